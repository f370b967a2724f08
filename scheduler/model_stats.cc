#include "scheduler/model_stats.h"

namespace kiln {
namespace {

// Seconds buckets from 50 µs to ~100 s; batch-size buckets 1..1024.
std::vector<double> LatencyBuckets() { return metrics::ExponentialBuckets(50e-6, 2.0, 22); }
std::vector<double> BatchBuckets() { return metrics::ExponentialBuckets(1, 2, 11); }

double Seconds(std::chrono::nanoseconds d) { return std::chrono::duration<double>(d).count(); }

uint64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

InferenceMetricFamilies::InferenceMetricFamilies(metrics::Registry& r)
    : requests(r.AddCounter("kiln_inference_requests_total",
                            "Tensor inference requests completed, by outcome.",
                            {"model", "outcome"})),
      failures(r.AddCounter("kiln_inference_failures_total",
                            "Failed tensor inference requests, by reason.", {"model", "reason"})),
      inference_count(r.AddCounter("kiln_inference_count_total",
                                   "Batch elements inferred (a request of batch 4 counts 4).",
                                   {"model"})),
      executions(r.AddCounter("kiln_inference_executions_total",
                              "Model executions; fewer than kiln_inference_count_total when "
                              "requests are batched.",
                              {"model"})),
      pending(r.AddGauge("kiln_inference_pending_requests",
                         "Requests waiting in the model's queue.", {"model"})),
      executing(r.AddGauge("kiln_inference_executing_requests",
                           "Requests in a model execution that is running now.", {"model"})),
      queue_seconds(r.AddHistogram("kiln_inference_queue_duration_seconds",
                                   "Time requests spent queued before execution.", {"model"},
                                   LatencyBuckets())),
      compute_seconds(r.AddHistogram("kiln_inference_compute_duration_seconds",
                                     "Duration of one model execution (one batch), including "
                                     "input gathering and output scattering.",
                                     {"model"}, LatencyBuckets())),
      request_seconds(r.AddHistogram("kiln_inference_request_duration_seconds",
                                     "Time from receiving a request to its response.", {"model"},
                                     LatencyBuckets())),
      batch_size(r.AddHistogram("kiln_inference_batch_size", "Batch elements per model execution.",
                                {"model"}, BatchBuckets())),
      sequences_active(r.AddGauge("kiln_inference_sequences_active",
                                  "Sequences (sequence batching) started and not yet ended or "
                                  "released as idle.",
                                  {"model"})) {}

std::string_view FailureReason(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
      return "invalid_argument";
    case StatusCode::kResourceExhausted:
      return "queue_full";
    case StatusCode::kDeadlineExceeded:
      return "timeout";
    case StatusCode::kCancelled:
      return "cancelled";
    case StatusCode::kUnavailable:
      return "unavailable";
    default:
      return "internal";
  }
}

void ModelStats::Atomic::Add(std::chrono::nanoseconds d) {
  count.fetch_add(1, std::memory_order_relaxed);
  ns.fetch_add(static_cast<uint64_t>(std::max<int64_t>(0, d.count())), std::memory_order_relaxed);
}

DurationStat ModelStats::Atomic::Load() const {
  return {count.load(std::memory_order_relaxed), ns.load(std::memory_order_relaxed)};
}

ModelStats::ModelStats(std::string model_name, InferenceMetricFamilies* families)
    : name_(std::move(model_name)), families_(families) {
  if (!families_) return;
  m_success_ = families_->requests.WithLabels({name_, "success"});
  m_failure_ = families_->requests.WithLabels({name_, "failure"});
  m_count_ = families_->inference_count.WithLabels({name_});
  m_exec_ = families_->executions.WithLabels({name_});
  m_pending_ = families_->pending.WithLabels({name_});
  m_executing_ = families_->executing.WithLabels({name_});
  m_queue_ = families_->queue_seconds.WithLabels({name_});
  m_compute_ = families_->compute_seconds.WithLabels({name_});
  m_request_ = families_->request_seconds.WithLabels({name_});
  m_batch_ = families_->batch_size.WithLabels({name_});
}

// Metric children stay registered after an unload so counters remain monotonic across a
// reload of the same model (Prometheus rate() stays correct); only the pending and executing
// gauges are reset.
ModelStats::~ModelStats() {
  if (m_pending_) m_pending_->Set(0);
  if (m_executing_) m_executing_->Set(0);
  if (m_sequences_) m_sequences_->Set(0);
}

void ModelStats::SetSequencesActive(uint64_t n) {
  sequences_active_.store(n, std::memory_order_relaxed);
  // Only sequence models get the series (REQUIRES: calls are serialized, as the batcher does).
  if (!m_sequences_ && families_) m_sequences_ = families_->sequences_active.WithLabels({name_});
  if (m_sequences_) m_sequences_->Set(static_cast<double>(n));
}

void ModelStats::RequestQueued() {
  if (m_pending_) m_pending_->Increment();
}

void ModelStats::RequestDequeued() {
  if (m_pending_) m_pending_->Decrement();
}

void ModelStats::ExecutionStarted(uint64_t n) {
  if (m_executing_) m_executing_->Increment(static_cast<double>(n));
}

void ModelStats::ExecutionFinished(uint64_t n) {
  if (m_executing_) m_executing_->Decrement(static_cast<double>(n));
}

void ModelStats::RequestSucceeded(std::chrono::nanoseconds total, std::chrono::nanoseconds queue,
                                  std::chrono::nanoseconds input, std::chrono::nanoseconds infer,
                                  std::chrono::nanoseconds output) {
  success_.Add(total);
  queue_.Add(queue);
  input_.Add(input);
  infer_.Add(infer);
  output_.Add(output);
  last_inference_ms_.store(NowMs(), std::memory_order_relaxed);
  if (!families_) return;
  m_success_->Increment();
  m_request_->Observe(Seconds(total));
  m_queue_->Observe(Seconds(queue));
}

void ModelStats::RequestFailed(const Status& status, std::chrono::nanoseconds total) {
  fail_.Add(total);
  if (!families_) return;
  m_failure_->Increment();
  families_->failures.WithLabels({name_, FailureReason(status)})->Increment();
  m_request_->Observe(Seconds(total));
}

void ModelStats::BatchExecuted(uint64_t batch_size, std::chrono::nanoseconds input,
                               std::chrono::nanoseconds infer, std::chrono::nanoseconds output) {
  inference_count_.fetch_add(batch_size, std::memory_order_relaxed);
  execution_count_.fetch_add(1, std::memory_order_relaxed);
  {
    absl::MutexLock lock(&batches_mu_);
    auto& b = batches_[batch_size];
    auto add = [](DurationStat& s, std::chrono::nanoseconds d) {
      s.count += 1;
      s.ns += static_cast<uint64_t>(std::max<int64_t>(0, d.count()));
    };
    add(b.compute_input, input);
    add(b.compute_infer, infer);
    add(b.compute_output, output);
  }
  if (!families_) return;
  m_count_->Increment(static_cast<double>(batch_size));
  m_exec_->Increment();
  m_compute_->Observe(Seconds(input + infer + output));
  m_batch_->Observe(static_cast<double>(batch_size));
}

ModelStatsSnapshot ModelStats::Snapshot() const {
  ModelStatsSnapshot s;
  s.last_inference_ms = last_inference_ms_.load(std::memory_order_relaxed);
  s.inference_count = inference_count_.load(std::memory_order_relaxed);
  s.execution_count = execution_count_.load(std::memory_order_relaxed);
  s.success = success_.Load();
  s.fail = fail_.Load();
  s.queue = queue_.Load();
  s.compute_input = input_.Load();
  s.compute_infer = infer_.Load();
  s.compute_output = output_.Load();
  absl::MutexLock lock(&batches_mu_);
  s.batches = batches_;
  return s;
}

}  // namespace kiln
