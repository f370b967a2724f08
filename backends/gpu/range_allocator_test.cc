#include "backends/gpu/range_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace kiln::gpu {
namespace {

TEST(RangeAllocatorTest, BestFitSplitsAndFreedNeighboursCoalesce) {
  RangeAllocator r(256);
  EXPECT_FALSE(r.Allocate(1).has_value()) << "nothing to allocate before the first Grow";
  r.Grow(4096);
  EXPECT_EQ(r.tail_free(), 4096u);
  const uint64_t a = *r.Allocate(1000);  // rounded to 1024
  const uint64_t b = *r.Allocate(512);
  const uint64_t c = *r.Allocate(1024);
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 1024u);
  EXPECT_EQ(c, 1536u);
  EXPECT_EQ(r.free_bytes(), 4096u - 2560u);
  r.Free(a, 1000);
  // Best fit: the 512 B request takes the 1 KiB hole, not the 1.5 KiB tail.
  EXPECT_EQ(r.tail_free(), 1536u);
  const uint64_t d = *r.Allocate(512);
  EXPECT_EQ(d, 0u);
  r.Free(d, 512);
  r.Free(c, 1024);
  r.Free(b, 512);
  EXPECT_EQ(r.free_ranges(), 1) << "every freed range merged back into one";
  EXPECT_EQ(r.free_bytes(), 4096u);
  EXPECT_EQ(*r.Allocate(4096), 0u);
  EXPECT_FALSE(r.Allocate(256).has_value());
}

TEST(RangeAllocatorTest, GrowingExtendsTheFreeTail) {
  RangeAllocator r(512);
  r.Grow(2048);
  const uint64_t a = *r.Allocate(1536);
  EXPECT_EQ(r.tail_free(), 512u);
  EXPECT_FALSE(r.Allocate(1024).has_value());
  r.Grow(r.capacity() + r.Align(1024 - r.tail_free()));  // what the device allocator does
  EXPECT_EQ(*r.Allocate(1024), 1536u);
  EXPECT_EQ(r.tail_free(), 0u);
  r.Free(a, 1536);
  EXPECT_EQ(r.free_bytes(), 1536u);
}

// Random allocations and frees never overlap and always add up.
TEST(RangeAllocatorTest, RandomTrafficKeepsRangesDisjoint) {
  RangeAllocator r(64);
  r.Grow(1 << 20);
  std::mt19937 rng(1);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  uint64_t used = 0;
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t bytes = 1 + rng() % 20000;
      if (std::optional<uint64_t> o = r.Allocate(bytes)) {
        live.emplace_back(*o, bytes);
        used += r.Align(bytes);
      }
    } else {
      const size_t k = rng() % live.size();
      r.Free(live[k].first, live[k].second);
      used -= r.Align(live[k].second);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    ASSERT_EQ(r.free_bytes() + used, r.capacity());
  }
  std::sort(live.begin(), live.end());
  for (size_t i = 1; i < live.size(); ++i) {
    ASSERT_LE(live[i - 1].first + r.Align(live[i - 1].second), live[i].first);
  }
  for (auto [o, b] : live) r.Free(o, b);
  EXPECT_EQ(r.free_ranges(), 1);
  EXPECT_EQ(r.free_bytes(), r.capacity());
}

}  // namespace
}  // namespace kiln::gpu
