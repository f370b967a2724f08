// PEFT's lora_dropout in the training graph: the input of each adapted layer's LoRA branch is
// multiplied by a keep mask / (1 - p) (torch.nn.Dropout), drawn per step, per module and per
// element by a counter-based hash instead of a stored random state, so that
//   - the mask costs no memory beyond the mask tensor itself and no host work per step;
//   - recomputation (activation checkpointing) and resuming from a checkpoint draw the same
//     masks: a mask depends only on (seed, optimizer step, micro-batch, module, element);
//   - a test (or scripts/fixtures/make_training_fixtures.py, which reimplements these three
//     functions in numpy) can compute the very mask Kiln applied.
// The bits differ from PyTorch's generator (nothing can match those); the distribution is the
// same: each element kept independently with probability 1 - p.
//
// The hash works on integers modulo the prime P = 2^31 - 1 with products below 2^62, so every
// backend evaluates it exactly in 64-bit integers:
//   h1 = (n * 48271 + s) mod P              n: the element's flat index mod P
//   h2 = (h1 * h1 + 12345) mod P            s: (step seed + module id) mod P
//   h3 = (h2 * 69621 + s) mod P
//   h4 = (h3 * h3 + 54321) mod P
//   keep  iff  h4 >= round(p * P)
// (two rounds of an affine map followed by a square: the squares break the lattice structure
// of a plain linear congruential sequence; see lora_dropout_test for the statistics).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/expr.h"

namespace kiln::models {

inline constexpr int64_t kDropoutModulus = 2147483647;  // 2^31 - 1

// The seed of one micro-batch's masks: a function of the run's seed, the optimizer step
// (1-based: the step being computed) and the micro-batch within it, in [0, P).
int64_t LoraDropoutStepSeed(uint64_t seed, int64_t step, int64_t micro_batch);

// A module's id, from its weight stem ("blk.3.attn_q"): FNV-1a (64-bit) of the bytes, mod P.
int64_t LoraDropoutModuleId(std::string_view stem);

// Whether element `n` (row-major flat index into the LoRA branch's input) is kept.
bool LoraDropoutKeep(int64_t step_seed, int64_t module_id, int64_t n, double p);

// The mask as an expression: 1 / (1 - p) where kept, else 0, as f32. `step_seed` is an i64
// expression (e.g. a Load of a one-element step input), `n` the element's flat index (i64).
// REQUIRES: 0 < p < 1.
Expr LoraDropoutMaskExpr(const Expr& step_seed, int64_t module_id, const Expr& n, double p);

}  // namespace kiln::models
