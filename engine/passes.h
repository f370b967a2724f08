// Graph-level compiler passes. Each has a name (for KILN_DUMP) and either checks a graph or
// returns a new one; `outputs` are remapped to the new graph's ids.
//
//   verify       every node's shape/dtype rule holds (every output's); a multi-output node is
//                followed by its output_of nodes; sources are uniquely named; in-place writes
//                (OpDef::writes_input) target State storage, each State value is overwritten
//                at most once, and nothing reads a State value after the node that overwrites
//                it (nodes run in builder order), program outputs included
//   dce          drops nodes that neither reach an output nor have side effects (sources stay
//                so every declared input remains bindable; a kept node keeps all its outputs)
//   lower_views  decides where each value's elements live: views (reshape, permute, slice,
//                expand) become strided aliases of their input's storage; a reshape that
//                cannot be a view gets a contiguous copy first; an in-place output aliases the
//                State storage it overwrites (kv_write's cache, adamw's param/m/v)
//   cast_matmul_rhs  for devices that do not take a matmul right operand of another type than
//                its left as it is (backend::kMatMulMixedRhsExtension), casts it first: autograd
//                emits matmul(g, w) with the frozen (quantized, f16) weight w for linear's dx
//
// Later passes (assign, plan, emit) are in program.cc.
//
// Optimizing passes register a pre-lowering rewrite (SetPreLowerRewrite): lower_views runs it
// first, on the graph after dce. The compiler (engine/compiler/compile.h) installs fusion
// there; the rewrite acts only for compiles that asked for it and returns nullopt otherwise.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <optional>
#include <vector>

#include "engine/graph.h"

namespace kiln {

// Where a value's elements live: `root` is the node that owns the storage (the value itself
// unless it is a view), `strides` and `offset` are in elements of the root's storage.
struct Layout {
  int32_t root = -1;
  std::vector<Dim> strides;
  Dim offset;
};

// Row-major strides of a symbolic shape.
std::vector<Dim> ContiguousStrides(const SymShape& shape);
bool IsContiguousLayout(const SymShape& shape, const std::vector<Dim>& strides);

Status Verify(const Graph& g, std::span<const Value> outputs);
StatusOr<Graph> EliminateDeadCode(const Graph& g, std::vector<Value>& outputs);
// Nullopt if no matmul has a right operand of another type than its output.
std::optional<Graph> CastMatMulRhs(const Graph& g, std::vector<Value>& outputs);
// Also fills `layouts` (one per node of the returned graph). Errors: an in-place write whose
// target is not a State tensor (or a view of one).
StatusOr<Graph> LowerViews(const Graph& g, std::vector<Value>& outputs,
                           std::vector<Layout>* layouts);

// A graph rewrite run at the start of lower_views: nullopt keeps the graph; a new graph must
// remap `outputs`. Thread-safe to set (once, before compiling); null removes it.
using PreLowerRewrite = StatusOr<std::optional<Graph>> (*)(const Graph& g,
                                                           std::vector<Value>& outputs);
void SetPreLowerRewrite(PreLowerRewrite rewrite);

}  // namespace kiln
