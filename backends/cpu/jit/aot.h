// Kernels compiled into the binary at build time (CMake option KILN_AOT_KERNELS): the kernels
// the built-in model graphs need (aot_gen.cc), so a first start on a fresh machine runs no
// compiler. Looked up by the same key as the disk cache (the SHA-256 of the generated code).
//
// Thread-safety: the table is immutable.
#pragma once

#include <span>
#include <string_view>

#include "engine/backend/kernel_abi.h"

namespace kiln::cpu::jit {

struct AotKernel {
  const char* key;                                       // GeneratedKernel::key
  KernelFn fn;                                           // pointwise/reduce kernels
  void (*inplace)(const LaunchArgs&, int64_t, int64_t);  // GEMM epilogues
  void (*from_acc)(const LaunchArgs&, const void*, int64_t, int64_t, int64_t, int64_t, int64_t);
};

// Sorted by key; empty when the build has no AOT kernels.
std::span<const AotKernel> AotKernels();
// The entry for `key`, or null.
const AotKernel* FindAotKernel(std::string_view key);

}  // namespace kiln::cpu::jit
