#include "server/http/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <boost/asio/buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kiln::http {
namespace {

namespace bhttp = boost::beast::http;
using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;
using HttpResponse = bhttp::response<bhttp::string_body>;
using ::testing::HasSubstr;
using ::testing::StartsWith;

ServerOptions Options(std::string address, int threads = 2) {
  ServerOptions o;
  o.address = std::move(address);
  o.threads = threads;
  return o;
}

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// A deliberately plain client: a blocking POSIX socket, poll() for timeouts, and Beast's
// response parser fed by hand, so each test controls exactly what goes on the wire.
class RawClient {
 public:
  enum class Recv { kData, kEof, kTimeout, kError };

  explicit RawClient(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~RawClient() { Close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }

  bool Send(std::string_view data) {
    while (!data.empty()) {
      ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // Appends what arrives within `timeout` to `pending_`.
  Recv RecvSome(milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(timeout.count()));
    if (r == 0) return Recv::kTimeout;
    if (r < 0) return Recv::kError;
    char buf[65536];
    ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n == 0) return Recv::kEof;
    if (n < 0) return Recv::kError;  // e.g. connection reset
    pending_.append(buf, static_cast<size_t>(n));
    return Recv::kData;
  }

  // Reads one response (for HEAD, pass head = true: no body follows). On a timeout or a
  // connection closed too early, records a failure and returns nullopt.
  std::optional<HttpResponse> ReadResponse(bool head = false, milliseconds timeout = seconds(5)) {
    bhttp::response_parser<bhttp::string_body> p;
    p.eager(true);
    p.body_limit(1 << 30);
    if (head) p.skip(true);
    return ReadWith(p, timeout, nullptr);
  }

  // Like ReadResponse, calling `progress(body_so_far)` each time more of the body arrived.
  std::optional<HttpResponse> ReadResponseStreaming(
      const std::function<void(const HttpResponse&)>& progress, milliseconds timeout) {
    bhttp::response_parser<bhttp::string_body> p;
    p.eager(true);
    p.body_limit(1 << 30);
    return ReadWith(p, timeout, &progress);
  }

  // True if the server closes the connection within `timeout` (any data is skipped).
  bool WaitClosed(milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      Recv r = RecvSome(std::max(left, milliseconds(1)));
      if (r == Recv::kEof || r == Recv::kError) return true;
      if (r == Recv::kTimeout) return false;
    }
    return false;
  }

  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  // Closes with a TCP reset instead of a FIN.
  void Reset() {
    linger l{1, 0};
    setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    Close();
  }

  std::string pending_;  // received, not yet parsed

 private:
  std::optional<HttpResponse> ReadWith(bhttp::response_parser<bhttp::string_body>& p,
                                       milliseconds timeout,
                                       const std::function<void(const HttpResponse&)>* progress) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
      if (!pending_.empty()) {
        boost::system::error_code ec;
        size_t n = p.put(boost::asio::buffer(pending_), ec);
        pending_.erase(0, n);
        if (ec && ec != bhttp::error::need_more) {
          ADD_FAILURE() << "bad response: " << ec.message();
          return std::nullopt;
        }
        if (p.is_header_done() && progress != nullptr) (*progress)(p.get());
        if (p.is_done()) return p.release();
        if (n > 0 && !pending_.empty()) continue;
      }
      if (Clock::now() >= deadline) {
        ADD_FAILURE() << "timed out waiting for a response";
        return std::nullopt;
      }
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      Recv r = RecvSome(std::max(left, milliseconds(1)));
      if (r == Recv::kEof && p.got_some()) {
        boost::system::error_code ec;
        p.put_eof(ec);
        if (!ec && p.is_done()) return p.release();
      }
      if (r != Recv::kData) {
        ADD_FAILURE() << "connection ended before a complete response ("
                      << (r == Recv::kTimeout ? "timeout" : "closed") << ")";
        return std::nullopt;
      }
    }
  }

  int fd_ = -1;
  bool connected_ = false;
};

std::string Get(std::string_view target, std::string_view extra_headers = "") {
  return std::string("GET ") + std::string(target) + " HTTP/1.1\r\nHost: t\r\n" +
         std::string(extra_headers) + "\r\n";
}

std::string Post(std::string_view target, std::string_view body) {
  return std::string("POST ") + std::string(target) +
         " HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + std::string(body);
}

// Answers with what it saw, as JSON.
void Echo(Request req, std::shared_ptr<Responder> r) {
  Response resp;
  resp.body = nlohmann::json{
      {"method", req.method},
      {"path", req.path},
      {"query", req.query},
      {"body", req.body},
      {"x_test", req.Header("x-TEST").value_or("")},
      {"remote", req.remote},
      {"head",
       req.head}}.dump();
  r->Send(std::move(resp));
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(Handler handler, ServerOptions options = {}) {
    options.address = "127.0.0.1:0";
    server_ = std::make_unique<Server>(options, std::move(handler));
    Status s = server_->Start();
    ASSERT_TRUE(s.ok()) << s;
    port_ = server_->port();
    ASSERT_GT(port_, 0);
  }

  // Runs `fn` on a background thread, joined at the end of the test.
  void Later(std::function<void()> fn) { threads_.emplace_back(std::move(fn)); }

  void TearDown() override {
    if (server_) server_->Shutdown(Clock::now() + seconds(2));
    for (auto& t : threads_) t.join();
    server_.reset();
  }

  std::unique_ptr<Server> server_;
  int port_ = 0;
  std::vector<std::thread> threads_;
};

TEST_F(HttpServerTest, GetAndPostEcho) {
  StartServer(Echo);
  RawClient c(port_);
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send(Get("/v2/models/a%20b/ready?x=1&y=%20", "X-Test: hello\r\n")));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 200);
  EXPECT_EQ((*res)[bhttp::field::content_type], "application/json");
  EXPECT_FALSE((*res)[bhttp::field::date].empty());
  auto j = nlohmann::json::parse(res->body());
  EXPECT_EQ(j["method"], "GET");
  EXPECT_EQ(j["path"], "/v2/models/a b/ready");
  EXPECT_EQ(j["query"], "x=1&y=%20");
  EXPECT_EQ(j["x_test"], "hello");
  EXPECT_THAT(j["remote"].get<std::string>(), StartsWith("127.0.0.1:"));

  ASSERT_TRUE(c.Send(Post("/infer", "{\"inputs\": [1, 2, 3]}")));
  res = c.ReadResponse();
  ASSERT_TRUE(res);
  j = nlohmann::json::parse(res->body());
  EXPECT_EQ(j["method"], "POST");
  EXPECT_EQ(j["path"], "/infer");
  EXPECT_EQ(j["body"], "{\"inputs\": [1, 2, 3]}");
  EXPECT_EQ(j["x_test"], "");
}

TEST_F(HttpServerTest, KeepAliveHundredSequentialRequests) {
  std::mutex mu;
  std::set<std::string> remotes;
  StartServer([&](Request req, std::shared_ptr<Responder> r) {
    {
      std::lock_guard<std::mutex> lock(mu);
      remotes.insert(req.remote);
    }
    Response resp;
    resp.content_type = "text/plain";
    resp.body = req.query;
    r->Send(std::move(resp));
  });
  RawClient c(port_);
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(c.Send(Get("/n?" + std::to_string(i)))) << i;
    auto res = c.ReadResponse();
    ASSERT_TRUE(res) << i;
    EXPECT_EQ(res->body(), std::to_string(i));
    EXPECT_TRUE(res->keep_alive()) << i;
  }
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(remotes.size(), 1u) << "requests did not share one connection";
}

TEST_F(HttpServerTest, PipelinedRequestsAreAnsweredInOrder) {
  StartServer([&](Request req, std::shared_ptr<Responder> r) {
    if (req.path == "/slow") {
      Later([r] {
        std::this_thread::sleep_for(milliseconds(100));
        Response resp;
        resp.body = "slow";
        r->Send(std::move(resp));
      });
      return;
    }
    Response resp;
    resp.body = req.path.substr(1);
    r->Send(std::move(resp));
  });
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/slow") + Post("/fast", "x") + Get("/third")));
  for (const char* want : {"slow", "fast", "third"}) {
    auto res = c.ReadResponse();
    ASSERT_TRUE(res);
    EXPECT_EQ(res->body(), want);
  }
}

TEST_F(HttpServerTest, OversizeBodyIs413WithoutReadingIt) {
  std::atomic<int> calls{0};
  ServerOptions o;
  o.max_body_bytes = 1024;
  StartServer(
      [&](Request req, std::shared_ptr<Responder> r) {
        calls++;
        Echo(std::move(req), std::move(r));
      },
      o);
  RawClient c(port_);
  // Only the header and a few bytes are sent: the answer must come without the body.
  ASSERT_TRUE(
      c.Send("POST /infer HTTP/1.1\r\nHost: t\r\nContent-Length: 10485760\r\n\r\n0123456789"));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 413);
  EXPECT_EQ(res->body(),
            "{\"error\":\"request body of 10485760 bytes exceeds the limit of 1024 bytes "
            "(server.http.max_body_bytes)\"}");
  EXPECT_FALSE(res->keep_alive());
  EXPECT_TRUE(c.WaitClosed(seconds(5)));
  EXPECT_EQ(calls.load(), 0);

  // A body exactly at the limit is fine.
  RawClient ok(port_);
  ASSERT_TRUE(ok.Send(Post("/infer", std::string(1024, 'a'))));
  res = ok.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 200);
  EXPECT_EQ(calls.load(), 1);

  // A chunked body is cut as soon as it passes the limit.
  RawClient chunked(port_);
  ASSERT_TRUE(
      chunked.Send("POST /infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                   "400\r\n" +
                   std::string(1024, 'b') + "\r\n10\r\n0123456789abcdef\r\n"));
  res = chunked.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 413);
  EXPECT_THAT(res->body(), HasSubstr("chunked request body exceeds the limit of 1024 bytes"));
  EXPECT_EQ(calls.load(), 1);
}

TEST_F(HttpServerTest, MalformedRequestIs400AndCloses) {
  std::atomic<int> calls{0};
  StartServer([&](Request req, std::shared_ptr<Responder> r) {
    calls++;
    Echo(std::move(req), std::move(r));
  });
  for (std::string garbage :
       {std::string("GARBAGE\r\n\r\n"), std::string("GET / HTTP/1.1\r\nBad Header\r\n\r\n"),
        std::string("GET /%zz HTTP/1.1\r\nHost: t\r\n\r\n"),
        std::string("POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")}) {
    RawClient c(port_);
    ASSERT_TRUE(c.Send(garbage));
    auto res = c.ReadResponse();
    ASSERT_TRUE(res) << garbage;
    EXPECT_EQ(res->result_int(), 400) << garbage;
    EXPECT_THAT(res->body(), StartsWith("{\"error\":")) << garbage;
    EXPECT_TRUE(c.WaitClosed(seconds(5))) << garbage;
  }
  EXPECT_EQ(calls.load(), 0);
}

TEST_F(HttpServerTest, UnsupportedTransferEncodingIsRejected) {
  StartServer(Echo);
  RawClient c(port_);
  ASSERT_TRUE(c.Send("POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\nxxxx"));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 501);
  EXPECT_TRUE(c.WaitClosed(seconds(5)));
}

TEST_F(HttpServerTest, ChunkedRequestBody) {
  StartServer(Echo);
  RawClient c(port_);
  ASSERT_TRUE(c.Send("POST /chunks HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"));
  ASSERT_TRUE(c.Send("7\r\nhello, \r\n"));
  std::this_thread::sleep_for(milliseconds(20));
  ASSERT_TRUE(c.Send("8\r\nchunked \r\n"));
  std::this_thread::sleep_for(milliseconds(20));
  ASSERT_TRUE(c.Send("5;ext=1\r\nworld\r\n0\r\n\r\n"));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  auto j = nlohmann::json::parse(res->body());
  EXPECT_EQ(j["body"], "hello, chunked world");
  // The connection is still usable afterwards.
  ASSERT_TRUE(c.Send(Get("/after")));
  res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(nlohmann::json::parse(res->body())["path"], "/after");
}

TEST_F(HttpServerTest, ExpectContinue) {
  ServerOptions o;
  o.max_body_bytes = 100;
  StartServer(Echo, o);
  RawClient c(port_);
  ASSERT_TRUE(
      c.Send("POST /up HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"));
  auto interim = c.ReadResponse();
  ASSERT_TRUE(interim);
  EXPECT_EQ(interim->result_int(), 100);
  ASSERT_TRUE(c.Send("hello"));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 200);
  EXPECT_EQ(nlohmann::json::parse(res->body())["body"], "hello");

  // Too large: a final 413 instead of 100 Continue.
  RawClient big(port_);
  ASSERT_TRUE(big.Send(
      "POST /up HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 500\r\n\r\n"));
  res = big.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 413);
}

TEST_F(HttpServerTest, HeadIsGetWithoutBody) {
  StartServer(Echo);
  RawClient c(port_);
  ASSERT_TRUE(c.Send("HEAD /thing HTTP/1.1\r\nHost: t\r\n\r\n"));
  auto res = c.ReadResponse(/*head=*/true);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 200);
  // The GET's length is announced, but no body follows: the next response parses cleanly.
  const std::string announced((*res)[bhttp::field::content_length]);
  ASSERT_TRUE(c.Send(Get("/thing")));
  auto get = c.ReadResponse();
  ASSERT_TRUE(get);
  auto j = nlohmann::json::parse(get->body());
  EXPECT_EQ(j["method"], "GET");
  EXPECT_EQ(j["head"], false);
  // Same handler output except `head`, which is one character longer as "false".
  EXPECT_EQ(std::stoul(announced) + 1, get->body().size());
}

TEST_F(HttpServerTest, AsyncSendFromAnotherThread) {
  StartServer([&](Request req, std::shared_ptr<Responder> r) {
    Later([r, body = req.body] {
      std::this_thread::sleep_for(milliseconds(50));
      Response resp;
      resp.status = 201;
      resp.headers.emplace_back("X-Worker", "yes");
      resp.body = "done:" + body;
      r->Send(std::move(resp));
    });
  });
  RawClient c(port_);
  auto start = Clock::now();
  ASSERT_TRUE(c.Send(Post("/work", "abc")));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_GE(MsSince(start), 45);
  EXPECT_EQ(res->result_int(), 201);
  EXPECT_EQ((*res)["X-Worker"], "yes");
  EXPECT_EQ(res->body(), "done:abc");
}

TEST_F(HttpServerTest, StreamingChunksArriveAsWritten) {
  // The writer sends chunk i only after the client has seen chunk i-1: if the server held
  // chunks back (until Finish or a buffer filled), the client would time out.
  std::mutex mu;
  std::condition_variable cv;
  int seen = 0;
  std::atomic<bool> writer_timed_out{false};
  StartServer([&](Request, std::shared_ptr<Responder> r) {
    r->StartStream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
    Later([&, r] {
      for (int i = 0; i < 5; ++i) {
        EXPECT_TRUE(r->Write("data: " + std::to_string(i) + "\n\n"));
        std::unique_lock<std::mutex> lock(mu);
        if (!cv.wait_for(lock, seconds(5), [&] { return seen > i; })) {
          writer_timed_out = true;
          break;
        }
      }
      r->Finish();
    });
  });
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/events")));
  auto res = c.ReadResponseStreaming(
      [&](const HttpResponse& partial) {
        int events = 0;
        for (size_t p = 0; (p = partial.body().find("\n\n", p)) != std::string::npos; p += 2) {
          ++events;
        }
        std::lock_guard<std::mutex> lock(mu);
        if (events > seen) {
          seen = events;
          cv.notify_all();
        }
      },
      seconds(10));
  ASSERT_TRUE(res);
  EXPECT_FALSE(writer_timed_out.load());
  EXPECT_EQ((*res)[bhttp::field::transfer_encoding], "chunked");
  EXPECT_EQ((*res)[bhttp::field::content_type], "text/event-stream");
  EXPECT_EQ((*res)["Cache-Control"], "no-cache");
  EXPECT_EQ(res->body(), "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n");
  EXPECT_TRUE(res->keep_alive());
}

TEST_F(HttpServerTest, ClientDisconnectTriggersOnClientGone) {
  for (bool reset : {false, true}) {
    std::promise<void> gone;
    auto gone_future = gone.get_future();
    std::promise<std::shared_ptr<Responder>> got;
    auto got_future = got.get_future();
    StartServer([&](Request, std::shared_ptr<Responder> r) {
      r->OnClientGone([&] { gone.set_value(); });
      r->StartStream(200, "text/event-stream", {});
      got.set_value(r);  // a "slow response": never finished by the handler
    });
    RawClient c(port_);
    ASSERT_TRUE(c.Send(Get("/slow")));
    ASSERT_EQ(got_future.wait_for(seconds(5)), std::future_status::ready);
    std::shared_ptr<Responder> r = got_future.get();
    EXPECT_FALSE(r->ClientGone());
    auto start = Clock::now();
    if (reset) {
      c.Reset();
    } else {
      c.Close();
    }
    ASSERT_EQ(gone_future.wait_for(seconds(1)), std::future_status::ready)
        << (reset ? "reset" : "close") << " not noticed within 1 s";
    EXPECT_LT(MsSince(start), 1000);
    EXPECT_TRUE(r->ClientGone());
    EXPECT_FALSE(r->Write("too late"));
    r->Finish();
    // Setting a callback after the fact still runs it.
    std::promise<void> late;
    r->OnClientGone([&] { late.set_value(); });
    EXPECT_EQ(late.get_future().wait_for(seconds(1)), std::future_status::ready);
    r.reset();
    EXPECT_EQ(server_->Shutdown(Clock::now() + seconds(2)), 0);
    server_.reset();
  }
}

TEST_F(HttpServerTest, DroppedResponderAnswers500) {
  StartServer([](Request, std::shared_ptr<Responder>) {});
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/")));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 500);
  EXPECT_THAT(res->body(), HasSubstr("not answered"));
}

TEST_F(HttpServerTest, ThrowingHandlerAnswers500AndServerLives) {
  StartServer([](Request req, std::shared_ptr<Responder> r) {
    if (req.path == "/throw") throw std::runtime_error("boom");
    Echo(std::move(req), std::move(r));
  });
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/throw")));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 500);
  ASSERT_TRUE(c.Send(Get("/fine")));
  res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 200);
}

TEST_F(HttpServerTest, ServerManagedHeadersAreNotDuplicated) {
  StartServer([](Request, std::shared_ptr<Responder> r) {
    Response resp;
    resp.headers = {{"Content-Length", "999"},
                    {"Connection", "close"},
                    {"X-Bad", "a\r\nInjected: yes"},
                    {"X-Good", "1"},
                    {"Content-Type", "text/csv"}};
    resp.body = "a,b";
    r->Send(std::move(resp));
  });
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/")));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ((*res)[bhttp::field::content_length], "3");
  EXPECT_EQ((*res)[bhttp::field::content_type], "text/csv");
  EXPECT_EQ(res->count(bhttp::field::content_type), 1u);
  EXPECT_EQ((*res)["X-Good"], "1");
  EXPECT_EQ(res->count("Injected"), 0u);
  EXPECT_EQ(res->count("X-Bad"), 0u);
  EXPECT_TRUE(res->keep_alive());
}

TEST_F(HttpServerTest, Http10) {
  StartServer(Echo);
  RawClient c(port_);
  ASSERT_TRUE(c.Send("GET /old HTTP/1.0\r\n\r\n"));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 200);
  EXPECT_TRUE(c.WaitClosed(seconds(5)));

  RawClient k(port_);
  ASSERT_TRUE(k.Send("GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
  res = k.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ((*res)[bhttp::field::connection], "keep-alive");
  ASSERT_TRUE(k.Send("GET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
  res = k.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(nlohmann::json::parse(res->body())["path"], "/b");
}

TEST_F(HttpServerTest, IdleKeepAliveConnectionsTimeOut) {
  ServerOptions o;
  o.idle_timeout_seconds = 1;
  StartServer(Echo, o);
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/")));
  ASSERT_TRUE(c.ReadResponse());
  auto start = Clock::now();
  EXPECT_TRUE(c.WaitClosed(seconds(5)));
  EXPECT_GE(MsSince(start), 800);
  EXPECT_LT(MsSince(start), 3000);
}

TEST(HttpServerStartTest, AddressInUse) {
  Server first(Options("127.0.0.1:0"), Echo);
  ASSERT_TRUE(first.Start().ok());
  const std::string address = "127.0.0.1:" + std::to_string(first.port());
  Server second(Options(address), Echo);
  Status s = second.Start();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(StatusMessage(s), "http: cannot listen on " + address + ": address already in use");
}

TEST(HttpServerStartTest, InvalidOptions) {
  for (const char* bad : {"nonsense", "127.0.0.1:99999", "127.0.0.1:x", "::1:80", "1.2.3:80"}) {
    Server s(Options(bad), Echo);
    Status st = s.Start();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad << ": " << st;
    EXPECT_THAT(std::string(StatusMessage(st)), HasSubstr("invalid listen address")) << bad;
  }
  Server threads(Options("127.0.0.1:0", /*threads=*/0), Echo);
  EXPECT_EQ(threads.Start().code(), StatusCode::kInvalidArgument);
  // Names resolve; IPv6 literals in brackets parse.
  Server local(Options("localhost:0"), Echo);
  EXPECT_TRUE(local.Start().ok());
}

TEST_F(HttpServerTest, StopAcceptingKeepsOpenConnections) {
  StartServer(Echo);
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/1")));
  ASSERT_TRUE(c.ReadResponse());
  server_->StopAccepting();
  RawClient refused(port_);
  EXPECT_FALSE(refused.connected());
  ASSERT_TRUE(c.Send(Get("/2")));
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->result_int(), 200);
}

TEST_F(HttpServerTest, ShutdownWaitsForInFlightResponse) {
  std::promise<void> called;
  StartServer([&](Request, std::shared_ptr<Responder> r) {
    called.set_value();
    Later([r] {
      std::this_thread::sleep_for(milliseconds(300));
      Response resp;
      resp.body = "finished";
      r->Send(std::move(resp));
    });
  });
  RawClient c(port_);
  RawClient idle(port_);  // an idle keep-alive connection must not hold shutdown up
  ASSERT_TRUE(c.Send(Get("/")));
  ASSERT_EQ(called.get_future().wait_for(seconds(5)), std::future_status::ready);
  auto start = Clock::now();
  int cut = -1;
  std::thread shutdown([&] { cut = server_->Shutdown(Clock::now() + seconds(10)); });
  auto res = c.ReadResponse();
  ASSERT_TRUE(res);
  EXPECT_EQ(res->body(), "finished");
  EXPECT_FALSE(res->keep_alive()) << "the last response should say Connection: close";
  c.Close();
  shutdown.join();
  EXPECT_EQ(cut, 0);
  EXPECT_GE(MsSince(start), 250);
  EXPECT_LT(MsSince(start), 5000);
  EXPECT_TRUE(idle.WaitClosed(seconds(1)));
}

TEST_F(HttpServerTest, ShutdownCutsUnfinishedStreamAtDeadline) {
  std::promise<void> streaming;
  std::atomic<bool> gone{false};
  std::shared_ptr<Responder> kept;
  StartServer([&](Request, std::shared_ptr<Responder> r) {
    r->OnClientGone([&] { gone = true; });
    r->StartStream(200, "text/event-stream", {});
    r->Write("data: first\n\n");
    kept = r;  // never finished
    streaming.set_value();
  });
  RawClient c(port_);
  ASSERT_TRUE(c.Send(Get("/stream")));
  ASSERT_EQ(streaming.get_future().wait_for(seconds(5)), std::future_status::ready);
  auto start = Clock::now();
  int cut = server_->Shutdown(Clock::now() + milliseconds(300));
  EXPECT_EQ(cut, 1);
  EXPECT_GE(MsSince(start), 290);
  EXPECT_LT(MsSince(start), 3000);
  EXPECT_TRUE(gone.load());
  EXPECT_TRUE(kept->ClientGone());
  EXPECT_FALSE(kept->Write("after shutdown"));
  // The client got the header and the first event, then the connection ended without the
  // terminating chunk.
  EXPECT_TRUE(c.WaitClosed(seconds(2)));
  EXPECT_THAT(c.pending_, HasSubstr("data: first"));
  EXPECT_EQ(c.pending_.find("0\r\n\r\n"), std::string::npos);
  EXPECT_EQ(server_->Shutdown(Clock::now()), 0) << "second Shutdown is a no-op";
  kept->Finish();   // inert after shutdown
  server_.reset();  // the responder outlives the server safely
  kept.reset();
}

TEST_F(HttpServerTest, SixtyFourConcurrentClients) {
  // Half the requests are answered inline, half from a worker thread.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<std::shared_ptr<Responder>, std::string>> queue;
  bool stop = false;
  std::thread worker([&] {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;
      auto [r, body] = std::move(queue.back());
      queue.pop_back();
      lock.unlock();
      Response resp;
      resp.body = body;
      r->Send(std::move(resp));
      lock.lock();
    }
  });
  ServerOptions o;
  o.threads = 4;
  StartServer(
      [&](Request req, std::shared_ptr<Responder> r) {
        if (req.query.back() % 2 == 0) {
          Response resp;
          resp.body = req.query;
          return r->Send(std::move(resp));
        }
        std::lock_guard<std::mutex> lock(mu);
        queue.emplace_back(std::move(r), req.query);
        cv.notify_one();
      },
      o);
  constexpr int kClients = 64, kRequests = 20;
  std::atomic<int> ok{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      RawClient c(port_);
      for (int n = 0; n < kRequests; ++n) {
        std::string q = std::to_string(i) + "-" + std::to_string(n);
        if (!c.Send(Get("/c?" + q))) return;
        auto res = c.ReadResponse(false, seconds(20));
        if (!res || res->body() != q) return;
        ok++;
      }
    });
  }
  for (auto& t : clients) t.join();
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
    cv.notify_all();
  }
  worker.join();
  EXPECT_EQ(ok.load(), kClients * kRequests);
}

}  // namespace
}  // namespace kiln::http
