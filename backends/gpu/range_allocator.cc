#include "backends/gpu/range_allocator.h"

#include <iterator>

#include "engine/base/status.h"

namespace kiln::gpu {

void RangeAllocator::Insert(uint64_t offset, uint64_t size) {
  by_offset_.emplace(offset, size);
  by_size_.emplace(size, offset);
}

void RangeAllocator::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  auto [lo, hi] = by_size_.equal_range(it->second);
  for (auto s = lo; s != hi; ++s) {
    if (s->second == it->first) {
      by_size_.erase(s);
      break;
    }
  }
  by_offset_.erase(it);
}

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t bytes) {
  const uint64_t size = Align(bytes);
  auto best = by_size_.lower_bound(size);
  if (best == by_size_.end()) return std::nullopt;
  const uint64_t offset = best->second, have = best->first;
  Erase(by_offset_.find(offset));
  if (have > size) Insert(offset + size, have - size);
  free_bytes_ -= size;
  return offset;
}

void RangeAllocator::Free(uint64_t offset, uint64_t bytes) {
  uint64_t size = Align(bytes);
  KILN_CHECK(offset + size <= capacity_, "RangeAllocator::Free past the capacity");
  free_bytes_ += size;
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first == offset + size) {  // merge the next range
    size += next->second;
    Erase(next);
  }
  auto it = by_offset_.lower_bound(offset);
  if (it != by_offset_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == offset) {  // merge into the previous range
      offset = prev->first;
      size += prev->second;
      Erase(prev);
    }
  }
  Insert(offset, size);
}

void RangeAllocator::Grow(uint64_t new_capacity) {
  KILN_CHECK(new_capacity >= capacity_ && Align(new_capacity) == new_capacity,
             "RangeAllocator::Grow must grow to an aligned capacity");
  if (new_capacity == capacity_) return;
  const uint64_t old = capacity_;
  capacity_ = new_capacity;
  Free(old, new_capacity - old);
}

uint64_t RangeAllocator::tail_free() const {
  if (by_offset_.empty()) return 0;
  const auto last = std::prev(by_offset_.end());
  return last->first + last->second == capacity_ ? last->second : 0;
}

}  // namespace kiln::gpu
