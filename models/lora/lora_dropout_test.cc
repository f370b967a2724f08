// The LoRA dropout hash (models/lora/lora_dropout.h): the host function and the expression
// agree, and the masks look like independent Bernoulli draws — the right keep rate, no
// correlation between neighbouring elements, between modules or between steps.
#include "models/lora/lora_dropout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kiln::models {
namespace {

std::vector<int> Mask(int64_t step_seed, int64_t module, int64_t n, double p) {
  std::vector<int> m(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) m[i] = LoraDropoutKeep(step_seed, module, i, p) ? 1 : 0;
  return m;
}

// Pearson correlation of two 0/1 sequences.
double Correlation(const std::vector<int>& a, const std::vector<int>& b) {
  double ma = 0, mb = 0;
  for (size_t i = 0; i < a.size(); ++i) ma += a[i], mb += b[i];
  ma /= a.size(), mb /= b.size();
  double cov = 0, va = 0, vb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    cov += (a[i] - ma) * (b[i] - mb);
    va += (a[i] - ma) * (a[i] - ma);
    vb += (b[i] - mb) * (b[i] - mb);
  }
  return cov / std::sqrt(va * vb);
}

TEST(LoraDropoutTest, KeepRateAndIndependence) {
  const int64_t n = 1 << 18;  // 4 sigma of a Bernoulli mean over n: ~0.0035
  const int64_t seed = LoraDropoutStepSeed(42, 1, 0);
  const int64_t q = LoraDropoutModuleId("blk.0.attn_q"), k = LoraDropoutModuleId("blk.0.attn_k");
  EXPECT_NE(q, k);
  for (const double p : {0.05, 0.1, 0.25, 0.5, 0.9}) {
    SCOPED_TRACE(p);
    const std::vector<int> m = Mask(seed, q, n, p);
    double kept = 0;
    for (int x : m) kept += x;
    EXPECT_NEAR(kept / n, 1 - p, 0.004);
    // Neighbours along a row (lag 1), along a column of a 576-wide input (lag 576), and at
    // a power of two.
    for (const int64_t lag : {1, 2, 576, 1024}) {
      const std::vector<int> a(m.begin(), m.end() - lag), b(m.begin() + lag, m.end());
      EXPECT_LT(std::fabs(Correlation(a, b)), 0.01) << "lag " << lag;
    }
    // Another module (the q/k/v projections read the same input) and the next step.
    EXPECT_LT(std::fabs(Correlation(m, Mask(seed, k, n, p))), 0.01);
    EXPECT_LT(std::fabs(Correlation(m, Mask(LoraDropoutStepSeed(42, 2, 0), q, n, p))), 0.01);
    EXPECT_LT(std::fabs(Correlation(m, Mask(LoraDropoutStepSeed(42, 1, 1), q, n, p))), 0.01);
    EXPECT_LT(std::fabs(Correlation(m, Mask(LoraDropoutStepSeed(43, 1, 0), q, n, p))), 0.01);
  }
}

TEST(LoraDropoutTest, SeedsAndIdsAreInRangeAndStable) {
  for (int64_t step = 1; step < 1000; ++step) {
    const int64_t s = LoraDropoutStepSeed(7, step, step % 3);
    EXPECT_GE(s, 0);
    EXPECT_LT(s, kDropoutModulus);
  }
  EXPECT_EQ(LoraDropoutStepSeed(42, 1, 0), LoraDropoutStepSeed(42, 1, 0));
  EXPECT_NE(LoraDropoutStepSeed(42, 1, 0), LoraDropoutStepSeed(42, 2, 0));
  // Fixed values: scripts/fixtures/make_training_fixtures.py computes the same ones.
  EXPECT_EQ(LoraDropoutModuleId(""), static_cast<int64_t>(0xcbf29ce484222325ull % 2147483647ull));
}

TEST(LoraDropoutTest, ExpressionMatchesTheHostFunction) {
  const int64_t seed = LoraDropoutStepSeed(42, 3, 1), module = LoraDropoutModuleId("blk.2.ffn_up");
  const double p = 0.3;
  const ExprProgram program(LoraDropoutMaskExpr(Expr::Int(seed), module, Expr::Index(0), p));
  int kept = 0;
  for (int64_t i = 0; i < 4096; ++i) {
    ExprEnv env;
    env.index = &i;
    const double want = LoraDropoutKeep(seed, module, i, p) ? 1.0 / (1.0 - p) : 0.0;
    EXPECT_NEAR(program.Eval(env).f, want, 1e-6) << i;
    kept += want > 0;
  }
  EXPECT_GT(kept, 2500);
  EXPECT_LT(kept, 3200);
}

}  // namespace
}  // namespace kiln::models
