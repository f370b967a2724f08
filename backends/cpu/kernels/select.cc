#include "backends/cpu/kernels/select.h"

#include <cstdlib>
#include <string_view>

#include "backends/cpu/kernels/attention.h"
#include "backends/cpu/kernels/attention_train.h"
#include "backends/cpu/kernels/autotune.h"
#include "backends/cpu/kernels/cross_entropy.h"
#include "backends/cpu/kernels/linear.h"
#include "backends/cpu/kernels/optimizer.h"
#include "backends/cpu/kernels/token_ops.h"

namespace kiln::cpu {

SelectContext DefaultSelectContext(
    backend::Device* device, int threads,
    StatusOr<backend::Kernel> (*reference)(const backend::KernelRequest&)) {
  SelectContext c;
  c.device = device;
  c.threads = threads;
  c.isa = ActiveIsa();
  c.tuner = &GemmTuner::Global();
  c.reference = reference;
  const char* q8 = std::getenv("KILN_CPU_Q8_ACTIVATIONS");
  c.q8_activations = q8 != nullptr && std::string_view(q8) == "1";
  const char* bf16 = std::getenv("KILN_CPU_BF16_ACTIVATIONS");
  c.bf16_activations = bf16 != nullptr && std::string_view(bf16) == "1";
  return c;
}

StatusOr<std::optional<backend::Kernel>> SelectKernel(const backend::KernelRequest& req,
                                                      const SelectContext& ctx) {
  switch (req.op) {
    case OpKind::kLinear:
    case OpKind::kMatMul:
      return MakeGemmKernel(req, ctx);
    case OpKind::kPagedAttention:
      return MakePagedAttentionKernel(req, ctx);
    case OpKind::kAttention:
      return MakeDenseAttentionKernel(req, ctx);
    case OpKind::kAttentionBackward:
      return MakeAttentionBackwardKernel(req, ctx);
    case OpKind::kRope:
      return MakeRopeKernel(req, ctx);
    case OpKind::kKvWrite:
      return MakeKvWriteKernel(req, ctx);
    case OpKind::kContiguous:
      return MakeContiguousKernel(req, ctx);
    case OpKind::kConcat:
      return MakeConcatKernel(req, ctx);
    case OpKind::kScatterAddRows:
      return MakeScatterAddRowsKernel(req, ctx);
    case OpKind::kFusedCrossEntropy:
      return MakeCrossEntropyKernel(req, ctx);
    case OpKind::kAdamW:
    case OpKind::kAdam:
    case OpKind::kSgd:
    case OpKind::kAdagrad:
      return MakeOptimizerKernel(req, ctx);
    default:
      return std::optional<backend::Kernel>();
  }
}

}  // namespace kiln::cpu
