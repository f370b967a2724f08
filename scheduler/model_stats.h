// Per-model inference statistics in Triton's shape (what ModelStatistics reports), plus the
// Prometheus metrics of the tensor-model path. Recording is lock-free except for the
// per-batch-size table.
//
// Metrics (all labelled by `model`; documented in docs/metrics.md):
//   kiln_inference_requests_total{model,outcome}     outcome: success | failure
//   kiln_inference_failures_total{model,reason}      reason: invalid_argument, queue_full,
//                                                    timeout, cancelled, unavailable, internal
//   kiln_inference_count_total{model}                batch elements inferred
//   kiln_inference_executions_total{model}           model executions (batches)
//   kiln_inference_pending_requests{model}           queued, not yet executing
//   kiln_inference_executing_requests{model}         in an execution running now
//   kiln_inference_queue_duration_seconds{model}     histogram
//   kiln_inference_compute_duration_seconds{model}   histogram, per execution
//   kiln_inference_request_duration_seconds{model}   histogram, received -> response
//   kiln_inference_batch_size{model}                 histogram of batch elements per execution
//   kiln_inference_sequences_active{model}           sequence models: sequences started and
//                                                    not yet ended or timed out
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/base/metrics.h"
#include "engine/base/status.h"

namespace kiln {

struct DurationStat {
  uint64_t count = 0;
  uint64_t ns = 0;
};

// A consistent-enough copy for the statistics API (fields are read one by one).
struct ModelStatsSnapshot {
  uint64_t last_inference_ms = 0;
  uint64_t inference_count = 0;
  uint64_t execution_count = 0;
  DurationStat success, fail, queue, compute_input, compute_infer, compute_output;
  struct Batch {
    DurationStat compute_input, compute_infer, compute_output;
  };
  std::map<uint64_t, Batch> batches;  // by batch size
};

// The metric families of the tensor path, registered once per registry.
struct InferenceMetricFamilies {
  explicit InferenceMetricFamilies(metrics::Registry& registry);
  metrics::Family<metrics::Counter>& requests;
  metrics::Family<metrics::Counter>& failures;
  metrics::Family<metrics::Counter>& inference_count;
  metrics::Family<metrics::Counter>& executions;
  metrics::Family<metrics::Gauge>& pending;
  metrics::Family<metrics::Gauge>& executing;
  metrics::Family<metrics::Histogram>& queue_seconds;
  metrics::Family<metrics::Histogram>& compute_seconds;
  metrics::Family<metrics::Histogram>& request_seconds;
  metrics::Family<metrics::Histogram>& batch_size;
  metrics::Family<metrics::Gauge>& sequences_active;
};

// The `reason` label for a failed request's status.
std::string_view FailureReason(const Status& status);

// Thread-safe.
class ModelStats {
 public:
  // `families` may be null (no Prometheus metrics, e.g. in unit tests).
  ModelStats(std::string model_name, InferenceMetricFamilies* families);
  ~ModelStats();

  void RequestQueued();
  void RequestDequeued();  // left the queue (to execute, or rejected/cancelled)
  // `n` requests entered / left a running execution (kiln_inference_executing_requests).
  void ExecutionStarted(uint64_t n);
  void ExecutionFinished(uint64_t n);
  void RequestSucceeded(std::chrono::nanoseconds total, std::chrono::nanoseconds queue,
                        std::chrono::nanoseconds input, std::chrono::nanoseconds infer,
                        std::chrono::nanoseconds output);
  void RequestFailed(const Status& status, std::chrono::nanoseconds total);
  // Sequence batching: the number of sequences started and not yet ended or timed out.
  void SetSequencesActive(uint64_t n);
  uint64_t sequences_active() const { return sequences_active_.load(std::memory_order_relaxed); }
  void BatchExecuted(uint64_t batch_size, std::chrono::nanoseconds input,
                     std::chrono::nanoseconds infer, std::chrono::nanoseconds output);

  ModelStatsSnapshot Snapshot() const;

 private:
  struct Atomic {
    std::atomic<uint64_t> count{0}, ns{0};
    void Add(std::chrono::nanoseconds d);
    DurationStat Load() const;
  };
  const std::string name_;
  InferenceMetricFamilies* families_;
  metrics::Counter *m_success_ = nullptr, *m_failure_ = nullptr, *m_count_ = nullptr,
                   *m_exec_ = nullptr;
  metrics::Gauge *m_pending_ = nullptr, *m_executing_ = nullptr, *m_sequences_ = nullptr;
  std::atomic<uint64_t> sequences_active_{0};
  metrics::Histogram *m_queue_ = nullptr, *m_compute_ = nullptr, *m_request_ = nullptr,
                     *m_batch_ = nullptr;

  std::atomic<uint64_t> last_inference_ms_{0}, inference_count_{0}, execution_count_{0};
  Atomic success_, fail_, queue_, input_, infer_, output_;
  mutable absl::Mutex batches_mu_;
  std::map<uint64_t, ModelStatsSnapshot::Batch> batches_ ABSL_GUARDED_BY(batches_mu_);
};

}  // namespace kiln
