#include "backends/cpu/kernels/kernels.h"

#include <cmath>
#include <limits>

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

const Q8Kernels* Q8KernelsFor(Isa isa) {
  if (!IsaSupported(isa)) return nullptr;
  if (isa == Isa::kScalar) return &ScalarQ8Kernels();
  if (isa == Isa::kAvx512 && VnniQ8Kernels() != nullptr) return VnniQ8Kernels();
  return &Avx2Q8Kernels();
}

void CombinePartials(const float* const* parts, int n, int64_t dv, float* out) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float m = ninf;
  for (int i = 0; i < n; ++i) {
    const float mi = parts[i][0];
    m = (std::isnan(m) || std::isnan(mi)) ? NAN : std::max(m, mi);
  }
  for (int64_t e = 0; e < dv; ++e) out[e] = 0;
  if (m == ninf) return;  // no visible key in any part
  float l = 0;
  for (int i = 0; i < n; ++i) {
    if (parts[i][0] == ninf) continue;
    const float w = std::exp(parts[i][0] - m);
    l += parts[i][1] * w;
    for (int64_t e = 0; e < dv; ++e) out[e] += parts[i][2 + e] * w;
  }
  const float inv = 1.0f / l;
  for (int64_t e = 0; e < dv; ++e) out[e] *= inv;
}

}  // namespace kiln::cpu
