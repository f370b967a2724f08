// The fine-tuning engine: a model's training forward (models/llm/forward.h, the training
// ForwardContext), a token-level cross-entropy over the batch's counted tokens, the backward graph
// from autograd (engine/autograd.h) and one fused optimizer kernel per trainable tensor —
// compiled by the same compiler as serving (fusion, memory planning, regional compilation,
// kernel cache) into one program per step.
//
//   KILN_ASSIGN_OR_RETURN(PagedLlmParts parts, OpenLlmParts(config));
//   KILN_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(std::move(parts), options));
//   for (...) KILN_ASSIGN_OR_RETURN(TrainStepResult r, trainer->Step(batch, lr));
//   LoraAdapter adapter = *trainer->ExportAdapter();
//
// Loss: mean over the batch's counted tokens (targets != -100) of -log softmax(logits)[target],
// as transformers' causal-LM loss with labels already shifted. Trainable tensors are f32
// States: LoRA A/B (base weights frozen in their stored dtype) or, for full fine-tuning, every
// weight (f32 master copies). Optimizer moments are f32 States beside them.
//
// Thread-safety: a Trainer is used by one thread at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/base/status.h"
#include "engine/builder.h"
#include "engine/optimizer.h"
#include "engine/program.h"
#include "engine/tensor.h"
#include "models/llm/forward.h"
#include "models/llm/paged_llm.h"
#include "models/lora/lora_config.h"
#include "models/train/dataset.h"

namespace kiln::models {

using train::TrainBatch;

struct TrainerOptions {
  enum class Method { kLora, kFull };
  Method method = Method::kLora;
  LoraConfig lora;
  int64_t batch_size = 4;  // rows per step
  int64_t seq_len = 256;   // tokens per row
  // The optimizer's constant hyper-parameters (engine/optimizer.h); the learning rate is
  // Step's argument, read at run time (the step program is compiled once).
  OptimizerParams optimizer;
  double max_grad_norm = 1.0;  // global-norm clipping (torch.nn.utils.clip_grad_norm_); 0: off
  // Adapter initialisation, and LoRA dropout's masks (lora.dropout > 0: PEFT's lora_dropout,
  // applied in Step and Gradients, not in Evaluate or Logits; models/lora/lora_dropout.h).
  uint64_t seed = 42;
  // Activation recomputation per transformer block (GradientOptions::recompute): the backward
  // recomputes each block's activations from its input instead of keeping them from the
  // forward; a smaller step arena for about one more forward of compute. Same results.
  bool recompute = false;
  // Selective recomputation (GradientOptions::recompute_on_read), when `recompute` is off:
  // the normalised inputs of attention and MLP (attn_norm, ffn_norm) and the MLP's activation
  // product (ffn_act) are recomputed where the backward reads them instead of being kept from
  // the forward: about 40% less activation memory for a few pointwise passes. Same results.
  bool recompute_cheap = true;
};

struct TrainStepResult {
  double loss = 0;       // mean over the counted tokens
  int64_t tokens = 0;    // counted tokens
  double grad_norm = 0;  // before clipping
};

// The classifier and its loss for training: per-row cross-entropy of logits = x W^T (the
// model's final Linear), the gradient of sum(loss * dloss) w.r.t. x, and W's own gradient when
// W is trainable (a State). Computed in chunks of rows, each chunk's logits, loss, dlogits and
// dlogits W in turn, so logits and dlogits never exist for all rows at once. A head that is
// not a plain 2-D Linear runs one fused cross-entropy (input = logits, dinput = dlogits).
struct ClassifierOutputs {
  Value loss;     // [rows]
  Value input;    // what dinput is the gradient of: x, or the logits
  Value dinput;   // [rows, C] (or [rows, V])
  Value weight;   // W (invalid when not chunked)
  Value dweight;  // W's gradient; invalid unless W is a State
};
ClassifierOutputs ChunkedClassifier(Builder& b, Value logits, Value targets, Value dloss);

// Whether `device` has its own attention_backward kernel (not the reference's) for the
// training attention of every layer of `hp` (f32, rows x seq_len, document masks with each
// layer's window); the training graphs then use the fused attention op. KILN_FUSED_ATTENTION=0
// says no (the decomposed attention, for comparisons).
bool NativeTrainingAttention(backend::Device& device, const LlmHParams& hp, int64_t rows,
                             int64_t seq_len);

class Trainer {
 public:
  // Builds and compiles the training graphs on `parts.device`. Errors: a bad LoRA
  // configuration, a target module the architecture lacks, sizes <= 0, compile errors.
  static StatusOr<std::unique_ptr<Trainer>> Create(PagedLlmParts parts,
                                                   const TrainerOptions& options);
  ~Trainer();

  const PagedLlmParts& parts() const { return parts_; }
  const TrainerOptions& options() const { return options_; }
  // Whether attention runs fused (NativeTrainingAttention), decided once at Create.
  bool fused_attention() const { return fused_attention_; }
  // The trainable tensors (LoRA "blk.3.attn_q.lora_A" (r, in) / ".lora_B" (out, r); full
  // fine-tuning: every weight), in graph order.
  const std::vector<TrainableTensor>& trainable() const { return trainable_; }
  int64_t trainable_parameters() const;

  // One optimizer step on `batch` at learning rate `lr`. REQUIRES: batch has
  // options().batch_size rows of options().seq_len tokens.
  StatusOr<TrainStepResult> Step(const TrainBatch& batch, double lr);
  // Gradient accumulation: one optimizer step on the gradient of the loss over every
  // counted token of `micro_batches` (each options().batch_size rows of options().seq_len
  // tokens) — what one batch of all their rows gives, as transformers' Trainer computes it
  // with gradient_accumulation_steps (the loss is normalised by the tokens of the whole
  // step, not averaged per micro-batch). Each micro-batch runs forward and backward and adds
  // its gradients into f32 accumulators (one per trainable tensor, allocated on first use);
  // then clipping and the optimizer run once on the sums. One micro-batch is Step(batch).
  // The result's loss is the step's mean, tokens its counted tokens. A micro-batch without
  // counted tokens is skipped; all of them without: InvalidArgument.
  StatusOr<TrainStepResult> Step(std::span<const TrainBatch> micro_batches, double lr);
  // The loss without a step (validation).
  StatusOr<TrainStepResult> Evaluate(const TrainBatch& batch);
  // The logits of every token of `batch` with the current trainable tensors (no loss, no
  // update; targets are ignored): [rows * seq_len, vocab_size] row-major. What a model with
  // ExportAdapter's adapter computes — e.g. PEFT on the Hugging Face model — for the same rows.
  StatusOr<std::vector<float>> Logits(const TrainBatch& batch);
  // The loss and d loss / d tensor for every trainable tensor (no update), by name.
  StatusOr<TrainStepResult> Gradients(const TrainBatch& batch,
                                      std::map<std::string, std::vector<float>>* grads);

  // The values of trainable tensor `name` (f32), or replaces them.
  StatusOr<std::vector<float>> Read(const std::string& name) const;
  Status Write(const std::string& name, std::span<const float> values);
  // The optimizer state ("<name>.m", "<name>.v", ...: OptimizerStateNames) by name, and the
  // step count, for checkpoints.
  std::map<std::string, std::vector<float>> OptimizerState() const;
  Status SetOptimizerState(const std::map<std::string, std::vector<float>>& state, int64_t step);
  int64_t step() const { return step_; }

  // LoRA only: the adapter (rows of B in the model's order) / replace it (shapes checked).
  StatusOr<LoraAdapter> ExportAdapter() const;
  Status ImportAdapter(const LoraAdapter& adapter);

  // Peak arena bytes of the step program, or of the largest of the gradient accumulation
  // programs (activations and gradients; weights excluded).
  size_t step_arena_bytes() const;

 private:
  // kAccumulate: forward and backward of one micro-batch, gradients added into the
  // accumulators; kApply: clipping and the optimizer on the accumulators (no forward).
  enum class Kind { kLoss, kGradients, kStep, kLogits, kAccumulate, kApply, kCount };
  struct Compiled;
  Trainer(PagedLlmParts parts, const TrainerOptions& options);
  Status Init();
  StatusOr<Compiled*> Get(Kind kind);
  // `out`: kGradients' gradients by name, or kLogits' logits under "logits". `count`: the
  // counted tokens the loss is normalised by (0: the batch's own). `micro_batch`: its index
  // within the step (LoRA dropout's masks differ per micro-batch).
  StatusOr<TrainStepResult> Run(Kind kind, const TrainBatch& batch, double lr,
                                std::map<std::string, std::vector<float>>* out, int64_t count = 0,
                                int64_t micro_batch = 0);
  // Checks a batch's shape and token ids; returns its counted tokens.
  StatusOr<int64_t> CheckBatch(const TrainBatch& batch) const;
  // Binds what a compiled program names (weights, States, inputs), allocating on first use.
  Status BindExternals(Program& p);
  // The step's optimizer hyper-parameters {step, lr, grad_scale} into "optim.hyper".
  Status PutHyper(double lr);
  StatusOr<double> ReadScalar(const Program& p, int output) const;
  Status Upload(const Tensor& t, const void* src, size_t bytes);
  Status Zero(const Tensor& t);
  StatusOr<std::vector<float>> Download(const Tensor& t) const;

  PagedLlmParts parts_;
  TrainerOptions options_;
  bool fused_attention_ = false;
  std::unique_ptr<backend::Stream> stream_;
  std::vector<TrainableTensor> trainable_;
  std::map<std::string, Tensor> weights_;            // frozen weights, by GGUF name
  std::map<std::string, Tensor> states_;             // trainable tensors and optimizer moments
  std::map<std::string, Tensor> inputs_;             // tokens, targets, positions, doc_ids, scalars
  std::vector<std::unique_ptr<Compiled>> compiled_;  // by Kind
  int64_t step_ = 0;
};

}  // namespace kiln::models
