// Runs a tensor model's requests: a scheduling thread forms batches from a BatchQueue (see
// batch_queue.h for the rules) and hands each to an idle model instance, each instance on
// its own worker thread. Requests are completed exactly once through their on_complete; a
// decoupled model's responses go out before that through on_response (inference_request.h).
//
// Thread-safety: Enqueue, WakeUp, pending, AwaitExecuting and Drain may be called from any
// thread.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "scheduler/batch_queue.h"
#include "scheduler/flight_recorder.h"
#include "scheduler/model_stats.h"
#include "scheduler/request_queue.h"

namespace kiln {

class DynamicBatcher {
 public:
  // REQUIRES: instances non-empty; `stats` outlives the batcher. `recorder` (null: none)
  // records batches (work slot i: instance i) and request state changes; it must outlive the
  // batcher and have a work slot per instance.
  DynamicBatcher(BatchQueue::Options options, std::vector<std::unique_ptr<TensorModel>> instances,
                 ModelStats* stats, FlightRecorder* recorder = nullptr);
  // The same with another queue (e.g. sequence_batcher.h's SequenceQueue), which is told of
  // each finished batch (RequestQueue::Finished) before its instance takes the next.
  DynamicBatcher(std::unique_ptr<RequestQueue> queue,
                 std::vector<std::unique_ptr<TensorModel>> instances, ModelStats* stats,
                 FlightRecorder* recorder = nullptr);
  // Drains with an immediate deadline and joins the threads.
  ~DynamicBatcher();

  DynamicBatcher(const DynamicBatcher&) = delete;
  DynamicBatcher& operator=(const DynamicBatcher&) = delete;

  // Queues a validated request (see BatchQueue::Enqueue) after the model's CheckRequest. On success
  // the batcher owns it
  // (`request` becomes null); on error the caller keeps it. After Drain began: Unavailable.
  Status Enqueue(std::unique_ptr<InferenceRequest>& request);

  // Wakes the scheduling thread, e.g. after a request's CancelFlag was set, so the request
  // leaves the queue now rather than at the next batch.
  void WakeUp();

  // Requests queued or executing.
  size_t pending() const;
  // Blocks until exactly `n` requests are handed to instances and not yet answered by them,
  // or `timeout` passed; returns whether that holds (tests order themselves by it).
  bool AwaitExecuting(size_t n, absl::Duration timeout) const;

  // Stops accepting requests and waits until every queued and executing request has
  // completed, or until `deadline`. Then completes whatever is left with UNAVAILABLE
  // ("cancelled: model shutting down") — requests still executing get that answer now and
  // their late results are discarded. Returns the number of requests cut off that way.
  int Drain(SteadyClock::time_point deadline);

 private:
  struct Instance;
  struct InFlight;
  class Sender;

  void SchedulerLoop();
  void WorkerLoop(Instance* instance);
  struct Timing {
    SteadyClock::time_point start;  // left the queue
    std::chrono::nanoseconds input{0}, infer{0}, output{0};
  };
  void Execute(Instance* instance, std::vector<std::unique_ptr<InferenceRequest>>& batch);
  // Runs one request of a decoupled model, its responses through request.on_response.
  Status ExecuteDecoupled(TensorModel& model, InferenceRequest& request,
                          std::span<const HostTensor> inputs);
  // Answers a request unless it was answered already (see InferenceRequest::answered).
  void Complete(std::unique_ptr<InferenceRequest> request, InferenceResponse&& response,
                const Timing& timing);

  ModelStats* const stats_;
  FlightRecorder* const recorder_;
  std::atomic<uint64_t> batch_id_{0};  // the flight recorder's batch ids
  mutable absl::Mutex mu_;
  const std::unique_ptr<RequestQueue> queue_ ABSL_PT_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  // Requests handed to instances and not yet answered by them; Drain may answer these
  // early. Pointers stay valid while listed (workers unlist before completing).
  std::vector<InferenceRequest*> executing_ ABSL_GUARDED_BY(mu_);
  // Held while a decoupled model's response goes to on_response, and by Drain while it
  // answers executing requests, so no response is delivered during or after their answer.
  // Order: mu_ before respond_mu_.
  absl::Mutex respond_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<std::unique_ptr<Instance>> instances_;
  std::thread scheduler_thread_;
};

}  // namespace kiln
