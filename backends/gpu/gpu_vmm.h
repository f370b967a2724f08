// An expandable segment: one reserved range of device virtual addresses whose front is backed
// by physical pages mapped on demand (the driver's virtual memory management: cuMemCreate,
// cuMemAddressReserve, cuMemMap, cuMemSetAccess), so the allocator grows one contiguous range
// instead of holding many separate cudaMalloc blocks that fragment — PyTorch's
// `expandable_segments`. The driver API is reached through cudaGetDriverEntryPointByVersion
// (never -lcuda), so binaries still start without a driver.
//
// Thread-safety: none (the device's allocator lock guards it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/base/status.h"

namespace kiln::gpu {

class ExpandableSegment {
 public:
  // Reserves `reserve_bytes` (rounded up to the allocation granularity) of addresses on device
  // `ordinal`; maps nothing yet. Unavailable when the driver lacks the entry points or the
  // device does not support virtual memory management.
  static StatusOr<std::unique_ptr<ExpandableSegment>> Create(int ordinal, uint64_t reserve_bytes);
  ~ExpandableSegment();  // unmaps and releases everything, frees the addresses

  // Maps pages until at least [0, bytes) is backed (in steps of the granularity).
  // ResourceExhausted when the device has no memory for them; past the reservation,
  // InvalidArgument.
  Status MapTo(uint64_t bytes);

  char* base() const { return reinterpret_cast<char*>(base_); }
  uint64_t mapped() const { return mapped_; }
  uint64_t reserved() const { return reserved_; }
  uint64_t granularity() const { return granularity_; }
  int64_t chunks() const { return static_cast<int64_t>(chunks_.size()); }

 private:
  struct Api;
  ExpandableSegment() = default;

  const Api* api_ = nullptr;
  int ordinal_ = 0;
  unsigned long long base_ = 0;  // CUdeviceptr
  uint64_t reserved_ = 0, mapped_ = 0, granularity_ = 0;
  std::vector<std::pair<uint64_t, unsigned long long>>
      chunks_;  // size, CUmemGenericAllocationHandle
};

}  // namespace kiln::gpu
