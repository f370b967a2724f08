#include "models/train/finetune.h"

#include <sys/resource.h>

#include <chrono>
#include <cmath>

#include "engine/lr_schedule.h"
#include "engine/optimizer.h"
#include "models/arch/arch.h"
#include "models/io/durable_file.h"
#include "models/io/errors.h"
#include "models/llm/loader.h"
#include "models/lora/peft_io.h"
#include "models/train/checkpoint.h"
#include "models/train/dataset.h"
#include "models/train/export.h"
#include "models/train/trainer.h"

namespace kiln::models {
namespace {

using Clock = std::chrono::steady_clock;

// kiln_train_*: what a dashboard shows of a run.
struct TrainMetrics {
  metrics::Counter* tokens = nullptr;
  metrics::Counter* steps = nullptr;
  metrics::Gauge* loss = nullptr;
  metrics::Gauge* lr = nullptr;
  metrics::Gauge* grad_norm = nullptr;
  metrics::Histogram* step_seconds = nullptr;

  explicit TrainMetrics(metrics::Registry* r) {
    if (r == nullptr) return;
    tokens =
        r->AddCounter("kiln_train_tokens_total", "Counted (target) tokens trained.").WithLabels({});
    steps = r->AddCounter("kiln_train_steps_total", "Optimizer steps taken.").WithLabels({});
    loss = r->AddGauge("kiln_train_loss", "Training loss of the last step.").WithLabels({});
    lr = r->AddGauge("kiln_train_learning_rate", "Learning rate of the last step.").WithLabels({});
    grad_norm = r->AddGauge("kiln_train_grad_norm",
                            "Global gradient norm of the last step, "
                            "before clipping.")
                    .WithLabels({});
    step_seconds = r->AddHistogram("kiln_train_step_seconds", "Seconds per optimizer step.", {},
                                   {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60})
                       .WithLabels({});
  }
};

}  // namespace

void RegisterTrainMetrics(metrics::Registry* registry) { (void)TrainMetrics(registry); }

namespace {

int64_t PeakRssBytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

// A validation batch with fewer rows than the step program takes, padded with rows that
// count nothing.
train::TrainBatch PadRows(train::TrainBatch b, int64_t rows) {
  const size_t n = static_cast<size_t>(rows * b.seq_len);
  b.tokens.resize(n, 0);
  b.targets.resize(n, train::kIgnoreIndex);
  b.positions.resize(n, 0);
  b.doc_ids.resize(n, train::kPadDocId);
  b.rows = rows;
  return b;
}

constexpr int64_t kMaxGradAccum = 1024;

Status CheckOptions(const FinetuneOptions& o) {
  if (o.model.empty()) return InvalidArgument("--model is required");
  if (o.train.empty()) return InvalidArgument("--train is required");
  if (o.method != "lora" && o.method != "full") {
    return InvalidArgument("--method must be lora or full, got '", o.method, "'");
  }
  if (!(o.lr > 0) || !std::isfinite(o.lr)) {
    return InvalidArgument("the learning rate must be positive, got ", o.lr);
  }
  if (o.epochs < 1 && o.steps < 1) return InvalidArgument("--epochs or --steps must be >= 1");
  if (o.batch_size < 1) return InvalidArgument("--batch-size must be >= 1, got ", o.batch_size);
  if (o.grad_accum < 1 || o.grad_accum > kMaxGradAccum) {
    return InvalidArgument("--grad-accum must be between 1 and ", kMaxGradAccum, ", got ",
                           o.grad_accum);
  }
  if (o.seq_len < 2) return InvalidArgument("--seq-len must be >= 2, got ", o.seq_len);
  if (o.warmup_steps < 0) return InvalidArgument("--warmup-steps must be >= 0");
  if (o.save_steps < 0) return InvalidArgument("--save-steps must be >= 0");
  if (!(o.weight_decay >= 0)) return InvalidArgument("--weight-decay must be >= 0");
  if (o.method == "lora") KILN_RETURN_IF_ERROR(o.lora.Validate());
  return OkStatus();
}

// The trainable tensors as a checkpoint's FullModelWeights (Hugging Face names and row order).
StatusOr<FullModelWeights> ExportFull(const Trainer& trainer, const HfLayout& layout) {
  const LlmHParams& hp = trainer.parts().hparams;
  FullModelWeights w;
  w.config = layout.config;
  for (const TrainableTensor& t : trainer.trainable()) {
    auto it = layout.hf_of.find(t.name);
    if (it == layout.hf_of.end()) {
      return Unimplemented("no Hugging Face name for weight '", t.name, "'");
    }
    KILN_ASSIGN_OR_RETURN(std::vector<float> v, trainer.Read(t.name));
    w.tensors[it->second] =
        CheckpointTensor{t.shape, HfRowOrder(t.name, std::move(v), t.shape, hp, layout)};
  }
  return w;
}

}  // namespace

StatusOr<FinetuneSummary> RunFinetune(const FinetuneOptions& o,
                                      const std::function<bool(const FinetuneProgress&)>& report) {
  KILN_RETURN_IF_ERROR(CheckOptions(o));
  auto say = [&](std::string message) {
    if (!report) return;
    FinetuneProgress p;
    p.message = std::move(message);
    (void)report(p);
  };
  LrSchedule schedule;
  KILN_ASSIGN_OR_RETURN(schedule.kind, ParseLrScheduleKind(o.schedule));
  KILN_ASSIGN_OR_RETURN(const OptimizerKind opt_kind, ParseOptimizerKind(o.optimizer));

  config::ModelConfig mc;
  mc.path = o.model;
  mc.backend = o.backend;
  mc.threads = o.threads;
  KILN_ASSIGN_OR_RETURN(PagedLlmParts parts, OpenLlmParts(mc));
  const PeftBaseModel base = PeftBaseModel::FromHParams(parts.hparams, o.model);

  // Data.
  train::DataOptions dopt;
  dopt.max_seq_len = o.seq_len;
  dopt.pack = o.pack;
  dopt.seed = o.seed;
  if (const auto& eog = parts.tokenizer->eog_ids(); !eog.empty()) dopt.pad_token_id = eog[0];
  std::vector<std::string> warnings;
  const std::string train_paths[] = {o.train};
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<train::DataLoader> data,
                        train::DataLoader::FromFiles(train_paths, *parts.tokenizer,
                                                     parts.chat_template.get(), dopt, &warnings));
  std::unique_ptr<train::DataLoader> valid;
  if (!o.valid.empty()) {
    train::DataOptions vopt = dopt;
    vopt.shuffle = false;
    const std::string valid_paths[] = {o.valid};
    KILN_ASSIGN_OR_RETURN(valid,
                          train::DataLoader::FromFiles(valid_paths, *parts.tokenizer,
                                                       parts.chat_template.get(), vopt, &warnings));
  }
  for (std::string& w : warnings) say("warning: " + w);

  // Steps: --steps, or enough batches to cover --epochs.
  const int64_t rows_per_epoch = data->RowsInEpoch(0);
  const int64_t rows_per_step = o.batch_size * o.grad_accum;
  const int64_t steps_per_epoch =
      std::max<int64_t>(1, (rows_per_epoch + rows_per_step - 1) / rows_per_step);
  const int64_t total_steps = o.steps > 0 ? o.steps : steps_per_epoch * o.epochs;
  schedule.lr = o.lr;
  schedule.warmup_steps = o.warmup_steps;
  schedule.total_steps = total_steps;

  TrainerOptions topt;
  topt.method = o.method == "lora" ? TrainerOptions::Method::kLora : TrainerOptions::Method::kFull;
  topt.lora = o.lora;
  topt.batch_size = o.batch_size;
  topt.seq_len = o.seq_len;
  topt.optimizer = DefaultOptimizerParams(opt_kind);
  topt.optimizer.weight_decay = o.weight_decay;
  topt.max_grad_norm = o.max_grad_norm;
  topt.seed = o.seed;
  topt.recompute = o.recompute;
  topt.recompute_cheap = !o.keep_activations;
  const nlohmann::json options_json = {{"model", o.model},
                                       {"train", o.train},
                                       {"valid", o.valid},
                                       {"method", o.method},
                                       {"r", o.lora.r},
                                       {"lora_alpha", o.lora.alpha},
                                       {"target_modules", o.lora.target_modules},
                                       {"use_rslora", o.lora.use_rslora},
                                       {"optimizer", o.optimizer},
                                       {"lr", o.lr},
                                       {"schedule", o.schedule},
                                       {"warmup_steps", o.warmup_steps},
                                       {"weight_decay", o.weight_decay},
                                       {"max_grad_norm", o.max_grad_norm},
                                       {"total_steps", total_steps},
                                       {"batch_size", o.batch_size},
                                       {"grad_accum", o.grad_accum},
                                       {"seq_len", o.seq_len},
                                       {"pack", o.pack},
                                       {"seed", o.seed}};
  const HfLayout layout = MakeHfLayout(parts);
  const bool full = o.method == "full";
  if (full) KILN_RETURN_IF_ERROR(CheckHfWritable(parts));  // before training, not after
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(std::move(parts), topt));
  say(Cat("training ", trainer->trainable_parameters(), " parameters (", o.method, ") for ",
          total_steps, " steps of ", o.batch_size, " x ", o.seq_len, " tokens",
          o.grad_accum > 1 ? Cat(" x ", o.grad_accum, " micro-batches") : std::string(), "; ",
          data->example_count(), " examples, ", rows_per_epoch, " rows per epoch"));

  // Resume.
  std::vector<LossRecord> losses;
  if (!o.resume.empty()) {
    KILN_ASSIGN_OR_RETURN(FoundCheckpoint found, FindLatestCheckpoint(o.resume));
    for (const std::string& s : found.skipped) say("skipped " + s);
    if (found.dir.empty()) return NotFound("no complete checkpoint under '", o.resume, "'");
    KILN_ASSIGN_OR_RETURN(Checkpoint ck, LoadCheckpoint(found.dir, base));
    if (full) {
      if (!ck.model) return InvalidArgument(found.dir, ": not a full fine-tuning checkpoint");
      for (const auto& [gguf, hf] : layout.hf_of) {
        auto it = ck.model->tensors.find(hf);
        if (it == ck.model->tensors.end()) continue;
        const std::vector<float> v = ModelRowOrder(
            gguf, std::move(it->second.data), it->second.shape, trainer->parts().hparams, layout);
        KILN_RETURN_IF_ERROR(Annotate(trainer->Write(gguf, v), Cat(found.dir, ": ", hf)));
      }
    } else {
      if (!ck.adapter) return InvalidArgument(found.dir, ": not a LoRA checkpoint");
      KILN_RETURN_IF_ERROR(Annotate(trainer->ImportAdapter(*ck.adapter), found.dir));
    }
    std::map<std::string, std::vector<float>> opt_state;
    for (auto& [name, t] : ck.optimizer) opt_state[name] = std::move(t.data);
    KILN_RETURN_IF_ERROR(Annotate(trainer->SetOptimizerState(opt_state, ck.state.step), found.dir));
    if (!ck.state.data_position.is_string()) {
      return InvalidArgument(found.dir, "/trainer_state.json: data_position is not a string");
    }
    KILN_ASSIGN_OR_RETURN(train::DataPosition pos,
                          train::DataPosition::Parse(ck.state.data_position.get<std::string>()));
    KILN_RETURN_IF_ERROR(Annotate(data->Seek(pos), Cat(found.dir, ": data position")));
    losses = ck.state.losses;
    if (report) {
      FinetuneProgress p;
      p.message = Cat("resumed from ", found.dir, " at step ", ck.state.step);
      p.resumed_step = ck.state.step;
      (void)report(p);
    }
  }

  TrainMetrics m(o.metrics);
  FinetuneSummary summary;
  summary.trainable_parameters = trainer->trainable_parameters();
  const auto start = Clock::now();
  std::map<std::string, std::vector<int64_t>> shapes;  // trainable tensor -> shape
  for (const TrainableTensor& t : trainer->trainable()) shapes[t.name] = t.shape;
  auto last_save = Clock::now();
  auto save = [&](int64_t step) -> Status {
    Checkpoint ck;
    ck.state.step = step;
    ck.state.epoch = static_cast<double>(step) / static_cast<double>(steps_per_epoch);
    ck.state.data_position = data->position().ToString();
    ck.state.losses = losses;
    ck.state.options = options_json;
    if (full) {
      KILN_ASSIGN_OR_RETURN(ck.model, ExportFull(*trainer, layout));
    } else {
      KILN_ASSIGN_OR_RETURN(ck.adapter, trainer->ExportAdapter());
    }
    for (auto& [name, v] : trainer->OptimizerState()) {  // "<tensor>.<state>"
      auto shape = shapes.find(name.substr(0, name.rfind('.')));
      KILN_CHECK(shape != shapes.end(), "optimizer state of an unknown tensor");
      ck.optimizer[name] = CheckpointTensor{shape->second, std::move(v)};
    }
    CheckpointOptions copt;
    copt.keep_last = o.keep_checkpoints;
    KILN_ASSIGN_OR_RETURN(std::string dir, WriteCheckpoint(o.out, ck, base, copt));
    last_save = Clock::now();
    if (report) {
      FinetuneProgress p;
      p.message = "checkpoint " + dir;
      p.checkpoint_dir = dir;
      p.checkpoint_step = step;
      (void)report(p);
    }
    return OkStatus();
  };
  auto validate = [&]() -> StatusOr<double> {
    double sum = 0;
    int64_t count = 0;
    for (const train::TrainBatch& b : valid->OnePass(o.batch_size)) {
      if (b.target_count == 0) continue;
      KILN_ASSIGN_OR_RETURN(TrainStepResult r, trainer->Evaluate(PadRows(b, o.batch_size)));
      sum += r.loss * static_cast<double>(r.tokens);
      count += r.tokens;
    }
    return count > 0 ? sum / static_cast<double>(count) : 0.0;
  };

  for (int64_t step = trainer->step() + 1; step <= total_steps; ++step) {
    std::vector<train::TrainBatch> batches;
    int64_t counted = 0;
    for (int64_t i = 0; i < o.grad_accum; ++i) {
      batches.push_back(data->NextBatch(o.batch_size));
      counted += batches.back().target_count;
    }
    const double lr = LearningRate(schedule, step);
    const auto t0 = Clock::now();
    StatusOr<TrainStepResult> r = counted > 0
                                      ? trainer->Step(batches, lr)
                                      : StatusOr<TrainStepResult>(InvalidArgument("empty batch"));
    if (!r.ok()) return Annotate(r.status(), Cat("step ", step));
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!std::isfinite(r->loss)) {
      return Internal("step ", step, ": the loss is not finite (", r->loss,
                      "); lower the learning rate (", lr, ")");
    }
    losses.push_back({step, r->loss});
    summary.steps++;
    summary.tokens += r->tokens;
    summary.final_loss = r->loss;
    if (m.tokens != nullptr) {
      m.tokens->Increment(static_cast<double>(r->tokens));
      m.steps->Increment();
      m.loss->Set(r->loss);
      m.lr->Set(lr);
      m.grad_norm->Set(r->grad_norm);
      m.step_seconds->Observe(seconds);
    }
    FinetuneProgress p;
    p.step = step;
    p.total_steps = total_steps;
    p.epoch = static_cast<double>(step) / static_cast<double>(steps_per_epoch);
    p.loss = r->loss;
    p.lr = lr;
    p.grad_norm = r->grad_norm;
    p.tokens_per_second = static_cast<double>(r->tokens) / std::max(seconds, 1e-9);
    p.step_seconds = seconds;
    const bool epoch_end = step % steps_per_epoch == 0 || step == total_steps;
    if (epoch_end && valid != nullptr) {
      KILN_ASSIGN_OR_RETURN(p.valid_loss, validate());
      summary.valid_loss = p.valid_loss;
    }
    if (report && !report(p)) {
      summary.stopped = step != total_steps;
      break;
    }
    const bool save_now =
        (o.save_steps > 0 ? step % o.save_steps == 0 : epoch_end) ||
        (o.save_seconds > 0 &&
         std::chrono::duration<double>(Clock::now() - last_save).count() >= o.save_seconds);
    if (save_now && step != total_steps) KILN_RETURN_IF_ERROR(save(step));
  }
  if (summary.steps > 0) KILN_RETURN_IF_ERROR(save(trainer->step()));
  if (full) {
    // The weights in Hugging Face's layout (f32), with the folder's tokenizer files when the
    // model came as a folder: a model directory Kiln and transformers load.
    std::map<std::string, std::vector<float>> tensors;
    for (const TrainableTensor& t : trainer->trainable()) {
      KILN_ASSIGN_OR_RETURN(tensors[t.name], trainer->Read(t.name));
    }
    KILN_RETURN_IF_ERROR(WriteHfModel(o.out, o.model, trainer->parts(), layout, tensors));
  } else {
    KILN_ASSIGN_OR_RETURN(LoraAdapter adapter, trainer->ExportAdapter());
    KILN_RETURN_IF_ERROR(WritePeftAdapter(o.out, adapter, base));
  }
  summary.adapter_dir = o.out;
  summary.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  summary.peak_rss_bytes = PeakRssBytes();
  summary.step_arena_bytes = static_cast<int64_t>(trainer->step_arena_bytes());
  return summary;
}

}  // namespace kiln::models
