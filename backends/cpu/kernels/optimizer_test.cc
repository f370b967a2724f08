// The vectorized optimizer loops of every variant this CPU runs against the reference
// kernel's (OptimizerElements): equal bit for bit, for each optimizer and option, at the first
// step and a later one, over ranges whose ends fall inside a vector.
#include "backends/cpu/kernels/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/kernels/isa.h"
#include "backends/ref/ref_kernels.h"

namespace kiln::cpu {
namespace {

struct Config {
  std::string name;
  OpKind op;
  std::vector<double> floats;
  std::vector<int64_t> ints;
  int states;
};

std::vector<Config> Configs() {
  return {
      {"adamw", OpKind::kAdamW, {0.9, 0.999, 1e-8, 0.01}, {}, 2},
      {"adam, L2 decay", OpKind::kAdam, {0.8, 0.95, 1e-6, 0.1}, {}, 2},
      {"sgd, momentum", OpKind::kSgd, {0.9, 0.1, 0.01}, {0}, 1},
      {"sgd, nesterov", OpKind::kSgd, {0.9, 0, 0.001}, {1}, 1},
      {"sgd, no momentum", OpKind::kSgd, {0, 0, 0.01}, {0}, 0},
      {"adagrad", OpKind::kAdagrad, {0.01, 0.1, 0.1, 1e-10}, {}, 1},
  };
}

TensorArg Dense(std::vector<float>& v) {
  TensorArg t;
  t.data = v.data();
  t.dtype = DType::kF32;
  t.rank = 1;
  t.shape[0] = static_cast<int64_t>(v.size());
  t.strides[0] = 1;
  return t;
}

void (*RangeOf(Isa isa))(const OptimizerStep&, int64_t, int64_t) {
  switch (isa) {
    case Isa::kAvx512:
      return avx512::OptimizerRange;
    case Isa::kAvx2:
      return avx2::OptimizerRange;
    default:
      return scalar::OptimizerRange;
  }
}

TEST(CpuOptimizer, EveryVariantEqualsTheReferenceBitForBit) {
  constexpr int64_t n = 1000 + 13;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0, 1);
  int variants = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    ++variants;
    for (const Config& c : Configs()) {
      for (double step : {1.0, 5.0}) {
        SCOPED_TRACE(std::string(IsaName(isa)) + " " + c.name + " step " + std::to_string(step));
        std::vector<float> param(n), grad(n), hyper = {static_cast<float>(step), 1e-3f, 0.5f};
        std::vector<std::vector<float>> states(c.states, std::vector<float>(n));
        for (int64_t i = 0; i < n; ++i) {
          param[i] = normal(rng);
          grad[i] = normal(rng) * 1e-2f;
          for (auto& s : states) s[i] = std::abs(normal(rng)) * 1e-3f;
        }
        // The reference, out of place.
        std::vector<float> want_param(n);
        std::vector<std::vector<float>> want_states(c.states, std::vector<float>(n));
        std::vector<TensorArg> in = {Dense(param), Dense(grad), Dense(hyper)};
        std::vector<TensorArg> extra;
        for (int k = 0; k < c.states; ++k) {
          in.push_back(Dense(states[k]));
          extra.push_back(Dense(want_states[k]));
        }
        LaunchArgs a;
        a.inputs = in.data();
        a.num_inputs = static_cast<int32_t>(in.size());
        a.output = Dense(want_param);
        a.extra_outputs = extra.data();
        a.num_extra_outputs = c.states;
        Attrs attrs;
        attrs.floats = c.floats;
        attrs.ints = c.ints;
        ref::OptimizerElements(a, c.op, attrs, 0, n);

        // The variant, in place (as the trainer runs it), over two ranges split mid-vector.
        OptimizerStep s;
        s.op = c.op;
        s.floats = c.floats;
        s.nesterov = !c.ints.empty() && c.ints[0] != 0;
        s.lr = hyper[1];
        s.scale = hyper[2];
        SetStepScalars(step, &s);
        s.param = param.data();
        s.grad = grad.data();
        s.param_out = param.data();
        for (int k = 0; k < c.states; ++k) {
          s.state_in[k] = states[k].data();
          s.state_out[k] = states[k].data();
        }
        const auto range = RangeOf(isa);
        range(s, 0, 37);
        range(s, 37, n);
        EXPECT_EQ(std::memcmp(param.data(), want_param.data(), n * sizeof(float)), 0);
        for (int k = 0; k < c.states; ++k) {
          EXPECT_EQ(std::memcmp(states[k].data(), want_states[k].data(), n * sizeof(float)), 0)
              << "state " << k;
        }
      }
    }
  }
  EXPECT_GE(variants, 1);
}

}  // namespace
}  // namespace kiln::cpu
