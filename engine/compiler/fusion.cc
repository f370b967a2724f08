#include "engine/compiler/fusion.h"

#include <algorithm>
#include <optional>
#include <unordered_map>

#include "absl/strings/str_join.h"

namespace kiln::compiler {
namespace {

enum class Cls : uint8_t { kOther, kPointwise, kReduce, kGemm };

struct Group {
  int32_t root = -1;
  int32_t anchor = -1;  // the reduction/row op or GEMM, if any
  Cls anchor_cls = Cls::kOther;
  std::vector<int32_t> members;
  std::vector<char> prologue;  // per member: upstream of a reduce anchor
};

bool Codegenable(DType t) { return t != DType::kInvalid && !IsQuantized(t); }

// Whether storing a value of `t` and loading it back is the identity on the expression value
// (or a rounding we accept inside fused kernels: f16/bf16 intermediates stay f32).
bool FusibleIntermediate(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF64:
    case DType::kF16:
    case DType::kBF16:
    case DType::kI64:
    case DType::kBool:
      return true;
    default:
      return false;
  }
}

int NumAux(const Node& n) {
  return n.op == OpKind::kMap && !n.attrs.ints.empty() ? static_cast<int>(n.attrs.ints[0]) : 0;
}

class Fuser {
 public:
  Fuser(const Graph& g, const std::vector<Value>& outputs, const FusionOptions& o)
      : g_(g), o_(o), n_(g.size()) {
    cls_.assign(n_, Cls::kOther);
    consumers_.resize(n_);
    is_output_.assign(n_, 0);
    state_rooted_.assign(n_, 0);
    group_of_.assign(n_, -1);
    for (Value v : outputs) is_output_[v.id] = 1;
    for (int32_t i = 0; i < n_; ++i) {
      const Node& node = g_.node(i);
      const OpDef& def = GetOpDef(node.op);
      for (int32_t in : node.inputs) {
        auto& c = consumers_[in];
        if (c.empty() || c.back() != i) c.push_back(i);
      }
      if (def.side_effect) side_effects_.push_back(i);
      if (node.op == OpKind::kState || InPlaceTarget(g_, i) >= 0) state_rooted_[i] = 1;
      if (def.cls == OpClass::kView && state_rooted_[node.inputs[0]]) state_rooted_[i] = 1;
      cls_[i] = Classify(node, def);
    }
  }

  void Run() {
    for (int32_t id = n_ - 1; id >= 0; --id) {
      if (group_of_[id] >= 0) continue;
      const Cls c = cls_[id];
      if (c == Cls::kPointwise ? !o_.caps.pointwise : (c != Cls::kReduce || !o_.caps.reductions)) {
        continue;
      }
      Group grp;
      grp.root = id;
      grp.members = {id};
      grp.prologue = {0};
      if (c == Cls::kReduce) {
        grp.anchor = id;
        grp.anchor_cls = Cls::kReduce;
      }
      const int gi = static_cast<int>(groups_.size());
      group_of_[id] = gi;
      groups_.push_back(std::move(grp));
      for (bool changed = true; changed;) {
        changed = false;
        std::vector<int32_t> ms = groups_[gi].members;
        std::sort(ms.rbegin(), ms.rend());
        for (int32_t m : ms) {
          for (int32_t p : g_.node(m).inputs) changed |= TryAbsorb(gi, p);
        }
      }
      if (groups_[gi].members.size() == 1) group_of_[id] = -1;  // nothing joined
    }
  }

  const Graph& g_;
  const FusionOptions& o_;
  const int32_t n_;
  std::vector<Cls> cls_;
  std::vector<std::vector<int32_t>> consumers_;
  std::vector<char> is_output_, state_rooted_;
  std::vector<int32_t> side_effects_;
  std::vector<int> group_of_;
  std::vector<Group> groups_;

 private:
  Cls Classify(const Node& node, const OpDef& def) const {
    if (node.shape.size() > static_cast<size_t>(kMaxRank)) return Cls::kOther;
    if (node.op == OpKind::kLinear || node.op == OpKind::kMatMul) {
      return Codegenable(node.dtype) ? Cls::kGemm : Cls::kOther;
    }
    if (!Codegenable(node.dtype)) return Cls::kOther;
    for (int32_t in : node.inputs) {
      if (!Codegenable(g_.node(in).dtype)) return Cls::kOther;
    }
    if (def.pointwise != nullptr &&
        (def.cls == OpClass::kPointwise || def.cls == OpClass::kGenerator)) {
      return Cls::kPointwise;
    }
    if (def.reduce != nullptr) return Cls::kReduce;
    return Cls::kOther;
  }

  bool IsMember(int gi, int32_t v) const { return group_of_[v] == gi; }
  int MemberIndex(const Group& grp, int32_t v) const {
    for (size_t i = 0; i < grp.members.size(); ++i) {
      if (grp.members[i] == v) return static_cast<int>(i);
    }
    return -1;
  }

  // Would moving p's reads to the group's root cross a side effect on State storage?
  bool CrossesSideEffect(int32_t p, int32_t root) const {
    bool reads_state = false;
    for (int32_t in : g_.node(p).inputs) reads_state |= state_rooted_[in] != 0;
    if (!reads_state) return false;
    for (int32_t s : side_effects_) {
      if (s > p && s < root) return true;
    }
    return false;
  }

  bool TryAbsorb(int gi, int32_t p) {
    Group& grp = groups_[gi];
    if (group_of_[p] >= 0 || cls_[p] == Cls::kOther || is_output_[p]) return false;
    if (static_cast<int>(grp.members.size()) >= o_.max_members) return false;
    for (int32_t u : consumers_[p]) {
      if (!IsMember(gi, u)) return false;
    }
    if (CrossesSideEffect(p, grp.root)) return false;
    const Node& node = g_.node(p);
    char prologue = 0;
    switch (cls_[p]) {
      case Cls::kPointwise: {
        if (!o_.caps.pointwise || !FusibleIntermediate(node.dtype)) return false;
        if (grp.anchor_cls == Cls::kReduce) {
          bool pro = false, epi = false;
          for (int32_t u : consumers_[p]) {
            if (u == grp.anchor) {
              const Node& r = g_.node(u);
              for (size_t s = 0; s < r.inputs.size(); ++s) {
                if (r.inputs[s] == p && s != 0) return false;  // per-row inputs stay inputs
              }
              pro = true;
            } else if (grp.prologue[MemberIndex(grp, u)]) {
              pro = true;
            } else {
              epi = true;
            }
          }
          if (pro) {
            // A prologue must read at least one tensor (the kernel takes its shape from one).
            if (static_cast<int>(node.inputs.size()) - NumAux(node) == 0) return false;
            if (epi && !Elementwise(grp.anchor)) return false;
          }
          prologue = pro ? 1 : 0;
        } else if (grp.anchor_cls == Cls::kGemm) {
          for (int32_t u : consumers_[p]) {
            if (u == grp.anchor) return false;  // GEMM operands are read by the GEMM itself
          }
        }
        break;
      }
      case Cls::kReduce:
        if (!o_.caps.reductions || grp.anchor >= 0) return false;
        grp.anchor = p;
        grp.anchor_cls = Cls::kReduce;
        break;
      case Cls::kGemm:
        if (!o_.caps.gemm_epilogues || grp.anchor >= 0) return false;
        if (g_.node(grp.root).dtype != node.dtype) return false;  // the GEMM writes the output
        if (node.shape.empty()) return false;
        grp.anchor = p;
        grp.anchor_cls = Cls::kGemm;
        break;
      case Cls::kOther:
        return false;
    }
    grp.members.push_back(p);
    grp.prologue.push_back(prologue);
    group_of_[p] = gi;
    return true;
  }

 public:
  bool Elementwise(int32_t r) const {
    const Node& n = g_.node(r);
    std::vector<DType> in;
    for (int32_t i : n.inputs) in.push_back(g_.node(i).dtype);
    return GetOpDef(n.op).reduce(n.attrs, in, n.dtype).elementwise_output;
  }
};

// Builds the expression/spec of one group and the fused node.
class GroupBuilder {
 public:
  GroupBuilder(const Fuser& f, const Group& grp) : f_(f), g_(f.g_), grp_(grp) {
    members_ = grp.members;
    std::sort(members_.begin(), members_.end());
    for (size_t i = 0; i < grp.members.size(); ++i) {
      member_.emplace(grp.members[i], static_cast<int>(i));
    }
  }

  // Fills `node` (the fused node; inputs are ids of the original graph) and, for anchored
  // groups, `group`. False (with a reason) if the group cannot be expressed.
  bool Build(Node* node, FusedGroup* group, std::string* why) {
    const Node& root = g_.node(grp_.root);
    const bool pure = grp_.anchor < 0;
    const bool reduce = grp_.anchor_cls == Cls::kReduce;
    const bool gemm = grp_.anchor_cls == Cls::kGemm;
    elementwise_ = reduce && f_.Elementwise(grp_.anchor);
    // Pass 1: the group's inputs, by role.
    if (gemm) {
      for (int32_t in : g_.node(grp_.anchor).inputs) gemm_args_.push_back(in);
    }
    for (int32_t m : members_) {
      const Node& n = g_.node(m);
      if (m == grp_.anchor) {
        if (gemm) continue;
        for (size_t s = 0; s < n.inputs.size(); ++s) {
          if (IsMember(n.inputs[s])) continue;
          Register(n.inputs[s], s == 0 ? ArgRole::kFull : ArgRole::kOut);
        }
        continue;
      }
      const int num_main = static_cast<int>(n.inputs.size()) - NumAux(n);
      for (int s = 0; s < static_cast<int>(n.inputs.size()); ++s) {
        const int32_t in = n.inputs[s];
        if (IsMember(in)) continue;
        if (s < num_main && ConstantOf(in)) continue;  // folded into the expression
        if (s >= num_main) {
          Register(in, ArgRole::kAux);
        } else if (pure || gemm || Prologue(m) || elementwise_) {
          Register(in, ArgRole::kFull);
        } else {
          Register(in, ArgRole::kOut);
        }
      }
    }
    const int num_inputs =
        static_cast<int>(gemm_args_.size() + full_.size() + out_.size() + aux_.size());
    if (num_inputs == 0) {  // e.g. a map of constant fills only
      *why = "no tensor inputs";
      return false;
    }
    if (num_inputs > f_.o_.max_inputs) {
      *why = "too many inputs";
      return false;
    }
    // Pass 2: expressions, members in graph order.
    for (int32_t m : members_) {
      if (!Value(m, why)) return false;
    }
    const Expr result = value_.at(grp_.root);
    int nodes = ExprSize(result);
    for (const ReduceStage& st : stages_) nodes += ExprSize(st.value);
    if (nodes > f_.o_.max_expr_nodes) {
      *why = "expression too large";
      return false;
    }
    // The fused node.
    node->name = root.name.empty() && grp_.anchor >= 0 ? g_.node(grp_.anchor).name : root.name;
    node->dtype = root.dtype;
    node->shape = root.shape;
    node->inputs.clear();
    for (const auto* list : {&gemm_args_, &full_, &out_, &aux_}) {
      node->inputs.insert(node->inputs.end(), list->begin(), list->end());
    }
    std::vector<std::string> ops;
    for (int32_t m : members_) ops.push_back(OpName(g_.node(m).op));
    label_ = absl::StrJoin(ops, "+");
    if (pure) {
      node->op = OpKind::kMap;
      node->attrs = Attrs();
      node->attrs.expr[0] = Finalize(result);
      node->attrs.ints = {static_cast<int64_t>(aux_.size())};
      node->attrs.dims = root.shape;
      node->attrs.dtype = root.dtype;
      return true;
    }
    const Node& anchor = g_.node(grp_.anchor);
    node->op = anchor.op;
    node->attrs = anchor.attrs;
    KernelSpec& s = group->spec;
    s.name = StrCat("fused.", label_);
    s.out_dtype = root.dtype;
    s.out_rank = static_cast<int>(root.shape.size());
    group->label = label_;
    for (int32_t in : gemm_args_) {
      s.args.push_back(
          {g_.node(in).dtype, ArgRole::kGemmOperand, static_cast<int>(g_.node(in).shape.size())});
    }
    if (gemm) {
      s.kind = KernelKind::kGemmEpilogue;
      s.rank = s.out_rank;
      s.gemm_operands = {0, 1};
      group->kind = FusedGroup::Kind::kGemm;
      group->gemm_op = anchor.op;
      group->gemm_attrs = anchor.attrs;
      for (int32_t in : anchor.inputs) {
        group->gemm_inputs.push_back({g_.node(in).dtype, g_.node(in).shape});
      }
      group->gemm_output = {anchor.dtype, anchor.shape};
    } else {
      s.kind = KernelKind::kReduce;
      const Node& x = g_.node(anchor.inputs[0]);
      s.rank = static_cast<int>(x.shape.size());
      s.elementwise = elementwise_;
      if (GetOpDef(anchor.op).cls == OpClass::kReduce) {
        s.keepdim = anchor.attrs.ints[0] != 0;
        for (size_t i = 1; i < anchor.attrs.ints.size(); ++i) {
          s.reduce_axes.push_back(static_cast<int>(anchor.attrs.ints[i]));
        }
      } else {
        s.reduce_axes = {s.rank - 1};
      }
      s.stages = stages_;
      s.shape_arg = full_.empty() ? -1 : static_cast<int>(gemm_args_.size());
      group->kind = FusedGroup::Kind::kReduce;
    }
    for (int32_t in : full_) s.args.push_back({g_.node(in).dtype, ArgRole::kFull, s.rank});
    for (int32_t in : out_) s.args.push_back({g_.node(in).dtype, ArgRole::kOut, s.out_rank});
    for (int32_t in : aux_) s.args.push_back({g_.node(in).dtype, ArgRole::kAux, 1});
    // Final leaf indices (placeholders -> argument positions).
    auto fix = [&](const Expr& e) { return Finalize(e); };
    if (gemm) {
      s.value = fix(result);
    } else {
      for (ReduceStage& st : s.stages) st.value = fix(st.value);
      s.output = fix(result);
    }
    const Status v = s.Validate();
    if (!v.ok()) {
      *why = std::string(StatusMessage(v));
      return false;
    }
    return true;
  }

  const std::string& label() const { return label_; }

 private:
  static constexpr int kPlaceholder = 100000;  // Input leaves before final numbering
  static constexpr int kGemmLeaf = 200000;

  bool IsMember(int32_t v) const { return member_.contains(v); }
  // A non-member input that is a constant fill (Builder::Full: MulScalar's, AddScalar's
  // operand), possibly broadcast, of a float type: its value as a constant of the expression, so
  // the kernel does not read a broadcast tensor (a stride-0 input keeps generated loops off their
  // unit-stride path). Expr::Const rounds it to the fill's dtype as the fill kernel does.
  std::optional<Expr> ConstantOf(int32_t v) const {
    // Through the reshapes and expands that broadcasting puts between the fill and its use.
    while (g_.node(v).op == OpKind::kExpand || g_.node(v).op == OpKind::kReshape) {
      v = g_.node(v).inputs[0];
    }
    const Node& n = g_.node(v);
    if (n.op != OpKind::kFull || n.attrs.floats.size() != 1) return {};
    if (n.dtype != DType::kF32 && n.dtype != DType::kF64) return {};
    return Expr::Const(n.attrs.floats[0], n.dtype);
  }
  bool Prologue(int32_t m) const { return grp_.prologue[member_.at(m)] != 0; }

  void Register(int32_t v, ArgRole role) {
    auto& list = role == ArgRole::kFull ? full_ : (role == ArgRole::kOut ? out_ : aux_);
    if (std::find(list.begin(), list.end(), v) == list.end()) list.push_back(v);
  }
  int Position(const std::vector<int32_t>& list, int32_t v) const {
    return static_cast<int>(std::find(list.begin(), list.end(), v) - list.begin());
  }
  // A placeholder leaf for non-member input `v` read in role `role`.
  Expr Leaf(int32_t v, ArgRole role) const {
    const DType t = ExprTypeOf(g_.node(v).dtype);
    const int base = role == ArgRole::kFull ? 0 : 50000;
    return Expr::Input(kPlaceholder + base + Position(role == ArgRole::kFull ? full_ : out_, v), t);
  }

  // Placeholders -> final Input/Load numbering: args are [gemm operands, full, out, aux].
  Expr Finalize(const Expr& e) const {
    const int nf = static_cast<int>(full_.size()), ng = static_cast<int>(gemm_args_.size());
    const int nargs =
        static_cast<int>(gemm_args_.size() + full_.size() + out_.size() + aux_.size());
    return MapLeaves(e, [&](const Expr& leaf) {
      const ExprNode& n = leaf.node();
      if (n.op != ExprOp::kInput) return leaf;
      if (n.index == kGemmLeaf) return Expr::Input(nargs, n.type);
      if (n.index >= kPlaceholder + 50000) {
        return Expr::Input(ng + nf + (n.index - kPlaceholder - 50000), n.type);
      }
      if (n.index >= kPlaceholder) return Expr::Input(ng + (n.index - kPlaceholder), n.type);
      return leaf;
    });
  }

  // The value of member m as an expression (placeholders for inputs).
  bool Value(int32_t m, std::string* why) {
    const Node& n = g_.node(m);
    const OpDef& def = GetOpDef(n.op);
    std::vector<DType> in;
    for (int32_t i : n.inputs) in.push_back(g_.node(i).dtype);
    const bool pure = grp_.anchor < 0;
    if (m == grp_.anchor && grp_.anchor_cls == Cls::kGemm) {
      value_[m] = Expr::Input(kGemmLeaf, n.dtype == DType::kF64 ? DType::kF64 : DType::kF32);
      return true;
    }
    // Inputs of m: member values or placeholders.
    const int num_main = static_cast<int>(n.inputs.size()) - NumAux(n);
    std::vector<Expr> sub;
    for (int s = 0; s < num_main; ++s) {
      const int32_t v = n.inputs[s];
      if (IsMember(v)) {
        sub.push_back(value_.at(v));
      } else if (m == grp_.anchor) {  // a reduction's operands stay tensors (input 0: its shape)
        sub.push_back(Leaf(v, s == 0 ? ArgRole::kFull : ArgRole::kOut));
      } else if (std::optional<Expr> c = ConstantOf(v)) {
        sub.push_back(*std::move(c));
      } else {
        const bool full = pure || grp_.anchor_cls == Cls::kGemm || Prologue(m) || elementwise_;
        sub.push_back(Leaf(v, full ? ArgRole::kFull : ArgRole::kOut));
      }
    }
    // Load(k) of m's aux inputs -> the group's aux numbering.
    auto remap_aux = [&](const Expr& leaf) {
      const ExprNode& x = leaf.node();
      if (x.op != ExprOp::kLoad) return leaf;
      const int32_t v = n.inputs[num_main + x.index];
      return Expr::Load(Position(aux_, v), x.args[0], x.type);
    };
    if (m == grp_.anchor) {
      const ReduceForm form = def.reduce(n.attrs, in, n.dtype);
      auto pos = [](const Expr& leaf) {
        return leaf.node().op == ExprOp::kIndex && leaf.node().index == 0 ? Expr::Index(kPosAxis)
                                                                          : leaf;
      };
      for (const ReduceStage& st : form.stages) {
        stages_.push_back({st.kind, Substitute(MapLeaves(st.value, pos), sub)});
      }
      value_[m] = Expr::Cast(ExprTypeOf(n.dtype), Substitute(form.output, sub));
      return true;
    }
    if (def.pointwise == nullptr) {
      *why = StrCat(def.name, " has no expression form");
      return false;
    }
    Expr form = def.pointwise(n.attrs, in, n.dtype);
    if (NumAux(n) > 0) form = MapLeaves(form, remap_aux);
    value_[m] = Expr::Cast(ExprTypeOf(n.dtype), Substitute(form, sub));
    return true;
  }

  const Fuser& f_;
  const Graph& g_;
  const Group& grp_;
  std::vector<int32_t> members_;
  std::unordered_map<int32_t, int> member_;
  bool elementwise_ = false;
  std::vector<int32_t> gemm_args_, full_, out_, aux_;
  std::unordered_map<int32_t, Expr> value_;
  std::vector<ReduceStage> stages_;
  std::string label_;
};

}  // namespace

int FusedGroupIndex(const Attrs& attrs) {
  const Expr& tag = attrs.expr[0];
  const Expr& idx = attrs.expr[1];
  if (!tag || !idx || tag.node().op != ExprOp::kConst || tag.type() != DType::kI64 ||
      tag.node().ivalue != kFusedTag || idx.node().op != ExprOp::kConst) {
    return -1;
  }
  return static_cast<int>(idx.node().ivalue);
}

StatusOr<FusionResult> Fuse(const Graph& g, std::vector<Value>& outputs,
                            const FusionOptions& options) {
  Fuser f(g, outputs, options);
  f.Run();
  FusionResult r;
  const int32_t n = g.size();
  // Build every group; groups that cannot be expressed stay unfused.
  std::vector<Node> fused(f.groups_.size());
  std::vector<char> ok(f.groups_.size(), 0);
  std::vector<int> tag(f.groups_.size(), -1);
  std::vector<std::string> labels(f.groups_.size());
  for (size_t gi = 0; gi < f.groups_.size(); ++gi) {
    const Group& grp = f.groups_[gi];
    if (grp.members.size() < 2) continue;
    GroupBuilder b(f, grp);
    auto group = std::make_shared<FusedGroup>();
    std::string why;
    if (!b.Build(&fused[gi], group.get(), &why)) continue;  // left unfused
    ok[gi] = 1;
    labels[gi] = b.label();
    if (grp.anchor >= 0) {
      tag[gi] = static_cast<int>(r.groups.size());
      fused[gi].attrs.expr[0] = Expr::Int(kFusedTag);
      fused[gi].attrs.expr[1] = Expr::Int(tag[gi]);
      r.groups.push_back(std::move(group));
    }
    ++r.fused_groups;
    r.fused_nodes += static_cast<int>(grp.members.size());
  }
  for (const SymbolInfo& s : g.symbols()) r.graph.AddSymbol(s.name, s.max, s.min);
  std::vector<int32_t> remap(n, -1);
  for (int32_t i = 0; i < n; ++i) {
    const int gi = f.group_of_[i];
    const bool in_group = gi >= 0 && ok[gi];
    if (in_group && f.groups_[gi].root != i) continue;  // computed inside the fused node
    Node node = in_group ? fused[gi] : g.node(i);
    for (int32_t& in : node.inputs) {
      in = remap[in];
      if (in < 0) return Internal("fusion: a group input was not emitted before its group");
    }
    remap[i] = r.graph.AddNode(std::move(node));
    r.marks.push_back(in_group ? StrCat("fused ", f.groups_[gi].members.size(), ": ", labels[gi])
                               : "");
  }
  for (Value& v : outputs) {
    v.id = remap[v.id];
    if (v.id < 0) return Internal("fusion: an output was fused away");
  }
  return r;
}

}  // namespace kiln::compiler
