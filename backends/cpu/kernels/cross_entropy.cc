#include "backends/cpu/kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "backends/cpu/kernels/kernels.h"

namespace kiln::cpu {
namespace {

using backend::Kernel;
using backend::KernelRequest;

struct CrossEntropyData {
  const IsaKernels* k = nullptr;
  int64_t ignore_index = 0;
  Kernel fallback;  // the reference kernel, for layouts found at run time
};

// Element offset of row `i` (row-major over x's leading axes) in a tensor of those axes,
// through its own strides (dloss is often a broadcast scalar: strides 0).
int64_t RowOffset(const TensorArg& t, const TensorArg& x, int64_t i) {
  int64_t off = 0;
  for (int d = x.rank - 2; d >= 0; --d) {
    off += (i % x.shape[d]) * t.strides[d];
    i /= x.shape[d];
  }
  return off;
}

void CrossEntropyKernel(const LaunchArgs& a, const ExecCtx& c) {
  const auto& d = *static_cast<const CrossEntropyData*>(a.kernel_data);
  const TensorArg &x = a.inputs[0], &targets = a.inputs[1], &dloss = a.inputs[2];
  const TensorArg &loss = a.output, &dx = a.extra_outputs[0];
  const int64_t n = x.shape[x.rank - 1];
  if (n == 0 || !x.IsContiguous() || !dx.IsContiguous()) {
    RunFallback(d.fallback, a, c);
    return;
  }
  const int64_t rows = x.numel() / n;
  const int64_t begin = rows * c.thread_index / c.thread_count;
  const int64_t end = rows * (c.thread_index + 1) / c.thread_count;
  const auto* xs = static_cast<const float*>(x.data);
  auto* dxs = static_cast<float*>(dx.data);
  auto* losses = static_cast<float*>(loss.data);
  const auto* g = static_cast<const float*>(dloss.data);
  for (int64_t i = begin; i < end; ++i) {
    const float* row = xs + i * n;
    float* drow = dxs + i * n;
    const int64_t target = IndexAt(targets, RowOffset(targets, x, i));
    float& row_loss = losses[RowOffset(loss, x, i)];
    const float gi = g[RowOffset(dloss, x, i)];
    if (target == d.ignore_index) {
      row_loss = 0;
      std::fill(drow, drow + n, 0.0f);
      continue;
    }
    float m = 0;
    double s = 0;
    d.k->softmax_stats(row, n, &m, &s);
    const bool in_range = target >= 0 && target < n;
    const double picked = in_range ? row[target] : 0.0;
    row_loss = static_cast<float>(static_cast<double>(m) + std::log(s) - picked);
    d.k->scaled_exp(row, n, m, static_cast<float>(static_cast<double>(gi) / s), drow);
    if (in_range) drow[target] -= gi;
  }
}

}  // namespace

StatusOr<std::optional<Kernel>> MakeCrossEntropyKernel(const KernelRequest& req,
                                                       const SelectContext& ctx) {
  const DType t = req.inputs[0].dtype;
  const DType target = req.inputs[1].dtype;
  if (t != DType::kF32 || (target != DType::kI32 && target != DType::kI64)) {
    return std::optional<Kernel>();
  }
  auto d = std::make_shared<CrossEntropyData>();
  d->k = KernelsFor(ctx.isa);
  if (d->k == nullptr) d->k = KernelsFor(Isa::kScalar);
  d->ignore_index = req.attrs->ints[0];
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  std::string name = absl::StrCat("cpu.fused_cross_entropy.", IsaName(d->k->isa));
  return std::optional<Kernel>(Kernel{CrossEntropyKernel, std::move(d), std::move(name)});
}

}  // namespace kiln::cpu
