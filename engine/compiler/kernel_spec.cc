#include "engine/compiler/kernel_spec.h"

#include <algorithm>
#include <sstream>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/ops.h"

namespace kiln::compiler {
namespace {

constexpr int kMaxArgs = 64;

bool Supported(DType t) { return t != DType::kInvalid && !IsQuantized(t); }

}  // namespace

const char* KernelKindName(KernelKind k) {
  switch (k) {
    case KernelKind::kPointwise:
      return "pointwise";
    case KernelKind::kReduce:
      return "reduce";
    case KernelKind::kGemmEpilogue:
      return "gemm_epilogue";
  }
  return "?";
}

int KernelSpec::NumAux() const {
  int n = 0;
  for (const KernelArg& a : args) n += a.role == ArgRole::kAux;
  return n;
}

int KernelSpec::AuxArg(int k) const {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].role == ArgRole::kAux && k-- == 0) return static_cast<int>(i);
  }
  return -1;
}

Expr MapLeaves(const Expr& e, const std::function<Expr(const Expr&)>& fn) {
  std::unordered_map<const ExprNode*, Expr> memo;
  std::function<Expr(const Expr&)> rec = [&](const Expr& x) -> Expr {
    auto it = memo.find(&x.node());
    if (it != memo.end()) return it->second;
    const ExprNode& n = x.node();
    Expr r;
    if (n.args.empty()) {
      r = fn(x);
    } else {
      std::vector<Expr> a;
      bool changed = false;
      for (const Expr& arg : n.args) {
        a.push_back(rec(arg));
        changed |= a.back() != arg;
      }
      if (n.op == ExprOp::kLoad) {
        r = fn(changed ? Expr::Load(n.index, a[0], n.type) : x);
      } else if (!changed) {
        r = x;
      } else if (n.op == ExprOp::kCast) {
        r = Expr::Cast(n.type, a[0]);
      } else if (n.op == ExprOp::kSelect) {
        r = Expr::Select(a[0], a[1], a[2]);
      } else if (a.size() == 1) {
        r = Expr::Unary(n.op, a[0]);
      } else {
        r = Expr::Binary(n.op, a[0], a[1]);
      }
    }
    memo.emplace(&x.node(), r);
    return r;
  };
  return rec(e);
}

int ExprSize(const Expr& e) {
  std::unordered_map<const ExprNode*, int> seen;
  std::function<void(const Expr&)> rec = [&](const Expr& x) {
    if (!seen.emplace(&x.node(), 1).second) return;
    for (const Expr& a : x.node().args) rec(a);
  };
  if (e) rec(e);
  return static_cast<int>(seen.size());
}

bool UsesF64(const Expr& e) {
  if (!e) return false;
  std::unordered_map<const ExprNode*, bool> seen;
  std::function<bool(const Expr&)> rec = [&](const Expr& x) {
    if (!seen.emplace(&x.node(), true).second) return false;
    if (x.type() == DType::kF64) return true;
    for (const Expr& a : x.node().args) {
      if (rec(a)) return true;
    }
    return false;
  };
  return rec(e);
}

bool UsesF64(const KernelSpec& spec) {
  if (spec.out_dtype == DType::kF64) return true;
  for (const KernelArg& a : spec.args) {
    if (a.dtype == DType::kF64) return true;
  }
  for (const ReduceStage& st : spec.stages) {
    if (UsesF64(st.value)) return true;
  }
  return UsesF64(spec.value) || UsesF64(spec.output);
}

namespace {

// Where an expression is evaluated, for leaf checks.
enum class Site { kPointwise, kStage, kOutputElementwise, kOutputRow, kEpilogue };

Status CheckLeaves(const KernelSpec& s, const Expr& e, Site site, int stage) {
  Status st = OkStatus();
  const int num_aux = s.NumAux();
  std::unordered_map<const ExprNode*, bool> seen;
  std::function<void(const Expr&)> rec = [&](const Expr& x) {
    if (!st.ok() || !seen.emplace(&x.node(), true).second) return;
    const ExprNode& n = x.node();
    switch (n.op) {
      case ExprOp::kInput: {
        const int nargs = static_cast<int>(s.args.size());
        if (site == Site::kEpilogue && n.index == nargs) {
          const DType want = s.out_dtype == DType::kF64 ? DType::kF64 : DType::kF32;
          if (n.type != want)
            st = Internal("epilogue reads the GEMM result as ", DTypeName(n.type));
          break;
        }
        if (n.index < 0 || n.index >= nargs) {
          st = Internal("reads Input(", n.index, ") but the kernel has ", nargs, " args");
          break;
        }
        const KernelArg& a = s.args[n.index];
        if (n.type != ExprTypeOf(a.dtype)) {
          st =
              Internal("reads arg ", n.index, " (", DTypeName(a.dtype), ") as ", DTypeName(n.type));
        }
        const bool full = a.role == ArgRole::kFull, out = a.role == ArgRole::kOut;
        bool ok = false;
        switch (site) {
          case Site::kPointwise:
          case Site::kEpilogue:
            ok = full;
            break;
          case Site::kStage:
          case Site::kOutputElementwise:
            ok = full || out;
            break;
          case Site::kOutputRow:
            ok = out;
            break;
        }
        if (!ok && st.ok())
          st = Internal("arg ", n.index, " is read where its role does not allow");
        break;
      }
      case ExprOp::kIndex: {
        const int limit = site == Site::kOutputRow ? s.out_rank : s.rank;
        const bool pos = site == Site::kStage && n.index == kPosAxis;
        if (!pos && (n.index < 0 || n.index >= limit))
          st = Internal("Index(", n.index, ") is out of range");
        break;
      }
      case ExprOp::kAcc: {
        const int limit = site == Site::kStage ? stage : static_cast<int>(s.stages.size());
        if (site == Site::kPointwise || site == Site::kEpilogue || n.index < 0 ||
            n.index >= limit) {
          st = Internal("Acc(", n.index, ") is not available here");
        } else if (n.type != s.stages[n.index].value.type() &&
                   !(s.stages[n.index].kind == ReduceKind::kArgMax && n.type == DType::kI64)) {
          st = Internal("Acc(", n.index, ") has the wrong type");
        }
        break;
      }
      case ExprOp::kCount:
        if (site == Site::kPointwise || site == Site::kEpilogue)
          st = Internal("Count outside a reduction");
        break;
      case ExprOp::kLoad:
        if (n.index < 0 || n.index >= num_aux) st = Internal("Load(", n.index, ") has no aux arg");
        break;
      default:
        break;
    }
    for (const Expr& a : n.args) rec(a);
  };
  if (!e) return Internal("missing expression");
  rec(e);
  return st;
}

}  // namespace

Status KernelSpec::Validate() const {
  auto fail = [&](const Status& s) { return Annotate(s, StrCat("kernel spec '", name, "'")); };
  if (rank < 0 || rank > kMaxRank || out_rank < 0 || out_rank > kMaxRank) {
    return fail(InvalidArgument("rank above ", kMaxRank));
  }
  if (args.size() > static_cast<size_t>(kMaxArgs)) return fail(InvalidArgument("too many args"));
  if (!Supported(out_dtype)) return fail(InvalidArgument("unsupported output dtype"));
  for (const KernelArg& a : args) {
    // GEMM operands are read by the library GEMM, not by generated code (a quantized weight).
    if (a.role != ArgRole::kGemmOperand && !Supported(a.dtype)) {
      return fail(Unimplemented("codegen does not read ", DTypeName(a.dtype), " tensors"));
    }
    if (a.role == ArgRole::kAux && a.rank != 1) return fail(Internal("aux args are 1-D"));
    if (a.role == ArgRole::kFull && a.rank != rank) return fail(Internal("full arg rank"));
    if (a.role == ArgRole::kOut && (kind != KernelKind::kReduce || a.rank != out_rank)) {
      return fail(Internal("out arg rank"));
    }
    if (a.role == ArgRole::kGemmOperand && kind != KernelKind::kGemmEpilogue) {
      return fail(Internal("gemm operand outside an epilogue"));
    }
  }
  switch (kind) {
    case KernelKind::kPointwise:
      if (out_rank != rank) return fail(Internal("pointwise out_rank != rank"));
      return CheckLeaves(*this, value, Site::kPointwise, 0).ok()
                 ? OkStatus()
                 : fail(CheckLeaves(*this, value, Site::kPointwise, 0));
    case KernelKind::kGemmEpilogue: {
      if (out_rank != rank || rank < 1) return fail(Internal("epilogue ranks"));
      if (gemm_operands.size() != 2) return fail(Internal("a GEMM has two operands"));
      Status s = CheckLeaves(*this, value, Site::kEpilogue, 0);
      return s.ok() ? s : fail(s);
    }
    case KernelKind::kReduce:
      break;
  }
  if (stages.empty()) return fail(Internal("a reduction needs stages"));
  for (size_t i = 0; i < reduce_axes.size(); ++i) {
    if (reduce_axes[i] < 0 || reduce_axes[i] >= rank ||
        (i > 0 && reduce_axes[i] <= reduce_axes[i - 1])) {
      return fail(Internal("reduce axes must be sorted, unique and in range"));
    }
  }
  const int want_out_rank =
      elementwise || keepdim ? rank : rank - static_cast<int>(reduce_axes.size());
  if (out_rank != want_out_rank) return fail(Internal("reduce out_rank"));
  if (shape_arg < 0 ? !elementwise
                    : (shape_arg >= static_cast<int>(args.size()) ||
                       args[shape_arg].role != ArgRole::kFull)) {
    return fail(Internal("reduce shape_arg"));
  }
  for (size_t i = 0; i < stages.size(); ++i) {
    Status s = CheckLeaves(*this, stages[i].value, Site::kStage, static_cast<int>(i));
    if (!s.ok()) return fail(s);
    if (stages[i].value.type() == DType::kBool) return fail(Internal("bool reduction stage"));
  }
  Status s = CheckLeaves(*this, output, elementwise ? Site::kOutputElementwise : Site::kOutputRow,
                         static_cast<int>(stages.size()));
  return s.ok() ? s : fail(s);
}

std::string KernelSpec::DebugString() const {
  std::ostringstream os;
  os << KernelKindName(kind) << " '" << name << "' rank=" << rank << " -> " << DTypeName(out_dtype)
     << "/" << out_rank << "\n";
  static constexpr const char* kRoles[] = {"full", "out", "aux", "gemm"};
  for (size_t i = 0; i < args.size(); ++i) {
    os << "  arg" << i << ": " << DTypeName(args[i].dtype) << " "
       << kRoles[static_cast<int>(args[i].role)] << " rank " << args[i].rank << "\n";
  }
  if (value) os << "  value = " << value.ToString() << "\n";
  for (size_t i = 0; i < stages.size(); ++i) {
    os << "  acc" << i << " = " << ReduceKindName(stages[i].kind) << "("
       << stages[i].value.ToString() << ")\n";
  }
  if (kind == KernelKind::kReduce) {
    os << "  axes=[" << absl::StrJoin(reduce_axes, ",") << "] keepdim=" << keepdim
       << " elementwise=" << elementwise << "\n  output = " << output.ToString() << "\n";
  }
  return os.str();
}

StatusOr<KernelSpec> SpecFromRequest(const backend::KernelRequest& req) {
  const OpDef& def = GetOpDef(req.op);
  std::vector<DType> in;
  for (const TensorType& t : req.inputs) {
    if (!Supported(t.dtype)) {
      return Unimplemented("codegen does not read ", DTypeName(t.dtype), " tensors");
    }
    if (t.shape.size() > static_cast<size_t>(kMaxRank)) return Unimplemented("rank above 8");
    in.push_back(t.dtype);
  }
  if (in.size() > static_cast<size_t>(kMaxArgs)) return Unimplemented("more than 64 inputs");
  const int out_rank = static_cast<int>(req.output.shape.size());
  if (out_rank > kMaxRank) return Unimplemented("rank above 8");
  KernelSpec s;
  s.name = def.name;
  s.out_dtype = req.output.dtype;
  s.out_rank = out_rank;
  if (def.pointwise != nullptr) {
    s.kind = KernelKind::kPointwise;
    s.rank = out_rank;
    const int num_aux = req.op == OpKind::kMap && !req.attrs->ints.empty()
                            ? static_cast<int>(req.attrs->ints[0])
                            : 0;
    const int num_main = static_cast<int>(in.size()) - num_aux;
    for (int i = 0; i < static_cast<int>(in.size()); ++i) {
      s.args.push_back(i < num_main ? KernelArg{in[i], ArgRole::kFull, out_rank}
                                    : KernelArg{in[i], ArgRole::kAux, 1});
    }
    s.value = def.pointwise(*req.attrs, in, req.output.dtype);
    const DType c = in.empty() ? DType::kInvalid : ExprTypeOf(in[0]);
    if (req.op == OpKind::kCast && IsInteger(req.output.dtype) &&
        (c == DType::kF32 || c == DType::kF64)) {
      // Float -> integer: the form clamps in f64 to the target's range, which is exactly what
      // the store does (truncate, saturate, NaN -> 0); without it f32 casts need no double.
      s.value = Expr::Input(0, c);
    }
  } else if (def.reduce != nullptr) {
    if (in.empty()) return Internal("a reduction without inputs");
    const ReduceForm form = def.reduce(*req.attrs, in, req.output.dtype);
    s.kind = KernelKind::kReduce;
    s.rank = static_cast<int>(req.inputs[0].shape.size());
    s.elementwise = form.elementwise_output;
    s.shape_arg = 0;
    if (def.cls == OpClass::kReduce) {
      s.keepdim = req.attrs->ints[0] != 0;
      for (size_t i = 1; i < req.attrs->ints.size(); ++i) {
        s.reduce_axes.push_back(static_cast<int>(req.attrs->ints[i]));
      }
    } else {
      s.reduce_axes = {s.rank - 1};
    }
    s.args.push_back({in[0], ArgRole::kFull, s.rank});
    for (size_t i = 1; i < in.size(); ++i) s.args.push_back({in[i], ArgRole::kOut, out_rank});
    // The forms' Index(0) is the position within the reduced elements.
    auto pos = [](const Expr& leaf) {
      return leaf.node().op == ExprOp::kIndex && leaf.node().index == 0 ? Expr::Index(kPosAxis)
                                                                        : leaf;
    };
    for (const ReduceStage& st : form.stages)
      s.stages.push_back({st.kind, MapLeaves(st.value, pos)});
    s.output = form.output;
  } else {
    return Unimplemented(def.name, " has no expression form");
  }
  KILN_RETURN_IF_ERROR(s.Validate());
  return s;
}

}  // namespace kiln::compiler
