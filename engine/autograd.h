// Reverse-mode automatic differentiation over the graph IR.
//
// `Gradients` appends the backward graph to the builder's graph: for each node on a path from
// `wrt` to `output`, in reverse order, it calls the op's backward rule (ops.cc), summing the
// gradients of values with several consumers. A multi-output node's rule is called once, with
// the gradient of each of its outputs (invalid where none flows; graph.h, ops.h). The result is
// ordinary graph nodes, compiled and run like the forward pass (training is a use of the engine,
// not a second engine).
//
//   Value loss = b.Mean(b.CrossEntropy(logits, targets), {0});
//   KILN_ASSIGN_OR_RETURN(std::vector<Value> grads, Gradients(b, loss, {w1, w2}));
//
// Thread-safety: as Builder.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "engine/builder.h"

namespace kiln {

// Forward node ids [begin, end): one block of activation recomputation.
struct NodeRange {
  int32_t begin = 0;
  int32_t end = 0;
};

struct GradientOptions {
  // Activation recomputation (torch.utils.checkpoint), per block: the backward of a node in
  // one of these ranges reads none of the block's forward values. Right before the block's
  // first backward rule runs, the block's computing nodes are cloned (appended to the graph,
  // so they run there, in builder order) from the values that enter the block; the block's
  // backward rules read the clones. Sources (weights, LoRA States) are read again, never
  // cloned; in-place writers and side effects are not cloned either. So only the values
  // entering each block (the residual stream) stay alive from the forward to the backward,
  // and one block's activations at a time during the backward; the price is one more forward
  // of each block. Results are the same ops on the same values: equal to no recomputation.
  // Ranges must not overlap; a node's output_of nodes count as its own.
  std::vector<NodeRange> recompute;
  // Selective recomputation: ranges cloned when a backward rule first reads one of their
  // values — any rule, inside the range or not — and every backward rule reads the clones.
  // For values that are cheap to compute and large to keep (normalised inputs, activation
  // products): they die in the forward and come back, one at a time, where the backward
  // needs them. Clones read the originals of values outside their range. Must not overlap
  // `recompute` or each other.
  std::vector<NodeRange> recompute_on_read;
};

// Returns d(sum(output * seed)) / d(wrt[i]) for each i, with wrt[i]'s shape and dtype.
// `seed` defaults to ones (so a scalar loss gives its plain gradient). An input that does
// not influence `output` gets zeros. Errors: an invalid value, a non-float `output` or
// `wrt`, a seed of the wrong type, or a builder error inside a backward rule. With
// KILN_DUMP containing "autograd", the graph is printed after the pass.
StatusOr<std::vector<Value>> Gradients(Builder& b, Value output, std::span<const Value> wrt,
                                       Value seed = {}, const GradientOptions& options = {});

// Several outputs at once: d(sum_k sum(outputs[k] * seeds[k])) / d(wrt[i]). Every seed is
// given and has its output's type. Used by backward rules of multi-output ops; also a way to
// differentiate several losses (or several outputs of one node) in one backward graph.
// Errors as above, and overlapping or out-of-graph recompute ranges.
StatusOr<std::vector<Value>> Gradients(Builder& b, std::span<const Value> outputs,
                                       std::span<const Value> seeds, std::span<const Value> wrt,
                                       const GradientOptions& options = {});

// The blocks `<family>.<N>` of a model's graph ("blk" -> blk.0, blk.1, ...) as node ranges,
// in graph order, for GradientOptions::recompute. A node belongs to the scope of the next
// named computing node at or after it (the rule regional compilation groups blocks by:
// unnamed helpers belong to the named value they feed); a range is a maximal run of nodes of
// one scope. Nodes named otherwise ("token_embd_rows", "logits") belong to no block.
std::vector<NodeRange> ScopeRanges(const Graph& g, std::string_view family);

// The nodes that compute each named value whose name ends with ".<suffix>" for one of
// `suffixes` ("ffn_act" -> blk.0.ffn_act, blk.1.ffn_act, ...), as node ranges in graph order,
// for GradientOptions::recompute_on_read. A node belongs to the next named computing node at
// or after it (the rule of ScopeRanges, by full name instead of block); helpers whose value is
// also read outside that run (an unnamed residual add) are left out, so a run may give
// several ranges.
std::vector<NodeRange> ValueRanges(const Graph& g, std::span<const std::string_view> suffixes);

}  // namespace kiln
