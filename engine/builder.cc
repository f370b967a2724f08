#include "engine/builder.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kiln {

void Builder::Fail(Status s) {
  if (status_.ok()) status_ = std::move(s);
}

Value Builder::Named(Value v, std::string_view name) {
  if (!v.valid()) return v;
  g_->mutable_node(v.id).name =
      scope_.empty() ? std::string(name) : absl::StrCat(scope_, ".", ToAbsl(name));
  return v;
}

Value Builder::AddNode(OpKind op, std::span<const Value> inputs, Attrs attrs,
                       std::string_view name) {
  const std::vector<Value> outs = AddNodeOutputs(op, inputs, std::move(attrs), name);
  return outs.empty() ? Value{} : outs[0];
}

std::vector<Value> Builder::AddNodeOutputs(OpKind op, std::span<const Value> inputs, Attrs attrs,
                                           std::string_view name) {
  const OpDef& def = GetOpDef(op);
  std::vector<TensorType> types;
  for (Value v : inputs) {
    if (!v.valid() || v.id >= g_->size()) {
      if (status_.ok()) Fail(InvalidArgument(def.name, ": an input is not a valid value"));
      return {};
    }
    const Node& n = g_->node(v.id);
    types.push_back({n.dtype, n.shape});
  }
  const int n_in = static_cast<int>(inputs.size());
  std::string full_name;
  if (!name.empty())
    full_name = scope_.empty() ? std::string(name) : absl::StrCat(scope_, ".", ToAbsl(name));
  auto describe = [&]() {
    std::vector<std::string> ts;
    for (const TensorType& t : types) ts.push_back(TypeString(t.dtype, t.shape, *g_));
    return absl::StrCat(def.name, full_name.empty() ? "" : absl::StrCat(" '", full_name, "'"),
                        ts.empty() ? "" : absl::StrCat(" (inputs ", absl::StrJoin(ts, ", "), ")"));
  };
  if (n_in < def.min_inputs || (def.max_inputs >= 0 && n_in > def.max_inputs)) {
    Fail(InvalidArgument(
        describe(), ": takes ", def.min_inputs,
        def.max_inputs == def.min_inputs ? "" : absl::StrCat(" to ", def.max_inputs),
        " inputs, got ", n_in));
    return {};
  }
  if (op == OpKind::kOutputOf) {
    Fail(InvalidArgument("output_of nodes are made by the builder with their producer"));
    return {};
  }
  StatusOr<std::vector<TensorType>> out = InferOutputs(op, types, attrs);
  if (!out.ok()) {
    Fail(InvalidArgument(describe(), ": ", out.status().message()));
    return {};
  }
  // In-place targets must be States: say so now, naming the op, rather than at compile time.
  for (size_t o = 0; o < out->size(); ++o) {
    const int j = def.writes_input[o];
    if (j < 0 || j >= n_in) continue;
    const int32_t owner = StorageOwner(*g_, inputs[j].id);
    if (g_->node(owner).op != OpKind::kState) {
      Fail(InvalidArgument(describe(), ": input ", j,
                           " is written in place, so it must be a State ",
                           "tensor (or a view of one); it is ", OpName(g_->node(owner).op), " '",
                           g_->node(owner).name, "' (weights and inputs are read-only)"));
      return {};
    }
  }
  Node node;
  node.op = op;
  for (Value v : inputs) node.inputs.push_back(v.id);
  node.dtype = (*out)[0].dtype;
  node.shape = std::move((*out)[0].shape);
  node.attrs = std::move(attrs);
  node.name = std::move(full_name);
  std::vector<Value> values = {Value{g_->AddNode(std::move(node))}};
  // Outputs 1..: output_of nodes directly after their producer (graph.h).
  for (size_t o = 1; o < out->size(); ++o) {
    Node proj;
    proj.op = OpKind::kOutputOf;
    proj.inputs = {values[0].id};
    proj.dtype = (*out)[o].dtype;
    proj.shape = (*out)[o].shape;
    proj.attrs.ints = {static_cast<int64_t>(o)};
    proj.attrs.dtype = proj.dtype;
    proj.attrs.dims = std::move((*out)[o].shape);
    values.push_back(Value{g_->AddNode(std::move(proj))});
  }
  return values;
}

bool Builder::NormalizeAxis(int& axis, int rank, const char* op) {
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank) {
    Fail(InvalidArgument(op, ": axis ", axis, " is out of range for rank ", rank));
    return false;
  }
  axis = a;
  return true;
}

// ---- Sources ----

Value Builder::Source(OpKind op, std::string_view name, DType dtype, SymShape shape) {
  if (name.empty()) {
    Fail(InvalidArgument(OpName(op), ": external tensors need a name"));
    return {};
  }
  for (const Dim& d : shape) {
    if (!d.IsMonotone()) {
      Fail(InvalidArgument(
          OpName(op), " '", ToAbsl(name), "': dimension ", d.ToString(g_->symbol_names()),
          " must not decrease as a symbol grows (memory is planned at the bounds)"));
      return {};
    }
  }
  Attrs a;
  a.dtype = dtype;
  a.dims = std::move(shape);
  return AddNode(op, {}, std::move(a), name);
}

Value Builder::Input(std::string_view name, DType dtype, SymShape shape) {
  return Source(OpKind::kInput, name, dtype, std::move(shape));
}
Value Builder::Weight(std::string_view name, DType dtype, SymShape shape) {
  return Source(OpKind::kWeight, name, dtype, std::move(shape));
}
Value Builder::State(std::string_view name, DType dtype, SymShape shape) {
  return Source(OpKind::kState, name, dtype, std::move(shape));
}

Value Builder::Full(double value, DType dtype, SymShape shape) {
  Attrs a;
  a.floats = {value};
  a.dtype = dtype;
  a.dims = std::move(shape);
  return AddNode(OpKind::kFull, {}, std::move(a));
}

Value Builder::ZerosLike(Value v) {
  if (!v.valid()) return {};
  return Full(0, dtype(v), shape(v));
}

Value Builder::Iota(DType dtype, SymShape shape, int axis, double start, double step) {
  if (!NormalizeAxis(axis, static_cast<int>(shape.size()), "iota")) return {};
  Attrs a;
  a.ints = {axis};
  a.floats = {start, step};
  a.dtype = dtype;
  a.dims = std::move(shape);
  return AddNode(OpKind::kIota, {}, std::move(a));
}

Value Builder::DimValue(const Dim& d, DType dtype) {
  Attrs a;
  a.dims = {d};
  a.dtype = dtype;
  return AddNode(OpKind::kDimValue, {}, std::move(a));
}

// ---- Pointwise ----

Value Builder::Unary(OpKind op, Value x) {
  const Value in[] = {x};
  return AddNode(op, in, Attrs{});
}

bool Builder::Broadcast(std::span<Value> values, const char* op) {
  for (Value v : values) {
    if (!v.valid()) return false;
  }
  size_t rank = 0;
  for (Value v : values) rank = std::max(rank, shape(v).size());
  SymShape target(rank, Dim(1));
  for (Value v : values) {
    const SymShape& s = shape(v);
    for (size_t i = 0; i < s.size(); ++i) {
      Dim& t = target[rank - s.size() + i];
      if (s[i] == t || s[i] == Dim(1)) continue;
      if (t == Dim(1)) {
        t = s[i];
        continue;
      }
      std::vector<std::string> shapes;
      for (Value w : values) shapes.push_back(TypeString(dtype(w), shape(w), *g_));
      Fail(InvalidArgument(op, ": shapes do not broadcast: ", absl::StrJoin(shapes, ", "),
                           " (trailing axes must be equal or 1)"));
      return false;
    }
  }
  for (Value& v : values) {
    if (shape(v) != target) v = Expand(v, target);
    if (!v.valid()) return false;
  }
  return true;
}

Value Builder::Binary(OpKind op, Value a, Value b) {
  Value in[] = {a, b};
  if (!Broadcast(in, OpName(op))) return {};
  return AddNode(op, in, Attrs{});
}

Value Builder::Neg(Value x) { return Unary(OpKind::kNeg, x); }
Value Builder::Abs(Value x) { return Unary(OpKind::kAbs, x); }
Value Builder::Exp(Value x) { return Unary(OpKind::kExp, x); }
Value Builder::Log(Value x) { return Unary(OpKind::kLog, x); }
Value Builder::Sqrt(Value x) { return Unary(OpKind::kSqrt, x); }
Value Builder::Rsqrt(Value x) { return Unary(OpKind::kRsqrt, x); }
Value Builder::Tanh(Value x) { return Unary(OpKind::kTanh, x); }
Value Builder::Sigmoid(Value x) { return Unary(OpKind::kSigmoid, x); }
Value Builder::Silu(Value x) { return Unary(OpKind::kSilu, x); }
Value Builder::Gelu(Value x, bool tanh_approximation) {
  return Unary(tanh_approximation ? OpKind::kGeluTanh : OpKind::kGeluErf, x);
}
Value Builder::Relu(Value x) { return Unary(OpKind::kRelu, x); }
Value Builder::Not(Value x) { return Unary(OpKind::kNot, x); }

Value Builder::Cast(Value x, DType dtype) {
  if (x.valid() && this->dtype(x) == dtype) return x;
  Attrs a;
  a.dtype = dtype;
  const Value in[] = {x};
  return AddNode(OpKind::kCast, in, std::move(a));
}

Value Builder::Clamp(Value x, double lo, double hi) {
  Attrs a;
  a.floats = {lo, hi};
  const Value in[] = {x};
  return AddNode(OpKind::kClamp, in, std::move(a));
}

Value Builder::Add(Value a, Value b) { return Binary(OpKind::kAdd, a, b); }
Value Builder::Sub(Value a, Value b) { return Binary(OpKind::kSub, a, b); }
Value Builder::Mul(Value a, Value b) { return Binary(OpKind::kMul, a, b); }
Value Builder::Div(Value a, Value b) { return Binary(OpKind::kDiv, a, b); }
Value Builder::Pow(Value a, Value b) { return Binary(OpKind::kPow, a, b); }
Value Builder::Maximum(Value a, Value b) { return Binary(OpKind::kMaximum, a, b); }
Value Builder::Minimum(Value a, Value b) { return Binary(OpKind::kMinimum, a, b); }
Value Builder::Eq(Value a, Value b) { return Binary(OpKind::kEq, a, b); }
Value Builder::Ne(Value a, Value b) { return Binary(OpKind::kNe, a, b); }
Value Builder::Lt(Value a, Value b) { return Binary(OpKind::kLt, a, b); }
Value Builder::Le(Value a, Value b) { return Binary(OpKind::kLe, a, b); }
Value Builder::Gt(Value a, Value b) { return Binary(OpKind::kGt, a, b); }
Value Builder::Ge(Value a, Value b) { return Binary(OpKind::kGe, a, b); }
Value Builder::And(Value a, Value b) { return Binary(OpKind::kAnd, a, b); }
Value Builder::Or(Value a, Value b) { return Binary(OpKind::kOr, a, b); }

Value Builder::Where(Value cond, Value a, Value b) {
  Value in[] = {cond, a, b};
  if (!Broadcast(in, "where")) return {};
  return AddNode(OpKind::kWhere, in, Attrs{});
}

Value Builder::AddScalar(Value x, double s) {
  if (!x.valid()) return {};
  return Add(x, Full(s, dtype(x), {}));
}

Value Builder::MulScalar(Value x, double s) {
  if (!x.valid()) return {};
  return Mul(x, Full(s, dtype(x), {}));
}

Value Builder::Map(const Expr& expr, std::span<const Value> inputs, DType out_dtype,
                   std::span<const Value> aux) {
  if (inputs.empty()) {
    Fail(InvalidArgument("map: needs at least one input (use MapIndices for index-only maps)"));
    return {};
  }
  std::vector<Value> in(inputs.begin(), inputs.end());
  if (!Broadcast(in, "map")) return {};
  for (Value v : aux) {
    if (!v.valid()) return {};
  }
  Attrs a;
  a.expr[0] = expr;
  a.dtype = out_dtype;
  a.dims = shape(in[0]);
  a.ints = {static_cast<int64_t>(aux.size())};
  in.insert(in.end(), aux.begin(), aux.end());
  return AddNode(OpKind::kMap, in, std::move(a));
}

Value Builder::MapIndices(const Expr& expr, SymShape shape, DType out_dtype,
                          std::span<const Value> aux) {
  Attrs a;
  a.expr[0] = expr;
  a.dtype = out_dtype;
  a.dims = std::move(shape);
  a.ints = {static_cast<int64_t>(aux.size())};
  return AddNode(OpKind::kMap, aux, std::move(a));
}

// ---- Reductions ----

Value Builder::Reduce(OpKind op, Value x, std::vector<int> axes, bool keepdim) {
  if (!x.valid()) return {};
  const int r = rank(x);
  for (int& a : axes) {
    if (!NormalizeAxis(a, r, OpName(op))) return {};
  }
  std::sort(axes.begin(), axes.end());
  axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
  Attrs attrs;
  attrs.ints.push_back(keepdim ? 1 : 0);
  for (int a : axes) attrs.ints.push_back(a);
  const Value in[] = {x};
  return AddNode(op, in, std::move(attrs));
}

Value Builder::Sum(Value x, std::vector<int> axes, bool keepdim) {
  return Reduce(OpKind::kSum, x, std::move(axes), keepdim);
}
Value Builder::Mean(Value x, std::vector<int> axes, bool keepdim) {
  return Reduce(OpKind::kMean, x, std::move(axes), keepdim);
}
Value Builder::Max(Value x, std::vector<int> axes, bool keepdim) {
  return Reduce(OpKind::kMax, x, std::move(axes), keepdim);
}
Value Builder::Min(Value x, std::vector<int> axes, bool keepdim) {
  return Reduce(OpKind::kMin, x, std::move(axes), keepdim);
}

Value Builder::ArgMax(Value x, int axis, bool keepdim, DType index_dtype) {
  if (!x.valid() || !NormalizeAxis(axis, rank(x), "argmax")) return {};
  Attrs a;
  a.ints = {keepdim ? 1 : 0, axis};
  a.dtype = index_dtype;
  const Value in[] = {x};
  return AddNode(OpKind::kArgMax, in, std::move(a));
}

Value Builder::SumTo(Value x, SymShape target) {
  if (!x.valid()) return {};
  const SymShape& s = shape(x);
  if (s == target) return x;
  if (target.size() > s.size()) {
    Fail(InvalidArgument("sum_to: target rank exceeds the input's"));
    return {};
  }
  const size_t lead = s.size() - target.size();
  std::vector<int> axes;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i < lead || (target[i - lead] == Dim(1) && s[i] != Dim(1)))
      axes.push_back(static_cast<int>(i));
  }
  Value r = axes.empty() ? x : Sum(x, axes, /*keepdim=*/true);
  return Reshape(r, target);
}

// ---- Row ops ----

Value Builder::Softmax(Value x) { return Unary(OpKind::kSoftmax, x); }
Value Builder::LogSoftmax(Value x) { return Unary(OpKind::kLogSoftmax, x); }

Value Builder::RmsNorm(Value x, double eps) {
  Attrs a;
  a.floats = {eps};
  const Value in[] = {x};
  return AddNode(OpKind::kRmsNorm, in, std::move(a));
}

Value Builder::RmsNorm(Value x, Value weight, double eps) { return Mul(RmsNorm(x, eps), weight); }

Value Builder::LayerNorm(Value x, double eps) {
  Attrs a;
  a.floats = {eps};
  const Value in[] = {x};
  return AddNode(OpKind::kLayerNorm, in, std::move(a));
}

Value Builder::LayerNorm(Value x, Value weight, Value bias, double eps) {
  Value y = Mul(LayerNorm(x, eps), weight);
  return bias.valid() ? Add(y, bias) : y;
}

Value Builder::CrossEntropy(Value logits, Value targets, int64_t ignore_index) {
  Attrs a;
  a.ints = {ignore_index};
  const Value in[] = {logits, targets};
  return AddNode(OpKind::kCrossEntropy, in, std::move(a));
}

// ---- Layout ----

Value Builder::Reshape(Value x, SymShape new_shape) {
  if (!x.valid()) return {};
  int infer = -1;
  Dim known = 1;
  for (size_t i = 0; i < new_shape.size(); ++i) {
    if (new_shape[i] == Dim(-1)) {
      if (infer >= 0) {
        Fail(InvalidArgument("reshape: at most one dim may be -1"));
        return {};
      }
      infer = static_cast<int>(i);
    } else {
      known *= new_shape[i];
    }
  }
  if (infer >= 0) {
    auto q = NumElements(shape(x)).DivExact(known);
    if (!q) {
      Fail(InvalidArgument("reshape: cannot infer the -1 dim of ",
                           ShapeString(new_shape, g_->symbol_names()), " from ",
                           TypeString(dtype(x), shape(x), *g_)));
      return {};
    }
    new_shape[infer] = *q;
  }
  if (new_shape == shape(x)) return x;
  Attrs a;
  a.dims = std::move(new_shape);
  const Value in[] = {x};
  return AddNode(OpKind::kReshape, in, std::move(a));
}

Value Builder::Permute(Value x, std::vector<int> perm) {
  if (!x.valid()) return {};
  bool identity = true;
  Attrs a;
  for (size_t i = 0; i < perm.size(); ++i) {
    if (!NormalizeAxis(perm[i], rank(x), "permute")) return {};
    identity &= perm[i] == static_cast<int>(i);
    a.ints.push_back(perm[i]);
  }
  if (identity && static_cast<int>(perm.size()) == rank(x)) return x;
  const Value in[] = {x};
  return AddNode(OpKind::kPermute, in, std::move(a));
}

Value Builder::Transpose(Value x, int a, int b) {
  if (!x.valid()) return {};
  const int r = rank(x);
  if (!NormalizeAxis(a, r, "transpose") || !NormalizeAxis(b, r, "transpose")) return {};
  std::vector<int> perm(r);
  for (int i = 0; i < r; ++i) perm[i] = i;
  std::swap(perm[a], perm[b]);
  return Permute(x, perm);
}

Value Builder::Slice(Value x, int axis, const Dim& start, const Dim& size) {
  if (!x.valid() || !NormalizeAxis(axis, rank(x), "slice")) return {};
  if (start == Dim(0) && size == shape(x)[axis]) return x;
  Attrs a;
  a.ints = {axis};
  a.dims = {start, size};
  const Value in[] = {x};
  return AddNode(OpKind::kSlice, in, std::move(a));
}

Value Builder::Expand(Value x, SymShape target) {
  if (!x.valid()) return {};
  const SymShape& s = shape(x);
  if (s.size() > target.size()) {
    Fail(InvalidArgument("expand: cannot reduce the rank from ", s.size(), " to ", target.size()));
    return {};
  }
  Value v = x;
  if (s.size() < target.size()) {
    SymShape padded(target.size() - s.size(), Dim(1));
    padded.insert(padded.end(), s.begin(), s.end());
    v = Reshape(x, padded);
  }
  if (shape(v) == target) return v;
  Attrs a;
  a.dims = std::move(target);
  const Value in[] = {v};
  return AddNode(OpKind::kExpand, in, std::move(a));
}

Value Builder::Concat(std::span<const Value> xs, int axis) {
  if (xs.empty()) {
    Fail(InvalidArgument("concat: needs at least one input"));
    return {};
  }
  for (Value v : xs) {
    if (!v.valid()) return {};
  }
  if (!NormalizeAxis(axis, rank(xs[0]), "concat")) return {};
  if (xs.size() == 1) return xs[0];
  Attrs a;
  a.ints = {axis};
  return AddNode(OpKind::kConcat, xs, std::move(a));
}

Value Builder::Contiguous(Value x) { return Unary(OpKind::kContiguous, x); }

Value Builder::Unsqueeze(Value x, int axis) {
  if (!x.valid()) return {};
  SymShape s = shape(x);
  const int r = static_cast<int>(s.size()) + 1;
  if (!NormalizeAxis(axis, r, "unsqueeze")) return {};
  s.insert(s.begin() + axis, Dim(1));
  return Reshape(x, std::move(s));
}

Value Builder::Squeeze(Value x, int axis) {
  if (!x.valid() || !NormalizeAxis(axis, rank(x), "squeeze")) return {};
  SymShape s = shape(x);
  if (s[axis] != Dim(1)) {
    Fail(InvalidArgument("squeeze: axis ", axis, " has size ", s[axis].ToString(g_->symbol_names()),
                         ", not 1"));
    return {};
  }
  s.erase(s.begin() + axis);
  return Reshape(x, std::move(s));
}

// ---- Indexing ----

Value Builder::Gather(Value table, Value indices, DType out_dtype) {
  Attrs a;
  a.dtype = out_dtype;
  const Value in[] = {table, indices};
  return AddNode(OpKind::kGather, in, std::move(a));
}

Value Builder::ScatterAddRows(Value indices, Value src, const Dim& rows) {
  Attrs a;
  a.dims = {rows};
  const Value in[] = {indices, src};
  return AddNode(OpKind::kScatterAddRows, in, std::move(a));
}

Value Builder::TakeAlong(Value x, Value indices) {
  const Value in[] = {x, indices};
  return AddNode(OpKind::kTakeAlong, in, Attrs{});
}

Value Builder::ScatterAddAlong(Value indices, Value src, const Dim& n) {
  Attrs a;
  a.dims = {n};
  const Value in[] = {indices, src};
  return AddNode(OpKind::kScatterAddAlong, in, std::move(a));
}

std::pair<Value, Value> Builder::TopK(Value x, int64_t k, DType index_dtype) {
  Attrs a;
  a.ints = {k};
  a.dtype = index_dtype;
  const Value in[] = {x};
  const Value idx = AddNode(OpKind::kTopK, in, std::move(a));
  return {TakeAlong(x, idx), idx};
}

// ---- Linear algebra ----

Value Builder::MatMul(Value a, Value b) {
  if (!a.valid() || !b.valid()) return {};
  const SymShape sa = shape(a), sb = shape(b);
  if (sa.size() < 2 || sb.size() < 2) {
    Fail(InvalidArgument("matmul: inputs need rank >= 2; got ", TypeString(dtype(a), sa, *g_), ", ",
                         TypeString(dtype(b), sb, *g_)));
    return {};
  }
  // Broadcast the batch dims only.
  const size_t batch = std::max(sa.size(), sb.size()) - 2;
  SymShape target(batch, Dim(1));
  for (const SymShape* s : {&sa, &sb}) {
    const size_t nb = s->size() - 2;
    for (size_t i = 0; i < nb; ++i) {
      Dim& t = target[batch - nb + i];
      const Dim& d = (*s)[i];
      if (d == t || d == Dim(1)) continue;
      if (t == Dim(1)) {
        t = d;
        continue;
      }
      Fail(InvalidArgument("matmul: batch dims do not broadcast: ", TypeString(dtype(a), sa, *g_),
                           ", ", TypeString(dtype(b), sb, *g_)));
      return {};
    }
  }
  auto expand = [&](Value v, const SymShape& s) {
    SymShape t = target;
    t.push_back(s[s.size() - 2]);
    t.push_back(s.back());
    return s == t ? v : Expand(v, t);
  };
  const Value in[] = {expand(a, sa), expand(b, sb)};
  return AddNode(OpKind::kMatMul, in, Attrs{});
}

Value Builder::Linear(Value x, Value w) {
  const Value in[] = {x, w};
  return AddNode(OpKind::kLinear, in, Attrs{});
}

Value Builder::Linear(Value x, Value w, Value bias) {
  Value y = Linear(x, w);
  return bias.valid() ? Add(y, bias) : y;
}

// ---- Rope and attention ----

Value Builder::Rope(Value x, Value positions, const RopeParams& p) {
  if (!x.valid()) return {};
  int64_t rd = p.rotary_dim;
  if (rd == 0 && !shape(x).empty()) rd = shape(x).back().TryConstant().value_or(0);
  Attrs a;
  a.ints = {rd, static_cast<int64_t>(p.layout), static_cast<int64_t>(p.scaling), p.inverse ? 1 : 0};
  a.floats = {p.theta, p.factor, p.low_freq_factor, p.high_freq_factor, p.original_max_position};
  const Value in[] = {x, positions};
  return AddNode(OpKind::kRope, in, std::move(a));
}

namespace {
Attrs AttentionAttrs(const AttentionParams& p, const Dim& head_dim) {
  Attrs a;
  double scale = p.scale;
  if (scale == 0) {
    const auto d = head_dim.TryConstant();
    scale = d && *d > 0 ? 1.0 / std::sqrt(static_cast<double>(*d)) : NAN;
  }
  a.floats = {scale};
  a.expr = {p.mask_mod, p.score_mod};
  return a;
}

// Dense attention's node; with_lse adds the log-sum-exp output.
std::vector<Value> AttentionNode(Builder& b, Value q, Value k, Value v, const AttentionParams& p,
                                 std::span<const Value> aux, bool with_lse) {
  if (!q.valid()) return {};
  std::vector<Value> in = {q, k, v};
  in.insert(in.end(), aux.begin(), aux.end());
  const Dim d = b.shape(q).empty() ? Dim(0) : b.shape(q).back();
  Attrs a = AttentionAttrs(p, d);
  if (p.fused_backward) {
    a.ints = {1, 1};
  } else if (with_lse) {
    a.ints = {1};
  }
  return b.AddNodeOutputs(OpKind::kAttention, in, std::move(a));
}

}  // namespace

Value Builder::Attention(Value q, Value k, Value v, const AttentionParams& p,
                         std::span<const Value> aux) {
  const std::vector<Value> outs = AttentionNode(*this, q, k, v, p, aux, /*with_lse=*/false);
  return outs.empty() ? Value{} : outs[0];
}

AttentionOutputs Builder::AttentionWithLse(Value q, Value k, Value v, const AttentionParams& p,
                                           std::span<const Value> aux) {
  const std::vector<Value> outs = AttentionNode(*this, q, k, v, p, aux, /*with_lse=*/true);
  if (outs.size() != 2) return {};
  return {outs[0], outs[1]};
}

AttentionGrads Builder::AttentionBackward(Value q, Value k, Value v, Value o, Value dout, Value lse,
                                          const AttentionParams& p, std::span<const Value> aux) {
  if (!q.valid()) return {};
  std::vector<Value> in = {q, k, v, o, dout, lse};
  in.insert(in.end(), aux.begin(), aux.end());
  const Dim d = shape(q).empty() ? Dim(0) : shape(q).back();
  AttentionParams fp = p;
  fp.fused_backward = false;
  const std::vector<Value> outs =
      AddNodeOutputs(OpKind::kAttentionBackward, in, AttentionAttrs(fp, d));
  if (outs.size() != 3) return {};
  return {outs[0], outs[1], outs[2]};
}

Value Builder::PagedAttention(Value q, Value k_cache, Value v_cache, Value block_table,
                              Value seq_lens, Value query_start, const AttentionParams& p,
                              std::span<const Value> aux) {
  if (!q.valid()) return {};
  std::vector<Value> in = {q, k_cache, v_cache, block_table, seq_lens, query_start};
  in.insert(in.end(), aux.begin(), aux.end());
  const Dim d = shape(q).empty() ? Dim(0) : shape(q).back();
  return AddNode(OpKind::kPagedAttention, in, AttentionAttrs(p, d));
}

Value Builder::KvWrite(Value cache, Value x, Value slot_mapping) {
  const Value in[] = {cache, x, slot_mapping};
  return AddNode(OpKind::kKvWrite, in, Attrs{});
}

// ---- Training ----

CrossEntropyOutputs Builder::FusedCrossEntropy(Value logits, Value targets, Value dloss,
                                               int64_t ignore_index) {
  if (!logits.valid() || !targets.valid() || !dloss.valid()) return {};
  if (shape(dloss) != shape(targets)) {
    dloss = Expand(dloss, shape(targets));  // a scalar (or broadcastable) upstream gradient
    if (!dloss.valid()) return {};
  }
  Attrs a;
  a.ints = {ignore_index};
  const Value in[] = {logits, targets, dloss};
  const std::vector<Value> outs = AddNodeOutputs(OpKind::kFusedCrossEntropy, in, std::move(a));
  if (outs.size() != 2) return {};
  return {outs[0], outs[1]};
}

SampleOutputs Builder::Sample(Value logits, Value params, Value uniform, Value penalty_tokens,
                              Value penalty_counts, Value banned, Value penalty_bias,
                              Value allowed) {
  if (allowed.valid() && !penalty_bias.valid() && penalty_tokens.valid()) {
    penalty_bias = Full(0, DType::kF32, shape(penalty_tokens));
  }
  const Value in[] = {logits,         params, uniform,      penalty_tokens,
                      penalty_counts, banned, penalty_bias, allowed};
  const size_t n = allowed.valid() ? 8 : penalty_bias.valid() ? 7 : 6;
  const std::vector<Value> outs =
      AddNodeOutputs(OpKind::kSample, std::span<const Value>(in, n), Attrs{});
  if (outs.size() != 4) return {};
  return {outs[0], outs[1], outs[2], outs[3]};
}

OptimizerOutputs Builder::OptimizerStep(Value param, Value grad, std::span<const Value> states,
                                        Value hyper, Value grad_scale, const OptimizerParams& p) {
  static constexpr OpKind kOps[] = {OpKind::kAdamW, OpKind::kAdam, OpKind::kSgd, OpKind::kAdagrad};
  Attrs a;
  switch (p.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      a.floats = {p.beta1, p.beta2, p.eps, p.weight_decay};
      break;
    case OptimizerKind::kSgd:
      a.floats = {p.momentum, p.dampening, p.weight_decay};
      a.ints = {p.nesterov ? 1 : 0};
      break;
    case OptimizerKind::kAdagrad:
      a.floats = {p.lr_decay, p.weight_decay, p.initial_accumulator_value, p.eps};
      break;
  }
  std::vector<Value> in = {param, grad, hyper};
  in.insert(in.end(), states.begin(), states.end());
  if (grad_scale.valid()) in.push_back(grad_scale);
  const std::vector<Value> outs = AddNodeOutputs(kOps[static_cast<int>(p.kind)], in, std::move(a));
  if (outs.size() != 1 + states.size()) return {};
  return {outs[0], std::vector<Value>(outs.begin() + 1, outs.end())};
}

}  // namespace kiln
