// A loaded tensor model: its signature, its dynamic batcher and its statistics. Front ends
// reach models only through this header and model_repository.h.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "models/encoder/embedding_tensor_model.h"
#include "scheduler/dynamic_batcher.h"
#include "scheduler/flight_recorder.h"
#include "scheduler/inference_request.h"
#include "scheduler/llm/llm_metrics.h"
#include "scheduler/model_stats.h"

namespace kiln {

namespace models {
class LlmModel;
}
class ContinuousBatcher;
class TraceSink;

// What a client must send and gets back.
struct ModelSignature {
  std::string name;
  int max_batch_size = 0;  // 0: no batch dimension
  std::vector<TensorSpec> inputs;
  std::vector<TensorSpec> outputs;
  // Triton's `model_transaction_policy { decoupled: true }`: zero, one or many responses per
  // request, served over streaming RPCs only (see InferenceRequest::on_response).
  bool decoupled = false;
};

// Embedding models' (`kind: embedding`) tensor names, for front ends
// (models/encoder/embedding_tensor_model.h).
inline constexpr std::string_view kEmbeddingInput = models::kEmbeddingInput;

// The version every Kiln model is served as.
inline constexpr std::string_view kModelVersion = "1";

// Checks a request against the signature and normalizes it: inputs reordered to the
// declared order, batch_size set. InvalidArgument naming the input and what is expected for
// an unknown, duplicate or missing input, a wrong datatype, a shape that does not match the
// declared dims (or a batch size over max_batch_size, or inconsistent between inputs), raw
// contents whose byte size does not match the shape, or an unknown or duplicate output.
Status PrepareRequest(const ModelSignature& signature, InferenceRequest& request);

// Builds the generative model of a `kind: llm` entry (weights, tokenizer, compiled program).
using LlmLoader =
    std::function<StatusOr<std::unique_ptr<models::LlmModel>>(const config::ModelConfig&)>;

// Builds one instance of a tensor model that loads weights (`kind: embedding`).
using TensorModelLoader =
    std::function<StatusOr<std::unique_ptr<TensorModel>>(const config::ModelConfig&)>;

// What loading a model needs from the server. Metric families may be null (no metrics).
struct ModelDeps {
  InferenceMetricFamilies* tensor_metrics = nullptr;
  LlmMetricFamilies* llm_metrics = nullptr;
  LlmLoader llm_loader;             // unset: `kind: llm` entries fail to load, saying so
  TensorModelLoader tensor_loader;  // unset: `kind: embedding` entries fail to load, saying so
  // Events each model's flight recorder keeps (observability.flight_recorder); 0: none.
  int flight_recorder_entries = 0;
  double watchdog_seconds = 0;  // observability.watchdog_seconds (LLMs watch running requests)
  // The server's trace sink (the LLM step loops' spans); null: none.
  TraceSink* tracer = nullptr;
  // The configuration of the model entry `name`, if there is one (ModelRepository sets it):
  // scheduler.speculative.draft_model may name another `kind: llm` entry instead of a path.
  std::function<std::optional<config::ModelConfig>(const std::string& name)> find_model;
};

// The KServe signature of every LLM (Triton's LLM-backend convention): BYTES text_input [1]
// -> BYTES text_output [1], with optional BOOL stream, BYTES sampling_parameters (JSON),
// BOOL exclude_input_in_output.
ModelSignature LlmSignature(const std::string& name);

// Namespaces an LLM's prefix cache: a reload with other weights under the same name must not
// match blocks computed by the old ones, so the path is part of it.
uint64_t LlmPrefixSeed(const config::ModelConfig& config);

class Model {
 public:
  // Creates the model's instances and its batcher (dynamic batcher for tensor models,
  // continuous batcher for LLMs).
  static StatusOr<std::shared_ptr<Model>> Load(const config::ModelConfig& config,
                                               const ModelDeps& deps);
  ~Model();

  const config::ModelConfig& config() const { return config_; }
  const std::string& name() const { return config_.name; }
  const std::string& platform() const { return platform_; }
  const ModelSignature& signature() const { return signature_; }

  // The continuous batcher of an LLM; nullptr for tensor models. Front ends generate through
  // the request path (generation.h), which holds it.
  ContinuousBatcher* llm() const { return llm_.get(); }
  bool is_llm() const { return llm_ != nullptr; }
  // A `kind: embedding` model: BYTES text_input -> FP32 embedding, token_count, truncated.
  bool is_embedding() const { return platform_ == models::kEmbeddingPlatform; }

  // Tensor models: PrepareRequest, then queue. On success the model owns the request and
  // answers it through on_complete (and on_response, which a decoupled model requires:
  // FailedPrecondition without it); on error the caller keeps it. LLMs take generation
  // requests through llm() instead (FailedPrecondition here).
  Status Infer(std::unique_ptr<InferenceRequest>& request);

  // Call after setting a queued request's CancelFlag so it leaves the queue promptly.
  void WakeUp();

  // Requests queued or executing.
  size_t pending() const;
  // Blocks until exactly `n` requests are executing (tensor models: handed to an instance;
  // LLMs: in the running batch), or `timeout` passed; returns whether that holds.
  bool AwaitExecuting(size_t n, absl::Duration timeout) const;
  ModelStatsSnapshot Stats() const { return stats_.Snapshot(); }
  // For front ends that complete LLM requests on the KServe path (Triton's statistics).
  ModelStats& stats() { return stats_; }

  // The model's flight recorder (steps or batches, request state changes); nullptr when
  // observability.flight_recorder is off. Lives as long as the model.
  FlightRecorder* flight_recorder() const { return recorder_.get(); }

  // Stops accepting, finishes queued work until `deadline`, cuts off the rest (see
  // DynamicBatcher::Drain, ContinuousBatcher::Drain). Returns the number cut off.
  int Drain(SteadyClock::time_point deadline);

 private:
  Model(config::ModelConfig config, InferenceMetricFamilies* families);

  config::ModelConfig config_;
  std::string platform_;
  ModelSignature signature_;
  ModelStats stats_;
  std::unique_ptr<FlightRecorder> recorder_;  // before the batchers, which record into it
  std::unique_ptr<DynamicBatcher> batcher_;   // tensor models
  std::unique_ptr<ContinuousBatcher> llm_;    // LLMs
};

}  // namespace kiln
