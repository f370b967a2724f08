#include "backends/cpu/kernels/optimizer.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "engine/optimizer.h"

// The baseline variant of the loops (optimizer_impl.h).
#define KILN_ISA_NS scalar
#include "backends/cpu/kernels/optimizer_impl.h"
#undef KILN_ISA_NS

namespace kiln::cpu {

void scalar::OptimizerRange(const OptimizerStep& s, int64_t begin, int64_t end) {
  OptimizerRangeOf<Lane1>(s, begin, end);
}

void SetStepScalars(double step, OptimizerStep* s) {
  s->first = step <= 1;
  const OptimizerStepScalars sc = StepScalars(s->op, s->floats, s->lr, step);
  s->step_size = sc.step_size;
  s->bias_correction2_sqrt = sc.bias_correction2_sqrt;
}

namespace {

using backend::Kernel;
using backend::KernelRequest;

struct OptimizerData {
  OpKind op = OpKind::kAdamW;
  Attrs attrs;
  void (*range)(const OptimizerStep&, int64_t, int64_t) = nullptr;  // the ISA's loops
  Kernel fallback;
};

double LoadScalar(const TensorArg& t, int64_t i) {
  const int64_t off = t.rank > 0 ? i * t.strides[0] : 0;
  return t.dtype == DType::kF64 ? static_cast<const double*>(t.data)[off]
                                : static_cast<const float*>(t.data)[off];
}

bool DenseF32(const TensorArg& t, int64_t n) {
  return t.dtype == DType::kF32 && t.IsContiguous() && t.numel() == n;
}

void OptimizerKernel(const LaunchArgs& a, const ExecCtx& c) {
  const auto& d = *static_cast<const OptimizerData*>(a.kernel_data);
  const TensorArg &param = a.inputs[0], &grad = a.inputs[1], &hyper = a.inputs[2];
  const int64_t n = param.numel();
  const int num_states = a.num_extra_outputs;
  const bool graph_scale = a.num_inputs > 3 + num_states;
  bool dense = DenseF32(param, n) && DenseF32(grad, n) && DenseF32(a.output, n) &&
               (hyper.dtype == DType::kF32 || hyper.dtype == DType::kF64) &&
               (!graph_scale || a.inputs[a.num_inputs - 1].dtype == DType::kF32 ||
                a.inputs[a.num_inputs - 1].dtype == DType::kF64);
  for (int k = 0; k < num_states && dense; ++k) {
    dense = DenseF32(a.inputs[3 + k], n) && DenseF32(a.extra_outputs[k], n);
  }
  if (!dense) {
    RunFallback(d.fallback, a, c);
    return;
  }
  OptimizerStep s;
  s.op = d.op;
  s.floats = d.attrs.floats;
  s.nesterov = d.op == OpKind::kSgd && d.attrs.ints[0] != 0;
  s.lr = LoadScalar(hyper, 1);
  s.scale = LoadScalar(hyper, 2);
  if (graph_scale) s.scale *= LoadScalar(a.inputs[a.num_inputs - 1], 0);
  SetStepScalars(LoadScalar(hyper, 0), &s);
  s.param = static_cast<const float*>(param.data);
  s.grad = static_cast<const float*>(grad.data);
  s.param_out = static_cast<float*>(a.output.data);
  for (int k = 0; k < num_states && k < 2; ++k) {
    s.state_in[k] = static_cast<const float*>(a.inputs[3 + k].data);
    s.state_out[k] = static_cast<float*>(a.extra_outputs[k].data);
  }
  // Cache-line-aligned shares (16 floats), so that no two threads write one line.
  const int64_t lines = (n + 15) / 16;
  const int64_t begin = std::min(n, lines * c.thread_index / c.thread_count * 16);
  const int64_t end = std::min(n, lines * (c.thread_index + 1) / c.thread_count * 16);
  d.range(s, begin, end);
}

}  // namespace

StatusOr<std::optional<Kernel>> MakeOptimizerKernel(const KernelRequest& req,
                                                    const SelectContext& ctx) {
  auto d = std::make_shared<OptimizerData>();
  d->op = req.op;
  d->attrs = *req.attrs;
  d->range = ctx.isa == Isa::kAvx512 ? avx512::OptimizerRange
             : ctx.isa == Isa::kAvx2 ? avx2::OptimizerRange
                                     : scalar::OptimizerRange;
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  std::string name = absl::StrCat("cpu.", OpName(req.op), ".dense");
  return std::optional<Kernel>(Kernel{OptimizerKernel, std::move(d), std::move(name)});
}

}  // namespace kiln::cpu
