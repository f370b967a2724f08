// The scalar variant of the CPU kernels (see kernels_impl.h). CMake compiles this file with
// the variant's target flags; nothing here may run unless KernelsFor() chose it.
#include "backends/cpu/kernels/kernels.h"
#include "backends/cpu/kernels/simd_scalar.h"

namespace kiln::cpu::scalar {
inline constexpr Isa kIsa = Isa::kScalar;
}  // namespace kiln::cpu::scalar

#define KILN_ISA_NS scalar
#include "backends/cpu/kernels/kernels_impl.h"
#undef KILN_ISA_NS

namespace kiln::cpu {
const IsaKernels& ScalarKernels() { return scalar::kTable; }
const Q8Kernels& ScalarQ8Kernels() { return scalar::kQ8Table; }
}  // namespace kiln::cpu
