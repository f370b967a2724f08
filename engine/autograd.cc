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

}  // namespace

StatusOr<std::vector<Value>> Gradients(Builder& b, Value output, std::span<const Value> wrt,
                                       Value seed) {
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
  return Gradients(b, outputs, seeds, wrt);
}

StatusOr<std::vector<Value>> Gradients(Builder& b, std::span<const Value> outputs,
                                       std::span<const Value> seeds, std::span<const Value> wrt) {
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
    const Node node = g.node(i);  // a copy: the rule appends nodes to g
    if (node.inputs.empty()) continue;
    const OpDef& def = GetOpDef(node.op);
    bool needs = false;
    for (int32_t in : node.inputs) needs |= from_wrt[in] && IsFloat(g.node(in).dtype);
    if (!needs) continue;
    if (def.backward == nullptr) {
      return InvalidArgument("gradients: ", def.name, node.name.empty() ? "" : " '", node.name,
                             node.name.empty() ? "" : "'",
                             " has no gradient, but it lies between the loss and a wrt value");
    }
    std::vector<Value> input_grads(node.inputs.size());
    BackwardArgs args{b, node, outs[0], grads[0], input_grads, outs, grads};
    KILN_RETURN_IF_ERROR(Annotate(def.backward(args), absl::StrCat("backward of ", def.name)));
    KILN_RETURN_IF_ERROR(Annotate(b.status(), absl::StrCat("backward of ", def.name)));
    for (size_t j = 0; j < node.inputs.size(); ++j) {
      const int32_t in = node.inputs[j];
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
