#include "scheduler/llm/kv_block_manager.h"

#include <numeric>
#include <set>

#include "gtest/gtest.h"

namespace kiln {
namespace {

std::vector<int32_t> Tokens(int n, int start = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(KvBlockManagerTest, AllocatesDistinctBlocksAndRefusesWhenFull) {
  KvBlockManager m(4, 16, true);
  auto a = m.Allocate(3);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(std::set<int32_t>(a->begin(), a->end()).size(), 3u);
  EXPECT_EQ(m.num_free(), 1);
  EXPECT_FALSE(m.Allocate(2).has_value());
  EXPECT_EQ(m.num_free(), 1) << "a failed allocation must take nothing";
  m.Release(*a);
  EXPECT_EQ(m.num_free(), 4);
}

TEST(KvBlockManagerTest, BlocksForRoundsUp) {
  KvBlockManager m(4, 16, false);
  EXPECT_EQ(m.BlocksFor(0), 0);
  EXPECT_EQ(m.BlocksFor(1), 1);
  EXPECT_EQ(m.BlocksFor(16), 1);
  EXPECT_EQ(m.BlocksFor(17), 2);
}

TEST(KvBlockManagerTest, HashesAreChainedAndCoverFullBlocksOnly) {
  KvBlockManager m(8, 4, true);
  auto a = m.BlockHashes(Tokens(10), 7);
  ASSERT_EQ(a.size(), 2u);  // 10 tokens: 2 full blocks
  // Same second block content after a different first block: different hash.
  std::vector<int32_t> other = Tokens(10);
  other[0] = 99;
  auto b = m.BlockHashes(other, 7);
  EXPECT_NE(a[0], b[0]);
  EXPECT_NE(a[1], b[1]);
  // A different seed (another model or adapter) never shares.
  EXPECT_NE(m.BlockHashes(Tokens(10), 8)[0], a[0]);
  EXPECT_EQ(m.BlockHashes(Tokens(10), 7), a);
}

TEST(KvBlockManagerTest, PublishedBlocksAreSharedAndSurviveRelease) {
  KvBlockManager m(8, 4, true);
  auto tokens = Tokens(12);
  auto hashes = m.BlockHashes(tokens, 1);
  auto seq1 = *m.Allocate(3);
  for (int i = 0; i < 3; ++i) m.Publish(seq1[i], hashes[i]);
  // A second sequence with the same prefix shares all three blocks while seq1 runs.
  auto shared = m.MatchPrefix(hashes);
  EXPECT_EQ(shared, seq1);
  EXPECT_EQ(m.refcount(seq1[0]), 2);
  m.Release(shared);
  m.Release(seq1);
  EXPECT_EQ(m.num_free(), 8) << "cached blocks count as allocatable";
  // ...and are still matched after both finished.
  auto again = m.MatchPrefix(hashes);
  EXPECT_EQ(again, seq1);
  EXPECT_EQ(m.hits(), 6u);
  m.Release(again);
}

TEST(KvBlockManagerTest, MatchStopsAtTheFirstMissingBlock) {
  KvBlockManager m(8, 4, true);
  auto hashes = m.BlockHashes(Tokens(12), 1);
  auto blocks = *m.Allocate(3);
  m.Publish(blocks[0], hashes[0]);
  m.Publish(blocks[2], hashes[2]);  // block 1 unpublished: 2 cannot be reached
  auto got = m.MatchPrefix(hashes);
  EXPECT_EQ(got, std::vector<int32_t>{blocks[0]});
  EXPECT_EQ(m.misses(), 2u);
  m.Release(got);
  m.Release(blocks);
}

TEST(KvBlockManagerTest, EvictsLeastRecentlyUsedAndTailFirst) {
  KvBlockManager m(4, 4, true);
  auto hashes = m.BlockHashes(Tokens(16), 1);
  auto blocks = *m.Allocate(4);
  for (int i = 0; i < 4; ++i) m.Publish(blocks[i], hashes[i]);
  m.Release(blocks);
  // Need 1 block: the tail (block 3) goes first; the head stays matchable.
  auto one = *m.Allocate(1);
  EXPECT_EQ(one[0], blocks[3]);
  EXPECT_EQ(m.evictions(), 1u);
  auto prefix = m.MatchPrefix(hashes);
  EXPECT_EQ(prefix, (std::vector<int32_t>{blocks[0], blocks[1], blocks[2]}));
  m.Release(prefix);
  m.Release(one);
}

TEST(KvBlockManagerTest, DuplicateContentKeepsTheFirstPublisher) {
  KvBlockManager m(4, 4, true);
  auto h = m.BlockHashes(Tokens(4), 1);
  auto a = *m.Allocate(1);
  auto b = *m.Allocate(1);
  m.Publish(a[0], h[0]);
  m.Publish(b[0], h[0]);
  m.Release(b);
  EXPECT_EQ(m.num_free(), 3);
  EXPECT_EQ(m.MatchPrefix(h), a);
}

TEST(KvBlockManagerTest, PrefixCacheOff) {
  KvBlockManager m(4, 4, false);
  auto h = m.BlockHashes(Tokens(8), 1);
  auto a = *m.Allocate(2);
  m.Publish(a[0], h[0]);
  m.Release(a);
  EXPECT_TRUE(m.MatchPrefix(h).empty());
  EXPECT_EQ(m.num_free(), 4);
}

}  // namespace
}  // namespace kiln
