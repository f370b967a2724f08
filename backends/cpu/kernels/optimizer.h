// The fused optimizers (OpKind::kAdamW, kAdam, kSgd, kAdagrad) on the cpu backend: one pass
// over contiguous f32 parameters, gradients and states, split over the pool's threads and
// vectorized per instruction set (optimizer_impl.h), with the reference kernel's arithmetic
// (torch.optim's single-tensor updates, per element in double: backends/ref/ref_kernels.cc
// OptimizerElements), so results equal the reference's bit for bit. Other layouts and dtypes
// (found at run time) run the reference kernel.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "backends/cpu/kernels/select.h"

namespace kiln::cpu {

StatusOr<std::optional<backend::Kernel>> MakeOptimizerKernel(const backend::KernelRequest& req,
                                                             const SelectContext& ctx);

// One update of dense f32 tensors, with the per-tensor scalars computed once as torch does.
struct OptimizerStep {
  OpKind op = OpKind::kAdamW;
  std::span<const double> floats;  // the op node's attrs.floats
  bool nesterov = false;           // kSgd
  bool first = false;              // step 1: states start from their initial values
  double lr = 0, scale = 1;        // scale: the gradient's (hyper[2] times the graph's)
  double step_size = 0;            // Adam(W): lr / (1 - beta1^step); Adagrad: clr
  double bias_correction2_sqrt = 1;
  const float* param = nullptr;
  const float* grad = nullptr;
  float* param_out = nullptr;  // may equal param (in place); states likewise
  const float* state_in[2] = {nullptr, nullptr};
  float* state_out[2] = {nullptr, nullptr};
};

// Sets s->first, step_size and bias_correction2_sqrt for `step` (1-based) from s->op, floats
// and lr (engine/optimizer.h StepScalars, as the reference kernel computes them).
void SetStepScalars(double step, OptimizerStep* s);

// Elements [begin, end) of `s`, per variant (optimizer_<isa>.cc).
namespace scalar {
void OptimizerRange(const OptimizerStep& s, int64_t begin, int64_t end);
}
namespace avx2 {
void OptimizerRange(const OptimizerStep& s, int64_t begin, int64_t end);
}
namespace avx512 {
void OptimizerRange(const OptimizerStep& s, int64_t begin, int64_t end);
}

}  // namespace kiln::cpu
