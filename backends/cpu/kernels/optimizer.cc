#include "backends/cpu/kernels/optimizer.h"

#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"

namespace kiln::cpu {
namespace {

using backend::Kernel;
using backend::KernelRequest;

struct OptimizerData {
  OpKind op = OpKind::kAdamW;
  Attrs attrs;
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
  const double step = LoadScalar(hyper, 0), lr = LoadScalar(hyper, 1);
  double scale = LoadScalar(hyper, 2);
  if (graph_scale) scale *= LoadScalar(a.inputs[a.num_inputs - 1], 0);
  const bool first = step <= 1;
  const std::vector<double>& f = d.attrs.floats;
  const int64_t begin = n * c.thread_index / c.thread_count;
  const int64_t end = n * (c.thread_index + 1) / c.thread_count;
  const float* g32 = static_cast<const float*>(grad.data);
  const float* p_in = static_cast<const float*>(param.data);
  float* p_out = static_cast<float*>(a.output.data);
  const float* s_in[2] = {nullptr, nullptr};
  float* s_out[2] = {nullptr, nullptr};
  for (int k = 0; k < num_states && k < 2; ++k) {
    s_in[k] = static_cast<const float*>(a.inputs[3 + k].data);
    s_out[k] = static_cast<float*>(a.extra_outputs[k].data);
  }
  // The same per-element arithmetic as OptimizerElements (see there for torch's equations).
  switch (d.op) {
    case OpKind::kAdamW:
    case OpKind::kAdam: {
      const double beta1 = f[0], beta2 = f[1], eps = f[2], weight_decay = f[3];
      const double step_size = lr / (1 - std::pow(beta1, step));
      const double bias_correction2_sqrt = std::sqrt(1 - std::pow(beta2, step));
      const bool adamw = d.op == OpKind::kAdamW;
      for (int64_t e = begin; e < end; ++e) {
        double g = g32[e] * scale;
        double p = p_in[e];
        if (adamw) {
          p *= 1 - lr * weight_decay;
        } else {
          g += weight_decay * p;
        }
        const double m = beta1 * (first ? 0.0 : s_in[0][e]) + (1 - beta1) * g;
        const double v = beta2 * (first ? 0.0 : s_in[1][e]) + (1 - beta2) * g * g;
        s_out[0][e] = static_cast<float>(m);
        s_out[1][e] = static_cast<float>(v);
        p -= step_size * m / (std::sqrt(v) / bias_correction2_sqrt + eps);
        p_out[e] = static_cast<float>(p);
      }
      break;
    }
    case OpKind::kSgd: {
      const double momentum = f[0], dampening = f[1], weight_decay = f[2];
      const bool nesterov = d.attrs.ints[0] != 0;
      for (int64_t e = begin; e < end; ++e) {
        double g = g32[e] * scale;
        const double p = p_in[e];
        g += weight_decay * p;
        if (momentum != 0) {
          const double buf = first ? g : momentum * s_in[0][e] + (1 - dampening) * g;
          s_out[0][e] = static_cast<float>(buf);
          g = nesterov ? g + momentum * buf : buf;
        }
        p_out[e] = static_cast<float>(p - lr * g);
      }
      break;
    }
    default: {  // adagrad
      const double lr_decay = f[0], weight_decay = f[1], initial = f[2], eps = f[3];
      const double clr = lr / (1 + (step - 1) * lr_decay);
      for (int64_t e = begin; e < end; ++e) {
        double g = g32[e] * scale;
        const double p = p_in[e];
        g += weight_decay * p;
        const double sum = (first ? initial : s_in[0][e]) + g * g;
        s_out[0][e] = static_cast<float>(sum);
        p_out[e] = static_cast<float>(p - clr * g / (std::sqrt(sum) + eps));
      }
      break;
    }
  }
}

}  // namespace

StatusOr<std::optional<Kernel>> MakeOptimizerKernel(const KernelRequest& req,
                                                    const SelectContext& ctx) {
  auto d = std::make_shared<OptimizerData>();
  d->op = req.op;
  d->attrs = *req.attrs;
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  std::string name = absl::StrCat("cpu.", OpName(req.op), ".dense");
  return std::optional<Kernel>(Kernel{OptimizerKernel, std::move(d), std::move(name)});
}

}  // namespace kiln::cpu
