// A generic asynchronous HTTP/1.1 server (Boost.Beast + Asio): the transport under Kiln's
// HTTP APIs (KServe v2 REST, /metrics, health, the OpenAI-compatible API with Server-Sent
// Events). It knows nothing about models: it parses requests, calls one Handler, and writes
// what the handler answers through a Responder, in order, per connection.
//
// Usage:
//   kiln::http::ServerOptions options;
//   options.address = "0.0.0.0:8000";
//   kiln::http::Server server(options, [&](kiln::http::Request req,
//                                           std::shared_ptr<kiln::http::Responder> r) {
//     if (req.path == "/healthz") {
//       kiln::http::Response ok;
//       ok.body = "{}";
//       return r->Send(std::move(ok));
//     }
//     queue.Push(std::move(req), std::move(r));  // long work: answer later, elsewhere
//   });
//   KILN_RETURN_IF_ERROR(server.Start());
//   ...
//   server.StopAccepting();
//   int cut = server.Shutdown(std::chrono::steady_clock::now() + std::chrono::seconds(30));
//
// Protocol behaviour:
// - HTTP/1.1 and 1.0; keep-alive; pipelined requests are answered strictly in order (the next
//   request on a connection is handled once the previous response is fully written).
// - Request bodies by Content-Length or `Transfer-Encoding: chunked`. A body larger than
//   `max_body_bytes` is answered 413 with a JSON error as soon as the header says so (or as
//   soon as chunked data passes the limit), without reading the rest; then the connection
//   closes. `Expect: 100-continue` is answered `100 Continue` only when the body is
//   acceptable.
// - Malformed requests: 400 (431 for a header block over 64 KiB, 505 for HTTP/2+ versions),
//   JSON error body, then the connection closes. Error bodies are `{"error": "..."}`.
// - HEAD is handled like GET (the handler sees method "GET" and `head == true`); the response
//   carries the GET's Content-Length but no body.
// - Idle keep-alive connections close after `idle_timeout_seconds`; the same limit applies to
//   each read of a request in progress and to each write (a client that stops reading).
// - Responses always carry `Date`, `Content-Length` (or chunked framing for streams) and
//   `Connection: close` when the connection will close.
// - TLS (`ServerOptions::tls` set): each connection first completes a TLS handshake (within
//   `idle_timeout_seconds`), with the context `tls->Current()` gave it when accepted, then
//   behaves as above. A failed handshake (e.g. plain HTTP sent to the port, no or a wrong client
//   certificate under mTLS) closes that connection, logged at debug level. Closing after a
//   response sends a TLS close_notify, bounded by the linger time.
//
// Threading: the handler runs on an I/O thread and MUST NOT block (no model execution, no
// waiting on locks held by slow work): hand the work off and answer through the Responder
// later, from any thread. All state of a connection lives on its Asio strand; Responder calls
// from other threads are posted to that strand, so they never race the I/O.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/base/status.h"
#include "server/tls/tls.h"

namespace kiln::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

// One parsed request, owned by the handler once delivered.
struct Request {
  std::string method;  // "GET", "POST", ... (a HEAD request reads "GET", see `head`)
  std::string path;    // percent-decoded path, without the query ("*" for OPTIONS *)
  std::string query;   // raw query string (after '?'), may be empty
  Headers headers;     // in arrival order, names as sent
  std::string body;
  std::string remote;  // "ip:port" of the peer ("[v6]:port" for IPv6)
  bool head = false;   // the request was HEAD: the response body will not be sent

  // The value of the first header named `name` (case-insensitive), if any.
  std::optional<std::string> Header(std::string_view name) const;
};

struct Response {
  int status = 200;  // 200..599 (anything else is a programmer error: logged, sent as 500)
  std::string content_type = "application/json";  // omitted when empty
  // Extra headers. Content-Length, Transfer-Encoding and Connection belong to the server and
  // are dropped (logged); a Content-Type here replaces `content_type`. Names and values with
  // CR or LF are dropped (logged).
  Headers headers;
  std::string body;
};

// The way back to the client for one request. Given to the handler as a shared_ptr; may be
// kept and used from any thread, after the handler returned. Thread-safe, but calls for one
// response must be made in order (e.g. from one thread at a time).
//
// Exactly one of Send() or StartStream()...Finish() must eventually be called. A Responder
// destroyed without a response makes the server answer 500 (a programmer error, logged); one
// destroyed after StartStream() without Finish() ends the connection, so the client sees a
// truncated stream. Calls out of order (Send twice, Write before StartStream) are
// programmer errors: logged and ignored.
class Responder {
 public:
  virtual ~Responder() = default;

  // Sends a complete response.
  virtual void Send(Response response) = 0;

  // Starts a streamed response: the header is sent at once, with chunked transfer-encoding
  // (HTTP/1.1) or close-delimited (HTTP/1.0). E.g. "text/event-stream" for SSE.
  virtual void StartStream(int status, std::string content_type, Headers headers) = 0;
  // Queues one piece of the stream; sent as soon as the connection can take it (chunks are
  // never held back until Finish). Empty chunks are ignored. Returns false once the client is
  // gone (stop producing then). The queue is not bounded: producers that can outrun the
  // network (not token streams) should watch ClientGone() or pace themselves.
  virtual bool Write(std::string chunk) = 0;
  // Ends the stream.
  virtual void Finish() = 0;

  // True once the client disconnected (or the server cut the request at shutdown).
  virtual bool ClientGone() const = 0;
  // `fn` is called once, from an I/O thread, when the client disconnects before the
  // response is completely written, or when Shutdown() cuts the request, so the caller can
  // cancel the work. Set it before starting the work; if the client is already gone, `fn`
  // runs promptly (inline if the server has already shut down). Not called when the
  // response completes. `fn` must not block.
  virtual void OnClientGone(std::function<void()> fn) = 0;
};

using Handler = std::function<void(Request, std::shared_ptr<Responder>)>;

struct ServerOptions {
  // "host:port"; host is an IPv4/IPv6 literal ("[::]" for IPv6), a name resolved once at
  // Start() (e.g. "localhost"), or empty for all IPv4 interfaces. Port 0 picks a free port.
  std::string address = "0.0.0.0:8000";
  int threads = 2;                    // I/O threads, >= 1
  int64_t max_body_bytes = 64 << 20;  // request body limit, >= 0
  int idle_timeout_seconds = 60;      // > 0
  std::string name = "http";          // prefix of log lines and Start() errors
  // TLS for every connection when set; plaintext when null. Shared: update it (e.g. on SIGHUP)
  // to change the certificate for new connections; open ones keep theirs.
  std::shared_ptr<tls::ServerContext> tls;
};

// The server. Start() once, then StopAccepting()/Shutdown() (or just destroy it: the
// destructor shuts down with no grace period). Thread-safe, except that Start() and
// Shutdown() must not race each other.
class Server {
 public:
  // REQUIRES: `handler` is callable.
  Server(ServerOptions options, Handler handler);
  // Shuts down at once if Shutdown() was not called (in-flight requests are cut).
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Validates the options, binds, listens and starts the I/O threads. Errors:
  // InvalidArgument for bad options or an address that does not parse or resolve;
  // Unavailable when it cannot listen, e.g.
  // "http: cannot listen on 0.0.0.0:8000: address already in use".
  // REQUIRES: not started before.
  Status Start();

  // The bound port (the real one when the address asked for port 0); 0 before Start().
  int port() const;

  // Closes the listener: new connections are refused; connections already open (and
  // their keep-alive requests) continue. Idempotent.
  void StopAccepting();

  // Stops accepting, closes idle connections, lets in-flight requests and streams finish
  // (their connections close after the response) until `deadline`, then closes every
  // connection (calling OnClientGone of what is still running) and joins the I/O threads.
  // Returns the number of requests cut off (dispatched, response not completely written).
  // Responders kept after this are inert: Write returns false, Send does nothing.
  // Idempotent (later calls return 0). REQUIRES: not called from an I/O thread (a handler).
  int Shutdown(std::chrono::steady_clock::time_point deadline);

  // Opaque internals (Asio objects), shared with connections and responders so that a
  // Responder kept past the Server's lifetime stays safe to call.
  class Core;

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace kiln::http
