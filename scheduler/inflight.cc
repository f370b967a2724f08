#include "scheduler/inflight.h"

namespace kiln {

InflightLimiter::Ticket& InflightLimiter::Ticket::operator=(Ticket&& o) noexcept {
  if (this != &o) {
    Release();
    owner_ = o.owner_;
    o.owner_ = nullptr;
  }
  return *this;
}

void InflightLimiter::Ticket::Release() {
  if (!owner_) return;
  InflightLimiter* owner = owner_;
  owner_ = nullptr;
  if (owner->inflight_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    absl::MutexLock lock(&owner->mu_);  // wakes WaitIdle
  }
}

StatusOr<InflightLimiter::Ticket> InflightLimiter::Acquire() {
  int64_t n = inflight_.fetch_add(1, std::memory_order_acq_rel);
  if (n >= limit_) {
    inflight_.fetch_sub(1, std::memory_order_acq_rel);
    return ResourceExhausted("too many requests in flight (", limit_,
                             ", server.max_inflight_requests); retry later");
  }
  return Ticket(this);
}

bool InflightLimiter::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this] { return inflight_.load(std::memory_order_acquire) == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

}  // namespace kiln
