// The graph builder used by model code: typed, broadcasting, error-accumulating.
//
//   Graph g;
//   Builder b(&g);
//   Dim T = b.Symbol("T", /*max=*/512);
//   Value x = b.Input("x", DType::kF32, {T, 64});
//   Value w = b.Weight("blk.0.attn_norm.weight", DType::kF32, {64});
//   Value h = b.Named(b.RmsNorm(x, w, 1e-5), "blk.0.attn_norm");
//   KILN_RETURN_IF_ERROR(b.status());
//
// Errors: a method given bad arguments (shapes that do not match, a dtype an op does not
// take) records the first error — naming the op, the node name and the shapes — and returns
// an invalid Value; every later call with an invalid input returns an invalid Value without
// a new error. Check `status()` once after building (Compile also refuses a graph built
// with errors). This keeps model code free of per-call error plumbing (XlaBuilder style).
//
// Broadcasting: binary/ternary pointwise ops broadcast NumPy-style (trailing axes aligned;
// sizes equal or 1) by inserting Reshape/Expand views. Dtypes never promote implicitly:
// mixing f16 and f32 is an error that asks for an explicit Cast.
//
// Names: `Named(v, "blk.3.attn_norm")` names a node for dumps. With a scope set
// (`SetNameScope("blk.3")`) names get the prefix: "blk.3.attn_norm".
//
// Thread-safety: none; one builder per graph, on one thread.
#pragma once

#include <initializer_list>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/graph.h"
#include "engine/optimizer.h"

namespace kiln {

// Rotary position embedding parameters (HF transformers' rope_scaling semantics).
struct RopeParams {
  enum class Layout : int { kNeox = 0, kInterleaved = 1 };  // half-split or pairwise
  enum class Scaling : int { kNone = 0, kLinear = 1, kLlama3 = 2 };
  int64_t rotary_dim = 0;  // 0: the whole head dim; else the first rotary_dim dims rotate
  Layout layout = Layout::kNeox;
  Scaling scaling = Scaling::kNone;
  double theta = 10000.0;
  double factor = 1.0;  // linear: positions / factor; llama3: low-frequency divisor
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192;
  bool inverse = false;  // rotate by -angle (the backward of rope)
};

// Attention parameters shared by dense and paged attention.
struct AttentionParams {
  double scale = 0;  // 0: 1/sqrt(head_dim)
  Expr mask_mod;     // null: attend everywhere; attn::CausalMask() for causal
  Expr score_mod;    // null: identity
  // Training: differentiate through one attention_backward node (flash-attention's
  // backward, from the saved log-sum-exp) instead of the decomposition. Adds the lse output
  // (Attention still returns output 0 only); needs no score_mod. Only for devices with an
  // attention_backward kernel (Device::GetKernel).
  bool fused_backward = false;
};

// Dense attention with its log-sum-exp (what a flash-attention backward needs).
struct AttentionOutputs {
  Value out;  // [B, Hq, Tq, Dv]
  Value lse;  // [B, Hq, Tq], the query's compute type (f32; f64 for f64 queries)
};

// attention_backward's outputs.
struct AttentionGrads {
  Value dq;  // q's shape
  Value dk;  // k's
  Value dv;  // v's
};

// The fused classifier step: per-row loss and the gradient of sum(loss * dloss) w.r.t. logits.
struct CrossEntropyOutputs {
  Value loss;     // [...]
  Value dlogits;  // [..., V]
};

// What the sample op returns (see OpKind::kSample).
struct SampleOutputs {
  Value token;         // [S] i32
  Value logprob;       // [S] f32, of the raw logits
  Value top_ids;       // [S, sampling::kMaxLogprobs] i32
  Value top_logprobs;  // [S, sampling::kMaxLogprobs] f32
};

class Builder {
 public:
  explicit Builder(Graph* graph) : g_(graph) {}
  Builder(const Builder&) = delete;
  Builder& operator=(const Builder&) = delete;

  Graph& graph() { return *g_; }
  const Status& status() const { return status_; }
  bool ok() const { return status_.ok(); }

  // ---- Symbols and names ----
  Dim Symbol(std::string name, int64_t max, int64_t min = 1) {
    return g_->AddSymbol(std::move(name), max, min);
  }
  Value Named(Value v, std::string_view name);
  void SetNameScope(std::string scope) { scope_ = std::move(scope); }
  const std::string& name_scope() const { return scope_; }

  // ---- Introspection ----
  const SymShape& shape(Value v) const { return g_->node(v.id).shape; }
  DType dtype(Value v) const { return g_->node(v.id).dtype; }
  int rank(Value v) const { return static_cast<int>(g_->node(v.id).shape.size()); }
  const Node& node(Value v) const { return g_->node(v.id); }

  // ---- Sources ----
  Value Input(std::string_view name, DType dtype, SymShape shape);
  Value Weight(std::string_view name, DType dtype, SymShape shape);
  Value State(std::string_view name, DType dtype, SymShape shape);
  Value Full(double value, DType dtype, SymShape shape);
  Value Scalar(double value, DType dtype) { return Full(value, dtype, {}); }
  Value ZerosLike(Value v);
  Value Iota(DType dtype, SymShape shape, int axis, double start = 0, double step = 1);
  Value DimValue(const Dim& d, DType dtype);

  // ---- Pointwise (binary/ternary ops broadcast) ----
  Value Neg(Value x);
  Value Abs(Value x);
  Value Exp(Value x);
  Value Log(Value x);
  Value Sqrt(Value x);
  Value Rsqrt(Value x);
  Value Tanh(Value x);
  Value Sigmoid(Value x);
  Value Silu(Value x);
  Value Gelu(Value x, bool tanh_approximation = true);
  Value Relu(Value x);
  Value Not(Value x);
  Value Cast(Value x, DType dtype);
  Value Clamp(Value x, double lo, double hi);
  Value Add(Value a, Value b);
  Value Sub(Value a, Value b);
  Value Mul(Value a, Value b);
  Value Div(Value a, Value b);
  Value Pow(Value a, Value b);
  Value Maximum(Value a, Value b);
  Value Minimum(Value a, Value b);
  Value Eq(Value a, Value b);
  Value Ne(Value a, Value b);
  Value Lt(Value a, Value b);
  Value Le(Value a, Value b);
  Value Gt(Value a, Value b);
  Value Ge(Value a, Value b);
  Value And(Value a, Value b);
  Value Or(Value a, Value b);
  Value Where(Value cond, Value a, Value b);
  // x op scalar (the scalar takes x's dtype).
  Value AddScalar(Value x, double s);
  Value MulScalar(Value x, double s);
  // A generic pointwise op: `expr` over Input(i) (typed ComputeDType(dtype(inputs[i])))
  // and Index(axis) of the output; inputs broadcast to a common shape.
  // `aux` are 1-D tensors the expression reads with Load(k, index).
  Value Map(const Expr& expr, std::span<const Value> inputs, DType out_dtype,
            std::span<const Value> aux = {});
  // A Map over output indices only (no element inputs), e.g. an attention mask.
  Value MapIndices(const Expr& expr, SymShape shape, DType out_dtype,
                   std::span<const Value> aux = {});

  // ---- Reductions (negative axes count from the end) ----
  Value Sum(Value x, std::vector<int> axes, bool keepdim = false);
  Value Mean(Value x, std::vector<int> axes, bool keepdim = false);
  Value Max(Value x, std::vector<int> axes, bool keepdim = false);
  Value Min(Value x, std::vector<int> axes, bool keepdim = false);
  Value ArgMax(Value x, int axis, bool keepdim = false, DType index_dtype = DType::kI32);
  // Sums `x` down to `shape` (the inverse of broadcasting; used by backward rules).
  Value SumTo(Value x, SymShape shape);  // by value: callers pass shapes of this graph

  // ---- Row ops (last axis) ----
  Value Softmax(Value x);
  Value LogSoftmax(Value x);
  Value RmsNorm(Value x, double eps);
  Value RmsNorm(Value x, Value weight, double eps);  // * weight (broadcast over rows)
  Value LayerNorm(Value x, double eps);
  Value LayerNorm(Value x, Value weight, Value bias, double eps);  // bias may be invalid
  // Per-row loss: logsumexp(logits) - logits[target]; 0 where target == ignore_index.
  Value CrossEntropy(Value logits, Value targets, int64_t ignore_index = -100);

  // ---- Layout ----
  // One dim may be -1 (inferred when the division is exact).
  Value Reshape(Value x, SymShape shape);
  Value Permute(Value x, std::vector<int> perm);
  Value Transpose(Value x, int a, int b);
  Value Slice(Value x, int axis, const Dim& start, const Dim& size);
  Value Expand(Value x, SymShape shape);  // also prepends axes of size 1 (rank may grow)
  Value Concat(std::span<const Value> xs, int axis);
  Value Concat(std::initializer_list<Value> xs, int axis) {
    return Concat(std::span<const Value>(xs.begin(), xs.size()), axis);
  }
  Value Contiguous(Value x);
  Value Unsqueeze(Value x, int axis);
  Value Squeeze(Value x, int axis);

  // ---- Indexing ----
  Value Gather(Value table, Value indices, DType out_dtype = DType::kInvalid);
  Value ScatterAddRows(Value indices, Value src, const Dim& rows);
  Value TakeAlong(Value x, Value indices);
  Value ScatterAddAlong(Value indices, Value src, const Dim& n);
  // Top-k along the last axis: {values, indices}, sorted by value descending (ties: lower
  // index first; NaN counts as largest).
  std::pair<Value, Value> TopK(Value x, int64_t k, DType index_dtype = DType::kI32);

  // ---- Linear algebra ----
  Value MatMul(Value a, Value b);  // batch dims broadcast
  Value Linear(Value x, Value w);  // x [..., K] * w [N, K]^T
  Value Linear(Value x, Value w, Value bias);

  // ---- Rope and attention ----
  Value Rope(Value x, Value positions, const RopeParams& p);
  // Dense attention: q [B,Hq,Tq,D], k/v [B,Hkv,Tk,D(v)]; `aux` are 1-D tensors the mask/score
  // expressions Load from.
  Value Attention(Value q, Value k, Value v, const AttentionParams& p,
                  std::span<const Value> aux = {});
  // The same, also returning the log-sum-exp of each query row's scaled scores after
  // score_mod and mask_mod (-inf for fully masked rows).
  AttentionOutputs AttentionWithLse(Value q, Value k, Value v, const AttentionParams& p,
                                    std::span<const Value> aux = {});
  // The gradients of Attention(q, k, v, p, aux) from its output `o`, the output's gradient
  // `dout` and the log-sum-exp `lse` (OpKind::kAttentionBackward; p without score_mod).
  AttentionGrads AttentionBackward(Value q, Value k, Value v, Value o, Value dout, Value lse,
                                   const AttentionParams& p, std::span<const Value> aux = {});
  Value PagedAttention(Value q, Value k_cache, Value v_cache, Value block_table, Value seq_lens,
                       Value query_start, const AttentionParams& p,
                       std::span<const Value> aux = {});
  // Writes rows of `x` into cache slots (slot = block * block_size + offset; negative slots
  // are skipped). Returns the updated cache: consume it (not the old value) to read after
  // the write.
  Value KvWrite(Value cache, Value x, Value slot_mapping);

  // ---- Training ----
  // Cross-entropy and its gradient in one kernel: loss as CrossEntropy, and
  // dlogits = (softmax(logits) - onehot(target)) * dloss per row (dloss: the upstream
  // gradient of each row's loss, e.g. a scalar 1/N for a mean; it broadcasts to the rows).
  // Rows whose target is ignore_index give loss 0 and zero dlogits.
  CrossEntropyOutputs FusedCrossEntropy(Value logits, Value targets, Value dloss,
                                        int64_t ignore_index = -100);
  // One optimizer step of torch.optim's p.kind (AdamW, Adam, SGD or Adagrad: see
  // engine/optimizer.h for the whole training step) on one parameter tensor, in one fused
  // kernel that updates `param` and its `states` in place.
  //   param:      an f32 State "x" (or a view of one), updated in place
  //   grad:       d loss / d param, any float dtype, param's shape
  //   states:     f32 States of param's shape, in OptimizerStateNames(p) order (e.g. "x.m",
  //               "x.v"); their contents are ignored at step 1 (torch's initial state)
  //   hyper:      f32/f64 [3] {step, lr, grad_scale}, step 1-based: usually one Input
  //               shared by every parameter, written by the host before each run (a captured
  //               step replays with the new values); the gradient is multiplied by
  //               grad_scale (e.g. 1/n for gradient accumulation) before anything else;
  //               f32 holds steps exactly up to 2^24 (f64 beyond)
  //   grad_scale: optional (an invalid Value: none), a rank-0 float computed in the graph
  //               that multiplies hyper's grad_scale: global-norm clipping's coef
  //               (ClipGradNorm), with no round trip to the host
  // Returns the updated values (aliasing the States); read those, not the States, after the
  // update. The node is a side effect: it runs without a consumer, in builder order.
  OptimizerOutputs OptimizerStep(Value param, Value grad, std::span<const Value> states,
                                 Value hyper, Value grad_scale, const OptimizerParams& p);
  OptimizerOutputs OptimizerStep(Value param, Value grad, std::initializer_list<Value> states,
                                 Value hyper, Value grad_scale, const OptimizerParams& p) {
    return OptimizerStep(param, grad, std::span<const Value>(states.begin(), states.size()), hyper,
                         grad_scale, p);
  }

  // ---- Sampling ----
  // The next token of each sequence from its row of logits, with engine/sampling.h's
  // algorithm: the step program's sampling stage (see OpKind::kSample for the inputs).
  // `allowed` without `penalty_bias` passes zero biases (the op's inputs are positional).
  SampleOutputs Sample(Value logits, Value params, Value uniform, Value penalty_tokens,
                       Value penalty_counts, Value banned, Value penalty_bias = {},
                       Value allowed = {});

  // ---- Low level ----
  // Appends a node after running its op's shape/dtype rule; records an error and returns an
  // invalid Value if the rule rejects it (or an input is invalid, or an input the op writes
  // in place is not a State). Returns output 0 (multi-output ops: see AddNodeOutputs).
  Value AddNode(OpKind op, std::span<const Value> inputs, Attrs attrs, std::string_view name = {});
  // The same, returning every output: the node (output 0) and, for multi-output ops, the
  // output_of nodes appended right after it (outputs 1, 2, ...). Empty on error.
  std::vector<Value> AddNodeOutputs(OpKind op, std::span<const Value> inputs, Attrs attrs,
                                    std::string_view name = {});

 private:
  Value Unary(OpKind op, Value x);
  Value Binary(OpKind op, Value a, Value b);
  Value Reduce(OpKind op, Value x, std::vector<int> axes, bool keepdim);
  Value Source(OpKind op, std::string_view name, DType dtype, SymShape shape);
  // Broadcasts values to one shape (error if incompatible); false on error.
  bool Broadcast(std::span<Value> values, const char* op);
  bool NormalizeAxis(int& axis, int rank, const char* op);
  void Fail(Status s);

  Graph* g_;
  Status status_;
  std::string scope_;
};

// Dense attention written with other ops (matmul, map, where, softmax): the definition the
// Attention op's backward rule differentiates, and a second opinion for its kernels.
// `attrs` as for OpKind::kAttention (scale already resolved).
Value AttentionDecomposed(Builder& b, Value q, Value k, Value v, const Attrs& attrs,
                          std::span<const Value> aux);
// The log-sum-exp output of dense attention written with other ops (the definition its
// backward rule differentiates): [B, Hq, Tq] in the query's compute type.
Value AttentionLseDecomposed(Builder& b, Value q, Value k, const Attrs& attrs,
                             std::span<const Value> aux);

}  // namespace kiln
