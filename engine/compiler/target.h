// What a device that runs generated kernels tells the compiler, and how the compiler hands it
// fused nodes.
//
// A device opts in by returning a compiler::Target from
// Device::GetExtension(kTargetExtension). compiler::Compile (compile.h) then
//   1. fuses the graph as far as Target::caps() allows (fusion.h),
//   2. calls Target::Prepare with every kernel request of the fused graph, so the device can
//      generate and compile them as one batch (one compiler run per program),
//   3. runs the usual assign/plan/emit, where the device's GetKernel is asked for each node.
// Devices without the extension compile exactly as with kiln::Compile.
//
// Fused nodes. A pure pointwise group becomes an ordinary `map` node (any device runs it).
// A group anchored on a reduction/row op or a GEMM keeps the anchor's OpKind (so planning
// treats it like that op: no in-place) but has its inputs rewired to the group's inputs and
// is tagged; only a device whose caps allowed it ever sees one. In GetKernel, call
// FusedGroupOf(request): non-null means "this node is a fused group; run its spec".
//
// Thread-safety: FusedGroupOf reads the calling thread's compile context and is valid only
// inside GetKernel/Prepare calls made by compiler::Compile on that thread. Target methods
// must be thread-safe (several programs may compile at once).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/compiler/kernel_spec.h"

namespace kiln::compiler {

inline constexpr std::string_view kTargetExtension = "kiln.compiler.target";

struct FusionCaps {
  bool pointwise = false;       // chains of pointwise ops -> one map node
  bool reductions = false;      // reductions/row ops with pointwise prologue and epilogue
  bool gemm_epilogues = false;  // linear/matmul + pointwise epilogue (bias, activation, residual)
  int max_inputs = 0;           // inputs of one fused kernel at most (0: the pass' default)
};

// Kernel accounting for logs and metrics.
struct CompileCounters {
  int64_t compiled = 0;       // kernels built by running the compiler in this process
  int64_t cached = 0;         // kernels loaded from the disk cache or the AOT table
  int64_t reused = 0;         // requests served by a kernel this process already had
  int64_t compiler_runs = 0;  // compiler invocations
  double seconds = 0;         // time spent generating, compiling and loading
};

class Target {
 public:
  virtual ~Target() = default;
  virtual FusionCaps caps() const = 0;
  // Generates and compiles, as one batch, the kernels these requests will ask for. An error
  // makes the compiler retry the program unfused (and log why).
  virtual Status Prepare(std::span<const backend::KernelRequest> requests) = 0;
  virtual CompileCounters counters() const = 0;
};

// A fused group as a device sees it.
struct FusedGroup {
  enum class Kind : uint8_t {
    kReduce,  // `spec` (kReduce) is the whole group; node inputs are spec.args in order
    kGemm,    // the GEMM `gemm` (its inputs are node inputs 0 and 1) then `spec`
              // (kGemmEpilogue; spec.args are all node inputs, the first two kGemmOperand)
  };
  Kind kind = Kind::kReduce;
  KernelSpec spec;
  std::string label;  // "add+rms_norm+mul", for kernel names and dumps
  // kGemm: the plain GEMM request (op linear or matmul, its attrs and two input types).
  OpKind gemm_op = OpKind::kLinear;
  Attrs gemm_attrs;
  std::vector<TensorType> gemm_inputs;
  TensorType gemm_output;
  backend::KernelRequest GemmRequest() const;
};

// The fused group `request` stands for, or null for an ordinary node. See the contract above.
const FusedGroup* FusedGroupOf(const backend::KernelRequest& request);

}  // namespace kiln::compiler
