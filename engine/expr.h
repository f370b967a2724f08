// The scalar expression IR: the "expression form" of pointwise and reduction ops, the body of
// generic `Map` ops, and FlexAttention-style mask_mod / score_mod functions.
//
// An Expr is an immutable tree of typed scalar operations over a few kinds of leaves:
//   Input(i)   element i of the op's inputs at the current position (converted to the
//              expression's compute type on load)
//   Index(a)   the current position along axis a (i64)
//   Acc(k)     the result of reduction stage k (reduction forms only)
//   Count()    the number of elements a reduction covers (i64)
//   Load(k, e) element e (an i64 expression) of the op's 1-D auxiliary tensor k
//   constants
// Types are compute types: f32, f64, i64 or bool. Binary operations promote (bool < i64 <
// f32 < f64) by inserting casts. Codegen (issue 4) prints these trees as C++/OpenCL/CUDA/HIP;
// `ExprProgram` interprets them (f32 nodes round to float after every operation, so an
// interpreted f32 expression overflows where generated f32 code would).
//
// Attention modifiers use the axes (b, h, q_idx, kv_idx) = Index(0..3) and, for score_mod,
// Input(0) = the score; see the `attn` helpers at the bottom.
//
// Thread-safety: Expr is immutable and shares subtrees; copies are cheap and thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/dtype.h"

namespace kiln {

enum class ExprOp : uint8_t {
  // Leaves.
  kConst,
  kInput,
  kIndex,
  kAcc,
  kCount,
  kLoad,  // args[0] = element index (i64)
  // Unary.
  kNeg,
  kAbs,
  kExp,
  kLog,
  kSqrt,
  kRsqrt,
  kTanh,
  kSigmoid,
  kErf,
  kSin,
  kCos,
  kFloor,
  kNot,
  // Binary.
  kAdd,
  kSub,
  kMul,
  kDiv,  // integer division truncates toward zero
  kMod,  // fmod for floats; for integers the result has the sign of the divisor (Python)
  kPow,
  kMax,
  kMin,
  kEq,
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
  kAnd,
  kOr,
  // Ternary: args = {cond, if_true, if_false}.
  kSelect,
  // Unary conversion to `type`.
  kCast,
};

const char* ExprOpName(ExprOp op);

// The expression type a stored element of `t` loads as: f64 for f64, f32 for other floats
// and quantized types, bool for bool, i64 for integers.
DType ExprTypeOf(DType t);

struct ExprNode;

class Expr {
 public:
  Expr() = default;  // null: "no expression"
  explicit operator bool() const { return node_ != nullptr; }
  const ExprNode& node() const { return *node_; }
  DType type() const;

  // Leaves.
  static Expr Const(double v, DType type = DType::kF32);
  static Expr Int(int64_t v);
  static Expr Bool(bool v);
  static Expr Input(int index, DType type = DType::kF32);
  static Expr Index(int axis);
  static Expr Acc(int stage, DType type = DType::kF32);
  static Expr Count();
  static Expr Load(int aux, const Expr& index, DType type = DType::kF32);

  // Generic constructors (type promotion as described above).
  static Expr Unary(ExprOp op, const Expr& a);
  static Expr Binary(ExprOp op, const Expr& a, const Expr& b);
  static Expr Select(const Expr& cond, const Expr& a, const Expr& b);
  static Expr Cast(DType type, const Expr& a);

  // C-like text: "(in0 * sigmoid(in0))", "select(idx2 >= idx3, in0, -inf)".
  std::string ToString() const;
  // Structural equality (same tree; shared or not).
  friend bool operator==(const Expr& a, const Expr& b);
  friend bool operator!=(const Expr& a, const Expr& b) { return !(a == b); }
  // A structural hash (equal trees hash equally), for kernel caches.
  uint64_t Hash() const;

  // True if the tree contains a leaf of this kind (with this index, if index >= 0).
  bool Uses(ExprOp leaf, int index = -1) const;
  // Largest Input index used plus one (0 if none); same for Load's aux index.
  int NumInputs() const;
  int NumAux() const;

 private:
  explicit Expr(std::shared_ptr<const ExprNode> n) : node_(std::move(n)) {}
  std::shared_ptr<const ExprNode> node_;
};

struct ExprNode {
  ExprOp op;
  DType type;      // f32, f64, i64 or bool
  int32_t index;   // Input / Index / Acc / Load
  double fvalue;   // Const of a float type
  int64_t ivalue;  // Const of i64 / bool
  std::vector<Expr> args;
};

// Operators for writing forms readably: x * Sigmoid(x), Ge(Expr::Index(2), Expr::Index(3)).
Expr operator+(const Expr& a, const Expr& b);
Expr operator-(const Expr& a, const Expr& b);
Expr operator*(const Expr& a, const Expr& b);
Expr operator/(const Expr& a, const Expr& b);
Expr operator-(const Expr& a);
Expr operator+(const Expr& a, double b);
Expr operator-(const Expr& a, double b);
Expr operator*(const Expr& a, double b);
Expr operator/(const Expr& a, double b);
Expr operator+(double a, const Expr& b);
Expr operator-(double a, const Expr& b);
Expr operator*(double a, const Expr& b);
Expr operator/(double a, const Expr& b);
Expr Exp(const Expr& a);
Expr Log(const Expr& a);
Expr Sqrt(const Expr& a);
Expr Rsqrt(const Expr& a);
Expr Tanh(const Expr& a);
Expr Sigmoid(const Expr& a);
Expr Erf(const Expr& a);
Expr Abs(const Expr& a);
Expr Max(const Expr& a, const Expr& b);
Expr Min(const Expr& a, const Expr& b);
Expr Pow(const Expr& a, const Expr& b);
Expr Mod(const Expr& a, const Expr& b);
Expr Eq(const Expr& a, const Expr& b);
Expr Ne(const Expr& a, const Expr& b);
Expr Lt(const Expr& a, const Expr& b);
Expr Le(const Expr& a, const Expr& b);
Expr Gt(const Expr& a, const Expr& b);
Expr Ge(const Expr& a, const Expr& b);
Expr And(const Expr& a, const Expr& b);
Expr Or(const Expr& a, const Expr& b);
Expr Not(const Expr& a);
Expr Select(const Expr& c, const Expr& a, const Expr& b);

// Replaces every Input(i) leaf by `inputs[i]` (null entries and other leaves stay). The
// replacement's type propagates: operations above it re-promote (so substituting an f64
// input into an f32-typed form computes in f64). Used to inline forms (fusion, derivatives).
Expr Substitute(const Expr& e, std::span<const Expr> inputs);

// d e / d Input(i), simplified (x*0, x+0, x*1 folded). Index/Acc/Count/Load/integer leaves
// have zero derivative; comparisons and Floor differentiate to 0 (a.e.); Max/Min send the
// gradient to the first argument on ties; Abs has derivative 0 at 0.
Expr Diff(const Expr& e, int input);

// A reduction's expression form: `stages` run in order over the reduced elements (each
// stage's `value` may use the inputs, indices and the results of earlier stages via Acc);
// `output` is evaluated per output element (per row for reductions, per element for
// normalizations, where it may also use Input/Index).
enum class ReduceKind : uint8_t { kSum, kMax, kMin, kArgMax };
const char* ReduceKindName(ReduceKind k);
struct ReduceStage {
  ReduceKind kind;
  Expr value;
};
struct ReduceForm {
  std::vector<ReduceStage> stages;
  Expr output;
  bool elementwise_output = false;  // softmax/norms: output has the input's shape
};

// ---- Interpreter ------------------------------------------------------------------------------

// One scalar value: `f` for float types, `i` for i64 and bool.
union ExprValue {
  double f;
  int64_t i;
};

// Values of the leaves at one evaluation point.
struct ExprEnv {
  const ExprValue* inputs = nullptr;  // by Input index, already in the leaf's type
  const int64_t* index = nullptr;     // by axis
  const ExprValue* acc = nullptr;     // by stage
  int64_t count = 0;
  // Loads element `i` of aux tensor `aux`, as a double (floats) or exact integer (ints).
  ExprValue (*load)(const void* ctx, int aux, int64_t i, DType type) = nullptr;
  const void* load_ctx = nullptr;
};

// An Expr flattened to straight-line code for fast repeated evaluation (the CPU backend's
// interpreter for expression forms; the harness's proof that forms match the reference).
// Thread-safety: Eval is const and reentrant.
class ExprProgram {
 public:
  ExprProgram() = default;
  explicit ExprProgram(const Expr& root);
  ExprValue Eval(const ExprEnv& env) const;
  DType type() const { return type_; }
  bool empty() const { return code_.empty(); }

 private:
  struct Instr {
    ExprOp op;
    DType type;
    DType arg_type;  // type of args (comparisons, casts)
    int32_t index;
    int32_t a, b, c;  // register numbers
    ExprValue imm;
  };
  int Emit(const Expr& e, std::vector<std::pair<const ExprNode*, int>>& memo);
  std::vector<Instr> code_;
  DType type_ = DType::kInvalid;
};

// ---- Attention modifiers (FlexAttention style) ---------------------------------------------
// mask_mod(b, h, q_idx, kv_idx) -> bool: true keeps the score. score_mod(score, b, h, q_idx,
// kv_idx) -> score, applied before masking. In paged attention q_idx/kv_idx are absolute
// positions within the sequence; in dense attention they are the tensor indices.
namespace attn {
inline Expr Batch() { return Expr::Index(0); }
inline Expr Head() { return Expr::Index(1); }
inline Expr QIdx() { return Expr::Index(2); }
inline Expr KvIdx() { return Expr::Index(3); }
inline Expr Score() { return Expr::Input(0, DType::kF32); }

Expr CausalMask();                       // kv_idx <= q_idx
Expr SlidingWindowMask(int64_t window);  // causal and q_idx - kv_idx < window
// Chunked (local) attention, Llama 4 style: causal within chunks of `chunk` positions
// (q_idx and kv_idx in the same chunk: kv_idx >= q_idx - q_idx mod chunk).
Expr ChunkedMask(int64_t chunk);
// Bidirectional within the first prefix_len[b] tokens, causal after; prefix_len is aux
// tensor `aux` (i32, one per sequence).
Expr PrefixLmMask(int aux);
// Bidirectional over each sequence's first len[b] keys (encoders over a padded batch: BERT);
// len is aux tensor `aux` (i32, one per sequence). Keys from len[b] on are padding.
Expr KeyPaddingMask(int aux);
// Packed training rows: causal (or a sliding window when window > 0) and only within one
// document. Aux tensor `aux` (i32, [B * row_len]) holds each token's document id, row-major
// over rows of row_len tokens.
Expr DocumentMask(int aux, int64_t row_len, int64_t window = 0);
// ALiBi: score + slope(h) * (kv_idx - q_idx), slope(h) = 2^(-8 (h + 1) / num_heads).
Expr AlibiScore(int64_t num_heads);
// Gemma-style soft-capping: cap * tanh(score / cap).
Expr SoftCapScore(double cap);
// A learned relative position bias (T5 / Swin style, without buckets): score +
// table[h * (2 max_distance + 1) + clamp(kv_idx - q_idx, -max_distance, max_distance) +
// max_distance], where aux tensor `aux` is the f32 table [num_heads * (2 max_distance + 1)].
Expr RelativeBiasScore(int aux, int64_t max_distance);
// Score modifiers applied one after the other: `second` of `first`'s result.
Expr Then(const Expr& first, const Expr& second);
// Masks combine with And / Or above (e.g. And(CausalMask(), DocumentMask(...))).
}  // namespace attn

}  // namespace kiln
