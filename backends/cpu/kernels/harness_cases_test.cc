// The op harness (backends/harness) on the hand-tuned cpu kernels: every code path of
// Linear, MatMul and PagedAttention against the reference backend, for every instruction-set
// variant this CPU runs and every GEMM implementation, on pools of 1, 2 and 3 threads.
//
// Shapes are chosen to hit the paths: M = 1..4 (GEMV row groups), M > 16 and not a multiple
// of the micro-kernel rows; N not a multiple of the GEMV strip (4) or the GEMM panel (16,
// 128); K not a multiple of 256 (the GEMM K block) and, for float weights, not of 32 or 8;
// strided and 3-D activations; a transposed activation (the reference fallback); GQA ratios
// 1, 2, 3, 4 and 8; long decode rows (split over the context), holes in block tables,
// padding rows, sliding windows, f16/bf16 caches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/builtin.h"
#include "backends/cpu/jit/cpu_jit.h"
#include "backends/cpu/kernels/attention.h"
#include "backends/cpu/kernels/attention_train.h"
#include "backends/cpu/kernels/isa.h"
#include "backends/cpu/kernels/kernels.h"
#include "backends/cpu/kernels/linear.h"
#include "backends/cpu/kernels/select.h"
#include "backends/host/host_device.h"
#include "backends/ref/ref_kernels.h"
#include "backends/registry.h"
#include "engine/builder.h"
#include "engine/program.h"
#include "engine/testing/op_harness.h"

namespace kiln::cpu {
namespace {

using harness::InputSpec;
using harness::OpCase;
using V = std::vector<Value>;

// The JIT that builds compiled attention modifiers for every VariantDevice (one process-wide
// cache of built functions).
jit::CpuJit& TestJit() {
  static jit::CpuJit* jit = new jit::CpuJit();
  return *jit;
}

// A host device whose Linear/MatMul/PagedAttention kernels come from SelectKernel with a
// fixed variant and GEMM implementation, everything else from the reference kernels.
class VariantDevice final : public backend::HostDevice {
 public:
  VariantDevice(Isa isa, const char* force_gemm, int threads, bool q8 = false, bool bf16 = false)
      : HostDevice("cpu-variant", threads),
        isa_(isa),
        force_gemm_(force_gemm),
        q8_(q8),
        bf16_(bf16) {}
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& req) override {
    SelectContext c;
    c.device = this;
    c.threads = threads();
    c.isa = isa_;
    c.reference = ref::KernelFor;
    c.force_gemm = force_gemm_;
    c.q8_activations = q8_;
    c.bf16_activations = bf16_;
    c.compile = [](const compiler::GeneratedKernel& g, const std::vector<std::string>& fns) {
      return TestJit().GetFunctions(g, fns);
    };
    KILN_ASSIGN_OR_RETURN(std::optional<backend::Kernel> k, SelectKernel(req, c));
    if (k) {
      if (req.op == OpKind::kLinear || req.op == OpKind::kMatMul ||
          req.op == OpKind::kPagedAttention || req.op == OpKind::kFusedCrossEntropy ||
          req.op == OpKind::kAttention || req.op == OpKind::kAttentionBackward ||
          req.op == OpKind::kAdamW || req.op == OpKind::kAdam || req.op == OpKind::kSgd ||
          req.op == OpKind::kAdagrad || req.op == OpKind::kScatterAddRows) {
        ++selected_;
      }
      std::lock_guard<std::mutex> l(mu_);
      last_kernel_ = k->name;
      by_op_[req.op] = k->name;
      return *std::move(k);
    }
    KILN_ASSIGN_OR_RETURN(backend::Kernel r, ref::KernelFor(req));
    std::lock_guard<std::mutex> l(mu_);
    by_op_[req.op] = r.name;
    return r;
  }
  int selected() const { return selected_; }
  std::string last_kernel() const {
    std::lock_guard<std::mutex> l(mu_);
    return last_kernel_;
  }
  // The kernel the last request for `op` got (hand-tuned or reference) since Forget().
  std::string KernelFor(OpKind op) const {
    std::lock_guard<std::mutex> l(mu_);
    auto it = by_op_.find(op);
    return it == by_op_.end() ? "(none)" : it->second;
  }
  void Forget() {
    std::lock_guard<std::mutex> l(mu_);
    by_op_.clear();
  }

 private:
  Isa isa_;
  const char* force_gemm_;
  bool q8_, bf16_;
  std::atomic<int> selected_{0};
  mutable std::mutex mu_;
  std::string last_kernel_;  // the name of the last hand-tuned kernel selected
  std::map<OpKind, std::string> by_op_;
};

InputSpec Normal(std::string name, DType t, std::vector<int64_t> shape, double scale = 1) {
  InputSpec s;
  s.name = std::move(name);
  s.dtype = t;
  s.shape = std::move(shape);
  s.hi = scale;
  return s;
}
InputSpec Weight(std::string name, DType t, std::vector<int64_t> shape) {
  InputSpec s = Normal(std::move(name), t, std::move(shape), 0.5);
  s.source = OpKind::kWeight;
  return s;
}
InputSpec State(InputSpec s) {
  s.source = OpKind::kState;
  s.differentiable = false;
  return s;
}
InputSpec Ints(std::string name, std::vector<int64_t> shape, std::vector<double> v) {
  InputSpec s = Normal(std::move(name), DType::kI32, std::move(shape));
  s.init = harness::Init::kCustom;
  s.values = std::move(v);
  s.differentiable = false;
  return s;
}
OpCase Make(std::string op, std::string detail, std::vector<InputSpec> in,
            std::function<Value(Builder&, const V&)> build) {
  OpCase c;
  c.op = op;
  c.name = absl::StrCat(op, " ", detail);
  c.inputs = std::move(in);
  c.build = std::move(build);
  return c;
}

std::vector<OpCase> LinearCases() {
  std::vector<OpCase> out;
  const auto linear = [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); };
  struct Shape {
    int64_t m, n, k;
  };
  const std::vector<Shape> quant = {{1, 5, 32},     {2, 13, 96}, {3, 17, 288},
                                    {4, 70, 256},   {5, 4, 544}, {17, 33, 1056},
                                    {33, 130, 320}, {70, 9, 96}};  // q8: rows split between threads
  const std::vector<Shape> floats = {{1, 3, 7},     {2, 9, 45},   {4, 16, 300},
                                     {19, 21, 257}, {1, 130, 64}, {40, 17, 520}};
  for (DType w : {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4}) {
    for (const Shape& s : quant) {
      out.push_back(Make("linear", absl::StrCat(DTypeName(w), " M=", s.m, " N=", s.n, " K=", s.k),
                         {Normal("x", DType::kF32, {s.m, s.k}), Weight("w", w, {s.n, s.k})},
                         linear));
    }
  }
  for (DType w : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const Shape& s : floats) {
      out.push_back(Make("linear", absl::StrCat(DTypeName(w), " M=", s.m, " N=", s.n, " K=", s.k),
                         {Normal("x", DType::kF32, {s.m, s.k}), Weight("w", w, {s.n, s.k})},
                         linear));
    }
  }
  // A column-major left operand (autograd's dW = g^T x): copied into rows, or read in place
  // by oneDNN.
  out.push_back(
      Make("matmul", "f32 transposed a M=40 K=100 N=150",
           {Normal("a", DType::kF32, {100, 40}), Normal("b", DType::kF32, {100, 150})},
           [](Builder& b, const V& in) { return b.MatMul(b.Transpose(in[0], 0, 1), in[1]); }));
  // K-quants go through the dequantizer (random blocks: they cannot be quantized here).
  for (int64_t m : {1, 9}) {
    InputSpec w = Weight("w", DType::kQ6_K, {6, 512});
    w.init = harness::Init::kRandomBlocks;
    out.push_back(Make("linear", absl::StrCat("q6_k M=", m, " N=6 K=512"),
                       {Normal("x", DType::kF32, {m, 512}), w}, linear));
  }
  // 3-D activations, a strided row view, and a transposed (non-contiguous) x.
  out.push_back(Make("linear", "q4_0 x [2,3,64]",
                     {Normal("x", DType::kF32, {2, 3, 64}), Weight("w", DType::kQ4_0, {7, 64})},
                     linear));
  out.push_back(
      Make("linear", "q8_0 x sliced [5,96] of [5,160]",
           {Normal("x", DType::kF32, {5, 160}), Weight("w", DType::kQ8_0, {9, 96})},
           [](Builder& b, const V& in) { return b.Linear(b.Slice(in[0], 1, 32, 96), in[1]); }));
  out.push_back(
      Make("linear", "f32 x transposed [6,40]",
           {Normal("x", DType::kF32, {40, 6}), Weight("w", DType::kF32, {11, 40})},
           [](Builder& b, const V& in) { return b.Linear(b.Transpose(in[0], 0, 1), in[1]); }));
  // MatMul: 2-D, batched with broadcast, and a transposed right operand.
  out.push_back(Make("matmul", "f32 [37,300]x[300,45]",
                     {Normal("a", DType::kF32, {37, 300}), Normal("b", DType::kF32, {300, 45})},
                     [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  out.push_back(Make("matmul", "f32 broadcast [9,70]x[3,70,20]",
                     {Normal("a", DType::kF32, {9, 70}), Normal("b", DType::kF32, {3, 70, 20})},
                     [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  out.push_back(
      Make("matmul", "f32 transposed rhs [6,33]x[19,33]^T",
           {Normal("a", DType::kF32, {6, 33}), Normal("b", DType::kF32, {19, 33})},
           [](Builder& b, const V& in) { return b.MatMul(in[0], b.Transpose(in[1], 0, 1)); }));
  // A frozen weight as the right operand, decoded panel by panel (autograd's dx = g w): one
  // panel, several panels per thread (the last partial), and f16 columns not in whole blocks.
  out.push_back(Make("matmul", "f32 [37,300]xq4_1 weight [300,96]",
                     {Normal("a", DType::kF32, {37, 300}), Weight("b", DType::kQ4_1, {300, 96})},
                     [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  for (DType t : {DType::kQ4_0, DType::kQ8_0, DType::kMXFP4, DType::kBF16}) {
    out.push_back(Make("matmul", absl::StrCat("f32 [5,64]x", DTypeName(t), " weight [64,416]"),
                       {Normal("a", DType::kF32, {5, 64}), Weight("b", t, {64, 416})},
                       [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  }
  out.push_back(Make("matmul", "f32 [7,50]xf16 weight [50,45]",
                     {Normal("a", DType::kF32, {7, 50}), Weight("b", DType::kF16, {50, 45})},
                     [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  return out;
}

struct PagedSetup {
  std::string name;
  int64_t T, hq, hkv, d, nb, bs;
  std::vector<double> block_table;  // [S, MB]
  int64_t mb;
  std::vector<double> seq_lens, query_start;
};

std::vector<OpCase> AttentionCases() {
  std::vector<PagedSetup> setups;
  // Decode of 4 sequences + 2 padding rows; one table entry out of range, one hole.
  setups.push_back({"decode x4 + pad, GQA 3",
                    6,
                    9,
                    3,
                    64,
                    12,
                    8,
                    {0, 1, 2, 3, 4, 5, 6, -1, 8, 9, 10, 99},
                    3,
                    {17, 9, 20, 24},
                    {0, 1, 2, 3, 4}});
  // One long decode row: split over the context (1100 keys in blocks of 16).
  {
    PagedSetup s{"long decode 1100 keys, GQA 4", 1, 8, 2, 32, 80, 16, {}, 70, {1100}, {0, 1}};
    for (int i = 0; i < 70; ++i) s.block_table.push_back((i * 37) % 80);
    setups.push_back(s);
  }
  // Prefill 21 rows + decode 1 (GQA 8, odd head dim).
  {
    PagedSetup s{
        "prefill 21 + decode 1, GQA 8", 23, 8, 1, 12, 20, 4, {}, 10, {21, 30}, {0, 21, 22}};
    for (int i = 0; i < 20; ++i) s.block_table.push_back(19 - i);
    setups.push_back(s);
  }
  // Long prefills over cached context (70 new rows after 30 and 20 cached): tasks of more than
  // one 32-row block of the tile path, over several 64-key tiles.
  {
    PagedSetup s{"prefill 70 + 70 after 30 and 20, MHA",
                 140,
                 4,
                 4,
                 16,
                 16,
                 16,
                 {},
                 7,
                 {100, 90},
                 {0, 70, 140}};
    for (int i = 0; i < 14; ++i) s.block_table.push_back((i * 5) % 16);
    setups.push_back(s);
  }
  // Chunked prefill: 5 new rows at the end of a 40-token sequence, MHA.
  {
    PagedSetup s{"chunk 5 of 40, MHA", 5, 4, 4, 16, 12, 4, {}, 10, {40}, {0, 5}};
    for (int i = 0; i < 10; ++i) s.block_table.push_back((i + 2) % 12);
    setups.push_back(s);
  }
  std::vector<OpCase> out;
  const Expr q_idx = Expr::Index(2), kv_idx = Expr::Index(3);
  struct Mask {
    const char* name;
    Expr mask;
    Expr score = {};
    bool alibi = false;  // ALiBi over the setup's query heads, before `score`
  };
  const Mask masks[] = {
      {"causal", attn::CausalMask()},
      {"window 7", attn::SlidingWindowMask(7)},
      {"window 300", attn::SlidingWindowMask(300)},
      {"unmasked", Expr()},
      {"causal softcap 30", attn::CausalMask(), attn::SoftCapScore(30)},
      {"window 7 softcap 1.5", attn::SlidingWindowMask(7), attn::SoftCapScore(1.5)},
      {"chunked 6", attn::ChunkedMask(6)},
      {"chunked 300 and window 7", And(attn::ChunkedMask(300), attn::SlidingWindowMask(7))},
      {"causal alibi", attn::CausalMask(), {}, true},
      {"chunked 5 alibi softcap 2", attn::ChunkedMask(5), attn::SoftCapScore(2), true},
      // Compiled (attention_mods.h): a custom mask alone, one under a native causal part,
      // and a custom score_mod.
      {"custom mask: causal or key < 10", Or(attn::CausalMask(), Lt(kv_idx, Expr::Int(10)))},
      {"custom mask: causal and same 7-block",
       And(attn::CausalMask(), Eq(q_idx / Expr::Int(7), kv_idx / Expr::Int(7)))},
      {"custom score: distance bias", attn::CausalMask(),
       attn::Score() + Expr::Cast(DType::kF32, kv_idx - q_idx) * 0.01},
      // A custom mask with a score_mod the kernel has natively: both run compiled (the
      // score_mod must see every score before the mask hides some).
      {"custom mask: causal or key < 10, softcap 2",
       Or(attn::CausalMask(), Lt(kv_idx, Expr::Int(10))), attn::SoftCapScore(2)}};
  for (const PagedSetup& s : setups) {
    const int64_t S = static_cast<int64_t>(s.seq_lens.size());
    for (DType cache : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (const Mask& m : masks) {
        if (cache != DType::kF32 && std::string(m.name) != "causal") continue;
        std::vector<InputSpec> in = {Normal("q", DType::kF32, {s.T, s.hq, s.d}),
                                     State(Normal("k_cache", cache, {s.nb, s.bs, s.hkv, s.d})),
                                     State(Normal("v_cache", cache, {s.nb, s.bs, s.hkv, s.d})),
                                     Ints("block_table", {S, s.mb}, s.block_table),
                                     Ints("seq_lens", {S}, s.seq_lens),
                                     Ints("query_start", {S + 1}, s.query_start)};
        AttentionParams p;
        p.mask_mod = m.mask;
        p.score_mod = m.score;
        if (m.alibi) {
          const Expr bias = attn::AlibiScore(s.hq);
          p.score_mod = m.score ? attn::Then(bias, m.score) : bias;
        }
        out.push_back(Make("paged_attention",
                           absl::StrCat(s.name, " ", DTypeName(cache), " cache, ", m.name), in,
                           [p](Builder& b, const V& x) {
                             return b.PagedAttention(x[0], x[1], x[2], x[3], x[4], x[5], p);
                           }));
      }
    }
  }
  return out;
}

struct Variant {
  Isa isa;
  const char* gemm;
  int threads;
};

std::string VariantName(const Variant& v) {
  return absl::StrCat(IsaName(v.isa), "_", v.gemm == nullptr ? "auto" : v.gemm, "_t", v.threads);
}

void PrintTo(const Variant& v, std::ostream* os) { *os << VariantName(v); }

class HarnessTest : public ::testing::TestWithParam<Variant> {};

TEST_P(HarnessTest, HandTunedKernelsMatchReference) {
  const Variant v = GetParam();
  if (!IsaSupported(v.isa)) GTEST_SKIP() << IsaName(v.isa) << " is not supported by this CPU";
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  VariantDevice dev(v.isa, v.gemm, v.threads);
  std::vector<OpCase> cases = LinearCases();
  if (v.gemm == nullptr || std::string(v.gemm) == "gemm") {
    for (OpCase& c : AttentionCases()) cases.push_back(std::move(c));
    // The training kernels (no GEMM inside): the op table's own cases.
    for (OpCase& c : harness::ForwardCases(/*full=*/true)) {
      if (c.op == "fused_cross_entropy" || c.op == "attention_backward" || c.op == "adamw" ||
          c.op == "adam" || c.op == "sgd" || c.op == "adagrad" || c.op == "scatter_add_rows" ||
          c.op == "attention") {
        cases.push_back(std::move(c));
      }
    }
  }
  int run = 0;
  for (const OpCase& c : cases) {
    const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
    EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << c.name << ": " << r.message;
    ++run;
  }
  EXPECT_GT(dev.selected(), run) << "the hand-tuned kernels were not selected";
}

std::vector<Variant> Variants() {
  std::vector<Variant> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    for (const char* g :
         {static_cast<const char*>(nullptr), "gemv", "gemm", "onednn", "onednn_dequant"}) {
      out.push_back({isa, g, 2});
    }
    out.push_back({isa, nullptr, 1});
    out.push_back({isa, "gemm", 3});
  }
  out.push_back({Isa::kAvx512, "gemm_avx2", 2});  // the avx2 GEMM beside the avx512 kernels
  return out;
}

// With q8 activations allowed (ggml's decode numerics), quantized Linear: within a normalized
// MSE of 5e-4 of the exact result — ggml's test-backend-ops bound for mul_mat; typically
// ~1e-5, up to ~2e-4 for a single 32-element block — on every variant.
TEST(HarnessQ8, QuantizedActivationsStayWithinTheirTolerance) {
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  int run = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    VariantDevice dev(isa, "gemv_q8", 2, /*q8=*/true);
    for (OpCase c : LinearCases()) {
      const DType wt = c.inputs[1].dtype;
      if (c.op != "linear" || !HasQ8Path(wt) || c.inputs[0].shape.size() != 2) continue;
      c.tol = 5e-4;
      const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
      EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass)
          << IsaName(isa) << " " << c.name << ": " << r.message;
      EXPECT_GT(r.error, 0) << "suspiciously exact: were activations quantized? " << c.name;
      ++run;
    }
  }
  EXPECT_GT(run, 20);
}

// Linear over `rows` rows of x [rows, k] on `dev` at once and each row alone: the rows are
// bit-identical, and the kernel's name names `impl`. Weights: the first n rows of x in `wt`.
void ExpectRowsIndependentOfBatch(VariantDevice& dev, DType wt, int64_t n, int64_t k,
                                  const std::vector<float>& x, int64_t rows, const char* impl) {
  SCOPED_TRACE(absl::StrCat(DTypeName(wt), " N=", n, " K=", k));
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 512);
  const Value y = b.Linear(b.Input("x", DType::kF32, {T, k}), b.Weight("w", wt, {n, k}));
  const Node& node = g.node(y.id);
  const std::vector<TensorType> in = {{DType::kF32, {T, k}}, {wt, {n, k}}};
  backend::KernelRequest req;
  req.op = node.op;
  req.attrs = &node.attrs;
  req.inputs = in;
  req.output = {node.dtype, node.shape};
  auto kernel = dev.GetKernel(req);
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  ASSERT_NE(kernel->name.find(impl), std::string::npos) << kernel->name;
  const int64_t row_bytes = DTypeBytes(wt, k);
  std::vector<uint8_t> w(row_bytes * n);
  for (int64_t r = 0; r < n; ++r) {
    ASSERT_TRUE((IsQuantized(wt) ? QuantizeRow(wt, x.data() + r * k, w.data() + r * row_bytes, k)
                                 : ConvertElements(DType::kF32, x.data() + r * k, wt,
                                                   w.data() + r * row_bytes, k))
                    .ok());
  }
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok());
  const auto run = [&](const float* xs, int64_t m, float* out) {
    TensorArg inputs[2] = {Arg2D(const_cast<float*>(xs), DType::kF32, m, k),
                           Arg2D(w.data(), wt, n, k)};
    LaunchArgs args;
    args.kernel_data = kernel->data.get();
    args.inputs = inputs;
    args.num_inputs = 2;
    args.output = Arg2D(out, DType::kF32, m, n);
    const Launch launch{kernel->fn, &args};
    ASSERT_TRUE((*stream)->Run(std::span<const Launch>(&launch, 1)).ok());
  };
  std::vector<float> batch(rows * n), alone(n);
  run(x.data(), rows, batch.data());
  for (int64_t m = 0; m < rows; ++m) {
    run(x.data() + m * k, 1, alone.data());
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(std::memcmp(&alone[j], &batch[m * n + j], 4), 0)
          << kernel->name << " row " << m << " column " << j << ": " << alone[j] << " alone, "
          << batch[m * n + j] << " in the batch";
    }
  }
}

// With q8 activations a row's result does not depend on how many rows share its call (a
// sequence's numerics must not depend on its batch): 70 rows — with 9 weight rows split by
// rows between the threads, with 40 by weight rows in sixteen-row strips where the CPU has
// VNNI — equal each row computed alone (four-row strips), bit for bit: every weight type, on
// every variant this CPU runs.
TEST(HarnessQ8, ARowsResultDoesNotDependOnItsBatch) {
  for (const int64_t kN : {9, 40}) {
    constexpr int64_t kM = 70, kK = 96;
    std::vector<float> x(kM * kK);
    for (int64_t i = 0; i < kM * kK; ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
    int compared = 0;
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
      if (!IsaSupported(isa)) continue;
      for (DType wt : {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4}) {
        VariantDevice dev(isa, nullptr, 2, /*q8=*/true);
        ExpectRowsIndependentOfBatch(dev, wt, kN, kK, x, kM, "gemv_q8");
        ++compared;
      }
    }
    EXPECT_GT(compared, 0);
  }
}

// With bf16 activations allowed, bf16 Linear on a CPU with AVX-512 BF16 runs vdpbf16ps on x
// rounded to bf16: within a normalized MSE of 1e-4 of the exact result (x's rounding alone:
// ~1e-6) and not exact; on variants or CPUs without it the exact f32 kernels run unchanged.
TEST(HarnessBf16, RoundedActivationsStayWithinTheirToleranceWhereTheCpuHasIt) {
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  int run = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    const bool bf16 = Bf16KernelsFor(isa) != nullptr;
    VariantDevice dev(isa, nullptr, 2, /*q8=*/false, /*bf16=*/true);
    for (OpCase c : LinearCases()) {
      if (c.op != "linear" || c.inputs[1].dtype != DType::kBF16) continue;
      if (bf16) c.tol = 1e-4;
      dev.Forget();
      const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
      EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass)
          << IsaName(isa) << " " << c.name << ": " << r.message;
      const std::string kernel = dev.KernelFor(OpKind::kLinear);
      EXPECT_EQ(kernel.find("gemm_bf16") != std::string::npos, bf16)
          << IsaName(isa) << " " << kernel;
      if (bf16) {
        EXPECT_GT(r.error, 0) << "suspiciously exact: was x rounded? " << c.name;
      }
      ++run;
    }
  }
  EXPECT_GT(run, 0);
  if (Bf16KernelsFor(Isa::kAvx512) == nullptr) {
    GTEST_SKIP() << "checked the exact fallback only: this CPU has no AVX-512 BF16";
  }
}

// With bf16 activations a row's result does not depend on its batch: 70 rows (weight rows
// split between the threads with 40 of them, rows of x with 9; K with and without a partial
// 32-element chunk) equal each row computed alone, bit for bit.
TEST(HarnessBf16, ARowsResultDoesNotDependOnItsBatch) {
  if (Bf16KernelsFor(Isa::kAvx512) == nullptr) {
    GTEST_SKIP() << "this CPU has no AVX-512 BF16 (vdpbf16ps)";
  }
  constexpr int64_t kM = 70;
  for (const int64_t kN : {9, 40}) {
    for (const int64_t kK : {96, 75}) {
      std::vector<float> x(kM * kK);
      for (int64_t i = 0; i < kM * kK; ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
      VariantDevice dev(Isa::kAvx512, nullptr, 2, /*q8=*/false, /*bf16=*/true);
      ExpectRowsIndependentOfBatch(dev, DType::kBF16, kN, kK, x, kM, "gemm_bf16");
    }
  }
}

// A decode row's paged attention does not depend on its batch: SmolLM2's heads (9 over 3 kv
// heads), a 600-key context that the kernel splits over its two threads, decoded alone and
// beside three other sequences (other lengths, a prefill chunk among them) — the row's
// output is bit-identical, on every instruction set.
TEST(HarnessPagedAttention, ADecodeRowDoesNotDependOnItsBatch) {
  constexpr int64_t kHq = 9, kHkv = 3, kD = 64, kBS = 16, kNB = 64, kMaxBlocks = 40;
  const std::vector<int64_t> lens = {600, 37, 180, 450}, nq = {1, 1, 5, 1};
  int compared = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    VariantDevice dev(isa, nullptr, 2);
    // The first `S` sequences of `lens`, their query rows in order; output rows of sequence 0.
    const auto run = [&](int64_t S) {
      int64_t T = 0;
      for (int64_t s = 0; s < S; ++s) T += nq[s];
      Graph g;
      Builder b(&g);
      AttentionParams causal;
      causal.mask_mod = attn::CausalMask();
      const Value o = b.PagedAttention(
          b.Input("q", DType::kF32, {T, kHq, kD}), b.State("k", DType::kF32, {kNB, kBS, kHkv, kD}),
          b.State("v", DType::kF32, {kNB, kBS, kHkv, kD}),
          b.Input("bt", DType::kI32, {S, kMaxBlocks}), b.Input("sl", DType::kI32, {S}),
          b.Input("qs", DType::kI32, {S + 1}), causal);
      EXPECT_TRUE(b.ok()) << b.status();
      auto p = Compile(g, {o}, dev);
      EXPECT_TRUE(p.ok()) << p.status();
      const auto values = [](int64_t n, double scale, int64_t seed) {
        std::vector<double> v(n);
        for (int64_t i = 0; i < n; ++i) v[i] = std::sin(scale * static_cast<double>(i + seed));
        return v;
      };
      // Sequence 0's query row first, the same in both runs; the others after it.
      const int64_t cache = kNB * kBS * kHkv * kD;
      std::vector<double> bt(S * kMaxBlocks, -1), sl(S), qs(S + 1, 0);
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t j = 0; j * kBS < lens[s] && j < kMaxBlocks; ++j) {
          bt[s * kMaxBlocks + j] = static_cast<double>((s * 17 + j * 3) % kNB);
        }
        sl[s] = static_cast<double>(lens[s]);
        qs[s + 1] = qs[s] + static_cast<double>(nq[s]);
      }
      const std::vector<std::pair<std::string, StatusOr<Tensor>>> in = {
          {"q", Tensor::FromDoubles(dev, DType::kF32, {T, kHq, kD}, values(T * kHq * kD, 0.37, 1))},
          {"k",
           Tensor::FromDoubles(dev, DType::kF32, {kNB, kBS, kHkv, kD}, values(cache, 0.11, 2))},
          {"v",
           Tensor::FromDoubles(dev, DType::kF32, {kNB, kBS, kHkv, kD}, values(cache, 0.23, 3))},
          {"bt", Tensor::FromDoubles(dev, DType::kI32, {S, kMaxBlocks}, bt)},
          {"sl", Tensor::FromDoubles(dev, DType::kI32, {S}, sl)},
          {"qs", Tensor::FromDoubles(dev, DType::kI32, {S + 1}, qs)},
      };
      for (const auto& [name, t] : in) EXPECT_TRUE((*p)->Bind(name, *t).ok()) << name;
      auto stream = dev.CreateStream();
      EXPECT_TRUE((*p)->Run(**stream).ok());
      std::vector<double> out = *(*p)->Output(0)->ToDoubles();
      out.resize(kHq * kD);  // sequence 0's row
      return out;
    };
    const std::vector<double> alone = run(1), batched = run(4);
    ASSERT_EQ(alone.size(), batched.size());
    double norm = 0;
    for (size_t i = 0; i < alone.size(); ++i) {
      ASSERT_EQ(alone[i], batched[i]) << IsaName(isa) << " element " << i;
      norm += alone[i] * alone[i];
    }
    EXPECT_GT(norm, 0.1) << IsaName(isa);  // not trivially zero
    EXPECT_EQ(dev.KernelFor(OpKind::kPagedAttention).find("cpu.paged_attention"), 0u);
    ++compared;
  }
  EXPECT_GT(compared, 0);
}

// A decoded matmul whose x exceeds 16 MiB with K >= 8192 (the classifier head's dx through a
// quantized tied embedding) runs in blocks of K, accumulated by oneDNN; once, on the variant
// this CPU runs (the reference product is large).
TEST(HarnessLongK, DecodedMatMulInBlocksOfKMatchesReference) {
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  const Isa isa = ActiveIsa();
  VariantDevice dev(isa, nullptr, 2);
  const OpCase c =
      Make("matmul", "f32 [513,8192]xq8_0 weight [8192,64] (blocks of K)",
           {Normal("a", DType::kF32, {513, 8192}, 0.1), Weight("b", DType::kQ8_0, {8192, 64})},
           [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); });
  const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
  EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << IsaName(isa) << ": " << r.message;
  EXPECT_GT(dev.selected(), 0);
  EXPECT_NE(dev.last_kernel().find("k_blocks"), std::string::npos) << dev.last_kernel();
}

// Block skipping: a document mask of 10 documents of 64 tokens over 640 (90% of the 64 x 64
// blocks of Tq x Tk empty) visits exactly the 10 diagonal blocks per head, and a sliding window
// of 64 at most two key blocks per query tile; both still equal the reference.
TEST(HarnessBlockSkipping, EmptyBlocksAreNeverVisited) {
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  VariantDevice dev(ActiveIsa(), nullptr, 2);
  constexpr int64_t kT = 640, kDoc = 64, kHq = 2;
  std::vector<double> docs(kT);
  for (int64_t i = 0; i < kT; ++i) docs[i] = static_cast<double>(i / kDoc);
  const std::vector<InputSpec> in = {Normal("q", DType::kF32, {1, kHq, kT, 16}),
                                     Normal("k", DType::kF32, {1, 1, kT, 16}),
                                     Normal("v", DType::kF32, {1, 1, kT, 16})};
  std::vector<InputSpec> with_docs = in;
  with_docs.push_back({"docs", DType::kI32, {kT}, harness::Init::kCustom, 0, 0, docs});
  const OpCase documents =
      Make("attention", "documents 10x64 [1,2,640,16]", with_docs, [](Builder& b, const V& x) {
        const Value aux[] = {x[3]};
        return b.Attention(x[0], x[1], x[2], {0, attn::DocumentMask(0, kT), {}}, aux);
      });
  uint64_t before = DenseAttentionScoresVisited();
  harness::Result r = harness::RunForward(documents, *ref->device(0), dev);
  EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << r.message;
  EXPECT_NE(dev.KernelFor(OpKind::kAttention).find("documents"), std::string::npos)
      << dev.KernelFor(OpKind::kAttention);
  const uint64_t docs_visited = DenseAttentionScoresVisited() - before;
  // Each query tile of 64 rows is one document: its 64 keys only (causal within it would be
  // half a block, but the kernel computes whole diagonal blocks and masks inside them). The
  // harness runs a case more than once; every run visits the same.
  constexpr uint64_t kDocsPerRun = kHq * (kT / kDoc) * kDoc * kDoc;
  ASSERT_GT(docs_visited, 0u);
  EXPECT_EQ(docs_visited % kDocsPerRun, 0u) << docs_visited;
  const uint64_t runs = docs_visited / kDocsPerRun;

  const OpCase window = Make("attention", "window 64 [1,2,640,16]", in, [](Builder& b, const V& x) {
    return b.Attention(x[0], x[1], x[2], {0, attn::SlidingWindowMask(64), {}});
  });
  before = DenseAttentionScoresVisited();
  r = harness::RunForward(window, *ref->device(0), dev);
  EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << r.message;
  // Tile t (rows 64t .. 64t+63) sees keys 64t - 63 .. 64t + 63: 127 keys (64 for t = 0),
  // visited from 64t - 64 so that the products start on whole vectors: 128.
  EXPECT_EQ(DenseAttentionScoresVisited() - before,
            runs * uint64_t{kHq * (64 * 64 + (kT / 64 - 1) * 64 * 128)});
}

// A value row that is inf reaches only the rows that see its key. Under a window of 64 over
// 256 tokens the dense kernel's query tile of rows 128..191 sees keys 65..191 and computes its
// scores from key 64, a whole vector earlier (the mask hides it): V[64] = inf must still leave
// rows 128.. finite and equal to the reference's, where rows 64..127 see it.
TEST(HarnessBlockSkipping, AValueOnlyTheMaskedAlignmentReadsStaysOut) {
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  VariantDevice dev(ActiveIsa(), nullptr, 2);
  constexpr int64_t kT = 256, kD = 16;
  const auto run = [&](backend::Device& d) {
    Graph g;
    Builder b(&g);
    const Value o = b.Attention(
        b.Input("q", DType::kF32, {1, 1, kT, kD}), b.Input("k", DType::kF32, {1, 1, kT, kD}),
        b.Input("v", DType::kF32, {1, 1, kT, kD}), {0, attn::SlidingWindowMask(64), {}});
    auto p = Compile(g, {o}, d);
    EXPECT_TRUE(p.ok()) << p.status();
    std::vector<double> q(kT * kD), k(kT * kD), v(kT * kD);
    for (int64_t i = 0; i < kT * kD; ++i) {
      q[i] = std::sin(0.37 * static_cast<double>(i));
      k[i] = std::sin(0.11 * static_cast<double>(i + 2));
      v[i] = std::sin(0.23 * static_cast<double>(i + 3));
    }
    for (int64_t e = 0; e < kD; ++e) v[64 * kD + e] = std::numeric_limits<double>::infinity();
    for (const auto& [name, x] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
      EXPECT_TRUE((*p)->Bind(name, *Tensor::FromDoubles(d, DType::kF32, {1, 1, kT, kD}, *x)).ok());
    }
    auto stream = d.CreateStream();
    EXPECT_TRUE((*p)->Run(**stream).ok());
    return *(*p)->Output(0)->ToDoubles();
  };
  const std::vector<double> want = run(*ref->device(0)), got = run(dev);
  EXPECT_NE(dev.KernelFor(OpKind::kAttention).find("cpu."), std::string::npos)
      << dev.KernelFor(OpKind::kAttention);
  ASSERT_EQ(got.size(), want.size());
  for (int64_t i = 128 * kD; i < kT * kD; ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << "element " << i;
    EXPECT_NEAR(got[i], want[i], 1e-5) << "element " << i;
  }
  EXPECT_FALSE(std::isfinite(got[100 * kD])) << "row 100 sees V[64]";
}

// The paged kernel never scores a key tile a compiled mask hides. Two sequences over the same
// 512 cached keys: one prefills all 512 (chunks of 64 rows, tile-aligned), the other decodes
// its last token (split over the context). With a document mask over documents of 64 (ids as
// aux) each row scores the one tile of its own document; with every key in one document, all
// the tiles of its causal range (4.5 a row on average). Both equal the reference.
TEST(HarnessBlockSkipping, PagedCompiledMaskSkipsHiddenTiles) {
  if (!TestJit().available()) GTEST_SKIP() << "no compiler for the attention modifiers";
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  VariantDevice dev(ActiveIsa(), nullptr, 2);
  constexpr int64_t kLen = 512, kDoc = 64, kHq = 2, kBs = 16, kMb = kLen / kBs;
  std::vector<double> table;
  for (int64_t s = 0; s < 2; ++s) {
    for (int64_t i = 0; i < kMb; ++i) table.push_back(static_cast<double>(kMb - 1 - i));
  }
  // Scores per run: (row, query head, tile) triples.
  auto scored = [&](int64_t doc_len, const char* name) {
    std::vector<double> docs(2 * kLen);
    for (int64_t i = 0; i < 2 * kLen; ++i) docs[i] = static_cast<double>(i % kLen / doc_len);
    const std::vector<InputSpec> in = {
        Normal("q", DType::kF32, {kLen + 1, kHq, 16}),
        State(Normal("k_cache", DType::kF32, {kMb, kBs, 1, 16})),
        State(Normal("v_cache", DType::kF32, {kMb, kBs, 1, 16})),
        Ints("block_table", {2, kMb}, table),
        Ints("seq_lens", {2}, {kLen, kLen}),
        Ints("query_start", {3}, {0, kLen, kLen + 1}),
        {"docs", DType::kI32, {2 * kLen}, harness::Init::kCustom, 0, 0, docs}};
    const AttentionParams p{0, attn::DocumentMask(0, kLen), {}};
    const OpCase c = Make("paged_attention", name, in, [p](Builder& b, const V& x) {
      const Value aux[] = {x[6]};
      return b.PagedAttention(x[0], x[1], x[2], x[3], x[4], x[5], p, aux);
    });
    dev.Forget();
    const uint64_t before = PagedAttentionCompiledTilesScored();
    const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
    EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << name << ": " << r.message;
    const std::string k = dev.KernelFor(OpKind::kPagedAttention);
    EXPECT_NE(k.find("compiled"), std::string::npos) << k;
    return PagedAttentionCompiledTilesScored() - before;
  };
  const uint64_t docs = scored(kDoc, "8 documents of 64");
  const uint64_t one = scored(kLen, "one document");
  // Per run: one tile per row and head; or row p's p / 64 + 1 tiles (8 for the decode row).
  // Exact because the tiles are skipped per block of 32 prefill rows, and with the device's 2
  // threads the prefill is cut into chunks of 64 rows, so no block straddles two documents.
  constexpr uint64_t kDocsPerRun = kHq * (kLen + 1);
  constexpr uint64_t kOnePerRun = kHq * (kDoc * (8 * 9 / 2) + 8);
  ASSERT_GT(docs, 0u);
  EXPECT_EQ(docs % kDocsPerRun, 0u) << docs;
  EXPECT_EQ(one * kDocsPerRun, docs * kOnePerRun) << docs << " and " << one;
}

// Skipping a hidden tile changes no bit. The documents of the test above as a compiled mask
// (hidden tiles skipped) against native causal with a compiled score_mod that gives the other
// documents' keys -inf: nothing to skip by, so every tile of the causal range is scored and the
// hidden ones fold as nothing. Both must give the same output, bit for bit.
TEST(HarnessBlockSkipping, PagedSkippedTilesChangeNoBit) {
  if (!TestJit().available()) GTEST_SKIP() << "no compiler for the attention modifiers";
  constexpr int64_t kLen = 512, kDoc = 64, kHq = 2, kBs = 16, kMb = kLen / kBs, kD = 16;
  VariantDevice dev(ActiveIsa(), nullptr, 2);
  const Expr row = attn::Batch() * Expr::Int(kLen);
  const Expr same = Eq(Expr::Load(0, row + attn::QIdx(), DType::kI64),
                       Expr::Load(0, row + attn::KvIdx(), DType::kI64));
  const auto run = [&](const AttentionParams& p) {
    Graph g;
    Builder b(&g);
    const Value aux[] = {b.Input("docs", DType::kI32, {2 * kLen})};
    const Value o = b.PagedAttention(
        b.Input("q", DType::kF32, {kLen + 1, kHq, kD}),
        b.State("k", DType::kF32, {kMb, kBs, 1, kD}), b.State("v", DType::kF32, {kMb, kBs, 1, kD}),
        b.Input("bt", DType::kI32, {2, kMb}), b.Input("sl", DType::kI32, {2}),
        b.Input("qs", DType::kI32, {3}), p, aux);
    EXPECT_TRUE(b.ok()) << b.status();
    auto prog = Compile(g, {o}, dev);
    EXPECT_TRUE(prog.ok()) << prog.status();
    const auto values = [](int64_t n, double scale) {
      std::vector<double> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[i] = std::sin(scale * static_cast<double>(i + 1));
      return v;
    };
    std::vector<double> docs(2 * kLen), table;
    for (int64_t i = 0; i < 2 * kLen; ++i) docs[i] = static_cast<double>(i % kLen / kDoc);
    for (int64_t i = 0; i < 2 * kMb; ++i) table.push_back(static_cast<double>(kMb - 1 - i % kMb));
    const int64_t cache = kMb * kBs * kD;
    const std::vector<double> lens = {kLen, kLen}, starts = {0, kLen, kLen + 1};
    const std::vector<std::pair<std::string, StatusOr<Tensor>>> in = {
        {"q", Tensor::FromDoubles(dev, DType::kF32, {kLen + 1, kHq, kD},
                                  values((kLen + 1) * kHq * kD, 0.37))},
        {"k", Tensor::FromDoubles(dev, DType::kF32, {kMb, kBs, 1, kD}, values(cache, 0.11))},
        {"v", Tensor::FromDoubles(dev, DType::kF32, {kMb, kBs, 1, kD}, values(cache, 0.23))},
        {"bt", Tensor::FromDoubles(dev, DType::kI32, {2, kMb}, table)},
        {"sl", Tensor::FromDoubles(dev, DType::kI32, {2}, lens)},
        {"qs", Tensor::FromDoubles(dev, DType::kI32, {3}, starts)},
        {"docs", Tensor::FromDoubles(dev, DType::kI32, {2 * kLen}, docs)},
    };
    for (const auto& [name, t] : in) EXPECT_TRUE((*prog)->Bind(name, *t).ok()) << name;
    auto stream = dev.CreateStream();
    EXPECT_TRUE((*prog)->Run(**stream).ok());
    EXPECT_NE(dev.KernelFor(OpKind::kPagedAttention).find("compiled"), std::string::npos)
        << dev.KernelFor(OpKind::kPagedAttention);
    return *(*prog)->Output(0)->ToDoubles();
  };
  const uint64_t before = PagedAttentionCompiledTilesScored();
  const std::vector<double> skipped = run({0, attn::DocumentMask(0, kLen), {}});
  const uint64_t scored_skipping = PagedAttentionCompiledTilesScored() - before;
  dev.Forget();
  const std::vector<double> scored =
      run({0, attn::CausalMask(),
           Expr::Select(same, attn::Score(),
                        Expr::Const(-std::numeric_limits<double>::infinity(), DType::kF32))});
  EXPECT_LT(3 * scored_skipping, PagedAttentionCompiledTilesScored() - before - scored_skipping);
  ASSERT_EQ(skipped.size(), scored.size());
  double norm = 0;
  for (size_t i = 0; i < skipped.size(); ++i) {
    ASSERT_EQ(skipped[i], scored[i]) << "element " << i;
    norm += skipped[i] * skipped[i];
  }
  EXPECT_GT(norm, 1.0);  // not trivially zero
}

// The modifiers a model's `attention:` config names (chunks, ALiBi, soft-capping; Gemma 2's
// soft-capped sliding-window layers) run on the paged kernel, not the reference, on every
// instruction set; custom masks and score_mods too, compiled into it.
TEST(HarnessModifiers, PagedAttentionAppliesThemInTheKernel) {
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  int run = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    VariantDevice dev(isa, nullptr, 2);
    for (const OpCase& c : AttentionCases()) {
      const bool softcap = c.name.find("softcap") != std::string::npos;
      const bool chunked = c.name.find("chunked") != std::string::npos;
      const bool alibi = c.name.find("alibi") != std::string::npos;
      const bool custom = c.name.find("custom") != std::string::npos;
      if (!softcap && !chunked && !alibi && !custom) continue;
      if (custom && !TestJit().available()) continue;
      dev.Forget();
      const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
      EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass)
          << IsaName(isa) << " " << c.name << ": " << r.message;
      const std::string k = dev.KernelFor(OpKind::kPagedAttention);
      EXPECT_EQ(k.find("cpu.paged_attention"), 0u) << c.name << ": " << k;
      EXPECT_EQ(k.find("softcap") != std::string::npos, softcap && !custom) << c.name << ": " << k;
      EXPECT_EQ(k.find("chunk") != std::string::npos, chunked) << c.name << ": " << k;
      EXPECT_EQ(k.find("alibi") != std::string::npos, alibi) << c.name << ": " << k;
      EXPECT_EQ(k.find("compiled") != std::string::npos, custom) << c.name << ": " << k;
      ++run;
    }
  }
  EXPECT_GE(run, 60);
}

// Dense attention with every modifier of the attn:: library (and combinations, and custom
// masks) runs a cpu kernel, never the reference: natively or with the modifiers compiled into
// it; forward and the fused backward, on every instruction set.
TEST(HarnessModifiers, DenseAttentionRunsEveryModifierInTheKernel) {
  if (!TestJit().available()) GTEST_SKIP() << "no C++ compiler for generated kernels";
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  int compiled = 0, run = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    VariantDevice dev(isa, nullptr, 2);
    for (const OpCase& c : harness::ForwardCases(/*full=*/true)) {
      if (c.op != "attention" && c.op != "attention_backward") continue;
      // f32 queries only (f16 and f64 stay on the reference); the side-by-side case has
      // other ops.
      if (c.inputs[0].dtype != DType::kF32 || c.name.find("side by side") != std::string::npos) {
        continue;
      }
      dev.Forget();
      const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
      EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass)
          << IsaName(isa) << " " << c.name << ": " << r.message;
      // Both kernels of a backward case: the forward's (with its lse) and the backward's.
      for (const char* op : {"attention", "attention_backward"}) {
        if (c.op == "attention" && std::string(op) != c.op) continue;
        const std::string k = dev.KernelFor(
            std::string(op) == "attention" ? OpKind::kAttention : OpKind::kAttentionBackward);
        EXPECT_EQ(k.find(absl::StrCat("cpu.", op, ".")), 0u) << c.name << ": " << k;
        if (k.find("compiled") != std::string::npos) ++compiled;
      }
      ++run;
    }
  }
  EXPECT_GE(run, 40);
  // prefix-LM, relative bias, chunked (and with a window), ALiBi (and then a cap), the
  // custom masks: forward and backward, on each instruction set.
  EXPECT_GE(compiled, 20) << "of " << run;
}

// Block masks of compiled modifiers: a block-diagonal custom mask (90% of the 64 x 64 blocks
// empty, the rest full) visits only its 10 diagonal blocks per head; a prefix-LM mask, whose
// prefix lengths are an aux tensor, visits the causal blocks plus the prefix's.
TEST(HarnessBlockSkipping, CompiledMasksSkipTheirEmptyBlocks) {
  if (!TestJit().available()) GTEST_SKIP() << "no C++ compiler for generated kernels";
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  VariantDevice dev(ActiveIsa(), nullptr, 2);
  constexpr int64_t kT = 640, kHq = 2;
  const std::vector<InputSpec> in = {Normal("q", DType::kF32, {1, kHq, kT, 16}),
                                     Normal("k", DType::kF32, {1, 1, kT, 16}),
                                     Normal("v", DType::kF32, {1, 1, kT, 16})};
  const OpCase diagonal =
      Make("attention", "block diagonal 10x64 [1,2,640,16]", in, [](Builder& b, const V& x) {
        const Expr mask = Eq(Expr::Index(2) / Expr::Int(64), Expr::Index(3) / Expr::Int(64));
        return b.Attention(x[0], x[1], x[2], {0, mask, {}});
      });
  uint64_t before = DenseAttentionScoresVisited();
  harness::Result r = harness::RunForward(diagonal, *ref->device(0), dev);
  EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << r.message;
  EXPECT_NE(dev.KernelFor(OpKind::kAttention).find("compiled mask"), std::string::npos)
      << dev.KernelFor(OpKind::kAttention);
  const uint64_t visited = DenseAttentionScoresVisited() - before;
  constexpr uint64_t kPerRun = kHq * (kT / 64) * 64 * 64;
  ASSERT_GT(visited, 0u);
  EXPECT_EQ(visited % kPerRun, 0u) << visited;
  const uint64_t runs = visited / kPerRun;

  std::vector<InputSpec> with_prefix = in;
  with_prefix.push_back(Ints("prefix", {1}, {100}));
  const OpCase prefix =
      Make("attention", "prefix-LM 100 [1,2,640,16]", with_prefix, [](Builder& b, const V& x) {
        const Value aux[] = {x[3]};
        return b.Attention(x[0], x[1], x[2], {0, attn::PrefixLmMask(0), {}}, aux);
      });
  before = DenseAttentionScoresVisited();
  r = harness::RunForward(prefix, *ref->device(0), dev);
  EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << r.message;
  // Query tile t sees key blocks 0..t, and block 1 too for t = 0 (keys 64..99 are prefix):
  // 2 + (2 + 3 + ... + 10) = 56 blocks.
  EXPECT_EQ(DenseAttentionScoresVisited() - before, runs * uint64_t{kHq * 56 * 64 * 64});
}

// A block mask that depends on aux tensors is cached by their contents: one program run with
// prefix lengths 100, then 300, then 100 again equals the reference each time (a table keyed
// by shape alone would reuse the first).
TEST(HarnessBlockSkipping, BlockMasksFollowTheAuxTensorsContents) {
  if (!TestJit().available()) GTEST_SKIP() << "no C++ compiler for generated kernels";
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  VariantDevice dev(ActiveIsa(), nullptr, 2);
  constexpr int64_t kT = 320;
  auto build = [](Graph& g) {
    Builder b(&g);
    const Value q = b.Input("q", DType::kF32, {1, 1, kT, 8});
    const Value k = b.Input("k", DType::kF32, {1, 1, kT, 8});
    const Value v = b.Input("v", DType::kF32, {1, 1, kT, 8});
    const Value aux[] = {b.Input("prefix", DType::kI32, {1})};
    return b.Attention(q, k, v, {0, attn::PrefixLmMask(0), {}}, aux);
  };
  Graph gc, gr;
  const Value oc = build(gc), orf = build(gr);
  auto cpu = Compile(gc, {oc}, dev);
  auto reference = Compile(gr, {orf}, *ref->device(0));
  ASSERT_TRUE(cpu.ok() && reference.ok());
  EXPECT_NE(dev.KernelFor(OpKind::kAttention).find("compiled mask"), std::string::npos)
      << dev.KernelFor(OpKind::kAttention);
  std::vector<double> x(kT * 8);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37 * static_cast<double>(i));
  auto cpu_stream = dev.CreateStream();
  auto ref_stream = ref->device(0)->CreateStream();
  ASSERT_TRUE(cpu_stream.ok() && ref_stream.ok());
  for (double prefix : {100.0, 300.0, 100.0}) {
    std::vector<double> out[2];
    int i = 0;
    for (auto* p : {&*cpu, &*reference}) {
      backend::Device& d = i == 0 ? static_cast<backend::Device&>(dev) : *ref->device(0);
      for (const char* in : {"q", "k", "v"}) {
        ASSERT_TRUE((*p)->Bind(in, *Tensor::FromDoubles(d, DType::kF32, {1, 1, kT, 8}, x)).ok());
      }
      const std::vector<double> len = {prefix};
      ASSERT_TRUE((*p)->Bind("prefix", *Tensor::FromDoubles(d, DType::kI32, {1}, len)).ok());
      backend::Stream& st = i == 0 ? **cpu_stream : **ref_stream;
      ASSERT_TRUE((*p)->Run(st).ok() && st.Synchronize().ok());
      out[i++] = *(*p)->Output(0)->ToDoubles();
    }
    ASSERT_EQ(out[0].size(), out[1].size());
    double err = 0;
    for (size_t e = 0; e < out[0].size(); ++e) err = std::max(err, std::abs(out[0][e] - out[1][e]));
    EXPECT_LT(err, 1e-5) << "prefix " << prefix;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, HarnessTest, ::testing::ValuesIn(Variants()),
                         [](const auto& info) { return VariantName(info.param); });

}  // namespace
}  // namespace kiln::cpu
