#include "backends/ref/ref_kernels.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/optimizer.h"
#include "engine/sampling.h"

namespace kiln::ref {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// What a reference kernel knows about its node.
struct RefData {
  OpKind op;
  Attrs attrs;
  std::vector<DType> in;
  DType out;
  ExprProgram expr[2];  // Map body; attention mask_mod / score_mod
};

const RefData& Data(const LaunchArgs& a) { return *static_cast<const RefData*>(a.kernel_data); }

// ---- Element access ---------------------------------------------------------------------------

bool IsIntLike(DType t) { return IsInteger(t) || t == DType::kBool; }

int64_t Off(const TensorArg& t, const int64_t* idx) {
  int64_t o = 0;
  for (int d = 0; d < t.rank; ++d) o += idx[d] * t.strides[d];
  return o;
}
double LoadF(const TensorArg& t, int64_t off) { return LoadElement(t.data, t.dtype, off); }
int64_t LoadI(const TensorArg& t, int64_t off) { return LoadInt(t.data, t.dtype, off); }
void StoreF(const TensorArg& t, int64_t off, double v) { StoreElement(t.data, t.dtype, off, v); }
void StoreI(const TensorArg& t, int64_t off, int64_t v) { StoreInt(t.data, t.dtype, off, v); }
// Copies one element between tensors without losing integer precision.
void CopyElem(const TensorArg& dst, int64_t doff, const TensorArg& src, int64_t soff) {
  if (IsIntLike(dst.dtype) && IsIntLike(src.dtype)) {
    StoreI(dst, doff, LoadI(src, soff));
  } else {
    StoreF(dst, doff, LoadF(src, soff));
  }
}

// Row-major odometer: advances idx over shape; false after the last index.
bool Next(int64_t* idx, const int64_t* shape, int rank) {
  for (int d = rank - 1; d >= 0; --d) {
    if (++idx[d] < shape[d]) return true;
    idx[d] = 0;
  }
  return false;
}

// Calls fn(idx) for every index of `shape` (nothing if any dim is 0).
template <typename F>
void ForEach(const int64_t* shape, int rank, F&& fn) {
  for (int d = 0; d < rank; ++d) {
    if (shape[d] == 0) return;
  }
  int64_t idx[kMaxRank] = {};
  do {
    fn(idx);
  } while (Next(idx, shape, rank));
}

double Sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}
double NanMax(double a, double b) {
  return (std::isnan(a) || std::isnan(b)) ? kNaN : std::max(a, b);
}
double NanMin(double a, double b) {
  return (std::isnan(a) || std::isnan(b)) ? kNaN : std::min(a, b);
}
int64_t WrapAdd(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
int64_t WrapSub(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b));
}
int64_t WrapMul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}
int64_t IntDiv(int64_t a, int64_t b) {
  if (b == 0) return 0;
  if (a == std::numeric_limits<int64_t>::min() && b == -1) return a;
  return a / b;
}

// ---- Generators ---------------------------------------------------------------------------------

void Full(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const double v = Data(a).attrs.floats[0];
  const TensorArg& o = a.output;
  ForEach(o.shape, o.rank, [&](const int64_t* idx) {
    if (IsIntLike(o.dtype)) {
      StoreI(o, Off(o, idx), static_cast<int64_t>(v));
    } else {
      StoreF(o, Off(o, idx), v);
    }
  });
}

void Iota(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const Attrs& at = Data(a).attrs;
  const TensorArg& o = a.output;
  ForEach(o.shape, o.rank, [&](const int64_t* idx) {
    const int64_t i = idx[at.ints[0]];
    if (IsIntLike(o.dtype)) {
      StoreI(o, Off(o, idx),
             static_cast<int64_t>(at.floats[0]) + static_cast<int64_t>(at.floats[1]) * i);
    } else {
      StoreF(o, Off(o, idx), at.floats[0] + at.floats[1] * static_cast<double>(i));
    }
  });
}

void DimValue(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  if (IsIntLike(a.output.dtype)) {
    StoreI(a.output, 0, a.params[0]);
  } else {
    StoreF(a.output, 0, static_cast<double>(a.params[0]));
  }
}

// ---- Pointwise ----------------------------------------------------------------------------------

double ApplyFloat(OpKind op, const Attrs& at, double x, double y) {
  switch (op) {
    case OpKind::kNeg:
      return -x;
    case OpKind::kAbs:
      return std::fabs(x);
    case OpKind::kExp:
      return std::exp(x);
    case OpKind::kLog:
      return std::log(x);
    case OpKind::kSqrt:
      return std::sqrt(x);
    case OpKind::kRsqrt:
      return 1.0 / std::sqrt(x);
    case OpKind::kTanh:
      return std::tanh(x);
    case OpKind::kSigmoid:
      return Sigmoid(x);
    case OpKind::kSilu:
      return x * Sigmoid(x);
    case OpKind::kGeluTanh:
      return 0.5 * x *
             (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
    case OpKind::kGeluErf:
      return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2));
    case OpKind::kRelu:
      return NanMax(x, 0.0);
    case OpKind::kClamp:
      return NanMin(NanMax(x, at.floats[0]), at.floats[1]);
    case OpKind::kAdd:
      return x + y;
    case OpKind::kSub:
      return x - y;
    case OpKind::kMul:
      return x * y;
    case OpKind::kDiv:
      return x / y;
    case OpKind::kPow:
      return std::pow(x, y);
    case OpKind::kMaximum:
      return NanMax(x, y);
    case OpKind::kMinimum:
      return NanMin(x, y);
    case OpKind::kEq:
      return x == y;
    case OpKind::kNe:
      return x != y;
    case OpKind::kLt:
      return x < y;
    case OpKind::kLe:
      return x <= y;
    case OpKind::kGt:
      return x > y;
    case OpKind::kGe:
      return x >= y;
    default:
      KILN_CHECK(false, "ref: not a float pointwise op");
  }
  return 0;
}

int64_t ApplyInt(OpKind op, const Attrs& at, int64_t x, int64_t y) {
  switch (op) {
    case OpKind::kNeg:
      return WrapSub(0, x);
    case OpKind::kAbs:
      return x < 0 ? WrapSub(0, x) : x;
    case OpKind::kRelu:
      return std::max<int64_t>(x, 0);
    case OpKind::kClamp:
      return std::min(std::max(x, static_cast<int64_t>(at.floats[0])),
                      static_cast<int64_t>(at.floats[1]));
    case OpKind::kAdd:
      return WrapAdd(x, y);
    case OpKind::kSub:
      return WrapSub(x, y);
    case OpKind::kMul:
      return WrapMul(x, y);
    case OpKind::kDiv:
      return IntDiv(x, y);
    case OpKind::kMaximum:
      return std::max(x, y);
    case OpKind::kMinimum:
      return std::min(x, y);
    case OpKind::kEq:
      return x == y;
    case OpKind::kNe:
      return x != y;
    case OpKind::kLt:
      return x < y;
    case OpKind::kLe:
      return x <= y;
    case OpKind::kGt:
      return x > y;
    case OpKind::kGe:
      return x >= y;
    case OpKind::kAnd:
      return (x != 0) && (y != 0);
    case OpKind::kOr:
      return (x != 0) || (y != 0);
    case OpKind::kNot:
      return x == 0;
    default:
      KILN_CHECK(false, "ref: not an integer pointwise op");
  }
  return 0;
}

void Pointwise(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const RefData& d = Data(a);
  const TensorArg& o = a.output;
  const TensorArg* in = a.inputs;
  ForEach(o.shape, o.rank, [&](const int64_t* idx) {
    const int64_t oo = Off(o, idx);
    switch (d.op) {
      case OpKind::kCast: {
        const int64_t io = Off(in[0], idx);
        if (IsIntLike(in[0].dtype) && IsIntLike(o.dtype)) {
          StoreI(o, oo, LoadI(in[0], io));  // wraps, like a C cast
        } else if (IsIntLike(in[0].dtype)) {
          StoreF(o, oo, static_cast<double>(LoadI(in[0], io)));
        } else {
          StoreF(o, oo, LoadF(in[0], io));  // float -> int saturates (StoreElement)
        }
        return;
      }
      case OpKind::kWhere: {
        const bool cond = LoadI(in[0], Off(in[0], idx)) != 0;
        const TensorArg& src = cond ? in[1] : in[2];
        CopyElem(o, oo, src, Off(src, idx));
        return;
      }
      default:
        break;
    }
    const bool int_mode = IsIntLike(in[0].dtype);
    const int64_t io0 = Off(in[0], idx);
    const int64_t io1 = a.num_inputs > 1 ? Off(in[1], idx) : 0;
    if (int_mode) {
      const int64_t x = LoadI(in[0], io0);
      const int64_t y = a.num_inputs > 1 ? LoadI(in[1], io1) : 0;
      StoreI(o, oo, ApplyInt(d.op, d.attrs, x, y));
    } else {
      const double x = LoadF(in[0], io0);
      const double y = a.num_inputs > 1 ? LoadF(in[1], io1) : 0;
      const double r = ApplyFloat(d.op, d.attrs, x, y);
      if (IsIntLike(o.dtype)) {
        StoreI(o, oo, static_cast<int64_t>(r));  // comparisons: 0 or 1
      } else {
        StoreF(o, oo, r);
      }
    }
  });
}

// Aux tensors (1-D) for expression Loads: out-of-range indices read as 0.
struct AuxCtx {
  const TensorArg* aux;
  int count;
};
ExprValue LoadAux(const void* ctx, int k, int64_t i, DType type) {
  const AuxCtx& a = *static_cast<const AuxCtx*>(ctx);
  ExprValue v;
  v.i = 0;
  if (k >= a.count || i < 0 || i >= a.aux[k].shape[0]) {
    if (type == DType::kF32 || type == DType::kF64) v.f = 0;
    return v;
  }
  const TensorArg& t = a.aux[k];
  if (type == DType::kF32 || type == DType::kF64) {
    v.f = LoadF(t, i * t.strides[0]);
  } else {
    v.i = LoadI(t, i * t.strides[0]);
  }
  return v;
}

ExprValue ToValue(const TensorArg& t, int64_t off, DType type) {
  ExprValue v;
  if (type == DType::kF32 || type == DType::kF64) {
    v.f = LoadF(t, off);
  } else {
    v.i = LoadI(t, off);
  }
  return v;
}
void StoreValue(const TensorArg& t, int64_t off, ExprValue v, DType type) {
  if (type == DType::kF32 || type == DType::kF64) {
    StoreF(t, off, v.f);
  } else {
    StoreI(t, off, v.i);
  }
}

// A Map is defined by its expression: the reference evaluates it directly.
void Map(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const RefData& d = Data(a);
  const int num_aux = d.attrs.ints.empty() ? 0 : static_cast<int>(d.attrs.ints[0]);
  const int num_main = a.num_inputs - num_aux;
  AuxCtx aux{a.inputs + num_main, num_aux};
  std::vector<ExprValue> vals(std::max(num_main, 1));
  const TensorArg& o = a.output;
  ForEach(o.shape, o.rank, [&](const int64_t* idx) {
    for (int i = 0; i < num_main; ++i)
      vals[i] = ToValue(a.inputs[i], Off(a.inputs[i], idx), ExprTypeOf(d.in[i]));
    ExprEnv env;
    env.inputs = vals.data();
    env.index = idx;
    env.load = LoadAux;
    env.load_ctx = &aux;
    StoreValue(o, Off(o, idx), d.expr[0].Eval(env), d.expr[0].type());
  });
}

// ---- Reductions ---------------------------------------------------------------------------------

void Reduce(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const RefData& d = Data(a);
  const TensorArg& x = a.inputs[0];
  const TensorArg& o = a.output;
  const bool keepdim = d.attrs.ints[0] != 0;
  bool reduced[kMaxRank] = {};
  for (size_t i = 1; i < d.attrs.ints.size(); ++i) reduced[d.attrs.ints[i]] = true;
  int64_t kept_shape[kMaxRank], red_shape[kMaxRank];
  int kept_axes[kMaxRank], red_axes[kMaxRank], nk = 0, nr = 0;
  for (int i = 0; i < x.rank; ++i) {
    if (reduced[i]) {
      red_axes[nr] = i;
      red_shape[nr++] = x.shape[i];
    } else {
      kept_axes[nk] = i;
      kept_shape[nk++] = x.shape[i];
    }
  }
  int64_t count = 1;
  for (int i = 0; i < nr; ++i) count *= red_shape[i];
  const bool ints = IsIntLike(x.dtype);
  ForEach(kept_shape, nk, [&](const int64_t* kidx) {
    int64_t xi[kMaxRank] = {}, oi[kMaxRank] = {};
    for (int i = 0; i < nk; ++i) xi[kept_axes[i]] = kidx[i];
    if (keepdim) {
      for (int i = 0; i < nk; ++i) oi[kept_axes[i]] = kidx[i];
    } else {
      for (int i = 0; i < nk; ++i) oi[i] = kidx[i];
    }
    double fsum = 0, fbest = d.op == OpKind::kMin ? kInf : -kInf;
    int64_t isum = 0, ibest = d.op == OpKind::kMin ? std::numeric_limits<int64_t>::max()
                                                   : std::numeric_limits<int64_t>::min();
    int64_t best_pos = 0, pos = 0;
    ForEach(red_shape, nr, [&](const int64_t* ridx) {
      for (int i = 0; i < nr; ++i) xi[red_axes[i]] = ridx[i];
      const int64_t off = Off(x, xi);
      if (ints) {
        const int64_t v = LoadI(x, off);
        isum = WrapAdd(isum, v);
        if (d.op == OpKind::kMin ? v < ibest : v > ibest) {
          ibest = v;
          best_pos = pos;
        }
      } else {
        const double v = LoadF(x, off);
        fsum += v;
        if (d.op == OpKind::kArgMax) {
          // First maximum; NaN counts as the largest value (first NaN wins).
          if ((std::isnan(v) && !std::isnan(fbest)) || v > fbest) {
            fbest = v;
            best_pos = pos;
          }
        } else {
          fbest = d.op == OpKind::kMin ? NanMin(fbest, v) : NanMax(fbest, v);
        }
      }
      ++pos;
    });
    const int64_t oo = Off(o, oi);
    switch (d.op) {
      case OpKind::kSum:
        ints ? StoreI(o, oo, isum) : StoreF(o, oo, fsum);
        break;
      case OpKind::kMean:
        StoreF(o, oo, fsum / static_cast<double>(count));
        break;
      case OpKind::kMax:
      case OpKind::kMin:
        ints ? StoreI(o, oo, ibest) : StoreF(o, oo, fbest);
        break;
      case OpKind::kArgMax:
        StoreI(o, oo, best_pos);
        break;
      default:
        KILN_CHECK(false, "ref: not a reduction");
    }
  });
}

// ---- Row ops (last axis)
// -------------------------------------------------------------------------

// Calls fn(x_offset_of_row_start, row_index_vector) for every row of x's leading axes.
template <typename F>
void ForEachRow(const TensorArg& x, F&& fn) {
  ForEach(x.shape, x.rank - 1, [&](const int64_t* idx) {
    int64_t off = 0;
    for (int d = 0; d < x.rank - 1; ++d) off += idx[d] * x.strides[d];
    fn(off, idx);
  });
}

void Row(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const RefData& d = Data(a);
  const TensorArg& x = a.inputs[0];
  const TensorArg& o = a.output;
  const int64_t n = x.shape[x.rank - 1];
  const int64_t xs = x.strides[x.rank - 1];
  std::vector<double> row(n);
  ForEachRow(x, [&](int64_t xoff, const int64_t* idx) {
    for (int64_t j = 0; j < n; ++j) row[j] = LoadF(x, xoff + j * xs);
    int64_t ooff = 0;
    for (int dd = 0; dd < x.rank - 1; ++dd) ooff += idx[dd] * o.strides[dd];
    const int64_t os = d.op == OpKind::kCrossEntropy ? 0 : o.strides[o.rank - 1];
    double m = -kInf, s = 0;
    if (d.op == OpKind::kSoftmax || d.op == OpKind::kLogSoftmax || d.op == OpKind::kCrossEntropy) {
      for (double v : row) m = NanMax(m, v);
      for (double v : row) s += std::exp(v - m);
    }
    switch (d.op) {
      case OpKind::kSoftmax:
        for (int64_t j = 0; j < n; ++j)
          StoreF(o, ooff + j * os, m == -kInf ? 0.0 : std::exp(row[j] - m) / s);
        break;
      case OpKind::kLogSoftmax:
        for (int64_t j = 0; j < n; ++j) StoreF(o, ooff + j * os, row[j] - m - std::log(s));
        break;
      case OpKind::kRmsNorm: {
        double ss = 0;
        for (double v : row) ss += v * v;
        const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + d.attrs.floats[0]);
        for (int64_t j = 0; j < n; ++j) StoreF(o, ooff + j * os, row[j] * r);
        break;
      }
      case OpKind::kLayerNorm: {
        double mean = 0;
        for (double v : row) mean += v;
        mean /= static_cast<double>(n);
        double var = 0;
        for (double v : row) var += (v - mean) * (v - mean);
        const double r = 1.0 / std::sqrt(var / static_cast<double>(n) + d.attrs.floats[0]);
        for (int64_t j = 0; j < n; ++j) StoreF(o, ooff + j * os, (row[j] - mean) * r);
        break;
      }
      case OpKind::kCrossEntropy: {
        const TensorArg& t = a.inputs[1];
        int64_t toff = 0;
        for (int dd = 0; dd < t.rank; ++dd) toff += idx[dd] * t.strides[dd];
        const int64_t target = LoadI(t, toff);
        if (target == d.attrs.ints[0]) {
          StoreF(o, ooff, 0.0);
          break;
        }
        const double picked = (target >= 0 && target < n) ? row[target] : 0.0;
        StoreF(o, ooff, m + std::log(s) - picked);
        break;
      }
      default:
        KILN_CHECK(false, "ref: not a row op");
    }
  });
}

// ---- Layout -------------------------------------------------------------------------------------

void Contiguous(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &x = a.inputs[0], &o = a.output;
  ForEach(o.shape, o.rank, [&](const int64_t* idx) { CopyElem(o, Off(o, idx), x, Off(x, idx)); });
}

void Concat(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const int axis = static_cast<int>(Data(a).attrs.ints[0]);
  const TensorArg& o = a.output;
  ForEach(o.shape, o.rank, [&](const int64_t* idx) {
    int64_t at = idx[axis];
    int j = 0;
    while (at >= a.inputs[j].shape[axis]) at -= a.inputs[j++].shape[axis];
    int64_t src[kMaxRank];
    std::copy(idx, idx + o.rank, src);
    src[axis] = at;
    CopyElem(o, Off(o, idx), a.inputs[j], Off(a.inputs[j], src));
  });
}

// ---- Indexing -----------------------------------------------------------------------------------

// One table row as doubles (dequantizing a quantized row in one go).
void LoadRow(const TensorArg& t, int64_t row, std::vector<double>& out) {
  const int64_t n = static_cast<int64_t>(out.size());
  if (IsQuantized(t.dtype)) {
    std::vector<float> tmp(n);
    const char* p = static_cast<const char*>(t.data) + ByteOffset(t.dtype, row * t.strides[0]);
    KILN_CHECK(DequantizeRow(t.dtype, p, tmp.data(), n).ok(), "ref: dequantize failed");
    std::copy(tmp.begin(), tmp.end(), out.begin());
    return;
  }
  // Rows of a non-quantized table may be strided in every axis.
  int64_t idx[kMaxRank] = {};
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = row * t.strides[0];
    for (int d = 1; d < t.rank; ++d) off += idx[d - 1] * t.strides[d];
    out[e] = LoadF(t, off);
    Next(idx, t.shape + 1, t.rank - 1);
  }
}

void Gather(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &table = a.inputs[0], &ids = a.inputs[1], &o = a.output;
  int64_t row_elems = 1;
  for (int d = 1; d < table.rank; ++d) row_elems *= table.shape[d];
  std::vector<double> row(row_elems);
  ForEach(ids.shape, ids.rank, [&](const int64_t* iidx) {
    const int64_t r = LoadI(ids, Off(ids, iidx));
    const bool valid = r >= 0 && r < table.shape[0];
    if (valid) LoadRow(table, r, row);
    int64_t oi[kMaxRank] = {};
    std::copy(iidx, iidx + ids.rank, oi);
    int64_t e = 0;
    ForEach(table.shape + 1, table.rank - 1, [&](const int64_t* ridx) {
      std::copy(ridx, ridx + table.rank - 1, oi + ids.rank);
      StoreF(o, Off(o, oi), valid ? row[e] : 0.0);
      ++e;
    });
  });
}

void ZeroFill(const TensorArg& o) {
  ForEach(o.shape, o.rank, [&](const int64_t* idx) { StoreF(o, Off(o, idx), 0.0); });
}

void ScatterAddRows(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &ids = a.inputs[0], &src = a.inputs[1], &o = a.output;
  ZeroFill(o);
  ForEach(ids.shape, ids.rank, [&](const int64_t* iidx) {
    const int64_t r = LoadI(ids, Off(ids, iidx));
    if (r < 0 || r >= o.shape[0]) return;
    int64_t si[kMaxRank] = {}, oi[kMaxRank] = {};
    std::copy(iidx, iidx + ids.rank, si);
    oi[0] = r;
    ForEach(o.shape + 1, o.rank - 1, [&](const int64_t* ridx) {
      std::copy(ridx, ridx + o.rank - 1, si + ids.rank);
      std::copy(ridx, ridx + o.rank - 1, oi + 1);
      const int64_t oo = Off(o, oi);
      StoreF(o, oo, LoadF(o, oo) + LoadF(src, Off(src, si)));
    });
  });
}

void TakeAlong(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &x = a.inputs[0], &ids = a.inputs[1], &o = a.output;
  const int last = x.rank - 1;
  ForEach(o.shape, o.rank, [&](const int64_t* idx) {
    const int64_t j = LoadI(ids, Off(ids, idx));
    const int64_t oo = Off(o, idx);
    if (j < 0 || j >= x.shape[last]) {
      StoreF(o, oo, 0.0);
      return;
    }
    int64_t xi[kMaxRank];
    std::copy(idx, idx + x.rank, xi);
    xi[last] = j;
    CopyElem(o, oo, x, Off(x, xi));
  });
}

void ScatterAddAlong(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &ids = a.inputs[0], &src = a.inputs[1], &o = a.output;
  const int last = o.rank - 1;
  ZeroFill(o);
  ForEach(src.shape, src.rank, [&](const int64_t* idx) {
    const int64_t j = LoadI(ids, Off(ids, idx));
    if (j < 0 || j >= o.shape[last]) return;
    int64_t oi[kMaxRank];
    std::copy(idx, idx + o.rank, oi);
    oi[last] = j;
    const int64_t oo = Off(o, oi);
    StoreF(o, oo, LoadF(o, oo) + LoadF(src, Off(src, idx)));
  });
}

void TopK(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &x = a.inputs[0], &o = a.output;
  const int64_t n = x.shape[x.rank - 1], k = o.shape[o.rank - 1];
  std::vector<double> row(n);
  std::vector<int64_t> order(n);
  ForEachRow(x, [&](int64_t xoff, const int64_t* idx) {
    for (int64_t j = 0; j < n; ++j) {
      row[j] = IsIntLike(x.dtype) ? static_cast<double>(LoadI(x, xoff + j * x.strides[x.rank - 1]))
                                  : LoadF(x, xoff + j * x.strides[x.rank - 1]);
    }
    std::iota(order.begin(), order.end(), 0);
    // Descending, NaN largest; stable keeps the lower index first on ties.
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) {
      const double u = row[p], v = row[q];
      if (std::isnan(u) || std::isnan(v)) return std::isnan(u) && !std::isnan(v);
      return u > v;
    });
    int64_t ooff = 0;
    for (int d = 0; d < o.rank - 1; ++d) ooff += idx[d] * o.strides[d];
    for (int64_t j = 0; j < k; ++j) StoreI(o, ooff + j * o.strides[o.rank - 1], order[j]);
  });
}

// ---- Linear algebra -----------------------------------------------------------------------------

void MatMul(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &x = a.inputs[0], &y = a.inputs[1], &o = a.output;
  const int r = o.rank;
  const int64_t K = x.shape[r - 1];
  if (IsQuantized(y.dtype)) {  // 2-D, blocks along N: decode row by row, then as f64
    const int64_t N = y.shape[1];
    std::vector<double> yd(static_cast<size_t>(K * N));
    std::vector<double> row(static_cast<size_t>(N));
    for (int64_t k = 0; k < K; ++k) {
      LoadRow(y, k, row);
      std::copy(row.begin(), row.end(), yd.begin() + k * N);
    }
    for (int64_t m = 0; m < o.shape[0]; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += LoadF(x, m * x.strides[0] + k * x.strides[1]) * yd[k * N + n];
        StoreF(o, m * o.strides[0] + n * o.strides[1], acc);
      }
    }
    return;
  }
  ForEach(o.shape, r, [&](const int64_t* idx) {
    int64_t xi[kMaxRank], yi[kMaxRank];
    std::copy(idx, idx + r, xi);
    std::copy(idx, idx + r, yi);
    double acc = 0;
    for (int64_t k = 0; k < K; ++k) {
      xi[r - 1] = k;
      yi[r - 2] = k;
      acc += LoadF(x, Off(x, xi)) * LoadF(y, Off(y, yi));
    }
    StoreF(o, Off(o, idx), acc);
  });
}

void Linear(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &x = a.inputs[0], &w = a.inputs[1], &o = a.output;
  const int64_t K = x.shape[x.rank - 1], N = w.shape[0];
  std::vector<double> wrow(K);
  for (int64_t nn = 0; nn < N; ++nn) {
    LoadRow(w, nn, wrow);
    ForEachRow(x, [&](int64_t xoff, const int64_t* idx) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += LoadF(x, xoff + k * x.strides[x.rank - 1]) * wrow[k];
      int64_t ooff = nn * o.strides[o.rank - 1];
      for (int d = 0; d < o.rank - 1; ++d) ooff += idx[d] * o.strides[d];
      StoreF(o, ooff, acc);
    });
  }
}

// ---- Rope ---------------------------------------------------------------------------------------

void Rope(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const Attrs& at = Data(a).attrs;
  const TensorArg &x = a.inputs[0], &pos = a.inputs[1], &o = a.output;
  const int r = x.rank;
  const int64_t H = x.shape[r - 2], D = x.shape[r - 1], rd = at.ints[0], half = rd / 2;
  const bool interleaved = at.ints[1] == 1;
  const double sign = at.ints[3] ? -1.0 : 1.0;
  std::vector<double> inv(static_cast<size_t>(half)), cs(inv.size()), sn(inv.size());
  for (int64_t i = 0; i < half; ++i) inv[i] = kiln::RopeInvFreq(at, i);
  ForEach(x.shape, r - 2, [&](const int64_t* lead) {
    const double p = static_cast<double>(LoadI(pos, Off(pos, lead)));
    // One rotation per pair for every head of this position.
    for (int64_t i = 0; i < half; ++i) {
      const double angle = sign * p * inv[i];
      cs[i] = std::cos(angle);
      sn[i] = std::sin(angle);
    }
    int64_t xi[kMaxRank];
    std::copy(lead, lead + r - 2, xi);
    for (int64_t h = 0; h < H; ++h) {
      xi[r - 2] = h;
      auto at_dim = [&](const TensorArg& t, int64_t dim) {
        xi[r - 1] = dim;
        return Off(t, xi);
      };
      for (int64_t i = 0; i < half; ++i) {
        const int64_t d0 = interleaved ? 2 * i : i, d1 = interleaved ? 2 * i + 1 : i + half;
        const double x0 = LoadF(x, at_dim(x, d0)), x1 = LoadF(x, at_dim(x, d1));
        StoreF(o, at_dim(o, d0), x0 * cs[i] - x1 * sn[i]);
        StoreF(o, at_dim(o, d1), x0 * sn[i] + x1 * cs[i]);
      }
      for (int64_t dd = rd; dd < D; ++dd) StoreF(o, at_dim(o, dd), LoadF(x, at_dim(x, dd)));
    }
  });
}

// ---- Attention ----------------------------------------------------------------------------------

// Softmax over the unmasked scores of one query row, then the weighted sum of values.
// `score(j)` returns nullopt-like NaN sentinel via `keep`.
struct AttnRow {
  std::vector<double> s;
  std::vector<char> keep;
};

// Returns the row's log-sum-exp (-inf when every score is masked).
double FinishRow(AttnRow& row, int64_t n, const std::function<double(int64_t, int64_t)>& value,
                 int64_t dv, const std::function<void(int64_t, double)>& store) {
  double m = -kInf;
  for (int64_t j = 0; j < n; ++j) {
    if (row.keep[j]) m = NanMax(m, row.s[j]);
  }
  std::vector<double> acc(dv, 0.0);
  double lse = -kInf;
  if (m != -kInf) {
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      row.s[j] = row.keep[j] ? std::exp(row.s[j] - m) : 0.0;
      sum += row.s[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      if (row.s[j] == 0) continue;
      for (int64_t e = 0; e < dv; ++e) acc[e] += row.s[j] / sum * value(j, e);
    }
    lse = m + std::log(sum);
  }
  for (int64_t e = 0; e < dv; ++e) store(e, acc[e]);
  return lse;
}

// Applies score_mod and mask_mod to one score.
double ModScore(const RefData& d, double s, const int64_t* bhqk, const AuxCtx* aux, bool* keep) {
  ExprEnv env;
  env.index = bhqk;
  env.load = LoadAux;
  env.load_ctx = aux;
  if (!d.expr[1].empty()) {
    ExprValue in;
    in.f = s;
    env.inputs = &in;
    s = d.expr[1].Eval(env).f;
  }
  *keep = d.expr[0].empty() || d.expr[0].Eval(env).i != 0;
  return s;
}

void Attention(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const RefData& d = Data(a);
  const TensorArg &q = a.inputs[0], &k = a.inputs[1], &v = a.inputs[2], &o = a.output;
  const AuxCtx aux{a.inputs + 3, a.num_inputs - 3};
  const int64_t B = q.shape[0], Hq = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Tk = k.shape[2], Dv = v.shape[3];
  const double scale = d.attrs.floats[0];
  AttnRow row{std::vector<double>(Tk), std::vector<char>(Tk)};
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kh = h / (Hq / Hkv);
      for (int64_t i = 0; i < Tq; ++i) {
        for (int64_t j = 0; j < Tk; ++j) {
          double s = 0;
          for (int64_t e = 0; e < D; ++e) {
            const int64_t qi[] = {b, h, i, e}, ki[] = {b, kh, j, e};
            s += LoadF(q, Off(q, qi)) * LoadF(k, Off(k, ki));
          }
          const int64_t bhqk[] = {b, h, i, j};
          bool keep = true;
          row.s[j] = ModScore(d, s * scale, bhqk, &aux, &keep);
          row.keep[j] = keep;
        }
        const double lse = FinishRow(
            row, Tk,
            [&](int64_t j, int64_t e) {
              const int64_t vi[] = {b, kh, j, e};
              return LoadF(v, Off(v, vi));
            },
            Dv,
            [&](int64_t e, double val) {
              const int64_t oi[] = {b, h, i, e};
              StoreF(o, Off(o, oi), val);
            });
        if (a.num_extra_outputs > 0) {  // the log-sum-exp output [B, Hq, Tq]
          const int64_t li[] = {b, h, i};
          StoreF(a.extra_outputs[0], Off(a.extra_outputs[0], li), lse);
        }
      }
    }
  }
}

// Flash-attention's backward, row by row in double: P = exp(s - lse) where kept, D_i =
// rowsum(do * o), dS = P (dP - D_i), dq = scale dS k, dk += scale dS^T q, dv += P^T do (the
// query heads of a kv head summed).
void AttentionBackward(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const RefData& d = Data(a);
  const TensorArg &q = a.inputs[0], &k = a.inputs[1], &v = a.inputs[2], &o = a.inputs[3],
                  &dout = a.inputs[4], &lse = a.inputs[5];
  const TensorArg &dq = a.output, &dk = a.extra_outputs[0], &dv = a.extra_outputs[1];
  const AuxCtx aux{a.inputs + 6, a.num_inputs - 6};
  const int64_t B = q.shape[0], Hq = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Tk = k.shape[2], Dv = v.shape[3];
  const double scale = d.attrs.floats[0];
  auto at4 = [](const TensorArg& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    const int64_t idx[] = {i0, i1, i2, i3};
    return LoadF(t, Off(t, idx));
  };
  std::vector<double> gk(static_cast<size_t>(B * Hkv * Tk * D), 0.0);
  std::vector<double> gv(static_cast<size_t>(B * Hkv * Tk * Dv), 0.0);
  std::vector<double> p(static_cast<size_t>(Tk)), gq(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kh = h / (Hq / Hkv);
      for (int64_t i = 0; i < Tq; ++i) {
        const int64_t li[] = {b, h, i};
        const double row_lse = LoadF(lse, Off(lse, li));
        double di = 0;
        for (int64_t e = 0; e < Dv; ++e) di += at4(dout, b, h, i, e) * at4(o, b, h, i, e);
        std::fill(gq.begin(), gq.end(), 0.0);
        for (int64_t j = 0; j < Tk; ++j) {
          double s = 0;
          for (int64_t e = 0; e < D; ++e) s += at4(q, b, h, i, e) * at4(k, b, kh, j, e);
          const int64_t bhqk[] = {b, h, i, j};
          bool keep = true;
          s = ModScore(d, s * scale, bhqk, &aux, &keep);
          p[j] = keep && row_lse != -kInf ? std::exp(s - row_lse) : 0.0;
          if (p[j] == 0) continue;
          double dp = 0;
          for (int64_t e = 0; e < Dv; ++e) {
            const double g = at4(dout, b, h, i, e);
            dp += g * at4(v, b, kh, j, e);
            gv[((b * Hkv + kh) * Tk + j) * Dv + e] += p[j] * g;
          }
          const double ds = p[j] * (dp - di) * scale;
          for (int64_t e = 0; e < D; ++e) {
            gq[e] += ds * at4(k, b, kh, j, e);
            gk[((b * Hkv + kh) * Tk + j) * D + e] += ds * at4(q, b, h, i, e);
          }
        }
        for (int64_t e = 0; e < D; ++e) {
          const int64_t qi[] = {b, h, i, e};
          StoreF(dq, Off(dq, qi), gq[e]);
        }
      }
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t j = 0; j < Tk; ++j) {
        for (int64_t e = 0; e < D; ++e) {
          const int64_t ki[] = {b, h, j, e};
          StoreF(dk, Off(dk, ki), gk[((b * Hkv + h) * Tk + j) * D + e]);
        }
        for (int64_t e = 0; e < Dv; ++e) {
          const int64_t vi[] = {b, h, j, e};
          StoreF(dv, Off(dv, vi), gv[((b * Hkv + h) * Tk + j) * Dv + e]);
        }
      }
    }
  }
}

void PagedAttention(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const RefData& d = Data(a);
  const TensorArg &q = a.inputs[0], &kc = a.inputs[1], &vc = a.inputs[2];
  const TensorArg &bt = a.inputs[3], &sl = a.inputs[4], &qs = a.inputs[5], &o = a.output;
  const AuxCtx aux{a.inputs + 6, a.num_inputs - 6};
  const int64_t T = q.shape[0], Hq = q.shape[1], D = q.shape[2];
  const int64_t NB = kc.shape[0], BS = kc.shape[1], Hkv = kc.shape[2], Dv = vc.shape[3];
  const int64_t S = bt.shape[0], MB = bt.shape[1];
  const double scale = d.attrs.floats[0];
  ZeroFill(o);  // rows that belong to no sequence (padding) stay 0
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q0 = std::clamp<int64_t>(LoadI(qs, s * qs.strides[0]), 0, T);
    const int64_t q1 = std::clamp<int64_t>(LoadI(qs, (s + 1) * qs.strides[0]), q0, T);
    const int64_t len = std::max<int64_t>(LoadI(sl, s * sl.strides[0]), 0);
    AttnRow row{std::vector<double>(len), std::vector<char>(len)};
    // Physical (block, offset) of every key position; -1 when the block table is invalid.
    std::vector<int64_t> block(len);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t slot = j / BS;
      const int64_t bi[] = {s, slot};
      const int64_t blk = slot < MB ? LoadI(bt, Off(bt, bi)) : -1;
      block[j] = (blk >= 0 && blk < NB) ? blk : -1;
    }
    for (int64_t t = q0; t < q1; ++t) {
      const int64_t qpos = len - (q1 - q0) + (t - q0);
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kh = h / (Hq / Hkv);
        for (int64_t j = 0; j < len; ++j) {
          if (block[j] < 0) {
            row.keep[j] = 0;
            continue;
          }
          double sc = 0;
          for (int64_t e = 0; e < D; ++e) {
            const int64_t qi[] = {t, h, e}, ki[] = {block[j], j % BS, kh, e};
            sc += LoadF(q, Off(q, qi)) * LoadF(kc, Off(kc, ki));
          }
          const int64_t bhqk[] = {s, h, qpos, j};
          bool keep = true;
          row.s[j] = ModScore(d, sc * scale, bhqk, &aux, &keep);
          row.keep[j] = keep;
        }
        (void)FinishRow(  // paged attention has no log-sum-exp output
            row, len,
            [&](int64_t j, int64_t e) {
              const int64_t vi[] = {block[j], j % BS, kh, e};
              return LoadF(vc, Off(vc, vi));
            },
            Dv,
            [&](int64_t e, double val) {
              const int64_t oi[] = {t, h, e};
              StoreF(o, Off(o, oi), val);
            });
      }
    }
  }
}

void KvWrite(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  const TensorArg &x = a.inputs[1], &slots = a.inputs[2], &cache = a.output;
  const int64_t T = x.shape[0], H = x.shape[1], D = x.shape[2];
  const int64_t NB = cache.shape[0], BS = cache.shape[1];
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = LoadI(slots, t * slots.strides[0]);
    if (slot < 0 || slot >= NB * BS) continue;  // padding rows (and bad slots) write nothing
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t e = 0; e < D; ++e) {
        const int64_t xi[] = {t, h, e}, ci[] = {slot / BS, slot % BS, h, e};
        StoreF(cache, Off(cache, ci), LoadF(x, Off(x, xi)));
      }
    }
  }
}

// ---- Training ---------------------------------------------------------------------------------

void FusedCrossEntropy(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  FusedCrossEntropyRows(a, Data(a).attrs.ints[0], 0, FusedCrossEntropyRowCount(a));
}

void Optimizer(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  OptimizerElements(a, Data(a).op, Data(a).attrs, 0, a.output.numel());
}

void Sample(const LaunchArgs& a, const ExecCtx& c) {
  if (c.thread_index) return;
  SampleRows(a, 0, SampleRowCount(a));
}

KernelFn FnFor(OpKind op) {
  switch (op) {
    case OpKind::kFull:
      return Full;
    case OpKind::kIota:
      return Iota;
    case OpKind::kDimValue:
      return DimValue;
    case OpKind::kMap:
      return Map;
    case OpKind::kSum:
    case OpKind::kMean:
    case OpKind::kMax:
    case OpKind::kMin:
    case OpKind::kArgMax:
      return Reduce;
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax:
    case OpKind::kRmsNorm:
    case OpKind::kLayerNorm:
    case OpKind::kCrossEntropy:
      return Row;
    case OpKind::kContiguous:
      return Contiguous;
    case OpKind::kConcat:
      return Concat;
    case OpKind::kGather:
      return Gather;
    case OpKind::kScatterAddRows:
      return ScatterAddRows;
    case OpKind::kTakeAlong:
      return TakeAlong;
    case OpKind::kScatterAddAlong:
      return ScatterAddAlong;
    case OpKind::kTopK:
      return TopK;
    case OpKind::kMatMul:
      return MatMul;
    case OpKind::kLinear:
      return Linear;
    case OpKind::kRope:
      return Rope;
    case OpKind::kAttention:
      return Attention;
    case OpKind::kAttentionBackward:
      return AttentionBackward;
    case OpKind::kPagedAttention:
      return PagedAttention;
    case OpKind::kKvWrite:
      return KvWrite;
    case OpKind::kFusedCrossEntropy:
      return FusedCrossEntropy;
    case OpKind::kAdamW:
    case OpKind::kAdam:
    case OpKind::kSgd:
    case OpKind::kAdagrad:
      return Optimizer;
    case OpKind::kSample:
      return Sample;
    default:
      break;
  }
  if (GetOpDef(op).cls == OpClass::kPointwise) return Pointwise;
  return nullptr;
}

}  // namespace

int64_t FusedCrossEntropyRowCount(const LaunchArgs& a) {
  const TensorArg& x = a.inputs[0];
  int64_t rows = 1;
  for (int d = 0; d + 1 < x.rank; ++d) rows *= x.shape[d];
  return rows;
}

// One pass per row over the loaded logits: the maximum, the sum of exponentials, then loss
// and dlogits from them (the softmax is never materialized or computed twice).
void FusedCrossEntropyRows(const LaunchArgs& a, int64_t ignore_index, int64_t begin, int64_t end) {
  const TensorArg &x = a.inputs[0], &targets = a.inputs[1], &dloss = a.inputs[2];
  const TensorArg &loss = a.output, &dx = a.extra_outputs[0];
  const int r = x.rank - 1;
  const int64_t n = x.shape[r];
  std::vector<double> row(static_cast<size_t>(n));
  int64_t idx[kMaxRank] = {};
  for (int64_t i = begin; i < end; ++i) {
    int64_t rest = i;
    for (int d = r - 1; d >= 0; --d) {
      idx[d] = rest % x.shape[d];
      rest /= x.shape[d];
    }
    auto row_off = [&](const TensorArg& t) {
      int64_t o = 0;
      for (int d = 0; d < r; ++d) o += idx[d] * t.strides[d];
      return o;
    };
    const int64_t xo = row_off(x), dxo = row_off(dx), lo = row_off(loss);
    const int64_t target = LoadI(targets, row_off(targets));
    if (target == ignore_index) {
      StoreF(loss, lo, 0.0);
      for (int64_t j = 0; j < n; ++j) StoreF(dx, dxo + j * dx.strides[r], 0.0);
      continue;
    }
    double m = -kInf, s = 0;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = LoadF(x, xo + j * x.strides[r]);
      m = NanMax(m, row[j]);
    }
    for (int64_t j = 0; j < n; ++j) s += std::exp(row[j] - m);
    const double picked = (target >= 0 && target < n) ? row[target] : 0.0;
    StoreF(loss, lo, m + std::log(s) - picked);
    const double g = LoadF(dloss, row_off(dloss));
    for (int64_t j = 0; j < n; ++j) {
      const double p = std::exp(row[j] - m) / s - (j == target ? 1.0 : 0.0);
      StoreF(dx, dxo + j * dx.strides[r], p * g);
    }
  }
}

// torch.optim's single-tensor updates (foreach=False, maximize=False), element by element,
// in double; g is the gradient times grad_scale. At step 1 the states start as torch creates
// them: zeros (adam's exp_avg, exp_avg_sq), the gradient (sgd's momentum_buffer),
// initial_accumulator_value (adagrad's state_sum).
void OptimizerElements(const LaunchArgs& a, OpKind op, const Attrs& attrs, int64_t begin,
                       int64_t end) {
  const TensorArg &param = a.inputs[0], &grad = a.inputs[1], &hyper = a.inputs[2];
  const TensorArg& param_out = a.output;
  const int64_t h0[] = {0}, h1[] = {1}, h2[] = {2};
  const double step = LoadF(hyper, Off(hyper, h0)), lr = LoadF(hyper, Off(hyper, h1));
  // hyper's grad_scale times the optional graph-computed one (the last input).
  double scale = LoadF(hyper, Off(hyper, h2));
  if (a.num_inputs > 3 + a.num_extra_outputs) scale *= LoadF(a.inputs[a.num_inputs - 1], 0);
  const bool first = step <= 1;
  const std::vector<double>& f = attrs.floats;
  const auto [step_size, bias_correction2_sqrt] = StepScalars(op, f, lr, step);
  int64_t idx[kMaxRank] = {};
  for (int64_t e = begin; e < end; ++e) {
    int64_t rest = e;
    for (int d = param.rank - 1; d >= 0; --d) {
      idx[d] = rest % param.shape[d];
      rest /= param.shape[d];
    }
    double g = LoadF(grad, Off(grad, idx)) * scale;
    double p = LoadF(param, Off(param, idx));
    auto state = [&](int k, double initial) {
      return first ? initial : LoadF(a.inputs[3 + k], Off(a.inputs[3 + k], idx));
    };
    auto store_state = [&](int k, double v) {
      const TensorArg& s = a.extra_outputs[k];
      StoreF(s, Off(s, idx), v);
    };
    switch (op) {
      case OpKind::kAdamW:
      case OpKind::kAdam: {
        // _single_tensor_adam(w): AdamW: param.mul_(1 - lr * weight_decay); Adam: grad =
        // grad.add(param, alpha=weight_decay). Then exp_avg.lerp_(grad, 1 - beta1);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps);
        // param.addcdiv_(exp_avg, denom, value=-step_size), step_size = lr / bias_correction1.
        const double beta1 = f[0], beta2 = f[1], eps = f[2], weight_decay = f[3];
        if (op == OpKind::kAdamW) {
          p *= 1 - lr * weight_decay;
        } else {
          g += weight_decay * p;
        }
        const double m = beta1 * state(0, 0) + (1 - beta1) * g;
        const double v = beta2 * state(1, 0) + (1 - beta2) * g * g;
        store_state(0, m);
        store_state(1, v);
        p -= step_size * m / (std::sqrt(v) / bias_correction2_sqrt + eps);
        break;
      }
      case OpKind::kSgd: {
        // _single_tensor_sgd: grad = grad.add(param, alpha=weight_decay); with momentum:
        // buf = clone(grad) at the first step, else buf.mul_(momentum).add_(grad,
        // alpha=1 - dampening); grad = grad.add(buf, alpha=momentum) if nesterov else buf;
        // param.add_(grad, alpha=-lr).
        const double momentum = f[0], dampening = f[1], weight_decay = f[2];
        g += weight_decay * p;
        if (momentum != 0) {
          const double buf = first ? g : momentum * state(0, 0) + (1 - dampening) * g;
          store_state(0, buf);
          g = attrs.ints[0] ? g + momentum * buf : buf;
        }
        p -= lr * g;
        break;
      }
      default: {
        // _single_tensor_adagrad: grad = grad.add(param, alpha=weight_decay);
        // clr = lr / (1 + (step - 1) * lr_decay); state_sum.addcmul_(grad, grad, value=1);
        // std = state_sum.sqrt().add_(eps); param.addcdiv_(grad, std, value=-clr).
        const double weight_decay = f[1], initial = f[2], eps = f[3];
        g += weight_decay * p;
        const double sum = state(0, initial) + g * g;
        store_state(0, sum);
        p -= step_size * g / (std::sqrt(sum) + eps);
        break;
      }
    }
    StoreF(param_out, Off(param_out, idx), p);
  }
}

StatusOr<backend::Kernel> KernelFor(const backend::KernelRequest& req) {
  const KernelFn fn = FnFor(req.op);
  if (fn == nullptr) return Unimplemented("no reference kernel for ", OpName(req.op));
  auto d = std::make_shared<RefData>();
  d->op = req.op;
  d->attrs = *req.attrs;
  for (const TensorType& t : req.inputs) d->in.push_back(t.dtype);
  d->out = req.output.dtype;
  if (req.op == OpKind::kMap) d->expr[0] = ExprProgram(req.attrs->expr[0]);
  if (req.op == OpKind::kAttention || req.op == OpKind::kPagedAttention ||
      req.op == OpKind::kAttentionBackward) {
    // Score mods run in the query's compute type (f64 stays f64 for gradient checks).
    const DType ct = ExprTypeOf(req.inputs[0].dtype);
    if (req.attrs->expr[0]) d->expr[0] = ExprProgram(req.attrs->expr[0]);
    if (req.attrs->expr[1]) {
      const Expr mod = Substitute(req.attrs->expr[1], std::vector<Expr>{Expr::Input(0, ct)});
      d->expr[1] = ExprProgram(Expr::Cast(ct, mod));
    }
  }
  return backend::Kernel{fn, std::move(d), absl::StrCat("ref.", OpName(req.op))};
}

int64_t SampleRowCount(const LaunchArgs& a) { return a.inputs[0].shape[0]; }

// engine/sampling.h on each row (the host sampler's code: the reference is the algorithm). The
// op's dtypes are fixed (f32 logits and params, f64 uniforms, i32 lists), so rows are read
// through typed pointers: this loop is also the cpu backend's kernel, once per decode step.
void SampleRows(const LaunchArgs& a, int64_t begin, int64_t end) {
  const TensorArg &logits = a.inputs[0], &params = a.inputs[1], &uniform = a.inputs[2];
  const TensorArg &pen_tokens = a.inputs[3], &pen_counts = a.inputs[4], &banned = a.inputs[5];
  const TensorArg &token = a.output, &logprob = a.extra_outputs[0];
  const TensorArg &top_ids = a.extra_outputs[1], &top_lps = a.extra_outputs[2];
  const int64_t V = logits.shape[1], P = pen_tokens.shape[1], E = banned.shape[1];
  const int64_t W = top_ids.shape[1];
  const TensorArg* pen_bias = a.num_inputs > 6 ? &a.inputs[6] : nullptr;
  const TensorArg* allowed = a.num_inputs > 7 ? &a.inputs[7] : nullptr;
  const int64_t words = allowed ? allowed->shape[1] : 0;
  auto at = [](const TensorArg& t, int64_t i, int64_t j) {
    return i * t.strides[0] + j * (t.rank > 1 ? t.strides[1] : 0);
  };
  auto f32 = [](const TensorArg& t) { return static_cast<float*>(t.data); };
  auto i32 = [](const TensorArg& t) { return static_cast<int32_t*>(t.data); };
  thread_local std::vector<float> row, raw, lps;
  thread_local std::vector<int32_t> ban, ids;
  thread_local std::vector<uint32_t> mask;
  thread_local std::vector<sampling::PenaltyToken> pen;
  thread_local sampling::Scratch scratch;
  for (int64_t s = begin; s < end; ++s) {
    float prm[sampling::kNumParams];
    for (int k = 0; k < sampling::kNumParams; ++k) prm[k] = f32(params)[at(params, s, k)];
    const sampling::RowParams p = sampling::UnpackParams(prm);
    row.resize(V);
    const float* l = f32(logits) + at(logits, s, 0);
    const int64_t ls = logits.strides[1];
    for (int64_t j = 0; j < V; ++j) row[j] = l[j * ls];
    pen.clear();
    for (int64_t j = 0; j < P; ++j) {
      const int32_t t = i32(pen_tokens)[at(pen_tokens, s, j)];
      if (t < 0) continue;
      pen.push_back({t, i32(pen_counts)[at(pen_counts, s, j)],
                     pen_bias ? f32(*pen_bias)[at(*pen_bias, s, j)] : 0.0f});
    }
    ban.clear();
    for (int64_t j = 0; j < E; ++j) ban.push_back(i32(banned)[at(banned, s, j)]);
    if (p.logprobs >= 0) raw = row;
    sampling::ApplyPenalties(p, row, pen, ban);
    if (allowed) {
      mask.resize(words);
      for (int64_t j = 0; j < words; ++j) {
        mask[j] = static_cast<uint32_t>(i32(*allowed)[at(*allowed, s, j)]);
      }
      sampling::ApplyAllowed(row, mask);
    }
    const double u = static_cast<double*>(uniform.data)[s * uniform.strides[0]];
    const int32_t t = sampling::Pick(p, row, u, scratch);
    i32(token)[s * token.strides[0]] = t;
    for (int64_t i = 0; i < W; ++i) {
      i32(top_ids)[at(top_ids, s, i)] = -1;
      f32(top_lps)[at(top_lps, s, i)] = 0.0f;
    }
    float lp = 0;
    if (p.logprobs >= 0) {
      const int32_t n = static_cast<int32_t>(std::min<int64_t>({p.logprobs, W, V}));
      ids.resize(n);
      lps.resize(n);
      lp = sampling::Logprobs(raw, t, n, ids.data(), lps.data());
      for (int32_t i = 0; i < n; ++i) {
        i32(top_ids)[at(top_ids, s, i)] = ids[i];
        f32(top_lps)[at(top_lps, s, i)] = lps[i];
      }
    }
    f32(logprob)[s * logprob.strides[0]] = lp;
  }
}

}  // namespace kiln::ref
