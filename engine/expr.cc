#include "engine/expr.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kiln {
namespace {

bool IsFloatType(DType t) { return t == DType::kF32 || t == DType::kF64; }

int Rank(DType t) {
  switch (t) {
    case DType::kBool:
      return 0;
    case DType::kI64:
      return 1;
    case DType::kF32:
      return 2;
    case DType::kF64:
      return 3;
    default:
      KILN_CHECK(false, "expression types are f32, f64, i64 and bool");
  }
  return 0;
}

DType Promote(DType a, DType b) { return Rank(a) >= Rank(b) ? a : b; }

bool IsComparison(ExprOp op) { return op >= ExprOp::kEq && op <= ExprOp::kGe; }

std::shared_ptr<ExprNode> NewNode(ExprOp op, DType type) {
  auto n = std::make_shared<ExprNode>();
  n->op = op;
  n->type = type;
  n->index = 0;
  n->fvalue = 0;
  n->ivalue = 0;
  return n;
}

bool AllConst(const std::vector<Expr>& args) {
  for (const Expr& a : args) {
    if (a.node().op != ExprOp::kConst) return false;
  }
  return true;
}

// Constant-folds a node whose arguments are all constants, by running it.
Expr Fold(const Expr& e) {
  ExprProgram p(e);
  const ExprValue v = p.Eval(ExprEnv{});
  if (IsFloatType(e.type())) return Expr::Const(v.f, e.type());
  if (e.type() == DType::kBool) return Expr::Bool(v.i != 0);
  return Expr::Int(v.i);
}

double RoundTo(DType t, double v) {
  return t == DType::kF32 ? static_cast<double>(static_cast<float>(v)) : v;
}

double StableSigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

int64_t IntDiv(int64_t a, int64_t b) {
  if (b == 0) return 0;  // defined (not UB) so a bad index expression cannot crash a kernel
  if (a == std::numeric_limits<int64_t>::min() && b == -1) return a;
  return a / b;
}
int64_t IntMod(int64_t a, int64_t b) {
  if (b == 0 || b == -1) return 0;
  const int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

}  // namespace

const char* ExprOpName(ExprOp op) {
  static constexpr const char* kNames[] = {
      "const", "input", "index", "acc",     "count", "load",   "neg", "abs",   "exp", "log",
      "sqrt",  "rsqrt", "tanh",  "sigmoid", "erf",   "sin",    "cos", "floor", "not", "add",
      "sub",   "mul",   "div",   "mod",     "pow",   "max",    "min", "eq",    "ne",  "lt",
      "le",    "gt",    "ge",    "and",     "or",    "select", "cast"};
  return kNames[static_cast<int>(op)];
}

DType ExprTypeOf(DType t) {
  if (t == DType::kBool) return DType::kBool;
  return ComputeDType(t);
}

const char* ReduceKindName(ReduceKind k) {
  switch (k) {
    case ReduceKind::kSum:
      return "sum";
    case ReduceKind::kMax:
      return "max";
    case ReduceKind::kMin:
      return "min";
    case ReduceKind::kArgMax:
      return "argmax";
  }
  return "?";
}

DType Expr::type() const { return node_->type; }

Expr Expr::Const(double v, DType type) {
  KILN_CHECK(
      type == DType::kF32 || type == DType::kF64 || type == DType::kI64 || type == DType::kBool,
      "Expr::Const: type must be f32, f64, i64 or bool");
  if (!IsFloatType(type)) return type == DType::kBool ? Bool(v != 0) : Int(static_cast<int64_t>(v));
  auto n = NewNode(ExprOp::kConst, type);
  n->fvalue = RoundTo(type, v);
  return Expr(n);
}

Expr Expr::Int(int64_t v) {
  auto n = NewNode(ExprOp::kConst, DType::kI64);
  n->ivalue = v;
  return Expr(n);
}

Expr Expr::Bool(bool v) {
  auto n = NewNode(ExprOp::kConst, DType::kBool);
  n->ivalue = v ? 1 : 0;
  return Expr(n);
}

Expr Expr::Input(int index, DType type) {
  Rank(type);  // checks the type
  auto n = NewNode(ExprOp::kInput, type);
  n->index = index;
  return Expr(n);
}

Expr Expr::Index(int axis) {
  auto n = NewNode(ExprOp::kIndex, DType::kI64);
  n->index = axis;
  return Expr(n);
}

Expr Expr::Acc(int stage, DType type) {
  Rank(type);
  auto n = NewNode(ExprOp::kAcc, type);
  n->index = stage;
  return Expr(n);
}

Expr Expr::Count() { return Expr(NewNode(ExprOp::kCount, DType::kI64)); }

Expr Expr::Load(int aux, const Expr& index, DType type) {
  Rank(type);
  auto n = NewNode(ExprOp::kLoad, type);
  n->index = aux;
  n->args.push_back(index.type() == DType::kI64 ? index : Cast(DType::kI64, index));
  return Expr(n);
}

Expr Expr::Cast(DType type, const Expr& a) {
  Rank(type);
  if (a.type() == type) return a;
  auto n = NewNode(ExprOp::kCast, type);
  n->args.push_back(a);
  Expr e(n);
  return a.node().op == ExprOp::kConst ? Fold(e) : e;
}

Expr Expr::Unary(ExprOp op, const Expr& a) {
  DType t = a.type();
  switch (op) {
    case ExprOp::kNeg:
    case ExprOp::kAbs:
      if (t == DType::kBool) t = DType::kI64;
      break;
    case ExprOp::kNot:
      t = DType::kBool;
      break;
    case ExprOp::kFloor:
      break;
    case ExprOp::kExp:
    case ExprOp::kLog:
    case ExprOp::kSqrt:
    case ExprOp::kRsqrt:
    case ExprOp::kTanh:
    case ExprOp::kSigmoid:
    case ExprOp::kErf:
    case ExprOp::kSin:
    case ExprOp::kCos:
      if (!IsFloatType(t)) t = DType::kF32;
      break;
    default:
      KILN_CHECK(false, "Expr::Unary: not a unary op");
  }
  if (op == ExprOp::kFloor && !IsFloatType(t)) return a;
  auto n = NewNode(op, t);
  n->args.push_back(Cast(t, a));
  Expr e(n);
  return AllConst(n->args) ? Fold(e) : e;
}

Expr Expr::Binary(ExprOp op, const Expr& a, const Expr& b) {
  KILN_CHECK(op >= ExprOp::kAdd && op <= ExprOp::kOr, "Expr::Binary: not a binary op");
  DType arg_t = Promote(a.type(), b.type());
  DType t = arg_t;
  if (op == ExprOp::kAnd || op == ExprOp::kOr) {
    arg_t = t = DType::kBool;
  } else if (IsComparison(op)) {
    t = DType::kBool;
  } else {
    if (arg_t == DType::kBool) arg_t = DType::kI64;
    if (op == ExprOp::kPow && !IsFloatType(arg_t)) arg_t = DType::kF32;
    t = arg_t;
  }
  auto n = NewNode(op, t);
  n->args.push_back(Cast(arg_t, a));
  n->args.push_back(Cast(arg_t, b));
  Expr e(n);
  return AllConst(n->args) ? Fold(e) : e;
}

Expr Expr::Select(const Expr& cond, const Expr& a, const Expr& b) {
  const DType t = Promote(a.type(), b.type());
  auto n = NewNode(ExprOp::kSelect, t);
  n->args.push_back(Cast(DType::kBool, cond));
  n->args.push_back(Cast(t, a));
  n->args.push_back(Cast(t, b));
  Expr e(n);
  if (cond.node().op == ExprOp::kConst) return cond.node().ivalue ? n->args[1] : n->args[2];
  return e;
}

namespace {

std::string ConstString(const ExprNode& n) {
  if (n.type == DType::kBool) return n.ivalue ? "true" : "false";
  if (n.type == DType::kI64) return absl::StrCat(n.ivalue);
  if (std::isnan(n.fvalue)) return "nan";
  if (std::isinf(n.fvalue)) return n.fvalue < 0 ? "-inf" : "inf";
  return absl::StrFormat("%.9g", n.fvalue);
}

const char* InfixOp(ExprOp op) {
  switch (op) {
    case ExprOp::kAdd:
      return " + ";
    case ExprOp::kSub:
      return " - ";
    case ExprOp::kMul:
      return " * ";
    case ExprOp::kDiv:
      return " / ";
    case ExprOp::kMod:
      return " % ";
    case ExprOp::kEq:
      return " == ";
    case ExprOp::kNe:
      return " != ";
    case ExprOp::kLt:
      return " < ";
    case ExprOp::kLe:
      return " <= ";
    case ExprOp::kGt:
      return " > ";
    case ExprOp::kGe:
      return " >= ";
    case ExprOp::kAnd:
      return " && ";
    case ExprOp::kOr:
      return " || ";
    default:
      return nullptr;
  }
}

}  // namespace

std::string Expr::ToString() const {
  if (!node_) return "<none>";
  const ExprNode& n = *node_;
  switch (n.op) {
    case ExprOp::kConst:
      return ConstString(n);
    case ExprOp::kInput:
      return absl::StrCat("in", n.index);
    case ExprOp::kIndex:
      return absl::StrCat("idx", n.index);
    case ExprOp::kAcc:
      return absl::StrCat("acc", n.index);
    case ExprOp::kCount:
      return "count";
    case ExprOp::kLoad:
      return absl::StrCat("aux", n.index, "[", n.args[0].ToString(), "]");
    case ExprOp::kNeg:
      return absl::StrCat("-", n.args[0].ToString());
    case ExprOp::kNot:
      return absl::StrCat("!", n.args[0].ToString());
    case ExprOp::kCast:
      return absl::StrCat(DTypeName(n.type), "(", n.args[0].ToString(), ")");
    case ExprOp::kSelect:
      return absl::StrCat("(", n.args[0].ToString(), " ? ", n.args[1].ToString(), " : ",
                          n.args[2].ToString(), ")");
    default:
      break;
  }
  if (const char* infix = InfixOp(n.op)) {
    return absl::StrCat("(", n.args[0].ToString(), infix, n.args[1].ToString(), ")");
  }
  std::string out = absl::StrCat(ExprOpName(n.op), "(");
  for (size_t i = 0; i < n.args.size(); ++i) {
    if (i) out += ", ";
    out += n.args[i].ToString();
  }
  return out + ")";
}

bool operator==(const Expr& a, const Expr& b) {
  if (a.node_ == b.node_) return true;
  if (!a.node_ || !b.node_) return false;
  const ExprNode &x = *a.node_, &y = *b.node_;
  if (x.op != y.op || x.type != y.type || x.index != y.index || x.ivalue != y.ivalue ||
      x.args.size() != y.args.size()) {
    return false;
  }
  if (std::memcmp(&x.fvalue, &y.fvalue, sizeof(double)) != 0) return false;  // NaN-safe
  for (size_t i = 0; i < x.args.size(); ++i) {
    if (x.args[i] != y.args[i]) return false;
  }
  return true;
}

uint64_t Expr::Hash() const {
  if (!node_) return 0;
  const ExprNode& n = *node_;
  uint64_t bits;
  std::memcpy(&bits, &n.fvalue, 8);
  size_t h =
      absl::HashOf(static_cast<int>(n.op), static_cast<int>(n.type), n.index, n.ivalue, bits);
  for (const Expr& a : n.args) h = absl::HashOf(h, a.Hash());
  return h;
}

bool Expr::Uses(ExprOp leaf, int index) const {
  if (!node_) return false;
  if (node_->op == leaf && (index < 0 || node_->index == index)) return true;
  for (const Expr& a : node_->args) {
    if (a.Uses(leaf, index)) return true;
  }
  return false;
}

int Expr::NumInputs() const {
  if (!node_) return 0;
  int n = node_->op == ExprOp::kInput ? node_->index + 1 : 0;
  for (const Expr& a : node_->args) n = std::max(n, a.NumInputs());
  return n;
}

int Expr::NumAux() const {
  if (!node_) return 0;
  int n = node_->op == ExprOp::kLoad ? node_->index + 1 : 0;
  for (const Expr& a : node_->args) n = std::max(n, a.NumAux());
  return n;
}

Expr operator+(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kAdd, a, b); }
Expr operator-(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kSub, a, b); }
Expr operator*(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kMul, a, b); }
Expr operator/(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kDiv, a, b); }
Expr operator-(const Expr& a) { return Expr::Unary(ExprOp::kNeg, a); }
// A double constant takes the other operand's type if that is a float type (so `x * 0.5`
// stays f32), else f32.
static Expr Lit(double v, const Expr& like) {
  return Expr::Const(v, IsFloatType(like.type()) ? like.type() : DType::kF32);
}
Expr operator+(const Expr& a, double b) { return a + Lit(b, a); }
Expr operator-(const Expr& a, double b) { return a - Lit(b, a); }
Expr operator*(const Expr& a, double b) { return a * Lit(b, a); }
Expr operator/(const Expr& a, double b) { return a / Lit(b, a); }
Expr operator+(double a, const Expr& b) { return Lit(a, b) + b; }
Expr operator-(double a, const Expr& b) { return Lit(a, b) - b; }
Expr operator*(double a, const Expr& b) { return Lit(a, b) * b; }
Expr operator/(double a, const Expr& b) { return Lit(a, b) / b; }
Expr Exp(const Expr& a) { return Expr::Unary(ExprOp::kExp, a); }
Expr Log(const Expr& a) { return Expr::Unary(ExprOp::kLog, a); }
Expr Sqrt(const Expr& a) { return Expr::Unary(ExprOp::kSqrt, a); }
Expr Rsqrt(const Expr& a) { return Expr::Unary(ExprOp::kRsqrt, a); }
Expr Tanh(const Expr& a) { return Expr::Unary(ExprOp::kTanh, a); }
Expr Sigmoid(const Expr& a) { return Expr::Unary(ExprOp::kSigmoid, a); }
Expr Erf(const Expr& a) { return Expr::Unary(ExprOp::kErf, a); }
Expr Abs(const Expr& a) { return Expr::Unary(ExprOp::kAbs, a); }
Expr Max(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kMax, a, b); }
Expr Min(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kMin, a, b); }
Expr Pow(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kPow, a, b); }
Expr Mod(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kMod, a, b); }
Expr Eq(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kEq, a, b); }
Expr Ne(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kNe, a, b); }
Expr Lt(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kLt, a, b); }
Expr Le(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kLe, a, b); }
Expr Gt(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kGt, a, b); }
Expr Ge(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kGe, a, b); }
Expr And(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kAnd, a, b); }
Expr Or(const Expr& a, const Expr& b) { return Expr::Binary(ExprOp::kOr, a, b); }
Expr Not(const Expr& a) { return Expr::Unary(ExprOp::kNot, a); }
Expr Select(const Expr& c, const Expr& a, const Expr& b) { return Expr::Select(c, a, b); }

Expr Substitute(const Expr& e, std::span<const Expr> inputs) {
  const ExprNode& n = e.node();
  if (n.op == ExprOp::kInput) {
    if (n.index < static_cast<int>(inputs.size()) && inputs[n.index]) return inputs[n.index];
    return e;
  }
  if (n.args.empty()) return e;
  std::vector<Expr> args;
  bool changed = false;
  for (const Expr& a : n.args) {
    args.push_back(Substitute(a, inputs));
    changed |= !(args.back() == a);
  }
  if (!changed) return e;
  switch (n.op) {
    case ExprOp::kLoad:
      return Expr::Load(n.index, args[0], n.type);
    case ExprOp::kCast:
      return Expr::Cast(n.type, args[0]);
    case ExprOp::kSelect:
      return Expr::Select(args[0], args[1], args[2]);
    default:
      break;
  }
  if (args.size() == 1) return Expr::Unary(n.op, args[0]);
  return Expr::Binary(n.op, args[0], args[1]);
}

// ---- Differentiation ----------------------------------------------------------------------------
namespace {

bool IsConstValue(const Expr& e, double v) {
  const ExprNode& n = e.node();
  if (n.op != ExprOp::kConst) return false;
  return IsFloatType(n.type) ? n.fvalue == v : static_cast<double>(n.ivalue) == v;
}
Expr Zero(DType t) { return Expr::Const(0, t); }
Expr SAdd(const Expr& a, const Expr& b) {
  if (IsConstValue(a, 0)) return Expr::Cast(Promote(a.type(), b.type()), b);
  if (IsConstValue(b, 0)) return Expr::Cast(Promote(a.type(), b.type()), a);
  return a + b;
}
Expr SNeg(const Expr& a) { return IsConstValue(a, 0) ? a : -a; }
Expr SSub(const Expr& a, const Expr& b) {
  if (IsConstValue(b, 0)) return Expr::Cast(Promote(a.type(), b.type()), a);
  if (IsConstValue(a, 0)) return Expr::Cast(Promote(a.type(), b.type()), SNeg(b));
  return a - b;
}
Expr SMul(const Expr& a, const Expr& b) {
  const DType t = Promote(a.type(), b.type());
  if (IsConstValue(a, 0) || IsConstValue(b, 0)) return Zero(t);
  if (IsConstValue(a, 1)) return Expr::Cast(t, b);
  if (IsConstValue(b, 1)) return Expr::Cast(t, a);
  return a * b;
}
Expr SDiv(const Expr& a, const Expr& b) {
  if (IsConstValue(a, 0)) return Zero(Promote(a.type(), b.type()));
  if (IsConstValue(b, 1)) return a;
  return a / b;
}
Expr SSelect(const Expr& c, const Expr& a, const Expr& b) {
  if (IsConstValue(a, 0) && IsConstValue(b, 0)) return Zero(Promote(a.type(), b.type()));
  return Select(c, a, b);
}

}  // namespace

Expr Diff(const Expr& e, int input) {
  const ExprNode& n = e.node();
  const DType t = IsFloatType(n.type) ? n.type : DType::kF32;
  if (!IsFloatType(n.type)) return Zero(t);
  auto d = [&](int k) { return Diff(n.args[k], input); };
  switch (n.op) {
    case ExprOp::kConst:
    case ExprOp::kIndex:
    case ExprOp::kAcc:
    case ExprOp::kCount:
    case ExprOp::kLoad:
    case ExprOp::kFloor:
      return Zero(t);
    case ExprOp::kInput:
      return Expr::Const(n.index == input ? 1.0 : 0.0, t);
    case ExprOp::kNeg:
      return SNeg(d(0));
    case ExprOp::kAbs: {
      const Expr& a = n.args[0];
      return SMul(d(0), Select(Gt(a, Zero(t)), Expr::Const(1, t),
                               Select(Lt(a, Zero(t)), Expr::Const(-1, t), Zero(t))));
    }
    case ExprOp::kExp:
      return SMul(d(0), e);
    case ExprOp::kLog:
      return SDiv(d(0), n.args[0]);
    case ExprOp::kSqrt:
      return SDiv(SMul(d(0), Expr::Const(0.5, t)), e);
    case ExprOp::kRsqrt:
      return SMul(d(0), Expr::Const(-0.5, t) * e * e * e);
    case ExprOp::kTanh:
      return SMul(d(0), 1.0 - e * e);
    case ExprOp::kSigmoid:
      return SMul(d(0), e * (1.0 - e));
    case ExprOp::kErf: {
      const Expr& a = n.args[0];
      return SMul(d(0), Expr::Const(2.0 / std::sqrt(std::numbers::pi), t) * Exp(-(a * a)));
    }
    case ExprOp::kSin:
      return SMul(d(0), Expr::Unary(ExprOp::kCos, n.args[0]));
    case ExprOp::kCos:
      return SMul(d(0), -Expr::Unary(ExprOp::kSin, n.args[0]));
    case ExprOp::kAdd:
      return SAdd(d(0), d(1));
    case ExprOp::kSub:
      return SSub(d(0), d(1));
    case ExprOp::kMul:
      return SAdd(SMul(d(0), n.args[1]), SMul(n.args[0], d(1)));
    case ExprOp::kDiv: {
      const Expr &a = n.args[0], &b = n.args[1];
      return SSub(SDiv(d(0), b), SMul(d(1), SDiv(a, b * b)));
    }
    case ExprOp::kMod: {  // fmod(a, b) = a - trunc(a / b) * b
      const Expr &a = n.args[0], &b = n.args[1];
      return SSub(d(0), SMul(d(1), SDiv(a - e, b)));
    }
    case ExprOp::kPow: {
      const Expr &a = n.args[0], &b = n.args[1];
      const Expr db = d(1);
      Expr r = SMul(d(0), b * Pow(a, b - 1.0));
      if (!IsConstValue(db, 0)) r = SAdd(r, SMul(db, e * Log(a)));
      return r;
    }
    case ExprOp::kMax:
      return SSelect(Ge(n.args[0], n.args[1]), d(0), d(1));
    case ExprOp::kMin:
      return SSelect(Le(n.args[0], n.args[1]), d(0), d(1));
    case ExprOp::kSelect:
      return SSelect(n.args[0], Diff(n.args[1], input), Diff(n.args[2], input));
    case ExprOp::kCast:
      if (!IsFloatType(n.args[0].type())) return Zero(t);
      return Expr::Cast(t, d(0));
    default:
      return Zero(t);  // comparisons, logic: zero almost everywhere
  }
}

// ---- Interpreter ------------------------------------------------------------------------------

ExprProgram::ExprProgram(const Expr& root) {
  std::vector<std::pair<const ExprNode*, int>> memo;
  Emit(root, memo);
  type_ = root.type();
}

int ExprProgram::Emit(const Expr& e, std::vector<std::pair<const ExprNode*, int>>& memo) {
  const ExprNode* key = &e.node();
  for (const auto& [node, reg] : memo) {
    if (node == key) return reg;  // shared subtree: evaluate once
  }
  Instr in{};
  in.op = key->op;
  in.type = key->type;
  in.index = key->index;
  in.a = in.b = in.c = -1;
  if (key->op == ExprOp::kConst) {
    if (IsFloatType(key->type)) {
      in.imm.f = key->fvalue;
    } else {
      in.imm.i = key->ivalue;
    }
  }
  const size_t nargs = key->args.size();
  if (nargs > 0) {
    in.arg_type = key->args[0].type();
    in.a = Emit(key->args[0], memo);
  }
  if (nargs > 1) in.b = Emit(key->args[1], memo);
  if (nargs > 2) in.c = Emit(key->args[2], memo);
  code_.push_back(in);
  const int reg = static_cast<int>(code_.size()) - 1;
  memo.emplace_back(key, reg);
  return reg;
}

ExprValue ExprProgram::Eval(const ExprEnv& env) const {
  KILN_CHECK(!code_.empty(), "ExprProgram::Eval on an empty program");
  // Registers are the instruction indices; expressions are small (tens of nodes).
  constexpr int kInline = 64;
  // Not zero-filled (this runs per element): every register is written before it is read,
  // since instructions only refer to earlier ones.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
  ExprValue inline_regs[kInline];
  std::vector<ExprValue> heap;
  ExprValue* r = inline_regs;
  if (code_.size() > kInline) {
    heap.resize(code_.size());
    r = heap.data();
  }
  for (size_t pc = 0; pc < code_.size(); ++pc) {
    const Instr& in = code_[pc];
    ExprValue& out = r[pc];
    const bool fl = IsFloatType(in.type);
    const bool arg_fl = in.a >= 0 && IsFloatType(in.arg_type);
    const double fa = in.a >= 0 ? r[in.a].f : 0, fb = in.b >= 0 ? r[in.b].f : 0;
    const int64_t ia = in.a >= 0 ? r[in.a].i : 0, ib = in.b >= 0 ? r[in.b].i : 0;
    switch (in.op) {
      case ExprOp::kConst:
        out = in.imm;
        continue;
      case ExprOp::kInput:
        out = env.inputs[in.index];
        continue;
      case ExprOp::kIndex:
        out.i = env.index[in.index];
        continue;
      case ExprOp::kAcc:
        out = env.acc[in.index];
        continue;
      case ExprOp::kCount:
        out.i = env.count;
        continue;
      case ExprOp::kLoad:
        out = env.load(env.load_ctx, in.index, ia, in.type);
        continue;
      case ExprOp::kCast:
        if (fl) {
          out.f = RoundTo(in.type, arg_fl ? fa : static_cast<double>(ia));
        } else if (in.type == DType::kBool) {
          out.i = arg_fl ? (fa != 0) : (ia != 0);
        } else {  // to i64: truncate, saturate, NaN -> 0 (as StoreElement does)
          if (!arg_fl) {
            out.i = ia;
          } else if (std::isnan(fa)) {
            out.i = 0;
          } else if (fa >= 9.2233720368547758e18) {
            out.i = std::numeric_limits<int64_t>::max();
          } else if (fa <= -9.2233720368547758e18) {
            out.i = std::numeric_limits<int64_t>::min();
          } else {
            out.i = static_cast<int64_t>(fa);
          }
        }
        continue;
      case ExprOp::kSelect:
        out = r[in.a].i ? r[in.b] : r[in.c];
        continue;
      case ExprOp::kNot:
        out.i = ia == 0;
        continue;
      default:
        break;
    }
    if (IsComparison(in.op)) {
      bool v = false;
      switch (in.op) {
        case ExprOp::kEq:
          v = arg_fl ? fa == fb : ia == ib;
          break;
        case ExprOp::kNe:
          v = arg_fl ? fa != fb : ia != ib;
          break;
        case ExprOp::kLt:
          v = arg_fl ? fa < fb : ia < ib;
          break;
        case ExprOp::kLe:
          v = arg_fl ? fa <= fb : ia <= ib;
          break;
        case ExprOp::kGt:
          v = arg_fl ? fa > fb : ia > ib;
          break;
        default:
          v = arg_fl ? fa >= fb : ia >= ib;
          break;
      }
      out.i = v;
      continue;
    }
    if (in.op == ExprOp::kAnd || in.op == ExprOp::kOr) {
      out.i = in.op == ExprOp::kAnd ? (ia && ib) : (ia || ib);
      continue;
    }
    if (fl) {
      double v = 0;
      switch (in.op) {
        case ExprOp::kNeg:
          v = -fa;
          break;
        case ExprOp::kAbs:
          v = std::fabs(fa);
          break;
        case ExprOp::kExp:
          v = std::exp(fa);
          break;
        case ExprOp::kLog:
          v = std::log(fa);
          break;
        case ExprOp::kSqrt:
          v = std::sqrt(fa);
          break;
        case ExprOp::kRsqrt:
          v = 1.0 / std::sqrt(fa);
          break;
        case ExprOp::kTanh:
          v = std::tanh(fa);
          break;
        case ExprOp::kSigmoid:
          v = StableSigmoid(fa);
          break;
        case ExprOp::kErf:
          v = std::erf(fa);
          break;
        case ExprOp::kSin:
          v = std::sin(fa);
          break;
        case ExprOp::kCos:
          v = std::cos(fa);
          break;
        case ExprOp::kFloor:
          v = std::floor(fa);
          break;
        case ExprOp::kAdd:
          v = fa + fb;
          break;
        case ExprOp::kSub:
          v = fa - fb;
          break;
        case ExprOp::kMul:
          v = fa * fb;
          break;
        case ExprOp::kDiv:
          v = fa / fb;
          break;
        case ExprOp::kMod:
          v = std::fmod(fa, fb);
          break;
        case ExprOp::kPow:
          v = std::pow(fa, fb);
          break;
        case ExprOp::kMax:  // NaN-propagating, like the reference kernels
          v = (std::isnan(fa) || std::isnan(fb)) ? std::numeric_limits<double>::quiet_NaN()
                                                 : std::max(fa, fb);
          break;
        case ExprOp::kMin:
          v = (std::isnan(fa) || std::isnan(fb)) ? std::numeric_limits<double>::quiet_NaN()
                                                 : std::min(fa, fb);
          break;
        default:
          KILN_CHECK(false, "ExprProgram: bad float op");
      }
      out.f = RoundTo(in.type, v);
    } else {
      int64_t v = 0;
      switch (in.op) {
        case ExprOp::kNeg:
          v = static_cast<int64_t>(0ull - static_cast<uint64_t>(ia));
          break;
        case ExprOp::kAbs:
          v = ia < 0 ? static_cast<int64_t>(0ull - static_cast<uint64_t>(ia)) : ia;
          break;
        case ExprOp::kAdd:
          v = static_cast<int64_t>(static_cast<uint64_t>(ia) + static_cast<uint64_t>(ib));
          break;
        case ExprOp::kSub:
          v = static_cast<int64_t>(static_cast<uint64_t>(ia) - static_cast<uint64_t>(ib));
          break;
        case ExprOp::kMul:
          v = static_cast<int64_t>(static_cast<uint64_t>(ia) * static_cast<uint64_t>(ib));
          break;
        case ExprOp::kDiv:
          v = IntDiv(ia, ib);
          break;
        case ExprOp::kMod:
          v = IntMod(ia, ib);
          break;
        case ExprOp::kMax:
          v = std::max(ia, ib);
          break;
        case ExprOp::kMin:
          v = std::min(ia, ib);
          break;
        default:
          KILN_CHECK(false, "ExprProgram: bad integer op");
      }
      out.i = v;
    }
  }
  return r[code_.size() - 1];
#pragma GCC diagnostic pop
}

// ---- Attention modifiers ----------------------------------------------------------------------
namespace attn {

Expr CausalMask() { return Le(KvIdx(), QIdx()); }

Expr SlidingWindowMask(int64_t window) {
  return And(Le(KvIdx(), QIdx()), Lt(QIdx() - KvIdx(), Expr::Int(window)));
}

Expr ChunkedMask(int64_t chunk) {
  return And(Le(KvIdx(), QIdx()), Ge(KvIdx(), QIdx() - Mod(QIdx(), Expr::Int(chunk))));
}

Expr PrefixLmMask(int aux) {
  return Or(Le(KvIdx(), QIdx()), Lt(KvIdx(), Expr::Load(aux, Batch(), DType::kI64)));
}

Expr KeyPaddingMask(int aux) { return Lt(KvIdx(), Expr::Load(aux, Batch(), DType::kI64)); }

Expr DocumentMask(int aux, int64_t row_len, int64_t window) {
  const Expr row = Batch() * Expr::Int(row_len);
  const Expr same =
      Eq(Expr::Load(aux, row + QIdx(), DType::kI64), Expr::Load(aux, row + KvIdx(), DType::kI64));
  return And(window > 0 ? SlidingWindowMask(window) : CausalMask(), same);
}

Expr AlibiScore(int64_t num_heads) {
  const Expr h1 = Expr::Cast(DType::kF32, Head() + Expr::Int(1));
  const Expr slope = Exp(h1 * (-8.0 * std::numbers::ln2 / static_cast<double>(num_heads)));
  return Score() + slope * Expr::Cast(DType::kF32, KvIdx() - QIdx());
}

Expr SoftCapScore(double cap) { return cap * Tanh(Score() / cap); }

Expr RelativeBiasScore(int aux, int64_t max_distance) {
  const Expr m = Expr::Int(max_distance);
  const Expr rel = Max(Min(KvIdx() - QIdx(), m), -m);
  return Score() + Expr::Load(aux, Head() * Expr::Int(2 * max_distance + 1) + rel + m, DType::kF32);
}

Expr Then(const Expr& first, const Expr& second) {
  const Expr in[] = {first};
  return Substitute(second, in);
}

}  // namespace attn
}  // namespace kiln
