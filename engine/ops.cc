// The op table. Each op appears once: its shape/dtype rule (Infer*), its backward rule
// (Backward*, written with the builder in terms of other ops) and its expression form
// (*Form). Reference kernels live in backends/ref; they are checked against the forms here
// by the op harness.
#include "engine/ops.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <optional>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/autograd.h"
#include "engine/builder.h"
#include "engine/sampling.h"

namespace kiln {
namespace {

using Types = std::span<const TensorType>;
using DTypes = std::span<const DType>;

template <typename... A>
Status Bad(const A&... a) {
  return InvalidArgument(a...);
}

bool IsNumeric(DType t) { return IsFloat(t) || IsInteger(t); }
bool IsIndexType(DType t) { return IsInteger(t); }

Status NeedFloat(DType t, const char* what = "input") {
  if (IsFloat(t)) return OkStatus();
  return Bad("the ", what, " must be a float tensor (f32, f64, f16, bf16, f8e4m3, f8e5m2); got ",
             DTypeName(t));
}
Status NeedNumeric(DType t) {
  if (IsNumeric(t)) return OkStatus();
  return Bad("the input must be a float or integer tensor; got ", DTypeName(t));
}
Status NeedIndex(DType t, const char* what) {
  if (IsIndexType(t)) return OkStatus();
  return Bad("the ", what, " must be an integer tensor (i32 or i64); got ", DTypeName(t));
}
Status NeedSameShapes(Types in) {
  for (size_t i = 1; i < in.size(); ++i) {
    if (in[i].shape != in[0].shape) return Bad("inputs must have equal shapes");
  }
  return OkStatus();
}
Status NeedSameDTypes(Types in) {
  for (size_t i = 1; i < in.size(); ++i) {
    if (in[i].dtype != in[0].dtype) {
      return Bad("inputs must have the same dtype (got ", DTypeName(in[0].dtype), " and ",
                 DTypeName(in[i].dtype), "); insert an explicit cast");
    }
  }
  return OkStatus();
}
Status NeedRank(const TensorType& t, int rank, const char* what) {
  if (static_cast<int>(t.shape.size()) == rank) return OkStatus();
  return Bad("the ", what, " must have rank ", rank, "; got rank ", t.shape.size());
}
bool KnownNegative(const Dim& d) {
  auto c = d.TryConstant();
  return c && *c < 0;
}

// ---- Shape/dtype rules ------------------------------------------------------------------------

StatusOr<TensorType> InferSource(Types, const Attrs& a) {
  if (a.dtype == DType::kInvalid) return Bad("a dtype is required");
  for (const Dim& d : a.dims) {
    if (KnownNegative(d)) return Bad("dimensions must be >= 0");
  }
  return TensorType{a.dtype, a.dims};
}

StatusOr<TensorType> InferGenerator(Types in, const Attrs& a) {
  KILN_ASSIGN_OR_RETURN(TensorType t, InferSource(in, a));
  if (IsQuantized(t.dtype)) return Bad("cannot generate a quantized tensor");
  return t;
}

StatusOr<TensorType> InferFull(Types in, const Attrs& a) {
  if (a.floats.size() != 1) return Bad("full needs one value");
  return InferGenerator(in, a);
}

StatusOr<TensorType> InferIota(Types in, const Attrs& a) {
  KILN_ASSIGN_OR_RETURN(TensorType t, InferGenerator(in, a));
  if (a.ints.size() != 1 || a.ints[0] < 0 || a.ints[0] >= static_cast<int64_t>(t.shape.size())) {
    return Bad("iota axis out of range");
  }
  if (a.floats.size() != 2) return Bad("iota needs start and step");
  if (!IsNumeric(t.dtype)) return Bad("iota needs a numeric dtype");
  return t;
}

StatusOr<TensorType> InferDimValue(Types, const Attrs& a) {
  if (a.dims.size() != 1) return Bad("dim_value needs one dim");
  if (!IsNumeric(a.dtype)) return Bad("dim_value needs a numeric dtype");
  return TensorType{a.dtype, {}};
}

StatusOr<TensorType> InferUnaryFloat(Types in, const Attrs&) {
  KILN_RETURN_IF_ERROR(NeedFloat(in[0].dtype));
  return in[0];
}

StatusOr<TensorType> InferUnaryNumeric(Types in, const Attrs&) {
  KILN_RETURN_IF_ERROR(NeedNumeric(in[0].dtype));
  return in[0];
}

StatusOr<TensorType> InferNot(Types in, const Attrs&) {
  if (in[0].dtype != DType::kBool) return Bad("not needs a bool input");
  return in[0];
}

StatusOr<TensorType> InferCast(Types in, const Attrs& a) {
  if (a.dtype == DType::kInvalid || IsQuantized(a.dtype)) {
    return Bad("cast target must be a scalar dtype (quantize weights when loading them); got ",
               DTypeName(a.dtype));
  }
  return TensorType{a.dtype, in[0].shape};
}

StatusOr<TensorType> InferClamp(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedNumeric(in[0].dtype));
  if (a.floats.size() != 2 || !(a.floats[0] <= a.floats[1])) return Bad("clamp needs lo <= hi");
  return in[0];
}

StatusOr<TensorType> InferBinaryArith(Types in, const Attrs&) {
  KILN_RETURN_IF_ERROR(NeedSameDTypes(in));
  KILN_RETURN_IF_ERROR(NeedNumeric(in[0].dtype));
  KILN_RETURN_IF_ERROR(NeedSameShapes(in));
  return in[0];
}

StatusOr<TensorType> InferPow(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedFloat(in[0].dtype));
  return InferBinaryArith(in, a);
}

StatusOr<TensorType> InferCompare(Types in, const Attrs&) {
  KILN_RETURN_IF_ERROR(NeedSameDTypes(in));
  if (IsQuantized(in[0].dtype)) return Bad("cannot compare quantized tensors");
  KILN_RETURN_IF_ERROR(NeedSameShapes(in));
  return TensorType{DType::kBool, in[0].shape};
}

StatusOr<TensorType> InferLogical(Types in, const Attrs&) {
  if (in[0].dtype != DType::kBool || in[1].dtype != DType::kBool) {
    return Bad("logical ops need bool inputs");
  }
  KILN_RETURN_IF_ERROR(NeedSameShapes(in));
  return in[0];
}

StatusOr<TensorType> InferWhere(Types in, const Attrs&) {
  if (in[0].dtype != DType::kBool) return Bad("where's condition must be bool");
  if (in[1].dtype != in[2].dtype) return Bad("where's branches must have the same dtype");
  if (IsQuantized(in[1].dtype)) return Bad("where cannot select quantized tensors");
  KILN_RETURN_IF_ERROR(NeedSameShapes(in));
  return in[1];
}

int MapNumAux(const Attrs& a) { return a.ints.empty() ? 0 : static_cast<int>(a.ints[0]); }

StatusOr<TensorType> InferMap(Types in, const Attrs& a) {
  if (!a.expr[0]) return Bad("map needs an expression");
  const int num_aux = MapNumAux(a);
  const int num_main = static_cast<int>(in.size()) - num_aux;
  if (num_aux < 0 || num_main < 0) return Bad("map: bad aux count");
  for (int i = 0; i < num_main; ++i) {
    if (in[i].shape != a.dims) return Bad("map inputs must have the output's shape");
    if (IsQuantized(in[i].dtype)) return Bad("map inputs cannot be quantized");
  }
  for (int i = num_main; i < static_cast<int>(in.size()); ++i) {
    if (in[i].shape.size() != 1) return Bad("map aux tensors must have rank 1");
  }
  if (a.expr[0].NumInputs() > num_main) return Bad("map expression reads a missing input");
  // Every Input leaf must have the type its tensor loads as (kernels load by tensor dtype).
  Status leaf_types = OkStatus();
  std::function<void(const Expr&)> check = [&](const Expr& e) {
    const ExprNode& n = e.node();
    if (n.op == ExprOp::kInput && n.type != ExprTypeOf(in[n.index].dtype) && leaf_types.ok()) {
      leaf_types = Bad("map expression reads input ", n.index, " as ", DTypeName(n.type),
                       " but it is ", DTypeName(in[n.index].dtype), " (loads as ",
                       DTypeName(ExprTypeOf(in[n.index].dtype)), ")");
    }
    for (const Expr& arg : n.args) check(arg);
  };
  check(a.expr[0]);
  KILN_RETURN_IF_ERROR(leaf_types);
  if (a.expr[0].NumAux() > num_aux) return Bad("map expression loads a missing aux tensor");
  for (int axis = static_cast<int>(a.dims.size()); axis < kMaxSymbols * 2; ++axis) {
    if (a.expr[0].Uses(ExprOp::kIndex, axis)) return Bad("map expression indexes axis ", axis);
  }
  if (a.expr[0].Uses(ExprOp::kAcc) || a.expr[0].Uses(ExprOp::kCount)) {
    return Bad("map expressions cannot use reduction leaves");
  }
  if (a.dtype == DType::kInvalid || IsQuantized(a.dtype)) return Bad("map needs an output dtype");
  return TensorType{a.dtype, a.dims};
}

// Reductions: ints = {keepdim, axes...}.
StatusOr<SymShape> ReducedShape(const TensorType& t, const Attrs& a) {
  if (a.ints.empty()) return Bad("reduction attributes missing");
  const bool keepdim = a.ints[0] != 0;
  const int rank = static_cast<int>(t.shape.size());
  std::vector<bool> reduced(rank, false);
  for (size_t i = 1; i < a.ints.size(); ++i) {
    const int64_t ax = a.ints[i];
    if (ax < 0 || ax >= rank) return Bad("reduction axis ", ax, " out of range for rank ", rank);
    if (reduced[ax]) return Bad("reduction axis ", ax, " repeated");
    if (i > 1 && ax < a.ints[i - 1]) return Bad("reduction axes must be sorted");
    reduced[ax] = true;
  }
  SymShape out;
  for (int i = 0; i < rank; ++i) {
    if (!reduced[i]) {
      out.push_back(t.shape[i]);
    } else if (keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

StatusOr<TensorType> InferReduce(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedNumeric(in[0].dtype));
  KILN_ASSIGN_OR_RETURN(SymShape s, ReducedShape(in[0], a));
  return TensorType{in[0].dtype, s};
}

StatusOr<TensorType> InferMean(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedFloat(in[0].dtype));
  return InferReduce(in, a);
}

StatusOr<TensorType> InferArgMax(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedNumeric(in[0].dtype));
  if (a.ints.size() != 2) return Bad("argmax takes one axis");
  if (a.dtype != DType::kI32 && a.dtype != DType::kI64) return Bad("argmax returns i32 or i64");
  KILN_ASSIGN_OR_RETURN(SymShape s, ReducedShape(in[0], a));
  return TensorType{a.dtype, s};
}

StatusOr<TensorType> InferRow(Types in, const Attrs&) {
  KILN_RETURN_IF_ERROR(NeedFloat(in[0].dtype));
  if (in[0].shape.empty()) return Bad("row ops need rank >= 1");
  return in[0];
}

StatusOr<TensorType> InferNorm(Types in, const Attrs& a) {
  if (a.floats.size() != 1 || !(a.floats[0] >= 0)) return Bad("eps must be >= 0");
  return InferRow(in, a);
}

StatusOr<TensorType> InferCrossEntropy(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedFloat(in[0].dtype, "logits tensor"));
  KILN_RETURN_IF_ERROR(NeedIndex(in[1].dtype, "targets tensor"));
  if (in[0].shape.empty()) return Bad("logits need rank >= 1");
  SymShape rows(in[0].shape.begin(), in[0].shape.end() - 1);
  if (in[1].shape != rows) return Bad("targets must have the logits' shape without the last axis");
  if (a.ints.size() != 1) return Bad("cross_entropy needs ignore_index");
  return TensorType{in[0].dtype, rows};
}

StatusOr<TensorType> InferReshape(Types in, const Attrs& a) {
  if (NumElements(in[0].shape) != NumElements(a.dims)) {
    return Bad("reshape must keep the number of elements");
  }
  return TensorType{in[0].dtype, a.dims};
}

StatusOr<TensorType> InferPermute(Types in, const Attrs& a) {
  const size_t rank = in[0].shape.size();
  if (a.ints.size() != rank) return Bad("permutation has ", a.ints.size(), " axes for rank ", rank);
  std::vector<bool> seen(rank, false);
  SymShape out;
  for (int64_t p : a.ints) {
    if (p < 0 || p >= static_cast<int64_t>(rank) || seen[p]) return Bad("not a permutation");
    seen[p] = true;
    out.push_back(in[0].shape[p]);
  }
  return TensorType{in[0].dtype, out};
}

StatusOr<TensorType> InferSlice(Types in, const Attrs& a) {
  const int rank = static_cast<int>(in[0].shape.size());
  if (a.ints.size() != 1 || a.dims.size() != 2) return Bad("slice needs axis, start and size");
  const int64_t axis = a.ints[0];
  if (axis < 0 || axis >= rank) return Bad("slice axis ", axis, " out of range for rank ", rank);
  const Dim &start = a.dims[0], &size = a.dims[1];
  if (KnownNegative(start) || KnownNegative(size)) return Bad("slice start/size must be >= 0");
  auto c_start = start.TryConstant(), c_size = size.TryConstant();
  auto c_dim = in[0].shape[axis].TryConstant();
  if (c_start && c_size && c_dim && *c_start + *c_size > *c_dim) {
    return Bad("slice [", *c_start, ", ", *c_start + *c_size, ") exceeds axis size ", *c_dim);
  }
  if (IsQuantized(in[0].dtype) && axis == rank - 1) {
    return Bad("a quantized tensor can only be sliced along rows");
  }
  SymShape out = in[0].shape;
  out[axis] = size;
  return TensorType{in[0].dtype, out};
}

StatusOr<TensorType> InferExpand(Types in, const Attrs& a) {
  if (in[0].shape.size() != a.dims.size()) return Bad("expand keeps the rank");
  for (size_t i = 0; i < a.dims.size(); ++i) {
    if (in[0].shape[i] != a.dims[i] && in[0].shape[i] != Dim(1)) {
      return Bad("expand: axis ", i, " must be 1 or equal to the target size");
    }
  }
  if (IsQuantized(in[0].dtype)) return Bad("cannot broadcast a quantized tensor");
  return TensorType{in[0].dtype, a.dims};
}

StatusOr<TensorType> InferConcat(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedSameDTypes(in));
  if (IsQuantized(in[0].dtype)) return Bad("cannot concatenate quantized tensors");
  const int rank = static_cast<int>(in[0].shape.size());
  if (a.ints.size() != 1 || a.ints[0] < 0 || a.ints[0] >= rank)
    return Bad("concat axis out of range");
  const int64_t axis = a.ints[0];
  SymShape out = in[0].shape;
  for (size_t i = 1; i < in.size(); ++i) {
    if (static_cast<int>(in[i].shape.size()) != rank) return Bad("concat inputs need equal ranks");
    for (int d = 0; d < rank; ++d) {
      if (d != axis && in[i].shape[d] != in[0].shape[d]) {
        return Bad("concat inputs must match except along axis ", axis);
      }
    }
    out[axis] += in[i].shape[axis];
  }
  return TensorType{in[0].dtype, out};
}

StatusOr<TensorType> InferSame(Types in, const Attrs&) {
  if (IsQuantized(in[0].dtype)) return Bad("cannot copy a quantized tensor element-wise");
  return in[0];
}

Status NeedWholeBlocks(DType t, const SymShape& row_dims, const char* what) {
  if (!IsQuantized(t)) return OkStatus();
  const Dim n = NumElements(row_dims);
  auto c = n.TryConstant();
  if (!c || *c % DTypeBlockElems(t) != 0) {
    return Bad("the ", what, " is ", DTypeName(t), ": its rows must be a constant multiple of ",
               DTypeBlockElems(t), " elements");
  }
  return OkStatus();
}

StatusOr<TensorType> InferGather(Types in, const Attrs& a) {
  const TensorType &table = in[0], &idx = in[1];
  if (table.shape.empty()) return Bad("the table needs rank >= 1");
  KILN_RETURN_IF_ERROR(NeedIndex(idx.dtype, "index tensor"));
  SymShape row(table.shape.begin() + 1, table.shape.end());
  KILN_RETURN_IF_ERROR(NeedWholeBlocks(table.dtype, row, "table"));
  DType out = a.dtype;
  if (out == DType::kInvalid) out = IsQuantized(table.dtype) ? DType::kF32 : table.dtype;
  if (IsQuantized(table.dtype) ? !IsFloat(out) : out != table.dtype) {
    return Bad("gather output dtype must be the table's (or a float type for quantized tables)");
  }
  SymShape s = idx.shape;
  s.insert(s.end(), row.begin(), row.end());
  return TensorType{out, s};
}

StatusOr<TensorType> InferScatterAddRows(Types in, const Attrs& a) {
  const TensorType &idx = in[0], &src = in[1];
  KILN_RETURN_IF_ERROR(NeedIndex(idx.dtype, "index tensor"));
  KILN_RETURN_IF_ERROR(NeedFloat(src.dtype, "source"));
  if (a.dims.size() != 1) return Bad("scatter_add_rows needs the row count");
  if (src.shape.size() < idx.shape.size() ||
      !std::equal(idx.shape.begin(), idx.shape.end(), src.shape.begin())) {
    return Bad("the source must start with the index tensor's shape");
  }
  SymShape s = {a.dims[0]};
  s.insert(s.end(), src.shape.begin() + idx.shape.size(), src.shape.end());
  return TensorType{src.dtype, s};
}

StatusOr<TensorType> InferTakeAlong(Types in, const Attrs&) {
  const TensorType &x = in[0], &idx = in[1];
  KILN_RETURN_IF_ERROR(NeedIndex(idx.dtype, "index tensor"));
  if (IsQuantized(x.dtype)) return Bad("take_along cannot read quantized tensors");
  if (x.shape.empty() || x.shape.size() != idx.shape.size()) {
    return Bad("x and indices need the same rank >= 1");
  }
  for (size_t i = 0; i + 1 < x.shape.size(); ++i) {
    if (x.shape[i] != idx.shape[i]) return Bad("x and indices must match except the last axis");
  }
  return TensorType{x.dtype, idx.shape};
}

StatusOr<TensorType> InferScatterAddAlong(Types in, const Attrs& a) {
  const TensorType &idx = in[0], &src = in[1];
  KILN_RETURN_IF_ERROR(NeedIndex(idx.dtype, "index tensor"));
  KILN_RETURN_IF_ERROR(NeedFloat(src.dtype, "source"));
  if (a.dims.size() != 1) return Bad("scatter_add_along needs the axis size");
  if (idx.shape != src.shape || idx.shape.empty()) return Bad("indices and source must match");
  SymShape s = src.shape;
  s.back() = a.dims[0];
  return TensorType{src.dtype, s};
}

StatusOr<TensorType> InferTopK(Types in, const Attrs& a) {
  KILN_RETURN_IF_ERROR(NeedNumeric(in[0].dtype));
  if (in[0].shape.empty()) return Bad("top_k needs rank >= 1");
  if (a.ints.size() != 1 || a.ints[0] < 1) return Bad("top_k needs k >= 1");
  if (a.dtype != DType::kI32 && a.dtype != DType::kI64) return Bad("top_k returns i32 or i64");
  auto n = in[0].shape.back().TryConstant();
  if (n && a.ints[0] > *n) return Bad("k = ", a.ints[0], " exceeds the axis size ", *n);
  SymShape s = in[0].shape;
  s.back() = a.ints[0];
  return TensorType{a.dtype, s};
}

StatusOr<TensorType> InferMatMul(Types in, const Attrs&) {
  const TensorType &x = in[0], &y = in[1];
  KILN_RETURN_IF_ERROR(NeedFloat(x.dtype));
  const size_t r = x.shape.size();
  if (y.dtype != x.dtype) {
    // A frozen weight as the right operand (autograd's dx = g w for linear): 2-D, float or
    // block-quantized with blocks along N (a GGUF [N_out, K] weight read as [K, N]).
    if (!IsFloat(y.dtype) && !IsQuantized(y.dtype)) {
      return Bad("matmul's right operand must be float or quantized");
    }
    if (r != 2 || y.shape.size() != 2) {
      return Bad("matmul with a ", DTypeName(y.dtype), " right operand (", DTypeName(x.dtype),
                 " left) needs rank 2 for both");
    }
    KILN_RETURN_IF_ERROR(NeedWholeBlocks(y.dtype, {y.shape[1]}, "right operand"));
  }
  if (r < 2 || y.shape.size() != r) return Bad("matmul needs equal ranks >= 2");
  for (size_t i = 0; i + 2 < r; ++i) {
    if (x.shape[i] != y.shape[i]) return Bad("matmul batch dims must match");
  }
  if (x.shape[r - 1] != y.shape[r - 2]) return Bad("matmul inner dims must match");
  SymShape s = x.shape;
  s[r - 1] = y.shape[r - 1];
  return TensorType{x.dtype, s};
}

StatusOr<TensorType> InferLinear(Types in, const Attrs&) {
  const TensorType &x = in[0], &w = in[1];
  KILN_RETURN_IF_ERROR(NeedFloat(x.dtype));
  if (x.shape.empty()) return Bad("linear needs x of rank >= 1");
  KILN_RETURN_IF_ERROR(NeedRank(w, 2, "weight"));
  if (!IsFloat(w.dtype) && !IsQuantized(w.dtype))
    return Bad("the weight must be float or quantized");
  if (w.shape[1] != x.shape.back()) return Bad("x's last axis must equal the weight's K (axis 1)");
  KILN_RETURN_IF_ERROR(NeedWholeBlocks(w.dtype, {w.shape[1]}, "weight"));
  SymShape s = x.shape;
  s.back() = w.shape[0];
  return TensorType{x.dtype, s};
}

StatusOr<TensorType> InferRope(Types in, const Attrs& a) {
  const TensorType &x = in[0], &pos = in[1];
  KILN_RETURN_IF_ERROR(NeedFloat(x.dtype));
  KILN_RETURN_IF_ERROR(NeedIndex(pos.dtype, "positions tensor"));
  if (x.shape.size() < 2) return Bad("rope needs x of rank >= 2 ([..., heads, head_dim])");
  if (pos.shape != SymShape(x.shape.begin(), x.shape.end() - 2)) {
    return Bad("positions must have x's shape without the last two axes");
  }
  if (a.ints.size() != 4 || a.floats.size() != 5) return Bad("rope attributes missing");
  auto d = x.shape.back().TryConstant();
  if (!d) return Bad("the head dim must be a constant");
  const int64_t rd = a.ints[0];
  if (rd <= 0 || rd > *d || rd % 2 != 0)
    return Bad("rotary_dim ", rd, " must be even, in (0, ", *d, "]");
  if (a.ints[1] < 0 || a.ints[1] > 1 || a.ints[2] < 0 || a.ints[2] > 2) return Bad("bad rope mode");
  if (!(a.floats[0] > 0) || !(a.floats[1] > 0)) return Bad("rope theta and factor must be > 0");
  return x;
}

Status CheckAttentionAttrs(const Attrs& a, int num_aux, int rank) {
  if (a.floats.size() != 1 || !std::isfinite(a.floats[0])) return Bad("attention needs a scale");
  for (const Expr& e : a.expr) {
    if (!e) continue;
    if (e.NumAux() > num_aux) return Bad("a mask/score expression loads a missing aux tensor");
    if (e.Uses(ExprOp::kAcc) || e.Uses(ExprOp::kCount)) return Bad("bad attention expression");
    for (int axis = rank; axis < 16; ++axis) {
      if (e.Uses(ExprOp::kIndex, axis)) return Bad("attention expressions use axes 0..3");
    }
  }
  if (a.expr[0] && a.expr[0].type() != DType::kBool) return Bad("mask_mod must return bool");
  if (a.expr[0] && a.expr[0].Uses(ExprOp::kInput)) return Bad("mask_mod cannot read the score");
  if (a.expr[1] && a.expr[1].NumInputs() > 1) return Bad("score_mod reads only Input(0)");
  return OkStatus();
}

Status CheckHeads(const Dim& hq, const Dim& hkv) {
  auto q = hq.TryConstant(), k = hkv.TryConstant();
  if (q && k && (*k == 0 || *q % *k != 0)) {
    return Bad("query heads (", *q, ") must be a multiple of kv heads (", *k, ")");
  }
  if ((q.has_value()) != (k.has_value())) return Bad("head counts must both be constant");
  if (!q && hq != hkv) return Bad("symbolic head counts must be equal");
  return OkStatus();
}

StatusOr<TensorType> InferAttention(Types in, const Attrs& a) {
  const TensorType &q = in[0], &k = in[1], &v = in[2];
  KILN_RETURN_IF_ERROR(NeedFloat(q.dtype, "query"));
  if (k.dtype != q.dtype || v.dtype != q.dtype) return Bad("q, k, v need the same dtype");
  KILN_RETURN_IF_ERROR(NeedRank(q, 4, "query ([B, Hq, Tq, D])"));
  KILN_RETURN_IF_ERROR(NeedRank(k, 4, "key ([B, Hkv, Tk, D])"));
  KILN_RETURN_IF_ERROR(NeedRank(v, 4, "value ([B, Hkv, Tk, Dv])"));
  if (k.shape[0] != q.shape[0] || v.shape[0] != q.shape[0]) return Bad("batch sizes differ");
  if (v.shape[1] != k.shape[1] || v.shape[2] != k.shape[2])
    return Bad("k and v must match in Hkv, Tk");
  if (k.shape[3] != q.shape[3]) return Bad("q and k head dims differ");
  KILN_RETURN_IF_ERROR(CheckHeads(q.shape[1], k.shape[1]));
  for (size_t i = 3; i < in.size(); ++i) {
    if (in[i].shape.size() != 1) return Bad("aux tensors must have rank 1");
  }
  KILN_RETURN_IF_ERROR(CheckAttentionAttrs(a, static_cast<int>(in.size()) - 3, 4));
  const bool flags_ok =
      a.ints.size() <= 2 &&
      std::all_of(a.ints.begin(), a.ints.end(), [](int64_t f) { return f == 0 || f == 1; });
  if (!flags_ok)
    return Bad("attention's ints are {}, {with_lse} or {with_lse, fused_backward} (0/1)");
  if (a.ints.size() == 2 && a.ints[1] == 1) {
    if (a.ints[0] != 1) return Bad("attention's fused_backward needs with_lse");
    if (a.expr[1]) return Bad("attention's fused_backward takes no score_mod");
  }
  return TensorType{q.dtype, {q.shape[0], q.shape[1], q.shape[2], v.shape[3]}};
}

// attention_backward: attention's inputs, then its output, the output's gradient and lse.
StatusOr<TensorType> InferAttentionBackward(Types in, const Attrs& a) {
  std::vector<TensorType> fwd = {in[0], in[1], in[2]};
  for (size_t i = 6; i < in.size(); ++i) fwd.push_back(in[i]);
  Attrs fa = a;
  fa.ints.clear();
  KILN_ASSIGN_OR_RETURN(TensorType o, InferAttention(fwd, fa));
  if (a.expr[1]) return Bad("attention_backward takes no score_mod");
  if (!a.ints.empty()) return Bad("attention_backward takes no ints");
  if (in[3].dtype != o.dtype || in[3].shape != o.shape) return Bad("o must be attention's output");
  if (in[4].dtype != o.dtype || in[4].shape != o.shape) return Bad("do must have o's type");
  const TensorType lse{ExprTypeOf(in[0].dtype), {o.shape[0], o.shape[1], o.shape[2]}};
  if (in[5].dtype != lse.dtype || in[5].shape != lse.shape) {
    return Bad("lse must be attention's log-sum-exp ([B, Hq, Tq] in the query's compute type)");
  }
  return in[0];  // dq
}

StatusOr<std::vector<TensorType>> InferAttentionBackwardExtra(Types in, const Attrs&) {
  return std::vector<TensorType>{in[1], in[2]};  // dk, dv
}

bool AttentionWithLse(const Attrs& a) { return !a.ints.empty() && a.ints[0] == 1; }

// Output 1 (when asked for): the log-sum-exp of each query row's scores.
StatusOr<std::vector<TensorType>> InferAttentionExtra(Types in, const Attrs& a) {
  if (!AttentionWithLse(a)) return std::vector<TensorType>{};
  const TensorType& q = in[0];
  return std::vector<TensorType>{{ExprTypeOf(q.dtype), {q.shape[0], q.shape[1], q.shape[2]}}};
}

StatusOr<TensorType> InferPagedAttention(Types in, const Attrs& a) {
  const TensorType &q = in[0], &kc = in[1], &vc = in[2], &bt = in[3], &sl = in[4], &qs = in[5];
  KILN_RETURN_IF_ERROR(NeedFloat(q.dtype, "query"));
  KILN_RETURN_IF_ERROR(NeedFloat(kc.dtype, "k cache"));
  KILN_RETURN_IF_ERROR(NeedFloat(vc.dtype, "v cache"));
  KILN_RETURN_IF_ERROR(NeedRank(q, 3, "query ([T, Hq, D])"));
  KILN_RETURN_IF_ERROR(NeedRank(kc, 4, "k cache ([blocks, block_size, Hkv, D])"));
  KILN_RETURN_IF_ERROR(NeedRank(vc, 4, "v cache ([blocks, block_size, Hkv, Dv])"));
  KILN_RETURN_IF_ERROR(NeedRank(bt, 2, "block table ([S, max_blocks])"));
  KILN_RETURN_IF_ERROR(NeedRank(sl, 1, "seq_lens ([S])"));
  KILN_RETURN_IF_ERROR(NeedRank(qs, 1, "query_start ([S+1])"));
  KILN_RETURN_IF_ERROR(NeedIndex(bt.dtype, "block table"));
  KILN_RETURN_IF_ERROR(NeedIndex(sl.dtype, "seq_lens tensor"));
  KILN_RETURN_IF_ERROR(NeedIndex(qs.dtype, "query_start tensor"));
  for (int i = 0; i < 3; ++i) {
    if (vc.shape[i] != kc.shape[i])
      return Bad("k and v caches must match in blocks, block size, heads");
  }
  if (kc.shape[3] != q.shape[2]) return Bad("q and k cache head dims differ");
  if (sl.shape[0] != bt.shape[0]) return Bad("seq_lens and block_table need the same S");
  if (qs.shape[0] != bt.shape[0] + 1) return Bad("query_start needs S + 1 entries");
  KILN_RETURN_IF_ERROR(CheckHeads(q.shape[1], kc.shape[2]));
  for (size_t i = 6; i < in.size(); ++i) {
    if (in[i].shape.size() != 1) return Bad("aux tensors must have rank 1");
  }
  KILN_RETURN_IF_ERROR(CheckAttentionAttrs(a, static_cast<int>(in.size()) - 6, 4));
  if (!a.ints.empty()) return Bad("paged attention does not return the log-sum-exp (ints = {})");
  return TensorType{q.dtype, {q.shape[0], q.shape[1], vc.shape[3]}};
}

StatusOr<TensorType> InferKvWrite(Types in, const Attrs&) {
  const TensorType &cache = in[0], &x = in[1], &slots = in[2];
  KILN_RETURN_IF_ERROR(NeedFloat(cache.dtype, "cache"));
  KILN_RETURN_IF_ERROR(NeedFloat(x.dtype, "new rows"));
  KILN_RETURN_IF_ERROR(NeedRank(cache, 4, "cache ([blocks, block_size, H, D])"));
  KILN_RETURN_IF_ERROR(NeedRank(x, 3, "new rows ([T, H, D])"));
  KILN_RETURN_IF_ERROR(NeedRank(slots, 1, "slot mapping ([T])"));
  KILN_RETURN_IF_ERROR(NeedIndex(slots.dtype, "slot mapping"));
  if (x.shape[1] != cache.shape[2] || x.shape[2] != cache.shape[3]) {
    return Bad("new rows' [H, D] must match the cache's");
  }
  if (slots.shape[0] != x.shape[0]) return Bad("one slot per new row");
  return cache;
}

StatusOr<TensorType> InferOutputOf(Types, const Attrs& a) {
  if (a.ints.size() != 1 || a.ints[0] < 1 || a.ints[0] >= kMaxOutputs) {
    return Bad("output_of needs an output index in [1, ", kMaxOutputs, ")");
  }
  // The type is the producer's output ints[0]: verify checks it against the producer's rule.
  if (a.dtype == DType::kInvalid) return Bad("output_of needs a dtype");
  return TensorType{a.dtype, a.dims};
}

// loss as cross_entropy's; the rows' dloss (the upstream gradient of each loss) as loss.
StatusOr<TensorType> InferFusedCrossEntropy(Types in, const Attrs& a) {
  KILN_ASSIGN_OR_RETURN(TensorType loss, InferCrossEntropy(in.first(2), a));
  if (in[2].dtype != in[0].dtype) {
    return Bad("dloss must have the logits' dtype ", DTypeName(in[0].dtype), "; got ",
               DTypeName(in[2].dtype));
  }
  if (in[2].shape != loss.shape) {
    return Bad("dloss must have the targets' shape (one upstream gradient per row)");
  }
  return loss;
}

StatusOr<std::vector<TensorType>> InferFusedCrossEntropyExtra(Types in, const Attrs&) {
  return std::vector<TensorType>{in[0]};  // dlogits
}

// The optimizers (see OpKind::kAdamW): (param, grad, hyper, states..., [grad_scale]) ->
// param, states..., with torch.optim's argument checks on the constant hyper-parameters.
template <OpKind K>
StatusOr<TensorType> InferOptimizer(Types in, const Attrs& a) {
  const char* op = OpName(K);
  const TensorType& param = in[0];
  auto need_f32 = [&](size_t i, const char* what) -> Status {
    if (in[i].dtype != DType::kF32) {
      return Bad(op, "'s ", what, " must be f32 (a State); got ", DTypeName(in[i].dtype));
    }
    if (in[i].shape != param.shape) return Bad(op, "'s ", what, " must have param's shape");
    return OkStatus();
  };
  KILN_RETURN_IF_ERROR(need_f32(0, "param"));
  KILN_RETURN_IF_ERROR(NeedFloat(in[1].dtype, "gradient"));
  if (in[1].shape != param.shape) return Bad(op, "'s gradient must have param's shape");
  const bool hyper_ok = in[2].shape.size() == 1 && in[2].shape[0] == Dim(3) &&
                        (in[2].dtype == DType::kF32 || in[2].dtype == DType::kF64);
  if (!hyper_ok) {
    return Bad(op, "'s hyper must be an f32 or f64 tensor of shape [3] holding {step, lr, ",
               "grad_scale}; got ", DTypeName(in[2].dtype), " of rank ", in[2].shape.size());
  }
  const std::vector<double>& f = a.floats;
  const size_t n_floats = K == OpKind::kSgd ? 3 : 4;
  if (f.size() != n_floats) {
    return Bad(op, " needs ", n_floats, " float attributes; got ", f.size());
  }
  switch (K) {
    case OpKind::kAdamW:
    case OpKind::kAdam:
      if (!(f[0] >= 0 && f[0] < 1) || !(f[1] >= 0 && f[1] < 1)) {
        return Bad(op, " needs betas in [0, 1) (got ", f[0], ", ", f[1], ")");
      }
      if (!(f[2] >= 0) || !(f[3] >= 0)) {
        return Bad(op, " needs eps and weight_decay >= 0 (got ", f[2], ", ", f[3], ")");
      }
      break;
    case OpKind::kSgd:
      if (!(f[0] >= 0) || !(f[2] >= 0)) {
        return Bad(op, " needs momentum and weight_decay >= 0 (got ", f[0], ", ", f[2], ")");
      }
      if (a.ints.size() != 1) return Bad(op, " needs ints = {nesterov}");
      if (a.ints[0] != 0 && (f[0] <= 0 || f[1] != 0)) {
        return Bad(op, ": nesterov momentum requires a momentum and zero dampening (got ", f[0],
                   ", ", f[1], ")");
      }
      break;
    default:  // adagrad
      if (!(f[0] >= 0) || !(f[1] >= 0) || !(f[2] >= 0) || !(f[3] >= 0)) {
        return Bad(op, " needs lr_decay, weight_decay, initial_accumulator_value and eps >= 0 ",
                   "(got ", f[0], ", ", f[1], ", ", f[2], ", ", f[3], ")");
      }
      break;
  }
  const size_t states = static_cast<size_t>(OptimizerStateCount(K, a));
  if (in.size() != 3 + states && in.size() != 4 + states) {
    return Bad(op, " with these attributes takes ", states,
               " state tensor(s) and an optional grad_scale; got ", in.size() - 3,
               " inputs after hyper");
  }
  static constexpr const char* kStateNames[] = {"first state", "second state"};
  for (size_t i = 0; i < states; ++i) KILN_RETURN_IF_ERROR(need_f32(3 + i, kStateNames[i]));
  if (in.size() == 4 + states) {
    const TensorType& gs = in.back();
    if (!gs.shape.empty() || !IsFloat(gs.dtype)) {
      return Bad(op, "'s grad_scale must be a rank-0 float tensor; got ", DTypeName(gs.dtype),
                 " of rank ", gs.shape.size());
    }
  }
  return param;
}

template <OpKind K>
StatusOr<std::vector<TensorType>> InferOptimizerExtra(Types in, const Attrs& a) {
  return std::vector<TensorType>(in.begin() + 3, in.begin() + 3 + OptimizerStateCount(K, a));
}

// logits [S,V] f32, params [S,kNumParams] f32, uniform [S] f64, penalty tokens and counts
// [S,P] i32, banned [S,E] i32 [, penalty_bias [S,P] f32 [, allowed [S,ceil(V/32)] i32]]
// -> token [S] i32 (+ logprob, top ids, top logprobs).
StatusOr<TensorType> InferSample(Types in, const Attrs&) {
  static constexpr const char* kNames[] = {"logits",         "params",         "uniform",
                                           "penalty_tokens", "penalty_counts", "banned"};
  static constexpr DType kTypes[] = {DType::kF32, DType::kF32, DType::kF64,
                                     DType::kI32, DType::kI32, DType::kI32};
  static constexpr size_t kRanks[] = {2, 2, 1, 2, 2, 2};
  for (int i = 0; i < 6; ++i) {
    if (in[i].dtype != kTypes[i] || in[i].shape.size() != kRanks[i]) {
      return Bad("sample's ", kNames[i], " must be ", DTypeName(kTypes[i]), " of rank ", kRanks[i],
                 "; got ", DTypeName(in[i].dtype), " of rank ", in[i].shape.size());
    }
    if (in[i].shape[0] != in[0].shape[0]) {
      return Bad("sample's ", kNames[i], " must have one row per sequence (the logits' rows)");
    }
  }
  if (in[1].shape[1] != Dim(sampling::kNumParams)) {
    return Bad("sample's params must have ", static_cast<int>(sampling::kNumParams),
               " columns (engine/sampling.h ParamIndex)");
  }
  if (in[3].shape[1] != in[4].shape[1]) {
    return Bad("sample's penalty_tokens and penalty_counts must have the same shape");
  }
  if (in.size() > 6 && (in[6].dtype != DType::kF32 || in[6].shape != in[3].shape)) {
    return Bad("sample's penalty_bias must be f32 of penalty_tokens' shape; got ",
               DTypeName(in[6].dtype), " of rank ", in[6].shape.size());
  }
  if (in.size() > 7) {
    const TensorType& allowed = in[7];
    if (allowed.dtype != DType::kI32 || allowed.shape.size() != 2 ||
        allowed.shape[0] != in[0].shape[0]) {
      return Bad("sample's allowed must be i32 [S, ceil(V / 32)] (S: the logits' rows); got ",
                 DTypeName(allowed.dtype), " of rank ", allowed.shape.size());
    }
    // ceil(V / 32) is not a polynomial: a symbolic vocabulary must be 32 * (the words).
    const Dim& vocab = in[0].shape[1];
    const std::optional<int64_t> v = vocab.TryConstant();
    const std::optional<Dim> words =
        v ? std::optional<Dim>(Dim(sampling::AllowedWords(*v))) : vocab.DivExact(Dim(32));
    if (!words || allowed.shape[1] != *words) {
      return Bad(
          "sample's allowed must have ceil(V / 32) columns for the logits' V = ", vocab.ToString(),
          " (a symbolic V must be 32 times a size); got ", allowed.shape[1].ToString());
    }
  }
  return TensorType{DType::kI32, {in[0].shape[0]}};
}

StatusOr<std::vector<TensorType>> InferSampleExtra(Types in, const Attrs&) {
  const Dim S = in[0].shape[0], N(sampling::kMaxLogprobs);
  return std::vector<TensorType>{{DType::kF32, {S}}, {DType::kI32, {S, N}}, {DType::kF32, {S, N}}};
}

// ---- Expression forms -----------------------------------------------------------------------

Expr In(int i, DTypes in) { return Expr::Input(i, ExprTypeOf(in[i])); }

template <OpKind K>
Expr UnaryForm(const Attrs& a, DTypes in, DType out) {
  const Expr x = In(0, in);
  const DType c = x.type();
  switch (K) {
    case OpKind::kNeg:
      return -x;
    case OpKind::kAbs:
      return Abs(x);
    case OpKind::kExp:
      return Exp(x);
    case OpKind::kLog:
      return Log(x);
    case OpKind::kSqrt:
      return Sqrt(x);
    case OpKind::kRsqrt:
      return Rsqrt(x);
    case OpKind::kTanh:
      return Tanh(x);
    case OpKind::kSigmoid:
      return Sigmoid(x);
    case OpKind::kSilu:
      return x * Sigmoid(x);
    case OpKind::kGeluTanh: {
      const double k = std::sqrt(2.0 / std::numbers::pi);
      return 0.5 * x * (1.0 + Tanh(k * (x + 0.044715 * x * x * x)));
    }
    case OpKind::kGeluErf:
      return 0.5 * x * (1.0 + Erf(x * (1.0 / std::numbers::sqrt2)));
    case OpKind::kRelu:
      return Max(x, Expr::Const(0, c));
    case OpKind::kNot:
      return Not(x);
    case OpKind::kClamp:
      return Min(Max(x, Expr::Const(a.floats[0], c)), Expr::Const(a.floats[1], c));
    case OpKind::kCast: {
      const DType oc = ExprTypeOf(out);
      if (IsInteger(out) && (c == DType::kF32 || c == DType::kF64)) {
        // Float -> integer saturates at the target's range (NaN -> 0), as StoreElement does.
        const double lo = IsSigned(out) ? -std::ldexp(1.0, 8 * DTypeBlockBytes(out) - 1) : 0.0;
        const double hi = IsSigned(out) ? std::ldexp(1.0, 8 * DTypeBlockBytes(out) - 1) - 1
                                        : std::ldexp(1.0, 8 * DTypeBlockBytes(out)) - 1;
        const Expr xd = Expr::Cast(DType::kF64, x);
        return Expr::Cast(DType::kI64,
                          Min(Max(xd, Expr::Const(lo, DType::kF64)), Expr::Const(hi, DType::kF64)));
      }
      return Expr::Cast(oc, x);
    }
    default:
      KILN_CHECK(false, "UnaryForm: not a unary op");
  }
  return {};
}

template <OpKind K>
Expr BinaryForm(const Attrs&, DTypes in, DType) {
  const Expr x = In(0, in), y = In(1, in);
  switch (K) {
    case OpKind::kAdd:
      return x + y;
    case OpKind::kSub:
      return x - y;
    case OpKind::kMul:
      return x * y;
    case OpKind::kDiv:
      return x / y;
    case OpKind::kPow:
      return Pow(x, y);
    case OpKind::kMaximum:
      return Max(x, y);
    case OpKind::kMinimum:
      return Min(x, y);
    case OpKind::kEq:
      return Eq(x, y);
    case OpKind::kNe:
      return Ne(x, y);
    case OpKind::kLt:
      return Lt(x, y);
    case OpKind::kLe:
      return Le(x, y);
    case OpKind::kGt:
      return Gt(x, y);
    case OpKind::kGe:
      return Ge(x, y);
    case OpKind::kAnd:
      return And(x, y);
    case OpKind::kOr:
      return Or(x, y);
    default:
      KILN_CHECK(false, "BinaryForm: not a binary op");
  }
  return {};
}

Expr WhereForm(const Attrs&, DTypes in, DType) { return Select(In(0, in), In(1, in), In(2, in)); }
Expr MapForm(const Attrs& a, DTypes, DType) { return a.expr[0]; }
Expr FullForm(const Attrs& a, DTypes, DType out) {
  return Expr::Const(a.floats[0], ExprTypeOf(out));
}
Expr IotaForm(const Attrs& a, DTypes, DType out) {
  const DType c = ExprTypeOf(out);
  const Expr i =
      Expr::Cast(c == DType::kI64 ? DType::kI64 : c, Expr::Index(static_cast<int>(a.ints[0])));
  if (c == DType::kI64) {
    return Expr::Int(static_cast<int64_t>(a.floats[0])) +
           Expr::Int(static_cast<int64_t>(a.floats[1])) * i;
  }
  return Expr::Const(a.floats[0], c) + Expr::Const(a.floats[1], c) * i;
}

// Reduction forms. Index(0) is the position within the reduced elements.
template <ReduceKind K, bool kMean>
ReduceForm ReduceAxesForm(const Attrs&, DTypes in, DType) {
  ReduceForm f;
  f.stages.push_back({K, In(0, in)});
  const DType t = In(0, in).type();
  Expr acc = Expr::Acc(0, K == ReduceKind::kArgMax ? DType::kI64 : t);
  f.output = kMean ? acc / Expr::Cast(t, Expr::Count()) : acc;
  return f;
}

ReduceForm SoftmaxForm(const Attrs&, DTypes in, DType) {
  const Expr x = In(0, in);
  const DType t = x.type();
  ReduceForm f;
  f.elementwise_output = true;
  f.stages.push_back({ReduceKind::kMax, x});
  const Expr m = Expr::Acc(0, t);
  f.stages.push_back({ReduceKind::kSum, Exp(x - m)});
  // A fully masked row (max = -inf) gives zeros instead of NaNs.
  f.output = Select(Eq(m, Expr::Const(-std::numeric_limits<double>::infinity(), t)),
                    Expr::Const(0, t), Exp(x - m) / Expr::Acc(1, t));
  return f;
}

ReduceForm LogSoftmaxForm(const Attrs&, DTypes in, DType) {
  const Expr x = In(0, in);
  const DType t = x.type();
  ReduceForm f;
  f.elementwise_output = true;
  f.stages.push_back({ReduceKind::kMax, x});
  f.stages.push_back({ReduceKind::kSum, Exp(x - Expr::Acc(0, t))});
  f.output = x - Expr::Acc(0, t) - Log(Expr::Acc(1, t));
  return f;
}

ReduceForm RmsNormForm(const Attrs& a, DTypes in, DType) {
  const Expr x = In(0, in);
  const DType t = x.type();
  ReduceForm f;
  f.elementwise_output = true;
  f.stages.push_back({ReduceKind::kSum, x * x});
  f.output =
      x * Rsqrt(Expr::Acc(0, t) / Expr::Cast(t, Expr::Count()) + Expr::Const(a.floats[0], t));
  return f;
}

ReduceForm LayerNormForm(const Attrs& a, DTypes in, DType) {
  const Expr x = In(0, in);
  const DType t = x.type();
  const Expr n = Expr::Cast(t, Expr::Count());
  ReduceForm f;
  f.elementwise_output = true;
  f.stages.push_back({ReduceKind::kSum, x});
  const Expr xc = x - Expr::Acc(0, t) / n;
  f.stages.push_back({ReduceKind::kSum, xc * xc});
  f.output = xc * Rsqrt(Expr::Acc(1, t) / n + Expr::Const(a.floats[0], t));
  return f;
}

ReduceForm CrossEntropyForm(const Attrs& a, DTypes in, DType) {
  const Expr x = In(0, in), target = In(1, in);
  const DType t = x.type();
  ReduceForm f;
  f.stages.push_back({ReduceKind::kMax, x});
  f.stages.push_back({ReduceKind::kSum, Exp(x - Expr::Acc(0, t))});
  f.stages.push_back({ReduceKind::kSum, Select(Eq(Expr::Index(0), target), x, Expr::Const(0, t))});
  f.output = Select(Eq(target, Expr::Int(a.ints[0])), Expr::Const(0, t),
                    Expr::Acc(0, t) + Log(Expr::Acc(1, t)) - Expr::Acc(2, t));
  return f;
}

// ---- Backward rules ---------------------------------------------------------------------------

Value In(const BackwardArgs& a, int i) { return Value{a.node.inputs[i]}; }

// Any pointwise op with an expression form: d/d in_i = grad * d form / d in_i, as one Map.
Status BackwardPointwise(BackwardArgs& a) {
  Builder& b = a.b;
  const Node& n = a.node;
  const OpDef& def = GetOpDef(n.op);
  std::vector<DType> types;
  for (int32_t id : n.inputs) types.push_back(b.graph().node(id).dtype);
  const Expr form = def.pointwise(n.attrs, types, n.dtype);
  const int num_aux = n.op == OpKind::kMap ? MapNumAux(n.attrs) : 0;
  const int num_main = static_cast<int>(n.inputs.size()) - num_aux;
  std::vector<Value> main, aux;
  for (int i = 0; i < num_main; ++i) main.push_back(In(a, i));
  main.push_back(a.grad);
  for (int i = num_main; i < static_cast<int>(n.inputs.size()); ++i) aux.push_back(In(a, i));
  const Expr g = Expr::Input(num_main, ExprTypeOf(b.dtype(a.grad)));
  for (int i = 0; i < num_main; ++i) {
    if (!IsFloat(types[i])) continue;
    const Expr d = Diff(form, i);
    if (d.node().op == ExprOp::kConst && d.node().fvalue == 0) continue;
    a.input_grads[i] = b.Map(g * d, main, types[i], aux);
  }
  return OkStatus();
}

Status BackwardAdd(BackwardArgs& a) {
  a.input_grads[0] = a.grad;
  a.input_grads[1] = a.grad;
  return OkStatus();
}
Status BackwardSub(BackwardArgs& a) {
  a.input_grads[0] = a.grad;
  a.input_grads[1] = a.b.Neg(a.grad);
  return OkStatus();
}
Status BackwardMul(BackwardArgs& a) {
  a.input_grads[0] = a.b.Mul(a.grad, In(a, 1));
  a.input_grads[1] = a.b.Mul(a.grad, In(a, 0));
  return OkStatus();
}
Status BackwardDiv(BackwardArgs& a) {
  Builder& b = a.b;
  a.input_grads[0] = b.Div(a.grad, In(a, 1));
  a.input_grads[1] = b.Neg(b.Mul(a.grad, b.Div(a.out, In(a, 1))));
  return OkStatus();
}
Status BackwardNeg(BackwardArgs& a) {
  a.input_grads[0] = a.b.Neg(a.grad);
  return OkStatus();
}
Status BackwardWhere(BackwardArgs& a) {
  Builder& b = a.b;
  const Value zero = b.ZerosLike(a.grad);
  a.input_grads[1] = b.Where(In(a, 0), a.grad, zero);
  a.input_grads[2] = b.Where(In(a, 0), zero, a.grad);
  return OkStatus();
}
Status BackwardCast(BackwardArgs& a) {
  const DType in = a.b.dtype(In(a, 0));
  if (IsFloat(in) && IsFloat(a.node.dtype)) a.input_grads[0] = a.b.Cast(a.grad, in);
  return OkStatus();
}
Status BackwardIdentity(BackwardArgs& a) {
  a.input_grads[0] = a.grad;
  return OkStatus();
}

// Reductions: the gradient broadcast back over the reduced axes.
SymShape KeepDimShape(const SymShape& in, const Attrs& attrs) {
  SymShape s = in;
  for (size_t i = 1; i < attrs.ints.size(); ++i) s[attrs.ints[i]] = 1;
  return s;
}
Value ToKeepDim(Builder& b, Value v, const SymShape& in, const Attrs& attrs) {
  return attrs.ints[0] ? v : b.Reshape(v, KeepDimShape(in, attrs));
}
std::vector<int> AxesOf(const Attrs& attrs) {
  return std::vector<int>(attrs.ints.begin() + 1, attrs.ints.end());
}

Status BackwardSum(BackwardArgs& a) {
  Builder& b = a.b;
  const SymShape in = b.shape(In(a, 0));
  a.input_grads[0] = b.Expand(ToKeepDim(b, a.grad, in, a.node.attrs), in);
  return OkStatus();
}

Status BackwardMean(BackwardArgs& a) {
  Builder& b = a.b;
  const SymShape in = b.shape(In(a, 0));
  Dim count = 1;
  for (int ax : AxesOf(a.node.attrs)) count *= in[ax];
  Value g = b.Expand(ToKeepDim(b, a.grad, in, a.node.attrs), in);
  if (auto c = count.TryConstant()) {
    a.input_grads[0] = b.MulScalar(g, 1.0 / static_cast<double>(*c));
  } else {
    a.input_grads[0] = b.Div(g, b.DimValue(count, b.dtype(g)));
  }
  return OkStatus();
}

// Max/min: the gradient is shared evenly by the elements equal to the result.
Status BackwardMaxMin(BackwardArgs& a) {
  Builder& b = a.b;
  const Value x = In(a, 0);
  const SymShape in = b.shape(x);
  const Value mask = b.Cast(b.Eq(x, ToKeepDim(b, a.out, in, a.node.attrs)), b.dtype(x));
  const Value count = b.Sum(mask, AxesOf(a.node.attrs), /*keepdim=*/true);
  a.input_grads[0] = b.Mul(mask, b.Div(ToKeepDim(b, a.grad, in, a.node.attrs), count));
  return OkStatus();
}

Status BackwardSoftmax(BackwardArgs& a) {
  Builder& b = a.b;
  const Value y = a.out, g = a.grad;
  a.input_grads[0] = b.Mul(y, b.Sub(g, b.Sum(b.Mul(g, y), {-1}, true)));
  return OkStatus();
}

Status BackwardLogSoftmax(BackwardArgs& a) {
  Builder& b = a.b;
  a.input_grads[0] = b.Sub(a.grad, b.Mul(b.Exp(a.out), b.Sum(a.grad, {-1}, true)));
  return OkStatus();
}

// y = x * r with r = rsqrt(mean(x^2) + eps): dx = r * (g - y * mean(g * y)).
Status BackwardRmsNorm(BackwardArgs& a) {
  Builder& b = a.b;
  const Value x = In(a, 0), y = a.out, g = a.grad;
  const Value r = b.Rsqrt(b.AddScalar(b.Mean(b.Mul(x, x), {-1}, true), a.node.attrs.floats[0]));
  a.input_grads[0] = b.Mul(r, b.Sub(g, b.Mul(y, b.Mean(b.Mul(g, y), {-1}, true))));
  return OkStatus();
}

// y = (x - mu) * r: dx = r * (g - mean(g) - y * mean(g * y)).
Status BackwardLayerNorm(BackwardArgs& a) {
  Builder& b = a.b;
  const Value x = In(a, 0), y = a.out, g = a.grad;
  const Value xc = b.Sub(x, b.Mean(x, {-1}, true));
  const Value r = b.Rsqrt(b.AddScalar(b.Mean(b.Mul(xc, xc), {-1}, true), a.node.attrs.floats[0]));
  const Value inner =
      b.Sub(b.Sub(g, b.Mean(g, {-1}, true)), b.Mul(y, b.Mean(b.Mul(g, y), {-1}, true)));
  a.input_grads[0] = b.Mul(r, inner);
  return OkStatus();
}

// d loss_n / d logits_n = (softmax(logits_n) - onehot(target_n)) * g_n (0 for ignored rows).
Status BackwardCrossEntropy(BackwardArgs& a) {
  Builder& b = a.b;
  const Value logits = In(a, 0), targets = In(a, 1);
  const DType t = b.dtype(logits);
  const SymShape& ls = b.shape(logits);
  const int last = static_cast<int>(ls.size()) - 1;
  const Value classes = b.Iota(b.dtype(targets), ls, last);
  const Value tcol = b.Unsqueeze(targets, -1);
  const Value onehot = b.Cast(b.Eq(classes, tcol), t);
  const Value ignore = b.Full(static_cast<double>(a.node.attrs.ints[0]), b.dtype(targets), {});
  const Value valid = b.Cast(b.Ne(targets, ignore), t);
  const Value scale = b.Unsqueeze(b.Mul(a.grad, valid), -1);
  a.input_grads[0] = b.Mul(b.Sub(b.Softmax(logits), onehot), scale);
  return OkStatus();
}

Status BackwardReshape(BackwardArgs& a) {
  a.input_grads[0] = a.b.Reshape(a.grad, a.b.shape(In(a, 0)));
  return OkStatus();
}

Status BackwardPermute(BackwardArgs& a) {
  std::vector<int> inv(a.node.attrs.ints.size());
  for (size_t i = 0; i < inv.size(); ++i) inv[a.node.attrs.ints[i]] = static_cast<int>(i);
  a.input_grads[0] = a.b.Permute(a.grad, inv);
  return OkStatus();
}

// The gradient of a slice is the gradient placed back between zeros.
Status BackwardSlice(BackwardArgs& a) {
  Builder& b = a.b;
  const SymShape in = b.shape(In(a, 0));
  const int axis = static_cast<int>(a.node.attrs.ints[0]);
  const Dim start = a.node.attrs.dims[0], size = a.node.attrs.dims[1];
  std::vector<Value> parts;
  auto zeros = [&](const Dim& n) {
    SymShape s = in;
    s[axis] = n;
    return b.Full(0, b.dtype(a.grad), s);
  };
  if (start != Dim(0)) parts.push_back(zeros(start));
  parts.push_back(a.grad);
  const Dim rest = in[axis] - start - size;
  if (rest != Dim(0)) parts.push_back(zeros(rest));
  a.input_grads[0] = parts.size() == 1 ? a.grad : b.Concat(parts, axis);
  return OkStatus();
}

Status BackwardExpand(BackwardArgs& a) {
  a.input_grads[0] = a.b.SumTo(a.grad, a.b.shape(In(a, 0)));
  return OkStatus();
}

Status BackwardConcat(BackwardArgs& a) {
  Builder& b = a.b;
  const int axis = static_cast<int>(a.node.attrs.ints[0]);
  Dim offset = 0;
  for (size_t i = 0; i < a.node.inputs.size(); ++i) {
    const Dim size = b.shape(In(a, static_cast<int>(i)))[axis];
    a.input_grads[i] = b.Slice(a.grad, axis, offset, size);
    offset += size;
  }
  return OkStatus();
}

Status BackwardGather(BackwardArgs& a) {
  Builder& b = a.b;
  const Value table = In(a, 0);
  if (IsFloat(b.dtype(table)) && b.dtype(table) == a.node.dtype) {
    a.input_grads[0] = b.ScatterAddRows(In(a, 1), a.grad, b.shape(table)[0]);
  }
  return OkStatus();
}

Status BackwardScatterAddRows(BackwardArgs& a) {
  a.input_grads[1] = a.b.Gather(a.grad, In(a, 0));
  return OkStatus();
}

Status BackwardTakeAlong(BackwardArgs& a) {
  Builder& b = a.b;
  a.input_grads[0] = b.ScatterAddAlong(In(a, 1), a.grad, b.shape(In(a, 0)).back());
  return OkStatus();
}

Status BackwardScatterAddAlong(BackwardArgs& a) {
  a.input_grads[1] = a.b.TakeAlong(a.grad, In(a, 0));
  return OkStatus();
}

Status BackwardMatMul(BackwardArgs& a) {
  Builder& b = a.b;
  const Value x = In(a, 0), y = In(a, 1);
  if (b.dtype(y) != b.dtype(x)) {
    // Mixed (rank 2): g y^T is a linear with y as its weight; a quantized y has no gradient.
    a.input_grads[0] = b.Linear(a.grad, y);
    if (IsFloat(b.dtype(y))) {
      a.input_grads[1] = b.Cast(b.MatMul(b.Transpose(x, 0, 1), a.grad), b.dtype(y));
    }
    return OkStatus();
  }
  a.input_grads[0] = b.MatMul(a.grad, b.Transpose(y, -1, -2));
  a.input_grads[1] = b.MatMul(b.Transpose(x, -1, -2), a.grad);
  return OkStatus();
}

// y = x w^T over the flattened leading axes: dx = g w, dw = g^T x.
Status BackwardLinear(BackwardArgs& a) {
  Builder& b = a.b;
  const Value x = In(a, 0), w = In(a, 1);
  const DType xt = b.dtype(x), wt = b.dtype(w);
  const SymShape xs = b.shape(x);
  const Dim k = xs.back(), n = b.shape(w)[0];
  const Dim m = NumElements(SymShape(xs.begin(), xs.end() - 1));
  const Value g2 = b.Reshape(a.grad, {m, n});
  // A w of another type is read as it is (matmul decodes it; no f32 copy of the weight).
  a.input_grads[0] = b.Reshape(b.MatMul(g2, w), xs);
  if (IsFloat(wt)) {
    // dw = g^T x reads g transposed (a copy of [m, n]); when K is much smaller than N (a LoRA
    // B, [N, r]), (x^T g)^T copies only x's [m, k].
    const std::optional<int64_t> kc = k.TryConstant(), nc = n.TryConstant();
    const bool narrow = kc && nc && *kc * 4 <= *nc;
    const Value x2 = b.Reshape(x, {m, k});
    const Value gw = narrow ? b.Contiguous(b.Transpose(b.MatMul(b.Transpose(x2, 0, 1), g2), 0, 1))
                            : b.MatMul(b.Transpose(g2, 0, 1), x2);
    a.input_grads[1] = wt == xt ? gw : b.Cast(gw, wt);
  }
  return OkStatus();
}

// Rope is a rotation: its backward rotates the gradient back.
Status BackwardRope(BackwardArgs& a) {
  Builder& b = a.b;
  Attrs attrs = a.node.attrs;
  attrs.ints[3] = attrs.ints[3] ? 0 : 1;
  const Value ins[] = {a.grad, In(a, 1)};
  a.input_grads[0] = b.AddNode(OpKind::kRope, ins, attrs);
  return OkStatus();
}

}  // namespace

namespace {

// k/v heads [B, Hkv, T, d] repeated to the query's Hq heads (GQA) as a view.
Value ExpandHeads(Builder& b, Value x, const Dim& hq) {
  const SymShape s = b.shape(x);
  if (s[1] == hq) return x;
  const Dim groups = *hq.DivExact(s[1]);
  Value e = b.Expand(b.Reshape(x, {s[0], s[1], 1, s[2], s[3]}), {s[0], s[1], groups, s[2], s[3]});
  return b.Reshape(e, {s[0], hq, s[2], s[3]});
}

// The scaled scores q k^T after score_mod, masked to -inf where mask_mod is false.
Value MaskedScores(Builder& b, Value q, Value k, const Attrs& attrs, std::span<const Value> aux) {
  const DType t = b.dtype(q);
  const Value kx = ExpandHeads(b, k, b.shape(q)[1]);
  Value s = b.MulScalar(b.MatMul(q, b.Transpose(kx, 2, 3)), attrs.floats[0]);
  const std::vector<Value> aux_v(aux.begin(), aux.end());
  if (attrs.expr[1]) {
    const Expr mod = Substitute(attrs.expr[1], std::vector<Expr>{Expr::Input(0, ExprTypeOf(t))});
    const Value ins[] = {s};
    s = b.Map(Expr::Cast(ExprTypeOf(t), mod), ins, t, aux_v);
  }
  if (attrs.expr[0]) {
    Attrs m;
    m.expr[0] = attrs.expr[0];
    m.dims = b.shape(s);
    m.dtype = DType::kBool;
    m.ints = {static_cast<int64_t>(aux_v.size())};
    const Value mask = b.AddNode(OpKind::kMap, aux_v, m);
    s = b.Where(mask, s, b.Full(-std::numeric_limits<double>::infinity(), t, {}));
  }
  return s;
}

// logsumexp over the last axis, computed in the scores' compute type: -inf for rows that are
// entirely -inf, with finite gradients there (zero) instead of NaNs.
Value LogSumExpRows(Builder& b, Value s) {
  s = b.Cast(s, ExprTypeOf(b.dtype(s)));
  const DType t = b.dtype(s);
  const Value neg_inf = b.Full(-std::numeric_limits<double>::infinity(), t, {});
  const Value m = b.Max(s, {-1}, /*keepdim=*/true);
  const Value masked = b.Eq(m, neg_inf);
  const Value m_safe = b.Where(masked, b.Full(0, t, {}), m);
  const Value sum = b.Sum(b.Exp(b.Sub(s, m_safe)), {-1}, /*keepdim=*/true);
  const Value sum_safe = b.Where(masked, b.Full(1, t, {}), sum);
  return b.Squeeze(b.Where(masked, neg_inf, b.Add(m_safe, b.Log(sum_safe))), -1);
}

}  // namespace

// Dense attention as other ops (used by its backward rule, and by the harness as a second
// opinion on the reference kernel).
Value AttentionDecomposed(Builder& b, Value q, Value k, Value v, const Attrs& attrs_in,
                          std::span<const Value> aux) {
  const Attrs attrs = attrs_in;  // may point into the graph, which grows below
  const Value s = MaskedScores(b, q, k, attrs, aux);
  return b.MatMul(b.Softmax(s), ExpandHeads(b, v, b.shape(q)[1]));
}

Value AttentionLseDecomposed(Builder& b, Value q, Value k, const Attrs& attrs_in,
                             std::span<const Value> aux) {
  const Attrs attrs = attrs_in;
  return LogSumExpRows(b, MaskedScores(b, q, k, attrs, aux));
}

namespace {

// Recompute the forward through other ops and differentiate that (flash-attention backward
// recomputes too); gradients of GQA-shared k/v heads sum through the Expand. Gradients may
// flow into the output, the log-sum-exp, or both.
Status BackwardAttention(BackwardArgs& a) {
  Builder& b = a.b;
  const Attrs attrs = a.node.attrs;
  std::vector<Value> aux;
  for (size_t i = 3; i < a.node.inputs.size(); ++i) aux.push_back(In(a, static_cast<int>(i)));
  const Value q = In(a, 0), k = In(a, 1), v = In(a, 2);
  const bool lse_grad = a.grads.size() > 1 && a.grads[1].valid();
  if (attrs.ints.size() == 2 && attrs.ints[1] == 1 && !lse_grad && a.outs.size() > 1) {
    Attrs ba;
    ba.floats = attrs.floats;
    ba.expr[0] = attrs.expr[0];
    std::vector<Value> in = {q, k, v, a.out, a.grad, a.outs[1]};
    in.insert(in.end(), aux.begin(), aux.end());
    const std::vector<Value> g = b.AddNodeOutputs(OpKind::kAttentionBackward, in, std::move(ba));
    KILN_RETURN_IF_ERROR(b.status());
    if (g.size() != 3) return InvalidArgument("attention_backward must have 3 outputs");
    for (int i = 0; i < 3; ++i) a.input_grads[i] = g[i];
    return OkStatus();
  }
  const Value s = MaskedScores(b, q, k, attrs, aux);
  std::vector<Value> outs, seeds;
  if (a.grad.valid()) {
    outs.push_back(b.MatMul(b.Softmax(s), ExpandHeads(b, v, b.shape(q)[1])));
    seeds.push_back(a.grad);
  }
  if (a.grads.size() > 1 && a.grads[1].valid()) {
    outs.push_back(LogSumExpRows(b, s));
    seeds.push_back(a.grads[1]);
  }
  const Value wrt[] = {q, k, v};
  KILN_ASSIGN_OR_RETURN(std::vector<Value> g, Gradients(b, outs, seeds, wrt));
  for (int i = 0; i < 3; ++i) a.input_grads[i] = g[i];
  return OkStatus();
}

// The loss output's gradient is cross_entropy's; dlogits, itself a gradient, has none.
Status BackwardFusedCrossEntropy(BackwardArgs& a) {
  if (a.grads.size() > 1 && a.grads[1].valid()) {
    return InvalidArgument(
        "fused_cross_entropy's dlogits output is already a gradient and cannot be "
        "differentiated (no second derivatives); differentiate its loss output or use "
        "cross_entropy");
  }
  return BackwardCrossEntropy(a);
}

using FormFn = Expr (*)(const Attrs&, DTypes, DType);
using ReduceFn = ReduceForm (*)(const Attrs&, DTypes, DType);
using InferFn = StatusOr<TensorType> (*)(Types, const Attrs&);
using BackwardFn = Status (*)(BackwardArgs&);

using InferExtraFn = StatusOr<std::vector<TensorType>> (*)(Types, const Attrs&);

struct Table {
  std::array<OpDef, static_cast<size_t>(OpKind::kNumOps)> defs{};
  void Set(OpKind op, const char* name, OpClass cls, int min_in, int max_in, InferFn infer,
           BackwardFn backward = nullptr, FormFn form = nullptr, ReduceFn reduce = nullptr,
           bool side_effect = false, int reuse = -1) {
    defs[static_cast<size_t>(op)] = OpDef{.op = op,
                                          .name = name,
                                          .cls = cls,
                                          .min_inputs = min_in,
                                          .max_inputs = max_in,
                                          .infer = infer,
                                          .backward = backward,
                                          .pointwise = form,
                                          .reduce = reduce,
                                          .side_effect = side_effect,
                                          .reuse_input = reuse,
                                          .infer_extra = nullptr,
                                          .writes_input = {-1, -1, -1, -1}};
  }
  // Multi-output and in-place facts of an op already Set: `writes[i]` is the input output i
  // overwrites (-1: none); ops that write in place are side effects.
  void SetOutputs(OpKind op, InferExtraFn extra, std::array<int8_t, kMaxOutputs> writes) {
    OpDef& d = defs[static_cast<size_t>(op)];
    d.infer_extra = extra;
    d.writes_input = writes;
    for (int8_t w : writes) d.side_effect |= w >= 0;
  }
};

Table BuildTable() {
  Table t;
  using C = OpClass;
  using K = OpKind;
  t.Set(K::kInput, "input", C::kSource, 0, 0, InferSource);
  t.Set(K::kWeight, "weight", C::kSource, 0, 0, InferSource);
  t.Set(K::kState, "state", C::kSource, 0, 0, InferSource);
  t.Set(K::kFull, "full", C::kGenerator, 0, 0, InferFull, nullptr, FullForm);
  t.Set(K::kIota, "iota", C::kGenerator, 0, 0, InferIota, nullptr, IotaForm);
  t.Set(K::kDimValue, "dim_value", C::kGenerator, 0, 0, InferDimValue);
  auto unary = [&](K op, const char* name, InferFn infer, FormFn form,
                   BackwardFn bw = BackwardPointwise) {
    t.Set(op, name, C::kPointwise, 1, 1, infer, bw, form, nullptr, false, 0);
  };
  unary(K::kNeg, "neg", InferUnaryNumeric, UnaryForm<K::kNeg>, BackwardNeg);
  unary(K::kAbs, "abs", InferUnaryNumeric, UnaryForm<K::kAbs>);
  unary(K::kExp, "exp", InferUnaryFloat, UnaryForm<K::kExp>);
  unary(K::kLog, "log", InferUnaryFloat, UnaryForm<K::kLog>);
  unary(K::kSqrt, "sqrt", InferUnaryFloat, UnaryForm<K::kSqrt>);
  unary(K::kRsqrt, "rsqrt", InferUnaryFloat, UnaryForm<K::kRsqrt>);
  unary(K::kTanh, "tanh", InferUnaryFloat, UnaryForm<K::kTanh>);
  unary(K::kSigmoid, "sigmoid", InferUnaryFloat, UnaryForm<K::kSigmoid>);
  unary(K::kSilu, "silu", InferUnaryFloat, UnaryForm<K::kSilu>);
  unary(K::kGeluTanh, "gelu_tanh", InferUnaryFloat, UnaryForm<K::kGeluTanh>);
  unary(K::kGeluErf, "gelu_erf", InferUnaryFloat, UnaryForm<K::kGeluErf>);
  unary(K::kRelu, "relu", InferUnaryNumeric, UnaryForm<K::kRelu>);
  unary(K::kNot, "not", InferNot, UnaryForm<K::kNot>, nullptr);
  unary(K::kCast, "cast", InferCast, UnaryForm<K::kCast>, BackwardCast);
  unary(K::kClamp, "clamp", InferClamp, UnaryForm<K::kClamp>);
  auto binary = [&](K op, const char* name, InferFn infer, FormFn form, BackwardFn bw) {
    t.Set(op, name, C::kPointwise, 2, 2, infer, bw, form, nullptr, false, 0);
  };
  binary(K::kAdd, "add", InferBinaryArith, BinaryForm<K::kAdd>, BackwardAdd);
  binary(K::kSub, "sub", InferBinaryArith, BinaryForm<K::kSub>, BackwardSub);
  binary(K::kMul, "mul", InferBinaryArith, BinaryForm<K::kMul>, BackwardMul);
  binary(K::kDiv, "div", InferBinaryArith, BinaryForm<K::kDiv>, BackwardDiv);
  binary(K::kPow, "pow", InferPow, BinaryForm<K::kPow>, BackwardPointwise);
  binary(K::kMaximum, "maximum", InferBinaryArith, BinaryForm<K::kMaximum>, BackwardPointwise);
  binary(K::kMinimum, "minimum", InferBinaryArith, BinaryForm<K::kMinimum>, BackwardPointwise);
  binary(K::kEq, "eq", InferCompare, BinaryForm<K::kEq>, nullptr);
  binary(K::kNe, "ne", InferCompare, BinaryForm<K::kNe>, nullptr);
  binary(K::kLt, "lt", InferCompare, BinaryForm<K::kLt>, nullptr);
  binary(K::kLe, "le", InferCompare, BinaryForm<K::kLe>, nullptr);
  binary(K::kGt, "gt", InferCompare, BinaryForm<K::kGt>, nullptr);
  binary(K::kGe, "ge", InferCompare, BinaryForm<K::kGe>, nullptr);
  binary(K::kAnd, "and", InferLogical, BinaryForm<K::kAnd>, nullptr);
  binary(K::kOr, "or", InferLogical, BinaryForm<K::kOr>, nullptr);
  t.Set(K::kWhere, "where", C::kPointwise, 3, 3, InferWhere, BackwardWhere, WhereForm, nullptr,
        false, 1);
  t.Set(K::kMap, "map", C::kPointwise, 0, -1, InferMap, BackwardPointwise, MapForm, nullptr, false,
        0);
  t.Set(K::kSum, "sum", C::kReduce, 1, 1, InferReduce, BackwardSum, nullptr,
        ReduceAxesForm<ReduceKind::kSum, false>);
  t.Set(K::kMean, "mean", C::kReduce, 1, 1, InferMean, BackwardMean, nullptr,
        ReduceAxesForm<ReduceKind::kSum, true>);
  t.Set(K::kMax, "max", C::kReduce, 1, 1, InferReduce, BackwardMaxMin, nullptr,
        ReduceAxesForm<ReduceKind::kMax, false>);
  t.Set(K::kMin, "min", C::kReduce, 1, 1, InferReduce, BackwardMaxMin, nullptr,
        ReduceAxesForm<ReduceKind::kMin, false>);
  t.Set(K::kArgMax, "argmax", C::kReduce, 1, 1, InferArgMax, nullptr, nullptr,
        ReduceAxesForm<ReduceKind::kArgMax, false>);
  t.Set(K::kSoftmax, "softmax", C::kRow, 1, 1, InferRow, BackwardSoftmax, nullptr, SoftmaxForm);
  t.Set(K::kLogSoftmax, "log_softmax", C::kRow, 1, 1, InferRow, BackwardLogSoftmax, nullptr,
        LogSoftmaxForm);
  t.Set(K::kRmsNorm, "rms_norm", C::kRow, 1, 1, InferNorm, BackwardRmsNorm, nullptr, RmsNormForm);
  t.Set(K::kLayerNorm, "layer_norm", C::kRow, 1, 1, InferNorm, BackwardLayerNorm, nullptr,
        LayerNormForm);
  t.Set(K::kCrossEntropy, "cross_entropy", C::kRow, 2, 2, InferCrossEntropy, BackwardCrossEntropy,
        nullptr, CrossEntropyForm);
  t.Set(K::kReshape, "reshape", C::kView, 1, 1, InferReshape, BackwardReshape);
  t.Set(K::kPermute, "permute", C::kView, 1, 1, InferPermute, BackwardPermute);
  t.Set(K::kSlice, "slice", C::kView, 1, 1, InferSlice, BackwardSlice);
  t.Set(K::kExpand, "expand", C::kView, 1, 1, InferExpand, BackwardExpand);
  t.Set(K::kConcat, "concat", C::kOther, 1, -1, InferConcat, BackwardConcat);
  t.Set(K::kContiguous, "contiguous", C::kOther, 1, 1, InferSame, BackwardIdentity);
  t.Set(K::kGather, "gather", C::kOther, 2, 2, InferGather, BackwardGather);
  t.Set(K::kScatterAddRows, "scatter_add_rows", C::kOther, 2, 2, InferScatterAddRows,
        BackwardScatterAddRows);
  t.Set(K::kTakeAlong, "take_along", C::kOther, 2, 2, InferTakeAlong, BackwardTakeAlong);
  t.Set(K::kScatterAddAlong, "scatter_add_along", C::kOther, 2, 2, InferScatterAddAlong,
        BackwardScatterAddAlong);
  t.Set(K::kTopK, "top_k", C::kOther, 1, 1, InferTopK);
  t.Set(K::kMatMul, "matmul", C::kOther, 2, 2, InferMatMul, BackwardMatMul);
  t.Set(K::kLinear, "linear", C::kOther, 2, 2, InferLinear, BackwardLinear);
  t.Set(K::kRope, "rope", C::kOther, 2, 2, InferRope, BackwardRope);
  t.Set(K::kAttention, "attention", C::kOther, 3, -1, InferAttention, BackwardAttention);
  t.SetOutputs(K::kAttention, InferAttentionExtra, {-1, -1, -1, -1});
  t.Set(K::kAttentionBackward, "attention_backward", C::kOther, 6, -1, InferAttentionBackward);
  t.SetOutputs(K::kAttentionBackward, InferAttentionBackwardExtra, {-1, -1, -1, -1});
  t.Set(K::kPagedAttention, "paged_attention", C::kOther, 6, -1, InferPagedAttention);
  t.Set(K::kKvWrite, "kv_write", C::kOther, 3, 3, InferKvWrite);
  t.SetOutputs(K::kKvWrite, nullptr, {0, -1, -1, -1});
  t.Set(K::kOutputOf, "output_of", C::kProjection, 1, 1, InferOutputOf);
  t.Set(K::kFusedCrossEntropy, "fused_cross_entropy", C::kOther, 3, 3, InferFusedCrossEntropy,
        BackwardFusedCrossEntropy);
  t.SetOutputs(K::kFusedCrossEntropy, InferFusedCrossEntropyExtra, {-1, -1, -1, -1});
  t.Set(K::kAdamW, "adamw", C::kOther, 3, 6, InferOptimizer<K::kAdamW>);
  t.SetOutputs(K::kAdamW, InferOptimizerExtra<K::kAdamW>, {0, 3, 4, -1});
  t.Set(K::kAdam, "adam", C::kOther, 3, 6, InferOptimizer<K::kAdam>);
  t.SetOutputs(K::kAdam, InferOptimizerExtra<K::kAdam>, {0, 3, 4, -1});
  t.Set(K::kSgd, "sgd", C::kOther, 3, 5, InferOptimizer<K::kSgd>);
  t.SetOutputs(K::kSgd, InferOptimizerExtra<K::kSgd>, {0, 3, -1, -1});
  t.Set(K::kAdagrad, "adagrad", C::kOther, 3, 5, InferOptimizer<K::kAdagrad>);
  t.SetOutputs(K::kAdagrad, InferOptimizerExtra<K::kAdagrad>, {0, 3, -1, -1});
  t.Set(K::kSample, "sample", C::kOther, 6, 8, InferSample);
  t.SetOutputs(K::kSample, InferSampleExtra, {-1, -1, -1, -1});
  for (size_t i = 0; i < t.defs.size(); ++i) {
    KILN_CHECK(t.defs[i].name != nullptr && t.defs[i].op == static_cast<OpKind>(i),
               "op table: an OpKind has no entry");
  }
  return t;
}

const Table& GetTable() {
  static const Table* table = new Table(BuildTable());
  return *table;
}

std::string Join(std::span<const int64_t> v) {
  return absl::StrCat("[", absl::StrJoin(v, ","), "]");
}

}  // namespace

const OpDef& GetOpDef(OpKind op) {
  const size_t i = static_cast<size_t>(op);
  KILN_CHECK(i < static_cast<size_t>(OpKind::kNumOps), "GetOpDef: op out of range");
  return GetTable().defs[i];
}

const char* OpName(OpKind op) { return GetOpDef(op).name; }

int OptimizerStateCount(OpKind op, const Attrs& a) {
  if (op == OpKind::kAdamW || op == OpKind::kAdam) return 2;
  if (op == OpKind::kSgd) return !a.floats.empty() && a.floats[0] != 0 ? 1 : 0;
  return 1;  // adagrad
}

StatusOr<std::vector<TensorType>> InferOutputs(OpKind op, std::span<const TensorType> in,
                                               const Attrs& attrs) {
  const OpDef& def = GetOpDef(op);
  KILN_ASSIGN_OR_RETURN(TensorType out, def.infer(in, attrs));
  std::vector<TensorType> outs = {std::move(out)};
  if (def.infer_extra != nullptr) {
    KILN_ASSIGN_OR_RETURN(std::vector<TensorType> extra, def.infer_extra(in, attrs));
    if (extra.size() + 1 > static_cast<size_t>(kMaxOutputs)) {
      return Internal(def.name, ": more than ", kMaxOutputs, " outputs");
    }
    for (TensorType& t : extra) outs.push_back(std::move(t));
  }
  return outs;
}

bool IsLaunched(OpKind op) {
  const OpClass c = GetOpDef(op).cls;
  return c != OpClass::kSource && c != OpClass::kView && c != OpClass::kProjection;
}

bool operator==(const Attrs& a, const Attrs& b) {
  return a.ints == b.ints && a.floats == b.floats && a.dims == b.dims && a.expr[0] == b.expr[0] &&
         a.expr[1] == b.expr[1] && a.dtype == b.dtype;
}

uint64_t Attrs::Hash() const {
  size_t h = absl::HashOf(static_cast<int>(dtype), ints.size(), floats.size(), dims.size());
  for (int64_t v : ints) h = absl::HashOf(h, v);
  for (double v : floats) h = absl::HashOf(h, v);
  for (const Dim& d : dims) h = absl::HashOf(h, d);
  return absl::HashOf(h, expr[0].Hash(), expr[1].Hash());
}

std::string Attrs::ToString(OpKind op, std::span<const std::string> names) const {
  auto dims_str = [&](size_t from) {
    std::vector<std::string> parts;
    for (size_t i = from; i < dims.size(); ++i) parts.push_back(dims[i].ToString(names));
    return absl::StrCat("[", absl::StrJoin(parts, ","), "]");
  };
  const std::span<const int64_t> iv(ints.data(), ints.size());
  switch (op) {
    case OpKind::kInput:
    case OpKind::kWeight:
    case OpKind::kState:
      return "";
    case OpKind::kFull:
      return absl::StrCat(" value=", floats[0]);
    case OpKind::kIota:
      return absl::StrCat(" axis=", ints[0], " start=", floats[0], " step=", floats[1]);
    case OpKind::kDimValue:
      return absl::StrCat(" dim=", dims[0].ToString(names));
    case OpKind::kClamp:
      return absl::StrCat(" lo=", floats[0], " hi=", floats[1]);
    case OpKind::kMap:
      return absl::StrCat(" expr=", expr[0].ToString(),
                          ints.empty() || ints[0] == 0 ? "" : absl::StrCat(" aux=", ints[0]));
    case OpKind::kSum:
    case OpKind::kMean:
    case OpKind::kMax:
    case OpKind::kMin:
      return absl::StrCat(" axes=", Join(iv.subspan(1)), " keepdim=", ints[0]);
    case OpKind::kArgMax:
      return absl::StrCat(" axis=", ints[1], " keepdim=", ints[0]);
    case OpKind::kRmsNorm:
    case OpKind::kLayerNorm:
      return absl::StrCat(" eps=", floats[0]);
    case OpKind::kCrossEntropy:
    case OpKind::kFusedCrossEntropy:
      return absl::StrCat(" ignore_index=", ints[0]);
    case OpKind::kOutputOf:
      return absl::StrCat(" index=", ints[0]);
    case OpKind::kAdamW:
    case OpKind::kAdam:
      return absl::StrCat(" beta1=", floats[0], " beta2=", floats[1], " eps=", floats[2],
                          " weight_decay=", floats[3]);
    case OpKind::kSgd:
      return absl::StrCat(" momentum=", floats[0], " dampening=", floats[1],
                          " weight_decay=", floats[2], " nesterov=", ints[0]);
    case OpKind::kAdagrad:
      return absl::StrCat(" lr_decay=", floats[0], " weight_decay=", floats[1],
                          " initial_accumulator_value=", floats[2], " eps=", floats[3]);
    case OpKind::kReshape:
    case OpKind::kExpand:
      return absl::StrCat(" shape=", dims_str(0));
    case OpKind::kPermute:
      return absl::StrCat(" perm=", Join(iv));
    case OpKind::kSlice:
      return absl::StrCat(" axis=", ints[0], " start=", dims[0].ToString(names),
                          " size=", dims[1].ToString(names));
    case OpKind::kConcat:
      return absl::StrCat(" axis=", ints[0]);
    case OpKind::kScatterAddRows:
      return absl::StrCat(" rows=", dims[0].ToString(names));
    case OpKind::kScatterAddAlong:
      return absl::StrCat(" n=", dims[0].ToString(names));
    case OpKind::kTopK:
      return absl::StrCat(" k=", ints[0]);
    case OpKind::kRope: {
      static constexpr const char* kLayouts[] = {"neox", "interleaved"};
      static constexpr const char* kScalings[] = {"none", "linear", "llama3"};
      std::string s = absl::StrCat(" rotary_dim=", ints[0], " layout=", kLayouts[ints[1] & 1],
                                   " theta=", floats[0]);
      if (ints[2]) absl::StrAppend(&s, " scaling=", kScalings[ints[2] % 3], " factor=", floats[1]);
      if (ints[2] == 2) {
        absl::StrAppend(&s, " low=", floats[2], " high=", floats[3], " orig=", floats[4]);
      }
      if (ints[3]) s += " inverse";
      return s;
    }
    case OpKind::kAttention:
    case OpKind::kAttentionBackward:
    case OpKind::kPagedAttention: {
      std::string s = absl::StrCat(" scale=", floats[0]);
      if (expr[0]) absl::StrAppend(&s, " mask=", expr[0].ToString());
      if (expr[1]) absl::StrAppend(&s, " score=", expr[1].ToString());
      if (!ints.empty() && ints[0] == 1) s += " lse";
      if (ints.size() > 1 && ints[1] == 1) s += " fused_backward";
      return s;
    }
    default:
      break;
  }
  std::string s;
  if (!ints.empty()) absl::StrAppend(&s, " ints=", Join(iv));
  if (!floats.empty()) absl::StrAppend(&s, " floats=[", absl::StrJoin(floats, ","), "]");
  if (!dims.empty()) absl::StrAppend(&s, " dims=", dims_str(0));
  return s;
}

double RopeInvFreq(const Attrs& at, int64_t i) {
  const double rd = static_cast<double>(at.ints[0]);
  const double theta = at.floats[0], factor = at.floats[1];
  double f = std::pow(theta, -2.0 * static_cast<double>(i) / rd);
  switch (at.ints[2]) {
    case 1:  // linear: positions / factor
      return f / factor;
    case 2: {  // llama3: divide low frequencies, keep high ones, blend in between
      const double low = at.floats[2], high = at.floats[3], orig = at.floats[4];
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen < orig / high) return f;
      if (wavelen > orig / low) return f / factor;
      const double smooth = (orig / wavelen - low) / (high - low);
      return (1 - smooth) * f / factor + smooth * f;
    }
    default:
      return f;
  }
}

}  // namespace kiln
