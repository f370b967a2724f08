#include "engine/compiler/testing/samples.h"

#include <set>

#include "engine/autograd.h"
#include "engine/compiler/codegen.h"
#include "engine/compiler/fusion.h"
#include "engine/compiler/testing/llama_graph.h"
#include "engine/optimizer.h"
#include "engine/testing/op_harness.h"

namespace kiln::compiler::testing {
namespace {

void AddNodeSpecs(const Graph& g, const std::string& label, std::set<std::string>& keys,
                  std::vector<Sample>& out) {
  for (int32_t id = 0; id < g.size(); ++id) {
    const Node& n = g.node(id);
    const OpDef& def = GetOpDef(n.op);
    if (def.pointwise == nullptr && def.reduce == nullptr) continue;
    if (FusedGroupIndex(n.attrs) >= 0) continue;  // fused nodes are added by the caller
    std::vector<TensorType> types;
    for (int32_t i : n.inputs) types.push_back({g.node(i).dtype, g.node(i).shape});
    backend::KernelRequest req;
    req.op = n.op;
    req.attrs = &n.attrs;
    req.inputs = types;
    req.output = {n.dtype, n.shape};
    StatusOr<KernelSpec> spec = SpecFromRequest(req);
    if (!spec.ok()) continue;
    StatusOr<GeneratedKernel> k = GenerateKernel(*spec, Dialect::kCpp);
    if (!k.ok() || !keys.insert(k->key).second) continue;
    out.push_back({StrCat(label, " / ", def.name), *std::move(spec)});
  }
}

void AddFused(Graph g, std::vector<Value> outs, const std::string& label,
              std::set<std::string>& keys, std::vector<Sample>& out) {
  FusionOptions o;
  o.caps.pointwise = o.caps.reductions = o.caps.gemm_epilogues = true;
  StatusOr<FusionResult> r = Fuse(g, outs, o);
  if (!r.ok()) return;
  for (const auto& grp : r->groups) {
    StatusOr<GeneratedKernel> k = GenerateKernel(grp->spec, Dialect::kCpp);
    if (!k.ok() || !keys.insert(k->key).second) continue;
    out.push_back({StrCat("fused ", label, ": ", grp->label), grp->spec});
  }
  // Fused pointwise groups are map nodes.
  std::vector<Sample> maps;
  AddNodeSpecs(r->graph, StrCat("fused ", label), keys, maps);
  for (Sample& s : maps) {
    if (s.spec.name == "map") out.push_back(std::move(s));
  }
}

}  // namespace

std::vector<Sample> SampleSpecs(bool fused) {
  std::vector<Sample> out;
  std::set<std::string> keys;
  for (const harness::OpCase& c : harness::ForwardCases(false)) {
    Graph g;
    Builder b(&g);
    std::vector<Value> in;
    for (const harness::InputSpec& s : c.inputs) {
      in.push_back(b.Input(s.name, s.dtype, SymShape(s.shape.begin(), s.shape.end())));
    }
    c.build(b, in);
    if (!b.ok()) continue;
    AddNodeSpecs(g, c.name, keys, out);
  }
  if (!fused) return out;
  // Llama blocks at the serving dtypes.
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    LlamaConfig cfg;
    cfg.layers = 2;
    cfg.dtype = cfg.weight_dtype = t;
    StatusOr<LlamaGraph> m = BuildLlama(cfg);
    if (!m.ok()) continue;
    AddFused(m->graph, {m->logits}, StrCat("llama ", DTypeName(t)), keys, out);
  }
  // A training step's kernels: a pre-norm block (attention written as matmul + masked softmax,
  // SwiGLU MLP), the fused cross-entropy, autograd's backward and clip_grad_norm_'s reductions,
  // so every dialect's printer is exercised on backward pointwise chains and reductions.
  {
    Graph g;
    Builder b(&g);
    const int64_t T = 16, C = 64, H = 4, D = 16, F = 96, V = 80;
    const Value x = b.Input("x", DType::kF32, {T, C});
    const Value tgt = b.Input("targets", DType::kI32, {T});
    const Value inv = b.Input("inv_count", DType::kF32, {});
    std::vector<Value> params;
    auto param = [&](const char* name, std::vector<int64_t> shape) {
      params.push_back(b.State(name, DType::kF32, SymShape(shape.begin(), shape.end())));
      return params.back();
    };
    const Value nw = param("attn_norm", {C}), wq = param("wq", {C, C}), wk = param("wk", {C, C});
    const Value wv = param("wv", {C, C}), wo = param("wo", {C, C}), fw = param("ffn_norm", {C});
    const Value wg = param("w_gate", {F, C}), wu = param("w_up", {F, C});
    const Value wd = param("w_down", {C, F}), wout = param("w_out", {V, C});
    auto heads = [&](Value v) {
      return b.Permute(b.Reshape(v, {1, T, H, D}), {0, 2, 1, 3});  // [1, H, T, D]
    };
    const Value h = b.RmsNorm(x, nw, 1e-5);
    Attrs attn;
    attn.floats = {0.25};
    attn.expr[0] = attn::CausalMask();
    const Value a = AttentionDecomposed(b, heads(b.Linear(h, wq)), heads(b.Linear(h, wk)),
                                        heads(b.Linear(h, wv)), attn, {});
    const Value y = b.Add(x, b.Linear(b.Reshape(b.Permute(a, {0, 2, 1, 3}), {T, C}), wo));
    const Value h2 = b.RmsNorm(y, fw, 1e-5);
    const Value m = b.Linear(b.Mul(b.Silu(b.Linear(h2, wg)), b.Linear(h2, wu)), wd);
    const Value logits = b.Linear(b.Add(y, m), wout);
    const CrossEntropyOutputs ce = b.FusedCrossEntropy(logits, tgt, inv);
    const Value outs[] = {logits}, seeds[] = {ce.dlogits};
    StatusOr<std::vector<Value>> grads = Gradients(b, outs, seeds, params);
    if (grads.ok() && b.ok()) {
      const ClipGradNormOutputs clip = ClipGradNorm(b, *grads, 1.0);
      std::vector<Value> all = *grads;
      all.insert(all.end(), {ce.loss, clip.coef});
      if (b.ok()) AddFused(g, all, "training step", keys, out);
    }
  }
  // Patterns the blocks do not contain.
  {
    Graph g;
    Builder b(&g);
    const Dim T = b.Symbol("T", 32);
    const Value s = b.Input("scores", DType::kF32, {2, 4, T, T});
    const Value mask = b.MapIndices(Select(attn::CausalMask(), Expr::Const(0), Expr::Const(-1e30)),
                                    {2, 4, T, T}, DType::kF32);
    const Value p = b.Softmax(b.Add(b.MulScalar(s, 0.125), mask));  // scaled masked softmax
    const Value x = b.Input("x", DType::kF16, {T, 64});
    const Value l2 = b.Sqrt(b.Sum(b.Mul(x, x), {1}, true));  // keepdim reduction + epilogue
    const Value lse = b.Exp(b.LogSoftmax(b.Tanh(x)));
    const Value tgt = b.Input("targets", DType::kI64, {T});
    const Value ce =
        b.Mul(b.CrossEntropy(b.Cast(x, DType::kF32), tgt), b.Input("wt", DType::kF32, {T}));
    const Value am = b.ArgMax(b.Neg(x), 1, false, DType::kI64);
    const Value w = b.Weight("w", DType::kBF16, {48, 64});
    const Value gelu =
        b.Add(b.Gelu(b.Linear(b.Cast(x, DType::kBF16), w)), b.Input("res", DType::kBF16, {T, 48}));
    const Value mx = b.Max(b.Abs(b.Input("y", DType::kF64, {3, T, 5})), {0, 2});
    if (b.ok()) AddFused(g, {p, l2, lse, ce, am, gelu, mx}, "patterns", keys, out);
  }
  return out;
}

}  // namespace kiln::compiler::testing
