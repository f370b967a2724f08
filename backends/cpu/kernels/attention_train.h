// Dense attention for training on the cpu backend: the forward with its log-sum-exp
// (OpKind::kAttention) and its backward (OpKind::kAttentionBackward), flash-attention style —
// the [Tq, Tk] probabilities exist only per tile of 64 query rows, never for the whole head.
//
// Covered: f32 q/k/v/o, last axes contiguous (other strides free). Natively: score_mod none
// or, in the forward, attn::SoftCapScore (Gemma 2); mask_mod none, CausalMask,
// SlidingWindowMask(w) or DocumentMask(0, Tk, w) (packed training rows, document ids i32/i64
// as aux 0) — keys such a mask rules out for a whole tile are never visited (about half the
// work of dense causal), the rest is masked per element. Any other mask_mod (and score_mod in
// the forward) with SelectContext::compile: compiled into the kernel (attention_mods.h), the
// tiles iterating over the mask's cached block mask — only non-empty 64 x 64 blocks are
// visited, only partial ones evaluate the mask. DenseAttentionScoresVisited counts what is.
// Anything else (no compiler; layouts found at run time) runs the reference kernel.
//
// Work: the forward splits (batch, query head, query tile) over the pool by cost; the backward
// (batch, kv head), each item owning its dk/dv rows and the dq of its query heads, so no
// two threads write one element. Numerics: f32 products and exponentials (kernels.h
// small_gemm, scaled_exp), softmax sums in double per row.
#pragma once

#include <cstdint>
#include <optional>

#include "backends/cpu/kernels/select.h"

namespace kiln::cpu {

// Scores the dense forward kernel has computed (query rows x visited keys, summed over its
// tiles) since the process started: what block skipping leaves of Tq x Tk (tests count it).
uint64_t DenseAttentionScoresVisited();

StatusOr<std::optional<backend::Kernel>> MakeDenseAttentionKernel(const backend::KernelRequest& req,
                                                                  const SelectContext& ctx);
StatusOr<std::optional<backend::Kernel>> MakeAttentionBackwardKernel(
    const backend::KernelRequest& req, const SelectContext& ctx);

}  // namespace kiln::cpu
