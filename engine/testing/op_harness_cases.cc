// The harness's case catalogue: every op of the op table, over dtypes and shapes
// (including broadcast and strided inputs). Gradient cases are f64.
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/sampling.h"
#include "engine/testing/op_harness.h"

namespace kiln::harness {
namespace {

using V = std::vector<Value>;
using BuildFn = std::function<Value(Builder&, const V&)>;

std::string ShapeStr(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

InputSpec Normal(std::string name, DType t, std::vector<int64_t> shape, double scale = 1) {
  InputSpec s;
  s.name = std::move(name);
  s.dtype = t;
  s.shape = std::move(shape);
  s.init = Init::kNormal;
  s.hi = scale;
  return s;
}
InputSpec Uniform(std::string name, DType t, std::vector<int64_t> shape, double lo, double hi) {
  InputSpec s = Normal(std::move(name), t, std::move(shape));
  s.init = Init::kUniform;
  s.lo = lo;
  s.hi = hi;
  return s;
}
InputSpec Index(std::string name, DType t, std::vector<int64_t> shape, int64_t lo, int64_t hi) {
  InputSpec s = Normal(std::move(name), t, std::move(shape));
  s.init = Init::kIndex;
  s.lo = static_cast<double>(lo);
  s.hi = static_cast<double>(hi);
  s.differentiable = false;
  return s;
}
InputSpec Bools(std::string name, std::vector<int64_t> shape) {
  InputSpec s = Normal(std::move(name), DType::kBool, std::move(shape));
  s.init = Init::kBool;
  s.differentiable = false;
  return s;
}
InputSpec Custom(std::string name, DType t, std::vector<int64_t> shape, std::vector<double> v) {
  InputSpec s = Normal(std::move(name), t, std::move(shape));
  s.init = Init::kCustom;
  s.values = std::move(v);
  s.differentiable = IsFloat(t);
  return s;
}
InputSpec Blocks(std::string name, DType t, std::vector<int64_t> shape) {
  InputSpec s = Normal(std::move(name), t, std::move(shape));
  s.init = Init::kRandomBlocks;
  s.source = OpKind::kWeight;
  s.differentiable = false;
  return s;
}
InputSpec AsWeight(InputSpec s) {
  s.source = OpKind::kWeight;
  return s;
}
InputSpec AsState(InputSpec s) {
  s.source = OpKind::kState;
  s.differentiable = false;
  return s;
}

OpCase Make(std::string op, std::string detail, std::vector<InputSpec> inputs, BuildFn build) {
  OpCase c;
  c.name = absl::StrCat(op, " ", detail);
  c.op = std::move(op);
  c.inputs = std::move(inputs);
  c.build = std::move(build);
  return c;
}

struct UnaryOp {
  const char* name;
  Value (Builder::*fn)(Value);
  bool positive;  // needs positive inputs
  bool ints;      // also defined for integers
};
const UnaryOp kUnary[] = {
    {"neg", &Builder::Neg, false, true},    {"abs", &Builder::Abs, false, true},
    {"exp", &Builder::Exp, false, false},   {"log", &Builder::Log, true, false},
    {"sqrt", &Builder::Sqrt, true, false},  {"rsqrt", &Builder::Rsqrt, true, false},
    {"tanh", &Builder::Tanh, false, false}, {"sigmoid", &Builder::Sigmoid, false, false},
    {"silu", &Builder::Silu, false, false}, {"relu", &Builder::Relu, false, true},
};

struct BinaryOp {
  const char* name;
  Value (Builder::*fn)(Value, Value);
  bool ints;
};
const BinaryOp kArith[] = {
    {"add", &Builder::Add, true},         {"sub", &Builder::Sub, true},
    {"mul", &Builder::Mul, true},         {"div", &Builder::Div, true},
    {"maximum", &Builder::Maximum, true}, {"minimum", &Builder::Minimum, true}};
const BinaryOp kCompare[] = {{"eq", &Builder::Eq, true}, {"ne", &Builder::Ne, true},
                             {"lt", &Builder::Lt, true}, {"le", &Builder::Le, true},
                             {"gt", &Builder::Gt, true}, {"ge", &Builder::Ge, true}};

InputSpec UnaryInput(const UnaryOp& u, DType t, std::vector<int64_t> shape) {
  return u.positive ? Uniform("x", t, std::move(shape), 0.1, 3)
                    : Normal("x", t, std::move(shape), 2);
}

// Shared setup of paged-attention cases: 2 sequences (a 5-token prefill, a 1-token decode of
// a 7-token sequence) in 6 blocks of 4, plus one padding row: T = 7.
std::vector<InputSpec> PagedInputs(DType q, DType cache, int64_t hq, int64_t hkv, int64_t d) {
  return {Normal("q", q, {7, hq, d}),
          AsState(Normal("k_cache", cache, {6, 4, hkv, d})),
          AsState(Normal("v_cache", cache, {6, 4, hkv, d})),
          Custom("block_table", DType::kI32, {2, 3}, {2, 0, 5, 1, 3, 4}),
          Custom("seq_lens", DType::kI32, {2}, {5, 7}),
          Custom("query_start", DType::kI32, {3}, {0, 5, 6})};
}

// Every dense-attention variant used by forward and gradient cases: each modifier of the
// attn:: library, and combinations.
struct AttnVariant {
  enum class Aux { kNone, kPrefixLen, kBiasTable };  // aux tensor 0, if any
  const char* name;
  AttentionParams params;
  Aux aux = Aux::kNone;
};
std::vector<AttnVariant> AttentionVariants() {
  using Aux = AttnVariant::Aux;
  std::vector<AttnVariant> v;
  v.push_back({"causal", {0, attn::CausalMask(), {}}});
  v.push_back({"unmasked", {0, {}, {}}});
  v.push_back({"sliding_window", {0, attn::SlidingWindowMask(2), {}}});
  v.push_back({"chunked", {0, attn::ChunkedMask(2), {}}});
  v.push_back({"alibi", {0, attn::CausalMask(), attn::AlibiScore(4)}});
  v.push_back({"softcap", {0.5, attn::CausalMask(), attn::SoftCapScore(2.0)}});
  v.push_back({"prefix_lm", {0, attn::PrefixLmMask(0), {}}, Aux::kPrefixLen});
  v.push_back({"key_padding", {0, attn::KeyPaddingMask(0), {}}, Aux::kPrefixLen});
  v.push_back(
      {"relative_bias", {0, attn::CausalMask(), attn::RelativeBiasScore(0, 2)}, Aux::kBiasTable});
  // Gemma 2's sliding layers; chunks and a window at once; ALiBi then a cap.
  v.push_back({"sliding_window+softcap", {0, attn::SlidingWindowMask(3), attn::SoftCapScore(1.5)}});
  v.push_back(
      {"chunked&sliding_window", {0, And(attn::ChunkedMask(3), attn::SlidingWindowMask(2)), {}}});
  v.push_back({"alibi>softcap",
               {0, attn::CausalMask(), attn::Then(attn::AlibiScore(4), attn::SoftCapScore(1.0))}});
  return v;
}

// Appends variant `v`'s aux input for `batch` sequences (prefix lengths; a bias table for 4
// heads, max distance 2). Returns whether there is one.
bool AddAttnAux(const AttnVariant& v, int64_t batch, std::vector<InputSpec>& in) {
  switch (v.aux) {
    case AttnVariant::Aux::kNone:
      return false;
    case AttnVariant::Aux::kPrefixLen:
      in.push_back(batch == 2 ? Custom("prefix_len", DType::kI32, {2}, {3, 0})
                              : Custom("prefix_len", DType::kI32, {1}, {2}));
      return true;
    case AttnVariant::Aux::kBiasTable: {
      InputSpec table = Normal("rel_bias", DType::kF32, {4 * 5});
      table.differentiable = false;  // a constant of the score_mod, not an attention input
      in.push_back(std::move(table));
      return true;
    }
  }
  return false;
}

// Shapes of the training attention cases (packed rows of L tokens; `docs`: document ids as
// aux 0, the mask attn::DocumentMask; `prefix`: prefix lengths per row as aux 0, the mask
// attn::PrefixLmMask).
struct TrainAttnShape {
  const char* name;
  AttentionParams params;
  int64_t B, hq, hkv, L, D;
  bool docs;
  std::vector<double> prefix = {};
};
std::vector<TrainAttnShape> TrainAttnShapes() {
  // Queries 0..2 see keys up to their index + 3; later queries see none.
  const Expr partial =
      And(Le(Expr::Index(3), Expr::Index(2) + Expr::Int(3)), Lt(Expr::Index(2), Expr::Int(3)));
  return {
      {"causal GQA 3/1 [1,3,9,8]", {0, attn::CausalMask(), {}}, 1, 3, 1, 9, 8, false},
      {"documents GQA 3/1 [2,3,70,64]", {0, attn::DocumentMask(0, 70), {}}, 2, 3, 1, 70, 64, true},
      {"documents (i64 ids), window 20, MHA [1,2,130,16]",
       {0, attn::DocumentMask(0, 130, 20), {}},
       1,
       2,
       2,
       130,
       16,
       true},
      {"sliding window 5 [1,2,17,12]",
       {0.3, attn::SlidingWindowMask(5), {}},
       1,
       2,
       1,
       17,
       12,
       false},
      {"unmasked [1,2,6,5]", {0, {}, {}}, 1, 2, 2, 6, 5, false},
      {"fully masked rows [1,2,7,4]", {0, partial, {}}, 1, 2, 1, 7, 4, false},
      // Masks the cpu kernels run compiled, over several 64-key blocks: full, partial and
      // empty blocks, runs of them with gaps, a table per shape and one per launch (aux).
      {"chunks of 48 and a window of 40, GQA 2/1 [1,2,150,16]",
       {0, And(attn::ChunkedMask(48), attn::SlidingWindowMask(40)), {}},
       1,
       2,
       1,
       150,
       16,
       false},
      {"prefix-LM (prefixes 40, 100) [2,2,150,16]",
       {0, attn::PrefixLmMask(0), {}},
       2,
       2,
       2,
       150,
       16,
       false,
       {40, 100}},
  };
}
// Per row of L tokens: a one-token document, one of 24 tokens, then the rest; odd rows instead
// reuse ids out of order (runs of 7 tokens cycling through 3 ids: a document id may come back
// after another's tokens, which block skipping must not assume away).
std::vector<double> DocIds(int64_t B, int64_t L) {
  std::vector<double> ids;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < L; ++i) {
      ids.push_back(b % 2 == 1 ? static_cast<double>(i / 7 % 3) : (i < 1 ? 0 : (i < 25 ? 1 : 2)));
    }
  }
  return ids;
}

void AddPointwise(std::vector<OpCase>& out, bool full) {
  std::vector<DType> floats = {DType::kF32, DType::kF16, DType::kBF16};
  if (full) floats.push_back(DType::kF64);
  std::vector<std::vector<int64_t>> shapes = {{7}, {3, 33}};
  if (full) shapes.push_back({64, 257});
  for (const UnaryOp& u : kUnary) {
    for (DType t : floats) {
      for (const auto& s : shapes) {
        out.push_back(Make(u.name, absl::StrCat(DTypeName(t), " ", ShapeStr(s)),
                           {UnaryInput(u, t, s)},
                           [fn = u.fn](Builder& b, const V& in) { return (b.*fn)(in[0]); }));
      }
    }
    // A strided (transposed) input.
    out.push_back(
        Make(u.name, "f32 transposed [6,5]", {UnaryInput(u, DType::kF32, {5, 6})},
             [fn = u.fn](Builder& b, const V& in) { return (b.*fn)(b.Transpose(in[0], 0, 1)); }));
    if (u.ints) {
      out.push_back(Make(u.name, "i32 [13]", {Index("x", DType::kI32, {13}, -50, 50)},
                         [fn = u.fn](Builder& b, const V& in) { return (b.*fn)(in[0]); }));
    }
  }
  for (DType t : floats) {
    for (bool tanh : {true, false}) {
      out.push_back(Make(tanh ? "gelu_tanh" : "gelu_erf", absl::StrCat(DTypeName(t), " [3,33]"),
                         {Normal("x", t, {3, 33}, 2)},
                         [tanh](Builder& b, const V& in) { return b.Gelu(in[0], tanh); }));
    }
    out.push_back(Make("clamp", absl::StrCat(DTypeName(t), " [3,33]"), {Normal("x", t, {3, 33})},
                       [](Builder& b, const V& in) { return b.Clamp(in[0], -0.5, 0.7); }));
  }
  out.push_back(Make("clamp", "i32 [13]", {Index("x", DType::kI32, {13}, -9, 9)},
                     [](Builder& b, const V& in) { return b.Clamp(in[0], -3, 4); }));
  out.push_back(Make("not", "bool [17]", {Bools("x", {17})},
                     [](Builder& b, const V& in) { return b.Not(in[0]); }));

  // Casts between every family, including saturation, wrapping and dequantization.
  struct CastCase {
    DType from, to;
    double scale;
  };
  const CastCase casts[] = {
      {DType::kF32, DType::kF16, 3},    {DType::kF32, DType::kBF16, 3},
      {DType::kF16, DType::kF32, 3},    {DType::kBF16, DType::kF16, 3},
      {DType::kF32, DType::kF8E4M3, 3}, {DType::kF32, DType::kF8E5M2, 3},
      {DType::kF8E4M3, DType::kF32, 3}, {DType::kF32, DType::kF64, 3},
      {DType::kF64, DType::kF32, 3},    {DType::kF32, DType::kI32, 1e10},
      {DType::kF32, DType::kI8, 300},   {DType::kF32, DType::kBool, 1},
      {DType::kF16, DType::kU8, 200},
  };
  for (const CastCase& cc : casts) {
    out.push_back(Make("cast", absl::StrCat(DTypeName(cc.from), "->", DTypeName(cc.to), " [5,7]"),
                       {Normal("x", cc.from, {5, 7}, cc.scale)},
                       [to = cc.to](Builder& b, const V& in) { return b.Cast(in[0], to); }));
  }
  out.push_back(Make("cast", "i32->f32 [9]", {Index("x", DType::kI32, {9}, -1000, 1000)},
                     [](Builder& b, const V& in) { return b.Cast(in[0], DType::kF32); }));
  out.push_back(Make("cast", "i64->i8 (wraps) [9]", {Index("x", DType::kI64, {9}, -1000, 1000)},
                     [](Builder& b, const V& in) { return b.Cast(in[0], DType::kI8); }));
  out.push_back(Make("cast", "bool->f16 [9]", {Bools("x", {9})},
                     [](Builder& b, const V& in) { return b.Cast(in[0], DType::kF16); }));
  for (DType q : {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4}) {
    out.push_back(Make("cast", absl::StrCat(DTypeName(q), "->f32 [3,64]"),
                       {AsWeight(Normal("x", q, {3, 64}))},
                       [](Builder& b, const V& in) { return b.Cast(in[0], DType::kF32); }));
  }
  for (DType q : {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    out.push_back(Make("cast", absl::StrCat(DTypeName(q), "->f32 [2,256]"),
                       {Blocks("x", q, {2, 256})},
                       [](Builder& b, const V& in) { return b.Cast(in[0], DType::kF32); }));
  }

  for (const BinaryOp& op : kArith) {
    for (DType t : floats) {
      InputSpec y = std::string(op.name) == "div" ? Uniform("y", t, {4, 33}, 0.5, 2)
                                                  : Normal("y", t, {4, 33});
      out.push_back(Make(op.name, absl::StrCat(DTypeName(t), " [4,33]"),
                         {Normal("x", t, {4, 33}), y},
                         [fn = op.fn](Builder& b, const V& in) { return (b.*fn)(in[0], in[1]); }));
    }
    out.push_back(
        Make(op.name, "f32 broadcast [4,1,3]x[5,1]",
             {Normal("x", DType::kF32, {4, 1, 3}), Uniform("y", DType::kF32, {5, 1}, 0.5, 2)},
             [fn = op.fn](Builder& b, const V& in) { return (b.*fn)(in[0], in[1]); }));
    out.push_back(
        Make(op.name, "i32 [16] (incl. division by 0)",
             {Index("x", DType::kI32, {16}, -100, 100), Index("y", DType::kI32, {16}, -3, 4)},
             [fn = op.fn](Builder& b, const V& in) { return (b.*fn)(in[0], in[1]); }));
  }
  out.push_back(Make("pow", "f32 [4,9]",
                     {Uniform("x", DType::kF32, {4, 9}, 0.2, 2), Normal("y", DType::kF32, {4, 9})},
                     [](Builder& b, const V& in) { return b.Pow(in[0], in[1]); }));
  out.push_back(Make("pow", "f16 [4,9]",
                     {Uniform("x", DType::kF16, {4, 9}, 0.2, 2), Normal("y", DType::kF16, {4, 9})},
                     [](Builder& b, const V& in) { return b.Pow(in[0], in[1]); }));
  for (const BinaryOp& op : kCompare) {
    // Small integer-valued inputs so equal values occur.
    for (DType t : {DType::kF32, DType::kF16, DType::kI32}) {
      out.push_back(Make(op.name, absl::StrCat(DTypeName(t), " [6,7]"),
                         {Index("x", t, {6, 7}, -2, 3), Index("y", t, {6, 7}, -2, 3)},
                         [fn = op.fn](Builder& b, const V& in) { return (b.*fn)(in[0], in[1]); }));
    }
  }
  out.push_back(Make("and", "bool [4,5]", {Bools("x", {4, 5}), Bools("y", {4, 5})},
                     [](Builder& b, const V& in) { return b.And(in[0], in[1]); }));
  out.push_back(Make("or", "bool broadcast [4,5]x[5]", {Bools("x", {4, 5}), Bools("y", {5})},
                     [](Builder& b, const V& in) { return b.Or(in[0], in[1]); }));
  for (DType t : {DType::kF32, DType::kF16, DType::kI32}) {
    out.push_back(
        Make("where", absl::StrCat(DTypeName(t), " broadcast cond [5]"),
             {Bools("c", {5}), Index("x", t, {4, 5}, -9, 9), Index("y", t, {4, 5}, -9, 9)},
             [](Builder& b, const V& in) { return b.Where(in[0], in[1], in[2]); }));
  }
  for (DType t : {DType::kF32, DType::kF64, DType::kF16}) {
    out.push_back(Make("map", absl::StrCat(DTypeName(t), " exp/select/index [4,6]"),
                       {Normal("x", t, {4, 6}), Normal("y", t, {4, 6})},
                       [t](Builder& b, const V& in) {
                         const DType c = ExprTypeOf(t);
                         const Expr x = Expr::Input(0, c), y = Expr::Input(1, c);
                         const Expr e = Exp(x * 0.5) + y * Expr::Cast(c, Expr::Index(1)) -
                                        Select(Gt(x, y), Expr::Const(1, c), Expr::Const(0, c));
                         return b.Map(e, in, t);
                       }));
  }
  out.push_back(Make("map", "index-only mask i32 aux [3,5]",
                     {Custom("limit", DType::kI32, {3}, {1, 4, 0})}, [](Builder& b, const V& in) {
                       const Expr e =
                           Lt(Expr::Index(1), Expr::Load(0, Expr::Index(0), DType::kI64));
                       return b.MapIndices(e, {3, 5}, DType::kBool, in);
                     }));
  out.push_back(Make("full", "f32 [3,4]", {}, [](Builder& b, const V&) {
    return b.Full(2.5, DType::kF32, {3, 4});
  }));
  out.push_back(Make("full", "i32 [5]", {},
                     [](Builder& b, const V&) { return b.Full(-7, DType::kI32, {5}); }));
  out.push_back(Make("full", "f16 [2,2]", {}, [](Builder& b, const V&) {
    return b.Full(0.1, DType::kF16, {2, 2});
  }));
  out.push_back(Make("iota", "f32 axis 1 [3,5]", {}, [](Builder& b, const V&) {
    return b.Iota(DType::kF32, {3, 5}, 1, 0.5, 0.25);
  }));
  out.push_back(Make("iota", "i64 axis 0 [4,2]", {}, [](Builder& b, const V&) {
    return b.Iota(DType::kI64, {4, 2}, 0, 3, 2);
  }));
  out.push_back(Make("dim_value", "i64", {},
                     [](Builder& b, const V&) { return b.DimValue(Dim(7), DType::kI64); }));
  out.push_back(Make("dim_value", "f32", {},
                     [](Builder& b, const V&) { return b.DimValue(Dim(7), DType::kF32); }));
}

void AddReductions(std::vector<OpCase>& out, bool full) {
  struct R {
    const char* name;
    Value (Builder::*fn)(Value, std::vector<int>, bool);
    bool ints;
  };
  const R reds[] = {{"sum", &Builder::Sum, true},
                    {"mean", &Builder::Mean, false},
                    {"max", &Builder::Max, true},
                    {"min", &Builder::Min, true}};
  const std::vector<std::pair<std::vector<int>, bool>> axes = {
      {{1}, false}, {{0, 2}, true}, {{0, 1, 2}, false}, {{-1}, true}};
  std::vector<DType> types = {DType::kF32, DType::kF16, DType::kBF16};
  for (const R& r : reds) {
    for (DType t : types) {
      for (const auto& [ax, keep] : axes) {
        std::vector<std::string> as;
        for (int a : ax) as.push_back(std::to_string(a));
        out.push_back(Make(
            r.name,
            absl::StrCat(DTypeName(t), " [3,4,5] axes=[", absl::StrJoin(as, ","), "]",
                         keep ? " keepdim" : ""),
            {Normal("x", t, {3, 4, 5})},
            [fn = r.fn, ax, keep](Builder& b, const V& in) { return (b.*fn)(in[0], ax, keep); }));
      }
    }
    if (r.ints) {
      out.push_back(
          Make(r.name, "i32 [4,6] axes=[0]", {Index("x", DType::kI32, {4, 6}, -99, 99)},
               [fn = r.fn](Builder& b, const V& in) { return (b.*fn)(in[0], {0}, false); }));
    }
  }
  if (full) {
    out.push_back(Make("sum", "f32 [64,1000] axes=[1]", {Normal("x", DType::kF32, {64, 1000})},
                       [](Builder& b, const V& in) { return b.Sum(in[0], {1}); }));
  }
  for (DType t : {DType::kF32, DType::kF16, DType::kI32}) {
    out.push_back(Make("argmax", absl::StrCat(DTypeName(t), " [4,9] axis=1"),
                       {t == DType::kI32 ? Index("x", t, {4, 9}, -5, 5) : Normal("x", t, {4, 9})},
                       [](Builder& b, const V& in) { return b.ArgMax(in[0], 1); }));
    out.push_back(
        Make("argmax", absl::StrCat(DTypeName(t), " [3,4,2] axis=0 keepdim i64"),
             {t == DType::kI32 ? Index("x", t, {3, 4, 2}, -5, 5) : Normal("x", t, {3, 4, 2})},
             [](Builder& b, const V& in) { return b.ArgMax(in[0], 0, true, DType::kI64); }));
  }
}

void AddRows(std::vector<OpCase>& out, bool full) {
  std::vector<DType> types = {DType::kF32, DType::kF16, DType::kBF16};
  if (full) types.push_back(DType::kF64);
  std::vector<std::vector<int64_t>> shapes = {{3, 17}, {2, 3, 64}};
  if (full) shapes.push_back({16, 4096});
  struct R {
    const char* name;
    BuildFn fn;
  };
  const R rows[] = {
      {"softmax", [](Builder& b, const V& in) { return b.Softmax(in[0]); }},
      {"log_softmax", [](Builder& b, const V& in) { return b.LogSoftmax(in[0]); }},
      {"rms_norm", [](Builder& b, const V& in) { return b.RmsNorm(in[0], 1e-5); }},
      {"layer_norm", [](Builder& b, const V& in) { return b.LayerNorm(in[0], 1e-5); }},
  };
  for (const R& r : rows) {
    for (DType t : types) {
      for (const auto& s : shapes) {
        out.push_back(Make(r.name, absl::StrCat(DTypeName(t), " ", ShapeStr(s)),
                           {Normal("x", t, s, 3)}, r.fn));
      }
    }
    out.push_back(
        Make(r.name, "f32 transposed [5,4]", {Normal("x", DType::kF32, {4, 5}, 3)},
             [fn = r.fn](Builder& b, const V& in) { return fn(b, {b.Transpose(in[0], 0, 1)}); }));
  }
  // Masked rows: -inf entries, and one fully masked row (softmax gives zeros).
  const double ninf = -INFINITY;
  const std::vector<double> masked = {1, ninf, 2, ninf, ninf, ninf, ninf, ninf, 0.5, 0.25, ninf, 3};
  out.push_back(Make("softmax", "f32 with -inf and a fully masked row [3,4]",
                     {Custom("x", DType::kF32, {3, 4}, masked)},
                     [](Builder& b, const V& in) { return b.Softmax(in[0]); }));
  out.push_back(Make("log_softmax", "f32 with -inf [2,4]",
                     {Custom("x", DType::kF32, {2, 4}, {1, ninf, 2, 0, ninf, 0.5, 0.25, 3})},
                     [](Builder& b, const V& in) { return b.LogSoftmax(in[0]); }));
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    out.push_back(Make("cross_entropy", absl::StrCat(DTypeName(t), " [6,11] with ignore_index"),
                       {Normal("logits", t, {6, 11}, 3),
                        Custom("targets", DType::kI32, {6}, {3, -100, 10, 0, 5, 7})},
                       [](Builder& b, const V& in) { return b.CrossEntropy(in[0], in[1]); }));
  }
  out.push_back(
      Make("cross_entropy", "f32 [2,3,5] i64 targets",
           {Normal("logits", DType::kF32, {2, 3, 5}), Index("targets", DType::kI64, {2, 3}, 0, 5)},
           [](Builder& b, const V& in) { return b.CrossEntropy(in[0], in[1]); }));
}

void AddLayout(std::vector<OpCase>& out) {
  for (DType t : {DType::kF32, DType::kF16, DType::kI64}) {
    const InputSpec x = t == DType::kI64 ? Index("x", t, {4, 6}, -9, 9) : Normal("x", t, {4, 6});
    out.push_back(Make("reshape", absl::StrCat(DTypeName(t), " [4,6]->[2,12] (view)"), {x},
                       [](Builder& b, const V& in) {
                         return b.Contiguous(b.Reshape(in[0], {2, 12}));
                       }));
    out.push_back(Make(
        "reshape", absl::StrCat(DTypeName(t), " transposed->[24] (copy)"), {x},
        [](Builder& b, const V& in) { return b.Neg(b.Reshape(b.Transpose(in[0], 0, 1), {24})); }));
    out.push_back(
        Make("permute", absl::StrCat(DTypeName(t), " [2,3,4] perm=[2,0,1]"),
             {t == DType::kI64 ? Index("x", t, {2, 3, 4}, -9, 9) : Normal("x", t, {2, 3, 4})},
             [](Builder& b, const V& in) {
               return b.Contiguous(b.Permute(in[0], {2, 0, 1}));
             }));
    out.push_back(Make("slice", absl::StrCat(DTypeName(t), " [4,6] axis 1 [2,5)"), {x},
                       [](Builder& b, const V& in) { return b.Neg(b.Slice(in[0], 1, 2, 3)); }));
    out.push_back(Make("expand", absl::StrCat(DTypeName(t), " [4,1]->[4,6]"),
                       {t == DType::kI64 ? Index("x", t, {4, 1}, -9, 9) : Normal("x", t, {4, 1})},
                       [](Builder& b, const V& in) {
                         return b.Contiguous(b.Expand(in[0], {4, 6}));
                       }));
    out.push_back(
        Make("contiguous", absl::StrCat(DTypeName(t), " transposed [6,4]"), {x},
             [](Builder& b, const V& in) { return b.Contiguous(b.Transpose(in[0], 0, 1)); }));
  }
  for (DType t : {DType::kF32, DType::kF16, DType::kI32}) {
    auto in = [t](const char* n, std::vector<int64_t> s) {
      return t == DType::kI32 ? Index(n, t, std::move(s), -9, 9) : Normal(n, t, std::move(s));
    };
    out.push_back(Make("concat", absl::StrCat(DTypeName(t), " axis 1 [2,3]+[2,1]+[2,2]"),
                       {in("a", {2, 3}), in("b", {2, 1}), in("c", {2, 2})},
                       [](Builder& b, const V& v) { return b.Concat(v, 1); }));
    out.push_back(Make("concat", absl::StrCat(DTypeName(t), " axis 0 with a strided input"),
                       {in("a", {2, 3}), in("b", {3, 3})}, [](Builder& b, const V& v) {
                         return b.Concat({v[0], b.Transpose(v[1], 0, 1)}, 0);
                       }));
    // Rows of several inputs per thread and an input split between threads; rank 1.
    out.push_back(Make("concat", absl::StrCat(DTypeName(t), " axis 1 [5,2,3]+[5,4,3]+[5,1,3]"),
                       {in("a", {5, 2, 3}), in("b", {5, 4, 3}), in("c", {5, 1, 3})},
                       [](Builder& b, const V& v) { return b.Concat(v, 1); }));
    out.push_back(Make("concat", absl::StrCat(DTypeName(t), " rank 1 [7]+[2]"),
                       {in("a", {7}), in("b", {2})},
                       [](Builder& b, const V& v) { return b.Concat(v, 0); }));
  }
}

void AddIndexing(std::vector<OpCase>& out) {
  const std::vector<double> ids = {1, 9, 0, 4};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    out.push_back(Make("gather", absl::StrCat(DTypeName(t), " table [10,4] idx [4]"),
                       {Normal("table", t, {10, 4}), Custom("idx", DType::kI32, {4}, ids)},
                       [](Builder& b, const V& in) { return b.Gather(in[0], in[1]); }));
  }
  out.push_back(Make("gather", "f32 table [10,2,3] idx i64 [2,2] incl. out of range",
                     {Normal("table", DType::kF32, {10, 2, 3}),
                      Custom("idx", DType::kI64, {2, 2}, {3, 12, 0, -1})},
                     [](Builder& b, const V& in) { return b.Gather(in[0], in[1]); }));
  for (DType q : {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4}) {
    out.push_back(
        Make("gather", absl::StrCat(DTypeName(q), " table [5,64] -> f32"),
             {AsWeight(Normal("table", q, {5, 64})), Custom("idx", DType::kI32, {3}, {4, 0, 2})},
             [](Builder& b, const V& in) { return b.Gather(in[0], in[1]); }));
  }
  out.push_back(
      Make("gather", "q6_k table [3,256] -> f16",
           {Blocks("table", DType::kQ6_K, {3, 256}), Custom("idx", DType::kI32, {2}, {2, 1})},
           [](Builder& b, const V& in) { return b.Gather(in[0], in[1], DType::kF16); }));
  out.push_back(
      Make("scatter_add_rows", "f32 idx [4] with repeats -> [5,3]",
           {Custom("idx", DType::kI32, {4}, {1, 3, 1, 0}), Normal("src", DType::kF32, {4, 3})},
           [](Builder& b, const V& in) { return b.ScatterAddRows(in[0], in[1], 5); }));
  out.push_back(Make("scatter_add_rows", "f32 i64 idx [9], repeats and ids out of range -> [6,20]",
                     {Custom("idx", DType::kI64, {9}, {5, 0, -1, 5, 2, 6, 3, 5, 0}),
                      Normal("src", DType::kF32, {9, 20})},
                     [](Builder& b, const V& in) { return b.ScatterAddRows(in[0], in[1], 6); }));
  out.push_back(Make(
      "scatter_add_rows", "f16 idx [2,2] -> [3,2]",
      {Custom("idx", DType::kI64, {2, 2}, {2, 2, 7, 0}), Normal("src", DType::kF16, {2, 2, 2})},
      [](Builder& b, const V& in) { return b.ScatterAddRows(in[0], in[1], 3); }));
  for (DType t : {DType::kF32, DType::kF16, DType::kI32}) {
    out.push_back(Make("take_along", absl::StrCat(DTypeName(t), " [3,6] idx [3,2]"),
                       {t == DType::kI32 ? Index("x", t, {3, 6}, -9, 9) : Normal("x", t, {3, 6}),
                        Index("idx", DType::kI32, {3, 2}, 0, 6)},
                       [](Builder& b, const V& in) { return b.TakeAlong(in[0], in[1]); }));
  }
  out.push_back(Make("scatter_add_along", "f32 [3,3] -> [3,6] with repeats",
                     {Custom("idx", DType::kI32, {3, 3}, {0, 0, 5, 2, 1, 2, 4, 3, 9}),
                      Normal("src", DType::kF32, {3, 3})},
                     [](Builder& b, const V& in) { return b.ScatterAddAlong(in[0], in[1], 6); }));
  for (DType t : {DType::kF32, DType::kF16, DType::kI32}) {
    out.push_back(
        Make("top_k", absl::StrCat(DTypeName(t), " [4,9] k=3 values and indices"),
             {t == DType::kI32 ? Index("x", t, {4, 9}, -3, 3) : Normal("x", t, {4, 9})},
             [](Builder& b, const V& in) {
               auto [values, idx] = b.TopK(in[0], 3);
               return b.Concat({b.Cast(values, DType::kF32), b.Cast(idx, DType::kF32)}, 1);
             }));
  }
  out.push_back(Make("top_k", "f32 [2,5] k=5 i64 with NaN",
                     {Custom("x", DType::kF32, {2, 5}, {1, NAN, 3, 3, -1, 0, 0, 2, 0, 1})},
                     [](Builder& b, const V& in) { return b.TopK(in[0], 5, DType::kI64).second; }));
}

void AddLinear(std::vector<OpCase>& out, bool full) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    out.push_back(Make("matmul", absl::StrCat(DTypeName(t), " [2,3,5]x[2,5,4]"),
                       {Normal("a", t, {2, 3, 5}), Normal("b", t, {2, 5, 4})},
                       [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  }
  out.push_back(Make("matmul", "f32 broadcast [3,5]x[2,5,4]",
                     {Normal("a", DType::kF32, {3, 5}), Normal("b", DType::kF32, {2, 5, 4})},
                     [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  out.push_back(
      Make("matmul", "f32 transposed rhs [3,5]x[4,5]^T",
           {Normal("a", DType::kF32, {3, 5}), Normal("b", DType::kF32, {4, 5})},
           [](Builder& b, const V& in) { return b.MatMul(in[0], b.Transpose(in[1], 0, 1)); }));
  if (full) {
    out.push_back(Make("matmul", "f32 [64,128]x[128,96]",
                       {Normal("a", DType::kF32, {64, 128}), Normal("b", DType::kF32, {128, 96})},
                       [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  }
  // A frozen weight as matmul's right operand, read as it is (autograd's dx = g w for linear):
  // blocks along N; several panels and threads in the full case.
  for (DType w :
       {DType::kF16, DType::kBF16, DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4}) {
    out.push_back(Make("matmul", absl::StrCat("f32 [3,5]x", DTypeName(w), " weight [5,64]"),
                       {Normal("a", DType::kF32, {3, 5}), AsWeight(Normal("w", w, {5, 64}, 0.5))},
                       [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
    if (full) {
      out.push_back(
          Make("matmul", absl::StrCat("f32 [9,1100]x", DTypeName(w), " weight [1100,160]"),
               {Normal("a", DType::kF32, {9, 1100}), AsWeight(Normal("w", w, {1100, 160}, 0.5))},
               [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
    }
  }
  out.push_back(
      Make("matmul", "f32 [2,64]xq8_0 weight [64,288]",
           {Normal("a", DType::kF32, {2, 64}), AsWeight(Normal("w", DType::kQ8_0, {64, 288}, 0.5))},
           [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  for (DType w : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ4_0, DType::kQ4_1, DType::kQ8_0,
                  DType::kMXFP4}) {
    out.push_back(Make("linear", absl::StrCat("f32 x [3,64], ", DTypeName(w), " w [5,64]"),
                       {Normal("x", DType::kF32, {3, 64}), AsWeight(Normal("w", w, {5, 64}, 0.5))},
                       [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  }
  // Prefill-sized: devices with a BLAS convert such weights for a GEMM from 32 rows on
  // (backends/common/device_kernels.h).
  for (DType w : {DType::kF16, DType::kBF16, DType::kQ4_1, DType::kQ8_0}) {
    out.push_back(
        Make("linear", absl::StrCat("f32 x [40,64], ", DTypeName(w), " w [24,64]"),
             {Normal("x", DType::kF32, {40, 64}), AsWeight(Normal("w", w, {24, 64}, 0.5))},
             [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  }
  // Decode-shaped (GPUs run a warp per weight row): one row with K of 18 blocks, fewer than a
  // warp's lanes; five rows (four per launch row, then one) with K of 48 blocks, more than the
  // lanes; odd N.
  for (DType w : {DType::kF16, DType::kBF16, DType::kQ4_0, DType::kQ4_1, DType::kQ8_0}) {
    out.push_back(
        Make("linear", absl::StrCat("f32 x [1,576], ", DTypeName(w), " w [37,576]"),
             {Normal("x", DType::kF32, {1, 576}), AsWeight(Normal("w", w, {37, 576}, 0.5))},
             [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
    out.push_back(
        Make("linear", absl::StrCat("f32 x [5,1536], ", DTypeName(w), " w [9,1536]"),
             {Normal("x", DType::kF32, {5, 1536}), AsWeight(Normal("w", w, {9, 1536}, 0.5))},
             [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  }
  out.push_back(Make("linear", "f32 x [1,1536], q4_k w [5,1536]",
                     {Normal("x", DType::kF32, {1, 1536}), Blocks("w", DType::kQ4_K, {5, 1536})},
                     [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  for (DType w : {DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    out.push_back(Make("linear", absl::StrCat("f32 x [2,256], ", DTypeName(w), " w [3,256]"),
                       {Normal("x", DType::kF32, {2, 256}), Blocks("w", w, {3, 256})},
                       [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  }
  out.push_back(
      Make("linear", "f16 x [2,3,64], q8_0 w [4,64], f16 bias",
           {Normal("x", DType::kF16, {2, 3, 64}), AsWeight(Normal("w", DType::kQ8_0, {4, 64})),
            Normal("bias", DType::kF16, {4})},
           [](Builder& b, const V& in) { return b.Linear(in[0], in[1], in[2]); }));
}

void AddRope(std::vector<OpCase>& out) {
  struct Variant {
    const char* name;
    RopeParams p;
  };
  RopeParams neox;
  RopeParams inter;
  inter.layout = RopeParams::Layout::kInterleaved;
  RopeParams linear;
  linear.scaling = RopeParams::Scaling::kLinear;
  linear.factor = 2;
  RopeParams llama3;
  llama3.scaling = RopeParams::Scaling::kLlama3;
  llama3.theta = 500000;
  llama3.factor = 8;
  llama3.low_freq_factor = 1;
  llama3.high_freq_factor = 4;
  llama3.original_max_position = 8192;
  RopeParams partial;
  partial.rotary_dim = 4;
  partial.layout = RopeParams::Layout::kInterleaved;
  const Variant variants[] = {{"neox", neox},
                              {"interleaved", inter},
                              {"linear", linear},
                              {"llama3", llama3},
                              {"partial", partial}};
  for (const Variant& v : variants) {
    for (DType t : {DType::kF32, DType::kF16}) {
      out.push_back(
          Make("rope", absl::StrCat(v.name, " ", DTypeName(t), " [4,2,8]"),
               {Normal("x", t, {4, 2, 8}), Custom("pos", DType::kI32, {4}, {0, 1, 5000, 3000})},
               [p = v.p](Builder& b, const V& in) { return b.Rope(in[0], in[1], p); }));
    }
  }
  // Prefill's q and k: slices of heads of the joined q|k|v projection, strided by token.
  out.push_back(
      Make("rope", "neox f32 [4,2,8] sliced from [4,5,8] (heads 1-2)",
           {Normal("x", DType::kF32, {4, 5, 8}), Custom("pos", DType::kI32, {4}, {0, 1, 5000, 3})},
           [](Builder& b, const V& in) { return b.Rope(b.Slice(in[0], 1, 1, 2), in[1], {}); }));
  out.push_back(
      Make("rope", "neox f32 batched [2,3,2,8]",
           {Normal("x", DType::kF32, {2, 3, 2, 8}), Index("pos", DType::kI64, {2, 3}, 0, 50)},
           [](Builder& b, const V& in) { return b.Rope(in[0], in[1], RopeParams{}); }));
}

void AddAttention(std::vector<OpCase>& out) {
  // f32 and f16, and f32 with the log-sum-exp output (compared too: every output of the node).
  for (const AttnVariant& v : AttentionVariants()) {
    for (const auto& [t, lse] : {std::pair{DType::kF32, false}, std::pair{DType::kF16, false},
                                 std::pair{DType::kF32, true}}) {
      std::vector<InputSpec> in = {Normal("q", t, {2, 4, 5, 8}), Normal("k", t, {2, 2, 5, 8}),
                                   Normal("v", t, {2, 2, 5, 8})};
      const bool aux = AddAttnAux(v, 2, in);
      out.push_back(Make(
          "attention",
          absl::StrCat(v.name, " ", DTypeName(t), lse ? " with lse" : "", " GQA 4/2 [2,4,5,8]"), in,
          [p = v.params, aux, lse](Builder& b, const V& x) {
            std::vector<Value> ax;
            if (aux) ax.push_back(x[3]);
            if (lse) return b.AttentionWithLse(x[0], x[1], x[2], p, ax).out;
            return b.Attention(x[0], x[1], x[2], p, ax);
          }));
    }
  }
  out.push_back(
      Make("attention", "unmasked f32 Tq<Tk, Dv!=D [1,2,3,4]",
           {Normal("q", DType::kF32, {1, 2, 3, 4}), Normal("k", DType::kF32, {1, 2, 6, 4}),
            Normal("v", DType::kF32, {1, 2, 6, 3})},
           [](Builder& b, const V& x) { return b.Attention(x[0], x[1], x[2], {}); }));
  // The decomposition the backward rule differentiates, side by side with the fused op (their
  // equality is asserted in engine/attention_test.cc).
  out.push_back(
      Make("attention", "fused and decomposed side by side (causal GQA f32)",
           {Normal("q", DType::kF32, {1, 4, 5, 8}), Normal("k", DType::kF32, {1, 2, 5, 8}),
            Normal("v", DType::kF32, {1, 2, 5, 8})},
           [](Builder& b, const V& x) {
             AttentionParams p;
             p.mask_mod = attn::CausalMask();
             const Value fused = b.Attention(x[0], x[1], x[2], p);
             const Value dec = AttentionDecomposed(b, x[0], x[1], x[2], b.node(fused).attrs, {});
             return b.Concat({fused, b.Sub(fused, dec)}, 3);
           }));

  out.push_back(
      Make("attention", "causal f16 with lse (f32 lse) [1,2,6,4]",
           {Normal("q", DType::kF16, {1, 2, 6, 4}), Normal("k", DType::kF16, {1, 2, 6, 4}),
            Normal("v", DType::kF16, {1, 2, 6, 4})},
           [](Builder& b, const V& x) {
             return b.AttentionWithLse(x[0], x[1], x[2], {0, attn::CausalMask(), {}}).out;
           }));
  // Rows 2.. see no key: output 0, lse -inf.
  out.push_back(
      Make("attention", "f32 with lse, fully masked rows, Tk > wg [1,2,4,4]x[1,1,80,4]",
           {Normal("q", DType::kF32, {1, 2, 4, 4}), Normal("k", DType::kF32, {1, 1, 80, 4}),
            Normal("v", DType::kF32, {1, 1, 80, 3})},
           [](Builder& b, const V& x) {
             const Expr mask = Lt(Expr::Index(2), Expr::Int(2));
             return b.AttentionWithLse(x[0], x[1], x[2], {0, mask, {}}).out;
           }));

  // Training attention (ForwardContext::AttendTrain, small): the forward with its lse, and
  // attention_backward from them, across the cpu kernels' 64-row tiles.
  for (const TrainAttnShape& t : TrainAttnShapes()) {
    for (bool backward : {false, true}) {
      std::vector<InputSpec> in = {Normal("q", DType::kF32, {t.B, t.hq, t.L, t.D}),
                                   Normal("k", DType::kF32, {t.B, t.hkv, t.L, t.D}),
                                   Normal("v", DType::kF32, {t.B, t.hkv, t.L, t.D}),
                                   Normal("do", DType::kF32, {t.B, t.hq, t.L, t.D})};
      // i64 ids for one shape (kernels read both widths).
      const DType ids = t.L == 130 ? DType::kI64 : DType::kI32;
      if (t.docs) in.push_back(Custom("docs", ids, {t.B * t.L}, DocIds(t.B, t.L)));
      if (!t.prefix.empty()) in.push_back(Custom("prefix", DType::kI32, {t.B}, t.prefix));
      out.push_back(Make(
          backward ? "attention_backward" : "attention",
          absl::StrCat("training ", t.name, backward ? "" : " with lse"), in,
          [p = t.params, aux = t.docs || !t.prefix.empty(), backward, q_n = t.B * t.hq * t.L * t.D,
           kv_n = t.B * t.hkv * t.L * t.D](Builder& b, const V& x) {
            std::vector<Value> ax;
            if (aux) ax.push_back(x[4]);
            const AttentionOutputs r = b.AttentionWithLse(x[0], x[1], x[2], p, ax);
            if (!backward) return r.out;
            // dq, dk and dv, all compared.
            const AttentionGrads g =
                b.AttentionBackward(x[0], x[1], x[2], r.out, x[3], r.lse, p, ax);
            return b.Concat(
                {b.Reshape(g.dq, {q_n}), b.Reshape(g.dk, {kv_n}), b.Reshape(g.dv, {kv_n})}, 0);
          }));
    }
  }

  // attention_backward in half precisions (computed in f32, as the forward).
  for (DType t : {DType::kF16, DType::kBF16}) {
    out.push_back(Make("attention_backward",
                       absl::StrCat("causal GQA 3/1 ", DTypeName(t), " [1,3,9,8]"),
                       {Normal("q", t, {1, 3, 9, 8}), Normal("k", t, {1, 1, 9, 8}),
                        Normal("v", t, {1, 1, 9, 8}), Normal("do", t, {1, 3, 9, 8})},
                       [](Builder& b, const V& x) {
                         const AttentionParams p{0, attn::CausalMask(), {}};
                         const AttentionOutputs r = b.AttentionWithLse(x[0], x[1], x[2], p);
                         return b.AttentionBackward(x[0], x[1], x[2], r.out, x[3], r.lse, p).dq;
                       }));
  }

  struct Paged {
    const char* name;
    DType q, cache;
    int64_t hq, hkv;
    AttentionParams p;
  };
  const Paged paged[] = {
      {"causal GQA 4/2 f32", DType::kF32, DType::kF32, 4, 2, {0, attn::CausalMask(), {}}},
      {"causal MHA f16 cache", DType::kF32, DType::kF16, 2, 2, {0, attn::CausalMask(), {}}},
      {"causal f8e4m3 cache", DType::kF32, DType::kF8E4M3, 4, 2, {0, attn::CausalMask(), {}}},
      {"f16 q and cache", DType::kF16, DType::kF16, 4, 1, {0, attn::CausalMask(), {}}},
      {"sliding window 3", DType::kF32, DType::kF32, 4, 2, {0, attn::SlidingWindowMask(3), {}}},
      {"softcap", DType::kF32, DType::kBF16, 4, 2, {0, attn::CausalMask(), attn::SoftCapScore(3)}},
      {"sliding window 3 + softcap (Gemma 2)",
       DType::kF32,
       DType::kF16,
       4,
       2,
       {0, attn::SlidingWindowMask(3), attn::SoftCapScore(2)}},
      {"alibi then softcap",
       DType::kF32,
       DType::kF32,
       4,
       4,
       {0, attn::CausalMask(), attn::Then(attn::AlibiScore(4), attn::SoftCapScore(2))}},
      {"chunked 2", DType::kF32, DType::kF32, 4, 2, {0, attn::ChunkedMask(2), {}}},
      {"alibi", DType::kF32, DType::kF32, 4, 4, {0, attn::CausalMask(), attn::AlibiScore(4)}},
      {"unmasked", DType::kF32, DType::kF32, 4, 2, {0, {}, {}}},
  };
  for (const Paged& pc : paged) {
    out.push_back(Make("paged_attention", absl::StrCat(pc.name, " (prefill 5 + decode 1 + pad)"),
                       PagedInputs(pc.q, pc.cache, pc.hq, pc.hkv, 8),
                       [p = pc.p](Builder& b, const V& x) {
                         return b.PagedAttention(x[0], x[1], x[2], x[3], x[4], x[5], p);
                       }));
  }
  // A relative position bias table through an aux tensor, on the paged path (paged q_idx and
  // kv_idx are positions: the table sees real distances).
  {
    std::vector<InputSpec> in = PagedInputs(DType::kF32, DType::kF16, 4, 2, 4);
    in.push_back(Normal("rel_bias", DType::kF32, {4 * 5}));
    out.push_back(Make("paged_attention", "relative bias table via aux (f16 cache)", in,
                       [](Builder& b, const V& x) {
                         const Value aux[] = {x[6]};
                         return b.PagedAttention(
                             x[0], x[1], x[2], x[3], x[4], x[5],
                             {0, attn::CausalMask(), attn::RelativeBiasScore(0, 2)}, aux);
                       }));
  }
  // Prefix-LM through an aux tensor, on the paged path.
  {
    std::vector<InputSpec> in = PagedInputs(DType::kF32, DType::kF32, 2, 2, 4);
    in.push_back(Custom("prefix_len", DType::kI32, {2}, {3, 2}));
    out.push_back(Make("paged_attention", "prefix-LM via aux", in, [](Builder& b, const V& x) {
      const Value aux[] = {x[6]};
      return b.PagedAttention(x[0], x[1], x[2], x[3], x[4], x[5], {0, attn::PrefixLmMask(0), {}},
                              aux);
    }));
  }
  for (DType cache : {DType::kF32, DType::kF16, DType::kF8E5M2}) {
    out.push_back(
        Make("kv_write", absl::StrCat("f32 rows -> ", DTypeName(cache), " cache, slot -1 skipped"),
             {AsState(Normal("cache", cache, {4, 2, 2, 3})), Normal("x", DType::kF32, {3, 2, 3}),
              Custom("slots", DType::kI32, {3}, {5, -1, 0})},
             [](Builder& b, const V& x) { return b.KvWrite(x[0], x[1], x[2]); }));
  }
  // Prefill's v: a slice of heads of the joined q|k|v projection, strided by token.
  out.push_back(
      Make("kv_write", "f32 rows sliced from [3,5,3] (heads 3-4) -> f32 cache",
           {AsState(Normal("cache", DType::kF32, {4, 2, 2, 3})),
            Normal("x", DType::kF32, {3, 5, 3}), Custom("slots", DType::kI32, {3}, {5, -1, 0})},
           [](Builder& b, const V& x) { return b.KvWrite(x[0], b.Slice(x[1], 1, 3, 2), x[2]); }));
}

// Fused cross-entropy (loss and dlogits) and the optimizers (param and states updated in
// place): every output of the node is compared.
void AddTraining(std::vector<OpCase>& out) {
  auto fused_ce = [](Builder& b, const V& in) {
    return b.FusedCrossEntropy(in[0], in[1], in[2]).loss;
  };
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    out.push_back(Make("fused_cross_entropy",
                       absl::StrCat(DTypeName(t), " [6,11] with ignore_index"),
                       {Normal("logits", t, {6, 11}, 3),
                        Custom("targets", DType::kI32, {6}, {3, -100, 10, 0, 5, 7}),
                        Uniform("dloss", t, {6}, 0.5, 2)},
                       fused_ce));
  }
  out.push_back(
      Make("fused_cross_entropy", "f32 [3,300] (rows longer than a work-group)",
           {Normal("logits", DType::kF32, {3, 300}, 3), Index("targets", DType::kI64, {3}, 0, 300),
            Uniform("dloss", DType::kF32, {3}, 0.5, 2)},
           fused_ce));
  out.push_back(Make("fused_cross_entropy",
                     "f32 [2,2,2500] (rows over several 1,024-element chunks), scalar dloss",
                     {Normal("logits", DType::kF32, {2, 2, 2500}, 4),
                      Custom("targets", DType::kI32, {2, 2}, {2499, -100, 0, 1500}),
                      Custom("dloss", DType::kF32, {}, {0.5})},
                     fused_ce));
  out.push_back(Make("fused_cross_entropy", "f32 [2,3,5] transposed logits, scalar dloss",
                     {Normal("logits", DType::kF32, {3, 2, 5}),
                      Custom("targets", DType::kI32, {2, 3}, {0, 4, -100, 2, 7, 1}),
                      Custom("dloss", DType::kF32, {}, {0.25})},
                     [](Builder& b, const V& in) {
                       return b.FusedCrossEntropy(b.Transpose(in[0], 0, 1), in[1], in[2]).loss;
                     }));
  // Optimizers: inputs param, grad, hyper {step, lr, grad_scale}, then the states, then an
  // optional graph grad_scale; the param (output 0) and every state are compared.
  auto optimizer = [](OptimizerParams p, bool transpose_grad = false) {
    return [p, transpose_grad](Builder& b, const V& in) {
      const size_t states = OptimizerStateNames(p).size();
      const Value grad = transpose_grad ? b.Transpose(in[1], 0, 1) : in[1];
      const Value scale = in.size() > 3 + states ? in.back() : Value{};
      return b
          .OptimizerStep(in[0], grad, std::span<const Value>(in).subspan(3, states), in[2], scale,
                         p)
          .param;
    };
  };
  // param, grad, hyper, then `states` state tensors (m-like ones signed, the last positive).
  auto inputs = [](std::vector<int64_t> shape, int states, std::vector<double> hyper,
                   DType grad_t = DType::kF32, DType hyper_t = DType::kF32) {
    std::vector<InputSpec> in = {AsState(Normal("param", DType::kF32, shape)),
                                 Normal("grad", grad_t, shape),
                                 Custom("hyper", hyper_t, {3}, std::move(hyper))};
    if (states == 2) in.push_back(AsState(Normal("m", DType::kF32, shape, 0.1)));
    if (states >= 1) in.push_back(AsState(Uniform("v", DType::kF32, shape, 0, 0.05)));
    return in;
  };
  auto with = [](OptimizerKind k, auto set) {
    OptimizerParams p = DefaultOptimizerParams(k);
    set(p);
    return p;
  };
  const OptimizerParams adamw = DefaultOptimizerParams(OptimizerKind::kAdamW);
  out.push_back(
      Make("adamw", "f32 [4,33] step 3", inputs({4, 33}, 2, {3, 1e-3, 1}), optimizer(adamw)));
  {
    std::vector<InputSpec> in = inputs({7}, 2, {1, 0.1, 2}, DType::kF16, DType::kF64);
    in.push_back(Custom("grad_scale", DType::kF32, {}, {0.25}));
    out.push_back(Make("adamw", "f16 grad, step 1, f64 hyper, graph grad_scale [7]", in,
                       optimizer(with(OptimizerKind::kAdamW, [](OptimizerParams& p) {
                         p.beta1 = 0.8;
                         p.beta2 = 0.95;
                         p.eps = 1e-6;
                         p.weight_decay = 0;
                       }))));
  }
  {
    std::vector<InputSpec> in = inputs({5, 6}, 2, {1000, 1e-2, 0.5});
    in[1] = Normal("grad", DType::kF32, {6, 5});
    out.push_back(Make("adamw", "transposed grad, step 1000 [5,6]", in, optimizer(adamw, true)));
  }
  out.push_back(Make(
      "adam", "f32 [3,17] step 4, L2 weight decay", inputs({3, 17}, 2, {4, 1e-2, 1}),
      optimizer(with(OptimizerKind::kAdam, [](OptimizerParams& p) { p.weight_decay = 0.1; }))));
  {
    std::vector<InputSpec> in = inputs({9}, 2, {1, 1e-2, 1}, DType::kBF16);
    in.push_back(Custom("grad_scale", DType::kF32, {}, {0.5}));
    out.push_back(Make("adam", "bf16 grad, step 1, graph grad_scale [9]", in,
                       optimizer(DefaultOptimizerParams(OptimizerKind::kAdam))));
  }
  auto sgd = [&](double momentum, double dampening, double wd, bool nesterov) {
    return with(OptimizerKind::kSgd, [=](OptimizerParams& p) {
      p.momentum = momentum;
      p.dampening = dampening;
      p.weight_decay = wd;
      p.nesterov = nesterov;
    });
  };
  out.push_back(Make("sgd", "momentum 0.9, dampening 0.1, weight decay, step 3 [4,33]",
                     inputs({4, 33}, 1, {3, 0.05, 1}), optimizer(sgd(0.9, 0.1, 0.01, false))));
  out.push_back(Make("sgd", "nesterov, step 2 [10]", inputs({10}, 1, {2, 0.05, 0.5}),
                     optimizer(sgd(0.9, 0, 0, true))));
  out.push_back(Make("sgd", "momentum, step 1 (buffer = grad) [10]", inputs({10}, 1, {1, 0.05, 1}),
                     optimizer(sgd(0.5, 0.3, 0.1, false))));
  {
    std::vector<InputSpec> in = inputs({3, 5}, 0, {7, 0.1, 1}, DType::kF16);
    in.push_back(Custom("grad_scale", DType::kF16, {}, {0.5}));
    out.push_back(Make("sgd", "no momentum (no state), f16 grad and grad_scale [3,5]", in,
                       optimizer(sgd(0, 0, 0.01, false))));
  }
  out.push_back(Make("adagrad", "lr_decay, weight decay, step 5 [4,33]",
                     inputs({4, 33}, 1, {5, 0.1, 1}),
                     optimizer(with(OptimizerKind::kAdagrad, [](OptimizerParams& p) {
                       p.lr_decay = 0.01;
                       p.weight_decay = 0.1;
                       p.initial_accumulator_value = 0.1;
                     }))));
  out.push_back(
      Make("adagrad", "step 1 (sum = initial_accumulator_value) [8]", inputs({8}, 1, {1, 0.1, 2}),
           optimizer(with(OptimizerKind::kAdagrad,
                          [](OptimizerParams& p) { p.initial_accumulator_value = 0.5; }))));
}

// The sampling stage: every row a different configuration (engine/sampling.h), every output
// compared (tokens and top ids exactly).
void AddSampling(std::vector<OpCase>& out) {
  auto row = [](float temperature, int32_t top_k, float top_p, float min_p, float rp,
                float presence, float frequency, int32_t logprobs) {
    sampling::RowParams p{temperature, top_k, top_p, min_p, rp, presence, frequency, logprobs};
    float r[sampling::kNumParams];
    sampling::PackParams(p, r);
    return std::vector<double>(r, r + sampling::kNumParams);
  };
  auto params = [](std::vector<std::vector<double>> rows) {
    std::vector<double> v;
    for (const auto& r : rows) v.insert(v.end(), r.begin(), r.end());
    const int64_t n = static_cast<int64_t>(rows.size());
    return Custom("params", DType::kF32, {n, sampling::kNumParams}, v);
  };
  auto sample = [](Builder& b, const V& in) {
    return b.Sample(in[0], in[1], in[2], in[3], in[4], in[5]).token;
  };
  out.push_back(Make(
      "sample", "f32 [8,64]: greedy, temperature, top-k, top-p, min-p, penalties, bans, logprobs",
      {Normal("logits", DType::kF32, {8, 64}, 2),
       params({row(0, 0, 1, 0, 1, 0, 0, -1), row(1, 0, 1, 0, 1, 0, 0, 3),
               row(0.7f, 5, 1, 0, 1, 0, 0, -1), row(1.2f, 0, 0.8f, 0, 1, 0, 0, 2),
               row(1, 10, 0.9f, 0.05f, 1, 0, 0, -1), row(0.9f, 0, 1, 0.2f, 1, 0, 0, 20),
               row(1, 0, 1, 0, 1.3f, 0.5f, 0.4f, 0), row(0, 0, 1, 0, 2, 1, 0, 5)}),
       Uniform("uniform", DType::kF64, {8}, 0, 1),
       Custom(
           "penalty_tokens", DType::kI32, {8, 3},
           {-1, -1, -1, 1, 2, -1, 3, -1, -1, 4, 5, 6, -1, -1, -1, 7, 8, 9, 10, 11, 12, 13, 63, 99}),
       Custom("penalty_counts", DType::kI32, {8, 3},
              {0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 1, 3, 0, 0, 0, 1, 1, 1, 0, 2, 5, 3, 1, 1}),
       Custom("banned", DType::kI32, {8, 2},
              {-1, -1, 0, -1, 1, 2, -1, -1, 3, -1, -1, -1, 4, 5, 62, 63})},
      sample));
  // With logit_bias (the optional 7th input): biases on penalized tokens, tokens listed for
  // their bias only (count -1), a +100 bias that decides greedy rows and a -100 one that
  // removes the likeliest candidate.
  out.push_back(
      Make("sample", "f32 [6,64] with logit bias: greedy, temperature, top-k, penalties, logprobs",
           {Normal("logits", DType::kF32, {6, 64}, 2),
            params({row(0, 0, 1, 0, 1, 0, 0, -1), row(1, 0, 1, 0, 1, 0, 0, 3),
                    row(0.7f, 5, 1, 0, 1, 0, 0, -1), row(1, 0, 1, 0, 1.3f, 0.5f, 0.4f, 2),
                    row(0, 0, 1, 0, 2, 1, 0, 5), row(1.2f, 0, 0.9f, 0, 1, 0, 0, 1)}),
            Uniform("uniform", DType::kF64, {6}, 0, 1),
            Custom("penalty_tokens", DType::kI32, {6, 3},
                   {17, -1, -1, 1, 2, 40, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 63, 99}),
            Custom("penalty_counts", DType::kI32, {6, 3},
                   {-1, 0, 0, 1, -1, -1, 0, 2, -1, 3, 0, -1, 1, -1, 2, -1, -1, 0}),
            Custom("banned", DType::kI32, {6, 1}, {-1, -1, 0, -1, 9, -1}),
            Custom("penalty_bias", DType::kF32, {6, 3},
                   {100, 0, 0, -2, 5, 3, -100, 1.5, 2, 0.5, -0.5, 4, -1, 100, 7, 1, -3, 0})},
           [](Builder& b, const std::vector<Value>& in) {
             return b.Sample(in[0], in[1], in[2], in[3], in[4], in[5], in[6]).token;
           }));
  // Nearly flat logits: top-p 0.99 needs most of the vocabulary (the candidate set grows past
  // its first 256), and logprobs over a larger row.
  out.push_back(Make("sample", "f32 [3,1000] flat: top-p growing past 256, top-k 300, logprobs",
                     {Normal("logits", DType::kF32, {3, 1000}, 0.05),
                      params({row(1.5f, 0, 0.99f, 0, 1, 0, 0, 20),
                              row(1, 300, 0.995f, 0, 1, 0, 0, 1), row(0, 0, 1, 0, 1, 0, 0, 20)}),
                      Uniform("uniform", DType::kF64, {3}, 0, 1),
                      Custom("penalty_tokens", DType::kI32, {3, 0}, {}),
                      Custom("penalty_counts", DType::kI32, {3, 0}, {}),
                      Custom("banned", DType::kI32, {3, 0}, {})},
                     sample));

  // One plain greedy row over 5,000 logits (the cpu backend splits its argmax over threads):
  // the maximum tied at 1200 and 4300 (the first wins), NaNs at the start of the later slices
  // and inside them; then a row whose first logit is NaN (max_element keeps it: token 0).
  for (const bool nan_first : {false, true}) {
    std::vector<double> logits(5000);
    for (int64_t i = 0; i < 5000; ++i) logits[i] = std::sin(0.61 * static_cast<double>(i));
    logits[1200] = logits[4300] = 3.5;
    for (int64_t i : {1250, 2500, 3333, 3750, 4999}) logits[i] = std::nan("");
    if (nan_first) logits[0] = std::nan("");
    out.push_back(
        Make("sample",
             absl::StrCat("f32 [1,5000] plain greedy: ties, NaNs", nan_first ? ", NaN first" : ""),
             {Custom("logits", DType::kF32, {1, 5000}, logits),
              params({row(0, 0, 1, 0, 1, 0, 0, -1)}), Uniform("uniform", DType::kF64, {1}, 0, 1),
              Custom("penalty_tokens", DType::kI32, {1, 2}, {7, -1}),
              Custom("penalty_counts", DType::kI32, {1, 2}, {1, 0}),
              Custom("banned", DType::kI32, {1, 1}, {-1})},
             sample));
  }

  // With the allowed-token mask (the optional 8th input, bit t % 32 of word t / 32): random
  // masks on greedy and drawn rows, a +100 bias on a masked token, a single allowed token, an
  // unconstrained row, rows with nothing allowed (token -1, logprob 0), and logprobs that stay
  // those of the raw logits. Every row sets its last word's bits past the vocabulary (ignored).
  auto masks = [](int64_t rows, int64_t vocab, uint32_t seed,
                  const std::vector<std::pair<int64_t, std::vector<int32_t>>>& fixed) {
    const int64_t words = sampling::AllowedWords(vocab);
    std::mt19937 rng(seed);
    std::vector<double> v;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<uint32_t> w(words);
      bool is_fixed = false;
      for (const auto& [row, tokens] : fixed) {
        if (row != r) continue;
        is_fixed = true;
        for (int32_t t : tokens) {
          if (t < 0) {
            std::fill(w.begin(), w.end(), 0xFFFFFFFFu);  // -1: every token
          } else {
            w[t / 32] |= 1u << (t % 32);
          }
        }
      }
      if (!is_fixed) {
        for (uint32_t& x : w) x = static_cast<uint32_t>(rng());
      }
      if (vocab % 32 != 0) w.back() |= ~0u << (vocab % 32);  // junk past the vocabulary
      for (uint32_t x : w) v.push_back(static_cast<double>(static_cast<int32_t>(x)));
    }
    return v;
  };
  out.push_back(Make(
      "sample",
      "f32 [9,100] with allowed: random masks, one token, all, none; greedy and drawn, logprobs",
      {Normal("logits", DType::kF32, {9, 100}, 2),
       params({row(0, 0, 1, 0, 1, 0, 0, 5), row(1, 0, 1, 0, 1, 0, 0, 3),
               row(0.8f, 5, 1, 0, 1, 0, 0, -1), row(1.1f, 0, 0.9f, 0.05f, 1.2f, 0.3f, 0, 2),
               row(1, 0, 1, 0, 1, 0, 0, 2), row(0, 10, 1, 0, 1, 0, 0, -1),
               row(1.2f, 0, 1, 0.1f, 1, 0, 0, 4), row(1, 0, 0.9f, 0, 1, 0, 0, 4),
               row(0, 0, 1, 0, 1, 0, 0, 1)}),
       Uniform("uniform", DType::kF64, {9}, 0, 1),
       Custom("penalty_tokens", DType::kI32, {9, 2},
              {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18}),
       Custom("penalty_counts", DType::kI32, {9, 2},
              {-1, -1, 1, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}),
       Custom("banned", DType::kI32, {9, 1}, {-1, 4, -1, -1, -1, 50, 0, -1, -1}),
       Custom("penalty_bias", DType::kF32, {9, 2},
              {100, 100, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}),
       Custom("allowed", DType::kI32, {9, 4},
              masks(9, 100, 7,
                    {{0, {0, 3, 17, 40, 63, 64, 99}},  // +100 on the masked 1 and 2
                     {4, {77}},
                     {5, {3}},
                     {6, {-1}},
                     {7, {}},
                     {8, {}}}))},
      [](Builder& b, const V& in) {
        return b.Sample(in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7]).token;
      }));
  // A larger vocabulary (1000: 32 words, the last one partly past it), flat logits so top-p
  // needs many candidates, half the tokens masked; no penalty_bias (the builder passes zeros).
  out.push_back(Make(
      "sample", "f32 [4,1000] with allowed, no bias: top-p past 256, top-k 300, logprobs",
      {Normal("logits", DType::kF32, {4, 1000}, 0.05),
       params({row(1.5f, 0, 0.99f, 0, 1, 0, 0, 20), row(1, 300, 0.995f, 0, 1, 0, 0, 1),
               row(0, 0, 1, 0, 1, 0, 0, 20), row(1, 0, 1, 0, 1, 0, 0, 3)}),
       Uniform("uniform", DType::kF64, {4}, 0, 1),
       Custom("penalty_tokens", DType::kI32, {4, 0}, {}),
       Custom("penalty_counts", DType::kI32, {4, 0}, {}), Custom("banned", DType::kI32, {4, 0}, {}),
       Custom("allowed", DType::kI32, {4, 32}, masks(4, 1000, 11, {{3, {999}}}))},
      [](Builder& b, const V& in) {
        return b.Sample(in[0], in[1], in[2], in[3], in[4], in[5], Value{}, in[6]).token;
      }));
}

}  // namespace

std::vector<OpCase> ForwardCases(bool full) {
  std::vector<OpCase> out;
  AddPointwise(out, full);
  AddReductions(out, full);
  AddRows(out, full);
  AddLayout(out);
  AddIndexing(out);
  AddLinear(out, full);
  AddRope(out);
  AddAttention(out);
  AddTraining(out);
  AddSampling(out);
  return out;
}

std::vector<OpCase> GradientCases(bool full) {
  const DType d = DType::kF64;
  std::vector<OpCase> out;
  for (const UnaryOp& u : kUnary) {
    out.push_back(Make(u.name, "f64 [3,4]", {UnaryInput(u, d, {3, 4})},
                       [fn = u.fn](Builder& b, const V& in) { return (b.*fn)(in[0]); }));
  }
  for (bool tanh : {true, false}) {
    out.push_back(Make(tanh ? "gelu_tanh" : "gelu_erf", "f64 [3,4]", {Normal("x", d, {3, 4}, 2)},
                       [tanh](Builder& b, const V& in) { return b.Gelu(in[0], tanh); }));
  }
  out.push_back(Make("clamp", "f64 [3,4]", {Normal("x", d, {3, 4})},
                     [](Builder& b, const V& in) { return b.Clamp(in[0], -0.5, 0.7); }));
  {
    OpCase c =
        Make("cast", "f64->f32->f64 [3,4]", {Normal("x", d, {3, 4})}, [](Builder& b, const V& in) {
          return b.Cast(b.Exp(b.Cast(in[0], DType::kF32)), DType::kF64);
        });
    c.grad_eps = 1e-2;
    c.grad_tol = 1e-4;
    out.push_back(c);
  }
  for (const BinaryOp& op : kArith) {
    out.push_back(Make(op.name, "f64 broadcast [3,4]x[4]",
                       {Normal("x", d, {3, 4}), Uniform("y", d, {4}, 0.5, 2)},
                       [fn = op.fn](Builder& b, const V& in) { return (b.*fn)(in[0], in[1]); }));
  }
  out.push_back(Make("pow", "f64 [3,4]", {Uniform("x", d, {3, 4}, 0.3, 2), Normal("y", d, {3, 4})},
                     [](Builder& b, const V& in) { return b.Pow(in[0], in[1]); }));
  out.push_back(Make("where", "f64 broadcast",
                     {Bools("c", {3, 4}), Normal("x", d, {3, 4}), Normal("y", d, {4})},
                     [](Builder& b, const V& in) { return b.Where(in[0], in[1], in[2]); }));
  out.push_back(Make("map", "f64 two inputs and an index",
                     {Normal("x", d, {3, 4}), Normal("y", d, {3, 4})}, [](Builder& b, const V& in) {
                       const Expr x = Expr::Input(0, d), y = Expr::Input(1, d);
                       const Expr e = Tanh(x * y) +
                                      Exp(x * 0.3) * Expr::Cast(d, Expr::Index(1) + Expr::Int(1));
                       return b.Map(e, in, d);
                     }));
  out.push_back(Make("sum", "f64 axes=[0,2] keepdim", {Normal("x", d, {2, 3, 4})},
                     [](Builder& b, const V& in) {
                       return b.Sum(in[0], {0, 2}, true);
                     }));
  out.push_back(Make("mean", "f64 axes=[1]", {Normal("x", d, {2, 3, 4})},
                     [](Builder& b, const V& in) { return b.Mean(in[0], {1}); }));
  out.push_back(Make("max", "f64 axes=[1] keepdim", {Normal("x", d, {2, 3, 4})},
                     [](Builder& b, const V& in) { return b.Max(in[0], {1}, true); }));
  out.push_back(
      Make("min", "f64 all axes", {Normal("x", d, {2, 3, 4})}, [](Builder& b, const V& in) {
        return b.Min(in[0], {0, 1, 2});
      }));
  out.push_back(Make("softmax", "f64 [3,5]", {Normal("x", d, {3, 5})},
                     [](Builder& b, const V& in) { return b.Softmax(in[0]); }));
  out.push_back(Make("log_softmax", "f64 [3,5]", {Normal("x", d, {3, 5})},
                     [](Builder& b, const V& in) { return b.LogSoftmax(in[0]); }));
  out.push_back(Make("rms_norm", "f64 with weight [3,6]",
                     {Normal("x", d, {3, 6}), Normal("w", d, {6})},
                     [](Builder& b, const V& in) { return b.RmsNorm(in[0], in[1], 1e-5); }));
  out.push_back(
      Make("layer_norm", "f64 with weight and bias [3,6]",
           {Normal("x", d, {3, 6}), Normal("w", d, {6}), Normal("bias", d, {6})},
           [](Builder& b, const V& in) { return b.LayerNorm(in[0], in[1], in[2], 1e-5); }));
  out.push_back(
      Make("cross_entropy", "f64 [4,7] with ignore_index",
           {Normal("logits", d, {4, 7}), Custom("targets", DType::kI32, {4}, {3, -100, 6, 0})},
           [](Builder& b, const V& in) { return b.CrossEntropy(in[0], in[1]); }));
  out.push_back(Make("reshape", "f64", {Normal("x", d, {3, 4})}, [](Builder& b, const V& in) {
    return b.Reshape(in[0], {2, 6});
  }));
  out.push_back(Make("permute", "f64", {Normal("x", d, {2, 3, 4})}, [](Builder& b, const V& in) {
    return b.Permute(in[0], {2, 0, 1});
  }));
  out.push_back(Make("slice", "f64 axis 1", {Normal("x", d, {3, 6})},
                     [](Builder& b, const V& in) { return b.Slice(in[0], 1, 2, 3); }));
  out.push_back(Make("expand", "f64", {Normal("x", d, {3, 1})}, [](Builder& b, const V& in) {
    return b.Expand(in[0], {2, 3, 4});
  }));
  out.push_back(Make("concat", "f64 axis 1", {Normal("a", d, {2, 3}), Normal("b", d, {2, 2})},
                     [](Builder& b, const V& in) { return b.Concat(in, 1); }));
  out.push_back(
      Make("contiguous", "f64 transposed", {Normal("x", d, {3, 4})},
           [](Builder& b, const V& in) { return b.Contiguous(b.Transpose(in[0], 0, 1)); }));
  out.push_back(Make("gather", "f64 table",
                     {Normal("table", d, {6, 3}), Custom("idx", DType::kI32, {4}, {1, 5, 1, 0})},
                     [](Builder& b, const V& in) { return b.Gather(in[0], in[1]); }));
  out.push_back(Make("scatter_add_rows", "f64 src",
                     {Custom("idx", DType::kI32, {3}, {2, 0, 2}), Normal("src", d, {3, 2})},
                     [](Builder& b, const V& in) { return b.ScatterAddRows(in[0], in[1], 4); }));
  out.push_back(
      Make("take_along", "f64",
           {Normal("x", d, {3, 5}), Custom("idx", DType::kI32, {3, 2}, {0, 4, 2, 2, 1, 3})},
           [](Builder& b, const V& in) { return b.TakeAlong(in[0], in[1]); }));
  out.push_back(
      Make("scatter_add_along", "f64",
           {Custom("idx", DType::kI32, {2, 3}, {0, 2, 0, 4, 1, 1}), Normal("src", d, {2, 3})},
           [](Builder& b, const V& in) { return b.ScatterAddAlong(in[0], in[1], 5); }));
  out.push_back(Make("top_k", "f64 values", {Normal("x", d, {3, 6})},
                     [](Builder& b, const V& in) { return b.TopK(in[0], 2).first; }));
  out.push_back(Make("matmul", "f64 broadcast [3,4]x[2,4,5]",
                     {Normal("a", d, {3, 4}), Normal("b", d, {2, 4, 5})},
                     [](Builder& b, const V& in) { return b.MatMul(in[0], in[1]); }));
  out.push_back(Make("linear", "f64 x [2,3,4] w [5,4]",
                     {Normal("x", d, {2, 3, 4}), Normal("w", d, {5, 4})},
                     [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  {
    RopeParams neox;
    RopeParams llama3;
    llama3.layout = RopeParams::Layout::kInterleaved;
    llama3.scaling = RopeParams::Scaling::kLlama3;
    llama3.theta = 500000;
    llama3.factor = 8;
    RopeParams partial;
    partial.rotary_dim = 2;
    for (const auto& [name, p] : {std::pair{"neox", neox}, std::pair{"interleaved llama3", llama3},
                                  std::pair{"partial", partial}}) {
      out.push_back(Make("rope", absl::StrCat(name, " f64"),
                         {Normal("x", d, {3, 2, 4}), Custom("pos", DType::kI32, {3}, {0, 2, 700})},
                         [p = p](Builder& b, const V& in) { return b.Rope(in[0], in[1], p); }));
    }
  }
  // Gradients into the output; into both outputs (out and lse); into lse alone (below).
  for (const AttnVariant& v : AttentionVariants()) {
    std::vector<InputSpec> in = {Normal("q", d, {1, 4, 4, 3}), Normal("k", d, {1, 2, 4, 3}),
                                 Normal("v", d, {1, 2, 4, 3})};
    const bool aux = AddAttnAux(v, 1, in);
    for (bool lse : {false, true}) {
      out.push_back(Make("attention",
                         absl::StrCat(v.name, lse ? " f64 out and lse" : " f64 GQA 4/2"), in,
                         [p = v.params, aux, lse](Builder& b, const V& x) {
                           std::vector<Value> ax;
                           if (aux) ax.push_back(x[3]);
                           if (!lse) return b.Attention(x[0], x[1], x[2], p, ax);
                           const AttentionOutputs r = b.AttentionWithLse(x[0], x[1], x[2], p, ax);
                           return b.Concat({b.Reshape(r.out, {1, 4, 12}), r.lse}, 2);
                         }));
    }
  }
  // The fused backward (attention_backward) under the harness' gradient check.
  for (const AttnVariant& v : AttentionVariants()) {
    if (v.params.score_mod) continue;
    std::vector<InputSpec> in = {Normal("q", d, {1, 4, 4, 3}), Normal("k", d, {1, 2, 4, 3}),
                                 Normal("v", d, {1, 2, 4, 3})};
    const bool aux = AddAttnAux(v, 1, in);
    out.push_back(Make("attention", absl::StrCat(v.name, " f64 GQA 4/2, fused backward"), in,
                       [p = v.params, aux](Builder& b, const V& x) {
                         std::vector<Value> ax;
                         if (aux) ax.push_back(x[3]);
                         AttentionParams fp = p;
                         fp.fused_backward = true;
                         return b.Attention(x[0], x[1], x[2], fp, ax);
                       }));
  }
  out.push_back(Make(
      "attention", "documents f64 [2,2,6,3], fused backward",
      {Normal("q", d, {2, 2, 6, 3}), Normal("k", d, {2, 1, 6, 3}), Normal("v", d, {2, 1, 6, 3}),
       Custom("docs", DType::kI32, {12}, {0, 0, 1, 1, 1, 2, 0, 1, 1, 1, 1, 1})},
      [](Builder& b, const V& x) {
        AttentionParams p{0, attn::DocumentMask(0, 6), {}};
        p.fused_backward = true;
        const Value aux[] = {x[3]};
        return b.Attention(x[0], x[1], x[2], p, aux);
      }));
  out.push_back(Make(
      "attention", "causal f64 lse only",
      {Normal("q", d, {1, 2, 4, 3}), Normal("k", d, {1, 2, 4, 3}), Normal("v", d, {1, 2, 4, 3})},
      [](Builder& b, const V& x) {
        return b.AttentionWithLse(x[0], x[1], x[2], {0, attn::CausalMask(), {}}).lse;
      }));
  {
    InputSpec dloss = Uniform("dloss", d, {4}, 0.5, 2);
    dloss.differentiable = false;  // the loss does not depend on it
    out.push_back(Make(
        "fused_cross_entropy", "f64 [4,7] loss with ignore_index",
        {Normal("logits", d, {4, 7}), Custom("targets", DType::kI32, {4}, {3, -100, 6, 0}), dloss},
        [](Builder& b, const V& in) { return b.FusedCrossEntropy(in[0], in[1], in[2]).loss; }));
  }
  if (full) {
    out.push_back(Make("softmax", "f64 [8,64]", {Normal("x", d, {8, 64})},
                       [](Builder& b, const V& in) { return b.Softmax(in[0]); }));
  }
  return out;
}

std::vector<OpCase> PerfCases(bool full) {
  const int64_t m = full ? 64 : 4, k = full ? 4096 : 256, n = full ? 4096 : 256;
  std::vector<OpCase> out;
  out.push_back(Make("linear", absl::StrCat("f32 [", m, ",", k, "]x[", n, ",", k, "]^T"),
                     {Normal("x", DType::kF32, {m, k}), AsWeight(Normal("w", DType::kF32, {n, k}))},
                     [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  out.push_back(
      Make("linear", absl::StrCat("q4_0 w [", n, ",", k, "]"),
           {Normal("x", DType::kF32, {m, k}), AsWeight(Normal("w", DType::kQ4_0, {n, k}))},
           [](Builder& b, const V& in) { return b.Linear(in[0], in[1]); }));
  out.push_back(Make("rms_norm", absl::StrCat("f32 [", m, ",", k, "]"),
                     {Normal("x", DType::kF32, {m, k})},
                     [](Builder& b, const V& in) { return b.RmsNorm(in[0], 1e-5); }));
  out.push_back(Make("silu", absl::StrCat("f32 [", m, ",", k, "]"),
                     {Normal("x", DType::kF32, {m, k})},
                     [](Builder& b, const V& in) { return b.Silu(in[0]); }));
  out.push_back(Make("softmax", absl::StrCat("f32 [", m, ",", k, "]"),
                     {Normal("x", DType::kF32, {m, k})},
                     [](Builder& b, const V& in) { return b.Softmax(in[0]); }));
  return out;
}

}  // namespace kiln::harness
