#include "server/llm/test_llm.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <sstream>

namespace kiln::llm::testing {

config::ModelConfig FakeModelConfig(const std::string& name) {
  config::ModelConfig m;
  m.name = name;
  m.kind = "llm";
  m.path = "fake";
  m.scheduler.kv_cache_bytes = 8 * 16 * 512;  // 512 blocks of 16 tokens (8 bytes per token)
  return m;
}

TestServer::TestServer(std::vector<config::ModelConfig> models, FakeLlmOptions fake,
                       int64_t max_inflight)
    : fake_(std::move(fake)) {
  config::Config config;
  config.server.grpc.address = "127.0.0.1:0";
  config.server.http.address = "127.0.0.1:0";
  config.server.metrics.enabled = false;
  config.server.max_inflight_requests = static_cast<int>(max_inflight);
  config.server.shutdown_grace_seconds = 5;
  config.models = std::move(models);
  server_ = std::make_unique<Server>(
      std::move(config),
      [opts = fake_](const config::ModelConfig& m) -> StatusOr<std::unique_ptr<models::LlmModel>> {
        FakeLlmOptions o = opts;
        o.max_adapters = m.max_loaded_adapters;
        return std::make_unique<FakeLlm>(o);
      });
  Status s = server_->Start();
  KILN_CHECK(s.ok(), "the test server failed to start");
}

TestServer::~TestServer() {
  fake_.gate->Open();  // a step held by a failed test must not hang the shutdown
  server_->Shutdown();
}

ContinuousBatcher& TestServer::batcher(const std::string& name) {
  auto model = repository().GetReady(name);
  KILN_CHECK(model.ok() && (*model)->is_llm(), "no such LLM");
  return *(*model)->llm();
}

double TestServer::Metric(const std::string& sample) {
  std::istringstream in(registry().Serialize());
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(sample + " ", 0) == 0) return std::stod(line.substr(sample.size() + 1));
  }
  return -1;
}

HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& body) {
  namespace asio = boost::asio;
  namespace bhttp = boost::beast::http;
  asio::io_context ioc;
  asio::ip::tcp::socket sock(ioc);
  sock.connect({asio::ip::address_v4::loopback(), static_cast<uint16_t>(port)});
  bhttp::request<bhttp::string_body> req{bhttp::string_to_verb(method), path, 11};
  req.set(bhttp::field::host, "127.0.0.1");
  req.set(bhttp::field::content_type, "application/json");
  req.body() = body;
  req.prepare_payload();
  bhttp::write(sock, req);
  boost::beast::flat_buffer buf;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(1 << 30);
  bhttp::read(sock, buf, parser);
  HttpReply out;
  out.status = static_cast<int>(parser.get().result_int());
  out.content_type = std::string(parser.get()[bhttp::field::content_type]);
  out.body = parser.get().body();
  return out;
}

std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    std::string_view event(body.data() + pos, end - pos);
    if (event.rfind("data: ", 0) == 0) out.emplace_back(event.substr(6));
    pos = end + 2;
  }
  return out;
}

}  // namespace kiln::llm::testing
