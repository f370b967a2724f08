#include "server/http/http_server.h"

#include <pthread.h>

#include <array>
#include <atomic>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/status.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cctype>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <exception>
#include <future>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "engine/base/ascii.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace kiln::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using Strand = asio::strand<asio::io_context::executor_type>;
using error_code = boost::system::error_code;

constexpr uint32_t kHeaderLimit = 64 << 10;            // bytes of request line + header fields
constexpr size_t kReadChunk = 16 << 10;                // bytes per socket read
constexpr size_t kMaxPipelinedBytes = 1 << 20;         // buffered while a response is pending
constexpr size_t kMaxWriteBatch = 64;                  // strings gathered into one write
constexpr auto kLingerTime = std::chrono::seconds(2);  // drain after closing our side
constexpr size_t kMaxTlsGather = 64 << 10;             // bytes copied to gather a TLS write

std::string JsonError(std::string_view message) {
  return nlohmann::json{{"error", message}}.dump();
}

Response ErrorResponse(int status, std::string_view message) {
  Response r;
  r.status = status;
  r.body = JsonError(message);
  return r;
}

// RFC 9110 IMF-fixdate, e.g. "Sun, 06 Nov 1994 08:49:37 GMT".
std::string HttpDate() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  size_t n = std::strftime(buf, sizeof(buf), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return std::string(buf, n);
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Splits a request target into a decoded path and the raw query. Returns false (with
// `error`) for targets a server must reject.
bool ParseTarget(std::string_view target, std::string& path, std::string& query,
                 std::string& error) {
  if (target == "*") {
    path = "*";
    return true;
  }
  // absolute-form ("http://host/x"), which proxies send: keep the path.
  for (std::string_view scheme : {"http://", "https://"}) {
    if (target.size() >= scheme.size() &&
        EqualsIgnoreCase(target.substr(0, scheme.size()), scheme)) {
      size_t slash = target.find('/', scheme.size());
      target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
      break;
    }
  }
  if (target.empty() || target[0] != '/') {
    error = "request target must start with '/'";
    return false;
  }
  size_t q = target.find('?');
  std::string_view raw = target.substr(0, q);
  if (q != std::string_view::npos) query = std::string(target.substr(q + 1));
  path.clear();
  path.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '%') {
      path += raw[i];
      continue;
    }
    int hi = i + 2 < raw.size() ? HexValue(raw[i + 1]) : -1;
    int lo = i + 2 < raw.size() ? HexValue(raw[i + 2]) : -1;
    if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) {
      error = "invalid percent-encoding in the request path";
      return false;
    }
    path += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return true;
}

bool IsTokenChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) ||
         std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

bool ValidHeader(std::string_view name, std::string_view value) {
  if (name.empty()) return false;
  for (char c : name) {
    if (!IsTokenChar(c)) return false;
  }
  for (char c : value) {
    if (c == '\r' || c == '\n' || c == '\0') return false;
  }
  return true;
}

std::string FormatEndpoint(const tcp::endpoint& ep) {
  const auto addr = ep.address();
  std::string host = addr.to_string();
  if (addr.is_v6()) host = "[" + host + "]";
  return host + ":" + std::to_string(ep.port());
}

// "Address already in use" -> "address already in use" (messages are embedded mid-sentence).
std::string LowerFirst(std::string s) {
  if (!s.empty()) s[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(s[0])));
  return s;
}

}  // namespace

std::optional<std::string> Request::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (EqualsIgnoreCase(k, name)) return v;
  }
  return std::nullopt;
}

namespace {
class Connection;
}  // namespace

// ---- Core: what the Server, its connections and its responders share -------------------------

class Server::Core : public std::enable_shared_from_this<Server::Core> {
 public:
  Core(ServerOptions options, Handler handler)
      : options(std::move(options)),
        handler(std::move(handler)),
        ioc(std::max(1, this->options.threads)),
        accept_strand(asio::make_strand(ioc)),
        acceptor(accept_strand),
        accept_retry(accept_strand) {}

  const ServerOptions options;
  const Handler handler;
  asio::io_context ioc;
  Strand accept_strand;
  tcp::acceptor acceptor;           // on accept_strand
  asio::steady_timer accept_retry;  // on accept_strand
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;
  std::atomic<int> port{0};
  std::atomic<int> cut{0};
  bool started = false;    // Start/Shutdown only
  bool shut_down = false;  // Start/Shutdown only

  // Posts `fn` to `strand` unless the server has shut down (its threads are gone: a queued
  // handler would never run and would keep its connection alive). Returns whether posted.
  template <typename Fn>
  bool Post(const Strand& strand, Fn&& fn) {
    std::shared_lock<std::shared_mutex> lock(post_mu_);
    if (posts_closed_) return false;
    asio::post(strand, std::forward<Fn>(fn));
    return true;
  }
  void ClosePosts() {
    std::unique_lock<std::shared_mutex> lock(post_mu_);
    posts_closed_ = true;
  }

  // Connection registry (for Shutdown). Register fails once the server is stopping.
  bool Register(uint64_t id, const std::shared_ptr<Connection>& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    connections_.emplace(id, c);
    return true;
  }
  void Unregister(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    connections_.erase(id);
    if (connections_.empty()) no_connections_.notify_all();
  }
  // Marks the server stopping and returns the live connections.
  std::vector<std::shared_ptr<Connection>> StopAndList() {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    return ListLocked();
  }
  std::vector<std::shared_ptr<Connection>> List() {
    std::lock_guard<std::mutex> lock(mu_);
    return ListLocked();
  }
  // Waits until no connection is left or `deadline` passes; returns whether none is left.
  bool WaitNoConnections(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return no_connections_.wait_until(lock, deadline, [this] { return connections_.empty(); });
  }

  void DoAccept();
  void OnAccept(const error_code& ec, const Strand& strand, tcp::socket socket);

 private:
  std::vector<std::shared_ptr<Connection>> ListLocked() {  // REQUIRES: mu_ held
    std::vector<std::shared_ptr<Connection>> out;
    for (auto& [id, weak] : connections_) {
      if (auto c = weak.lock()) out.push_back(std::move(c));
    }
    return out;
  }

  // std::mutex rather than absl::Mutex: Debian's Abseil is not built for ThreadSanitizer,
  // which then cannot see absl::Mutex and reports every access it guards as a race.
  std::mutex mu_;
  std::condition_variable no_connections_;                     // signalled under mu_
  std::map<uint64_t, std::weak_ptr<Connection>> connections_;  // guarded by mu_
  bool stopping_ = false;                                      // guarded by mu_
  uint64_t next_id_ = 0;                                       // accept_strand only
  std::shared_mutex post_mu_;
  bool posts_closed_ = false;  // guarded by post_mu_
};

using Core = Server::Core;

namespace {

// ---- Transport: the byte stream under a connection, plain TCP or TLS over TCP --------------

// One Connection serves both: the few operations it needs go through here, which picks the
// plain socket or the TLS stream at run time. Confined to the connection's strand.
class Transport {
 public:
  explicit Transport(tcp::socket socket) : plain_(std::move(socket)) {}
  // `context` is kept alive with the stream: a reload may drop the server's reference to it.
  Transport(tcp::socket socket, std::shared_ptr<asio::ssl::context> context)
      : context_(std::move(context)) {
    tls_.emplace(std::move(socket), *context_);
  }

  bool tls() const { return tls_.has_value(); }
  tcp::socket& socket() { return tls_ ? tls_->next_layer() : *plain_; }

  // REQUIRES: tls().
  template <typename Handler>
  void AsyncHandshake(Handler handler) {
    tls_->async_handshake(asio::ssl::stream_base::server, std::move(handler));
  }
  // Sends close_notify and waits for the client's (or an error, e.g. the client just closing
  // TCP, which is what most do). REQUIRES: tls(), no read outstanding.
  template <typename Handler>
  void AsyncShutdown(Handler handler) {
    tls_->async_shutdown(std::move(handler));
  }

  template <typename Handler>
  void AsyncReadSome(asio::mutable_buffer buffer, Handler handler) {
    if (tls_) {
      tls_->async_read_some(buffer, std::move(handler));
    } else {
      plain_->async_read_some(buffer, std::move(handler));
    }
  }

  // REQUIRES: `buffers` stay valid until `handler` runs.
  template <typename Handler>
  void AsyncWrite(const std::vector<asio::const_buffer>& buffers, Handler handler) {
    if (!tls_) {
      asio::async_write(*plain_, buffers, std::move(handler));
      return;
    }
    // A TLS stream encrypts one buffer per record: gather small ones first, so that a response
    // header and body (or a batch of stream chunks) leave as one record, not several.
    size_t total = 0;
    for (const auto& b : buffers) total += b.size();
    if (buffers.size() == 1 || total > kMaxTlsGather) {
      asio::async_write(*tls_, buffers, std::move(handler));
      return;
    }
    joined_.clear();
    for (const auto& b : buffers) joined_.append(static_cast<const char*>(b.data()), b.size());
    asio::async_write(*tls_, asio::buffer(joined_), std::move(handler));
  }

 private:
  std::shared_ptr<asio::ssl::context> context_;
  std::optional<tcp::socket> plain_;
  std::optional<asio::ssl::stream<tcp::socket>> tls_;
  std::string joined_;  // the gathered buffers of the write in progress (TLS)
};

// ---- Connection: one client socket; every member is confined to `strand_` --------------------

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(std::shared_ptr<Core> core, Strand strand, Transport transport, uint64_t id)
      : core_(std::move(core)),
        strand_(std::move(strand)),
        transport_(std::move(transport)),
        read_timer_(strand_),
        write_timer_(strand_),
        id_(id) {}

  const Strand& strand() const { return strand_; }
  Core& core() { return *core_; }
  uint64_t id() const { return id_; }

  void Start() {
    if (phase_ == Phase::kClosed) return;  // aborted before it started
    error_code ec;
    tcp::socket& socket = transport_.socket();
    socket.set_option(tcp::no_delay(true), ec);  // streamed tokens must not wait for Nagle
    auto ep = socket.remote_endpoint(ec);
    remote_ = ec ? std::string("unknown") : FormatEndpoint(ep);
    if (transport_.tls()) {
      if (stopping_) {
        Close();
        return;
      }
      phase_ = Phase::kHandshaking;
      ArmReadTimer(std::chrono::seconds(core_->options.idle_timeout_seconds));
      transport_.AsyncHandshake(
          [self = shared_from_this()](const error_code& ec) { self->OnHandshake(ec); });
      return;
    }
    StartReading();
  }

  void OnHandshake(const error_code& ec) {
    if (phase_ == Phase::kClosed) return;  // timed out, or the server is shutting down
    if (ec) {
      // Plain HTTP to a TLS port, a client that does not trust us, no client certificate...
      spdlog::debug("{}: {}: TLS handshake failed: {}", core_->options.name, remote_, ec.message());
      Close();
      return;
    }
    StartReading();
  }

  void StartReading() {
    NewRequest();
    if (stopping_) {
      Close();
      return;
    }
    Pump();
  }

  // Server shutdown, phase 1: close if idle; otherwise close after the current response.
  void OnStopping() {
    stopping_ = true;
    if (phase_ == Phase::kHandshaking) Close();
    if (phase_ == Phase::kReading && parser_ && in_.size() == 0 && !parser_->got_some()) Close();
  }
  // Server shutdown, phase 2 (deadline passed): cut whatever is running.
  void Abort() {
    if (phase_ == Phase::kClosed) return;
    if (pending_ && !pending_->response_done) core_->cut.fetch_add(1);
    Close();
  }

  // ---- Responder operations, posted by Exchange. `seq` names the request they belong to. --
  void DoSend(uint64_t seq, Response r);
  void DoStartStream(uint64_t seq, int status, std::string content_type, Headers headers);
  void DoWrite(uint64_t seq, std::string chunk);
  void DoFinish(uint64_t seq);
  void DoAbandon(uint64_t seq, bool was_streaming);
  void DoSetOnGone(uint64_t seq, std::function<void()> fn);

 private:
  enum class Phase {
    kHandshaking,  // TLS handshake in progress
    kReading,      // parsing a request (or waiting for one)
    kHandling,     // a request is with the handler / its response is being written
    kLingering,    // our side is done; draining the client's data before closing
    kClosed,
  };
  // The request being answered.
  struct Pending {
    uint64_t seq = 0;
    std::shared_ptr<std::atomic<bool>> gone;  // shared with the Exchange
    std::function<void()> on_gone;
    bool gone_signalled = false;
    bool head = false;
    bool keep_alive = true;
    bool http10 = false;
    bool chunked = false;        // streaming with chunked framing
    bool response_done = false;  // everything of the response is queued
  };

  bool Current(uint64_t seq) const {
    return phase_ != Phase::kClosed && pending_ && pending_->seq == seq;
  }

  void NewRequest() {
    parser_.emplace();
    parser_->header_limit(kHeaderLimit);
    parser_->body_limit(static_cast<uint64_t>(core_->options.max_body_bytes));
    parser_->eager(true);
    header_checked_ = false;
    phase_ = Phase::kReading;
    ArmReadTimer(std::chrono::seconds(core_->options.idle_timeout_seconds));
  }

  // Parses what is buffered (if reading a request) and keeps one read outstanding when one
  // is wanted: to read requests, to notice a client that leaves while its response is
  // pending, and to drain while lingering.
  void Pump() {
    if (phase_ == Phase::kReading) Parse();
    MaybeRead();
  }

  void MaybeRead() {
    if (reading_ || phase_ == Phase::kClosed || phase_ == Phase::kHandshaking || peer_eof_ ||
        shutting_down_tls_) {
      return;
    }
    if (phase_ == Phase::kHandling && in_.size() >= kMaxPipelinedBytes) return;
    reading_ = true;
    transport_.AsyncReadSome(
        asio::buffer(read_buf_),
        [self = shared_from_this()](const error_code& ec, size_t n) { self->OnRead(ec, n); });
  }

  void OnRead(const error_code& ec, size_t n) {
    reading_ = false;
    if (phase_ == Phase::kClosed) return;
    if (shutting_down_tls_) {  // the read LingerTls cancelled (or data to discard)
      ShutdownTls();
      return;
    }
    if (ec) {
      if (phase_ == Phase::kHandling && ec == asio::error::eof) {
        // The client shut down its side. It may still read (a half-close), so a response
        // that comes is still written, but the work is told to stop, as in nginx and Go.
        peer_eof_ = true;
        pending_->keep_alive = false;
        SignalGone();
        return;
      }
      if (phase_ == Phase::kHandling) SignalGone();
      Close();
      return;
    }
    if (phase_ == Phase::kLingering) {
      MaybeRead();  // discard
      return;
    }
    auto dst = in_.prepare(n);
    std::memcpy(dst.data(), read_buf_.data(), n);
    in_.commit(n);
    if (phase_ == Phase::kReading) {
      ArmReadTimer(std::chrono::seconds(core_->options.idle_timeout_seconds));
    }
    Pump();
  }

  void Parse() {
    while (phase_ == Phase::kReading && in_.size() > 0) {
      error_code ec;
      size_t n = parser_->put(in_.data(), ec);
      in_.consume(n);
      if (ec == bhttp::error::need_more) ec = {};
      if (ec) {
        Reject(ec);
        return;
      }
      if (parser_->is_header_done() && !header_checked_) {
        header_checked_ = true;
        if (!CheckHeader()) return;
      }
      if (parser_->is_done()) {
        Dispatch();
        return;
      }
      if (n == 0) return;  // need more bytes
    }
  }

  // Runs once per request when its header is complete. Returns false if it rejected it.
  bool CheckHeader() {
    const auto& msg = parser_->get();
    if (msg.version() != 10 && msg.version() != 11) {
      RejectWith(505, "HTTP version not supported (only HTTP/1.0 and HTTP/1.1)");
      return false;
    }
    // A Transfer-Encoding other than chunked leaves the body length unknown; reading on
    // would misframe the next request (request smuggling).
    if (msg.find(bhttp::field::transfer_encoding) != msg.end() && !parser_->chunked()) {
      RejectWith(501, "unsupported Transfer-Encoding (only chunked is accepted)");
      return false;
    }
    auto expect = msg.find(bhttp::field::expect);
    if (expect != msg.end() && !parser_->is_done()) {
      if (!EqualsIgnoreCase(std::string_view(expect->value().data(), expect->value().size()),
                            "100-continue")) {
        RejectWith(417, "unsupported Expect header (only 100-continue is accepted)");
        return false;
      }
      if (msg.version() == 11) {
        Queue("HTTP/1.1 100 Continue\r\n\r\n");
        StartWrite();
      }
    }
    return true;
  }

  void Reject(const error_code& ec) {
    if (ec == bhttp::error::body_limit) {
      const auto& msg = parser_->get();
      auto cl = msg.find(bhttp::field::content_length);
      std::string limit = std::to_string(core_->options.max_body_bytes);
      std::string what = cl != msg.end()
                             ? "request body of " +
                                   std::string(cl->value().data(), cl->value().size()) +
                                   " bytes exceeds the limit of " + limit + " bytes"
                             : "chunked request body exceeds the limit of " + limit + " bytes";
      RejectWith(413, what + " (server.http.max_body_bytes)");
    } else if (ec == bhttp::error::header_limit) {
      RejectWith(431, "request header fields exceed " + std::to_string(kHeaderLimit) + " bytes");
    } else {
      RejectWith(400, "malformed HTTP request: " + ec.message());
    }
  }

  // Answers an unacceptable request with a JSON error and closes the connection once it is
  // written. Nothing more is parsed: the rest of what the client sends is discarded.
  void RejectWith(int status, const std::string& message) {
    spdlog::debug("{}: {} {}: {}", core_->options.name, remote_, status, message);
    Response r = ErrorResponse(status, message);
    Queue(Head(r.status, r.content_type, r.headers, r.body.size(), /*chunked=*/false,
               /*keep_alive=*/false, /*http10=*/false));
    Queue(std::move(r.body));
    phase_ = Phase::kLingering;
    closing_ = true;
    DisarmReadTimer();
    AfterQueue();
  }

  void Dispatch() {
    auto& msg = parser_->get();
    Request req;
    std::string error;
    if (!ParseTarget(std::string_view(msg.target().data(), msg.target().size()), req.path,
                     req.query, error)) {
      RejectWith(400, error);
      return;
    }
    req.head = msg.method() == bhttp::verb::head;
    req.method = req.head ? std::string("GET")
                          : std::string(msg.method_string().data(), msg.method_string().size());
    req.headers.reserve(std::distance(msg.begin(), msg.end()));
    for (const auto& f : msg) {
      req.headers.emplace_back(std::string(f.name_string().data(), f.name_string().size()),
                               std::string(f.value().data(), f.value().size()));
    }
    req.body = std::move(msg.body());
    req.remote = remote_;

    pending_.emplace();
    pending_->seq = ++seq_;
    pending_->gone = std::make_shared<std::atomic<bool>>(false);
    pending_->head = req.head;
    pending_->keep_alive = parser_->keep_alive();
    pending_->http10 = msg.version() == 10;
    phase_ = Phase::kHandling;
    DisarmReadTimer();  // the handler may take as long as it needs

    auto responder = MakeResponder(pending_->seq, pending_->gone);
    try {
      core_->handler(std::move(req), std::move(responder));
    } catch (const std::exception& e) {
      // The responder was released while unwinding, so the client gets a 500.
      spdlog::error("{}: handler threw: {}", core_->options.name, e.what());
    } catch (...) {
      spdlog::error("{}: handler threw a non-std exception", core_->options.name);
    }
  }

  std::shared_ptr<Responder> MakeResponder(uint64_t seq, std::shared_ptr<std::atomic<bool>> gone);

  // The status line and header fields of a response.
  std::string Head(int status, const std::string& content_type, const Headers& extra,
                   std::optional<size_t> content_length, bool chunked, bool keep_alive,
                   bool http10) {
    std::string h;
    h.reserve(256);
    h += "HTTP/1.1 ";
    h += std::to_string(status);
    h += ' ';
    auto reason = bhttp::obsolete_reason(bhttp::int_to_status(status));
    if (bhttp::int_to_status(status) != bhttp::status::unknown)
      h.append(reason.data(), reason.size());
    h += "\r\nDate: ";
    h += HttpDate();
    h += "\r\n";
    const bool no_body = status == 204 || status == 304;
    bool extra_content_type = false;
    for (const auto& [k, v] : extra) {
      if (EqualsIgnoreCase(k, "Content-Length") || EqualsIgnoreCase(k, "Transfer-Encoding") ||
          EqualsIgnoreCase(k, "Connection") || !ValidHeader(k, v)) {
        spdlog::error(
            "{}: handler set header `{}`, which the server manages or which is invalid;"
            " dropped",
            core_->options.name, k);
        continue;
      }
      if (EqualsIgnoreCase(k, "Content-Type")) extra_content_type = true;
      h += k;
      h += ": ";
      h += v;
      h += "\r\n";
    }
    if (!no_body && !extra_content_type && !content_type.empty() &&
        ValidHeader("Content-Type", content_type)) {
      h += "Content-Type: ";
      h += content_type;
      h += "\r\n";
    }
    if (!no_body) {
      if (content_length) {
        h += "Content-Length: ";
        h += std::to_string(*content_length);
        h += "\r\n";
      } else if (chunked) {
        h += "Transfer-Encoding: chunked\r\n";
      }
    }
    if (!keep_alive) {
      h += "Connection: close\r\n";
    } else if (http10) {
      h += "Connection: keep-alive\r\n";
    }
    h += "\r\n";
    return h;
  }

  bool KeepAlive() const { return pending_->keep_alive && !stopping_ && !peer_eof_; }

  void Queue(std::string s) { out_.push_back(std::move(s)); }

  // Starts writing what is queued, or, if nothing is left to write, moves on.
  void AfterQueue() {
    if (writing_) return;
    if (out_.empty()) {
      OnDrained();
      return;
    }
    StartWrite();
  }

  void StartWrite() {
    if (writing_ || out_.empty() || phase_ == Phase::kClosed) return;
    writing_ = true;
    write_bufs_.clear();
    write_count_ = std::min(out_.size(), kMaxWriteBatch);
    for (size_t i = 0; i < write_count_; ++i) write_bufs_.push_back(asio::buffer(out_[i]));
    ArmWriteTimer();
    transport_.AsyncWrite(write_bufs_, [self = shared_from_this()](const error_code& ec, size_t) {
      self->OnWrite(ec);
    });
  }

  void OnWrite(const error_code& ec) {
    writing_ = false;
    DisarmWriteTimer();
    if (phase_ == Phase::kClosed) return;
    if (ec) {
      SignalGone();
      Close();
      return;
    }
    out_.erase(out_.begin(), out_.begin() + static_cast<std::ptrdiff_t>(write_count_));
    AfterQueue();
  }

  // Everything queued is written.
  void OnDrained() {
    if (closing_) {
      Linger();
      return;
    }
    if (!pending_ || !pending_->response_done) return;
    const bool keep = KeepAlive();
    pending_.reset();
    if (!keep) {
      Linger();
      return;
    }
    NewRequest();
    Pump();
  }

  // Graceful close: stop sending, then read (and drop) until the client closes or a short
  // time passes, so that a client still sending does not get a reset that destroys the
  // response it has not read yet.
  void Linger() {
    phase_ = Phase::kLingering;
    if (transport_.tls()) {
      LingerTls();
      return;
    }
    error_code ignored;
    transport_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    if (peer_eof_) {
      Close();
      return;
    }
    in_.clear();
    ArmReadTimer(kLingerTime);
    MaybeRead();
  }

  // TLS: send close_notify (the client's end of a close-delimited body), then wait for the
  // client's close_notify or its TCP close, for the linger time at most. The TLS shutdown reads
  // by itself, so a read still outstanding is cancelled first; OnRead then starts it.
  void LingerTls() {
    if (peer_eof_) {
      Close();
      return;
    }
    in_.clear();
    ArmReadTimer(kLingerTime);
    shutting_down_tls_ = true;
    if (reading_) {
      error_code ignored;
      transport_.socket().cancel(ignored);
      return;
    }
    ShutdownTls();
  }

  void ShutdownTls() {
    transport_.AsyncShutdown([self = shared_from_this()](const error_code&) { self->Close(); });
  }

  void SignalGone() {
    if (!pending_ || pending_->gone_signalled) return;
    pending_->gone_signalled = true;
    pending_->gone->store(true);
    if (auto fn = std::move(pending_->on_gone)) {
      pending_->on_gone = nullptr;
      RunUserCallback(fn);
    }
  }

  void RunUserCallback(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      spdlog::error("{}: OnClientGone callback threw: {}", core_->options.name, e.what());
    } catch (...) {
      spdlog::error("{}: OnClientGone callback threw", core_->options.name);
    }
  }

  void Close() {
    if (phase_ == Phase::kClosed) return;
    if (pending_ && !pending_->response_done) SignalGone();
    phase_ = Phase::kClosed;
    DisarmReadTimer();
    DisarmWriteTimer();
    error_code ignored;
    transport_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    transport_.socket().close(ignored);
    out_.clear();
    in_.clear();
    core_->Unregister(id_);
  }

  void ArmReadTimer(std::chrono::steady_clock::duration d) {
    const uint64_t gen = ++read_gen_;
    read_timer_.expires_after(d);
    read_timer_.async_wait([self = shared_from_this(), gen](const error_code& ec) {
      if (ec || gen != self->read_gen_) return;
      self->Close();  // idle, too slow a request, or done lingering
    });
  }
  void DisarmReadTimer() {
    ++read_gen_;
    read_timer_.cancel();
  }
  void ArmWriteTimer() {
    const uint64_t gen = ++write_gen_;
    write_timer_.expires_after(std::chrono::seconds(core_->options.idle_timeout_seconds));
    write_timer_.async_wait([self = shared_from_this(), gen](const error_code& ec) {
      if (ec || gen != self->write_gen_) return;
      spdlog::debug("{}: {}: client stopped reading; closing", self->core_->options.name,
                    self->remote_);
      self->Close();
    });
  }
  void DisarmWriteTimer() {
    ++write_gen_;
    write_timer_.cancel();
  }

  const std::shared_ptr<Core> core_;
  const Strand strand_;
  Transport transport_;
  asio::steady_timer read_timer_;
  asio::steady_timer write_timer_;
  const uint64_t id_;
  std::string remote_;

  Phase phase_ = Phase::kReading;
  bool stopping_ = false;           // server shutdown: close after the current response
  bool closing_ = false;            // close once the queue is written (after an error response)
  bool peer_eof_ = false;           // the client shut down its sending side
  bool shutting_down_tls_ = false;  // TLS close_notify sent or about to be: no more reads
  bool header_checked_ = false;
  uint64_t seq_ = 0;
  uint64_t read_gen_ = 0, write_gen_ = 0;

  std::array<char, kReadChunk> read_buf_;
  beast::flat_buffer in_;  // received, not yet parsed
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  bool reading_ = false;
  std::optional<Pending> pending_;

  std::deque<std::string> out_;  // queued for writing, in order
  std::vector<asio::const_buffer> write_bufs_;
  size_t write_count_ = 0;
  bool writing_ = false;
};

// ---- Exchange: the Responder for one request --------------------------------------------------

class Exchange final : public Responder {
 public:
  Exchange(std::shared_ptr<Connection> conn, uint64_t seq, std::shared_ptr<std::atomic<bool>> gone)
      : conn_(std::move(conn)), seq_(seq), gone_(std::move(gone)) {}

  ~Exchange() override {
    const int s = state_.load();
    if (s == kDone) return;
    Post([c = conn_, seq = seq_, streaming = s == kStreaming] { c->DoAbandon(seq, streaming); });
  }

  void Send(Response r) override {
    if (!Transition(kNew, kDone, "Send")) return;
    Post([c = conn_, seq = seq_, r = std::move(r)]() mutable { c->DoSend(seq, std::move(r)); });
  }

  void StartStream(int status, std::string content_type, Headers headers) override {
    if (!Transition(kNew, kStreaming, "StartStream")) return;
    Post([c = conn_, seq = seq_, status, ct = std::move(content_type),
          h = std::move(headers)]() mutable {
      c->DoStartStream(seq, status, std::move(ct), std::move(h));
    });
  }

  bool Write(std::string chunk) override {
    if (state_.load() != kStreaming) {
      spdlog::error("{}: Responder::Write called {}", conn_->core().options.name,
                    state_.load() == kNew ? "before StartStream" : "after Finish");
      return false;
    }
    if (gone_->load()) return false;
    return Post([c = conn_, seq = seq_, chunk = std::move(chunk)]() mutable {
      c->DoWrite(seq, std::move(chunk));
    });
  }

  void Finish() override {
    if (!Transition(kStreaming, kDone, "Finish")) return;
    Post([c = conn_, seq = seq_] { c->DoFinish(seq); });
  }

  bool ClientGone() const override { return gone_->load(); }

  void OnClientGone(std::function<void()> fn) override {
    if (!fn) return;
    auto shared = std::make_shared<std::function<void()>>(std::move(fn));
    if (!Post([c = conn_, seq = seq_, shared] { c->DoSetOnGone(seq, std::move(*shared)); }) &&
        gone_->load()) {
      (*shared)();  // the server has shut down: no I/O thread is left to run it
    }
  }

 private:
  enum State { kNew, kStreaming, kDone };

  bool Transition(int from, int to, const char* what) {
    int expected = from;
    if (state_.compare_exchange_strong(expected, to)) return true;
    spdlog::error("{}: Responder::{} called {}; ignored", conn_->core().options.name, what,
                  expected == kDone ? "after the response was completed" : "out of order");
    return false;
  }

  template <typename Fn>
  bool Post(Fn&& fn) {
    return conn_->core().Post(conn_->strand(), std::forward<Fn>(fn));
  }

  const std::shared_ptr<Connection> conn_;
  const uint64_t seq_;
  const std::shared_ptr<std::atomic<bool>> gone_;
  std::atomic<int> state_{kNew};
};

std::shared_ptr<Responder> Connection::MakeResponder(uint64_t seq,
                                                     std::shared_ptr<std::atomic<bool>> gone) {
  return std::make_shared<Exchange>(shared_from_this(), seq, std::move(gone));
}

void Connection::DoSend(uint64_t seq, Response r) {
  if (!Current(seq)) return;
  if (r.status < 200 || r.status > 599) {
    spdlog::error("{}: handler answered status {}, outside 200..599; sending 500 instead",
                  core_->options.name, r.status);
    r = ErrorResponse(500, "internal error: invalid response status");
  }
  const bool no_body = r.status == 204 || r.status == 304;
  Queue(Head(r.status, r.content_type, r.headers, r.body.size(), /*chunked=*/false, KeepAlive(),
             pending_->http10));
  if (!pending_->head && !no_body && !r.body.empty()) Queue(std::move(r.body));
  pending_->response_done = true;
  AfterQueue();
}

void Connection::DoStartStream(uint64_t seq, int status, std::string content_type,
                               Headers headers) {
  if (!Current(seq)) return;
  if (status < 200 || status > 599 || status == 204 || status == 304) {
    spdlog::error("{}: stream started with status {}; sending 500 instead", core_->options.name,
                  status);
    status = 500;
  }
  // HTTP/1.0 has no chunked encoding: the stream ends when the connection closes.
  pending_->chunked = !pending_->http10;
  if (pending_->http10) pending_->keep_alive = false;
  Queue(Head(status, content_type, headers, std::nullopt, pending_->chunked, KeepAlive(),
             pending_->http10));
  StartWrite();
}

void Connection::DoWrite(uint64_t seq, std::string chunk) {
  if (!Current(seq) || pending_->head || chunk.empty()) return;
  if (pending_->chunked) {
    char size[24];
    auto end = std::to_chars(size, size + sizeof(size), chunk.size(), 16).ptr;
    std::string framed;
    framed.reserve(chunk.size() + 32);
    framed.append(size, end);
    framed += "\r\n";
    framed += chunk;
    framed += "\r\n";
    Queue(std::move(framed));
  } else {
    Queue(std::move(chunk));
  }
  StartWrite();
}

void Connection::DoFinish(uint64_t seq) {
  if (!Current(seq)) return;
  if (pending_->chunked && !pending_->head) Queue("0\r\n\r\n");
  pending_->response_done = true;
  AfterQueue();
}

void Connection::DoAbandon(uint64_t seq, bool was_streaming) {
  if (!Current(seq)) return;
  if (pending_->gone_signalled) {
    // The client left and the work was dropped, as OnClientGone invites: nothing to answer.
    Close();
    return;
  }
  if (!was_streaming) {
    spdlog::error(
        "{}: a Responder was dropped without a response (programmer error); "
        "answering 500",
        core_->options.name);
    DoSend(seq, ErrorResponse(500, "internal error: the request was not answered"));
    return;
  }
  spdlog::error("{}: a stream was dropped without Finish() (programmer error); closing",
                core_->options.name);
  // No terminating chunk: the client must see a truncated stream, not a complete one.
  pending_->keep_alive = false;
  pending_->response_done = true;
  AfterQueue();
}

void Connection::DoSetOnGone(uint64_t seq, std::function<void()> fn) {
  if (!pending_ || pending_->seq != seq) return;  // completed: never gone
  if (pending_->gone_signalled) {
    RunUserCallback(fn);
  } else {
    pending_->on_gone = std::move(fn);
  }
}

}  // namespace

// ---- Accepting ----------------------------------------------------------------------------

void Core::DoAccept() {
  // Each connection gets its own strand; the socket is created on it.
  Strand strand = asio::make_strand(ioc);
  acceptor.async_accept(strand,
                        [self = shared_from_this(), strand](const error_code& ec, auto socket) {
                          self->OnAccept(ec, strand, tcp::socket(std::move(socket)));
                        });
}

void Core::OnAccept(const error_code& ec, const Strand& strand, tcp::socket socket) {
  if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
  if (ec) {
    // Out of descriptors or memory: back off instead of spinning; other errors are about
    // the one connection that failed.
    spdlog::warn("{}: accept failed: {}", options.name, ec.message());
    if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space ||
        ec == asio::error::no_memory) {
      accept_retry.expires_after(std::chrono::milliseconds(100));
      accept_retry.async_wait([self = shared_from_this()](const error_code& wait_ec) {
        if (!wait_ec && self->acceptor.is_open()) self->DoAccept();
      });
      return;
    }
    DoAccept();
    return;
  }
  const uint64_t id = ++next_id_;
  Transport transport = options.tls ? Transport(std::move(socket), options.tls->Current())
                                    : Transport(std::move(socket));
  auto conn = std::make_shared<Connection>(shared_from_this(), strand, std::move(transport), id);
  if (Register(id, conn)) {
    asio::dispatch(conn->strand(), [conn] { conn->Start(); });
  }
  DoAccept();
}

// ---- Server -------------------------------------------------------------------------------

Server::Server(ServerOptions options, Handler handler)
    : core_(std::make_shared<Core>(std::move(options), std::move(handler))) {
  KILN_CHECK(core_->handler != nullptr, "http::Server needs a handler");
}

Server::~Server() {
  if (core_->started && !core_->shut_down) Shutdown(std::chrono::steady_clock::now());
}

namespace {

// Parses "host:port" into endpoints to try; `error` says what is wrong with it.
bool ResolveAddress(asio::io_context& ioc, const std::string& address,
                    std::vector<tcp::endpoint>& out, std::string& error) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    error = "expected host:port";
    return false;
  }
  std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  int port = -1;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port < 0 || port > 65535) {
    error = "port must be a number in 0..65535";
    return false;
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    error = "IPv6 addresses must be in brackets, e.g. [::1]:8000";
    return false;
  }
  if (host.empty()) host = "0.0.0.0";
  error_code aec;
  auto addr = asio::ip::make_address(host, aec);
  if (!aec) {
    out.emplace_back(addr, static_cast<unsigned short>(port));
    return true;
  }
  if (host.find_first_not_of("0123456789.") == std::string::npos) {
    // getaddrinfo would read "1.2.3" as 1.2.0.3 (inet_aton); that is a typo, not a name.
    error = "`" + host + "` is not a valid IPv4 address";
    return false;
  }
  tcp::resolver resolver(ioc);
  auto results = resolver.resolve(host, port_text, tcp::resolver::passive, aec);
  if (aec || results.empty()) {
    error = "cannot resolve host `" + host + "`: " + LowerFirst(aec.message());
    return false;
  }
  for (const auto& r : results) out.push_back(r.endpoint());
  return true;
}

}  // namespace

Status Server::Start() {
  Core& c = *core_;
  KILN_CHECK(!c.started, "http::Server::Start called twice");
  const ServerOptions& o = c.options;
  if (o.threads < 1) {
    return InvalidArgument(o.name, ": threads is ", o.threads, " but must be at least 1");
  }
  if (o.max_body_bytes < 0) {
    return InvalidArgument(o.name, ": max_body_bytes is ", o.max_body_bytes, " but must be >= 0");
  }
  if (o.idle_timeout_seconds <= 0) {
    return InvalidArgument(o.name, ": idle_timeout_seconds is ", o.idle_timeout_seconds,
                           " but must be > 0");
  }
  std::vector<tcp::endpoint> endpoints;
  std::string error;
  if (!ResolveAddress(c.ioc, o.address, endpoints, error)) {
    return InvalidArgument(o.name, ": invalid listen address \"", o.address, "\": ", error);
  }
  // Try each resolved address (e.g. "localhost" may give ::1 and 127.0.0.1); first that binds.
  error_code ec;
  for (const tcp::endpoint& ep : endpoints) {
    error_code ignored;
    if (c.acceptor.is_open()) c.acceptor.close(ignored);
    c.acceptor.open(ep.protocol(), ec);
    if (!ec) c.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) c.acceptor.bind(ep, ec);
    if (!ec) c.acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (!ec) break;
  }
  if (ec) {
    error_code ignored;
    c.acceptor.close(ignored);
    return Unavailable(o.name, ": cannot listen on ", o.address, ": ", LowerFirst(ec.message()));
  }
  c.port = c.acceptor.local_endpoint(ec).port();
  c.started = true;
  c.work.emplace(c.ioc.get_executor());
  asio::dispatch(c.accept_strand, [core = core_] { core->DoAccept(); });
  for (int i = 0; i < o.threads; ++i) {
    c.threads.emplace_back([core = core_.get(), i] {
      std::string thread_name = (core->options.name + "-io" + std::to_string(i)).substr(0, 15);
      pthread_setname_np(pthread_self(), thread_name.c_str());
      for (;;) {
        try {
          core->ioc.run();
          return;
        } catch (const std::exception& e) {
          // A handler must not throw out of the I/O loop; keep serving the others.
          spdlog::error("{}: exception on an I/O thread: {}", core->options.name, e.what());
        }
      }
    });
  }
  spdlog::info("{}: listening on {} (port {})", o.name, o.address, c.port.load());
  return OkStatus();
}

int Server::port() const { return core_->port.load(); }

void Server::StopAccepting() {
  Core& c = *core_;
  if (!c.started || c.shut_down) return;
  auto done = std::make_shared<std::promise<void>>();
  auto future = done->get_future();
  const bool posted = c.Post(c.accept_strand, [core = core_, done] {
    error_code ignored;
    core->acceptor.close(ignored);
    core->accept_retry.cancel();
    done->set_value();
  });
  // Wait, so that the port is closed on return, unless we are on an I/O thread ourselves
  // (then the close runs once this handler returns).
  if (posted && !c.ioc.get_executor().running_in_this_thread()) future.wait();
}

int Server::Shutdown(std::chrono::steady_clock::time_point deadline) {
  Core& c = *core_;
  if (!c.started || c.shut_down) return 0;
  KILN_CHECK(!c.ioc.get_executor().running_in_this_thread(),
             "http::Server::Shutdown must not be called from an I/O thread (a handler)");
  StopAccepting();
  for (auto& conn : c.StopAndList()) c.Post(conn->strand(), [conn] { conn->OnStopping(); });
  if (!c.WaitNoConnections(deadline)) {
    for (auto& conn : c.List()) c.Post(conn->strand(), [conn] { conn->Abort(); });
    // Closing is prompt; the bound only guards against a handler stuck on an I/O thread.
    if (!c.WaitNoConnections(std::chrono::steady_clock::now() + std::chrono::seconds(5))) {
      spdlog::error("{}: connections did not close within 5 s of the shutdown deadline",
                    c.options.name);
    }
  }
  c.ClosePosts();
  c.work.reset();
  c.ioc.stop();
  for (auto& t : c.threads) t.join();
  c.threads.clear();
  // Run what was queued before posts closed (completions of the closed sockets), so that no
  // handler is left holding a connection.
  c.ioc.restart();
  c.ioc.poll();
  c.shut_down = true;
  const int cut = c.cut.load();
  spdlog::info("{}: shut down ({} request(s) cut off)", c.options.name, cut);
  return cut;
}

}  // namespace kiln::http
