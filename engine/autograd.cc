#include "engine/autograd.h"

#include "absl/strings/str_cat.h"
#include "engine/dump.h"

namespace kiln {
namespace {

Status CheckValue(const Graph& g, Value v, const char* what) {
  if (!v.valid() || v.id >= g.size()) return InvalidArgument("gradients: invalid ", what, " value");
  if (!IsFloat(g.node(v.id).dtype)) {
    return InvalidArgument("gradients: ", what, " '", g.node(v.id).name, "' is ",
                           DTypeName(g.node(v.id).dtype), "; only float tensors have gradients");
  }
  return OkStatus();
}

// Activation recomputation: which block each forward node is in, and each block's clones.
class Recompute {
 public:
  Recompute(Builder& b, int32_t n) : b_(b), block_(n, -1), clone_(n, -1) {}

  // `ranges` (GradientOptions::recompute), then `on_read` (recompute_on_read).
  Status Init(std::span<const NodeRange> blocks, std::span<const NodeRange> on_read) {
    const Graph& g = b_.graph();
    const int32_t n = static_cast<int32_t>(block_.size());
    std::vector<NodeRange> ranges(blocks.begin(), blocks.end());
    ranges.insert(ranges.end(), on_read.begin(), on_read.end());
    on_read_.assign(ranges.size(), 0);
    std::fill(on_read_.begin() + static_cast<ptrdiff_t>(blocks.size()), on_read_.end(), 1);
    for (size_t r = 0; r < ranges.size(); ++r) {
      const NodeRange& range = ranges[r];
      if (range.begin < 0 || range.begin > range.end || range.end > g.size()) {
        return InvalidArgument("gradients: recompute range ", r, " [", range.begin, ", ", range.end,
                               ") is not within the graph's ", g.size(), " nodes");
      }
      for (int32_t i = range.begin; i < std::min(range.end, n); ++i) {
        if (block_[i] >= 0) {
          return InvalidArgument("gradients: recompute ranges ", block_[i], " and ", r,
                                 " overlap at node ", i);
        }
        block_[i] = static_cast<int32_t>(r);
      }
    }
    // A multi-output node's outputs are cloned with it: they belong to its block.
    for (int32_t i = 0; i < n; ++i) {
      if (g.node(i).op == OpKind::kOutputOf) block_[i] = block_[g.node(i).inputs[0]];
    }
    done_.assign(ranges.size(), 0);
    return OkStatus();
  }

  // The node whose backward rule runs next, with its inputs (and its outputs `outs`) replaced
  // by its block's clones; the block is cloned first if it has not been.
  // Inputs in an on-read range are replaced by that range's clones (cloned first if needed),
  // wherever the reading node is.
  Node Prepare(int32_t id, std::span<Value> outs) {
    const Graph& g = b_.graph();
    Node node = g.node(id);
    const int32_t n = static_cast<int32_t>(block_.size());
    const int32_t blk = block_[id];
    if (blk >= 0 && !done_[blk]) Clone(blk);
    for (int32_t& in : node.inputs) {
      const int32_t ib = in < n ? block_[in] : -1;
      if (ib < 0 || (ib != blk && !on_read_[ib])) continue;
      if (!done_[ib]) Clone(ib);
      in = Map(ib, in);
    }
    if (blk >= 0) {
      for (Value& o : outs) o = Value{Map(blk, o.id)};
    }
    return node;
  }

 private:
  int32_t Map(int32_t blk, int32_t id) const {
    return id < static_cast<int32_t>(block_.size()) && block_[id] == blk && clone_[id] >= 0
               ? clone_[id]
               : id;
  }

  // Appends a copy of block `blk`'s computing nodes, in order, reading the clones of values
  // inside the block and the original of everything else.
  void Clone(int32_t blk) {
    done_[blk] = 1;
    const std::string scope = b_.name_scope();
    b_.SetNameScope("");
    const int32_t n = static_cast<int32_t>(block_.size());
    for (int32_t i = 0; i < n; ++i) {
      if (block_[i] != blk) continue;
      const Node node = b_.graph().node(i);  // a copy: cloning appends nodes
      const OpDef& def = GetOpDef(node.op);
      bool in_place = false;
      for (int8_t w : def.writes_input) in_place |= w >= 0;
      if (node.op == OpKind::kOutputOf || def.cls == OpClass::kSource || def.side_effect ||
          in_place) {
        continue;
      }
      std::vector<Value> inputs;
      for (int32_t in : node.inputs) inputs.push_back(Value{Map(blk, in)});
      // "recompute.blk.3.attn_norm": readable in dumps, and no block scope of its own.
      const std::string name = node.name.empty() ? "" : absl::StrCat("recompute.", node.name);
      const std::vector<Value> outs = b_.AddNodeOutputs(node.op, inputs, node.attrs, name);
      for (size_t k = 0; k < outs.size() && i + static_cast<int32_t>(k) < n; ++k) {
        clone_[i + k] = outs[k].id;
      }
    }
    b_.SetNameScope(scope);
  }

  Builder& b_;
  std::vector<int32_t> block_;  // per forward node: its range, or -1
  std::vector<int32_t> clone_;  // per forward node: its clone, or -1
  std::vector<char> done_;      // per range: cloned
  std::vector<char> on_read_;   // per range: a recompute_on_read range
};

}  // namespace

std::vector<NodeRange> ScopeRanges(const Graph& g, std::string_view family) {
  const int32_t n = g.size();
  // "blk.12.attn_norm" -> "blk.12"; other names, and other families' blocks -> "".
  auto scope_of = [&](const std::string& name) -> std::string_view {
    const std::string_view s = BlockScope(name);
    return s.size() > family.size() && s.starts_with(family) && s[family.size()] == '.'
               ? s
               : std::string_view();
  };
  std::vector<std::string_view> scope(n);
  std::string_view next;
  for (int32_t i = n - 1; i >= 0; --i) {
    const Node& node = g.node(i);
    // Sources never decide a scope (a block's weights are declared inside it, its LoRA States
    // outside every scope) but take the one around them, so they do not split a block.
    if (GetOpDef(node.op).cls != OpClass::kSource && !node.name.empty()) {
      next = scope_of(node.name);
    }
    scope[i] = next;
  }
  std::vector<NodeRange> ranges;
  for (int32_t i = 0; i < n;) {
    int32_t j = i + 1;
    while (j < n && scope[j] == scope[i]) ++j;
    if (!scope[i].empty()) ranges.push_back({i, j});
    i = j;
  }
  return ranges;
}

std::vector<NodeRange> ValueRanges(const Graph& g, std::span<const std::string_view> suffixes) {
  const int32_t n = g.size();
  // Each node's owner: the next named computing node at or after it.
  std::vector<int32_t> owner(n, -1);
  int32_t next = -1;
  for (int32_t i = n - 1; i >= 0; --i) {
    const Node& node = g.node(i);
    if (GetOpDef(node.op).cls != OpClass::kSource && !node.name.empty()) next = i;
    owner[i] = next;
  }
  auto wanted = [&](int32_t o) {
    if (o < 0) return false;
    const std::string_view name = g.node(o).name;
    for (std::string_view s : suffixes) {
      if (name.size() > s.size() && name.ends_with(s) && name[name.size() - s.size() - 1] == '.') {
        return true;
      }
    }
    return false;
  };
  // A helper whose value is also read outside its owner's run (an unnamed residual add before
  // a norm) stays out: recomputing it would chain the clones through every block. The owner
  // itself is what the backward reads, so it may escape.
  std::vector<int32_t> last_reader(n, -1);
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t in : g.node(i).inputs) last_reader[in] = std::max(last_reader[in], i);
  }
  std::vector<NodeRange> ranges;
  for (int32_t i = 0; i < n;) {
    int32_t j = i + 1;
    while (j < n && owner[j] == owner[i]) ++j;
    if (wanted(owner[i])) {
      int32_t begin = -1;
      for (int32_t k = i; k <= j; ++k) {
        const bool inside = k < j && (k == owner[i] || last_reader[k] < j);
        if (inside && begin < 0) begin = k;
        if (!inside && begin >= 0) {
          ranges.push_back({begin, k});
          begin = -1;
        }
      }
    }
    i = j;
  }
  return ranges;
}

StatusOr<std::vector<Value>> Gradients(Builder& b, Value output, std::span<const Value> wrt,
                                       Value seed, const GradientOptions& options) {
  KILN_RETURN_IF_ERROR(b.status());
  Graph& g = b.graph();
  if (!output.valid() || output.id >= g.size()) return InvalidArgument("gradients: invalid output");
  if (!IsFloat(b.dtype(output))) {
    return InvalidArgument("gradients: the output must be a float tensor; got ",
                           DTypeName(b.dtype(output)));
  }
  if (!seed.valid()) {
    seed = b.Full(1.0, b.dtype(output), b.shape(output));
  } else if (b.dtype(seed) != b.dtype(output) || b.shape(seed) != b.shape(output)) {
    return InvalidArgument("gradients: the seed must have the output's type ",
                           TypeString(b.dtype(output), b.shape(output), g), "; got ",
                           TypeString(b.dtype(seed), b.shape(seed), g));
  }
  const Value outputs[] = {output};
  const Value seeds[] = {seed};
  return Gradients(b, outputs, seeds, wrt, options);
}

StatusOr<std::vector<Value>> Gradients(Builder& b, std::span<const Value> outputs,
                                       std::span<const Value> seeds, std::span<const Value> wrt,
                                       const GradientOptions& options) {
  KILN_RETURN_IF_ERROR(b.status());
  Graph& g = b.graph();
  if (outputs.size() != seeds.size()) {
    return InvalidArgument("gradients: ", outputs.size(), " outputs but ", seeds.size(), " seeds");
  }
  int32_t last = -1;
  for (size_t k = 0; k < outputs.size(); ++k) {
    KILN_RETURN_IF_ERROR(CheckValue(g, outputs[k], "output"));
    KILN_RETURN_IF_ERROR(CheckValue(g, seeds[k], "seed"));
    if (b.dtype(seeds[k]) != b.dtype(outputs[k]) || b.shape(seeds[k]) != b.shape(outputs[k])) {
      return InvalidArgument("gradients: seed ", k, " must have its output's type ",
                             TypeString(b.dtype(outputs[k]), b.shape(outputs[k]), g), "; got ",
                             TypeString(b.dtype(seeds[k]), b.shape(seeds[k]), g));
    }
    last = std::max(last, outputs[k].id);
  }
  for (Value w : wrt) KILN_RETURN_IF_ERROR(CheckValue(g, w, "wrt"));
  // Nodes on a path wrt -> outputs. Ids are topological, so one sweep each way suffices.
  const int32_t n = last + 1;
  std::vector<char> from_wrt(n, 0), to_out(n, 0);
  for (Value w : wrt) {
    if (w.id < n) from_wrt[w.id] = 1;
  }
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t in : g.node(i).inputs) from_wrt[i] |= from_wrt[in];
  }
  for (Value o : outputs) to_out[o.id] = 1;
  for (int32_t i = n - 1; i >= 0; --i) {
    if (!to_out[i]) continue;
    for (int32_t in : g.node(i).inputs) to_out[in] = 1;
  }

  Recompute recompute(b, n);
  KILN_RETURN_IF_ERROR(recompute.Init(options.recompute, options.recompute_on_read));

  std::vector<Value> grad(n);
  auto accumulate = [&](int32_t id, Value v) {
    grad[id] = grad[id].valid() ? b.Add(grad[id], v) : v;
  };
  for (size_t k = 0; k < outputs.size(); ++k) accumulate(outputs[k].id, seeds[k]);

  for (int32_t i = last; i >= 0; --i) {
    // An output_of node's gradient waits in grad[] for its producer's rule, which gets the
    // gradients of all its outputs at once.
    if (g.node(i).op == OpKind::kOutputOf || !from_wrt[i] || !to_out[i]) continue;
    const int num_out = g.NumOutputs(i);
    std::vector<Value> outs(num_out), grads(num_out);
    bool any = false;
    for (int o = 0; o < num_out; ++o) {
      outs[o] = Value{i + o};
      grads[o] = i + o < n ? grad[i + o] : Value{};
      any |= grads[o].valid();
    }
    if (!any) continue;
    const Node& fwd = g.node(i);
    if (fwd.inputs.empty()) continue;
    const OpDef& def = GetOpDef(fwd.op);
    bool needs = false;
    for (int32_t in : fwd.inputs) needs |= from_wrt[in] && IsFloat(g.node(in).dtype);
    if (!needs) continue;
    // A copy (the rule appends nodes to g) that reads recomputed values in a recomputed block;
    // gradients stay indexed by the forward ids.
    const std::vector<int32_t> fwd_inputs = fwd.inputs;
    const Node node = recompute.Prepare(i, outs);
    if (def.backward == nullptr) {
      return InvalidArgument("gradients: ", def.name, node.name.empty() ? "" : " '", node.name,
                             node.name.empty() ? "" : "'",
                             " has no gradient, but it lies between the loss and a wrt value");
    }
    std::vector<Value> input_grads(node.inputs.size());
    BackwardArgs args{b, node, outs[0], grads[0], input_grads, outs, grads};
    KILN_RETURN_IF_ERROR(Annotate(def.backward(args), absl::StrCat("backward of ", def.name)));
    KILN_RETURN_IF_ERROR(Annotate(b.status(), absl::StrCat("backward of ", def.name)));
    for (size_t j = 0; j < fwd_inputs.size(); ++j) {
      const int32_t in = fwd_inputs[j];
      if (!input_grads[j].valid() || !from_wrt[in]) continue;
      const Node& src = g.node(in);
      if (b.dtype(input_grads[j]) != src.dtype || b.shape(input_grads[j]) != src.shape) {
        return Internal("backward rule of ", def.name, " returned ",
                        TypeString(b.dtype(input_grads[j]), b.shape(input_grads[j]), g),
                        " for input ", j, " of type ", TypeString(src.dtype, src.shape, g));
      }
      accumulate(in, input_grads[j]);
    }
  }
  std::vector<Value> result;
  for (Value w : wrt) {
    result.push_back(w.id < n && grad[w.id].valid() ? grad[w.id] : b.ZerosLike(w));
  }
  KILN_RETURN_IF_ERROR(b.status());
  DumpGraph(DumpConfigFromEnv(), "autograd", g);
  return result;
}

}  // namespace kiln
