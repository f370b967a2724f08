#include "backends/cpu/threaded_ref.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/ref/ref_kernels.h"

namespace kiln::cpu {
namespace {

// This thread's share [begin, end) of n items.
std::pair<int64_t, int64_t> Share(int64_t n, const ExecCtx& c) {
  return {n * c.thread_index / c.thread_count, n * (c.thread_index + 1) / c.thread_count};
}

struct TrainingData {
  int64_t ignore_index = 0;    // fused_cross_entropy
  OpKind op = OpKind::kAdamW;  // optimizers: the op and its attributes
  Attrs attrs;
};
const TrainingData& Data(const LaunchArgs& a) {
  return *static_cast<const TrainingData*>(a.kernel_data);
}

void FusedCrossEntropyKernel(const LaunchArgs& a, const ExecCtx& c) {
  const auto [begin, end] = Share(ref::FusedCrossEntropyRowCount(a), c);
  ref::FusedCrossEntropyRows(a, Data(a).ignore_index, begin, end);
}

void OptimizerKernel(const LaunchArgs& a, const ExecCtx& c) {
  const auto [begin, end] = Share(a.output.numel(), c);
  ref::OptimizerElements(a, Data(a).op, Data(a).attrs, begin, end);
}

void SampleKernel(const LaunchArgs& a, const ExecCtx& c) {
  const auto [begin, end] = Share(ref::SampleRowCount(a), c);
  ref::SampleRows(a, begin, end);
}

}  // namespace

std::optional<backend::Kernel> ThreadedReferenceKernel(const backend::KernelRequest& req) {
  auto d = std::make_shared<TrainingData>();
  switch (req.op) {
    case OpKind::kFusedCrossEntropy:
      d->ignore_index = req.attrs->ints[0];
      return backend::Kernel{FusedCrossEntropyKernel, std::move(d), "cpu.fused_cross_entropy"};
    case OpKind::kAdamW:
    case OpKind::kAdam:
    case OpKind::kSgd:
    case OpKind::kAdagrad:
      d->op = req.op;
      d->attrs = *req.attrs;
      return backend::Kernel{OptimizerKernel, std::move(d), absl::StrCat("cpu.", OpName(req.op))};
    case OpKind::kSample:
      return backend::Kernel{SampleKernel, nullptr, "cpu.sample"};
    default:
      return std::nullopt;
  }
}

}  // namespace kiln::cpu
