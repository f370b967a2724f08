// The paged KV cache's block allocator and prefix cache. The model owns the KV memory; this
// class decides which block holds which tokens.
//
// Blocks hold `block_size` tokens. A sequence's blocks are listed in its block table. A block
// that is full is *published* under the hash of its tokens chained with the hash of the block
// before it (and a namespace seed: the model and adapter), so a later request whose prompt
// starts with the same tokens shares it instead of recomputing it.
//
// Every block is in exactly one state:
//   free       — no content; handed out by Allocate;
//   in use     — referenced by >= 1 sequences (refcount); may be published (shared);
//   cached     — published, refcount 0: still holds valid KV and can be matched again; also
//                allocatable, least recently used first (evicting it from the cache).
// num_free() counts free + cached blocks: everything Allocate may hand out.
//
// Thread-safety: none; the continuous batcher's loop thread owns it.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace kiln {

class KvBlockManager {
 public:
  // REQUIRES: num_blocks >= 1, block_size >= 1.
  KvBlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_cache);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }
  int32_t num_free() const;  // free + cached
  int32_t num_used() const { return num_blocks_ - num_free(); }
  // Blocks needed to hold `tokens` tokens.
  int32_t BlocksFor(int64_t tokens) const;

  // The hash of one block of tokens following a block (or namespace seed) hashed `parent`.
  static uint64_t HashBlock(uint64_t parent, std::span<const int32_t> tokens);

  // Hashes of the full blocks of `tokens` (a chain: each covers every token before it).
  std::vector<uint64_t> BlockHashes(std::span<const int32_t> tokens, uint64_t seed) const;

  // Finds the longest prefix of `hashes` whose blocks are cached or in use, takes a reference
  // on each and returns their ids (possibly empty). Counts hits and misses per block.
  std::vector<int32_t> MatchPrefix(std::span<const uint64_t> hashes);

  bool CanAllocate(int32_t n) const { return n <= num_free(); }
  // `n` blocks with refcount 1, taking free blocks first, then evicting cached ones (least
  // recently used first). nullopt, and nothing taken, if fewer than `n` are available.
  std::optional<std::vector<int32_t>> Allocate(int32_t n);

  // Marks a full block (refcount >= 1) as holding the tokens hashed by `hash`. If another
  // block already holds that content, nothing changes (this block stays private).
  void Publish(int32_t block, uint64_t hash);

  // Drops one reference on each block. A block reaching zero becomes cached if published,
  // free otherwise. Blocks are released last-to-first so a sequence's tail is evicted before
  // its head (heads are the most shareable).
  void Release(std::span<const int32_t> blocks);

  int32_t refcount(int32_t block) const { return blocks_[block].refs; }

  // Prefix-cache counters, in blocks.
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  uint64_t evictions() const { return evictions_; }

 private:
  struct Block {
    int32_t refs = 0;
    std::optional<uint64_t> hash;         // set while published
    std::list<int32_t>::iterator lru_it;  // valid while cached
    bool cached = false;
  };
  void Unpublish(int32_t id);

  const int32_t num_blocks_, block_size_;
  const bool prefix_cache_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;  // stack of free block ids
  std::list<int32_t> lru_;     // cached blocks, least recently used first
  std::unordered_map<uint64_t, int32_t> by_hash_;
  uint64_t hits_ = 0, misses_ = 0, evictions_ = 0;
};

}  // namespace kiln
