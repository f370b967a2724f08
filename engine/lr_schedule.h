// Learning-rate schedules with linear warmup, as Hugging Face transformers defines them
// (transformers.optimization: get_constant_schedule_with_warmup,
// get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup with num_cycles = 0.5).
// The trainer computes the rate on the host each step and writes it, with the step number,
// into the optimizer's hyper input (engine/optimizer.h): the compiled step never changes.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/base/status.h"

namespace kiln {

enum class LrScheduleKind : int { kConstant = 0, kLinear = 1, kCosine = 2 };

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kLinear;
  double lr = 1e-4;          // the peak (base) learning rate, reached after warmup
  int64_t warmup_steps = 0;  // linear ramp from 0 over this many steps
  int64_t total_steps = 0;   // linear/cosine: the rate reaches 0 here (ignored by constant)
};

// The learning rate of optimizer step `step` (1-based, the number in the optimizer's hyper
// input): lr * lr_lambda(step - 1) with transformers' lr_lambda, which is what a LambdaLR
// gives the step-th optimizer.step() of transformers' Trainer (the scheduler steps after
// the optimizer). So with warmup the first step's rate is 0, as there. With w = warmup_steps,
// n = total_steps, s = step - 1:
//   s < w:     s / max(1, w)                                          (all kinds)
//   constant:  1
//   linear:    max(0, (n - s) / max(1, n - w))
//   cosine:    max(0, 0.5 (1 + cos(pi * (s - w) / max(1, n - w))))
// REQUIRES: step >= 1.
double LearningRate(const LrSchedule& schedule, int64_t step);

// "constant", "linear", "cosine"; InvalidArgument naming the allowed values otherwise.
StatusOr<LrScheduleKind> ParseLrScheduleKind(std::string_view name);
const char* LrScheduleKindName(LrScheduleKind kind);

}  // namespace kiln
