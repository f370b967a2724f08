// Fine-tuning optimizers as graph ops: torch.optim's AdamW, Adam, SGD and Adagrad, each one
// fused kernel per parameter tensor (OpKind::kAdamW, kAdam, kSgd, kAdagrad), and global-norm
// gradient clipping (torch.nn.utils.clip_grad_norm_) computed in the graph.
//
// A training step, built once, compiled into one Program and run (or captured and replayed)
// every step:
//
//   Value hyper = b.Input("opt.hyper", DType::kF32, {3});  // {step, lr, grad_scale}
//   std::vector<Value> grads = *Gradients(b, loss, params);
//   ClipGradNormOutputs clip = ClipGradNorm(b, grads, /*max_norm=*/1.0);  // optional
//   OptimizerParams opt = DefaultOptimizerParams(OptimizerKind::kAdamW);
//   for (size_t i = 0; i < params.size(); ++i) {  // params[i]: the f32 State "x"
//     std::vector<Value> states;                 // the f32 States "x.m", "x.v" (same shape)
//     for (const std::string& s : OptimizerStateNames(opt)) {
//       states.push_back(b.State(name + "." + s, DType::kF32, shape_of_x));
//     }
//     b.OptimizerStep(params[i], grads[i], states, hyper, clip.coef, opt);  // or Value{}
//   }
//
// Before each run the host writes {step (1-based), LearningRate(schedule, step)
// (engine/lr_schedule.h), grad_scale} into hyper. grad_scale is 1 unless the gradients need
// a factor the graph does not apply (1/n for n summed micro-batches); with clipping, apply
// such a factor in the graph (scale the loss) instead, since clip_grad_norm_ sees the
// averaged gradients in PyTorch. Build every gradient and ClipGradNorm before the first
// OptimizerStep: nodes run in builder order and nothing may read a State after an optimizer
// overwrote it (verify refuses such graphs). The States may hold anything before step 1.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"
#include "engine/ops.h"

namespace kiln {

class Builder;

enum class OptimizerKind : int { kAdamW = 0, kAdam = 1, kSgd = 2, kAdagrad = 3 };

// The constant hyper-parameters of an optimizer (node attributes); what changes per step
// (step, lr, gradient scale) is a run-time input of the op. Each field is used only by the
// optimizers named; the defaults here are AdamW's, DefaultOptimizerParams gives torch's
// defaults for each kind.
struct OptimizerParams {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double beta1 = 0.9;          // adamw, adam
  double beta2 = 0.999;        // adamw, adam
  double eps = 1e-8;           // adamw, adam, adagrad (torch's adagrad default: 1e-10)
  double weight_decay = 1e-2;  // all: decoupled for adamw, added to the gradient (L2) else
  double momentum = 0;         // sgd; 0: no momentum buffer (no state)
  double dampening = 0;        // sgd
  bool nesterov = false;       // sgd: REQUIRES momentum > 0 and dampening == 0
  double lr_decay = 0;         // adagrad
  double initial_accumulator_value = 0;  // adagrad
};

// torch.optim's defaults for `kind` (weight_decay 1e-2 for AdamW, 0 for the others; eps 1e-10
// for Adagrad).
OptimizerParams DefaultOptimizerParams(OptimizerKind kind);

// "adamw", "adam", "sgd", "adagrad"; InvalidArgument naming the allowed values otherwise.
StatusOr<OptimizerKind> ParseOptimizerKind(std::string_view name);
const char* OptimizerKindName(OptimizerKind kind);

// The state tensors the optimizer keeps per parameter, as name suffixes in the order
// OptimizerStep takes them: adamw/adam {"m", "v"}, sgd {"momentum"} (none without momentum),
// adagrad {"sum"}. Each is an f32 tensor of the parameter's shape.
std::vector<std::string> OptimizerStateNames(const OptimizerParams& p);

// The values after an optimizer step; each aliases the State it overwrote (read these, not
// the States, after the update).
struct OptimizerOutputs {
  Value param;
  std::vector<Value> states;  // in OptimizerStateNames order
};

// The per-tensor scalars of an optimizer op's update at `step` (1-based), as torch computes them
// once per step (Python floats), for the kernels: Adam(W): step_size = lr / (1 - beta1^step)
// and bias_correction2_sqrt = sqrt(1 - beta2^step); Adagrad: step_size = clr = lr / (1 +
// (step - 1) * lr_decay); SGD: lr and 1. `attr_floats`: the op node's attrs.floats.
struct OptimizerStepScalars {
  double step_size = 0;
  double bias_correction2_sqrt = 1;
};
OptimizerStepScalars StepScalars(OpKind op, std::span<const double> attr_floats, double lr,
                                 double step);

// Global-norm clipping's two numbers, as torch.nn.utils.clip_grad_norm_ computes them.
struct ClipGradNormOutputs {
  Value total_norm;  // rank 0 f32: the 2-norm of the per-tensor 2-norms
  Value coef;        // rank 0 f32: min(1, max_norm / (total_norm + 1e-6))
};

// Builds clip_grad_norm_'s total norm and clipping coefficient over `grads` (any float
// dtype and shape; each is cast to f32, its norm taken, then the norm of those norms) without
// scaling anything: feed `coef` to OptimizerStep's grad_scale, so the clipped update needs no
// round trip to the host. A non-finite total gives a non-finite
// coefficient (torch's error_if_nonfinite=False). Errors are recorded in the builder.
// REQUIRES: grads is not empty, max_norm > 0.
ClipGradNormOutputs ClipGradNorm(Builder& b, std::span<const Value> grads, double max_norm);

}  // namespace kiln
