// Best-fit allocation of ranges of one growing address range [0, capacity): the bookkeeping of
// an expandable segment (gpu_vmm.h), which maps device pages at its end as it grows instead of
// holding many separate cudaMalloc blocks. Freed ranges coalesce with their free neighbours,
// so memory freed by one shape of request serves any other.
//
// Thread-safety: none (the device's allocator lock guards it).
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace kiln::gpu {

class RangeAllocator {
 public:
  // Every offset and size is a multiple of `alignment` (a power of two).
  explicit RangeAllocator(uint64_t alignment) : alignment_(alignment) {}

  // The smallest free range that fits `bytes` (rounded up to the alignment), split; nullopt
  // when none does. REQUIRES: bytes > 0.
  std::optional<uint64_t> Allocate(uint64_t bytes);
  // Returns an allocated range. REQUIRES: exactly a range Allocate returned, not yet freed.
  void Free(uint64_t offset, uint64_t bytes);
  // Adds [capacity, new_capacity) as free. REQUIRES: new_capacity >= capacity, aligned.
  void Grow(uint64_t new_capacity);

  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  // The free range that ends at the capacity (0 if the last byte is allocated): growing by
  // `bytes - tail_free()` makes room for `bytes`.
  uint64_t tail_free() const;
  uint64_t Align(uint64_t bytes) const { return (bytes + alignment_ - 1) & ~(alignment_ - 1); }
  int64_t free_ranges() const { return static_cast<int64_t>(by_offset_.size()); }

 private:
  void Insert(uint64_t offset, uint64_t size);
  void Erase(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t alignment_;
  uint64_t capacity_ = 0;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;     // free ranges: offset -> size
  std::multimap<uint64_t, uint64_t> by_size_;  // the same: size -> offset
};

}  // namespace kiln::gpu
