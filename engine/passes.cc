#include "engine/passes.h"

#include <algorithm>
#include <atomic>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kiln {

std::vector<Dim> ContiguousStrides(const SymShape& shape) {
  std::vector<Dim> s(shape.size());
  Dim acc = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    s[i] = acc;
    acc = acc * shape[i];
  }
  return s;
}

bool IsContiguousLayout(const SymShape& shape, const std::vector<Dim>& strides) {
  Dim expect = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    if (shape[i] != Dim(1) && strides[i] != expect) return false;
    expect = expect * shape[i];
  }
  return true;
}

namespace {

std::string NodeLabel(const Graph& g, int32_t id) {
  const Node& n = g.node(id);
  return absl::StrCat("%", id, n.name.empty() ? "" : absl::StrCat(" '", n.name, "'"), " (",
                      OpName(n.op), " ", TypeString(n.dtype, n.shape, g), ")");
}

}  // namespace

namespace {

// Versions of State storage, for the in-place rules: a State, and every in-place write,
// starts a version of the storage it lives in; views read the version of their input.
struct StateVersions {
  std::vector<int32_t> version;         // per node: the version it reads, or -1
  std::vector<int32_t> overwritten_by;  // per version node: the node that overwrites it, or -1
};

// Checks the in-place writes of node `i` (all its outputs) and records them in `sv`.
Status CheckInPlaceWrites(const Graph& g, int32_t i, int num_out, StateVersions& sv) {
  for (int o = 0; o < num_out; ++o) {
    const int32_t target = InPlaceTarget(g, i + o);
    if (target < 0) continue;
    const int32_t owner = StorageOwner(g, target);
    if (g.node(owner).op != OpKind::kState) {
      return InvalidArgument("verify: ", NodeLabel(g, i), " writes ", NodeLabel(g, target),
                             " in place (output ", o, "), so that must be a State tensor (or a ",
                             "view of one); it lives in ", OpName(g.node(owner).op), " '",
                             g.node(owner).name, "', and weights and inputs are read-only");
    }
    // (A second writer of a value reads it after the first: Verify rejects that read.)
    const int32_t ver = sv.version[target];
    if (sv.overwritten_by[ver] == i) {
      return InvalidArgument("verify: ", NodeLabel(g, i), " writes the same storage of State '",
                             g.node(owner).name, "' through two outputs");
    }
    sv.overwritten_by[ver] = i;
  }
  return OkStatus();
}

}  // namespace

Status Verify(const Graph& g, std::span<const Value> outputs) {
  absl::flat_hash_set<std::string> names;
  StateVersions sv;
  sv.version.assign(g.size(), -1);
  sv.overwritten_by.assign(g.size(), -1);
  for (int32_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(i);
    const OpDef& def = GetOpDef(n.op);
    if (def.cls == OpClass::kProjection) {
      return InvalidArgument("verify: ", NodeLabel(g, i),
                             " does not directly follow its producer with the outputs before it");
    }
    std::vector<TensorType> in;
    for (int32_t id : n.inputs) {
      if (id < 0 || id >= i)
        return Internal("verify: ", NodeLabel(g, i), " reads node ", id, " which is not before it");
      in.push_back({g.node(id).dtype, g.node(id).shape});
    }
    const int n_in = static_cast<int>(in.size());
    if (n_in < def.min_inputs || (def.max_inputs >= 0 && n_in > def.max_inputs)) {
      return InvalidArgument("verify: ", NodeLabel(g, i), " has ", n_in, " inputs");
    }
    StatusOr<std::vector<TensorType>> t = InferOutputs(n.op, in, n.attrs);
    if (!t.ok()) return Annotate(t.status(), absl::StrCat("verify: ", NodeLabel(g, i)));
    const int num_out = static_cast<int>(t->size());
    if (g.NumOutputs(i) != num_out) {
      return InvalidArgument("verify: ", NodeLabel(g, i), " has ", num_out,
                             " outputs but is followed by ", g.NumOutputs(i) - 1,
                             " output_of nodes");
    }
    for (int o = 0; o < num_out; ++o) {
      const Node& out = g.node(i + o);
      if (o > 0 && (out.attrs.ints.size() != 1 || out.attrs.ints[0] != o)) {
        return InvalidArgument("verify: ", NodeLabel(g, i + o), " should be output ", o, " of %",
                               i);
      }
      if ((*t)[o].dtype != out.dtype || (*t)[o].shape != out.shape) {
        return Internal("verify: ", NodeLabel(g, i + o), " is recorded as ",
                        TypeString(out.dtype, out.shape, g), " but its rule gives ",
                        TypeString((*t)[o].dtype, (*t)[o].shape, g));
      }
    }
    if (def.cls == OpClass::kSource) {
      if (n.name.empty()) return InvalidArgument("verify: ", NodeLabel(g, i), " needs a name");
      if (!names.insert(n.name).second) {
        return InvalidArgument("verify: two external tensors are named '", n.name, "'");
      }
    }
    // In-place rules. The executor runs nodes in this order, so a node that reads a State
    // value must come before the node that overwrites that value.
    for (int32_t id : n.inputs) {
      const int32_t ver = sv.version[id];
      if (ver < 0 || sv.overwritten_by[ver] < 0 || sv.overwritten_by[ver] == i) continue;
      return InvalidArgument(
          "verify: ", NodeLabel(g, i), " reads ", NodeLabel(g, id), " after ",
          NodeLabel(g, sv.overwritten_by[ver]), " overwrote it in place (nodes run in builder ",
          "order); read the writer's output to see the update, or build the read before the "
          "write");
    }
    KILN_RETURN_IF_ERROR(CheckInPlaceWrites(g, i, num_out, sv));
    if (n.op == OpKind::kState) sv.version[i] = i;
    if (def.cls == OpClass::kView) sv.version[i] = sv.version[n.inputs[0]];
    for (int o = 0; o < num_out; ++o) {
      if (InPlaceTarget(g, i + o) >= 0) sv.version[i + o] = i + o;
    }
    i += num_out - 1;  // the output_of nodes were checked with their producer
  }
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Value v = outputs[k];
    if (!v.valid() || v.id >= g.size())
      return InvalidArgument("verify: an output is not a valid value");
    const int32_t ver = sv.version[v.id];
    if (ver >= 0 && sv.overwritten_by[ver] >= 0) {
      return InvalidArgument("verify: output ", k, " is ", NodeLabel(g, v.id), ", whose storage ",
                             NodeLabel(g, sv.overwritten_by[ver]),
                             " overwrites in place before the program ends; output the ",
                             "writer's result instead");
    }
  }
  return OkStatus();
}

StatusOr<Graph> EliminateDeadCode(const Graph& g, std::vector<Value>& outputs) {
  std::vector<char> live(g.size(), 0);
  for (Value v : outputs) live[v.id] = 1;
  for (int32_t i = g.size() - 1; i >= 0; --i) {
    const Node& n = g.node(i);
    const OpDef& def = GetOpDef(n.op);
    if (def.side_effect || def.cls == OpClass::kSource) live[i] = 1;
    if (!live[i]) continue;
    for (int32_t in : n.inputs) live[in] = 1;
  }
  // A live node's launch writes all its outputs: keep their output_of nodes (storage).
  for (int32_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(i);
    if (n.op == OpKind::kOutputOf && live[n.inputs[0]]) live[i] = 1;
  }
  Graph out;
  for (const SymbolInfo& s : g.symbols()) out.AddSymbol(s.name, s.max, s.min);
  std::vector<int32_t> remap(g.size(), -1);
  for (int32_t i = 0; i < g.size(); ++i) {
    if (!live[i]) continue;
    Node n = g.node(i);
    for (int32_t& in : n.inputs) in = remap[in];
    remap[i] = out.AddNode(std::move(n));
  }
  for (Value& v : outputs) v.id = remap[v.id];
  return out;
}

namespace {

// A reshape that only adds or drops size-1 axes keeps the other axes' strides.
bool ReshapeOnlyUnitAxes(const SymShape& from, const std::vector<Dim>& strides, const SymShape& to,
                         std::vector<Dim>* out_strides) {
  std::vector<int> kept_from, kept_to;
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i] != Dim(1)) kept_from.push_back(static_cast<int>(i));
  }
  for (size_t i = 0; i < to.size(); ++i) {
    if (to[i] != Dim(1)) kept_to.push_back(static_cast<int>(i));
  }
  if (kept_from.size() != kept_to.size()) return false;
  for (size_t k = 0; k < kept_from.size(); ++k) {
    if (from[kept_from[k]] != to[kept_to[k]]) return false;
  }
  out_strides->assign(to.size(), Dim(0));
  for (size_t k = 0; k < kept_to.size(); ++k) (*out_strides)[kept_to[k]] = strides[kept_from[k]];
  return true;
}

}  // namespace

namespace {
std::atomic<PreLowerRewrite> g_pre_lower{nullptr};
}  // namespace

void SetPreLowerRewrite(PreLowerRewrite rewrite) { g_pre_lower.store(rewrite); }

StatusOr<Graph> LowerViews(const Graph& g_in, std::vector<Value>& outputs,
                           std::vector<Layout>* layouts) {
  std::optional<Graph> rewritten;
  if (PreLowerRewrite rewrite = g_pre_lower.load()) {
    KILN_ASSIGN_OR_RETURN(rewritten, rewrite(g_in, outputs));
  }
  const Graph& g = rewritten ? *rewritten : g_in;
  Graph out;
  for (const SymbolInfo& s : g.symbols()) out.AddSymbol(s.name, s.max, s.min);
  std::vector<int32_t> remap(g.size(), -1);
  layouts->clear();
  auto own = [&](int32_t id) {
    Layout l;
    l.root = id;
    l.strides = ContiguousStrides(out.node(id).shape);
    l.offset = 0;
    return l;
  };
  for (int32_t i = 0; i < g.size(); ++i) {
    Node n = g.node(i);
    for (int32_t& in : n.inputs) in = remap[in];
    const OpKind op = n.op;
    if (op == OpKind::kReshape) {
      const Layout& src = (*layouts)[n.inputs[0]];
      const SymShape& from = out.node(n.inputs[0]).shape;
      Layout l;
      if (IsContiguousLayout(from, src.strides)) {
        l = src;
        l.strides = ContiguousStrides(n.shape);
      } else if (ReshapeOnlyUnitAxes(from, src.strides, n.shape, &l.strides)) {
        l.root = src.root;
        l.offset = src.offset;
      } else {
        // Not expressible as strides: copy to a dense buffer, then view that.
        Node copy;
        copy.op = OpKind::kContiguous;
        copy.inputs = {n.inputs[0]};
        copy.dtype = out.node(n.inputs[0]).dtype;
        copy.shape = from;
        copy.name = n.name.empty() ? "" : n.name + ".contiguous";
        const int32_t cid = out.AddNode(std::move(copy));
        layouts->push_back(own(cid));
        n.inputs[0] = cid;
        l = own(cid);
        l.strides = ContiguousStrides(n.shape);
      }
      remap[i] = out.AddNode(std::move(n));
      layouts->push_back(std::move(l));
      continue;
    }
    Layout l;
    const int32_t id = out.size();
    switch (op) {
      case OpKind::kPermute: {
        const Layout& src = (*layouts)[n.inputs[0]];
        l.root = src.root;
        l.offset = src.offset;
        for (int64_t p : n.attrs.ints) l.strides.push_back(src.strides[p]);
        break;
      }
      case OpKind::kSlice: {
        const Layout& src = (*layouts)[n.inputs[0]];
        l = src;
        l.offset = src.offset + n.attrs.dims[0] * src.strides[n.attrs.ints[0]];
        break;
      }
      case OpKind::kExpand: {
        const Layout& src = (*layouts)[n.inputs[0]];
        const SymShape& from = out.node(n.inputs[0]).shape;
        l = src;
        for (size_t d = 0; d < from.size(); ++d) {
          if (from[d] == Dim(1) && n.shape[d] != Dim(1)) l.strides[d] = 0;
        }
        break;
      }
      default:
        l.root = id;
        l.strides = ContiguousStrides(n.shape);
        l.offset = 0;
        break;
    }
    remap[i] = out.AddNode(std::move(n));
    // An in-place output lives where the input it overwrites lives (State storage).
    if (const int32_t target = InPlaceTarget(out, id); target >= 0) {
      l = (*layouts)[target];
      if (out.node(l.root).op != OpKind::kState) {
        return InvalidArgument(NodeLabel(out, id), " writes in place into ",
                               OpName(out.node(l.root).op), " '", out.node(l.root).name,
                               "': in-place targets must be State tensors (or views of them)");
      }
    }
    layouts->push_back(std::move(l));
  }
  for (Value& v : outputs) v.id = remap[v.id];
  return out;
}

std::optional<Graph> CastMatMulRhs(const Graph& g, std::vector<Value>& outputs) {
  auto mixed = [&](const Node& n) {
    return n.op == OpKind::kMatMul && g.node(n.inputs[1]).dtype != n.dtype;
  };
  if (std::none_of(g.nodes().begin(), g.nodes().end(), mixed)) return std::nullopt;
  Graph out;
  for (const SymbolInfo& s : g.symbols()) out.AddSymbol(s.name, s.max, s.min);
  std::vector<int32_t> remap(g.size(), -1);
  for (int32_t i = 0; i < g.size(); ++i) {
    Node node = g.node(i);
    for (int32_t& in : node.inputs) in = remap[in];
    if (mixed(g.node(i))) {
      const Node& rhs = g.node(g.node(i).inputs[1]);
      Node cast;
      cast.op = OpKind::kCast;
      cast.inputs = {node.inputs[1]};
      cast.dtype = node.dtype;
      cast.shape = rhs.shape;
      cast.attrs.dtype = node.dtype;
      if (!rhs.name.empty()) cast.name = absl::StrCat(rhs.name, ".", DTypeName(node.dtype));
      node.inputs[1] = out.AddNode(std::move(cast));
    }
    remap[i] = out.AddNode(std::move(node));
  }
  for (Value& v : outputs) v.id = remap[v.id];
  return out;
}

}  // namespace kiln
