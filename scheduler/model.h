// A loaded tensor model: its signature, its dynamic batcher and its statistics. Front ends
// reach models only through this header and model_repository.h.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "scheduler/dynamic_batcher.h"
#include "scheduler/inference_request.h"
#include "scheduler/model_stats.h"

namespace kiln {

// What a client must send and gets back.
struct ModelSignature {
  std::string name;
  int max_batch_size = 0;  // 0: no batch dimension
  std::vector<TensorSpec> inputs;
  std::vector<TensorSpec> outputs;
};

// The version every Kiln model is served as.
inline constexpr std::string_view kModelVersion = "1";

// Checks a request against the signature and normalizes it: inputs reordered to the
// declared order, batch_size set. InvalidArgument naming the input and what is expected for
// an unknown, duplicate or missing input, a wrong datatype, a shape that does not match the
// declared dims (or a batch size over max_batch_size, or inconsistent between inputs), raw
// contents whose byte size does not match the shape, or an unknown or duplicate output.
Status PrepareRequest(const ModelSignature& signature, InferenceRequest& request);

class Model {
 public:
  // Creates the model's instances and its batcher. `families` may be null.
  static StatusOr<std::shared_ptr<Model>> Load(const config::ModelConfig& config,
                                               InferenceMetricFamilies* families);
  ~Model();

  const config::ModelConfig& config() const { return config_; }
  const std::string& name() const { return config_.name; }
  const std::string& platform() const { return platform_; }
  const ModelSignature& signature() const { return signature_; }

  // PrepareRequest, then queue. On success the model owns the request and answers it through
  // on_complete; on error the caller keeps it.
  Status Infer(std::unique_ptr<InferenceRequest>& request);

  // Call after setting a queued request's CancelFlag so it leaves the queue promptly.
  void WakeUp() { batcher_->WakeUp(); }

  size_t pending() const { return batcher_->pending(); }
  ModelStatsSnapshot Stats() const { return stats_.Snapshot(); }

  // Stops accepting, finishes queued work until `deadline`, cuts off the rest (see
  // DynamicBatcher::Drain). Returns the number cut off.
  int Drain(SteadyClock::time_point deadline) { return batcher_->Drain(deadline); }

 private:
  Model(config::ModelConfig config, InferenceMetricFamilies* families);

  config::ModelConfig config_;
  std::string platform_;
  ModelSignature signature_;
  ModelStats stats_;
  std::unique_ptr<DynamicBatcher> batcher_;
};

}  // namespace kiln
