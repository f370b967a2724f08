#include "backends/cpu/threaded_ref.h"

#include <cstring>
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

// gather of whole rows of a table in the output's own dtype (embeddings: token and position
// rows), copied with memcpy over the threads; other layouts run the reference loop, which
// converts element by element.
struct GatherData {
  backend::Kernel reference;
};

bool DenseRows(const TensorArg& t) {  // every axis but the first is dense
  int64_t expect = 1;
  for (int d = t.rank - 1; d >= 1; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expect) return false;
    expect *= t.shape[d];
  }
  return true;
}

void GatherKernel(const LaunchArgs& a, const ExecCtx& c) {
  const TensorArg &table = a.inputs[0], &ids = a.inputs[1], &o = a.output;
  const bool fast = table.dtype == o.dtype && DenseRows(table) && o.IsContiguous() &&
                    ids.IsContiguous() && (ids.dtype == DType::kI32 || ids.dtype == DType::kI64);
  if (!fast) {
    const backend::Kernel& ref = static_cast<const GatherData*>(a.kernel_data)->reference;
    LaunchArgs args = a;
    args.kernel_data = ref.data.get();
    ref.fn(args, c);
    return;
  }
  int64_t row_elems = 1;
  for (int d = 1; d < table.rank; ++d) row_elems *= table.shape[d];
  const size_t row_bytes = static_cast<size_t>(ByteOffset(table.dtype, row_elems));
  const auto [begin, end] = Share(ids.numel(), c);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = ids.dtype == DType::kI32 ? static_cast<const int32_t*>(ids.data)[i]
                                               : static_cast<const int64_t*>(ids.data)[i];
    char* dst = static_cast<char*>(o.data) + static_cast<size_t>(i) * row_bytes;
    if (r < 0 || r >= table.shape[0]) {
      std::memset(dst, 0, row_bytes);  // out of range: zeros, as the reference
    } else {
      std::memcpy(
          dst, static_cast<const char*>(table.data) + ByteOffset(table.dtype, r * table.strides[0]),
          row_bytes);
    }
  }
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
    case OpKind::kGather: {
      if (req.inputs[0].dtype != req.output.dtype || IsQuantized(req.output.dtype)) {
        return std::nullopt;
      }
      StatusOr<backend::Kernel> reference = ref::KernelFor(req);
      if (!reference.ok()) return std::nullopt;
      auto g = std::make_shared<GatherData>();
      g->reference = *std::move(reference);
      return backend::Kernel{GatherKernel, std::move(g), "cpu.gather"};
    }
    default:
      return std::nullopt;
  }
}

}  // namespace kiln::cpu
