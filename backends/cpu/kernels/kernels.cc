#include "backends/cpu/kernels/kernels.h"

#include "spdlog/spdlog.h"

namespace kiln::cpu {

bool HasFastDecoder(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ8_0:
    case DType::kMXFP4:
      return true;
    default:
      return false;
  }
}

bool HasQ8Path(DType t) {
  return t == DType::kQ4_0 || t == DType::kQ4_1 || t == DType::kQ8_0 || t == DType::kMXFP4;
}

const IsaKernels* KernelsFor(Isa isa) {
  if (!IsaSupported(isa)) return nullptr;
  switch (isa) {
    case Isa::kScalar:
      return &ScalarKernels();
    case Isa::kAvx2:
      return &Avx2Kernels();
    case Isa::kAvx512:
      return &Avx512Kernels();
  }
  return nullptr;
}

const Q8Kernels* VnniQ8Kernels() { return CpuHasAvx512Vnni() ? &Avx512VnniQ8Kernels() : nullptr; }

namespace avx512bf16 {
double MeasureDotSpeedup();  // kernels_bf16.cc; only where CpuHasAvx512Bf16()
}  // namespace avx512bf16

double Bf16DotSpeedup() {
  static const double speedup = [] {
    if (!CpuHasAvx512Bf16()) return 0.0;
    const double s = avx512bf16::MeasureDotSpeedup();
    spdlog::info("cpu: vdpbf16ps runs {:.2f}x the multiply-adds of 512-bit FMAs here ({})", s,
                 s >= kMinBf16DotSpeedup ? "activations: bf16 uses it"
                                         : "activations: bf16 keeps the exact f32 kernels");
    return s;
  }();
  return speedup;
}

const Bf16Kernels* Bf16KernelsFor(Isa isa) {
  if (isa != Isa::kAvx512 || !IsaSupported(isa) || !CpuHasAvx512Bf16()) return nullptr;
  return Bf16DotSpeedup() >= kMinBf16DotSpeedup ? &Avx512Bf16Kernels() : nullptr;
}

const Q8Kernels* Q8KernelsFor(Isa isa) {
  if (!IsaSupported(isa)) return nullptr;
  if (isa == Isa::kScalar) return &ScalarQ8Kernels();
  if (isa == Isa::kAvx512 && VnniQ8Kernels() != nullptr) return VnniQ8Kernels();
  return &Avx2Q8Kernels();
}

}  // namespace kiln::cpu
