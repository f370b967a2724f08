// The avx2 variant of the CPU kernels (see kernels_impl.h). CMake compiles this file with
// the variant's target flags; nothing here may run unless KernelsFor() chose it.
#include "backends/cpu/kernels/kernels.h"
#include "backends/cpu/kernels/simd_avx2.h"

namespace kiln::cpu::avx2 {
inline constexpr Isa kIsa = Isa::kAvx2;
}  // namespace kiln::cpu::avx2

#define KILN_ISA_NS avx2
#include "backends/cpu/kernels/kernels_impl.h"
#undef KILN_ISA_NS

namespace kiln::cpu {
const IsaKernels& Avx2Kernels() { return avx2::kTable; }
const Q8Kernels& Avx2Q8Kernels() { return avx2::kQ8Table; }
}  // namespace kiln::cpu
