// The avx2 variant of the optimizer loops (optimizer_impl.h); CMake compiles this file with
// the variant's target flags and -ffp-contract=off. Runs only where ActiveIsa() is avx2.
#include <immintrin.h>

#include "backends/cpu/kernels/optimizer.h"

namespace kiln::cpu::avx2 {
namespace {
struct VecD {
  static constexpr int kLanes = 4;
  __m256d v;
  static VecD Set1(double x) { return {_mm256_set1_pd(x)}; }
  static VecD Load(const float* p) { return {_mm256_cvtps_pd(_mm_loadu_ps(p))}; }
  void Store(float* p) const { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
  friend VecD operator+(VecD a, VecD b) { return {_mm256_add_pd(a.v, b.v)}; }
  friend VecD operator-(VecD a, VecD b) { return {_mm256_sub_pd(a.v, b.v)}; }
  friend VecD operator*(VecD a, VecD b) { return {_mm256_mul_pd(a.v, b.v)}; }
  friend VecD operator/(VecD a, VecD b) { return {_mm256_div_pd(a.v, b.v)}; }
  friend VecD Sqrt(VecD a) { return {_mm256_sqrt_pd(a.v)}; }
};
}  // namespace
}  // namespace kiln::cpu::avx2

#define KILN_ISA_NS avx2
#include "backends/cpu/kernels/optimizer_impl.h"
#undef KILN_ISA_NS

namespace kiln::cpu::avx2 {
void OptimizerRange(const OptimizerStep& s, int64_t begin, int64_t end) {
  OptimizerRangeOf<VecD>(s, begin, end);
}
}  // namespace kiln::cpu::avx2
