// A fine-tuning run from files to an adapter (or fully fine-tuned weights): what
// `kiln finetune` does, and what the daemon's job runner will call.
//
//   FinetuneOptions o;
//   o.model = ".kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf";
//   o.train = "train.jsonl";
//   o.out = "out";
//   KILN_ASSIGN_OR_RETURN(FinetuneSummary s, RunFinetune(o, &progress));
//
// The run: open the model (models/llm/loader.h), tokenize and pack the data
// (models/train/dataset.h), build and compile the training step (models/train/trainer.h),
// then per step: next batch, learning rate from the schedule (engine/lr_schedule.h), one
// optimizer step, a progress report; a validation pass at the end of each epoch; a checkpoint
// every `save_steps` steps and at the end (models/train/checkpoint.h, atomic); the final
// adapter in PEFT's layout directly in `out` (adapter_config.json, adapter_model.safetensors).
// With `resume`, the newest complete checkpoint under it continues the run: the same data
// position, optimizer state and step, so the losses are those of an uninterrupted run.
//
// Thread-safety: RunFinetune blocks the calling thread; runs share nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/base/metrics.h"
#include "engine/base/status.h"
#include "models/lora/lora_config.h"

namespace kiln::models {

struct FinetuneOptions {
  std::string model;  // GGUF file or Hugging Face folder
  std::string train;  // JSONL (OpenAI chat or prompt/completion)
  std::string valid;  // optional JSONL: loss reported per epoch
  std::string out = "kiln-finetune";
  std::string resume;           // a run's out dir (its newest complete checkpoint), or empty
  std::string method = "lora";  // lora | full
  LoraConfig lora;
  std::string optimizer = "adamw";  // adamw | adam | sgd | adagrad
  double lr = 2e-4;
  std::string schedule = "linear";  // constant | linear | cosine (each with warmup)
  int64_t warmup_steps = 0;
  double weight_decay = 0.0;  // transformers' TrainingArguments default
  double max_grad_norm = 1.0;
  int64_t epochs = 1;
  int64_t steps = 0;  // > 0: this many optimizer steps instead of `epochs`
  int64_t batch_size = 4;
  // Micro-batches of batch_size rows per optimizer step (Trainer::Step over micro-batches):
  // the step of one batch of grad_accum * batch_size rows in the memory of batch_size rows.
  int64_t grad_accum = 1;
  int64_t seq_len = 1024;
  bool pack = true;
  bool recompute = false;         // TrainerOptions::recompute: a smaller arena, ~1 more forward
  bool keep_activations = false;  // TrainerOptions::recompute_cheap off
  uint64_t seed = 42;
  int64_t save_steps = 0;  // 0: a checkpoint at the end of each epoch and at the end
  // > 0: also a checkpoint once this many seconds passed since the last one (or the start),
  // checked after each step; what bounds the work a crash loses when steps are slow.
  double save_seconds = 0;
  int keep_checkpoints = 2;
  int threads = 0;  // CPU threads; 0: the CPUs the process may use (affinity, cgroup quota)
  std::string backend = "cpu";
  metrics::Registry* metrics = nullptr;  // kiln_train_*; not owned; may be null
};

// What each step reports (and the final summary repeats).
struct FinetuneProgress {
  int64_t step = 0, total_steps = 0;
  double epoch = 0;  // fractional
  double loss = 0, lr = 0, grad_norm = 0;
  double tokens_per_second = 0;  // counted (target) tokens of this step / its seconds
  double step_seconds = 0;       // wall time of the optimizer step
  double valid_loss = -1;        // >= 0 right after a validation pass
  std::string message;           // a warning or note to print, if any
  // Set on the report that follows a checkpoint write (message "checkpoint <dir>"): its
  // directory and step. Empty otherwise.
  std::string checkpoint_dir;
  int64_t checkpoint_step = 0;
  int64_t resumed_step = 0;  // on the "resumed from" message: the step the run continues after
};

struct FinetuneSummary {
  int64_t steps = 0, tokens = 0;  // optimizer steps and counted tokens trained this run
  double seconds = 0;
  double final_loss = 0, valid_loss = -1;
  int64_t trainable_parameters = 0;
  int64_t peak_rss_bytes = 0;  // of the process
  int64_t step_arena_bytes = 0;
  std::string adapter_dir;  // where the result is
  bool stopped = false;     // report asked to stop before the last step
};

// Registers the kiln_train_* families RunFinetune reports into (docs/metrics.md), so that a
// server exposes them before its first job. Idempotent; `registry` may be null (nothing).
void RegisterTrainMetrics(metrics::Registry* registry);

// Runs the whole fine-tuning; `report` (may be null) is called after every step and for
// messages; returning false after a step stops the run there: a checkpoint of that step is
// written (so `resume` continues it) and the summary has stopped = true. Errors: bad options
// (named), unreadable or malformed data (file:line: field), model errors, and I/O errors
// writing checkpoints (nothing partial is left as complete).
StatusOr<FinetuneSummary> RunFinetune(const FinetuneOptions& options,
                                      const std::function<bool(const FinetuneProgress&)>& report);

}  // namespace kiln::models
