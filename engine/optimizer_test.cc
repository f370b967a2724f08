// The optimizer ops' builder contract: names, state lists, torch's defaults, and the argument
// checks (numerics are in training_test.cc and the op harness).
#include "engine/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/builder.h"

namespace kiln {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Message(const Status& s) { return std::string(s.message()); }

TEST(OptimizerTest, ParsesNamesAndGivesTorchDefaults) {
  for (OptimizerKind k : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd,
                          OptimizerKind::kAdagrad}) {
    EXPECT_EQ(*ParseOptimizerKind(OptimizerKindName(k)), k);
    EXPECT_EQ(DefaultOptimizerParams(k).kind, k);
  }
  EXPECT_THAT(Message(ParseOptimizerKind("lion").status()),
              AllOf(HasSubstr("'lion'"), HasSubstr("\"adamw\""), HasSubstr("\"adagrad\"")));
  EXPECT_EQ(DefaultOptimizerParams(OptimizerKind::kAdamW).weight_decay, 1e-2);
  EXPECT_EQ(DefaultOptimizerParams(OptimizerKind::kAdam).weight_decay, 0);
  EXPECT_EQ(DefaultOptimizerParams(OptimizerKind::kAdagrad).eps, 1e-10);
}

TEST(OptimizerTest, StateNames) {
  OptimizerParams p = DefaultOptimizerParams(OptimizerKind::kAdam);
  EXPECT_THAT(OptimizerStateNames(p), ElementsAre("m", "v"));
  p = DefaultOptimizerParams(OptimizerKind::kSgd);
  EXPECT_TRUE(OptimizerStateNames(p).empty());
  p.momentum = 0.9;
  EXPECT_THAT(OptimizerStateNames(p), ElementsAre("momentum"));
  EXPECT_THAT(OptimizerStateNames(DefaultOptimizerParams(OptimizerKind::kAdagrad)),
              ElementsAre("sum"));
}

struct Fixture {
  Graph g;
  Builder b{&g};
  Value w = b.State("w", DType::kF32, {3});
  Value s1 = b.State("w.s1", DType::kF32, {3});
  Value s2 = b.State("w.s2", DType::kF32, {3});
  Value grad = b.Input("grad", DType::kF32, {3});
  Value hyper = b.Input("hyper", DType::kF32, {3});
};

TEST(OptimizerTest, EveryKindBuildsWithItsStatesAndAnOptionalGradScale) {
  for (OptimizerKind k : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd,
                          OptimizerKind::kAdagrad}) {
    SCOPED_TRACE(OptimizerKindName(k));
    Fixture f;
    OptimizerParams p = DefaultOptimizerParams(k);
    p.momentum = 0.5;
    const std::vector<Value> all = {f.s1, f.s2};
    const std::span<const Value> states(all.data(), OptimizerStateNames(p).size());
    const OptimizerOutputs a = f.b.OptimizerStep(f.w, f.grad, states, f.hyper, Value{}, p);
    const OptimizerOutputs b =
        f.b.OptimizerStep(a.param, f.grad, a.states, f.hyper, f.b.Scalar(0.5, DType::kF32), p);
    ASSERT_TRUE(f.b.ok()) << f.b.status();
    EXPECT_EQ(b.states.size(), states.size());
    EXPECT_EQ(f.g.NumOutputs(b.param.id), static_cast<int>(1 + states.size()));
    EXPECT_STREQ(OpName(f.b.node(b.param).op), OptimizerKindName(k));
  }
}

TEST(OptimizerTest, RejectsBadArguments) {
  auto error = [](auto build) {
    Fixture f;
    build(f);
    return Message(f.b.status());
  };
  const OptimizerParams adamw;
  EXPECT_THAT(error([&](Fixture& f) {
                f.b.OptimizerStep(f.w, f.grad, {f.s1, f.s2}, f.b.Input("step", DType::kI32, {}),
                                  Value{}, adamw);
              }),
              AllOf(HasSubstr("adamw"), HasSubstr("hyper"), HasSubstr("[3]"),
                    HasSubstr("{step, lr, grad_scale}")));
  EXPECT_THAT(
      error([&](Fixture& f) { f.b.OptimizerStep(f.w, f.grad, {f.s1}, f.hyper, Value{}, adamw); }),
      AllOf(HasSubstr("adamw"), HasSubstr("2 state tensor(s)")));
  EXPECT_THAT(error([&](Fixture& f) {
                f.b.OptimizerStep(f.w, f.grad, {f.s1, f.b.State("x", DType::kF16, {3})}, f.hyper,
                                  Value{}, adamw);
              }),
              AllOf(HasSubstr("second state"), HasSubstr("f32")));
  EXPECT_THAT(error([&](Fixture& f) {
                f.b.OptimizerStep(f.w, f.grad, {f.s1, f.s2}, f.hyper,
                                  f.b.Input("scale", DType::kF32, {1}), adamw);
              }),
              HasSubstr("grad_scale must be a rank-0 float"));
  EXPECT_THAT(error([&](Fixture& f) {
                f.b.OptimizerStep(f.w, f.b.Input("g2", DType::kF32, {4}), {f.s1, f.s2}, f.hyper,
                                  Value{}, adamw);
              }),
              HasSubstr("gradient must have param's shape"));
  OptimizerParams bad = adamw;
  bad.beta2 = 1;
  EXPECT_THAT(error([&](Fixture& f) {
                f.b.OptimizerStep(f.w, f.grad, {f.s1, f.s2}, f.hyper, Value{}, bad);
              }),
              HasSubstr("betas in [0, 1)"));
  OptimizerParams sgd = DefaultOptimizerParams(OptimizerKind::kSgd);
  sgd.momentum = 0.9;
  sgd.dampening = 0.1;
  sgd.nesterov = true;
  EXPECT_THAT(
      error([&](Fixture& f) { f.b.OptimizerStep(f.w, f.grad, {f.s1}, f.hyper, Value{}, sgd); }),
      AllOf(HasSubstr("sgd"), HasSubstr("nesterov"), HasSubstr("zero dampening")));
  // A State written in place: the parameter cannot be a Weight.
  EXPECT_THAT(error([&](Fixture& f) {
                f.b.OptimizerStep(f.b.Weight("frozen", DType::kF32, {3}), f.grad, {f.s1}, f.hyper,
                                  Value{}, DefaultOptimizerParams(OptimizerKind::kAdagrad));
              }),
              AllOf(HasSubstr("adagrad"), HasSubstr("must be a State")));
}

TEST(OptimizerTest, ClipGradNormBuildsRankZeroF32Values) {
  Graph g;
  Builder b(&g);
  const Value grads[] = {b.Input("a", DType::kBF16, {2, 3}), b.Input("b", DType::kF32, {5})};
  const ClipGradNormOutputs c = ClipGradNorm(b, grads, 1.0);
  ASSERT_TRUE(b.ok()) << b.status();
  for (Value v : {c.total_norm, c.coef}) {
    EXPECT_EQ(b.dtype(v), DType::kF32);
    EXPECT_TRUE(b.shape(v).empty());
  }
}

}  // namespace
}  // namespace kiln
