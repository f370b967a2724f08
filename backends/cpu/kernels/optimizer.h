// The fused optimizers (OpKind::kAdamW, kAdam, kSgd, kAdagrad) on the cpu backend: one pass
// over contiguous f32 parameters, gradients and states, split over the pool's threads, with
// the reference kernel's arithmetic (torch.optim's single-tensor updates, per element in
// double: backends/ref/ref_kernels.cc OptimizerElements), so results equal the reference's
// bit for bit. Other layouts and dtypes (found at run time) run the reference kernel.
#pragma once

#include <optional>

#include "backends/cpu/kernels/select.h"

namespace kiln::cpu {

StatusOr<std::optional<backend::Kernel>> MakeOptimizerKernel(const backend::KernelRequest& req,
                                                             const SelectContext& ctx);

}  // namespace kiln::cpu
