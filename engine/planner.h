// The memory planner: places buffers with known live ranges in one arena.
//
// Liveness-based, greedy by size (TFLite's "greedy by size" strategy): buffers are placed
// largest first, each at the lowest aligned offset that overlaps no already placed buffer
// whose live range intersects its own. Buffers whose ranges do not intersect share memory.
// The Program sizes buffers at the symbols' upper bounds, so one plan serves every binding.
//
// Pure function; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kiln {

struct BufferRequest {
  int64_t bytes = 0;
  int32_t first = 0;  // first step (launch index) that writes it
  int32_t last = 0;   // last step that reads it (inclusive)
};

struct MemoryPlan {
  std::vector<int64_t> offsets;  // per request, a multiple of the alignment
  int64_t peak = 0;              // arena bytes needed
};

// REQUIRES: alignment is a power of two; first <= last for every request.
MemoryPlan PlanMemory(std::span<const BufferRequest> requests, int64_t alignment);

}  // namespace kiln
