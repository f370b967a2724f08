#include "engine/planner.h"

#include <algorithm>
#include <numeric>

#include "engine/base/status.h"

namespace kiln {

MemoryPlan PlanMemory(std::span<const BufferRequest> requests, int64_t alignment) {
  KILN_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0,
             "alignment must be a power of two");
  const size_t n = requests.size();
  MemoryPlan plan;
  plan.offsets.assign(n, 0);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Largest first; ties by earlier start keep the result deterministic.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (requests[a].bytes != requests[b].bytes) return requests[a].bytes > requests[b].bytes;
    return requests[a].first < requests[b].first;
  });
  auto align = [&](int64_t v) { return (v + alignment - 1) & ~(alignment - 1); };
  std::vector<size_t> placed;
  std::vector<std::pair<int64_t, int64_t>> busy;  // [begin, end) of live-overlapping buffers
  for (size_t idx : order) {
    const BufferRequest& r = requests[idx];
    KILN_CHECK(r.first <= r.last, "buffer live range is empty");
    if (r.bytes == 0) continue;
    busy.clear();
    for (size_t p : placed) {
      const BufferRequest& q = requests[p];
      if (q.last < r.first || r.last < q.first) continue;  // never alive together
      busy.emplace_back(plan.offsets[p], plan.offsets[p] + q.bytes);
    }
    std::sort(busy.begin(), busy.end());
    // The first gap that fits, scanning up from 0.
    int64_t offset = 0;
    for (const auto& [begin, end] : busy) {
      if (offset + r.bytes <= begin) break;
      offset = std::max(offset, align(end));
    }
    plan.offsets[idx] = offset;
    plan.peak = std::max(plan.peak, offset + r.bytes);
    placed.push_back(idx);
  }
  plan.peak = align(plan.peak);
  return plan;
}

}  // namespace kiln
