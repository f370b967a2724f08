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
#include <vector>

#include "engine/builder.h"

namespace kiln {

// Returns d(sum(output * seed)) / d(wrt[i]) for each i, with wrt[i]'s shape and dtype.
// `seed` defaults to ones (so a scalar loss gives its plain gradient). An input that does
// not influence `output` gets zeros. Errors: an invalid value, a non-float `output` or
// `wrt`, a seed of the wrong type, or a builder error inside a backward rule. With
// KILN_DUMP containing "autograd", the graph is printed after the pass.
StatusOr<std::vector<Value>> Gradients(Builder& b, Value output, std::span<const Value> wrt,
                                       Value seed = {});
// Several outputs at once: d(sum_k sum(outputs[k] * seeds[k])) / d(wrt[i]). Every seed is
// given and has its output's type. Used by backward rules of multi-output ops; also a way to
// differentiate several losses (or several outputs of one node) in one backward graph.
StatusOr<std::vector<Value>> Gradients(Builder& b, std::span<const Value> outputs,
                                       std::span<const Value> seeds, std::span<const Value> wrt);

}  // namespace kiln
