#include "engine/autograd.h"

#include "absl/strings/str_cat.h"
#include "engine/dump.h"

namespace kiln {

StatusOr<std::vector<Value>> Gradients(Builder& b, Value output, std::span<const Value> wrt,
                                       Value seed) {
  KILN_RETURN_IF_ERROR(b.status());
  Graph& g = b.graph();
  if (!output.valid() || output.id >= g.size()) return InvalidArgument("gradients: invalid output");
  if (!IsFloat(b.dtype(output))) {
    return InvalidArgument("gradients: the output must be a float tensor; got ",
                           DTypeName(b.dtype(output)));
  }
  for (Value w : wrt) {
    if (!w.valid() || w.id >= g.size()) return InvalidArgument("gradients: invalid wrt value");
    if (!IsFloat(b.dtype(w))) {
      return InvalidArgument("gradients: wrt '", g.node(w.id).name, "' is ", DTypeName(b.dtype(w)),
                             "; only float tensors have gradients");
    }
  }
  // Nodes on a path wrt -> output. Ids are topological, so one sweep each way suffices.
  const int32_t n = output.id + 1;
  std::vector<char> from_wrt(n, 0), to_out(n, 0);
  for (Value w : wrt) {
    if (w.id < n) from_wrt[w.id] = 1;
  }
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t in : g.node(i).inputs) from_wrt[i] |= from_wrt[in];
  }
  to_out[output.id] = 1;
  for (int32_t i = n - 1; i >= 0; --i) {
    if (!to_out[i]) continue;
    for (int32_t in : g.node(i).inputs) to_out[in] = 1;
  }

  std::vector<Value> grad(n);
  if (!seed.valid()) {
    seed = b.Full(1.0, b.dtype(output), b.shape(output));
  } else if (b.dtype(seed) != b.dtype(output) || b.shape(seed) != b.shape(output)) {
    return InvalidArgument("gradients: the seed must have the output's type ",
                           TypeString(b.dtype(output), b.shape(output), g), "; got ",
                           TypeString(b.dtype(seed), b.shape(seed), g));
  }
  grad[output.id] = seed;

  for (int32_t i = output.id; i >= 0; --i) {
    if (!from_wrt[i] || !to_out[i] || !grad[i].valid()) continue;
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
    BackwardArgs args{b, node, Value{i}, grad[i], input_grads};
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
      grad[in] = grad[in].valid() ? b.Add(grad[in], input_grads[j]) : input_grads[j];
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
