// The q8 kernels with AVX-512 VNNI (q8_impl.h): the AVX2 vector layer compiled with AVX-512 VL
// and VNNI added, in its own namespace, so that its integer dots are vpdpbusd and its tiles use
// 32 vector registers. CMake compiles this file with those flags; nothing here may run unless
// Q8KernelsFor() chose it (CpuHasAvx512Vnni()).
#include "backends/cpu/kernels/kernels.h"

#define KILN_SIMD_AVX2_NS avx512vnni
#include "backends/cpu/kernels/simd_avx2.h"
#undef KILN_SIMD_AVX2_NS

static_assert(KILN_Q8_VNNI, "kernels_q8_vnni.cc needs -mavx512vl -mavx512vnni");

namespace kiln::cpu::avx512vnni {
inline constexpr Isa kIsa = Isa::kAvx512;  // the variant that uses this set
}  // namespace kiln::cpu::avx512vnni

#define KILN_ISA_NS avx512vnni
#include "backends/cpu/kernels/q8_impl.h"
#undef KILN_ISA_NS

namespace kiln::cpu {
const Q8Kernels& Avx512VnniQ8Kernels() { return avx512vnni::kQ8Table; }
}  // namespace kiln::cpu
