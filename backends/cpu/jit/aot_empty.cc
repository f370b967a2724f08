// The AOT table of a build without precompiled kernels (KILN_AOT_KERNELS=OFF).
#include "backends/cpu/jit/aot.h"

namespace kiln::cpu::jit {

std::span<const AotKernel> AotKernels() { return {}; }

}  // namespace kiln::cpu::jit
