// http::Server over TLS (ServerOptions::tls): the same HTTP behaviour after a handshake, clean
// failure of plaintext and silent clients, mTLS, and certificate updates for new connections.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/http/http_server.h"
#include "server/tls/testing.h"
#include "server/tls/tls.h"

namespace kiln::http {
namespace {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using tls::testing::KeyPair;
using tls::testing::MakeCert;
using tls::testing::NewKey;

// A blocking TLS client on its own io_context: connect, handshake, GET on one connection.
class TlsClient {
 public:
  // `ca_pem` verifies the server; `cert_pem`/`key_pem` (optional) are the client's own.
  TlsClient(int port, const std::string& ca_pem, const std::string& cert_pem = "",
            const std::string& key_pem = "")
      : ctx_(ssl::context::tls_client) {
    ctx_.add_certificate_authority(asio::buffer(ca_pem));
    ctx_.set_verify_mode(ssl::verify_peer);
    if (!cert_pem.empty()) {
      ctx_.use_certificate_chain(asio::buffer(cert_pem));
      ctx_.use_private_key(asio::buffer(key_pem), ssl::context::pem);
    }
    // After the context is set up: a stream copies its settings when created.
    stream_.emplace(ioc_, ctx_);
    stream_->next_layer().connect(tcp::endpoint(asio::ip::address_v4::loopback(), port));
    stream_->handshake(ssl::stream_base::client, handshake_error_);
  }

  const boost::system::error_code& handshake_error() const { return handshake_error_; }

  // Reads until the server ends the connection; returns the error that ended it.
  boost::system::error_code ReadToEnd() {
    boost::system::error_code ec;
    char buf[256];
    while (!ec) stream_->read_some(asio::buffer(buf), ec);
    return ec;
  }

  // The serial number of the server's certificate, as an integer.
  long PeerSerial() {
    X509* cert = SSL_get1_peer_certificate(stream_->native_handle());
    if (!cert) return -1;
    const long serial = ASN1_INTEGER_get(X509_get0_serialNumber(cert));
    X509_free(cert);
    return serial;
  }

  // One GET on the connection; nullopt (with `error`) if it fails.
  std::optional<bhttp::response<bhttp::string_body>> Get(const std::string& target,
                                                         boost::system::error_code* error,
                                                         bool close = false) {
    bhttp::request<bhttp::string_body> req(bhttp::verb::get, target, 11);
    req.set(bhttp::field::host, "localhost");
    if (close) req.set(bhttp::field::connection, "close");
    bhttp::write(*stream_, req, *error);
    if (*error) return std::nullopt;
    bhttp::response<bhttp::string_body> res;
    bhttp::read(*stream_, buffer_, res, *error);
    if (*error) return std::nullopt;
    return res;
  }

 private:
  asio::io_context ioc_;
  ssl::context ctx_;
  std::optional<ssl::stream<tcp::socket>> stream_;
  boost::beast::flat_buffer buffer_;
  boost::system::error_code handshake_error_;
};

// A plain TCP socket to `port`.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// True if the server closes `fd` (EOF or reset) within `timeout`, skipping data; the first
// bytes received go to `*first`.
bool ClosedWithin(int fd, std::chrono::milliseconds timeout, std::string* first) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (poll(&p, 1, static_cast<int>(std::max<long>(1, left.count()))) <= 0) continue;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return true;
    if (first->empty()) first->assign(buf, static_cast<size_t>(n));
  }
  return false;
}

class HttpServerTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ca_ = NewKey();
    ca_pem_ = MakeCert(ca_, "Test CA", ca_, "Test CA", 1, -60, 86400, /*ca=*/true);
    server_key_ = NewKey();
    pem_.cert_chain = MakeCert(server_key_, "localhost", ca_, "Test CA", 0x1001);
    pem_.private_key = server_key_.pem;
  }

  void Start(int idle_timeout_seconds = 60) {
    auto context = tls::ServerContext::Create(pem_);
    ASSERT_TRUE(context.ok()) << context.status();
    context_ = *context;
    ServerOptions o;
    o.address = "127.0.0.1:0";
    o.idle_timeout_seconds = idle_timeout_seconds;
    o.tls = context_;
    server_ = std::make_unique<Server>(o, [](Request req, std::shared_ptr<Responder> r) {
      Response resp;
      resp.body = req.path == "/big" ? std::string(3 << 20, 'x') : "hello " + req.path;
      r->Send(std::move(resp));
    });
    ASSERT_TRUE(server_->Start().ok());
  }

  void ExpectGetWorks(TlsClient& c, const std::string& path = "/x") {
    boost::system::error_code ec;
    auto res = c.Get(path, &ec);
    ASSERT_TRUE(res) << ec.message();
    EXPECT_EQ(res->result_int(), 200);
    EXPECT_EQ(res->body(), "hello " + path);
  }

  KeyPair ca_, server_key_;
  std::string ca_pem_;
  tls::Pem pem_;
  std::shared_ptr<tls::ServerContext> context_;
  std::unique_ptr<Server> server_;
};

TEST_F(HttpServerTlsTest, KeepAliveRequestsOverTls) {
  Start();
  TlsClient c(server_->port(), ca_pem_);
  ASSERT_FALSE(c.handshake_error()) << c.handshake_error().message();
  EXPECT_EQ(c.PeerSerial(), 0x1001);
  for (int i = 0; i < 3; ++i) ExpectGetWorks(c, "/r" + std::to_string(i));
}

TEST_F(HttpServerTlsTest, LargeResponseThenSmallOnes) {
  Start();
  TlsClient c(server_->port(), ca_pem_);
  boost::system::error_code ec;
  auto res = c.Get("/big", &ec);
  ASSERT_TRUE(res) << ec.message();
  EXPECT_EQ(res->body(), std::string(3 << 20, 'x'));
  ExpectGetWorks(c);
}

TEST_F(HttpServerTlsTest, ConnectionCloseEndsWithCloseNotifyAtOnce) {
  Start();
  TlsClient c(server_->port(), ca_pem_);
  boost::system::error_code ec;
  auto res = c.Get("/bye", &ec, /*close=*/true);
  ASSERT_TRUE(res) << ec.message();
  EXPECT_EQ(res->body(), "hello /bye");
  const auto t0 = Clock::now();
  // A clean TLS end (close_notify) reads as EOF; no waiting for the linger time.
  EXPECT_EQ(c.ReadToEnd(), asio::error::eof);
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(500));
}

TEST_F(HttpServerTlsTest, PlaintextRequestIsClosedPromptlyAndServerKeepsServing) {
  Start();
  const int fd = Connect(server_->port());
  const std::string get = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
  std::string first;
  EXPECT_TRUE(ClosedWithin(fd, std::chrono::seconds(2), &first));
  EXPECT_EQ(first.rfind("HTTP/", 0), std::string::npos) << first;
  close(fd);
  TlsClient c(server_->port(), ca_pem_);
  ExpectGetWorks(c);
}

TEST_F(HttpServerTlsTest, SilentClientIsClosedAfterTheIdleTimeout) {
  Start(/*idle_timeout_seconds=*/1);
  const int fd = Connect(server_->port());
  const auto t0 = Clock::now();
  std::string first;
  EXPECT_TRUE(ClosedWithin(fd, std::chrono::seconds(5), &first));
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(900));
  close(fd);
}

TEST_F(HttpServerTlsTest, UpdateChangesNewConnectionsOnly) {
  Start();
  TlsClient before(server_->port(), ca_pem_);
  ExpectGetWorks(before);
  KeyPair key2 = NewKey();
  tls::Pem pem2;
  pem2.cert_chain = MakeCert(key2, "localhost", ca_, "Test CA", 0x2002);
  pem2.private_key = key2.pem;
  ASSERT_TRUE(context_->Update(pem2).ok());
  TlsClient after(server_->port(), ca_pem_);
  EXPECT_EQ(after.PeerSerial(), 0x2002);
  ExpectGetWorks(after);
  EXPECT_EQ(before.PeerSerial(), 0x1001);
  ExpectGetWorks(before);  // still open, still served
}

TEST_F(HttpServerTlsTest, MutualTlsNeedsAClientCertificateFromTheCa) {
  pem_.client_ca = ca_pem_;
  Start();
  {
    TlsClient anonymous(server_->port(), ca_pem_);
    // TLS 1.3 reports the refusal on the first read rather than in the handshake.
    boost::system::error_code ec = anonymous.handshake_error();
    if (!ec) anonymous.Get("/x", &ec);
    EXPECT_TRUE(ec) << "a client without a certificate was served";
  }
  {
    KeyPair stranger_ca = NewKey(), stranger = NewKey();
    TlsClient other(server_->port(), ca_pem_,
                    MakeCert(stranger, "client", stranger_ca, "Other CA", 7), stranger.pem);
    boost::system::error_code ec = other.handshake_error();
    if (!ec) other.Get("/x", &ec);
    EXPECT_TRUE(ec) << "a client certificate from another CA was accepted";
  }
  KeyPair client = NewKey();
  TlsClient good(server_->port(), ca_pem_, MakeCert(client, "client", ca_, "Test CA", 9),
                 client.pem);
  ASSERT_FALSE(good.handshake_error()) << good.handshake_error().message();
  ExpectGetWorks(good);
}

}  // namespace
}  // namespace kiln::http
