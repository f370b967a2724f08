// Test-only: kilnd's server in-process (the real Server: model loading, gRPC and HTTP front
// ends, metrics) on loopback ports picked by the OS, whose `kind: llm` models are the fake
// LLM of scheduler/llm/testing/fake_llm.h, for the tests of server/llm/ without weights.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "scheduler/llm/continuous_batcher.h"
#include "scheduler/llm/testing/fake_llm.h"
#include "server/server.h"

namespace kiln::llm::testing {

using llm_testing::FakeLlm;
using llm_testing::FakeLlmOptions;
using llm_testing::LoadFixtureTokenizer;

// A model entry served by the fake ("kind: llm", path "fake").
config::ModelConfig FakeModelConfig(const std::string& name);

class TestServer {
 public:
  // `models` may mix fake LLMs (FakeModelConfig) and builtin tensor models. Every `kind: llm`
  // entry is a FakeLlm sharing `fake`'s knobs (with the entry's max_loaded_adapters slots). Metrics
  // are not served over HTTP (read them with Metric).
  explicit TestServer(std::vector<config::ModelConfig> models, FakeLlmOptions fake = {},
                      int64_t max_inflight = 4096);
  ~TestServer();

  int grpc_port() const { return server_->grpc_port(); }
  int http_port() const { return server_->http_port(); }
  std::string grpc_target() const { return "127.0.0.1:" + std::to_string(grpc_port()); }
  ModelRepository& repository() { return *server_->core().repository; }
  ServerCore& core() { return server_->core(); }
  metrics::Registry& registry() { return server_->registry(); }
  FakeLlmOptions& fake() { return fake_; }
  // The batcher of a loaded LLM (tests observe its snapshot).
  ContinuousBatcher& batcher(const std::string& name);
  // One sample of /metrics ("name{labels}"); -1 if absent.
  double Metric(const std::string& sample);

 private:
  FakeLlmOptions fake_;
  std::unique_ptr<Server> server_;
};

// A minimal blocking HTTP/1.1 client for the tests.
struct HttpReply {
  int status = 0;
  std::string content_type;
  std::string body;
};
HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& body = "");

// Server-Sent Events: the `data:` payloads of a complete event stream, in order.
std::vector<std::string> SseData(const std::string& body);

}  // namespace kiln::llm::testing
