// The fusion pass ("fuse", dumpable with KILN_DUMP=fuse): groups nodes so that each group is
// one kernel.
//
// What fuses (greedy, consumer absorbs producer, from the graph's end backwards — XLA-style):
//   - chains and trees of pointwise ops (incl. generators with a form, casts, where, map):
//     `silu(gate) * up`, residual adds, `x * scale + mask`, ...  -> one `map` node;
//   - one reduction or row op with a pointwise prologue on the reduced input and a pointwise
//     epilogue: `rms_norm(x + r) * w`, `softmax(s * scale + mask)`, `sum(x * x)`, ...
//   - a linear/matmul with a pointwise epilogue (bias, activation, residual): see
//     gemm_epilogue.h.
// Rules that keep it correct:
//   - a producer joins only if every consumer of it is in the group and it is not a graph
//     output (no value is computed twice or lost);
//   - views, sources and other ops are boundaries (groups read views as strided inputs);
//   - a group never moves a read of State storage across a side effect (kv_write): nodes
//     between the producer and the group's root in graph order that have side effects block
//     producers reading a State (or a view of one);
//   - intermediates are not rounded to their storage type inside a group when that type is
//     f16/bf16 (computed in f32, like fused kernels elsewhere); producers stored as narrow
//     integers or fp8 do not join (their store would saturate/wrap/round observably);
//   - a GEMM joins only if the group's result has the GEMM's dtype (the GEMM writes there);
//   - size limits: 64 nodes, 32 inputs, 512 expression nodes per group.
// The fused node of a reduction/GEMM group keeps the anchor's OpKind and is tagged (see
// target.h); the planner then treats it like that op (its in-place and liveness rules), and
// its position is the group's last node, so the group's inputs live until there.
//
// Thread-safety: pure function of its arguments.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/compiler/target.h"
#include "engine/graph.h"

namespace kiln::compiler {

struct FusionOptions {
  FusionCaps caps;
  int max_members = 64;
  int max_inputs = 32;
  int max_expr_nodes = 512;
};

struct FusionResult {
  Graph graph;
  // Groups of tagged nodes, by tag index.
  std::vector<std::shared_ptr<const FusedGroup>> groups;
  std::vector<std::string> marks;  // per node of `graph`: "fused 3: add+rms_norm+mul" or ""
  int fused_groups = 0;            // groups of >= 2 nodes (map groups included)
  int fused_nodes = 0;             // nodes inside them
};

// Fuses `g` (verified, dead code removed). `outputs` are remapped to the new graph.
StatusOr<FusionResult> Fuse(const Graph& g, std::vector<Value>& outputs,
                            const FusionOptions& options);

// Tags of fused nodes (attrs.expr[0] = Int(kFusedTag), attrs.expr[1] = Int(group index)).
inline constexpr int64_t kFusedTag = 0x6b696c6e66757365;  // "kilnfuse"
// The group index of a tagged node's attrs, or -1.
int FusedGroupIndex(const Attrs& attrs);

}  // namespace kiln::compiler
