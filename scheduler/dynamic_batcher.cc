#include "scheduler/dynamic_batcher.h"

#include <algorithm>
#include <cstring>

#include "scheduler/trace.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

// Concatenates the requests' inputs along dimension 0.
std::vector<HostTensor> GatherInputs(std::vector<std::unique_ptr<InferenceRequest>>& batch) {
  if (batch.size() == 1) return std::move(batch.front()->inputs);
  std::vector<HostTensor> out = batch.front()->inputs;  // name, datatype, shape template
  for (size_t i = 0; i < out.size(); ++i) {
    size_t bytes = 0;
    int64_t rows = 0;
    for (const auto& r : batch) {
      bytes += r->inputs[i].data.size();
      rows += r->inputs[i].shape[0];
    }
    out[i].data.clear();
    out[i].data.reserve(bytes);
    for (const auto& r : batch) out[i].data += r->inputs[i].data;
    out[i].shape[0] = rows;
  }
  return out;
}

// The raw bytes of rows [begin, begin + rows) of a tensor with `total_rows` rows.
StatusOr<std::string> SliceRows(const HostTensor& t, int64_t total_rows, int64_t begin,
                                int64_t rows) {
  if (total_rows <= 0 || t.shape.empty() || t.shape[0] != total_rows) {
    return Internal("output '", t.name, "' has shape ", ShapeToString(t.shape), ", expected ",
                    total_rows, " rows");
  }
  if (t.datatype != DataType::kBytes) {
    const size_t row_bytes = t.data.size() / static_cast<size_t>(total_rows);
    return t.data.substr(begin * row_bytes, rows * row_bytes);
  }
  // BYTES: walk the length-prefixed elements.
  KILN_ASSIGN_OR_RETURN(int64_t elements, CountBytesElements(t.data));
  const int64_t per_row = elements / total_rows;
  const int64_t first = begin * per_row, last = (begin + rows) * per_row;
  size_t pos = 0, start = 0;
  for (int64_t e = 0; e < last; ++e) {
    if (e == first) start = pos;
    uint32_t len;
    std::memcpy(&len, t.data.data() + pos, 4);
    pos += 4 + len;
  }
  if (first == last) start = pos;
  return t.data.substr(start, pos - start);
}

// absl waits take absl::Time (wall clock); convert a steady-clock deadline.
absl::Time AbslDeadline(SteadyClock::time_point t) {
  return absl::Now() + absl::FromChrono(t - SteadyClock::now());
}

// BatchQueue (the dynamic batcher's rules) as a RequestQueue: one queue for every instance.
class DynamicQueue final : public RequestQueue {
 public:
  explicit DynamicQueue(BatchQueue::Options options) : queue_(std::move(options)) {}
  Status Enqueue(std::unique_ptr<InferenceRequest>& r, SteadyClock::time_point now) override {
    return queue_.Enqueue(r, now);
  }
  std::vector<Completion> Expire(SteadyClock::time_point now) override {
    return queue_.Expire(now);
  }
  Decision Next(SteadyClock::time_point now, int /*instance*/) override {
    BatchQueue::Decision d = queue_.Next(now);
    return {std::move(d.batch), d.retry_at};
  }
  std::optional<SteadyClock::time_point> NextDeadline() const override {
    return queue_.NextDeadline();
  }
  size_t size() const override { return queue_.size(); }
  std::vector<std::unique_ptr<InferenceRequest>> TakeAll() override { return queue_.TakeAll(); }

 private:
  BatchQueue queue_;
};

}  // namespace

struct DynamicBatcher::Instance {
  std::unique_ptr<TensorModel> model;
  absl::Mutex mu;
  std::vector<std::unique_ptr<InferenceRequest>> batch ABSL_GUARDED_BY(mu);
  bool quit ABSL_GUARDED_BY(mu) = false;
  bool busy = false;  // guarded by the batcher's mu_ (not expressible as an annotation here)
  int index = 0;      // the flight recorder's work slot
  std::thread thread;
};

DynamicBatcher::DynamicBatcher(BatchQueue::Options options,
                               std::vector<std::unique_ptr<TensorModel>> instances,
                               ModelStats* stats, FlightRecorder* recorder)
    : DynamicBatcher(std::make_unique<DynamicQueue>(std::move(options)), std::move(instances),
                     stats, recorder) {}

DynamicBatcher::DynamicBatcher(std::unique_ptr<RequestQueue> queue,
                               std::vector<std::unique_ptr<TensorModel>> instances,
                               ModelStats* stats, FlightRecorder* recorder)
    : stats_(stats), recorder_(recorder), queue_(std::move(queue)) {
  KILN_CHECK(!instances.empty(), "a batcher needs at least one model instance");
  for (auto& m : instances) {
    auto inst = std::make_unique<Instance>();
    inst->model = std::move(m);
    inst->index = static_cast<int>(instances_.size());
    instances_.push_back(std::move(inst));
  }
  for (auto& inst : instances_) {
    inst->thread = std::thread([this, i = inst.get()] { WorkerLoop(i); });
  }
  scheduler_thread_ = std::thread([this] { SchedulerLoop(); });
}

DynamicBatcher::~DynamicBatcher() {
  Drain(SteadyClock::now());
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  scheduler_thread_.join();
  for (auto& inst : instances_) {
    {
      absl::MutexLock lock(&inst->mu);
      inst->quit = true;
    }
    inst->thread.join();
  }
}

Status DynamicBatcher::Enqueue(std::unique_ptr<InferenceRequest>& request) {
  // Values the model cannot take fail this request alone, before it joins a batch. Models
  // read their inputs by position: a request without all of them (a sequence model's client
  // sends no control inputs; the sequence batcher adds them later) is not theirs to check.
  const TensorModel& model = *instances_.front()->model;
  if (request->inputs.size() == model.inputs().size()) {
    KILN_RETURN_IF_ERROR(model.CheckRequest(request->inputs));
  }
  absl::MutexLock lock(&mu_);
  if (!accepting_) {
    return Unavailable("model '", request->model_name, "' is shutting down");
  }
  const InferenceRequest* queued = request.get();  // the queue owns it on success
  KILN_RETURN_IF_ERROR(queue_->Enqueue(request, SteadyClock::now()));
  if (recorder_) recorder_->RecordRequest(queued->id, FlightRequestState::kQueued);
  if (stats_) stats_->RequestQueued();
  wake_ = true;
  return OkStatus();
}

void DynamicBatcher::WakeUp() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

size_t DynamicBatcher::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_->size() + executing_.size();
}

bool DynamicBatcher::AwaitExecuting(size_t n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto done = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return executing_.size() == n; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

void DynamicBatcher::SchedulerLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    wake_ = false;
    const auto now = SteadyClock::now();
    std::vector<RequestQueue::Completion> expired = queue_->Expire(now);
    std::optional<SteadyClock::time_point> wait_until = queue_->NextDeadline();
    for (auto& inst : instances_) {
      if (inst->busy || queue_->size() == 0) continue;
      RequestQueue::Decision d = queue_->Next(now, inst->index);
      if (d.batch.empty()) {
        if (d.retry_at && (!wait_until || *d.retry_at < *wait_until)) wait_until = d.retry_at;
        continue;  // a sequence queue may have work for another instance
      }
      inst->busy = true;
      for (const auto& r : d.batch) executing_.push_back(r.get());
      absl::MutexLock inst_lock(&inst->mu);
      inst->batch = std::move(d.batch);
    }
    if (!expired.empty()) {
      mu_.Unlock();
      for (auto& [req, status] : expired) {
        if (stats_) stats_->RequestDequeued();
        Complete(std::move(req), InferenceResponse{status, {}}, Timing{SteadyClock::now()});
      }
      mu_.Lock();
      continue;  // the queue may have changed while unlocked
    }
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wake_ || stop_; };
    if (wait_until) {
      mu_.AwaitWithDeadline(absl::Condition(&woken), AbslDeadline(*wait_until));
    } else {
      mu_.Await(absl::Condition(&woken));
    }
  }
}

void DynamicBatcher::WorkerLoop(Instance* inst) {
  for (;;) {
    std::vector<std::unique_ptr<InferenceRequest>> batch;
    {
      absl::MutexLock lock(&inst->mu);
      auto ready = [inst]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(inst->mu) {
        return inst->quit || !inst->batch.empty();
      };
      inst->mu.Await(absl::Condition(&ready));
      if (inst->batch.empty()) return;  // quit
      batch = std::move(inst->batch);
      inst->batch.clear();
    }
    Execute(inst, batch);
    absl::MutexLock lock(&mu_);
    queue_->Finished(inst->index, SteadyClock::now());
    inst->busy = false;
    wake_ = true;
  }
}

void DynamicBatcher::Execute(Instance* inst,
                             std::vector<std::unique_ptr<InferenceRequest>>& batch) {
  Timing timing{SteadyClock::now()};
  const uint64_t batch_requests = batch.size();
  if (stats_) {
    for (size_t i = 0; i < batch.size(); ++i) stats_->RequestDequeued();
    stats_->ExecutionStarted(batch_requests);
  }
  struct ExecutionEnd {
    ModelStats* stats;
    uint64_t n;
    ~ExecutionEnd() {
      if (stats) stats->ExecutionFinished(n);
    }
  } execution_end{stats_, batch_requests};
  auto unlist = [this](const std::vector<std::unique_ptr<InferenceRequest>>& done) {
    absl::MutexLock lock(&mu_);
    std::erase_if(executing_, [&](InferenceRequest* p) {
      return std::any_of(done.begin(), done.end(), [p](const auto& r) { return r.get() == p; });
    });
  };
  // Requests cancelled between batch formation and now are answered without running.
  std::vector<std::unique_ptr<InferenceRequest>> cancelled;
  for (auto& r : batch) {
    if (r->cancel->cancelled()) cancelled.push_back(std::move(r));
  }
  if (!cancelled.empty()) {
    std::erase(batch, nullptr);
    unlist(cancelled);
    for (auto& r : cancelled) {
      Complete(std::move(r), {Cancelled("request cancelled by the client"), {}}, timing);
    }
  }
  if (batch.empty()) return;

  const std::string model_name = batch.front()->model_name;
  int64_t total_rows = 0;
  std::vector<int64_t> rows;
  for (const auto& r : batch) {
    total_rows += r->batch_size;
    rows.push_back(r->batch_size);
  }
  const bool batched = batch.size() > 1;
  FlightEvent flight;  // flight recorder
  if (recorder_) {
    flight.work_id = ++batch_id_;
    flight.seqs = static_cast<int32_t>(batch.size());
    flight.rows = static_cast<int32_t>(total_rows);
    recorder_->BeginWork(inst->index, FlightRecorder::WorkKind::kBatch, flight.work_id,
                         timing.start);
    for (const auto& r : batch) {
      recorder_->RecordRequest(r->id, FlightRequestState::kRunning, flight.work_id);
    }
    flight.kind = FlightEventKind::kBatchBegin;
    recorder_->SetWorkRequests(
        inst->index, flight.seqs, [&batch](int i) -> std::string_view { return batch[i]->id; },
        flight);
  }

  std::vector<HostTensor> inputs = GatherInputs(batch);
  const auto t_input = SteadyClock::now();
  std::vector<HostTensor> outputs;
  // A decoupled model (one request per batch: it does not batch) sends its responses as it
  // goes; its outputs stay empty and the request's final answer only ends it.
  Status status = inst->model->decoupled() ? ExecuteDecoupled(*inst->model, *batch.front(), inputs)
                                           : inst->model->Execute(inputs, &outputs);
  const auto t_infer = SteadyClock::now();
  if (status.ok() && !inst->model->decoupled() && outputs.size() != inst->model->outputs().size()) {
    status = Internal("model '", model_name, "' produced ", outputs.size(), " outputs, expected ",
                      inst->model->outputs().size());
  }

  // Scatter outputs back to the requests, in the order each asked for them.
  std::vector<InferenceResponse> responses(batch.size());
  int64_t row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    InferenceResponse& resp = responses[i];
    resp.status = status;
    if (!status.ok()) continue;
    const InferenceRequest& r = *batch[i];
    std::vector<HostTensor*> order;
    if (r.requested_outputs.empty()) {
      for (auto& o : outputs) order.push_back(&o);
    } else {
      for (const auto& name : r.requested_outputs) {
        auto it = std::find_if(outputs.begin(), outputs.end(),
                               [&](const HostTensor& o) { return o.name == name; });
        if (it != outputs.end()) order.push_back(&*it);
      }
    }
    for (HostTensor* o : order) {
      if (!batched) {
        resp.outputs.push_back(r.requested_outputs.empty() ? std::move(*o) : *o);
        continue;
      }
      auto bytes = SliceRows(*o, total_rows, row, rows[i]);
      if (!bytes.ok()) {
        resp.status = bytes.status();
        resp.outputs.clear();
        break;
      }
      HostTensor part{o->name, o->datatype, o->shape, std::move(*bytes)};
      part.shape[0] = rows[i];
      resp.outputs.push_back(std::move(part));
    }
    row += rows[i];
  }
  const auto t_output = SteadyClock::now();
  for (const auto& r : batch) {  // tracing
    if (r->trace == nullptr || !r->trace->recording()) continue;
    r->trace->Span("queue", r->enqueued_at, timing.start);
    r->trace->Span("execute", timing.start, t_output,
                   {{"kiln.batch_requests", static_cast<int64_t>(batch.size())},
                    {"kiln.batch_rows", total_rows},
                    {"kiln.ok", int64_t{status.ok()}}});
  }
  timing.input = t_input - timing.start;
  timing.infer = t_infer - t_input;
  timing.output = t_output - t_infer;
  if (recorder_) {
    flight.kind = FlightEventKind::kBatchEnd;
    flight.ok = status.ok();
    flight.run_ns = timing.infer.count();
    flight.total_ns = std::chrono::nanoseconds(t_output - timing.start).count();
    recorder_->EndWork(inst->index, flight);
  }
  if (stats_ && status.ok()) {
    stats_->BatchExecuted(static_cast<uint64_t>(total_rows), timing.input, timing.infer,
                          timing.output);
  }
  if (!status.ok()) {
    spdlog::warn("model '{}' failed a batch of {} request(s): {}", model_name, batch.size(),
                 StatusMessage(status));
  }
  unlist(batch);
  for (size_t i = 0; i < batch.size(); ++i) {
    Complete(std::move(batch[i]), std::move(responses[i]), timing);
  }
}

// The ResponseSender a decoupled model gets: filters each response to the requested outputs
// and hands it to the request's on_response, unless the request was answered already.
class DynamicBatcher::Sender final : public ResponseSender {
 public:
  Sender(DynamicBatcher* batcher, InferenceRequest* request, size_t declared_outputs)
      : batcher_(batcher), request_(request), declared_outputs_(declared_outputs) {}

  Status Send(std::vector<HostTensor> outputs, bool final) override {
    if (final_sent_) {
      return FailedPrecondition("model '", request_->model_name,
                                "' sent a response after its final one");
    }
    if (outputs.size() != declared_outputs_) {
      return Internal("model '", request_->model_name, "' sent ", outputs.size(),
                      " outputs, expected ", declared_outputs_);
    }
    InferenceResponse resp;
    resp.final = final;
    if (request_->requested_outputs.empty()) {
      resp.outputs = std::move(outputs);
    } else {
      for (const std::string& name : request_->requested_outputs) {
        auto it = std::find_if(outputs.begin(), outputs.end(),
                               [&](const HostTensor& o) { return o.name == name; });
        if (it != outputs.end()) resp.outputs.push_back(std::move(*it));
      }
    }
    absl::MutexLock lock(&batcher_->respond_mu_);
    if (request_->answered.load() || request_->cancel->cancelled()) {
      return Cancelled("request cancelled");
    }
    final_sent_ = final;
    request_->on_response(std::move(resp));
    return OkStatus();
  }

  bool cancelled() const override {
    return request_->cancel->cancelled() || request_->answered.load();
  }

 private:
  DynamicBatcher* const batcher_;
  InferenceRequest* const request_;
  const size_t declared_outputs_;
  bool final_sent_ = false;
};

Status DynamicBatcher::ExecuteDecoupled(TensorModel& model, InferenceRequest& request,
                                        std::span<const HostTensor> inputs) {
  if (!request.on_response) {
    return FailedPrecondition("model '", request.model_name, "' is decoupled: no response sink");
  }
  Sender sender(this, &request, model.outputs().size());
  return model.ExecuteDecoupled(inputs, sender);
}

void DynamicBatcher::Complete(std::unique_ptr<InferenceRequest> r, InferenceResponse&& resp,
                              const Timing& timing) {
  if (r->answered.exchange(true)) return;  // cut off by Drain already
  if (recorder_) {
    const StatusCode code = resp.status.code();
    recorder_->RecordRequest(r->id,
                             code == StatusCode::kOk          ? FlightRequestState::kFinished
                             : code == StatusCode::kCancelled ? FlightRequestState::kCancelled
                             : code == StatusCode::kDeadlineExceeded ? FlightRequestState::kTimedOut
                                                                     : FlightRequestState::kFailed,
                             0, code == StatusCode::kOk ? "" : absl::StatusCodeToString(code));
  }
  const auto now = SteadyClock::now();
  if (stats_) {
    if (resp.status.ok()) {
      stats_->RequestSucceeded(now - r->received_at, timing.start - r->enqueued_at, timing.input,
                               timing.infer, timing.output);
    } else {
      stats_->RequestFailed(resp.status, now - r->received_at);
    }
  }
  if (r->on_complete) r->on_complete(std::move(resp));
}

int DynamicBatcher::Drain(SteadyClock::time_point deadline) {
  std::vector<std::unique_ptr<InferenceRequest>> queued;
  std::vector<std::pair<std::function<void(InferenceResponse &&)>, std::string>> executing;
  std::vector<SteadyClock::time_point> executing_received;
  {
    absl::MutexLock lock(&mu_);
    accepting_ = false;
    wake_ = true;
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return queue_->size() == 0 && executing_.empty();
    };
    mu_.AwaitWithDeadline(absl::Condition(&idle), AbslDeadline(deadline));
    queued = queue_->TakeAll();
    // Answer executing requests now; their workers find them answered and drop the result.
    // respond_mu_: a decoupled model's response in flight finishes first, and none follows.
    absl::MutexLock respond_lock(&respond_mu_);
    for (InferenceRequest* r : executing_) {
      r->cancel->Cancel();  // a decoupled model stops at its next response or wait
      if (r->answered.exchange(true)) continue;
      executing.emplace_back(std::move(r->on_complete), r->model_name);
      executing_received.push_back(r->received_at);
    }
  }
  const int cut = static_cast<int>(queued.size() + executing.size());
  for (auto& r : queued) {
    if (stats_) stats_->RequestDequeued();
    Status s = Unavailable("cancelled: model '", r->model_name, "' is shutting down");
    Complete(std::move(r), {std::move(s), {}}, Timing{SteadyClock::now()});
  }
  for (size_t i = 0; i < executing.size(); ++i) {
    Status s = Unavailable("cancelled: model '", executing[i].second,
                           "' is shutting down and the request did not finish in time");
    if (stats_) stats_->RequestFailed(s, SteadyClock::now() - executing_received[i]);
    if (executing[i].first) executing[i].first({s, {}});
  }
  return cut;
}

}  // namespace kiln
