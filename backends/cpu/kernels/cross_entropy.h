// The fused cross-entropy (OpKind::kFusedCrossEntropy) on the cpu backend: f32 logits with
// contiguous rows, threads over rows; per row one vectorised pass for the maximum, one for
// the sum of exponentials (kernels.h softmax_stats) and one writing dlogits
// (scaled_exp), so the softmax is never stored. Other dtypes and layouts (found at run time)
// run the reference rows on the same threads. Agrees with the reference (double throughout)
// within about 1e-6 relative.
#pragma once

#include <optional>

#include "backends/cpu/kernels/select.h"

namespace kiln::cpu {

StatusOr<std::optional<backend::Kernel>> MakeCrossEntropyKernel(const backend::KernelRequest& req,
                                                                const SelectContext& ctx);

}  // namespace kiln::cpu
