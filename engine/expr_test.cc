#include "engine/expr.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kiln {
namespace {

double EvalF(const Expr& e, std::vector<double> in, std::vector<int64_t> idx = {}) {
  std::vector<ExprValue> v(in.size());
  for (size_t i = 0; i < in.size(); ++i) v[i].f = in[i];
  ExprEnv env;
  env.inputs = v.data();
  env.index = idx.data();
  ExprProgram p(e);
  ExprValue r = p.Eval(env);
  return (e.type() == DType::kF32 || e.type() == DType::kF64) ? r.f : static_cast<double>(r.i);
}

TEST(ExprTest, BuildPrintAndEvaluate) {
  Expr x = Expr::Input(0), y = Expr::Input(1);
  Expr e = x * Sigmoid(x) + y / 2.0;
  EXPECT_EQ(e.type(), DType::kF32);
  EXPECT_EQ(e.ToString(), "((in0 * sigmoid(in0)) + (in1 / 2))");
  EXPECT_NEAR(EvalF(e, {1.5, 3.0}), 1.5 / (1 + std::exp(-1.5)) + 1.5, 1e-6);
  EXPECT_EQ(e.NumInputs(), 2);
  EXPECT_TRUE(e.Uses(ExprOp::kInput, 1));
  EXPECT_FALSE(e.Uses(ExprOp::kIndex));
}

TEST(ExprTest, PromotionAndConstantFolding) {
  Expr i = Expr::Index(0);
  Expr mixed = i + Expr::Input(0, DType::kF64);
  EXPECT_EQ(mixed.type(), DType::kF64);
  EXPECT_EQ(Ge(i, Expr::Int(3)).type(), DType::kBool);
  Expr folded = Expr::Const(2.0) * Expr::Const(3.0) + 1.0;
  ASSERT_EQ(folded.node().op, ExprOp::kConst);
  EXPECT_EQ(folded.node().fvalue, 7.0);
  EXPECT_EQ(Select(Expr::Bool(true), Expr::Input(0), Expr::Input(1)), Expr::Input(0));
}

TEST(ExprTest, F32NodesRoundLikeF32Code) {
  // exp(100) overflows in f32 but not in f64: the interpreter must model f32 code.
  EXPECT_TRUE(std::isinf(EvalF(Exp(Expr::Input(0)), {100.0})));
  EXPECT_FALSE(std::isinf(EvalF(Exp(Expr::Input(0, DType::kF64)), {100.0})));
  EXPECT_EQ(EvalF(Expr::Input(0) + 1e-9, {1.0}), 1.0);
}

TEST(ExprTest, IntegerSemantics) {
  Expr a = Expr::Index(0), b = Expr::Index(1);
  EXPECT_EQ(EvalF(a / b, {}, {-7, 2}), -3);     // truncates
  EXPECT_EQ(EvalF(Mod(a, b), {}, {-7, 2}), 1);  // sign of divisor
  EXPECT_EQ(EvalF(Mod(a, b), {}, {7, -2}), -1);
  EXPECT_EQ(EvalF(a / b, {}, {7, 0}), 0);  // defined, not a crash
  EXPECT_EQ(EvalF(Expr::Cast(DType::kI64, Expr::Input(0)), {-2.7}), -2);
  EXPECT_EQ(EvalF(Expr::Cast(DType::kI64, Expr::Input(0)), {std::nan("")}), 0);
}

TEST(ExprTest, StructuralEqualityAndHash) {
  Expr a = Exp(Expr::Input(0) * 2.0);
  Expr b = Exp(Expr::Input(0) * 2.0);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.Hash(), b.Hash());
  EXPECT_NE(a, Exp(Expr::Input(0) * 3.0));
  EXPECT_NE(a.Hash(), Exp(Expr::Input(1) * 2.0).Hash());
}

TEST(ExprTest, DiffMatchesFiniteDifferences) {
  Expr x = Expr::Input(0, DType::kF64), y = Expr::Input(1, DType::kF64);
  const std::vector<Expr> fns = {
      x * y,
      x / y,
      Exp(x) * Log(y),
      Sqrt(x * y),
      Rsqrt(x + y),
      Tanh(x - y),
      Sigmoid(x * y),
      Erf(x),
      Pow(x, y),
      Max(x, y * 2.0),
      Min(x, y),
      Abs(x - y),
      Select(Gt(x, y), x * x, y * 3.0),
      Expr::Unary(ExprOp::kSin, x) * Expr::Unary(ExprOp::kCos, y),
      Mod(x * 3.0, y),
      -x + 0.5 * y,
  };
  const std::vector<std::pair<double, double>> points = {{0.7, 1.3}, {1.9, 0.4}, {0.3, 2.2}};
  for (const Expr& f : fns) {
    for (auto [px, py] : points) {
      for (int wrt = 0; wrt < 2; ++wrt) {
        const Expr df = Diff(f, wrt);
        const double h = 1e-6;
        std::vector<double> lo = {px, py}, hi = {px, py};
        lo[wrt] -= h;
        hi[wrt] += h;
        const double fd = (EvalF(f, hi) - EvalF(f, lo)) / (2 * h);
        EXPECT_NEAR(EvalF(df, {px, py}), fd, 1e-5 * (1 + std::fabs(fd)))
            << f.ToString() << " d/din" << wrt << " at (" << px << "," << py
            << "): " << df.ToString();
      }
    }
  }
}

TEST(ExprTest, DiffSimplifies) {
  Expr x = Expr::Input(0), y = Expr::Input(1);
  EXPECT_EQ(Diff(x + y, 0).ToString(), "1");
  EXPECT_EQ(Diff(x * y, 0).ToString(), "in1");
  EXPECT_EQ(Diff(Expr::Index(0) * y, 0).ToString(), "0");
  EXPECT_EQ(Diff(Expr::Cast(DType::kF32, Expr::Index(1)), 0).ToString(), "0");
}

TEST(ExprTest, SubstituteInlines) {
  Expr x = Expr::Input(0);
  Expr inner = Expr::Input(0) + Expr::Input(1);
  Expr e = Substitute(Exp(x), std::vector<Expr>{inner});
  EXPECT_EQ(e.ToString(), "exp((in0 + in1))");
}

TEST(ExprTest, AttentionModifiers) {
  auto mask = [](const Expr& m, std::vector<int64_t> bhqk) { return EvalF(m, {}, bhqk); };
  EXPECT_EQ(mask(attn::CausalMask(), {0, 0, 5, 5}), 1);
  EXPECT_EQ(mask(attn::CausalMask(), {0, 0, 5, 6}), 0);
  EXPECT_EQ(mask(attn::SlidingWindowMask(3), {0, 0, 10, 8}), 1);
  EXPECT_EQ(mask(attn::SlidingWindowMask(3), {0, 0, 10, 7}), 0);
  // Prefix-LM reads the prefix length of sequence b from aux tensor 0.
  const int64_t prefix[] = {4, 0};
  ExprEnv env;
  int64_t idx[] = {0, 0, 1, 3};
  env.index = idx;
  env.load = [](const void* ctx, int, int64_t i, DType) {
    ExprValue v;
    v.i = static_cast<const int64_t*>(ctx)[i];
    return v;
  };
  env.load_ctx = prefix;
  EXPECT_EQ(ExprProgram(attn::PrefixLmMask(0)).Eval(env).i, 1);  // kv 3 < prefix 4
  idx[0] = 1;
  EXPECT_EQ(ExprProgram(attn::PrefixLmMask(0)).Eval(env).i, 0);  // no prefix: causal
  // ALiBi with 8 heads: head 0 slope 2^-1.
  EXPECT_NEAR(EvalF(attn::AlibiScore(8), {1.0}, {0, 0, 10, 6}), 1.0 - 0.5 * 4, 1e-6);
  EXPECT_NEAR(EvalF(attn::SoftCapScore(30), {100.0}), 30 * std::tanh(100.0 / 30), 1e-5);
  // Chunks of 4: query 9 (chunk 8..11) sees keys 8 and 9 only.
  EXPECT_EQ(mask(attn::ChunkedMask(4), {0, 0, 9, 8}), 1);
  EXPECT_EQ(mask(attn::ChunkedMask(4), {0, 0, 9, 9}), 1);
  EXPECT_EQ(mask(attn::ChunkedMask(4), {0, 0, 9, 7}), 0);
  EXPECT_EQ(mask(attn::ChunkedMask(4), {0, 0, 9, 10}), 0);
  EXPECT_EQ(mask(attn::ChunkedMask(4), {0, 0, 8, 8}), 1);
  // Combinations.
  const Expr both = And(attn::ChunkedMask(4), attn::SlidingWindowMask(2));
  EXPECT_EQ(mask(both, {0, 0, 11, 10}), 1);
  EXPECT_EQ(mask(both, {0, 0, 11, 9}), 0);  // same chunk, outside the window
  EXPECT_EQ(mask(Or(attn::CausalMask(), attn::SlidingWindowMask(2)), {0, 0, 3, 0}), 1);
  // Soft-capping of an ALiBi-biased score: the cap applies last.
  EXPECT_NEAR(EvalF(attn::Then(attn::AlibiScore(8), attn::SoftCapScore(2)), {1.0}, {0, 0, 10, 6}),
              2 * std::tanh((1.0 - 0.5 * 4) / 2), 1e-6);
}

// The two examples of docs/engine.md ("Writing one"), as written there.
Expr GlobalTokensMask(int64_t n) {
  using namespace attn;
  const Expr global = Or(Lt(QIdx(), Expr::Int(n)), Lt(KvIdx(), Expr::Int(n)));
  return Or(CausalMask(), global);
}
Expr HeadTemperatureScore(int aux) {
  using namespace attn;
  return Score() / Expr::Load(aux, Head(), DType::kF32);
}

TEST(ExprTest, TheModifierExamplesOfTheDocs) {
  auto mask = [](const Expr& m, std::vector<int64_t> bhqk) { return EvalF(m, {}, bhqk); };
  EXPECT_EQ(mask(GlobalTokensMask(4), {0, 0, 2, 9}), 1);   // a global query sees the future
  EXPECT_EQ(mask(GlobalTokensMask(4), {0, 0, 9, 3}), 1);   // a global key is seen
  EXPECT_EQ(mask(GlobalTokensMask(4), {0, 0, 9, 10}), 0);  // otherwise causal
  const Expr both = And(GlobalTokensMask(4), attn::SlidingWindowMask(256));
  EXPECT_EQ(mask(both, {0, 0, 1000, 3}), 0);
  const float temps[] = {2, 4};
  ExprEnv env;
  int64_t idx[] = {0, 1, 5, 5};
  const ExprValue score{.f = 8};
  env.inputs = &score;
  env.index = idx;
  env.load = [](const void* ctx, int, int64_t i, DType) {
    return ExprValue{.f = static_cast<const float*>(ctx)[i]};
  };
  env.load_ctx = temps;
  EXPECT_NEAR(ExprProgram(attn::Then(HeadTemperatureScore(0), attn::SoftCapScore(30))).Eval(env).f,
              30 * std::tanh(8.0 / 4 / 30), 1e-6);
}

TEST(ExprTest, RelativeBiasScoreReadsTheClampedDistanceOfItsHead) {
  // Two heads, max distance 2: a table of 2 * 5 floats, entry h * 5 + clamp(kv - q) + 2.
  const float table[] = {10, 11, 12, 13, 14, 20, 21, 22, 23, 24};
  ExprEnv env;
  int64_t idx[] = {0, 1, 7, 6};
  const ExprValue score{.f = 0.5};
  env.inputs = &score;
  env.index = idx;
  env.load = [](const void* ctx, int aux, int64_t i, DType t) {
    EXPECT_EQ(aux, 0);
    EXPECT_EQ(t, DType::kF32);
    EXPECT_TRUE(i >= 0 && i < 10) << i;
    return ExprValue{.f = static_cast<const float*>(ctx)[i]};
  };
  env.load_ctx = table;
  const ExprProgram bias(attn::RelativeBiasScore(0, 2));
  EXPECT_DOUBLE_EQ(bias.Eval(env).f, 0.5 + 21);  // head 1, distance -1
  idx[3] = 0;
  EXPECT_DOUBLE_EQ(bias.Eval(env).f, 0.5 + 20);  // distance -7 clamps to -2
  idx[1] = 0;
  idx[3] = 9;
  EXPECT_DOUBLE_EQ(bias.Eval(env).f, 0.5 + 14);  // head 0, distance 2
}

}  // namespace
}  // namespace kiln
