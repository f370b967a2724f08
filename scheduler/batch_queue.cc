#include "scheduler/batch_queue.h"

#include <algorithm>

namespace kiln {

BatchQueue::BatchQueue(Options options) : options_(std::move(options)) {
  uint32_t levels = 1;
  if (options_.batching && options_.batching->priority_levels > 0) {
    levels = options_.batching->priority_levels;
  }
  levels_.resize(levels);
}

const config::QueuePolicy& BatchQueue::PolicyFor(uint32_t level) const {
  if (!options_.batching) return default_policy_;
  const auto& b = *options_.batching;
  auto it = b.priority_queue_policy.find(level);
  return it != b.priority_queue_policy.end() ? it->second : b.default_queue_policy;
}

Status BatchQueue::Enqueue(std::unique_ptr<InferenceRequest>& request,
                           SteadyClock::time_point now) {
  InferenceRequest& r = *request;
  uint32_t level = 0;  // 0: the single level of a model without priority levels
  const uint32_t num_levels = options_.batching ? options_.batching->priority_levels : 0;
  if (num_levels == 0) {
    if (r.priority != 0) {
      return InvalidArgument("priority ", r.priority, " given but model '", r.model_name,
                             "' has no priority levels (dynamic_batching.priority_levels is 0); "
                             "omit the parameter or send 0");
    }
  } else if (r.priority == 0) {
    level = options_.batching->default_priority_level;
  } else if (r.priority > num_levels) {
    return InvalidArgument("priority ", r.priority, " is out of range: model '", r.model_name,
                           "' has priority levels 1 (highest) to ", num_levels,
                           "; 0 selects the default level ",
                           options_.batching->default_priority_level);
  } else {
    level = static_cast<uint32_t>(r.priority);
  }
  const config::QueuePolicy& policy = PolicyFor(level);
  Queue& queue = levels_[level == 0 ? 0 : level - 1];
  if (policy.max_queue_size > 0 && queue.size() >= policy.max_queue_size) {
    return ResourceExhausted("the queue of model '", r.model_name, "'",
                             num_levels > 0 ? absl::StrCat(" at priority level ", level) : "",
                             " is full (max_queue_size ", policy.max_queue_size, "); retry later");
  }
  uint64_t timeout_us = policy.default_timeout_microseconds;
  if (r.timeout_us.has_value() && policy.allow_timeout_override) timeout_us = *r.timeout_us;
  r.priority_level = level;
  r.enqueued_at = now;
  r.deadline.reset();
  if (timeout_us > 0) r.deadline = now + std::chrono::microseconds(timeout_us);
  queue.push_back(std::move(request));
  ++size_;
  return OkStatus();
}

std::vector<BatchQueue::Completion> BatchQueue::Expire(SteadyClock::time_point now) {
  std::vector<Completion> out;
  auto sweep = [&](Queue& q) {
    for (auto it = q.begin(); it != q.end();) {
      InferenceRequest& r = **it;
      if (r.cancel->cancelled()) {
        out.emplace_back(std::move(*it), Cancelled("request cancelled by the client"));
      } else if (r.deadline && now >= *r.deadline) {
        const config::QueuePolicy& policy = PolicyFor(r.priority_level);
        if (policy.timeout_action == config::QueuePolicy::TimeoutAction::kDelay) {
          r.deadline.reset();
          r.delayed = true;
          delayed_.push_back(std::move(*it));
        } else {
          const auto waited =
              std::chrono::duration_cast<std::chrono::microseconds>(now - r.enqueued_at);
          out.emplace_back(std::move(*it),
                           DeadlineExceeded("request timed out after ", waited.count(),
                                            " us in the queue of model '", r.model_name,
                                            "' (queue policy timeout_action REJECT)"));
        }
      } else {
        ++it;
        continue;
      }
      it = q.erase(it);
    }
  };
  for (Queue& q : levels_) sweep(q);
  // Delayed requests have no deadline; only cancellation applies.
  for (auto it = delayed_.begin(); it != delayed_.end();) {
    if ((*it)->cancel->cancelled()) {
      out.emplace_back(std::move(*it), Cancelled("request cancelled by the client"));
      it = delayed_.erase(it);
    } else {
      ++it;
    }
  }
  // Moved-to-delayed requests are still queued; only completions leave.
  size_ -= out.size();
  return out;
}

template <typename Fn>
void BatchQueue::ForEachInOrder(Fn&& fn) const {
  for (const Queue& q : levels_) {
    for (const auto& r : q) {
      if (!fn(*r)) return;
    }
  }
  for (const auto& r : delayed_) {
    if (!fn(*r)) return;
  }
}

std::unique_ptr<InferenceRequest> BatchQueue::PopFront() {
  for (Queue& q : levels_) {
    if (!q.empty()) {
      auto r = std::move(q.front());
      q.pop_front();
      --size_;
      return r;
    }
  }
  auto r = std::move(delayed_.front());
  delayed_.pop_front();
  --size_;
  return r;
}

BatchQueue::Decision BatchQueue::Next(SteadyClock::time_point now) {
  Decision d;
  if (size_ == 0) return d;
  const bool batches = options_.batching.has_value() && options_.max_batch_size > 0;
  if (!batches) {
    d.batch.push_back(PopFront());
    return d;
  }
  const auto& cfg = *options_.batching;
  const int64_t max = options_.max_batch_size;

  // Scan the candidate batch: requests in order while they fit.
  const InferenceRequest* head = nullptr;
  int64_t total = 0;
  size_t count = 0;
  size_t preferred_count = 0;  // requests making up the best preferred size so far
  bool blocked = false;        // a further request exists but cannot join
  SteadyClock::time_point oldest = SteadyClock::time_point::max();
  ForEachInOrder([&](const InferenceRequest& r) {
    if (head == nullptr) {
      head = &r;
    } else if (!BatchCompatible(*head, r) || total + r.batch_size > max) {
      blocked = true;
      return false;
    }
    total += r.batch_size;
    ++count;
    oldest = std::min(oldest, r.enqueued_at);
    if (std::find(cfg.preferred_batch_size.begin(), cfg.preferred_batch_size.end(), total) !=
        cfg.preferred_batch_size.end()) {
      preferred_count = count;  // sizes only grow, so the last hit is the largest
    }
    return total < max;
  });

  size_t take = 0;
  if (total >= max || blocked) {
    take = count;
  } else if (preferred_count > 0) {
    take = preferred_count;
  } else {
    const auto delay = std::chrono::microseconds(cfg.max_queue_delay_microseconds);
    if (now >= oldest + delay) {
      take = count;
    } else {
      d.retry_at = oldest + delay;
      return d;
    }
  }
  d.batch.reserve(take);
  for (size_t i = 0; i < take; ++i) d.batch.push_back(PopFront());
  return d;
}

std::optional<SteadyClock::time_point> BatchQueue::NextDeadline() const {
  std::optional<SteadyClock::time_point> earliest;
  for (const Queue& q : levels_) {
    for (const auto& r : q) {
      if (r->deadline && (!earliest || *r->deadline < *earliest)) earliest = r->deadline;
    }
  }
  return earliest;
}

size_t BatchQueue::size() const { return size_; }

std::vector<std::unique_ptr<InferenceRequest>> BatchQueue::TakeAll() {
  std::vector<std::unique_ptr<InferenceRequest>> all;
  while (size_ > 0) all.push_back(PopFront());
  return all;
}

bool BatchCompatible(const InferenceRequest& a, const InferenceRequest& b) {
  if (a.inputs.size() != b.inputs.size()) return false;
  for (size_t i = 0; i < a.inputs.size(); ++i) {
    const auto& sa = a.inputs[i].shape;
    const auto& sb = b.inputs[i].shape;
    if (sa.size() != sb.size() || sa.empty()) return false;
    if (!std::equal(sa.begin() + 1, sa.end(), sb.begin() + 1)) return false;
  }
  return true;
}

}  // namespace kiln
