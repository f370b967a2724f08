// Known values for the reference kernels: the oracle is checked independently here (values
// computed by hand or with a short Python transcription of the HF formulas), since the
// harness can only compare backends with it.
#include <gtest/gtest.h>

#include <cmath>

#include "backends/builtin.h"
#include "engine/builder.h"
#include "engine/program.h"

namespace kiln {
namespace {

class RefKernelsTest : public ::testing::Test {
 protected:
  std::unique_ptr<backend::Backend> backend_ = backend::MakeRefBackend();
  backend::Device& dev_ = *backend_->device(0);
  std::unique_ptr<backend::Stream> stream_ = *dev_.CreateStream();

  struct In {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<double> values;
  };
  std::vector<double> Run(std::vector<In> inputs,
                          const std::function<Value(Builder&, std::vector<Value>)>& fn) {
    Graph g;
    Builder b(&g);
    std::vector<Value> vals;
    for (const In& in : inputs) {
      vals.push_back(b.Input(in.name, in.dtype, SymShape(in.shape.begin(), in.shape.end())));
    }
    const Value out = fn(b, vals);
    EXPECT_TRUE(b.ok()) << b.status();
    auto p = Compile(g, {out}, dev_);
    EXPECT_TRUE(p.ok()) << p.status();
    for (const In& in : inputs) {
      EXPECT_TRUE(
          (*p)->Bind(in.name, *Tensor::FromDoubles(dev_, in.dtype, in.shape, in.values)).ok());
    }
    EXPECT_TRUE((*p)->Run(*stream_).ok());
    return *(*p)->Output(0)->ToDoubles();
  }
};

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

TEST_F(RefKernelsTest, RopeLayoutsMatchHandComputedRotations) {
  const In x{"x", DType::kF64, {1, 1, 8}, {1, 2, 3, 4, 5, 6, 7, 8}};
  const In pos{"pos", DType::kI32, {1}, {3}};
  ExpectNear(Run({x, pos},
                 [](Builder& b, std::vector<Value> v) { return b.Rope(v[0], v[1], RopeParams{}); }),
             {-1.6955925368997815, 0.13755173828317435, 2.7886815998294927, 3.975982036013484,
              -4.8088424749423595, 6.323059348076315, 7.086836736850399, 8.011963982027009},
             1e-12);
  RopeParams inter;
  inter.layout = RopeParams::Layout::kInterleaved;
  ExpectNear(
      Run({x, pos}, [&](Builder& b, std::vector<Value> v) { return b.Rope(v[0], v[1], inter); }),
      {-1.27223251272018, -1.8388649851410237, 1.6839286407314598, 4.707906576486443,
       4.817777167529964, 6.147277703506403, 6.975968536023609, 8.020963968527013},
      1e-12);
}

TEST_F(RefKernelsTest, RopeLlama3ScalingUsesTheHfFrequencies) {
  // theta 5e5, factor 8, low 1, high 4, original 8192: pair 0 and 1 keep their frequency,
  // pair 2 is blended, pair 3 is divided by the factor.
  const double want_freq[4] = {1.0, 0.03760603093086393, 0.0005248461609929547,
                               6.647869871181235e-06};
  RopeParams p;
  p.scaling = RopeParams::Scaling::kLlama3;
  p.theta = 500000;
  p.factor = 8;
  const double position = 1000;
  const auto out = Run({{"x", DType::kF64, {1, 1, 8}, {1, 1, 1, 1, 0, 0, 0, 0}},
                        {"pos", DType::kI32, {1}, {position}}},
                       [&](Builder& b, std::vector<Value> v) { return b.Rope(v[0], v[1], p); });
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(out[i], std::cos(position * want_freq[i]), 1e-9) << i;
    EXPECT_NEAR(out[i + 4], std::sin(position * want_freq[i]), 1e-9) << i;
  }
}

TEST_F(RefKernelsTest, QuantizedLinearEqualsLinearOnDequantizedWeights) {
  std::vector<double> w(2 * 64), x(64);
  for (int i = 0; i < 128; ++i) w[i] = std::sin(0.37 * i);
  for (int i = 0; i < 64; ++i) x[i] = std::cos(0.11 * i);
  Tensor wq = *Tensor::FromDoubles(dev_, DType::kQ8_0, {2, 64}, w);
  const std::vector<double> deq = *wq.ToDoubles();
  const auto got = Run({{"x", DType::kF64, {1, 64}, x}, {"w", DType::kQ8_0, {2, 64}, w}},
                       [](Builder& b, std::vector<Value> v) { return b.Linear(v[0], v[1]); });
  for (int n = 0; n < 2; ++n) {
    double want = 0;
    for (int k = 0; k < 64; ++k) want += x[k] * deq[n * 64 + k];
    EXPECT_NEAR(got[n], want, 1e-12);
  }
}

TEST_F(RefKernelsTest, SelectionOpsOrderTiesAndNaNs) {
  const In x{"x", DType::kF32, {1, 5}, {1, NAN, 3, 3, -1}};
  EXPECT_EQ(Run({x}, [](Builder& b, std::vector<Value> v) { return b.TopK(v[0], 5).second; }),
            (std::vector<double>{1, 2, 3, 0, 4}));  // NaN largest; ties: lower index first
  EXPECT_EQ(Run({{"x", DType::kF32, {4}, {2, 5, 5, 1}}},
                [](Builder& b, std::vector<Value> v) { return b.ArgMax(v[0], 0); }),
            (std::vector<double>{1}));
}

TEST_F(RefKernelsTest, NumericallyStableRowOps) {
  const double l2 = std::log(2.0), l3 = std::log(3.0);
  ExpectNear(Run({{"z", DType::kF64, {1, 3}, {0, l2, l3}}, {"t", DType::kI32, {1}, {2}}},
                 [](Builder& b, std::vector<Value> v) { return b.CrossEntropy(v[0], v[1]); }),
             {l2}, 1e-14);  // log(1 + 2 + 3) - log 3
  ExpectNear(Run({{"z", DType::kF64, {2, 2}, {1000, 1001, -INFINITY, -INFINITY}}},
                 [](Builder& b, std::vector<Value> v) { return b.Softmax(v[0]); }),
             {1 / (1 + std::exp(1.0)), std::exp(1.0) / (1 + std::exp(1.0)), 0, 0}, 1e-14);
  ExpectNear(Run({{"z", DType::kF64, {1, 3}, {1, 2, 3}}},
                 [](Builder& b, std::vector<Value> v) { return b.LayerNorm(v[0], 0); }),
             {-std::sqrt(1.5), 0, std::sqrt(1.5)}, 1e-14);
  ExpectNear(Run({{"z", DType::kF64, {1, 2}, {3, 4}}},
                 [](Builder& b, std::vector<Value> v) { return b.RmsNorm(v[0], 0); }),
             {3 / std::sqrt(12.5), 4 / std::sqrt(12.5)}, 1e-14);
}

TEST_F(RefKernelsTest, CastsSaturateAndIndicesOutOfRangeReadZero) {
  EXPECT_EQ(Run({{"x", DType::kF32, {4}, {300, -300, NAN, 2.9}}},
                [](Builder& b, std::vector<Value> v) { return b.Cast(v[0], DType::kI8); }),
            (std::vector<double>{127, -128, 0, 2}));
  EXPECT_EQ(Run({{"t", DType::kF32, {2, 2}, {1, 2, 3, 4}}, {"i", DType::kI32, {3}, {1, 7, -1}}},
                [](Builder& b, std::vector<Value> v) { return b.Gather(v[0], v[1]); }),
            (std::vector<double>{3, 4, 0, 0, 0, 0}));
  EXPECT_EQ(
      Run({{"a", DType::kF32, {2, 2}, {1, 2, 3, 4}}, {"b", DType::kF32, {2, 2}, {5, 6, 7, 8}}},
          [](Builder& b, std::vector<Value> v) { return b.MatMul(v[0], v[1]); }),
      (std::vector<double>{19, 22, 43, 50}));
}

}  // namespace
}  // namespace kiln
