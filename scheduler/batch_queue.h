// The dynamic batcher's queue and batch-formation rules, with Triton's semantics, as pure
// logic: time is passed in, nothing blocks, nothing runs a model. DynamicBatcher drives it
// from a thread; tests drive it with a fake clock.
//
// Rules (Triton's ModelDynamicBatching / ModelQueuePolicy):
// - Requests are ordered by priority level (1 is highest), FIFO within a level. Requests whose
//   queue timeout expired under a DELAY policy move behind every other request.
// - A request's queue timeout is its `timeout` parameter if the level's policy allows an
//   override, else the policy's default_timeout_microseconds (0 = none). On expiry, REJECT
//   completes it with DEADLINE_EXCEEDED; DELAY keeps it (demoted).
// - max_queue_size (per level, 0 = unbounded): a request arriving at a full level is refused
//   at once with RESOURCE_EXHAUSTED.
// - A batch is formed from the head of the queue, taking requests in order while their
//   non-batch input shapes match the head's and the total stays <= max_batch_size; it stops
//   at the first request that does not fit. It is sent at once if it is full, if the next
//   request cannot join, or if its size reached a preferred_batch_size (the largest one
//   reachable at a request boundary is used); otherwise it waits until the oldest request in
//   it has been queued max_queue_delay_microseconds.
// - Without dynamic batching, or with max_batch_size 0, every request executes alone.
//
// Thread-safety: none; the owner serializes access.
#pragma once

#include <array>
#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "config/config.h"
#include "engine/base/status.h"
#include "scheduler/inference_request.h"

namespace kiln {

class BatchQueue {
 public:
  struct Options {
    int max_batch_size = 0;
    // nullopt: no dynamic batching (one request per execution, FIFO, no queue policy).
    std::optional<config::DynamicBatchingConfig> batching;
  };
  explicit BatchQueue(Options options);

  // Resolves the request's priority level and deadline and queues it. On success the queue
  // owns the request (`request` is null); on error the caller keeps it. Errors:
  // InvalidArgument for a priority outside the configured levels, ResourceExhausted when
  // the level's queue is full.
  Status Enqueue(std::unique_ptr<InferenceRequest>& request, SteadyClock::time_point now);

  using Completion = std::pair<std::unique_ptr<InferenceRequest>, Status>;

  // Removes cancelled requests (CANCELLED) and, at or past their deadline, REJECT-policy
  // requests (DEADLINE_EXCEEDED); demotes expired DELAY-policy requests. Returns what was
  // removed with the status to complete each with.
  std::vector<Completion> Expire(SteadyClock::time_point now);

  struct Decision {
    std::vector<std::unique_ptr<InferenceRequest>> batch;  // empty: nothing to run now
    // When to ask again if nothing arrives before: the batch delay of a partial batch.
    std::optional<SteadyClock::time_point> retry_at;
  };
  // Picks the next batch to execute now (removing it from the queue), or says when to ask
  // again. Call only when a model instance is free to run it.
  Decision Next(SteadyClock::time_point now);

  // Earliest queue deadline of any request still subject to one.
  std::optional<SteadyClock::time_point> NextDeadline() const;

  size_t size() const;
  bool empty() const { return size() == 0; }

  // Removes and returns every queued request (shutdown).
  std::vector<std::unique_ptr<InferenceRequest>> TakeAll();

 private:
  using Queue = std::deque<std::unique_ptr<InferenceRequest>>;
  const config::QueuePolicy& PolicyFor(uint32_t level) const;
  // Visits queued requests in scheduling order; stops when fn returns false.
  template <typename Fn>
  void ForEachInOrder(Fn&& fn) const;
  std::unique_ptr<InferenceRequest> PopFront();

  Options options_;
  config::QueuePolicy default_policy_;  // for the no-dynamic-batching case
  std::vector<Queue> levels_;           // index 0 = level 1 (or the single level)
  Queue delayed_;
  size_t size_ = 0;
};

// True if two requests' inputs may share a batch: same inputs with the same shapes except
// dimension 0. REQUIRES: both were validated against the same model.
bool BatchCompatible(const InferenceRequest& a, const InferenceRequest& b);

}  // namespace kiln
