// Paged attention on the cpu backend (see select.h for what is covered).
//
// Work items are (sequence, kv head, query rows): the query heads that share a kv head are
// processed together (each key and value row is loaded once for the whole group), and
// items are spread over the pool by estimated cost. A decode row (one query of a
// sequence) with a long context is also split over the context: each part produces an
// unnormalized softmax state and the last thread to finish a row merges them, so a single
// long sequence keeps every thread busy without a barrier. Items of several query rows
// (prefill) run 32 rows at a time with tile products: each tile of keys is gathered once for
// the rows and the group's heads, scores and P V are small GEMMs.
//
// Kernel data holds per-launch scratch for those partial states (keyed by the launch, so
// programs that share kernels may run concurrently on different streams).
#pragma once

#include <optional>
#include <utility>

#include "backends/cpu/kernels/kernels.h"
#include "backends/cpu/kernels/select.h"
#include "engine/expr.h"

namespace kiln::cpu {

// mask_mod -> (kind, window) for the masks the kernels implement (null: kNone; CausalMask;
// SlidingWindowMask(w)); nullopt otherwise.
std::optional<std::pair<MaskKind, int64_t>> ClassifyMask(const Expr& mask);

// The cap of a score_mod that is exactly attn::Then(inner, attn::SoftCapScore(cap)) (with the
// default `inner`, SoftCapScore(cap) itself); nullopt for any other.
std::optional<double> SoftCapOf(const Expr& score, const Expr& inner = attn::Score());

// (query row, query head, key tile) triples the paged kernel has scored through compiled
// modifiers (AttnArgs::mods) since the process started; a key tile a compiled mask hides from
// a decode row, or from every row of a block of 32 prefill rows, is not scored (tests count
// them).
uint64_t PagedAttentionCompiledTilesScored();

StatusOr<std::optional<backend::Kernel>> MakePagedAttentionKernel(const backend::KernelRequest& req,
                                                                  const SelectContext& ctx);

}  // namespace kiln::cpu
