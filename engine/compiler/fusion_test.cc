// The fusion pass: which groups form (and which must not), and that fused programs compute
// what the reference computes — op by op patterns and a Llama-style model at prefill and
// decode shapes.
#include "engine/compiler/fusion.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "engine/compiler/compile.h"
#include "engine/compiler/testing/llama_run.h"
#include "engine/testing/devices.h"

namespace kiln::compiler {
namespace {

FusionOptions AllCaps() {
  FusionOptions o;
  o.caps.pointwise = o.caps.reductions = o.caps.gemm_epilogues = true;
  return o;
}

// Computing nodes of a graph (what becomes launches).
std::vector<const Node*> Computing(const Graph& g) {
  std::vector<const Node*> out;
  for (const Node& n : g.nodes()) {
    const OpClass c = GetOpDef(n.op).cls;
    if (c != OpClass::kSource && c != OpClass::kView) out.push_back(&n);
  }
  return out;
}

FusionResult FuseOrDie(const Graph& g, std::vector<Value>& outs, FusionOptions o = AllCaps()) {
  StatusOr<FusionResult> r = Fuse(g, outs, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

TEST(FusionTest, SiluTimesUpBecomesOneMap) {
  Graph g;
  Builder b(&g);
  const Value gate = b.Input("gate", DType::kF32, {4, 8});
  const Value up = b.Input("up", DType::kF32, {4, 8});
  std::vector<Value> outs = {b.Mul(b.Silu(gate), up)};
  const FusionResult r = FuseOrDie(g, outs);
  const auto nodes = Computing(r.graph);
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0]->op, OpKind::kMap);
  EXPECT_EQ(nodes[0]->inputs.size(), 2u);
  EXPECT_EQ(r.fused_nodes, 2);
  EXPECT_TRUE(r.groups.empty());  // maps need no tag
  EXPECT_EQ(r.graph.node(outs[0].id).op, OpKind::kMap);
}

TEST(FusionTest, ResidualAddRmsNormAndWeightBecomeOneRowKernel) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 16);
  const Value x = b.Input("x", DType::kF32, {T, 32});
  const Value r = b.Input("r", DType::kF32, {T, 32});
  const Value w = b.Weight("w", DType::kF32, {32});
  std::vector<Value> outs = {b.RmsNorm(b.Add(x, r), w, 1e-5)};
  const FusionResult res = FuseOrDie(g, outs);
  const auto nodes = Computing(res.graph);
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0]->op, OpKind::kRmsNorm);
  ASSERT_EQ(res.groups.size(), 1u);
  const FusedGroup& fg = *res.groups[0];
  EXPECT_EQ(fg.kind, FusedGroup::Kind::kReduce);
  EXPECT_EQ(fg.label, "add+rms_norm+mul");
  EXPECT_TRUE(fg.spec.elementwise);
  EXPECT_EQ(fg.spec.args.size(), 3u);  // x, r, the expanded weight
  EXPECT_TRUE(fg.spec.Validate().ok()) << fg.spec.Validate();
  EXPECT_EQ(FusedGroupIndex(nodes[0]->attrs), 0);
}

TEST(FusionTest, ScaledMaskedSoftmaxIsOneKernel) {
  Graph g;
  Builder b(&g);
  const Value s = b.Input("scores", DType::kF32, {2, 4, 8, 8});
  const Value mask = b.Input("mask", DType::kF32, {2, 4, 8, 8});
  std::vector<Value> outs = {
      b.Softmax(b.Add(b.Mul(s, b.Input("scale", DType::kF32, {2, 4, 8, 8})), mask))};
  const FusionResult r = FuseOrDie(g, outs);
  ASSERT_EQ(Computing(r.graph).size(), 1u);
  EXPECT_EQ(r.groups.at(0)->label, "mul+add+softmax");
}

TEST(FusionTest, ReductionWithPrologueAndEpilogue) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {6, 10});
  std::vector<Value> outs = {b.Sqrt(b.Sum(b.Mul(x, x), {1}))};  // row L2 norms
  const FusionResult r = FuseOrDie(g, outs);
  ASSERT_EQ(Computing(r.graph).size(), 1u);
  const KernelSpec& s = r.groups.at(0)->spec;
  EXPECT_FALSE(s.elementwise);
  EXPECT_EQ(s.reduce_axes, std::vector<int>{1});
  EXPECT_EQ(r.groups[0]->label, "mul+sum+sqrt");
}

TEST(FusionTest, ValuesWithConsumersOutsideAGroupAreNotMovedIn) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {4, 16});
  const Value h = b.Add(x, x);  // also an output: must be materialized
  const Value y = b.Exp(h);
  std::vector<Value> outs = {h, b.Neg(y)};
  const FusionResult r = FuseOrDie(g, outs);
  const auto nodes = Computing(r.graph);
  ASSERT_EQ(nodes.size(), 2u);  // add; exp+neg
  EXPECT_EQ(nodes[0]->op, OpKind::kAdd);
  EXPECT_EQ(nodes[1]->op, OpKind::kMap);
}

TEST(FusionTest, ReadsOfStateDoNotMoveAcrossKvWrite) {
  Graph g;
  Builder b(&g);
  const Value cache = b.State("cache", DType::kF32, {2, 4, 1, 8});
  const Value old = b.Neg(cache);  // reads the cache before the write
  const Value w =
      b.KvWrite(cache, b.Input("x", DType::kF32, {3, 1, 8}), b.Input("slots", DType::kI32, {3}));
  std::vector<Value> outs = {b.Mul(old, old), w};
  const FusionResult r = FuseOrDie(g, outs);
  int negs = 0;
  for (const Node* n : Computing(r.graph)) negs += n->op == OpKind::kNeg;
  EXPECT_EQ(negs, 1) << "neg must stay before kv_write";
}

TEST(FusionTest, LinearWithBiasAndActivationTakesAnEpilogue) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {5, 16});
  const Value w = b.Weight("w", DType::kF32, {8, 16});
  const Value bias = b.Weight("bias", DType::kF32, {8});
  const Value res = b.Input("res", DType::kF32, {5, 8});
  const Value y = b.Add(b.Relu(b.Linear(x, w, bias)), res);
  std::vector<Value> outs = {y};
  const FusionResult r = FuseOrDie(g, outs);
  const auto nodes = Computing(r.graph);
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0]->op, OpKind::kLinear);
  const FusedGroup& fg = *r.groups.at(0);
  EXPECT_EQ(fg.kind, FusedGroup::Kind::kGemm);
  EXPECT_EQ(fg.spec.kind, KernelKind::kGemmEpilogue);
  EXPECT_EQ(nodes[0]->inputs.size(), 4u);  // x, w, bias (expanded), res
  // Without the capability the GEMM stays alone and the epilogue is a map.
  FusionOptions no_gemm = AllCaps();
  no_gemm.caps.gemm_epilogues = false;
  std::vector<Value> outs2 = {y};
  const FusionResult r2 = FuseOrDie(g, outs2, no_gemm);
  EXPECT_EQ(Computing(r2.graph).size(), 2u);
}

TEST(FusionTest, ScalarFillsBecomeConstantsOfTheExpression) {
  // LoRA's `base + lora_b(x) * scaling`: the scale is a broadcast fill (MulScalar), which a
  // kernel would read as a stride-0 tensor; it is folded into the epilogue instead.
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {5, 16});
  const Value w = b.Weight("w", DType::kF32, {8, 16});
  const Value lora = b.Input("lora", DType::kF32, {5, 8});
  const double scale = 0.1;  // not a float: the constant must be rounded as the fill rounds it
  std::vector<Value> outs = {b.Add(b.Linear(x, w), b.MulScalar(lora, scale))};
  const FusionResult r = FuseOrDie(g, outs);
  const Node& fused = r.graph.node(outs[0].id);
  ASSERT_EQ(fused.op, OpKind::kLinear);
  EXPECT_EQ(fused.inputs.size(), 3u);  // x, w, lora: no fill (left unread, for the compiler's DCE)
  const Expr& e = r.groups.at(0)->spec.value;
  bool found = false;
  MapLeaves(e, [&](const Expr& leaf) {
    if (leaf.node().op == ExprOp::kConst) {
      found = true;
      EXPECT_EQ(leaf.node().fvalue, static_cast<double>(static_cast<float>(scale)));
    }
    return leaf;
  });
  EXPECT_TRUE(found) << e.ToString();
  // A map of fills only keeps its input (a fused map needs a tensor to take its shape from).
  Graph g2;
  Builder b2(&g2);
  std::vector<Value> outs2 = {
      b2.Add(b2.Full(1.0, DType::kF32, {4}), b2.Full(2.0, DType::kF32, {4}))};
  const FusionResult r2 = FuseOrDie(g2, outs2);
  EXPECT_FALSE(Computing(r2.graph).empty());
}

TEST(FusionTest, NarrowIntegerIntermediatesAreNotFused) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {16});
  const Value i8 = b.Cast(x, DType::kI8);  // saturates: must be stored to mean the same
  std::vector<Value> outs = {b.Add(b.Cast(i8, DType::kF32), x)};
  const FusionResult r = FuseOrDie(g, outs);
  EXPECT_EQ(Computing(r.graph).size(), 2u);
}

TEST(FusionTest, NothingFusesWithoutCapabilities) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {16});
  std::vector<Value> outs = {b.Exp(b.Neg(x))};
  const FusionResult r = FuseOrDie(g, outs, FusionOptions{});
  EXPECT_EQ(Computing(r.graph).size(), 2u);
  EXPECT_EQ(r.fused_groups, 0);
}

// ---- Numerics: fused programs on cpu vs the reference -----------------------------------------

struct Devices {
  std::unique_ptr<backend::Backend> ref = kiln::MakeTestBackend("ref");
  std::unique_ptr<backend::Backend> cpu = kiln::MakeTestBackend("cpu", 2);
  backend::Device& r() { return *ref->device(0); }
  backend::Device& c() { return *cpu->device(0); }
};

using testing::LlamaRun;
using testing::Nmse;
using testing::RunLlama;

class LlamaFusionTest : public ::testing::TestWithParam<DType> {};

TEST_P(LlamaFusionTest, FusedMatchesReferenceAtPrefillAndDecode) {
  Devices d;
  testing::LlamaConfig cfg;
  cfg.dtype = GetParam();
  cfg.weight_dtype = GetParam();
  const double tol = GetParam() == DType::kF32 ? 1e-9 : 1e-4;
  for (const auto& [seqs, new_tokens, context] :
       std::vector<std::tuple<int, int, int>>{{2, 5, 0}, {3, 1, 7}}) {
    SCOPED_TRACE(StrCat(seqs, " seqs x ", new_tokens, " tokens after ", context));
    auto want =
        RunLlama(cfg, d.r(),
                 {.compiler = false, .seqs = seqs, .new_tokens = new_tokens, .context = context});
    ASSERT_TRUE(want.ok()) << want.status();
    CompileReport rep;
    auto fused = RunLlama(
        cfg, d.c(), {.seqs = seqs, .new_tokens = new_tokens, .context = context, .report = &rep});
    ASSERT_TRUE(fused.ok()) << fused.status();
    EXPECT_GT(rep.fused_groups, 0) << rep.ToString();
    EXPECT_FALSE(rep.unfused_fallback) << rep.ToString();
    EXPECT_LT(rep.launches, rep.nodes) << rep.ToString();
    EXPECT_LE(Nmse(*fused, *want), tol);
    auto unfused = RunLlama(
        cfg, d.c(), {.fuse = false, .seqs = seqs, .new_tokens = new_tokens, .context = context});
    ASSERT_TRUE(unfused.ok()) << unfused.status();
    EXPECT_LE(Nmse(*unfused, *want), tol);
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, LlamaFusionTest, ::testing::Values(DType::kF32, DType::kF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(CompileTest, ReportsRegionsKernelsAndMetrics) {
  Devices d;
  testing::LlamaConfig cfg;
  cfg.layers = 4;
  metrics::Registry registry;
  CompileReport rep;
  auto out = RunLlama(cfg, d.c(), {.new_tokens = 3, .report = &rep, .registry = &registry});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_FALSE(rep.regions.classes.empty());
  EXPECT_EQ(rep.regions.classes[0].family, "blk");
  EXPECT_EQ(rep.regions.classes[0].instances.size(), 4u) << rep.regions.Summary();
  // Four identical blocks: most kernel requests are served by kernels already made.
  EXPECT_GT(rep.kernels.reused, rep.kernels.compiled + rep.kernels.cached) << rep.ToString();
  const std::string text = registry.Serialize();
  EXPECT_NE(text.find("kiln_compile_kernels_total{outcome=\"reused\"}"), std::string::npos) << text;
  EXPECT_NE(text.find("kiln_compile_seconds_total"), std::string::npos);
}

TEST(CompileTest, FuseDumpShowsTheGroups) {
  Devices d;
  auto m = testing::BuildLlama(testing::LlamaConfig{});
  ASSERT_TRUE(m.ok());
  std::ostringstream os;
  CompilerOptions o;
  o.program.dump.passes = "fuse";
  o.program.dump.out = &os;
  auto p = Compile(m->graph, {m->logits}, d.c(), o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NE(os.str().find("fused 3: add+rms_norm+mul"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find("silu"), std::string::npos) << os.str();
}

TEST(CompileTest, DevicesWithoutATargetCompileAsUsual) {
  Devices d;
  testing::LlamaConfig cfg;
  CompileReport rep;
  auto a = RunLlama(cfg, d.r(), {.new_tokens = 2, .report = &rep});
  auto b = RunLlama(cfg, d.r(), {.compiler = false, .fuse = false, .new_tokens = 2});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(rep.fused_groups, 0);
}

}  // namespace
}  // namespace kiln::compiler
