#include "backends/cpu/kernels/isa.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "spdlog/spdlog.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace kiln::cpu {
namespace {

#if defined(__x86_64__)
uint64_t Xgetbv() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

Isa Detect() {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::kScalar;
  const bool fma = c & bit_FMA, f16c = c & bit_F16C, osxsave = c & bit_OSXSAVE, avx = c & bit_AVX;
  if (!(osxsave && avx && fma && f16c)) return Isa::kScalar;
  const uint64_t xcr0 = Xgetbv();
  if ((xcr0 & 0x6) != 0x6) return Isa::kScalar;  // the OS saves XMM and YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::kScalar;
  if (!(b & bit_AVX2)) return Isa::kScalar;
  const bool avx512 = (b & bit_AVX512F) && (b & bit_AVX512BW) && (b & bit_AVX512VL) &&
                      (b & bit_AVX512DQ) && (xcr0 & 0xe6) == 0xe6;  // + opmask, ZMM state
  return avx512 ? Isa::kAvx512 : Isa::kAvx2;
#else
  return Isa::kScalar;
#endif
}

bool DetectAvx512Vnni() {
#if defined(__x86_64__)
  if (DetectedIsa() != Isa::kAvx512) return false;  // needs AVX-512 VL and the OS's ZMM state
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & bit_AVX512VNNI);
#else
  return false;
#endif
}

bool DetectAvx512Bf16() {
#if defined(__x86_64__)
  if (DetectedIsa() != Isa::kAvx512) return false;
  unsigned a, b, c, d;
  // CPUID.(EAX=7, ECX=1):EAX bit 5 (GCC 12's cpuid.h has no name for it).
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
#else
  return false;
#endif
}

std::string Brand() {
#if defined(__x86_64__)
  unsigned regs[12] = {};
  unsigned max = __get_cpuid_max(0x80000000, nullptr);
  if (max >= 0x80000004) {
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002 + i, &regs[4 * i], &regs[4 * i + 1], &regs[4 * i + 2],
                  &regs[4 * i + 3]);
    }
    char s[49] = {};
    std::memcpy(s, regs, 48);
    std::string out(s);
    const size_t b = out.find_first_not_of(' '), e = out.find_last_not_of(' ');
    return b == std::string::npos ? "unknown cpu" : out.substr(b, e - b + 1);
  }
#endif
  return "unknown cpu";
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "scalar";
}

std::optional<Isa> ParseIsa(std::string_view name) {
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (name == IsaName(i)) return i;
  }
  return std::nullopt;
}

Isa DetectedIsa() {
  static const Isa isa = Detect();
  return isa;
}

Isa ActiveIsa() {
  static const Isa isa = [] {
    Isa best = DetectedIsa();
    if (const char* env = std::getenv("KILN_CPU_ISA"); env != nullptr && *env != '\0') {
      const std::optional<Isa> want = ParseIsa(env);
      if (!want) {
        spdlog::warn("KILN_CPU_ISA={} is not one of scalar, avx2, avx512; using {}", env,
                     IsaName(best));
      } else if (static_cast<int>(*want) < static_cast<int>(best)) {
        best = *want;
      }
    }
    return best;
  }();
  return isa;
}

bool CpuHasAvx512Vnni() {
  static const bool vnni = DetectAvx512Vnni();
  return vnni;
}

bool CpuHasAvx512Bf16() {
  static const bool bf16 = DetectAvx512Bf16();
  return bf16;
}

const char* CpuDescription() {
  static const std::string s = Brand() + " " + IsaName(DetectedIsa());
  return s.c_str();
}

}  // namespace kiln::cpu
