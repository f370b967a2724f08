#include "backends/xpu/cl_codegen.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kiln::xpu {
namespace {

bool IsF(DType t) { return t == DType::kF32 || t == DType::kF64; }

std::string Lower(const char* s) { return s; }

// A float literal that round-trips exactly (hex float).
std::string FloatLit(double v, DType t) {
  const bool f32 = t == DType::kF32;
  if (std::isnan(v)) return f32 ? "NAN" : "((double)NAN)";
  if (std::isinf(v)) {
    return v > 0 ? (f32 ? "INFINITY" : "((double)INFINITY)")
                 : (f32 ? "(-INFINITY)" : "(-(double)INFINITY)");
  }
  std::string s = absl::StrFormat("%a", v);
  if (f32) s += "f";
  return absl::StrCat("(", s, ")");
}

std::string IntLit(int64_t v) {
  if (v == INT64_MIN) return "KILN_I64_MIN";
  return absl::StrCat("(", v, "L)");
}

std::string Zero(DType t) {
  switch (t) {
    case DType::kF32:
      return "0.0f";
    case DType::kF64:
      return "0.0";
    case DType::kBool:
      return "false";
    default:
      return "0L";
  }
}

// Meta indices are compile-time constants in the source: m[<i>].
std::string M(int i) { return absl::StrCat("m[", i, "]"); }

}  // namespace

const char* ClExprPrinter::CType(DType t) {
  switch (t) {
    case DType::kF32:
      return "float";
    case DType::kF64:
      return "double";
    case DType::kBool:
      return "bool";
    default:
      return "long";
  }
}

std::string ClLoad(DType dtype, DType as, const std::string& ptr, const std::string& index) {
  const std::string name = Lower(DTypeName(dtype));
  const std::string args = absl::StrCat("(", ptr, ", ", index, ")");
  switch (as) {
    case DType::kF64:
      if (dtype == DType::kF64) return "ldd_f64" + args;
      if (IsInteger(dtype) || dtype == DType::kBool) return "(double)ldi_" + name + args;
      return "(double)ldf_" + name + args;
    case DType::kF32:
      return "ldf_" + name + args;
    case DType::kBool:
      if (IsInteger(dtype) || dtype == DType::kBool) return "(ldi_" + name + args + " != 0)";
      return "(ldf_" + name + args + " != 0.0f)";
    default:
      if (IsInteger(dtype) || dtype == DType::kBool) return "ldi_" + name + args;
      if (dtype == DType::kF64) return "convert_long_sat_rtz(ldd_f64" + args + ")";
      return "convert_long_sat_rtz(ldf_" + name + args + ")";
  }
}

std::string ClStore(DType dtype, DType from, const std::string& ptr, const std::string& index,
                    const std::string& value) {
  const std::string name = Lower(DTypeName(dtype));
  const char* fn = "sti_";
  std::string v = value;
  switch (from) {
    case DType::kF32:
      fn = "stf_";
      break;
    case DType::kF64:
      fn = "std_";
      break;
    case DType::kBool:
      v = absl::StrCat("(long)(", value, ")");
      break;
    default:
      break;
  }
  return absl::StrCat(fn, name, "(", ptr, ", ", index, ", ", v, ");");
}

StatusOr<std::string> ClExprPrinter::Print(const Expr& e, std::string* body) {
  return Node(e, body);
}

StatusOr<std::string> ClExprPrinter::Node(const Expr& e, std::string* body) {
  const ExprNode& n = e.node();
  if (n.type == DType::kF64 && !fp64_) {
    return Unimplemented("the expression computes in f64 but the device has no cl_khr_fp64");
  }
  switch (n.op) {
    case ExprOp::kConst:
      if (IsF(n.type)) return FloatLit(n.fvalue, n.type);
      if (n.type == DType::kBool) return std::string(n.ivalue ? "true" : "false");
      return IntLit(n.ivalue);
    case ExprOp::kInput:
      if (n.index < 0 || n.index >= static_cast<int>(leaves_.inputs.size()) ||
          leaves_.inputs[n.index].empty()) {
        return Internal("expression reads input ", n.index, ", which this kernel does not load");
      }
      return leaves_.inputs[n.index];
    case ExprOp::kIndex:
      return absl::StrCat(leaves_.index_prefix, n.index);
    case ExprOp::kAcc:
      return absl::StrCat(leaves_.acc_prefix, n.index);
    case ExprOp::kCount:
      return leaves_.count;
    default:
      break;
  }
  for (const auto& [node, var] : memo_) {
    if (node == &n) return var;
  }
  std::vector<std::string> a;
  for (const Expr& arg : n.args) {
    KILN_ASSIGN_OR_RETURN(std::string s, Node(arg, body));
    a.push_back(std::move(s));
  }
  const DType t = n.type;
  const DType at = n.args.empty() ? t : n.args[0].type();
  const bool fl = IsF(t), afl = IsF(at), f64 = t == DType::kF64;
  std::string v;
  auto fcall = [&](const char* f) { return absl::StrCat(f, "(", a[0], ")"); };
  switch (n.op) {
    case ExprOp::kLoad: {
      if (n.index >= static_cast<int>(leaves_.aux_dtype.size())) {
        return Internal("expression loads aux tensor ", n.index, ", which this kernel lacks");
      }
      const std::string k = absl::StrCat(n.index);
      const std::string e_var = absl::StrCat("le", next_++);
      absl::StrAppend(body, "    const long ", e_var, " = ", a[0], ";\n");
      v = absl::StrCat(
          "((", e_var, " >= 0 && ", e_var, " < xn", k, ") ? ",
          ClLoad(leaves_.aux_dtype[n.index], t, "px" + k, absl::StrCat(e_var, " * xs", k)), " : ",
          Zero(t), ")");
      break;
    }
    case ExprOp::kNeg:
      v = fl ? absl::StrCat("(-", a[0], ")") : absl::StrCat("wneg(", a[0], ")");
      break;
    case ExprOp::kAbs:
      v = fl ? fcall("fabs") : absl::StrCat("(", a[0], " < 0 ? wneg(", a[0], ") : ", a[0], ")");
      break;
    case ExprOp::kExp:
      v = fcall("exp");
      break;
    case ExprOp::kLog:
      v = fcall("log");
      break;
    case ExprOp::kSqrt:
      v = fcall("sqrt");
      break;
    case ExprOp::kRsqrt:
      v = fcall("rsqrt");
      break;
    case ExprOp::kTanh:
      v = fcall("tanh");
      break;
    case ExprOp::kSigmoid:
      v = fcall(f64 ? "sigmoidd" : "sigmoidf");
      break;
    case ExprOp::kErf:
      v = fcall("erf");
      break;
    case ExprOp::kSin:
      v = fcall("sin");
      break;
    case ExprOp::kCos:
      v = fcall("cos");
      break;
    case ExprOp::kFloor:
      v = fl ? fcall("floor") : a[0];
      break;
    case ExprOp::kNot:
      v = absl::StrCat("(!", a[0], ")");
      break;
    case ExprOp::kAdd:
    case ExprOp::kSub:
    case ExprOp::kMul:
      if (fl) {
        const char* op = n.op == ExprOp::kAdd ? " + " : n.op == ExprOp::kSub ? " - " : " * ";
        v = absl::StrCat("(", a[0], op, a[1], ")");
      } else {
        const char* f = n.op == ExprOp::kAdd ? "wadd" : n.op == ExprOp::kSub ? "wsub" : "wmul";
        v = absl::StrCat(f, "(", a[0], ", ", a[1], ")");
      }
      break;
    case ExprOp::kDiv:
      v = fl ? absl::StrCat("(", a[0], " / ", a[1], ")")
             : absl::StrCat("idiv(", a[0], ", ", a[1], ")");
      break;
    case ExprOp::kMod:
      v = absl::StrCat(fl ? "fmod(" : "imod(", a[0], ", ", a[1], ")");
      break;
    case ExprOp::kPow:
      v = absl::StrCat("pow(", a[0], ", ", a[1], ")");
      break;
    case ExprOp::kMax:
    case ExprOp::kMin: {
      const bool mx = n.op == ExprOp::kMax;
      const char* f =
          fl ? (f64 ? (mx ? "nmaxd" : "nmind") : (mx ? "nmaxf" : "nminf")) : (mx ? "max" : "min");
      v = absl::StrCat(f, "(", a[0], ", ", a[1], ")");
      break;
    }
    case ExprOp::kEq:
    case ExprOp::kNe:
    case ExprOp::kLt:
    case ExprOp::kLe:
    case ExprOp::kGt:
    case ExprOp::kGe: {
      static const char* kOps[] = {" == ", " != ", " < ", " <= ", " > ", " >= "};
      v = absl::StrCat("(", a[0], kOps[static_cast<int>(n.op) - static_cast<int>(ExprOp::kEq)],
                       a[1], ")");
      break;
    }
    case ExprOp::kAnd:
      v = absl::StrCat("(", a[0], " && ", a[1], ")");
      break;
    case ExprOp::kOr:
      v = absl::StrCat("(", a[0], " || ", a[1], ")");
      break;
    case ExprOp::kSelect:
      v = absl::StrCat("(", a[0], " ? ", a[1], " : ", a[2], ")");
      break;
    case ExprOp::kCast:
      if (fl) {
        v = at == DType::kBool
                ? absl::StrCat("(", a[0], " ? (", CType(t), ")1 : (", CType(t), ")0)")
                : absl::StrCat("((", CType(t), ")", a[0], ")");
      } else if (t == DType::kBool) {
        v = absl::StrCat("(", a[0], " != 0)");
      } else {  // to i64: truncate, saturate, NaN -> 0
        v = afl ? absl::StrCat("convert_long_sat_rtz(", a[0], ")")
                : absl::StrCat("((long)", a[0], ")");
      }
      break;
    default:
      return Internal("OpenCL printer: unhandled expression op ", ExprOpName(n.op));
  }
  const std::string var = absl::StrCat("t", next_++);
  absl::StrAppend(body, "    const ", CType(t), " ", var, " = ", v, ";\n");
  memo_.emplace_back(&n, var);
  return var;
}

// ---- Pointwise ----------------------------------------------------------------------------------

StatusOr<PointwiseKernel> MakePointwiseKernel(XpuDevice& dev, const std::string& label,
                                              const Expr& value, std::span<const DType> inputs,
                                              int num_aux, DType out, int rank) {
  PointwiseKernel k;
  k.rank = rank;
  k.num_aux = num_aux;
  k.num_main = static_cast<int>(inputs.size()) - num_aux;
  // Meta: n, contig, shape[r], out (off, strides[r]), main (off, strides[r])..., aux (off,
  // len, stride)...
  const int per = 1 + rank;
  const int n_meta = 2 + rank + per * (1 + k.num_main) + 3 * num_aux;
  k.meta_size = ClArgs::MetaSize(n_meta);
  if (k.meta_size < 0 ||
      static_cast<size_t>(k.meta_size) * 8 + 8 * 24 > dev.info().max_param_bytes) {
    return Unimplemented("too many inputs for one OpenCL kernel (", inputs.size(), ")");
  }
  ClExprPrinter::Leaves leaves;
  for (int i = 0; i < k.num_main; ++i) leaves.inputs.push_back(absl::StrCat("in", i));
  for (int i = k.num_main; i < static_cast<int>(inputs.size()); ++i) {
    leaves.aux_dtype.push_back(inputs[i]);
  }
  ClExprPrinter printer(leaves, dev.fp64());
  std::string body;
  KILN_ASSIGN_OR_RETURN(std::string result, printer.Print(value, &body));

  std::string s = absl::StrCat("// ", label, "\n__kernel void KNAME(gptr b_out");
  for (int i = 0; i < k.num_main; ++i) absl::StrAppend(&s, ", cgptr b_in", i);
  for (int i = 0; i < num_aux; ++i) absl::StrAppend(&s, ", cgptr b_aux", i);
  absl::StrAppend(&s, ", const meta", k.meta_size, " mt) {\n");
  absl::StrAppend(
      &s, "  const long* m = mt.v;\n  const long n = m[0];\n  const int contig = (int)m[1];\n");
  const int out_at = 2 + rank;
  absl::StrAppend(&s, "  gptr po = b_out + ", M(out_at), ";\n");
  for (int i = 0; i < k.num_main; ++i) {
    absl::StrAppend(&s, "  cgptr p", i, " = b_in", i, " + ", M(out_at + per * (1 + i)), ";\n");
  }
  for (int i = 0; i < num_aux; ++i) {
    const int at = out_at + per * (1 + k.num_main) + 3 * i;
    absl::StrAppend(&s, "  cgptr px", i, " = b_aux", i, " + ", M(at), ";\n  const long xn", i,
                    " = ", M(at + 1), ", xs", i, " = ", M(at + 2), ";\n");
  }
  const bool uses_index = value.Uses(ExprOp::kIndex);
  absl::StrAppend(&s, "  for (long g = get_global_id(0); g < n; g += get_global_size(0)) {\n");
  absl::StrAppend(&s, "    long eo");
  for (int i = 0; i < k.num_main; ++i) absl::StrAppend(&s, ", e", i);
  absl::StrAppend(&s, ";\n");
  for (int d = 0; d < rank; ++d) absl::StrAppend(&s, "    long idx", d, ";\n");
  std::string unravel = "      long rem = g;\n";
  for (int d = rank - 1; d >= 0; --d) {
    absl::StrAppend(&unravel, "      idx", d, " = rem % ", M(2 + d), "; rem /= ", M(2 + d), ";\n");
  }
  if (rank == 0) unravel.clear();
  absl::StrAppend(&s, "    if (contig) {\n      eo = g;\n");
  for (int i = 0; i < k.num_main; ++i) absl::StrAppend(&s, "      e", i, " = g;\n");
  if (uses_index) s += unravel;
  absl::StrAppend(&s, "    } else {\n", unravel);
  auto offset = [&](int at) {
    std::string o = "0";
    for (int d = 0; d < rank; ++d) absl::StrAppend(&o, " + idx", d, " * ", M(at + 1 + d));
    return o;
  };
  absl::StrAppend(&s, "      eo = ", offset(out_at), ";\n");
  for (int i = 0; i < k.num_main; ++i) {
    absl::StrAppend(&s, "      e", i, " = ", offset(out_at + per * (1 + i)), ";\n");
  }
  absl::StrAppend(&s, "    }\n");
  for (int i = 0; i < k.num_main; ++i) {
    if (!value.Uses(ExprOp::kInput, i)) continue;
    const DType as = ExprTypeOf(inputs[i]);
    absl::StrAppend(&s, "    const ", ClExprPrinter::CType(as), " in", i, " = ",
                    ClLoad(inputs[i], as, absl::StrCat("p", i), absl::StrCat("e", i)), ";\n");
  }
  absl::StrAppend(&s, body, "    ", ClStore(out, value.type(), "po", "eo", result), "\n  }\n}\n");
  k.slot = dev.DeclareKernel("pw", s);
  return k;
}

void LaunchPointwise(const PointwiseKernel& k, const LaunchArgs& a, Exec& ex) {
  const XpuDevice& dev = *ex.device;
  const TensorArg& o = a.output;
  const int64_t n = o.numel();
  if (n == 0) return;
  ClArgs args;
  args.Long(n);
  // Contiguous fast path: every tensor dense row-major with the output's shape.
  bool contig = o.IsContiguous();
  for (int i = 0; i < k.num_main && contig; ++i) {
    const TensorArg& t = a.inputs[i];
    contig = t.IsContiguous();
    for (int d = 0; d < k.rank && contig; ++d) {
      contig = t.shape[d] == 1 || t.strides[d] == o.strides[d] || o.shape[d] == 1;
    }
  }
  args.Long(contig ? 1 : 0);
  for (int d = 0; d < k.rank; ++d) args.Long(o.shape[d]);
  args.Long(args.Mem(dev, o.data));
  for (int d = 0; d < k.rank; ++d) args.Long(o.strides[d]);
  for (int i = 0; i < k.num_main; ++i) {
    const TensorArg& t = a.inputs[i];
    args.Long(args.Mem(dev, t.data));
    for (int d = 0; d < k.rank; ++d) args.Long(t.strides[d]);
  }
  for (int i = k.num_main; i < k.num_main + k.num_aux; ++i) {
    const TensorArg& t = a.inputs[i];
    args.Long(args.Mem(dev, t.data));
    args.Long(t.rank > 0 ? t.shape[0] : 1);
    args.Long(t.rank > 0 ? t.strides[0] : 0);
  }
  const size_t wg = dev.work_group();
  const size_t groups = std::min<size_t>((static_cast<size_t>(n) + wg - 1) / wg, 65536);
  const size_t global = groups * wg;
  ex.Enqueue(k.slot, args, 1, &global, &wg, k.meta_size);
}

// ---- Reductions ---------------------------------------------------------------------------------

StatusOr<ReduceKernel> MakeReduceKernel(XpuDevice& dev, const std::string& label,
                                        const ReduceForm& form, std::span<const DType> inputs,
                                        DType out, int rank, std::vector<int> axes, bool keepdim) {
  ReduceKernel k;
  k.rank = rank;
  k.axes = axes;
  k.keepdim = keepdim;
  k.elementwise = form.elementwise_output;
  k.num_inputs = static_cast<int>(inputs.size());
  const int nr = static_cast<int>(axes.size()), nk = rank - nr;
  // Meta: rows, count, kshape[nk], rshape[nr], x (off, kstrides, rstrides), out (off,
  // kstrides[, rstrides]), per-row inputs (off, kstrides)...
  const int x_at = 2 + nk + nr;
  const int o_at = x_at + 1 + nk + nr;
  const int t_at = o_at + 1 + nk + (k.elementwise ? nr : 0);
  const int n_meta = t_at + (1 + nk) * (k.num_inputs - 1);
  k.meta_size = ClArgs::MetaSize(n_meta);
  if (k.meta_size < 0) return Unimplemented("reduction with too many inputs");

  std::string s = absl::StrCat("// ", label, "\n__kernel void KNAME(gptr b_out, cgptr b_x");
  for (int i = 1; i < k.num_inputs; ++i) absl::StrAppend(&s, ", cgptr b_t", i);
  absl::StrAppend(&s, ", const meta", k.meta_size, " mt) {\n  const long* m = mt.v;\n");
  absl::StrAppend(&s,
                  "  const int lid = get_local_id(0);\n  const long rows = m[0], count = m[1];\n");
  absl::StrAppend(&s, "  cgptr px = b_x + ", M(x_at), ";\n  gptr po = b_out + ", M(o_at), ";\n");
  for (int i = 1; i < k.num_inputs; ++i) {
    absl::StrAppend(&s, "  cgptr pt", i, " = b_t", i, " + ", M(t_at + (1 + nk) * (i - 1)), ";\n");
  }
  // Local scratch for the work-group reductions, per accumulator type used.
  bool need[4] = {false, false, false, false};  // float, double, long, positions
  for (const ReduceStage& st : form.stages) {
    const DType t = st.value.type();
    if (t == DType::kF32) need[0] = true;
    if (t == DType::kF64) need[1] = true;
    if (t == DType::kI64 || t == DType::kBool) need[2] = true;
    if (st.kind == ReduceKind::kArgMax) need[3] = true;
    if (t == DType::kF64 && !dev.fp64()) {
      return Unimplemented("the reduction computes in f64 but the device has no cl_khr_fp64");
    }
  }
  if (need[0]) s += "  __local float red_f[KILN_WG];\n";
  if (need[1]) s += "  __local double red_d[KILN_WG];\n";
  if (need[2]) s += "  __local long red_l[KILN_WG];\n";
  if (need[3]) s += "  __local long red_p[KILN_WG];\n";
  absl::StrAppend(&s,
                  "  for (long row = get_group_id(0); row < rows; row += get_num_groups(0)) {\n");
  // Kept index of this row, and the row's base offsets.
  absl::StrAppend(&s, "    long krem = row;\n");
  for (int i = nk - 1; i >= 0; --i) {
    absl::StrAppend(&s, "    const long k", i, " = krem % ", M(2 + i), "; krem /= ", M(2 + i),
                    ";\n");
  }
  auto kept_offset = [&](int at) {
    std::string o = "0";
    for (int i = 0; i < nk; ++i) absl::StrAppend(&o, " + k", i, " * ", M(at + i));
    return o;
  };
  absl::StrAppend(&s, "    const long xbase = ", kept_offset(x_at + 1), ";\n");
  absl::StrAppend(&s, "    const long obase = ", kept_offset(o_at + 1), ";\n");
  std::vector<std::string> input_names(k.num_inputs);
  input_names[0] = "in0";
  for (int i = 1; i < k.num_inputs; ++i) {
    const DType as = ExprTypeOf(inputs[i]);
    input_names[i] = absl::StrCat("in", i);
    absl::StrAppend(
        &s, "    const ", ClExprPrinter::CType(as), " in", i, " = ",
        ClLoad(inputs[i], as, absl::StrCat("pt", i), kept_offset(t_at + (1 + nk) * (i - 1) + 1)),
        ";\n");
  }
  // The offsets of reduced position p within the row.
  auto reduced_offsets = [&](bool with_out) {
    std::string res = "      long rrem = p;\n";
    for (int j = nr - 1; j >= 0; --j) {
      absl::StrAppend(&res, "      const long r", j, " = rrem % ", M(2 + nk + j),
                      "; rrem /= ", M(2 + nk + j), ";\n");
    }
    absl::StrAppend(&res, "      const long xo = xbase");
    for (int j = 0; j < nr; ++j) absl::StrAppend(&res, " + r", j, " * ", M(x_at + 1 + nk + j));
    res += ";\n";
    if (with_out) {
      absl::StrAppend(&res, "      const long oo = obase");
      for (int j = 0; j < nr; ++j) absl::StrAppend(&res, " + r", j, " * ", M(o_at + 1 + nk + j));
      res += ";\n";
    }
    return res;
  };
  const DType xt = ExprTypeOf(inputs[0]);
  const std::string load_x = absl::StrCat("      const ", ClExprPrinter::CType(xt),
                                          " in0 = ", ClLoad(inputs[0], xt, "px", "xo"), ";\n");
  for (size_t si = 0; si < form.stages.size(); ++si) {
    const ReduceStage& st = form.stages[si];
    const DType t = st.value.type();
    const char* ct = ClExprPrinter::CType(t);
    const bool fl = IsF(t);
    const bool argmax = st.kind == ReduceKind::kArgMax;
    std::string init;
    switch (st.kind) {
      case ReduceKind::kSum:
        init = Zero(t);
        break;
      case ReduceKind::kMin:
        init = fl ? (t == DType::kF32 ? "INFINITY" : "((double)INFINITY)") : "LONG_MAX";
        break;
      default:
        init = fl ? (t == DType::kF32 ? "(-INFINITY)" : "(-(double)INFINITY)") : "LONG_MIN";
        break;
    }
    absl::StrAppend(&s, "    ", argmax ? "long" : ct, " acc", si, ";\n    {\n    ", ct,
                    " part = ", init, ";\n");
    if (argmax) absl::StrAppend(&s, "    long best = 0;\n");
    absl::StrAppend(&s, "    for (long p = lid; p < count; p += KILN_WG) {\n",
                    reduced_offsets(false));
    if (st.value.Uses(ExprOp::kInput, 0)) s += load_x;
    absl::StrAppend(&s, "      const long idx0 = p;\n");
    ClExprPrinter::Leaves leaves;
    leaves.inputs = input_names;
    ClExprPrinter printer(leaves, dev.fp64());
    std::string body;
    KILN_ASSIGN_OR_RETURN(std::string v, printer.Print(st.value, &body));
    // Nested one level deeper than the printer assumes; indentation is cosmetic.
    absl::StrAppend(&s, body, "      const ", ct, " v = ", v, ";\n");
    switch (st.kind) {
      case ReduceKind::kSum:
        absl::StrAppend(&s, fl ? "      part += v;\n" : "      part = wadd(part, v);\n");
        break;
      case ReduceKind::kMax:
        absl::StrAppend(&s, fl ? absl::StrCat("      part = ", t == DType::kF32 ? "nmaxf" : "nmaxd",
                                              "(part, v);\n")
                               : "      part = max(part, v);\n");
        break;
      case ReduceKind::kMin:
        absl::StrAppend(&s, fl ? absl::StrCat("      part = ", t == DType::kF32 ? "nminf" : "nmind",
                                              "(part, v);\n")
                               : "      part = min(part, v);\n");
        break;
      case ReduceKind::kArgMax:
        absl::StrAppend(
            &s, fl ? "      if ((isnan(v) && !isnan(part)) || v > part) { part = v; best = p; }\n"
                   : "      if (v > part) { part = v; best = p; }\n");
        break;
    }
    absl::StrAppend(&s, "    }\n");
    // Work-group tree reduction; every item reads the result.
    const std::string red = t == DType::kF32 ? "red_f" : t == DType::kF64 ? "red_d" : "red_l";
    absl::StrAppend(&s, "    ", red, "[lid] = part;\n");
    if (argmax) absl::StrAppend(&s, "    red_p[lid] = best;\n");
    absl::StrAppend(&s, "    barrier(CLK_LOCAL_MEM_FENCE);\n",
                    "    for (int s = KILN_WG / 2; s > 0; s >>= 1) {\n      if (lid < s) {\n");
    const std::string A = red + "[lid]", B = red + "[lid + s]";
    switch (st.kind) {
      case ReduceKind::kSum:
        absl::StrAppend(
            &s, "        ", A,
            fl ? absl::StrCat(" += ", B, ";\n") : absl::StrCat(" = wadd(", A, ", ", B, ");\n"));
        break;
      case ReduceKind::kMax:
      case ReduceKind::kMin: {
        const bool mx = st.kind == ReduceKind::kMax;
        const char* f =
            fl ? (t == DType::kF32 ? (mx ? "nmaxf" : "nminf") : (mx ? "nmaxd" : "nmind"))
               : (mx ? "max" : "min");
        absl::StrAppend(&s, "        ", A, " = ", f, "(", A, ", ", B, ");\n");
        break;
      }
      case ReduceKind::kArgMax:
        absl::StrAppend(&s, "        const ", ct, " a = ", A, ", b = ", B,
                        ";\n        const long pa = red_p[lid], pb = red_p[lid + s];\n");
        if (fl) {
          absl::StrAppend(&s,
                          "        if ((isnan(b) && !isnan(a)) || b > a || ((b == a || (isnan(a) "
                          "&& isnan(b))) && pb < pa)) { ",
                          A, " = b; red_p[lid] = pb; }\n");
        } else {
          absl::StrAppend(&s, "        if (b > a || (b == a && pb < pa)) { ", A,
                          " = b; red_p[lid] = pb; }\n");
        }
        break;
    }
    absl::StrAppend(&s, "      }\n      barrier(CLK_LOCAL_MEM_FENCE);\n    }\n");
    absl::StrAppend(&s, "    acc", si, " = ", argmax ? "red_p[0]" : red + "[0]",
                    ";\n    barrier(CLK_LOCAL_MEM_FENCE);\n    }\n");
  }
  ClExprPrinter::Leaves leaves;
  leaves.inputs = input_names;
  ClExprPrinter printer(leaves, dev.fp64());
  std::string body;
  KILN_ASSIGN_OR_RETURN(std::string v, printer.Print(form.output, &body));
  if (k.elementwise) {
    absl::StrAppend(&s, "    for (long p = lid; p < count; p += KILN_WG) {\n",
                    reduced_offsets(true));
    if (form.output.Uses(ExprOp::kInput, 0)) s += load_x;
    absl::StrAppend(&s, "      const long idx0 = p;\n", body, "  ",
                    ClStore(out, form.output.type(), "po", "oo", v), "\n    }\n");
  } else {
    absl::StrAppend(&s, "    if (lid == 0) {\n", body, "      ",
                    ClStore(out, form.output.type(), "po", "obase", v), "\n    }\n");
  }
  absl::StrAppend(&s, "  }\n}\n");
  k.slot = dev.DeclareKernel("red", s);
  return k;
}

void LaunchReduce(const ReduceKernel& k, const LaunchArgs& a, Exec& ex) {
  const XpuDevice& dev = *ex.device;
  const TensorArg& x = a.inputs[0];
  const TensorArg& o = a.output;
  bool reduced[kMaxRank] = {};
  for (int ax : k.axes) reduced[ax] = true;
  std::vector<int> kept, red;
  for (int i = 0; i < x.rank; ++i) (reduced[i] ? red : kept).push_back(i);
  int64_t rows = 1, count = 1;
  for (int i : kept) rows *= x.shape[i];
  for (int i : red) count *= x.shape[i];
  if (rows == 0) return;
  ClArgs args;
  const int64_t out_off = args.Mem(dev, o.data);  // buffer 0: out
  args.Long(rows);
  args.Long(count);
  for (int i : kept) args.Long(x.shape[i]);
  for (int i : red) args.Long(x.shape[i]);
  args.Long(args.Mem(dev, x.data));
  for (int i : kept) args.Long(x.strides[i]);
  for (int i : red) args.Long(x.strides[i]);
  args.Long(out_off);
  // Output strides of the kept axes (and of the reduced ones for elementwise outputs).
  for (size_t j = 0; j < kept.size(); ++j) {
    const int oaxis = (k.elementwise || k.keepdim) ? kept[j] : static_cast<int>(j);
    args.Long(o.strides[oaxis]);
  }
  if (k.elementwise) {
    for (int i : red) args.Long(o.strides[i]);
  }
  for (int i = 1; i < k.num_inputs; ++i) {
    const TensorArg& t = a.inputs[i];
    args.Long(args.Mem(dev, t.data));
    for (size_t j = 0; j < kept.size(); ++j) args.Long(t.strides[j]);
  }
  const size_t wg = dev.work_group();
  const size_t global = std::min<size_t>(static_cast<size_t>(rows), 65536) * wg;
  ex.Enqueue(k.slot, args, 1, &global, &wg, k.meta_size);
}

}  // namespace kiln::xpu
