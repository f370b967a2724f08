// The op table: every op of the graph IR is defined exactly once, here and in ops.cc —
// its shape rule, dtype rule, backward rule (in terms of other ops) and, for pointwise and
// reduction ops, its expression form (the input of codegen). Backends implement kernels
// for ops; nothing else about an op is written per backend.
//
// Attributes are generic (ints, floats, dims, expressions, one dtype) so that printing,
// hashing and comparing nodes needs no per-op code. The per-op layout is documented at each
// OpKind below; builder.h is the typed way to create nodes.
//
// Conventions: "pointwise" ops take inputs of exactly the output's shape (the builder
// inserts Expand for broadcasting); strides are free (kernels take strided views). Axis
// attributes are non-negative (the builder normalizes negative ones).
//
// Thread-safety: the table is built once on first use and immutable afterwards; every
// function here is thread-safe. Backward rules append to the Builder they are given.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "engine/base/status.h"
#include "engine/dtype.h"
#include "engine/expr.h"
#include "engine/symbolic.h"

namespace kiln {

enum class OpKind : uint16_t {
  // ---- Sources (no inputs) ----
  kInput,     // external tensor bound per run (step inputs)
  kWeight,    // external tensor bound once, read-only (may be quantized / mmap'd)
  kState,     // external tensor bound once, updated in place by launches (the paged KV cache,
              // parameters and optimizer moments in training)
  kFull,      // floats[0] = value; dims = shape; dtype = element type
  kIota,      // ints[0] = axis; floats = {start, step}; dims = shape; dtype
  kDimValue,  // dims[0] = a symbolic size, as a rank-0 tensor of `dtype` at run time
  // ---- Pointwise unary ----
  kNeg,
  kAbs,
  kExp,
  kLog,
  kSqrt,
  kRsqrt,
  kTanh,
  kSigmoid,
  kSilu,
  kGeluTanh,
  kGeluErf,
  kRelu,
  kNot,    // bool -> bool
  kCast,   // dtype = target (not quantized); a quantized input is dequantized
  kClamp,  // floats = {lo, hi}
  // ---- Pointwise binary / ternary / generic ----
  kAdd,
  kSub,
  kMul,
  kDiv,  // integer division truncates; x / 0 is 0 for integers
  kPow,
  kMaximum,  // NaN-propagating
  kMinimum,
  kEq,  // comparisons: same-type inputs, bool output
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
  kAnd,  // bool
  kOr,
  kWhere,  // (cond bool, a, b)
  kMap,    // expr[0] over Input(i) (typed ExprTypeOf(input i's dtype)), Index(axis) and
           // Load(k, ...) of aux tensor k; ints[0] = number of aux inputs (1-D, last in the
           // input list); dims = output shape (the other inputs have it); dtype = output
  // ---- Reductions: ints = {keepdim, axes...} ----
  kSum,
  kMean,
  kMax,
  kMin,
  kArgMax,  // ints = {keepdim, axis}; dtype = i32 or i64; first index of the maximum
  // ---- Row ops over the last axis ----
  kSoftmax,  // fully -inf rows give zeros
  kLogSoftmax,
  kRmsNorm,       // floats[0] = eps: x * rsqrt(mean(x^2) + eps)
  kLayerNorm,     // floats[0] = eps: (x - mean) * rsqrt(var + eps)
  kCrossEntropy,  // (logits [..., V], targets [...] int) -> [...]; ints[0] = ignore_index
  // ---- Layout: views (no copy) and copies ----
  kReshape,     // dims = new shape (same element count; input must be viewable, see passes)
  kPermute,     // ints = permutation: out.shape[i] = in.shape[perm[i]]
  kSlice,       // ints[0] = axis; dims = {start, size}
  kExpand,      // dims = new shape; input dims equal or 1 (stride 0)
  kConcat,      // ints[0] = axis; 1+ inputs
  kContiguous,  // dense row-major copy
  // ---- Indexing ----
  kGather,           // (table [V, E...], idx [I...] int) -> [I..., E...]; dtype = out
  kScatterAddRows,   // (idx [I...], src [I..., E...]) -> zeros [V, E...] += rows; dims[0] = V
  kTakeAlong,        // (x [..., N], idx [..., K] int) -> [..., K]
  kScatterAddAlong,  // (idx [..., K], src [..., K]) -> zeros [..., N] +=; dims[0] = N
  kTopK,             // x [..., N] -> indices [..., k]; ints[0] = k; dtype = index type
  // ---- Linear algebra ----
  kMatMul,  // (a [..., M, K], b [..., K, N]) -> [..., M, N]; equal batch dims; b may have
            // another float type or be block-quantized (blocks along N) when both are 2-D
  kLinear,  // (x [..., K], w [N, K]) -> [..., N] = x w^T; w may be block-quantized
  // ---- Position encoding ----
  kRope,  // (x [..., H, D], pos [...] int); see RopeParams in builder.h for ints/floats
  // ---- Attention ----
  kAttention,       // (q [B,Hq,Tq,D], k [B,Hkv,Tk,D], v [B,Hkv,Tk,Dv], aux...) -> [B,Hq,Tq,Dv];
                    // ints = {} or {with_lse} or {with_lse, fused_backward}: with_lse = 1
                    // adds output 1, lse [B,Hq,Tq] in the query's compute type (f32; f64 for
                    // f64 queries): logsumexp of the scaled scores after score_mod and
                    // mask_mod (-inf for fully masked rows). fused_backward = 1 (needs
                    // with_lse, no score_mod): the backward rule emits one attention_backward
                    // node instead of differentiating the decomposition (which keeps the
                    // [B,Hq,Tq,Tk] probabilities alive from its forward to its backward)
  kPagedAttention,  // (q [T,Hq,D], k_cache [NB,BS,Hkv,D], v_cache [NB,BS,Hkv,Dv],
                    //  block_table [S,MB] i32, seq_lens [S] i32, query_start [S+1] i32,
                    //  aux...) -> [T,Hq,Dv]
                    // both: floats[0] = scale; expr[0] = mask_mod, expr[1] = score_mod
  kKvWrite,         // (cache [NB,BS,H,D], x [T,H,D], slot_mapping [T] int) -> cache, in place
  // ---- Multi-output plumbing ----
  kOutputOf,  // (producer) -> output ints[0] (>= 1) of its only input, a multi-output node.
              // A node with n outputs is followed directly by n - 1 output_of nodes (outputs
              // 1 .. n-1, in order); they own storage but no kernel: the producer's launch
              // writes them (LaunchArgs::extra_outputs)
  // ---- Training ----
  kFusedCrossEntropy,  // (logits [..., V] float, targets [...] int, dloss [...] logits' dtype)
                       // -> loss [...], dlogits [..., V]: loss as kCrossEntropy, dlogits =
                       // (softmax(logits) - onehot(target)) * dloss, in one kernel;
                       // ints[0] = ignore_index (such rows: loss 0, dlogits 0)
  // Optimizers: one fused kernel per parameter tensor, PyTorch's torch.optim update of one
  // step (the _single_tensor_* functions). Inputs (param, grad, hyper, states...,
  // [grad_scale]) -> param, states..., output 0 overwriting input 0 and output 1 + k input
  // 3 + k (in place). param and states: States, f32, param's shape; grad: float, that shape.
  // What changes per step is read at run time, so a captured step replays with new values:
  // hyper is an f32/f64 [3] tensor {step (1-based), lr, grad_scale}; the optional last input,
  // a rank-0 float tensor (e.g. global-norm clipping's coefficient computed in the graph),
  // multiplies grad_scale; the gradient is multiplied by grad_scale before anything else. At
  // step 1 every state starts as torch creates it (the States' old contents are not read).
  kAdamW,    // states m, v; floats = {beta1, beta2, eps, weight_decay}, decoupled decay
  kAdam,     // states m, v; floats = {beta1, beta2, eps, weight_decay}, L2 decay (no amsgrad)
  kSgd,      // states: momentum_buffer if momentum != 0, else none; floats = {momentum,
             // dampening, weight_decay}; ints[0] = nesterov (0/1)
  kAdagrad,  // state sum; floats = {lr_decay, weight_decay, initial_accumulator_value, eps}
  // ---- Sampling ----
  kSample,  // (logits [S, V] f32, params [S, sampling::kNumParams] f32, uniform [S] f64,
            //  penalty_tokens [S, P] i32, penalty_counts [S, P] i32, banned [S, E] i32
            //  [, penalty_bias [S, P] f32: each listed token's logit bias; count -1 lists a
            //  token for its bias only
            //  [, allowed [S, ceil(V / 32)] i32: a bitmask per row, bit t % 32 of word t / 32
            //  set if token t may be sampled (grammar-constrained decoding)]])
            // -> token [S] i32, logprob [S] f32, top_ids [S, sampling::kMaxLogprobs] i32,
            //    top_logprobs [S, sampling::kMaxLogprobs] f32.
            // engine/sampling.h on each row: penalties (token ids < 0 pad a row), banned tokens
            // (-1 pads), tokens outside `allowed` set to -inf, then greedy or a draw with the
            // row's uniform. A row with no token left (all -inf) gets token -1
            // (sampling::kNoToken) and logprob 0. logprob and the top-n (n = the row's
            // logprobs, at most kMaxLogprobs) are of the raw logits (the mask does not change
            // them); rows that ask for none get logprob 0, and unused top entries id -1,
            // logprob 0. No attrs.
  // ---- Training: attention ----
  kAttentionBackward,  // (q [B,Hq,Tq,D], k [B,Hkv,Tk,D], v [B,Hkv,Tk,Dv], o [B,Hq,Tq,Dv],
                       //  do [B,Hq,Tq,Dv], lse [B,Hq,Tq], aux...) -> dq (q's type), dk, dv:
                       // the gradients of dense attention (flash-attention's backward: the
                       // probabilities exp(score - lse) recomputed, D_i = rowsum(do * o),
                       // dS = P (dP - D_i); GQA heads summed into dk, dv); attrs as
                       // kAttention's floats and expr[0] (mask_mod); no score_mod, ints = {}.
                       // Built by kAttention's backward rule when its ints[1] asks for it.
  kNumOps,
};

const char* OpName(OpKind op);

// Node attributes. Which fields an op uses is documented at its OpKind.
struct Attrs {
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<Dim> dims;
  std::array<Expr, 2> expr;
  DType dtype = DType::kInvalid;

  friend bool operator==(const Attrs& a, const Attrs& b);
  // A structural hash (for kernel caches and CSE).
  uint64_t Hash() const;
  // " eps=1e-05", " axes=[1] keepdim=0", ... (leading space; empty when no attributes).
  std::string ToString(OpKind op, std::span<const std::string> symbol_names = {}) const;
};

enum class OpClass : uint8_t {
  kSource,     // Input/Weight/State: external storage, no kernel
  kGenerator,  // Full/Iota/DimValue: no inputs, but a kernel
  kPointwise,
  kReduce,  // Sum/Mean/Max/Min/ArgMax
  kRow,     // softmax, norms, cross-entropy: reduction over the last axis
  kView,    // Reshape/Permute/Slice/Expand: no kernel, shares the input's storage
  kOther,
  kProjection,  // output_of: storage written by its producer's launch; no kernel of its own
};

// The most outputs one node may have.
inline constexpr int kMaxOutputs = 4;

// The type of one value: element type and (possibly symbolic) shape.
struct TensorType {
  DType dtype = DType::kInvalid;
  SymShape shape;
};

class Builder;
struct Node;

// A handle to a node's output (its id in the graph). Invalid (id < 0) after a builder error.
struct Value {
  int32_t id = -1;
  bool valid() const { return id >= 0; }
  friend bool operator==(Value a, Value b) { return a.id == b.id; }
  friend bool operator!=(Value a, Value b) { return a.id != b.id; }
};

// What a backward rule gets: the node (a copy: the rule appends to the graph), its output
// value, the gradient of the loss w.r.t. that output, and a slot per input to fill with the
// input's gradient (leave invalid for "no gradient": integer inputs, indices, ...).
// Multi-output nodes: `outs` and `grads` hold every output and its gradient in output order;
// a gradient is invalid where none flows (so `grad`, output 0's, may be invalid too). The
// rule is called when at least one output has a gradient.
struct BackwardArgs {
  Builder& b;
  const Node& node;
  Value out;   // output 0
  Value grad;  // d loss / d output 0 (always valid for single-output ops)
  std::vector<Value>& input_grads;
  std::span<const Value> outs;   // every output (outs[0] == out)
  std::span<const Value> grads;  // one per output (grads[0] == grad)
};

struct OpDef {
  OpKind op;
  const char* name;
  OpClass cls;
  int min_inputs;
  int max_inputs;  // -1: variadic
  // Shape and dtype rule: validates inputs and attributes, returns the output type.
  // Messages say what was wrong and what is allowed (the builder adds the node's name).
  StatusOr<TensorType> (*infer)(std::span<const TensorType> in, const Attrs& attrs);
  // Backward rule, or nullptr if the op has no gradient (sources, indices, side effects).
  Status (*backward)(BackwardArgs& args);
  // Expression form of pointwise/generator ops: the output element as an Expr over
  // Input(i) (typed ComputeDType(in[i])) and Index(axis). Null for other classes.
  Expr (*pointwise)(const Attrs& attrs, std::span<const DType> in, DType out);
  // Expression form of reduce/row ops (Input(0) = the reduced tensor; Input(i > 0) are
  // per-row inputs, e.g. cross-entropy targets). Null for other classes.
  ReduceForm (*reduce)(const Attrs& attrs, std::span<const DType> in, DType out);
  bool side_effect;  // kept by DCE; ordered by builder order (KvWrite, optimizers)
  // An optimization: the output may reuse the arena storage of input `reuse_input` (>= 0)
  // when that input dies here and has the same byte size; -1: never.
  int reuse_input;
  // Multi-output ops: the types of outputs 1, 2, ... (output 0's is `infer`'s) for these
  // inputs and attributes; empty for a single output. Null: always one output.
  StatusOr<std::vector<TensorType>> (*infer_extra)(std::span<const TensorType> in,
                                                   const Attrs& attrs);
  // In-place writes (semantics, not an optimization): output i overwrites input
  // writes_input[i] (-1: output i has storage of its own). That input must be a State or a
  // view of one (Weights and Inputs are read-only); the output aliases its storage and takes
  // no arena space; nothing may read the overwritten value after the writer (verify checks
  // it). Ops that write in place are side effects.
  std::array<int8_t, kMaxOutputs> writes_input;
};

const OpDef& GetOpDef(OpKind op);

// The number of state tensors (inputs 3 .., outputs 1 ..) of an optimizer node (kAdamW,
// kAdam, kSgd, kAdagrad) with these attributes; an optional grad_scale input follows them.
int OptimizerStateCount(OpKind op, const Attrs& attrs);

// Every output's type for a node of `op`: infer's, then infer_extra's (messages as infer's).
StatusOr<std::vector<TensorType>> InferOutputs(OpKind op, std::span<const TensorType> in,
                                               const Attrs& attrs);
// Whether a node of `op` is launched (has a kernel): false for sources, views and output_of.
bool IsLaunched(OpKind op);

// Inverse frequency of rotary pair i of a kRope node's attrs (HF transformers' rope_scaling
// semantics: none, linear, llama3); shared by every RoPE kernel.
double RopeInvFreq(const Attrs& attrs, int64_t i);

}  // namespace kiln
