#include "engine/builder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/autograd.h"
#include "engine/sampling.h"

namespace kiln {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(BuilderTest, BuildsTypedNamedGraph) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 64);
  const Value x = b.Input("x", DType::kF32, {T, 8});
  const Value w = b.Weight("blk.0.attn_norm.weight", DType::kF32, {8});
  b.SetNameScope("blk.0");
  const Value h = b.Named(b.RmsNorm(x, w, 1e-5), "attn_norm");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b.shape(h), (SymShape{T, 8}));
  EXPECT_EQ(b.dtype(h), DType::kF32);
  EXPECT_EQ(g.node(h.id).name, "blk.0.attn_norm");
  const std::string dump = g.ToString();
  EXPECT_NE(dump.find("symbols: T=[1,64]"), std::string::npos) << dump;
  EXPECT_NE(dump.find("= rms_norm(%0) eps=1e-05"), std::string::npos) << dump;
  EXPECT_NE(dump.find("blk.0.attn_norm: f32[T,8] = mul("), std::string::npos) << dump;
  EXPECT_NE(dump.find("= expand(%"), std::string::npos) << dump;  // w broadcast to [T,8]
}

TEST(BuilderTest, BroadcastsNumpyStyle) {
  Graph g;
  Builder b(&g);
  const Value a = b.Input("a", DType::kF32, {4, 1, 3});
  const Value c = b.Input("c", DType::kF32, {5, 1});
  const Value s = b.Add(a, c);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b.shape(s), (SymShape{4, 5, 3}));
}

TEST(BuilderTest, RecordsFirstErrorWithContext) {
  Graph g;
  Builder b(&g);
  const Value a = b.Input("a", DType::kF32, {4, 3});
  const Value c = b.Input("c", DType::kF16, {4, 3});
  const Value bad = b.Named(b.Add(a, c), "sum");
  EXPECT_FALSE(bad.valid());
  EXPECT_FALSE(b.ok());
  const std::string msg(StatusMessage(b.status()));
  EXPECT_NE(msg.find("add"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[4,3], f16[4,3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("explicit cast"), std::string::npos) << msg;
  // Later calls with the invalid value do not replace the first error.
  EXPECT_FALSE(b.Exp(bad).valid());
  EXPECT_EQ(std::string(StatusMessage(b.status())), msg);
  const Value d = b.Input("d", DType::kF32, {5});
  EXPECT_FALSE(b.Add(a, d).valid());
  EXPECT_EQ(std::string(StatusMessage(b.status())), msg);
}

TEST(BuilderTest, ShapeErrorsNameWhatIsAllowed) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {2, 8});
  const Value w = b.Weight("w", DType::kF32, {16, 4});
  EXPECT_FALSE(b.Linear(x, w).valid());
  EXPECT_NE(std::string(StatusMessage(b.status())).find("weight's K"), std::string::npos);
}

TEST(BuilderTest, ReshapeInfersMinusOneSymbolically) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 16);
  const Value x = b.Input("x", DType::kF32, {T, 32});
  const Value r = b.Reshape(x, {-1, 4, 8});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b.shape(r), (SymShape{T, 4, 8}));
  EXPECT_FALSE(b.Reshape(x, {-1, 5}).valid());
}

TEST(BuilderTest, RejectsNonMonotoneSourceShapes) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 16);
  const Dim S = b.Symbol("S", 4);
  EXPECT_FALSE(b.Input("x", DType::kF32, {S - T}).valid());
  EXPECT_NE(std::string(StatusMessage(b.status())).find("must not decrease"), std::string::npos);
  Graph g2;
  Builder b2(&g2);
  const Dim T2 = b2.Symbol("T", 16);
  EXPECT_TRUE(b2.Input("y", DType::kF32, {T2 - 1}).valid());  // monotone: fine
}

TEST(BuilderTest, QuantizedWeightsNeedWholeBlocks) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {2, 48});
  const Value w = b.Weight("w", DType::kQ4_0, {8, 48});
  EXPECT_FALSE(b.Linear(x, w).valid());
  EXPECT_NE(std::string(StatusMessage(b.status())).find("multiple of 32"), std::string::npos);
  Graph g2;
  Builder b2(&g2);
  const Value x2 = b2.Input("x", DType::kF32, {2, 64});
  const Value w2 = b2.Weight("w", DType::kQ4_0, {8, 64});
  EXPECT_EQ(b2.shape(b2.Linear(x2, w2)), (SymShape{2, 8}));
}

TEST(BuilderTest, AttentionChecksHeads) {
  Graph g;
  Builder b(&g);
  const Value q = b.Input("q", DType::kF32, {1, 6, 3, 8});
  const Value k = b.Input("k", DType::kF32, {1, 4, 3, 8});
  EXPECT_FALSE(b.Attention(q, k, k, {}).valid());
  EXPECT_NE(std::string(StatusMessage(b.status())).find("multiple of kv heads"), std::string::npos);
}

// The sample op's optional `allowed` mask: i32 [S, ceil(V / 32)]; a symbolic V must be 32
// times a size. Without penalty_bias the builder passes zero biases (inputs are positional).
TEST(BuilderTest, SampleChecksTheAllowedMask) {
  struct Shapes {
    Dim vocab;
    SymShape mask;
  };
  // `shapes(S, W)`: the logits' columns and the mask's shape, over the symbols S and W.
  auto sample = [](Graph& g, DType mask_type, auto shapes) {
    Builder b(&g);
    const Dim S = b.Symbol("S", 8), W = b.Symbol("W", 4096);
    const Shapes sh = shapes(S, W);
    const SampleOutputs o = b.Sample(
        b.Input("logits", DType::kF32, {S, sh.vocab}),
        b.Input("params", DType::kF32, {S, sampling::kNumParams}), b.Input("u", DType::kF64, {S}),
        b.Input("pt", DType::kI32, {S, 2}), b.Input("pc", DType::kI32, {S, 2}),
        b.Input("ban", DType::kI32, {S, 1}), Value{}, b.Input("allowed", mask_type, sh.mask));
    EXPECT_EQ(o.token.valid(), b.ok());
    return b.status();
  };
  auto error = [&](DType mask_type, auto shapes) {
    Graph g;
    return std::string(StatusMessage(sample(g, mask_type, shapes)));
  };
  {
    Graph g;
    ASSERT_TRUE(sample(g, DType::kI32, [](Dim S, Dim) { return Shapes{100, {S, 4}}; }).ok());
    const Node& n = g.nodes()[g.nodes().size() - 4];  // the sample node, then its 3 outputs
    ASSERT_EQ(n.op, OpKind::kSample);
    ASSERT_EQ(n.inputs.size(), 8u);
    EXPECT_EQ(g.node(n.inputs[6]).op, OpKind::kFull);  // the zero biases
    EXPECT_EQ(g.node(n.inputs[6]).shape, g.node(n.inputs[3]).shape);
  }
  {
    Graph g;  // 32 * W tokens: W words
    EXPECT_TRUE(sample(g, DType::kI32, [](Dim S, Dim W) { return Shapes{W * 32, {S, W}}; }).ok());
  }
  const std::string columns = error(DType::kI32, [](Dim S, Dim) { return Shapes{100, {S, 3}}; });
  EXPECT_THAT(columns,
              AllOf(HasSubstr("ceil(V / 32) columns"), HasSubstr("V = 100"), HasSubstr("got 3")));
  const std::string exact = error(DType::kI32, [](Dim S, Dim) { return Shapes{64, {S, 3}}; });
  EXPECT_THAT(exact, HasSubstr("ceil(V / 32) columns"));
  const std::string dtype = error(DType::kI64, [](Dim S, Dim) { return Shapes{64, {S, 2}}; });
  EXPECT_THAT(dtype, HasSubstr("allowed must be i32"));
  const std::string rows = error(DType::kI32, [](Dim, Dim) { return Shapes{64, {3, 2}}; });
  EXPECT_THAT(rows, HasSubstr("allowed must be i32 [S, ceil(V / 32)]"));
  const std::string rank = error(DType::kI32, [](Dim S, Dim) { return Shapes{64, {S}}; });
  EXPECT_THAT(rank, HasSubstr("of rank 1"));
  const std::string symbolic = error(DType::kI32, [](Dim S, Dim W) { return Shapes{W, {S, W}}; });
  EXPECT_THAT(symbolic, HasSubstr("32 times a size"));
}

TEST(AutogradTest, GradientsHaveInputTypesAndUnusedInputsGetZeros) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 8);
  const Value x = b.Input("x", DType::kF32, {T, 4});
  const Value w = b.Weight("w", DType::kF32, {3, 4});
  const Value unused = b.Weight("unused", DType::kF32, {2});
  const Value loss = b.Sum(b.Silu(b.Linear(x, w)), {0, 1});
  auto grads = Gradients(b, loss, std::vector<Value>{x, w, unused});
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(b.shape((*grads)[0]), (SymShape{T, 4}));
  EXPECT_EQ(b.shape((*grads)[1]), (SymShape{3, 4}));
  EXPECT_EQ(g.node((*grads)[2].id).op, OpKind::kFull);
}

// A multi-output node's rule gets a gradient per output, invalid where none flows: gradients
// through attention's lse alone, its output alone, or both build; fused cross-entropy's dlogits
// (already a gradient) refuses with a message.
TEST(AutogradTest, GradientsFlowIntoAnyOutputOfANode) {
  Graph g;
  Builder b(&g);
  const Value q = b.Input("q", DType::kF32, {1, 2, 3, 4});
  const Value k = b.Input("k", DType::kF32, {1, 2, 3, 4});
  const Value v = b.Input("v", DType::kF32, {1, 2, 3, 4});
  const AttentionOutputs a = b.AttentionWithLse(q, k, v, {});
  const Value wrt[] = {q, k, v};
  auto lse_only = Gradients(b, b.Sum(a.lse, {0, 1, 2}), wrt);
  ASSERT_TRUE(lse_only.ok()) << lse_only.status();
  EXPECT_EQ(g.node((*lse_only)[2].id).op, OpKind::kFull) << "lse does not depend on v";
  auto out_only = Gradients(b, b.Sum(a.out, {0, 1, 2, 3}), wrt);
  ASSERT_TRUE(out_only.ok()) << out_only.status();
  EXPECT_NE(g.node((*out_only)[2].id).op, OpKind::kFull);
  const Value outs[] = {a.out, a.lse};
  const Value seeds[] = {b.Full(1, DType::kF32, {1, 2, 3, 4}), b.Full(2, DType::kF32, {1, 2, 3})};
  EXPECT_TRUE(Gradients(b, outs, seeds, wrt).ok());
  const Value bad_seeds[] = {seeds[1], seeds[0]};
  auto bad = Gradients(b, outs, bad_seeds, wrt);
  EXPECT_THAT(std::string(StatusMessage(bad.status())),
              HasSubstr("seed 0 must have its output's type"));

  const Value logits = b.Input("logits", DType::kF32, {2, 5});
  const CrossEntropyOutputs ce =
      b.FusedCrossEntropy(logits, b.Input("t", DType::kI32, {2}), b.Full(1, DType::kF32, {}));
  const Value lw[] = {logits};
  EXPECT_TRUE(Gradients(b, b.Sum(ce.loss, {0}), lw).ok());
  auto second = Gradients(b, b.Sum(ce.dlogits, {0, 1}), lw);
  EXPECT_THAT(std::string(StatusMessage(second.status())),
              AllOf(HasSubstr("fused_cross_entropy"), HasSubstr("already a gradient")));
}

TEST(AutogradTest, RefusesOpsWithoutGradient) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {4, 8});
  const Value top = b.TopK(x, 2).first;  // values are differentiable (take_along)
  auto ok = Gradients(b, b.Sum(top, {0, 1}), std::vector<Value>{x});
  EXPECT_TRUE(ok.ok()) << ok.status();
  const Value cache = b.State("k_cache", DType::kF32, {4, 2, 2, 4});
  const Value rows = b.Reshape(x, {4, 2, 4});
  const Value slots = b.Input("slots", DType::kI32, {4});
  const Value written = b.KvWrite(cache, rows, slots);
  auto bad = Gradients(b, b.Sum(written, {0, 1, 2, 3}), std::vector<Value>{x});
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(std::string(StatusMessage(bad.status())).find("kv_write"), std::string::npos);
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

TEST(BuilderTest, MapChecksItsExpressionAgainstTheInputs) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF16, {4});
  const Value ok = b.Map(Exp(Expr::Input(0, DType::kF32)), std::vector<Value>{x}, DType::kF16);
  EXPECT_TRUE(ok.valid()) << b.status();
  const Value wrong = b.Map(Exp(Expr::Input(0, DType::kF64)), std::vector<Value>{x}, DType::kF16);
  EXPECT_FALSE(wrong.valid());
  EXPECT_NE(std::string(StatusMessage(b.status())).find("loads as f32"), std::string::npos)
      << b.status();
}

}  // namespace
}  // namespace kiln
