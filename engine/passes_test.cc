// Graph passes on multi-output nodes and in-place writes: the IR's invariants (output_of nodes
// follow their producer), verify's in-place rules with the messages users see, dce keeping
// writers and every output, and lower_views aliasing in-place outputs to their States.
#include "engine/passes.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/builder.h"

namespace kiln {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string Message(const Status& s) { return std::string(StatusMessage(s)); }

// param, m, v (States), grad and hyper (Inputs) of an AdamW update.
struct AdamWInputs {
  Value p, m, v, grad, hyper;
};
AdamWInputs MakeAdamWInputs(Builder& b, const char* prefix = "w") {
  const std::string n(prefix);
  return {b.State(n, DType::kF32, {3}), b.State(n + ".m", DType::kF32, {3}),
          b.State(n + ".v", DType::kF32, {3}), b.Input(n + ".grad", DType::kF32, {3}),
          b.Input(n + ".hyper", DType::kF32, {3})};
}
OptimizerOutputs AdamW(Builder& b, Value p, Value grad, Value m, Value v, Value hyper) {
  return b.OptimizerStep(p, grad, {m, v}, hyper, Value{}, OptimizerParams{});
}

TEST(MultiOutputTest, OutputsFollowTheirProducerAndShowInTheDump) {
  Graph g;
  Builder b(&g);
  const Value logits = b.Input("logits", DType::kF32, {4, 9});
  const Value targets = b.Input("targets", DType::kI32, {4});
  const Value dloss = b.Input("dloss", DType::kF32, {4});
  const CrossEntropyOutputs ce = b.FusedCrossEntropy(logits, targets, dloss, -1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(ce.dlogits.id, ce.loss.id + 1);
  EXPECT_EQ(g.NumOutputs(ce.loss.id), 2);
  EXPECT_EQ(g.NumOutputs(logits.id), 1);
  EXPECT_EQ(b.shape(ce.dlogits), (SymShape{4, 9}));
  const std::string dump = g.ToString();
  EXPECT_THAT(dump, HasSubstr("%3: f32[4] = fused_cross_entropy(%0, %1, %2) ignore_index=-1\n"));
  EXPECT_THAT(dump, HasSubstr("%4: f32[4,9] = output_of(%3) index=1\n"));
  const Value outs[] = {ce.loss, ce.dlogits};
  EXPECT_TRUE(Verify(g, outs).ok());
}

TEST(MultiOutputTest, VerifyRejectsMissingAndMisplacedOutputs) {
  Graph g;
  Builder b(&g);
  const AttentionOutputs a = b.AttentionWithLse(b.Input("q", DType::kF32, {1, 2, 3, 4}),
                                                b.Input("k", DType::kF32, {1, 2, 3, 4}),
                                                b.Input("v", DType::kF32, {1, 2, 3, 4}), {});
  ASSERT_TRUE(b.ok()) << b.status();
  // Without its output_of node the attention node is incomplete.
  Graph missing;
  for (int32_t i = 0; i < a.lse.id; ++i) missing.AddNode(g.node(i));
  EXPECT_THAT(Message(Verify(missing, {})),
              AllOf(HasSubstr("attention"), HasSubstr("has 2 outputs but is followed by 0")));
  // An output_of node must directly follow its producer (and the outputs before it).
  Graph misplaced = g;
  Builder mb(&misplaced);
  mb.Neg(a.lse);
  misplaced.AddNode(g.node(a.lse.id));
  EXPECT_THAT(Message(Verify(misplaced, {})),
              AllOf(HasSubstr("output_of"), HasSubstr("does not directly follow its producer")));
}

TEST(InPlaceTest, TargetsMustBeStates) {
  Graph g;
  Builder b(&g);
  const Value w = b.Weight("w", DType::kF32, {3});
  const AdamWInputs in = MakeAdamWInputs(b, "opt");
  AdamW(b, w, in.grad, in.m, in.v, in.hyper);
  EXPECT_THAT(Message(b.status()), AllOf(HasSubstr("adamw"), HasSubstr("input 0"),
                                         HasSubstr("must be a State"), HasSubstr("weight 'w'")));
  // Verify checks graphs that did not come from the builder.
  Graph g2;
  Builder b2(&g2);
  const AdamWInputs in2 = MakeAdamWInputs(b2);
  const OptimizerOutputs out = AdamW(b2, in2.p, in2.grad, in2.m, in2.v, in2.hyper);
  ASSERT_TRUE(b2.ok()) << b2.status();
  g2.mutable_node(in2.m.id).op = OpKind::kInput;
  const Value outs[] = {out.param};
  EXPECT_THAT(Message(Verify(g2, outs)),
              AllOf(HasSubstr("adamw"), HasSubstr("'w.m'"), HasSubstr("in place (output 1)"),
                    HasSubstr("must be a State"), HasSubstr("read-only")));
}

TEST(InPlaceTest, ReadsOfAStateMustComeBeforeItsWriter) {
  Graph g;
  Builder b(&g);
  const AdamWInputs in = MakeAdamWInputs(b);
  const Value before = b.Neg(in.p);  // the pre-update value, read before the update: fine
  const OptimizerOutputs out = AdamW(b, in.p, in.grad, in.m, in.v, in.hyper);
  const Value after = b.Neg(out.param);  // the updated value: fine
  ASSERT_TRUE(b.ok()) << b.status();
  {
    const Value outs[] = {before, after};
    EXPECT_TRUE(Verify(g, outs).ok()) << Verify(g, outs);
  }
  const Value stale = b.Exp(b.Slice(in.m, 0, 1, 2));  // m's old value, after the update
  const Value outs[] = {stale};
  EXPECT_THAT(Message(Verify(g, outs)),
              AllOf(HasSubstr("slice"), HasSubstr("reads %1 'w.m'"), HasSubstr("after"),
                    HasSubstr("adamw"), HasSubstr("overwrote it in place")));
}

TEST(InPlaceTest, OutputsCannotBeAPreUpdateValue) {
  Graph g;
  Builder b(&g);
  const AdamWInputs in = MakeAdamWInputs(b);
  const OptimizerOutputs out = AdamW(b, in.p, in.grad, in.m, in.v, in.hyper);
  ASSERT_TRUE(b.ok()) << b.status();
  const Value bad[] = {out.states[0], in.v};
  EXPECT_THAT(Message(Verify(g, bad)),
              AllOf(HasSubstr("output 1"), HasSubstr("'w.v'"), HasSubstr("adamw")));
  const Value good[] = {out.param, out.states[0], out.states[1]};
  EXPECT_TRUE(Verify(g, good).ok());
}

TEST(InPlaceTest, WritesChainThroughTheWritersOutputs) {
  Graph g;
  Builder b(&g);
  const Value cache = b.State("cache", DType::kF32, {2, 2, 1, 4});
  const Value x = b.Input("x", DType::kF32, {1, 1, 4});
  const Value slots = b.Input("slots", DType::kI32, {1});
  const Value first = b.KvWrite(cache, x, slots);
  const Value second = b.KvWrite(first, x, slots);  // the second write consumes the first's
  ASSERT_TRUE(b.ok()) << b.status();
  {
    const Value outs[] = {second};
    EXPECT_TRUE(Verify(g, outs).ok()) << Verify(g, outs);
  }
  b.KvWrite(cache, x, slots);  // a second write of the original value
  EXPECT_THAT(Message(Verify(g, {})),
              AllOf(HasSubstr("kv_write"), HasSubstr("reads %0 'cache'"), HasSubstr("after")));
}

TEST(InPlaceTest, OneNodeCannotWriteAStateThroughTwoOutputs) {
  Graph g;
  Builder b(&g);
  const AdamWInputs in = MakeAdamWInputs(b);
  AdamW(b, in.p, in.grad, in.m, in.m, in.hyper);  // m and v are the same State
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(Message(Verify(g, {})),
              AllOf(HasSubstr("adamw"), HasSubstr("'w.m'"), HasSubstr("two outputs")));
}

TEST(InPlaceTest, DceKeepsWritersAndAllOutputsOfLiveNodes) {
  Graph g;
  Builder b(&g);
  const AdamWInputs in = MakeAdamWInputs(b);
  AdamW(b, in.p, in.grad, in.m, in.v, in.hyper);  // no consumer: a side effect
  const CrossEntropyOutputs ce =
      b.FusedCrossEntropy(b.Input("logits", DType::kF32, {2, 5}),
                          b.Input("targets", DType::kI32, {2}), b.Input("dl", DType::kF32, {2}));
  const Value dead = b.Exp(ce.loss);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<Value> outs = {ce.loss};
  auto out = EliminateDeadCode(g, outs);
  ASSERT_TRUE(out.ok()) << out.status();
  int adamw = 0, outputs_of = 0, exps = 0;
  for (const Node& n : out->nodes()) {
    adamw += n.op == OpKind::kAdamW;
    outputs_of += n.op == OpKind::kOutputOf;
    exps += n.op == OpKind::kExp;
  }
  EXPECT_EQ(adamw, 1);
  EXPECT_EQ(outputs_of, 3);  // m and v of adamw, dlogits of the cross-entropy
  EXPECT_EQ(exps, 0) << "dead: " << dead.id;
  EXPECT_TRUE(Verify(*out, outs).ok());
}

// Devices without kMatMulMixedRhsExtension (xpu) get linear's dx = g w with w cast to f32.
TEST(CastMatMulRhsTest, CastsAQuantizedRightOperandOnlyWhereNeeded) {
  Graph g;
  Builder b(&g);
  const Value w = b.Weight("w", DType::kQ4_0, {8, 64});
  const Value gq = b.MatMul(b.Input("g", DType::kF32, {3, 8}), w);
  const Value plain =
      b.MatMul(b.Input("a", DType::kF32, {3, 8}), b.Input("c", DType::kF32, {8, 2}));
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<Value> outs = {gq, plain};
  const std::optional<Graph> cast = CastMatMulRhs(g, outs);
  ASSERT_TRUE(cast.has_value());
  EXPECT_TRUE(Verify(*cast, outs).ok());
  const Node& mm = cast->node(outs[0].id);
  ASSERT_EQ(mm.op, OpKind::kMatMul);
  const Node& rhs = cast->node(mm.inputs[1]);
  EXPECT_EQ(rhs.op, OpKind::kCast);
  EXPECT_EQ(rhs.dtype, DType::kF32);
  EXPECT_EQ(rhs.name, "w.f32");
  EXPECT_EQ(cast->node(cast->node(outs[1].id).inputs[1]).op, OpKind::kInput);
  std::vector<Value> plain_outs = {plain};
  EXPECT_FALSE(CastMatMulRhs(*cast, plain_outs).has_value());
}

TEST(InPlaceTest, LowerViewsAliasesInPlaceOutputsToTheirStates) {
  Graph g;
  Builder b(&g);
  const AdamWInputs in = MakeAdamWInputs(b);
  const Value m_view = b.Reshape(in.m, {3, 1});  // a view of a State is a valid target too
  const OptimizerOutputs out = AdamW(b, in.p, in.grad, b.Reshape(m_view, {3}), in.v, in.hyper);
  const CrossEntropyOutputs ce =
      b.FusedCrossEntropy(b.Input("logits", DType::kF32, {2, 5}),
                          b.Input("targets", DType::kI32, {2}), b.Input("dl", DType::kF32, {2}));
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<Value> outs = {out.param, out.states[0], out.states[1], ce.dlogits};
  std::vector<Layout> layouts;
  auto lowered = LowerViews(g, outs, &layouts);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  const Graph& l = *lowered;
  EXPECT_EQ(l.node(layouts[outs[0].id].root).name, "w");
  EXPECT_EQ(l.node(layouts[outs[1].id].root).name, "w.m");
  EXPECT_EQ(l.node(layouts[outs[2].id].root).name, "w.v");
  EXPECT_EQ(layouts[outs[3].id].root, outs[3].id);  // dlogits owns its storage
}

}  // namespace
}  // namespace kiln
