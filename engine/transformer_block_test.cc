// A 2-layer Llama-style transformer built with the builder: embedding, RMSNorm, GQA
// attention with RoPE, SwiGLU MLP, residuals, LM head and cross-entropy. Forward and
// backward run on each built-in backend; every parameter gradient is checked against
// central finite differences (f64).
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "engine/autograd.h"
#include "engine/builder.h"
#include "engine/program.h"
#include "engine/testing/devices.h"

namespace kiln {
namespace {

constexpr int64_t kVocab = 11, kDim = 8, kHeads = 2, kKvHeads = 1, kHeadDim = 4, kFfn = 12,
                  kLayers = 2;
constexpr DType kType = DType::kF64;

struct Model {
  Graph graph;
  std::vector<Value> params;
  Value loss;
  Value logits;
};

// x [T, C] -> [T, C]
Value AttentionBlock(Builder& b, Value x, Value pos, const Dim& T, int layer) {
  auto w = [&](const char* name, SymShape shape) {
    return b.Weight(absl::StrCat("blk.", layer, ".", name), kType, std::move(shape));
  };
  const Value wq = w("attn_q.weight", {kHeads * kHeadDim, kDim});    // (Hq*D, C)
  const Value wk = w("attn_k.weight", {kKvHeads * kHeadDim, kDim});  // (Hkv*D, C)
  const Value wv = w("attn_v.weight", {kKvHeads * kHeadDim, kDim});  // (Hkv*D, C)
  const Value wo = w("attn_output.weight", {kDim, kHeads * kHeadDim});
  RopeParams rope;
  rope.theta = 10000;
  // [T, H, D] -> rope -> [1, H, T, D]
  auto heads = [&](Value y, int64_t h, bool apply_rope, const char* name) {
    Value r = b.Reshape(y, {T, h, kHeadDim});
    if (apply_rope) r = b.Rope(r, pos, rope);
    return b.Named(b.Unsqueeze(b.Permute(r, {1, 0, 2}), 0), absl::StrCat("blk.", layer, ".", name));
  };
  const Value q = heads(b.Linear(x, wq), kHeads, true, "q");     // [1, Hq, T, D]
  const Value k = heads(b.Linear(x, wk), kKvHeads, true, "k");   // [1, Hkv, T, D]
  const Value v = heads(b.Linear(x, wv), kKvHeads, false, "v");  // [1, Hkv, T, D]
  AttentionParams ap;
  ap.mask_mod = attn::CausalMask();
  const Value a =
      b.Named(b.Attention(q, k, v, ap), absl::StrCat("blk.", layer, ".attn"));  // [1, Hq, T, D]
  const Value merged = b.Reshape(b.Permute(b.Squeeze(a, 0), {1, 0, 2}), {T, kHeads * kHeadDim});
  return b.Named(b.Linear(merged, wo), absl::StrCat("blk.", layer, ".attn_out"));  // [T, C]
}

// x [T, C] -> [T, C]: SwiGLU.
Value MlpBlock(Builder& b, Value x, int layer) {
  auto w = [&](const char* name, SymShape shape) {
    return b.Weight(absl::StrCat("blk.", layer, ".", name), kType, std::move(shape));
  };
  const Value gate = b.Linear(x, w("ffn_gate.weight", {kFfn, kDim}));  // [T, F]
  const Value up = b.Linear(x, w("ffn_up.weight", {kFfn, kDim}));      // [T, F]
  return b.Named(b.Linear(b.Mul(b.Silu(gate), up), w("ffn_down.weight", {kDim, kFfn})),
                 absl::StrCat("blk.", layer, ".ffn_out"));
}

Model BuildModel(int layers = kLayers) {
  Model m;
  Builder b(&m.graph);
  const Dim T = b.Symbol("T", 16);
  const Value tokens = b.Input("tokens", DType::kI32, {T});
  const Value targets = b.Input("targets", DType::kI32, {T});
  const Value pos = b.Input("positions", DType::kI32, {T});
  Value h =
      b.Named(b.Gather(b.Weight("token_embd.weight", kType, {kVocab, kDim}), tokens), "token_embd");
  for (int l = 0; l < layers; ++l) {
    const Value an = b.Weight(absl::StrCat("blk.", l, ".attn_norm.weight"), kType, {kDim});
    const Value x = b.Named(b.RmsNorm(h, an, 1e-5), absl::StrCat("blk.", l, ".attn_norm"));
    h = b.Add(h, AttentionBlock(b, x, pos, T, l));
    const Value fn = b.Weight(absl::StrCat("blk.", l, ".ffn_norm.weight"), kType, {kDim});
    const Value x2 = b.Named(b.RmsNorm(h, fn, 1e-5), absl::StrCat("blk.", l, ".ffn_norm"));
    h = b.Add(h, MlpBlock(b, x2, l));
  }
  const Value norm = b.RmsNorm(h, b.Weight("output_norm.weight", kType, {kDim}), 1e-5);
  m.logits = b.Named(b.Linear(norm, b.Weight("output.weight", kType, {kVocab, kDim})), "logits");
  m.loss = b.Named(b.Mean(b.CrossEntropy(m.logits, targets), {0}), "loss");
  EXPECT_TRUE(b.ok()) << b.status();
  for (int32_t id : m.graph.Sources(OpKind::kWeight)) m.params.push_back(Value{id});
  return m;
}

class TransformerBlockTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformerBlockTest, ParameterGradientsMatchFiniteDifferences) {
  auto ref_backend = kiln::MakeTestBackend("ref");
  auto dev_backend = kiln::MakeTestBackend(GetParam(), 2);
  backend::Device& ref = *ref_backend->device(0);
  backend::Device& dev = *dev_backend->device(0);

  Model m = BuildModel();
  Builder b(&m.graph);
  auto grads = Gradients(b, m.loss, m.params);
  ASSERT_TRUE(grads.ok()) << grads.status();
  std::vector<Value> outputs = {m.loss};
  outputs.insert(outputs.end(), grads->begin(), grads->end());

  auto train = Compile(m.graph, outputs, dev);
  ASSERT_TRUE(train.ok()) << train.status();
  auto fwd = Compile(m.graph, {m.loss}, ref);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_LT((*train)->arena_bytes(), (*train)->unplanned_bytes());

  // Data: 5 tokens, small random weights (norm weights near 1).
  const int64_t T = 5;
  std::mt19937_64 rng(42);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::map<std::string, Tensor> dev_params, ref_params;
  for (Value p : m.params) {
    const Node& n = m.graph.node(p.id);
    std::vector<int64_t> shape;
    for (const Dim& d : n.shape) shape.push_back(d.constant());
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    std::vector<double> v(count);
    const bool is_norm = n.name.find("norm") != std::string::npos;
    for (double& x : v) x = is_norm ? 1.0 + 0.1 * normal(rng) : 0.4 * normal(rng);
    dev_params[n.name] = *Tensor::FromDoubles(dev, kType, shape, v);
    ref_params[n.name] = *Tensor::FromDoubles(ref, kType, shape, v);
  }
  const std::vector<double> tokens = {3, 7, 1, 10, 3}, targets = {7, 1, 10, 3, 0},
                            pos = {0, 1, 2, 3, 4};
  for (auto* prog : {train->get(), fwd->get()}) {
    backend::Device& d = &prog->device() == &dev ? dev : ref;
    auto& params = &prog->device() == &dev ? dev_params : ref_params;
    ASSERT_TRUE(prog->SetSymbol("T", T).ok());
    ASSERT_TRUE(prog->Bind("tokens", *Tensor::FromDoubles(d, DType::kI32, {T}, tokens)).ok());
    ASSERT_TRUE(prog->Bind("targets", *Tensor::FromDoubles(d, DType::kI32, {T}, targets)).ok());
    ASSERT_TRUE(prog->Bind("positions", *Tensor::FromDoubles(d, DType::kI32, {T}, pos)).ok());
    for (auto& [name, t] : params) ASSERT_TRUE(prog->Bind(name, t).ok()) << name;
  }
  auto dev_stream = *dev.CreateStream();
  auto ref_stream = *ref.CreateStream();
  ASSERT_TRUE((*train)->Run(*dev_stream).ok());
  const double loss = (*(*train)->Output(0)->ToDoubles())[0];
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_GT(loss, 0.5);  // random weights: near log(11) = 2.4
  EXPECT_LT(loss, 10);

  auto eval = [&]() {
    EXPECT_TRUE((*fwd)->Run(*ref_stream).ok());
    return (*(*fwd)->Output(0)->ToDoubles())[0];
  };
  EXPECT_NEAR(eval(), loss, 1e-12);  // the device's forward equals the reference's

  double total_num = 0, total_den = 0;
  int checked = 0;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const std::string& name = m.graph.node(m.params[i].id).name;
    const std::vector<double> analytic = *(*train)->Output(static_cast<int>(i) + 1)->ToDoubles();
    Tensor& t = ref_params[name];
    double num = 0, den = 0;
    for (int64_t e = 0; e < t.numel(); ++e) {
      const double x = LoadElement(t.data(), kType, e);
      const double h = 1e-6;
      StoreElement(t.data(), kType, e, x + h);
      const double up = eval();
      StoreElement(t.data(), kType, e, x - h);
      const double down = eval();
      StoreElement(t.data(), kType, e, x);
      const double fd = (up - down) / (2 * h);
      num += (analytic[e] - fd) * (analytic[e] - fd);
      den += fd * fd;
      ++checked;
    }
    EXPECT_GT(den, 0) << name << " has an all-zero gradient";
    EXPECT_LT(num / den, 1e-9) << "gradient of " << name << " (NMSE " << num / den << ")";
    total_num += num;
    total_den += den;
  }
  EXPECT_EQ(checked, kVocab * kDim * 2 + kDim +
                         kLayers * (2 * kDim + 2 * kHeads * kHeadDim * kDim +
                                    2 * kKvHeads * kHeadDim * kDim + 3 * kFfn * kDim));
  EXPECT_LT(total_num / total_den, 1e-10);
}

// Activation recomputation per block (GradientOptions::recompute), and of the norms' outputs
// where the backward reads them (recompute_on_read): the same gradients, bit for bit, from a
// smaller arena; the backward reads no block's inner forward values, and no original norm
// output.
TEST_P(TransformerBlockTest, RecomputedBlocksGiveTheSameGradientsInASmallerArena) {
  auto dev_backend = kiln::MakeTestBackend(GetParam(), 2);
  backend::Device& dev = *dev_backend->device(0);
  constexpr int kDeep = 6;
  struct Run {
    Model m;
    std::unique_ptr<Program> program;
    int32_t forward_nodes = 0;
    std::vector<NodeRange> blocks;
  };
  Run runs[3];  // none, blocks, norms on read
  for (int recompute = 0; recompute < 3; ++recompute) {
    Run& r = runs[recompute];
    r.m = BuildModel(kDeep);
    Builder b(&r.m.graph);
    r.forward_nodes = r.m.graph.size();
    GradientOptions options;
    static constexpr std::string_view kNorms[] = {"attn_norm", "ffn_norm"};
    if (recompute == 1) options.recompute = ScopeRanges(r.m.graph, "blk");
    if (recompute == 2) options.recompute_on_read = ValueRanges(r.m.graph, kNorms);
    r.blocks = recompute == 1 ? options.recompute : options.recompute_on_read;
    auto grads = Gradients(b, r.m.loss, r.m.params, Value{}, options);
    ASSERT_TRUE(grads.ok()) << grads.status();
    std::vector<Value> outputs = {r.m.loss};
    outputs.insert(outputs.end(), grads->begin(), grads->end());
    auto p = Compile(r.m.graph, outputs, dev);
    ASSERT_TRUE(p.ok()) << p.status();
    r.program = std::move(*p);
  }
  // One range per block; the backward reads only the values that leave a block (those read by
  // forward nodes outside it), every other forward value of a block is read by its clones.
  const Run& rc = runs[1];
  ASSERT_EQ(rc.blocks.size(), static_cast<size_t>(kDeep));
  const Graph& g = rc.m.graph;
  EXPECT_GT(g.size(), runs[0].m.graph.size());  // the clones
  int inner_values = 0;
  for (const NodeRange& blk : rc.blocks) {
    for (int32_t i = blk.begin; i < blk.end; ++i) {
      if (GetOpDef(g.node(i).op).cls == OpClass::kSource) continue;
      bool leaves_block = false, read_by_backward = false;
      for (int32_t j = blk.end; j < g.size(); ++j) {
        for (int32_t in : g.node(j).inputs) {
          if (in != i) continue;
          (j < rc.forward_nodes ? leaves_block : read_by_backward) = true;
        }
      }
      if (!leaves_block) {
        ++inner_values;
        EXPECT_FALSE(read_by_backward)
            << "the backward reads " << g.node(i).name << " (%" << i << ")";
      }
    }
  }
  EXPECT_GT(inner_values, kDeep * 10);
  // Two norms per block; the backward reads only their clones.
  const Run& rn = runs[2];
  ASSERT_GE(rn.blocks.size(), static_cast<size_t>(2 * kDeep));
  for (const NodeRange& r : rn.blocks) {
    for (int32_t i = r.begin; i < r.end; ++i) {
      if (GetOpDef(rn.m.graph.node(i).op).cls == OpClass::kSource) continue;
      for (int32_t j = rn.forward_nodes; j < rn.m.graph.size(); ++j) {
        for (int32_t in : rn.m.graph.node(j).inputs) {
          EXPECT_NE(in, i) << "the backward reads " << OpName(rn.m.graph.node(i).op) << " %" << i;
        }
      }
    }
  }
  EXPECT_LT(runs[1].program->arena_bytes(), runs[0].program->arena_bytes());
  EXPECT_LT(runs[2].program->arena_bytes(), runs[0].program->arena_bytes());
  std::cout << "arena bytes: " << runs[0].program->arena_bytes() << " without recomputation, "
            << runs[1].program->arena_bytes() << " per block, " << runs[2].program->arena_bytes()
            << " norms on read\n";

  const int64_t T = 16;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> tokens(T), targets(T), pos(T);
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = static_cast<double>(rng() % kVocab);
    targets[t] = static_cast<double>(rng() % kVocab);
    pos[t] = static_cast<double>(t);
  }
  std::map<std::string, std::vector<double>> values;
  for (Value p : runs[0].m.params) {
    const Node& n = runs[0].m.graph.node(p.id);
    int64_t count = 1;
    for (const Dim& d : n.shape) count *= d.constant();
    std::vector<double>& v = values[n.name];
    for (int64_t e = 0; e < count; ++e) {
      v.push_back(n.name.find("norm") != std::string::npos ? 1.0 + 0.1 * normal(rng)
                                                           : 0.4 * normal(rng));
    }
  }
  auto stream = *dev.CreateStream();
  std::vector<std::vector<double>> results[3];
  for (int recompute = 0; recompute < 3; ++recompute) {
    Run& r = runs[recompute];
    Program& p = *r.program;
    ASSERT_TRUE(p.SetSymbol("T", T).ok());
    ASSERT_TRUE(p.Bind("tokens", *Tensor::FromDoubles(dev, DType::kI32, {T}, tokens)).ok());
    ASSERT_TRUE(p.Bind("targets", *Tensor::FromDoubles(dev, DType::kI32, {T}, targets)).ok());
    ASSERT_TRUE(p.Bind("positions", *Tensor::FromDoubles(dev, DType::kI32, {T}, pos)).ok());
    for (Value v : r.m.params) {
      const Node& n = r.m.graph.node(v.id);
      std::vector<int64_t> shape;
      for (const Dim& d : n.shape) shape.push_back(d.constant());
      ASSERT_TRUE(p.Bind(n.name, *Tensor::FromDoubles(dev, kType, shape, values[n.name])).ok());
    }
    ASSERT_TRUE(p.Run(*stream).ok());
    for (size_t i = 0; i <= r.m.params.size(); ++i) {
      results[recompute].push_back(*p.Output(static_cast<int>(i))->ToDoubles());
    }
  }
  for (int mode = 1; mode < 3; ++mode) {
    ASSERT_EQ(results[0].size(), results[mode].size());
    for (size_t i = 0; i < results[0].size(); ++i) {
      const std::string what =
          i == 0 ? "the loss" : runs[0].m.graph.node(runs[0].m.params[i - 1].id).name;
      EXPECT_EQ(results[0][i], results[mode][i]) << what << " (mode " << mode << ")";
    }
  }
}

TEST(RecomputeTest, RangesMustNotOverlapAndLieInTheGraph) {
  Model m = BuildModel();
  Builder b(&m.graph);
  const std::vector<NodeRange> blocks = ScopeRanges(m.graph, "blk");
  ASSERT_EQ(blocks.size(), static_cast<size_t>(kLayers));
  EXPECT_LE(blocks[0].end, blocks[1].begin);
  EXPECT_TRUE(ScopeRanges(m.graph, "layer").empty());
  GradientOptions overlap;
  overlap.recompute = {blocks[0], {blocks[0].end - 1, blocks[1].end}};
  auto g = Gradients(b, m.loss, m.params, Value{}, overlap);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().ToString().find("overlap"), std::string::npos) << g.status();
  GradientOptions outside;
  outside.recompute = {{blocks[1].begin, m.graph.size() + 5}};
  g = Gradients(b, m.loss, m.params, Value{}, outside);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().ToString().find("not within the graph"), std::string::npos) << g.status();
}

TEST_P(TransformerBlockTest, NamedTensorsAppearInDumps) {
  Model m = BuildModel();
  const std::string s = m.graph.ToString();
  EXPECT_NE(s.find("blk.1.attn_norm: f64[T,8] = mul("), std::string::npos) << s;
  EXPECT_NE(s.find("blk.0.attn: f64[1,2,T,4] = attention("), std::string::npos) << s;
  EXPECT_NE(s.find("mask=(idx3 <= idx2)"), std::string::npos) << s;
  EXPECT_NE(s.find("logits: f64[T,11] = linear("), std::string::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(Backends, TransformerBlockTest, ::testing::Values("ref", "cpu"));

}  // namespace
}  // namespace kiln
