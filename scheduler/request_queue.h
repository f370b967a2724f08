// The queue a DynamicBatcher drives: where requests wait and how batches are formed. Two
// implementations: the dynamic batcher's BatchQueue (batch_queue.h, wrapped in
// dynamic_batcher.cc) and the sequence batcher's SequenceQueue (sequence_batcher.h).
//
// Implementations are pure logic: time is passed in, nothing blocks, nothing runs a model.
// Thread-safety: none; DynamicBatcher calls every method under its mutex.
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "engine/base/status.h"
#include "scheduler/inference_request.h"

namespace kiln {

class RequestQueue {
 public:
  virtual ~RequestQueue() = default;

  // Queues a validated request (PrepareRequest done). On success the queue owns it
  // (`request` is null); on error the caller keeps it and answers it with the error.
  virtual Status Enqueue(std::unique_ptr<InferenceRequest>& request,
                         SteadyClock::time_point now) = 0;

  using Completion = std::pair<std::unique_ptr<InferenceRequest>, Status>;
  // Removes requests that must be answered without running (cancelled, timed out) and does
  // other time-driven housekeeping. Returns what was removed and the status to answer with.
  virtual std::vector<Completion> Expire(SteadyClock::time_point now) = 0;

  struct Decision {
    std::vector<std::unique_ptr<InferenceRequest>> batch;  // empty: nothing for it now
    // When to ask again if nothing arrives before (e.g. a batch delay).
    std::optional<SteadyClock::time_point> retry_at;
  };
  // The next batch for model instance `instance` (which is idle), removed from the queue.
  virtual Decision Next(SteadyClock::time_point now, int instance) = 0;

  // The batch last handed to `instance` by Next has been executed and answered.
  virtual void Finished(int instance, SteadyClock::time_point now) {
    (void)instance;
    (void)now;
  }

  // The earliest time Expire has something to do; nullopt: none.
  virtual std::optional<SteadyClock::time_point> NextDeadline() const = 0;

  // Requests queued (not handed out by Next).
  virtual size_t size() const = 0;

  // Removes and returns every queued request (shutdown).
  virtual std::vector<std::unique_ptr<InferenceRequest>> TakeAll() = 0;
};

}  // namespace kiln
