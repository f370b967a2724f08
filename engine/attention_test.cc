// Attention cross-checks that a backend-vs-reference comparison cannot make: the fused dense
// kernel equals its decomposition into other ops (the definition its backward rule
// differentiates), and paged attention over a block table equals dense attention over the
// same keys gathered into order.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "engine/autograd.h"
#include "engine/builder.h"
#include "engine/program.h"
#include "engine/testing/devices.h"

namespace kiln {
namespace {

class AttentionTest : public ::testing::Test {
 protected:
  std::unique_ptr<backend::Backend> backend_ = kiln::MakeTestBackend("ref");
  backend::Device& dev_ = *backend_->device(0);
  std::unique_ptr<backend::Stream> stream_ = *dev_.CreateStream();

  Tensor Random(std::vector<int64_t> shape, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> n(0, 1);
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    std::vector<double> v(count);
    for (double& x : v) x = n(rng);
    return *Tensor::FromDoubles(dev_, DType::kF64, std::move(shape), v);
  }
  Tensor Ints(std::vector<int64_t> shape, std::vector<double> v) {
    return *Tensor::FromDoubles(dev_, DType::kI32, std::move(shape), v);
  }
  // Runs `g` with the given bindings; returns every output.
  std::vector<std::vector<double>> Run(const Graph& g, std::vector<Value> outs,
                                       const std::vector<std::pair<std::string, Tensor>>& inputs) {
    auto p = Compile(g, outs, dev_);
    EXPECT_TRUE(p.ok()) << p.status();
    for (const auto& [name, t] : inputs) EXPECT_TRUE((*p)->Bind(name, t).ok()) << name;
    EXPECT_TRUE((*p)->Run(*stream_).ok());
    std::vector<std::vector<double>> r;
    for (int i = 0; i < (*p)->num_outputs(); ++i) r.push_back(*(*p)->Output(i)->ToDoubles());
    return r;
  }
};

double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

TEST_F(AttentionTest, FusedEqualsDecomposedForEveryModifier) {
  struct Variant {
    const char* name;
    AttentionParams p;
    bool aux;
  };
  const Variant variants[] = {
      {"causal", {0, attn::CausalMask(), {}}, false},
      {"unmasked", {0, {}, {}}, false},
      {"sliding", {0, attn::SlidingWindowMask(2), {}}, false},
      {"alibi", {0, attn::CausalMask(), attn::AlibiScore(4)}, false},
      {"softcap", {0.3, attn::CausalMask(), attn::SoftCapScore(1.5)}, false},
      {"prefix_lm", {0, attn::PrefixLmMask(0), {}}, true},
      {"key_padding", {0, attn::KeyPaddingMask(0), {}}, true},
      {"chunked", {0, attn::ChunkedMask(2), {}}, false},
      {"window and softcap", {0, attn::SlidingWindowMask(2), attn::SoftCapScore(1.5)}, false},
      {"chunked, alibi then softcap",
       {0, And(attn::ChunkedMask(3), attn::CausalMask()),
        attn::Then(attn::AlibiScore(4), attn::SoftCapScore(1))},
       false},
  };
  for (const Variant& v : variants) {
    Graph g;
    Builder b(&g);
    const Value q = b.Input("q", DType::kF64, {2, 4, 5, 3});
    const Value k = b.Input("k", DType::kF64, {2, 2, 5, 3});
    const Value val = b.Input("v", DType::kF64, {2, 2, 5, 2});
    std::vector<Value> aux;
    if (v.aux) aux.push_back(b.Input("prefix", DType::kI32, {2}));
    const Value fused = b.Attention(q, k, val, v.p, aux);
    const Value dec = AttentionDecomposed(b, q, k, val, b.node(fused).attrs, aux);
    // The log-sum-exp output, and its definition through other ops.
    const AttentionOutputs with_lse = b.AttentionWithLse(q, k, val, v.p, aux);
    const Value lse_dec = AttentionLseDecomposed(b, q, k, b.node(fused).attrs, aux);
    ASSERT_TRUE(b.ok()) << b.status();
    std::vector<std::pair<std::string, Tensor>> in = {{"q", Random({2, 4, 5, 3}, 1)},
                                                      {"k", Random({2, 2, 5, 3}, 2)},
                                                      {"v", Random({2, 2, 5, 2}, 3)}};
    if (v.aux) in.push_back({"prefix", Ints({2}, {3, 0})});
    const auto out = Run(g, {fused, dec, with_lse.out, with_lse.lse, lse_dec}, in);
    EXPECT_LT(MaxAbsDiff(out[0], out[1]), 1e-12) << v.name;
    EXPECT_EQ(out[2], out[0]) << v.name << ": asking for the lse changes the output";
    EXPECT_LT(MaxAbsDiff(out[3], out[4]), 1e-12) << v.name;
  }
}

// The fused backward (one attention_backward node, flash-attention's recomputation from the
// saved log-sum-exp) gives the gradients of differentiating the decomposition, for every mask
// (document masks and fully masked rows included), GQA, Tq != Tk and Dv != D.
TEST_F(AttentionTest, FusedBackwardEqualsDifferentiatingTheDecomposition) {
  struct Variant {
    const char* name;
    Expr mask;
    int aux;  // 0: none; 1: prefix lengths [B]; 2: document ids [B * Tk]
  };
  // Queries 0..3 see keys up to their index + 2; query 4 sees none.
  const Expr partial =
      And(Le(Expr::Index(3), Expr::Index(2) + Expr::Int(2)), Lt(Expr::Index(2), Expr::Int(4)));
  const Variant variants[] = {
      {"causal", attn::CausalMask(), 0},
      {"unmasked", Expr(), 0},
      {"sliding", attn::SlidingWindowMask(2), 0},
      {"prefix_lm", attn::PrefixLmMask(0), 1},
      {"documents", attn::DocumentMask(0, 5), 2},
      {"documents window 2", attn::DocumentMask(0, 5, 2), 2},
      {"fully masked row", partial, 0},
      {"chunked", attn::ChunkedMask(2), 0},
      {"chunked or global", Or(attn::ChunkedMask(2), Lt(attn::KvIdx(), Expr::Int(1))), 0},
  };
  for (const Variant& v : variants) {
    std::vector<std::vector<double>> grads[2];
    for (bool fused : {false, true}) {
      Graph g;
      Builder b(&g);
      const Value q = b.Input("q", DType::kF64, {2, 4, 5, 3});
      const Value k = b.Input("k", DType::kF64, {2, 2, 5, 3});
      const Value val = b.Input("v", DType::kF64, {2, 2, 5, 2});
      const Value w = b.Input("w", DType::kF64, {2, 4, 5, 2});
      std::vector<Value> aux;
      if (v.aux == 1) aux.push_back(b.Input("prefix", DType::kI32, {2}));
      if (v.aux == 2) aux.push_back(b.Input("docs", DType::kI32, {10}));
      AttentionParams p{0, v.mask, {}};
      p.fused_backward = fused;
      const Value o = b.Attention(q, k, val, p, aux);
      const Value loss = b.Sum(b.Mul(o, w), {0, 1, 2, 3});
      const Value wrt[] = {q, k, val};
      auto gr = Gradients(b, loss, wrt);
      ASSERT_TRUE(gr.ok()) << gr.status();
      ASSERT_TRUE(b.ok()) << b.status();
      int backward_nodes = 0, softmaxes = 0;
      for (int32_t i = 0; i < g.size(); ++i) {
        backward_nodes += g.node(i).op == OpKind::kAttentionBackward;
        softmaxes += g.node(i).op == OpKind::kSoftmax;
      }
      EXPECT_EQ(backward_nodes, fused ? 1 : 0) << v.name;
      if (fused) {
        EXPECT_EQ(softmaxes, 0) << v.name << ": the fused backward decomposed";
      }
      std::vector<std::pair<std::string, Tensor>> in = {{"q", Random({2, 4, 5, 3}, 1)},
                                                        {"k", Random({2, 2, 5, 3}, 2)},
                                                        {"v", Random({2, 2, 5, 2}, 3)},
                                                        {"w", Random({2, 4, 5, 2}, 4)}};
      if (v.aux == 1) in.push_back({"prefix", Ints({2}, {3, 0})});
      // Row 0: documents of 2 and 3 tokens; row 1: 1, 1, 3 (a document of one token).
      if (v.aux == 2) in.push_back({"docs", Ints({10}, {0, 0, 1, 1, 1, 0, 1, 2, 2, 2})});
      grads[fused] = Run(g, *gr, in);
    }
    ASSERT_EQ(grads[0].size(), 3u);
    ASSERT_EQ(grads[1].size(), 3u);
    const char* names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) {
      EXPECT_LT(MaxAbsDiff(grads[1][i], grads[0][i]), 1e-12) << v.name << " " << names[i];
      double norm = 0;
      for (double x : grads[0][i]) norm += x * x;
      EXPECT_GT(norm, 1e-6) << v.name << " " << names[i] << ": a zero gradient proves nothing";
    }
  }
}

// What a flash-attention backward does with the log-sum-exp: P = exp(S - lse) recomputes the
// attention weights without a second softmax, so P V is the forward output again. Fully
// masked rows have lse = -inf (and output 0).
TEST_F(AttentionTest, LogSumExpRecomputesTheAttentionWeights) {
  Graph g;
  Builder b(&g);
  const Value q = b.Input("q", DType::kF64, {1, 2, 4, 3});
  const Value k = b.Input("k", DType::kF64, {1, 2, 6, 3});
  const Value val = b.Input("v", DType::kF64, {1, 2, 6, 2});
  // Queries 0..2 see keys up to their index + 2; query 3 sees none.
  const Expr mask =
      And(Le(Expr::Index(3), Expr::Index(2) + Expr::Int(2)), Lt(Expr::Index(2), Expr::Int(3)));
  const AttentionOutputs r = b.AttentionWithLse(q, k, val, {0.7, mask, {}});
  // S = 0.7 q k^T, masked; P = exp(S - lse).
  Value s = b.MulScalar(b.MatMul(q, b.Transpose(k, 2, 3)), 0.7);
  s = b.Where(b.MapIndices(mask, {1, 2, 4, 6}, DType::kBool), s,
              b.Full(-INFINITY, DType::kF64, {}));
  const Value p = b.Exp(b.Sub(s, b.Unsqueeze(r.lse, -1)));
  const Value rows = b.Sum(p, {-1});
  const Value again = b.MatMul(p, val);
  ASSERT_TRUE(b.ok()) << b.status();
  const auto out = Run(g, {r.out, r.lse, rows, again},
                       {{"q", Random({1, 2, 4, 3}, 4)},
                        {"k", Random({1, 2, 6, 3}, 5)},
                        {"v", Random({1, 2, 6, 2}, 6)}});
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      const int row = h * 4 + i;
      if (i == 3) {
        EXPECT_EQ(out[1][row], -INFINITY) << "fully masked row " << row;
        EXPECT_EQ(out[0][row * 2], 0);
        continue;
      }
      EXPECT_TRUE(std::isfinite(out[1][row]));
      EXPECT_NEAR(out[2][row], 1.0, 1e-12) << "row " << row;  // the weights sum to 1
      for (int e = 0; e < 2; ++e) {
        EXPECT_NEAR(out[3][row * 2 + e], out[0][row * 2 + e], 1e-12) << "row " << row;
      }
    }
  }
}

// Two sequences in a paged cache (block size 2): a 3-token prefill of a 3-token sequence and a
// 1-token decode of a 5-token sequence whose blocks are scattered. Each must equal dense
// causal attention over its keys in logical order.
TEST_F(AttentionTest, PagedEqualsDenseOverGatheredKeys) {
  const int64_t NB = 6, BS = 2, Hq = 4, Hkv = 2, D = 3;
  const std::vector<double> block_table = {4, 1, 0, 2, 5, 3};  // [2, 3]
  const std::vector<int64_t> lens = {3, 5}, nq = {3, 1};
  Graph g;
  Builder b(&g);
  const Value q = b.Input("q", DType::kF64, {4, Hq, D});
  const Value kc = b.State("k_cache", DType::kF64, {NB, BS, Hkv, D});
  const Value vc = b.State("v_cache", DType::kF64, {NB, BS, Hkv, D});
  const Value bt = b.Input("block_table", DType::kI32, {2, 3});
  const Value sl = b.Input("seq_lens", DType::kI32, {2});
  const Value qs = b.Input("query_start", DType::kI32, {3});
  AttentionParams causal;
  causal.mask_mod = attn::CausalMask();
  const Value paged = b.PagedAttention(q, kc, vc, bt, sl, qs, causal);
  // Dense reference per sequence: gather the sequence's cache rows in logical order.
  std::vector<Value> dense;
  int64_t q0 = 0;
  for (int s = 0; s < 2; ++s) {
    std::vector<double> slots;
    for (int64_t j = 0; j < lens[s]; ++j)
      slots.push_back(block_table[s * 3 + j / BS] * BS + j % BS);
    const Value idx = b.Input("slots" + std::to_string(s), DType::kI32, {lens[s]});
    auto rows = [&](Value cache) {  // [L, Hkv, D] -> [1, Hkv, L, D]
      const Value flat = b.Reshape(cache, {NB * BS, Hkv, D});
      return b.Unsqueeze(b.Permute(b.Gather(flat, idx), {1, 0, 2}), 0);
    };
    const Value qd = b.Unsqueeze(b.Permute(b.Slice(q, 0, q0, nq[s]), {1, 0, 2}), 0);  // [1,Hq,nq,D]
    AttentionParams p;  // queries are the last nq of L positions
    p.mask_mod = Le(attn::KvIdx(), attn::QIdx() + Expr::Int(lens[s] - nq[s]));
    const Value o = b.Attention(qd, rows(kc), rows(vc), p);  // [1,Hq,nq,D]
    dense.push_back(b.Permute(b.Squeeze(o, 0), {1, 0, 2}));  // [nq,Hq,D]
    q0 += nq[s];
  }
  const Value dense_all = b.Concat(dense, 0);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<std::pair<std::string, Tensor>> in = {
      {"q", Random({4, Hq, D}, 7)},
      {"k_cache", Random({NB, BS, Hkv, D}, 8)},
      {"v_cache", Random({NB, BS, Hkv, D}, 9)},
      {"block_table", Ints({2, 3}, block_table)},
      {"seq_lens", Ints({2}, {3, 5})},
      {"query_start", Ints({3}, {0, 3, 4})},
  };
  for (int s = 0; s < 2; ++s) {
    std::vector<double> slots;
    for (int64_t j = 0; j < lens[s]; ++j)
      slots.push_back(block_table[s * 3 + j / BS] * BS + j % BS);
    in.push_back({"slots" + std::to_string(s), Ints({lens[s]}, slots)});
  }
  const auto out = Run(g, {paged, dense_all}, in);
  EXPECT_LT(MaxAbsDiff(out[0], out[1]), 1e-12);
  double norm = 0;
  for (double x : out[0]) norm += x * x;
  EXPECT_GT(norm, 0.1);  // not trivially zero
}

}  // namespace
}  // namespace kiln
