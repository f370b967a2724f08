// Any attention modifier on the cpu kernels: an op's mask_mod and score_mod printed by the
// engine's C++ printer (compiler::GenerateExprFunction) into two functions over a tile of
// scores, built by the cpu backend's JIT (SelectContext::compile), and the block mask the
// dense kernels iterate over.
//
//   apply(s, ld, rows, n, b, h, q0, kv0, masked): for the tile s[rows x n] of query rows
//     q0.. and keys kv0..: s = score_mod(s, b, h, q, kv), then, if `masked`, -inf where
//     mask_mod(b, h, q, kv) is false. One call per tile; the expressions are inlined into
//     its loops (no call per element).
//   apply_at(s, n, b, h, q, kv[]): the same on n scores of one query row and the keys at
//     positions kv[0..n) (paged attention: keys of valid cache blocks only).
//   classify(b, h, q0, rows, kv0, n): whether mask_mod keeps none, all or some of the tile.
//   any(b, h, q0, rows, kv0, n): whether it keeps some of it (returns at the first 16 keys of
//     a row that have one).
//
// BlockMask: for each tile of query rows, the key blocks (as many keys) that the mask does not
// rule out entirely, each marked full (no mask evaluated) or partial. Built by evaluating
// mask_mod on every (query, key) pair once per step shape and cached (BlockMasks): per (Tq,
// Tk, b and h where the mask reads them, and the contents of the aux tensors where it reads
// those: document ids, prefix lengths), so training steps with the same packing and
// same-shaped steps reuse their table.
//
// Numerics: score_mod runs in f32 as the reference's does for f32 queries (transcendentals
// from the C++ math library: last-bit differences).
//
// Thread-safety: AttnMods is immutable after Compile; BlockMasks::For is thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "backends/cpu/kernels/select.h"
#include "engine/expr.h"

namespace kiln::cpu {

// An aux tensor as the generated functions read it (1-D: element e at data + e * stride
// elements; out of range reads give 0).
struct AttnAux {
  const void* data = nullptr;
  int64_t len = 0;
  int64_t stride = 0;
};

enum class BlockKind : uint8_t { kEmpty = 0, kFull = 1, kPartial = 2 };

class AttnMods {
 public:
  // Compiles `mask` and `score` (either may be null) for aux tensors of `aux` dtypes through
  // ctx.compile. Unavailable without a compile function or compiler; Unimplemented for
  // expressions the printer cannot print (quantized aux tensors). Failures are logged once per
  // reason (the kernels then leave such attention to the reference kernel).
  static StatusOr<std::shared_ptr<const AttnMods>> Compile(const Expr& mask, const Expr& score,
                                                           std::span<const DType> aux,
                                                           const SelectContext& ctx);

  bool has_mask() const { return classify_ != nullptr; }
  bool has_score() const { return has_score_; }
  // Whether mask_mod reads b, h, or any aux tensor; the aux tensors it reads.
  bool mask_reads_batch() const { return reads_b_; }
  bool mask_reads_head() const { return reads_h_; }
  bool mask_reads_aux() const { return !mask_aux_.empty(); }
  const std::vector<int>& mask_aux() const { return mask_aux_; }
  const std::string& label() const { return label_; }  // "mask+score", for kernel names

  void Apply(float* s, int64_t ld, int64_t rows, int64_t n, int64_t b, int64_t h, int64_t q0,
             int64_t kv0, bool masked, const AttnAux* aux) const {
    apply_(s, ld, rows, n, b, h, q0, kv0, masked ? 1 : 0, aux);
  }
  // One query row, keys at positions kv[0..n): score_mod, then mask_mod.
  void ApplyAt(float* s, int64_t n, int64_t b, int64_t h, int64_t q, const int64_t* kv,
               const AttnAux* aux) const {
    apply_at_(s, n, b, h, q, kv, aux);
  }
  BlockKind Classify(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t kv0, int64_t n,
                     const AttnAux* aux) const {
    return classify_ == nullptr ? BlockKind::kFull
                                : static_cast<BlockKind>(classify_(b, h, q0, rows, kv0, n, aux));
  }
  // Classify(...) != kEmpty, usually sooner.
  bool Any(int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t kv0, int64_t n,
           const AttnAux* aux) const {
    return any_ == nullptr || any_(b, h, q0, rows, kv0, n, aux) != 0;
  }

 private:
  using ApplyFn = void (*)(float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int, const AttnAux*);
  using ApplyAtFn = void (*)(float*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                             const AttnAux*);
  using ClassifyFn = int (*)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const AttnAux*);
  ApplyFn apply_ = nullptr;
  ApplyAtFn apply_at_ = nullptr;
  ClassifyFn classify_ = nullptr;  // null: no mask_mod
  ClassifyFn any_ = nullptr;       // null: no mask_mod
  bool has_score_ = false;
  static StatusOr<std::shared_ptr<const AttnMods>> CompileImpl(const Expr& mask, const Expr& score,
                                                               std::span<const DType> aux,
                                                               const SelectContext& ctx);
  bool reads_b_ = false, reads_h_ = false;
  std::vector<int> mask_aux_;
  std::string label_;
};

// One key block of a query tile: keys [kv0, kv0 + n).
struct KeyBlock {
  int64_t kv0 = 0, n = 0;
  bool partial = false;  // false: every score of the block is kept (mask not evaluated)
};

// The non-empty key blocks of every query tile of one (b, h) slice, in key order.
struct BlockMask {
  std::vector<std::vector<KeyBlock>> tiles;
};

// The aux tensors of a launch (its inputs from `first` on) as the compiled functions read them.
std::vector<AttnAux> AuxTensors(const LaunchArgs& a, int first);

// The block-mask cache key of the aux tensors (inputs from `first` on) that `mods`' mask
// reads: for each, its length, then its elements' bytes; empty if it reads none.
std::string AuxKey(const AttnMods& mods, const LaunchArgs& a, int first);

// The block masks of one kernel, cached.
class BlockMasks {
 public:
  // The table of head (b, h) for queries [0, tq) and keys [0, tk) with the aux tensors `aux`,
  // where `aux_bytes` holds the contents of those the mask reads (AuxKey; ignored when it reads
  // none); built on first use by
  // every caller that asks for it meanwhile (the launch's threads take query tiles from a
  // shared counter), each returning when the whole table is done.
  std::shared_ptr<const BlockMask> For(const AttnMods& mods, int64_t b, int64_t h, int64_t tile,
                                       int64_t tq, int64_t tk, const AttnAux* aux,
                                       std::string_view aux_bytes) const;

 private:
  // A table, complete once `done` reaches the number of query tiles.
  struct Entry {
    BlockMask table;
    int64_t tiles = 0;
    std::atomic<int64_t> next{0}, done{0};  // tiles taken, tiles finished
    std::mutex mu;
    std::condition_variable finished;
  };
  // Past either bound the cache starts over (shapes or packings that keep changing).
  static constexpr size_t kMaxTables = 64;
  static constexpr size_t kMaxBytes = size_t{64} << 20;
  mutable std::mutex mu_;
  mutable size_t bytes_ = 0;  // of the keys' aux contents and the tables, roughly
  mutable std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, std::string>,
                   std::shared_ptr<Entry>>
      cache_;  // (b or -1, h or -1, tile, tq, tk, aux contents or "") -> table
};

}  // namespace kiln::cpu
