// Sample kernel specs for codegen tests: every op's expression form (from the op harness'
// forward cases, over their dtypes and ranks) and fused groups (from small transformer-style
// graphs run through the fusion pass). Used by the dialect compile tests (OpenCL on PoCL,
// CUDA via NVRTC, HIP via hipcc).
#pragma once

#include <string>
#include <vector>

#include "engine/compiler/kernel_spec.h"

namespace kiln::compiler::testing {

struct Sample {
  std::string label;  // "rms_norm f16 [2,3,64]" or "fused: add+rms_norm+mul"
  KernelSpec spec;
};

// Distinct specs (by generated C++ key), at least one per op with an expression form.
// `fused` adds fusion-pass groups.
std::vector<Sample> SampleSpecs(bool fused = true);

}  // namespace kiln::compiler::testing
