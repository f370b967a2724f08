// The avx512 variant of the CPU kernels (see kernels_impl.h). CMake compiles this file with
// the variant's target flags; nothing here may run unless KernelsFor() chose it.
#include "backends/cpu/kernels/kernels.h"
#include "backends/cpu/kernels/simd_avx512.h"

namespace kiln::cpu::avx512 {
inline constexpr Isa kIsa = Isa::kAvx512;
}  // namespace kiln::cpu::avx512

#define KILN_ISA_NS avx512
#include "backends/cpu/kernels/kernels_impl.h"
#undef KILN_ISA_NS

namespace kiln::cpu {
const IsaKernels& Avx512Kernels() { return avx512::kTable; }
}  // namespace kiln::cpu
