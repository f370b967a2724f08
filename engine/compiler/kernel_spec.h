// KernelSpec: what one generated kernel computes, independent of the language it is printed
// in. Codegen (codegen.h) prints a spec as C++, OpenCL C, CUDA C or HIP C; the fusion pass
// (fusion.h) builds specs for fused groups; SpecFromRequest builds one for a single op from
// the op table's expression form.
//
// Three kinds:
//   kPointwise     out[i] = value(args at i, Index(axis) of i, aux loads) over the output shape.
//   kReduce        per output row: `stages` run in order over the reduced elements (each may
//                  use earlier stages' results via Acc), then `output` is evaluated per output
//                  element (elementwise: over the reduced elements again, e.g. softmax, norms).
//   kGemmEpilogue  out[r, c] = value(GEMM result at [r, c], args at [r, c]) — applied by a GEMM
//                  kernel to its result tile (gemm_epilogue.h).
//
// Leaves of the expressions: Input(i) is args[i] loaded at the current position (its type is
// ExprTypeOf(args[i].dtype)); Load(k, e) is element e of the k-th aux arg; Index(a) is the
// position along axis a — of the iteration space in `value`/`stages`, of the output in a
// reduce's `output`; Index(kPosAxis) is the position within the reduced elements (row-major
// over the reduced axes); Acc(k) and Count as in expr.h. In a kGemmEpilogue, Input(args.size())
// is the GEMM result (f32 for f32/f16/bf16 outputs, f64 for f64).
//
// Thread-safety: a spec is a value (Exprs are immutable); copies are independent.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/base/status.h"
#include "engine/expr.h"

namespace kiln::compiler {

// Index(kPosAxis): the position within the reduced elements of a reduce stage.
inline constexpr int kPosAxis = 31;

enum class KernelKind : uint8_t { kPointwise, kReduce, kGemmEpilogue };
const char* KernelKindName(KernelKind k);

enum class ArgRole : uint8_t {
  kFull,         // has the iteration space's shape (pointwise: the output's; reduce: the
                 // reduced tensor's); loaded at the current element
  kOut,          // reduce only: has the output's shape; loaded once per output row
  kAux,          // a 1-D tensor read with Load(k, e); out-of-range reads give 0
  kGemmOperand,  // kGemmEpilogue only: an operand of the GEMM itself (not read by the epilogue)
};

struct KernelArg {
  DType dtype = DType::kInvalid;
  ArgRole role = ArgRole::kFull;
  int rank = 0;  // kFull: spec.rank; kOut: spec.out_rank; kAux: 1; kGemmOperand: its rank
};

struct KernelSpec {
  KernelKind kind = KernelKind::kPointwise;
  std::string name;  // for comments and kernel names ("rms_norm", "fused.add+rms_norm+mul")
  int rank = 0;      // the iteration space (pointwise/epilogue: the output's rank)
  std::vector<KernelArg> args;  // in LaunchArgs::inputs order
  DType out_dtype = DType::kInvalid;
  int out_rank = 0;

  Expr value;  // kPointwise, kGemmEpilogue

  // kReduce:
  std::vector<ReduceStage> stages;
  Expr output;
  bool elementwise = false;      // the output has the iteration space's shape
  std::vector<int> reduce_axes;  // sorted axes of the iteration space
  bool keepdim = false;          // reduced axes stay (size 1) in the output
  int shape_arg = -1;            // a kFull arg whose shape is the iteration space (-1: the
                                 // output's, which requires `elementwise`)

  // kGemmEpilogue: the GEMM's operand args (x, w) in the GEMM's own input order.
  std::vector<int> gemm_operands;

  int NumAux() const;
  // The i-th aux arg's index in `args` (-1 if none).
  int AuxArg(int k) const;
  // Checks the spec is well formed (leaf indices, types, roles, axes). Codegen calls it.
  Status Validate() const;
  // Multi-line human-readable form (dumps, test failures).
  std::string DebugString() const;
};

// The spec of a single op's kernel from its expression form (pointwise, generator with a
// form, reduction, row op). Unimplemented if the op has no form or uses something codegen
// does not handle (quantized inputs, rank above kMaxRank, more than 64 inputs).
StatusOr<KernelSpec> SpecFromRequest(const backend::KernelRequest& req);

// Rewrites the leaves of `e` bottom-up: `fn` gets each leaf and returns its replacement (or the
// leaf itself). Operations are rebuilt with the usual promotion.
Expr MapLeaves(const Expr& e, const std::function<Expr(const Expr&)>& fn);

// Number of distinct nodes in the expression DAG (shared subtrees count once).
int ExprSize(const Expr& e);

// Whether computing `e` (or any expression of `spec`, or reading/writing its tensors) needs
// f64 arithmetic — which devices without double support (OpenCL without cl_khr_fp64) lack.
bool UsesF64(const Expr& e);
bool UsesF64(const KernelSpec& spec);

}  // namespace kiln::compiler
