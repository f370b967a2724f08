// Test-only: a deterministic fake LLM and an in-process server (the real gRPC and HTTP front
// ends over a model repository whose `kind: llm` loader builds the fake), for the tests of
// server/llm/ without model weights.
//
// The fake uses the byte-level BPE fixture tokenizer (ChatML control tokens: 0
// <|begin_of_text|>, 1 <|end_of_text|> = EOS, 2 <|im_start|>, 3 <|im_end|>) and the SmolLM2
// chat template. Its next token is a hash of the whole context read back through the paged
// KV cache, mapped into ordinary tokens [300, 2900), so a wrong block table changes the output
// and FakeLlm::Continue predicts every greedy generation.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "models/llm/llm_model.h"
#include "scheduler/model_repository.h"
#include "server/core.h"
#include "server/grpc_server.h"
#include "server/http_frontend.h"

namespace kiln::llm::testing {

struct FakeLlmOptions {
  int32_t context_length = 256;
  bool chat_template = true;
  // Shared knobs, read at every step (tests change them while the server runs).
  std::shared_ptr<std::atomic<int>> step_delay_us = std::make_shared<std::atomic<int>>(0);
  // The context length at which the model says EOS (0: never).
  std::shared_ptr<std::atomic<int>> eos_at = std::make_shared<std::atomic<int>>(0);
};

class FakeLlm final : public models::LlmModel {
 public:
  explicit FakeLlm(FakeLlmOptions options = {});
  ~FakeLlm() override;

  const models::LlmModelInfo& info() const override { return info_; }
  const models::Tokenizer& tokenizer() const override { return *tokenizer_; }
  const models::ChatTemplate* chat_template() const override { return template_.get(); }
  int64_t KvBytesPerBlock(int32_t block_size) const override { return 8 * block_size; }
  Status AllocateKvCache(int32_t num_blocks, int32_t block_size) override;
  Status Step(const models::StepBatch& batch, std::span<float> logits,
              models::StepStats* stats) override;

  // The greedy continuation of `context` (at most `n` tokens; stops after EOS).
  static std::vector<int32_t> Continue(std::vector<int32_t> context, int n, int eos_at = 0);

 private:
  FakeLlmOptions options_;
  models::LlmModelInfo info_;
  std::unique_ptr<models::Tokenizer> tokenizer_;
  std::unique_ptr<models::ChatTemplate> template_;
  int32_t block_size_ = 0;
  std::vector<std::pair<int32_t, int32_t>> kv_;  // (token, position) per slot
};

// The fixture tokenizer alone.
std::unique_ptr<models::Tokenizer> LoadFixtureTokenizer();

// A model entry served by the fake ("kind: llm", path "fake").
config::ModelConfig FakeModelConfig(const std::string& name);

// kilnd's front ends in-process, on loopback ports picked by the OS (metrics off).
class TestServer {
 public:
  // `models` may mix fake LLMs (FakeModelConfig) and builtin tensor models. `loader`, if set,
  // builds the `kind: llm` models instead of the fake (e.g. models::LoadLlm).
  TestServer(std::vector<config::ModelConfig> models, FakeLlmOptions fake = {},
             int64_t max_inflight = 4096, LlmLoader loader = {});
  ~TestServer();

  int grpc_port() const { return grpc_->port(); }
  int http_port() const { return http_->http_port(); }
  std::string grpc_target() const { return "127.0.0.1:" + std::to_string(grpc_port()); }
  ModelRepository& repository() { return *repository_; }
  ServerCore& core() { return core_; }
  metrics::Registry& registry() { return registry_; }
  FakeLlmOptions& fake() { return fake_; }
  // The batcher of a loaded LLM.
  ContinuousBatcher& batcher(const std::string& name);
  // One sample of /metrics ("name{labels}"); -1 if absent.
  double Metric(const std::string& sample);

 private:
  config::Config config_;
  FakeLlmOptions fake_;
  metrics::Registry registry_;
  std::unique_ptr<InferenceMetricFamilies> families_;
  std::unique_ptr<LlmMetricFamilies> llm_families_;
  std::unique_ptr<ModelRepository> repository_;
  std::unique_ptr<InflightLimiter> limiter_;
  ServerCore core_;
  std::unique_ptr<GrpcFrontEnd> grpc_;
  std::unique_ptr<HttpFrontEnds> http_;
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
