// The cpu backend's kernels for training ops: fused cross-entropy (loss and dlogits in one
// pass) and AdamW. They run the reference loops (backends/ref: computed in double, rounded
// once) split over the stream's thread pool, by rows and by elements.
#pragma once

#include <optional>

#include "engine/backend/backend.h"

namespace kiln::cpu {

// A kernel for fused_cross_entropy or adamw; nullopt for other ops.
std::optional<backend::Kernel> TrainingKernel(const backend::KernelRequest& request);

}  // namespace kiln::cpu
