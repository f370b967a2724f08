#include "engine/planner.h"

#include <gtest/gtest.h>

#include <random>

namespace kiln {
namespace {

void ExpectValid(std::span<const BufferRequest> r, const MemoryPlan& p, int64_t alignment) {
  ASSERT_EQ(p.offsets.size(), r.size());
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(p.offsets[i] % alignment, 0);
    EXPECT_LE(p.offsets[i] + r[i].bytes, p.peak);
    for (size_t j = i + 1; j < r.size(); ++j) {
      const bool live_together = !(r[i].last < r[j].first || r[j].last < r[i].first);
      const bool overlap =
          p.offsets[i] < p.offsets[j] + r[j].bytes && p.offsets[j] < p.offsets[i] + r[i].bytes;
      if (r[i].bytes > 0 && r[j].bytes > 0 && live_together) {
        EXPECT_FALSE(overlap) << "buffers " << i << " and " << j << " overlap while both live";
      }
    }
  }
}

TEST(PlannerTest, ChainReusesMemory) {
  // a -> b -> c -> d: each buffer dies at the next step, so two slots suffice.
  std::vector<BufferRequest> r = {{1000, 0, 1}, {1000, 1, 2}, {1000, 2, 3}, {1000, 3, 4}};
  MemoryPlan p = PlanMemory(r, 64);
  ExpectValid(r, p, 64);
  EXPECT_EQ(p.peak, 2048);  // 2 * align(1000)
  EXPECT_EQ(p.offsets[0], p.offsets[2]);
}

TEST(PlannerTest, AllLiveTogetherNeedsTheSum) {
  std::vector<BufferRequest> r = {{64, 0, 5}, {128, 1, 5}, {256, 2, 5}};
  MemoryPlan p = PlanMemory(r, 64);
  ExpectValid(r, p, 64);
  EXPECT_EQ(p.peak, 448);
}

TEST(PlannerTest, SmallBufferFillsGapBetweenLargeOnes) {
  // Big buffers live at disjoint times share one slot; the small long-lived one goes beside.
  std::vector<BufferRequest> r = {{4096, 0, 1}, {4096, 2, 3}, {64, 0, 3}};
  MemoryPlan p = PlanMemory(r, 64);
  ExpectValid(r, p, 64);
  EXPECT_EQ(p.peak, 4096 + 64);
}

TEST(PlannerTest, ZeroSizedAndEmpty) {
  EXPECT_EQ(PlanMemory({}, 64).peak, 0);
  std::vector<BufferRequest> r = {{0, 0, 1}, {100, 0, 1}};
  MemoryPlan p = PlanMemory(r, 64);
  EXPECT_EQ(p.peak, 128);
}

TEST(PlannerTest, RandomPlansAreValidAndNoWorseThanNoReuse) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<BufferRequest> r;
    int64_t sum = 0;
    for (int i = 0; i < 40; ++i) {
      const int32_t first = static_cast<int32_t>(rng() % 50);
      const int32_t last = first + static_cast<int32_t>(rng() % 10);
      const int64_t bytes = static_cast<int64_t>(rng() % 5000);
      r.push_back({bytes, first, last});
      sum += (bytes + 255) / 256 * 256;
    }
    MemoryPlan p = PlanMemory(r, 256);
    ExpectValid(r, p, 256);
    EXPECT_LE(p.peak, sum);
  }
}

}  // namespace
}  // namespace kiln
