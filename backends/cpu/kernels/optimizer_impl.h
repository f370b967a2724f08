// The element loops of the fused optimizers (optimizer.cc), written once over a vector of
// doubles and compiled per instruction set like kernels_impl.h: an optimizer_<isa>.cc file
// defines in namespace kiln::cpu::<isa> a vector of kLanes doubles (+ - * /, Sqrt, Set1, Load
// from floats, Store to floats rounding to nearest), includes this header, and defines its
// OptimizerRange (optimizer.h) as OptimizerRangeOf<its vector>.
//
// Every variant computes what the reference kernel computes (backends/ref/ref_kernels.cc
// OptimizerElements: torch.optim's single-tensor updates, per element in double, in the same
// order) with correctly rounded IEEE operations, so its results equal the reference's bit for
// bit. CMake compiles these files with -ffp-contract=off: a fused multiply-add would round
// differently.
//
// No include guard on purpose: included once per variant.

#include <cmath>
#include <cstdint>
#include <span>

#include "backends/cpu/kernels/optimizer.h"

namespace kiln::cpu::KILN_ISA_NS {
namespace {

// One lane: the tail of each range.
struct Lane1 {
  static constexpr int kLanes = 1;
  double v;
  static Lane1 Set1(double x) { return {x}; }
  static Lane1 Load(const float* p) { return {*p}; }
  void Store(float* p) const { *p = static_cast<float>(v); }
  friend Lane1 operator+(Lane1 a, Lane1 b) { return {a.v + b.v}; }
  friend Lane1 operator-(Lane1 a, Lane1 b) { return {a.v - b.v}; }
  friend Lane1 operator*(Lane1 a, Lane1 b) { return {a.v * b.v}; }
  friend Lane1 operator/(Lane1 a, Lane1 b) { return {a.v / b.v}; }
  friend Lane1 Sqrt(Lane1 a) { return {std::sqrt(a.v)}; }
};

// Elements [e, e + V::kLanes) of each update (OptimizerElements cites torch's equations).
template <class V, bool kFirst, bool kAdamW>
inline void AdamLanes(const OptimizerStep& s, int64_t e) {
  const std::span<const double> f = s.floats;
  const V beta1 = V::Set1(f[0]), beta2 = V::Set1(f[1]), eps = V::Set1(f[2]);
  V g = V::Load(s.grad + e) * V::Set1(s.scale);
  V p = V::Load(s.param + e);
  if constexpr (kAdamW) {
    p = p * V::Set1(1 - s.lr * f[3]);
  } else {
    g = g + V::Set1(f[3]) * p;
  }
  const V m0 = kFirst ? V::Set1(0) : V::Load(s.state_in[0] + e);
  const V v0 = kFirst ? V::Set1(0) : V::Load(s.state_in[1] + e);
  const V m = beta1 * m0 + V::Set1(1 - f[0]) * g;
  const V v = beta2 * v0 + V::Set1(1 - f[1]) * g * g;
  m.Store(s.state_out[0] + e);
  v.Store(s.state_out[1] + e);
  p = p - V::Set1(s.step_size) * m / (Sqrt(v) / V::Set1(s.bias_correction2_sqrt) + eps);
  p.Store(s.param_out + e);
}

template <class V, bool kFirst, bool kMomentum>
inline void SgdLanes(const OptimizerStep& s, int64_t e) {
  const std::span<const double> f = s.floats;
  const V p = V::Load(s.param + e);
  V g = V::Load(s.grad + e) * V::Set1(s.scale);
  g = g + V::Set1(f[2]) * p;
  if constexpr (kMomentum) {
    const V momentum = V::Set1(f[0]);
    const V buf = kFirst ? g : momentum * V::Load(s.state_in[0] + e) + V::Set1(1 - f[1]) * g;
    buf.Store(s.state_out[0] + e);
    g = s.nesterov ? g + momentum * buf : buf;
  }
  (p - V::Set1(s.lr) * g).Store(s.param_out + e);
}

template <class V, bool kFirst>
inline void AdagradLanes(const OptimizerStep& s, int64_t e) {
  const std::span<const double> f = s.floats;
  const V p = V::Load(s.param + e);
  V g = V::Load(s.grad + e) * V::Set1(s.scale);
  g = g + V::Set1(f[1]) * p;
  const V sum = (kFirst ? V::Set1(f[2]) : V::Load(s.state_in[0] + e)) + g * g;
  sum.Store(s.state_out[0] + e);
  (p - V::Set1(s.step_size) * g / (Sqrt(sum) + V::Set1(f[3]))).Store(s.param_out + e);
}

// Whole vectors of [e, end); returns where the tail starts.
template <class V, bool kFirst>
int64_t Lanes(const OptimizerStep& s, int64_t e, int64_t end) {
  const int64_t last = end - V::kLanes;
  switch (s.op) {
    case OpKind::kAdamW:
      for (; e <= last; e += V::kLanes) AdamLanes<V, kFirst, true>(s, e);
      break;
    case OpKind::kAdam:
      for (; e <= last; e += V::kLanes) AdamLanes<V, kFirst, false>(s, e);
      break;
    case OpKind::kSgd:
      if (s.floats[0] != 0) {
        for (; e <= last; e += V::kLanes) SgdLanes<V, kFirst, true>(s, e);
      } else {
        for (; e <= last; e += V::kLanes) SgdLanes<V, kFirst, false>(s, e);
      }
      break;
    default:
      for (; e <= last; e += V::kLanes) AdagradLanes<V, kFirst>(s, e);
      break;
  }
  return e;
}

// Elements [begin, end) of `s`: vectors of V, then single lanes.
template <class V>
void OptimizerRangeOf(const OptimizerStep& s, int64_t begin, int64_t end) {
  if (s.first) {
    Lanes<Lane1, true>(s, Lanes<V, true>(s, begin, end), end);
  } else {
    Lanes<Lane1, false>(s, Lanes<V, false>(s, begin, end), end);
  }
}

}  // namespace
}  // namespace kiln::cpu::KILN_ISA_NS
