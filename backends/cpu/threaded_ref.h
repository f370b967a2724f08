// The cpu backend's kernels that run reference loops (backends/ref: the same code and numerics)
// split over the stream's thread pool: fused cross-entropy (loss and dlogits in one pass) and
// sample by rows (plain greedy rows, fewer than the threads, by slices of the vocabulary: the
// same argmax), the optimizers by elements; gather copies whole rows (same dtype in and out)
// by rows, other gathers run the reference loop.
#pragma once

#include <optional>

#include "engine/backend/backend.h"

namespace kiln::cpu {

// A kernel for fused_cross_entropy, the optimizers, sample or gather; nullopt for other ops.
std::optional<backend::Kernel> ThreadedReferenceKernel(const backend::KernelRequest& request);

}  // namespace kiln::cpu
