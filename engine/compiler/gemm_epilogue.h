// The GEMM epilogue hook: what a GEMM kernel may take so that bias, activation and residual
// adds after it run inside it instead of as separate kernels.
//
// The fusion pass turns `y = f(linear(x, w), e0, e1, ...)` (f pointwise) into one linear or
// matmul node whose inputs are (x, w, e0, e1, ...) when the device's compiler::Target allows
// GEMM epilogues (FusionCaps::gemm_epilogues). The epilogue is generated code (codegen.h,
// kGemmEpilogue) exposed as two plain functions:
//
//   from_acc(args, acc, ld, r0, r1, c0, c1)
//       For output rows [r0, r1) and columns [c0, c1): reads the GEMM results from `acc`
//       (row-major tile: the value for (r, c) at acc[(r - r0) * ld + (c - c0)]; float for
//       f32/f16/bf16 outputs, double for f64), reads e_i at (r, c), writes the final value to
//       args.output at (r, c). Meant for GEMM kernels to call on each finished tile while it
//       is in registers/cache, instead of storing the tile themselves.
//   inplace(args, r0, r1)
//       The same over whole rows, reading the GEMM result from args.output itself (already
//       stored there, in the output dtype). The fallback for GEMM kernels that know nothing
//       of epilogues: run the GEMM, then this.
//
// Rows are the output's leading axes flattened (row r, column c is element [.., c] of the
// output [..., N]). `args` is the fused node's LaunchArgs: inputs[0] = x, inputs[1] = w,
// inputs[2..] = the epilogue's inputs (indexed like the output, any strides). The output
// never aliases an input (fused GEMM nodes are not planned in place), so an epilogue may read
// e_i after the GEMM wrote (r, c). Both functions are reentrant: threads may run disjoint row
// ranges at once.
//
// How a GEMM kernel accepts it: when GetKernel sees FusedGroupOf(req) of kind kGemm, build
// the kernel for group->GemmRequest() and have it call `from_acc` per tile (the CPU
// backend's generic path, backends/cpu/jit, wraps any GEMM kernel with `inplace` instead).
//
// Plain data: usable from plugins.
#pragma once

#include <cstdint>

#include "engine/backend/kernel_abi.h"

namespace kiln::compiler {

struct GemmEpilogue {
  void (*from_acc)(const LaunchArgs& args, const void* acc, int64_t ld, int64_t r0, int64_t r1,
                   int64_t c0, int64_t c1) = nullptr;
  void (*inplace)(const LaunchArgs& args, int64_t r0, int64_t r1) = nullptr;
};

}  // namespace kiln::compiler
