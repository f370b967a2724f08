// Instruction-set selection for the CPU kernels: what this CPU (and OS) supports, detected
// once with cpuid/xgetbv, and which variant the kernels use.
//
// Every kernel exists in three variants compiled from one source with different target
// flags (kernels_impl.h): `scalar` (portable C++, SSE2 at most — always available),
// `avx2` (AVX2 + FMA + F16C) and `avx512` (AVX-512 F/BW/VL/DQ). The active variant is the
// best one the CPU supports, lowered (never raised) by the environment variable
// `KILN_CPU_ISA=scalar|avx2|avx512` — for tests that force each variant, and to rule a
// variant out in production. An unknown value is ignored with a warning.
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace kiln::cpu {

enum class Isa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// "scalar", "avx2", "avx512".
const char* IsaName(Isa isa);
std::optional<Isa> ParseIsa(std::string_view name);

// The best variant this CPU and OS support (cached after the first call).
Isa DetectedIsa();
// min(DetectedIsa(), KILN_CPU_ISA) — read once, at the first call.
Isa ActiveIsa();
// True if `isa` can run here (isa <= DetectedIsa()).
inline bool IsaSupported(Isa isa) {
  return static_cast<int>(isa) <= static_cast<int>(DetectedIsa());
}

// True if the CPU has AVX-512 VNNI (vpdpbusd) besides the avx512 variant's AVX-512 F/BW/VL/DQ:
// the q8 kernels use it (kernels.h Q8KernelsFor) where the active variant is avx512.
bool CpuHasAvx512Vnni();

// True if the CPU has AVX-512 BF16 (vdpbf16ps) besides the avx512 variant's F/BW/VL/DQ: the
// bf16-activation kernels use it (kernels.h Bf16KernelsFor) where the active variant is avx512.
bool CpuHasAvx512Bf16();

// "AMD EPYC 7B13 avx2" — the cpuid brand string and detected variant, for cache keys and logs.
const char* CpuDescription();

}  // namespace kiln::cpu
