#include "scheduler/llm/kv_block_manager.h"

#include "engine/base/status.h"

namespace kiln {
// 64-bit FNV-1a over the parent hash and the block's tokens, finished with a murmur-style
// mix. Collisions would share wrong KV, so the full 64 bits are kept in the chain.
uint64_t KvBlockManager::HashBlock(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = 1469598103934665603ull;
  auto mix_in = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix_in(parent);
  for (int32_t t : tokens) mix_in(static_cast<uint32_t>(t));
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

KvBlockManager::KvBlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_cache)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_cache_(enable_prefix_cache),
      blocks_(num_blocks) {
  KILN_CHECK(num_blocks >= 1 && block_size >= 1, "KV cache needs blocks of at least 1 token");
  free_.reserve(num_blocks);
  for (int32_t i = num_blocks - 1; i >= 0; --i) free_.push_back(i);  // hand out 0, 1, ... first
}

int32_t KvBlockManager::num_free() const {
  return static_cast<int32_t>(free_.size() + lru_.size());
}

int32_t KvBlockManager::BlocksFor(int64_t tokens) const {
  return static_cast<int32_t>((tokens + block_size_ - 1) / block_size_);
}

std::vector<uint64_t> KvBlockManager::BlockHashes(std::span<const int32_t> tokens,
                                                  uint64_t seed) const {
  std::vector<uint64_t> out;
  uint64_t parent = seed;
  for (size_t start = 0; start + block_size_ <= tokens.size(); start += block_size_) {
    parent = HashBlock(parent, tokens.subspan(start, block_size_));
    out.push_back(parent);
  }
  return out;
}

std::vector<int32_t> KvBlockManager::MatchPrefix(std::span<const uint64_t> hashes) {
  std::vector<int32_t> out;
  if (!prefix_cache_) return out;
  for (uint64_t h : hashes) {
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    Block& b = blocks_[it->second];
    if (b.cached) {
      lru_.erase(b.lru_it);
      b.cached = false;
    }
    ++b.refs;
    out.push_back(it->second);
  }
  hits_ += out.size();
  misses_ += hashes.size() - out.size();
  return out;
}

void KvBlockManager::Unpublish(int32_t id) {
  Block& b = blocks_[id];
  if (!b.hash) return;
  auto it = by_hash_.find(*b.hash);
  if (it != by_hash_.end() && it->second == id) by_hash_.erase(it);
  b.hash.reset();
}

std::optional<std::vector<int32_t>> KvBlockManager::Allocate(int32_t n) {
  if (!CanAllocate(n)) return std::nullopt;
  std::vector<int32_t> out;
  out.reserve(n);
  while (static_cast<int32_t>(out.size()) < n) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      id = lru_.front();
      lru_.pop_front();
      blocks_[id].cached = false;
      Unpublish(id);
      ++evictions_;
    }
    blocks_[id].refs = 1;
    out.push_back(id);
  }
  return out;
}

void KvBlockManager::Publish(int32_t block, uint64_t hash) {
  if (!prefix_cache_) return;
  Block& b = blocks_[block];
  KILN_CHECK(b.refs > 0, "publishing a block nobody holds");
  if (b.hash) return;                   // already published (shared from the cache)
  if (by_hash_.contains(hash)) return;  // same content computed twice; keep the first
  b.hash = hash;
  by_hash_.emplace(hash, block);
}

void KvBlockManager::Release(std::span<const int32_t> blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t id = *it;
    Block& b = blocks_[id];
    KILN_CHECK(b.refs > 0, "releasing a block that is not in use");
    if (--b.refs > 0) continue;
    if (b.hash) {
      // Tail blocks are released first, so they sit nearer the LRU front: evicted first.
      b.lru_it = lru_.insert(lru_.end(), id);
      b.cached = true;
    } else {
      free_.push_back(id);
    }
  }
}

}  // namespace kiln
