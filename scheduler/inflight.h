// Admission control across front ends: at most `limit` requests in flight (queued or
// executing) at once; past it, new requests are refused at once. Also counts what is in
// flight so that shutdown can wait for it.
//
// Thread-safety: thread-safe; tickets may be released from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "engine/base/status.h"

namespace kiln {

class InflightLimiter {
 public:
  explicit InflightLimiter(int64_t limit) : limit_(limit) {}

  // Releases its slot when destroyed.
  class Ticket {
   public:
    Ticket() = default;
    explicit Ticket(InflightLimiter* owner) : owner_(owner) {}
    Ticket(Ticket&& o) noexcept : owner_(o.owner_) { o.owner_ = nullptr; }
    Ticket& operator=(Ticket&& o) noexcept;
    Ticket(const Ticket&) = delete;
    ~Ticket() { Release(); }
    void Release();

   private:
    InflightLimiter* owner_ = nullptr;
  };

  // A ticket, or ResourceExhausted naming the limit.
  StatusOr<Ticket> Acquire();

  int64_t inflight() const { return inflight_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

  // Waits until nothing is in flight or `deadline` passes; true if nothing is in flight.
  bool WaitIdle(absl::Time deadline);

 private:
  const int64_t limit_;
  std::atomic<int64_t> inflight_{0};
  absl::Mutex mu_;  // only for WaitIdle's wake-ups
};

}  // namespace kiln
