#include "scheduler/finetune/job_service.h"

#include <openssl/sha.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "models/io/durable_file.h"
#include "models/llm/llm_model.h"
#include "models/train/checkpoint.h"
#include "models/train/dataset.h"
#include "models/train/finetune.h"
#include "scheduler/finetune/jsonl_check.h"
#include "scheduler/llm/continuous_batcher.h"
#include "scheduler/llm/generate_request.h"
#include "scheduler/model.h"
#include "scheduler/model_repository.h"
#include "spdlog/spdlog.h"

namespace kiln::finetune {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kPurpose = "fine-tune";
constexpr size_t kMaxSuffixLength = 64;
constexpr size_t kMaxMetadataKeys = 16;
constexpr size_t kMaxMetadataKeyLength = 64;
constexpr size_t kMaxMetadataValueLength = 512;
constexpr int64_t kMaxEpochs = 50;
constexpr int64_t kMaxBatchSize = 256;
constexpr double kLoraLearningRate = 2e-4;  // learning_rate_multiplier 1 (PEFT's usual)
constexpr double kFullLearningRate = 2e-5;  // full fine-tuning moves every weight: 10x lower
constexpr int64_t kDefaultMaxSeqLen = 1024;
// A job whose base model is known but not READY is tried again after this long.
constexpr std::chrono::seconds kNotReadyRetry{5};

std::string Sha256Hex(std::string_view bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * sizeof digest);
  for (unsigned char c : digest) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

bool ValidSuffixChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
}

// Examples (non-blank lines, read as training reads them): what "auto" hyper-parameters
// are chosen by.
int64_t CountExamples(std::string_view text) {
  int64_t n = 0;
  (void)models::train::ForEachJsonlLine(text, "", [&](int64_t, std::string_view) {
    ++n;
    return OkStatus();
  });
  return n;
}

Status Bad(std::string_view param, std::string message) {
  return WithParam(InvalidArgument(message), param);
}

// An integer field, or "auto" (-> nullopt). `where` is the field's path for messages.
StatusOr<std::optional<int64_t>> AutoInt(const json& v, const std::string& where, int64_t lo,
                                         int64_t hi) {
  if (v.is_string() && v.get<std::string>() == "auto") return std::optional<int64_t>();
  if (!v.is_number_integer() && !v.is_number_unsigned()) {
    return Bad(where, StrCat("`", where, "` must be an integer in [", lo, ", ", hi,
                             "] or \"auto\", got ", v.dump()));
  }
  const int64_t n =
      v.is_number_unsigned()
          ? static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), uint64_t{1} << 62))
          : v.get<int64_t>();
  if (n < lo || n > hi) {
    return Bad(where,
               StrCat("`", where, "` is ", n, "; allowed: ", lo, " to ", hi, " or \"auto\""));
  }
  return std::optional<int64_t>(n);
}

StatusOr<double> PositiveNumber(const json& v, const std::string& where, double hi) {
  if (!v.is_number()) return Bad(where, StrCat("`", where, "` must be a number, got ", v.dump()));
  const double x = v.get<double>();
  if (!(x > 0) || x > hi) {
    return Bad(where,
               StrCat("`", where, "` is ", v.dump(), "; allowed: greater than 0, at most ", hi));
  }
  return x;
}

// The hyper-parameters a job trains with, resolved from the request (see docs/fine-tuning.md).
struct Hyper {
  int64_t n_epochs = 1;
  int64_t batch_size = 1;
  double learning_rate_multiplier = 1;
  double learning_rate = kLoraLearningRate;
  std::string method = "lora";  // lora | full
  int64_t lora_r = 8;
  double lora_alpha = 16;
  double lora_dropout = 0;
  int64_t gradient_accumulation_steps = 1;
  bool use_rslora = false;
  std::vector<std::string> target_modules = {"all-linear"};
  int64_t max_seq_len = kDefaultMaxSeqLen;
  std::string lr_scheduler = "linear";
  int64_t warmup_steps = 0;

  json ToJson() const {
    return {{"n_epochs", n_epochs},
            {"batch_size", batch_size},
            {"learning_rate_multiplier", learning_rate_multiplier},
            {"learning_rate", learning_rate},
            {"method", method},
            {"lora_r", lora_r},
            {"lora_alpha", lora_alpha},
            {"lora_dropout", lora_dropout},
            {"gradient_accumulation_steps", gradient_accumulation_steps},
            {"use_rslora", use_rslora},
            {"target_modules", target_modules},
            {"max_seq_len", max_seq_len},
            {"lr_scheduler", lr_scheduler},
            {"warmup_steps", warmup_steps}};
  }
  // The inverse of ToJson (a stored job's resolved values); absent keys keep the defaults.
  static Hyper FromJson(const json& j) {
    Hyper h;
    h.n_epochs = j.value("n_epochs", h.n_epochs);
    h.batch_size = j.value("batch_size", h.batch_size);
    h.learning_rate_multiplier = j.value("learning_rate_multiplier", h.learning_rate_multiplier);
    h.learning_rate = j.value("learning_rate", h.learning_rate);
    h.method = j.value("method", h.method);
    h.lora_r = j.value("lora_r", h.lora_r);
    h.lora_alpha = j.value("lora_alpha", h.lora_alpha);
    h.lora_dropout = j.value("lora_dropout", h.lora_dropout);
    h.gradient_accumulation_steps =
        j.value("gradient_accumulation_steps", h.gradient_accumulation_steps);
    h.use_rslora = j.value("use_rslora", h.use_rslora);
    h.target_modules = j.value("target_modules", h.target_modules);
    h.max_seq_len = j.value("max_seq_len", h.max_seq_len);
    h.lr_scheduler = j.value("lr_scheduler", h.lr_scheduler);
    h.warmup_steps = j.value("warmup_steps", h.warmup_steps);
    return h;
  }
};

// Reads the hyper-parameters object `h` (at `where`) into `out`; "auto" and absent keys get
// the documented defaults for `examples` training examples and a context of `context`.
Status ParseHyper(const json& h, const std::string& where, int64_t examples, int64_t context,
                  Hyper* out) {
  if (!h.is_null() && !h.is_object()) {
    return Bad(where, StrCat("`", where, "` must be an object, got ", h.dump()));
  }
  std::optional<int64_t> n_epochs, batch_size;
  std::optional<double> multiplier, lr;
  std::optional<int64_t> max_seq_len;
  if (h.is_object()) {
    for (const auto& [key, v] : h.items()) {
      const std::string path = where + "." + key;
      if (key == "n_epochs") {
        KILN_ASSIGN_OR_RETURN(n_epochs, AutoInt(v, path, 1, kMaxEpochs));
      } else if (key == "batch_size") {
        KILN_ASSIGN_OR_RETURN(batch_size, AutoInt(v, path, 1, kMaxBatchSize));
      } else if (key == "learning_rate_multiplier") {
        if (!(v.is_string() && v.get<std::string>() == "auto")) {
          KILN_ASSIGN_OR_RETURN(multiplier, PositiveNumber(v, path, 100));
        }
      } else if (key == "learning_rate") {
        KILN_ASSIGN_OR_RETURN(lr, PositiveNumber(v, path, 1));
      } else if (key == "method") {
        if (!v.is_string() || (v != "lora" && v != "full")) {
          return Bad(path, StrCat("`", path, "` is ", v.dump(), "; allowed: \"lora\", \"full\""));
        }
        out->method = v.get<std::string>();
      } else if (key == "lora_r") {
        KILN_ASSIGN_OR_RETURN(std::optional<int64_t> r, AutoInt(v, path, 1, 256));
        if (r) out->lora_r = *r;
      } else if (key == "lora_alpha") {
        KILN_ASSIGN_OR_RETURN(out->lora_alpha, PositiveNumber(v, path, 1e6));
      } else if (key == "lora_dropout") {
        if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() < 1)) {
          return Bad(path, StrCat("`", path, "` is ", v.dump(), "; allowed: 0 <= p < 1"));
        }
        out->lora_dropout = v.get<double>();
      } else if (key == "gradient_accumulation_steps") {
        KILN_ASSIGN_OR_RETURN(std::optional<int64_t> n, AutoInt(v, path, 1, 64));
        if (n) out->gradient_accumulation_steps = *n;
      } else if (key == "use_rslora") {
        if (!v.is_boolean()) return Bad(path, StrCat("`", path, "` must be true or false"));
        out->use_rslora = v.get<bool>();
      } else if (key == "target_modules") {
        std::vector<std::string> t;
        if (v.is_string()) {
          t.push_back(v.get<std::string>());
        } else if (v.is_array() && !v.empty()) {
          for (const json& e : v) {
            if (!e.is_string()) return Bad(path, StrCat("`", path, "` must list strings"));
            t.push_back(e.get<std::string>());
          }
        } else {
          return Bad(path, StrCat("`", path, "` must be \"all-linear\" or a list of module names"));
        }
        out->target_modules = std::move(t);
      } else if (key == "max_seq_len") {
        KILN_ASSIGN_OR_RETURN(max_seq_len, AutoInt(v, path, 16, std::max<int64_t>(16, context)));
      } else if (key == "lr_scheduler") {
        if (!v.is_string() || (v != "linear" && v != "cosine" && v != "constant")) {
          return Bad(path, StrCat("`", path, "` is ", v.dump(),
                                  "; allowed: \"linear\", \"cosine\", \"constant\""));
        }
        out->lr_scheduler = v.get<std::string>();
      } else if (key == "warmup_steps") {
        KILN_ASSIGN_OR_RETURN(std::optional<int64_t> w, AutoInt(v, path, 0, 1 << 20));
        if (w) out->warmup_steps = *w;
      } else {
        return Bad(path, StrCat("unknown hyper-parameter `", key,
                                "`; allowed: n_epochs, batch_size, learning_rate_multiplier, "
                                "learning_rate, method, lora_r, lora_alpha, lora_dropout, "
                                "use_rslora, target_modules, max_seq_len, lr_scheduler, "
                                "warmup_steps, gradient_accumulation_steps"));
      }
    }
  }
  // "auto": about 100 passes over a small set, 3 epochs from 34 examples up; one packed row
  // per step below 256 examples, more for larger sets (a CPU step costs a row's tokens).
  out->n_epochs =
      n_epochs ? *n_epochs
               : std::clamp<int64_t>((100 + examples - 1) / std::max<int64_t>(examples, 1), 3, 25);
  out->batch_size = batch_size ? *batch_size : std::clamp<int64_t>(examples / 256, 1, 8);
  out->learning_rate_multiplier = multiplier.value_or(1.0);
  const double base_lr = out->method == "full" ? kFullLearningRate : kLoraLearningRate;
  out->learning_rate = lr ? *lr : base_lr * out->learning_rate_multiplier;
  out->max_seq_len = max_seq_len ? *max_seq_len : std::min(kDefaultMaxSeqLen, context);
  models::LoraConfig lc;
  lc.r = out->lora_r;
  lc.alpha = out->lora_alpha;
  lc.dropout = out->lora_dropout;
  lc.target_modules = out->target_modules;
  if (Status s = lc.Validate(); !s.ok()) return WithParam(s, where + ".target_modules");
  return OkStatus();
}

}  // namespace

struct FineTuningService::Impl {
  config::FineTuningConfig ft;
  std::string root;  // <storage_dir>/finetune
  std::unique_ptr<JobStore> store;
  ModelRepository* repository = nullptr;
  metrics::Registry* registry = nullptr;
  metrics::Family<metrics::Gauge>* jobs_gauge = nullptr;
  metrics::Counter* yield_seconds = nullptr;

  // What a running job's report callback checks after each step.
  struct Control {
    std::atomic<bool> cancel{false}, pause{false};
  };

  mutable absl::Mutex mu;
  // Status transitions are read-modify-write of a job row: all of them hold `mu`.
  std::map<std::string, std::shared_ptr<Control>> running ABSL_GUARDED_BY(mu);
  // Queued jobs whose base model was not ready when they were taken: not taken again before.
  std::map<std::string, Clock::time_point> not_before ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  uint64_t version ABSL_GUARDED_BY(mu) = 0;  // bumped by every event and status change
  std::vector<std::thread> threads;

  std::string FilesDir() const { return root + "/files"; }
  std::string JobDir(std::string_view id) const { return StrCat(root, "/jobs/", id); }

  void Bump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { ++version; }

  // Adds an event; logs (never fails the caller) when the store cannot take it.
  void Event(const std::string& job, std::string level, std::string message, json data = nullptr) {
    absl::MutexLock l(&mu);
    EventLocked(job, std::move(level), std::move(message), std::move(data));
  }
  // The same with `mu` held: status changes write their event first, in the same critical
  // section, so whoever sees the new status (a poller, WatchJob) finds its event there.
  void EventLocked(const std::string& job, std::string level, std::string message,
                   json data = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    EventRecord e;
    e.job_id = job;
    e.level = std::move(level);
    e.type = data.is_null() ? "message" : "metrics";
    e.message = std::move(message);
    e.data = std::move(data);
    if (StatusOr<EventRecord> r = store->AddEvent(std::move(e)); !r.ok()) {
      spdlog::error("fine-tuning job {}: cannot record an event: {}", job, r.status().ToString());
    }
    Bump();
  }

  // Writes the job; logs on failure (the row keeps its old value: nothing half-written).
  void Save(const JobRecord& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (Status s = store->UpdateJob(job); !s.ok()) {
      spdlog::error("fine-tuning job {}: cannot update the store: {}", job.id, s.ToString());
    }
    Bump();
  }

  void RefreshGauges() {
    if (jobs_gauge == nullptr) return;
    StatusOr<std::map<JobStatus, int64_t>> counts = store->CountJobsByStatus();
    if (!counts.ok()) return;
    for (JobStatus s :
         {JobStatus::kValidatingFiles, JobStatus::kQueued, JobStatus::kRunning, JobStatus::kPaused,
          JobStatus::kSucceeded, JobStatus::kFailed, JobStatus::kCancelled}) {
      auto it = counts->find(s);
      jobs_gauge->WithLabels({JobStatusName(s)})
          ->Set(it == counts->end() ? 0.0 : static_cast<double>(it->second));
    }
  }

  // Sets the status (and finished_at for terminal ones) of job `id` under `mu`, after its
  // event: whoever sees the new status (a poller, WatchJob) finds the event already there.
  // Nothing happens unless the job is still `from` (a cancel may have ended it meanwhile).
  void Transition(const std::string& id, JobStatus from, JobStatus to, std::string message,
                  std::string level = "info", json error = nullptr) {
    {
      absl::MutexLock l(&mu);
      StatusOr<JobRecord> job = store->GetJob(id);
      if (!job.ok() || job->status != from) return;
      EventLocked(id, std::move(level), std::move(message));
      job->status = to;
      if (IsTerminal(to)) job->finished_at = UnixNow();
      if (!error.is_null()) job->error = std::move(error);
      Save(*job);
    }
    RefreshGauges();
  }

  bool Stopping() const {
    absl::MutexLock l(&mu);
    return stopping;
  }

  StatusOr<std::shared_ptr<Model>> BaseModel(const std::string& name,
                                             std::string_view param) const {
    StatusOr<std::shared_ptr<Model>> m = repository->GetReady(name);
    if (!m.ok()) {
      if (m.status().code() == absl::StatusCode::kNotFound) {
        return WithParam(NotFound("unknown base model '", name,
                                  "'; GET /v1/models lists the models this server serves"),
                         param);
      }
      return WithParam(m.status(), param);
    }
    if (!(*m)->is_llm()) {
      return WithParam(
          InvalidArgument("model '", name, "' cannot be fine-tuned: it is a ", (*m)->config().kind,
                          " tensor model; only generative models (kind: llm) can"),
          param);
    }
    return m;
  }

  // ---- the validator: validating_files -> queued | failed ----
  void ValidateJob(const JobRecord& job) {
    auto fail = [&](const Status& s, std::string_view param) {
      Transition(job.id, JobStatus::kValidatingFiles, JobStatus::kFailed,
                 StrCat("Validation failed: ", s.message()), "error",
                 json{{"code", param == "validation_file" ? "invalid_validation_file"
                                                          : "invalid_training_file"},
                      {"message", std::string(s.message())},
                      {"param", param}});
    };
    StatusOr<std::shared_ptr<Model>> model = BaseModel(job.model, "model");
    // Not READY for a moment (loading, reloading): validated on a later pass instead.
    if (!model.ok() && model.status().code() == absl::StatusCode::kUnavailable) return;
    if (!model.ok()) return fail(model.status(), "model");
    const models::LlmModel& llm = (*model)->llm()->model();
    const Hyper h = Hyper::FromJson(job.hyperparameters);
    for (const auto& [param, id] :
         {std::pair<std::string_view, std::string>{"training_file", job.training_file},
          {"validation_file", job.validation_file}}) {
      if (id.empty()) continue;
      StatusOr<FileRecord> f = store->GetFile(id);
      if (!f.ok()) return fail(f.status(), param);
      StatusOr<std::string> text = models::ReadWholeFile(f->path);
      if (!text.ok()) return fail(text.status(), param);
      // Messages name the file as its owner knows it (its id and upload name), not our path.
      std::vector<std::string> warnings;
      StatusOr<std::vector<models::train::Example>> ex = models::train::TokenizeJsonl(
          *text, StrCat(f->id, " (", f->filename, ")"), llm.tokenizer(), llm.chat_template(),
          {.max_seq_len = h.max_seq_len}, &warnings);
      if (!ex.ok()) return fail(ex.status(), param);
      if (!warnings.empty()) {
        Event(job.id, "warn",
              StrCat(warnings.size(), " examples of ", id, " are longer than ", h.max_seq_len,
                     " tokens and will be cut; first: ", warnings[0]));
      }
    }
    {
      absl::MutexLock l(&mu);
      StatusOr<JobRecord> cur = store->GetJob(job.id);
      if (!cur.ok() || cur->status != JobStatus::kValidatingFiles) return;  // cancelled meanwhile
      EventLocked(job.id, "info", "Files validated, moving job to queued state");
      cur->status = cur->pause_requested ? JobStatus::kPaused : JobStatus::kQueued;
      Save(*cur);
    }
    RefreshGauges();
  }

  // ---- the runner ----
  // The oldest queued job nobody runs, marked running; nullopt when there is none.
  std::optional<JobRecord> TakeQueued() {
    StatusOr<std::vector<JobRecord>> q = store->JobsWithStatus({JobStatus::kQueued});
    if (!q.ok() || q->empty()) return std::nullopt;
    absl::MutexLock l(&mu);
    if (stopping) return std::nullopt;
    const auto now = Clock::now();
    for (JobRecord& j : *q) {
      if (running.count(j.id) != 0) continue;
      if (auto wait = not_before.find(j.id); wait != not_before.end() && wait->second > now) {
        continue;
      }
      StatusOr<JobRecord> cur = store->GetJob(j.id);
      if (!cur.ok() || cur->status != JobStatus::kQueued) continue;
      cur->status = JobStatus::kRunning;
      Save(*cur);
      running[cur->id] = std::make_shared<Control>();
      return *std::move(cur);
    }
    return std::nullopt;
  }

  // Blocks until something changed since `seen` (a new job, a resume, a status change) or
  // `timeout` passed; the timeout covers a wake-up missed between a read and the wait.
  void AwaitChange(uint64_t seen, absl::Duration timeout) {
    absl::MutexLock l(&mu);
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return version != seen || stopping; };
    mu.AwaitWithTimeout(absl::Condition(&changed), timeout);
  }
  uint64_t Version() const {
    absl::MutexLock l(&mu);
    return version;
  }

  // One thread: jobs in validating_files, oldest first (validation never waits for training).
  void ValidatorLoop() {
    while (!Stopping()) {
      const uint64_t seen = Version();
      StatusOr<std::vector<JobRecord>> v = store->JobsWithStatus({JobStatus::kValidatingFiles});
      if (v.ok()) {
        for (const JobRecord& j : *v) {
          if (Stopping()) return;
          ValidateJob(j);
        }
      }
      AwaitChange(seen, absl::Seconds(5));
    }
  }

  // fine_tuning.max_concurrent_jobs threads: queued jobs, oldest first.
  void RunnerLoop() {
    while (!Stopping()) {
      const uint64_t seen = Version();
      if (std::optional<JobRecord> job = TakeQueued()) {
        RefreshGauges();
        RunJob(*job);
        continue;
      }
      AwaitChange(seen, absl::Seconds(5));
    }
  }

  std::string ModelName(const JobRecord& job) const {
    return StrCat("ft:", job.model, ":", job.suffix, ":", job.id);
  }

  // Serves the adapter in `dir` as `name` on the job's base model; an event says why not.
  bool Serve(const JobRecord& job, const std::string& name, const std::string& dir) {
    Status s = repository->AddLoraAdapter(name, job.model, dir);
    if (s.ok() || s.code() == absl::StatusCode::kAlreadyExists) return true;
    Event(job.id, "warn", StrCat("'", name, "' is not served: ", s.message()));
    return false;
  }

  void RunJob(JobRecord job) {
    std::shared_ptr<Control> control;
    {
      absl::MutexLock l(&mu);
      control = running[job.id];
    }
    const Hyper h = Hyper::FromJson(job.hyperparameters);
    models::FinetuneOptions o;
    StatusOr<std::shared_ptr<Model>> model = BaseModel(job.model, "model");
    if (!model.ok() && model.status().code() == absl::StatusCode::kUnavailable) {
      // Known but not READY (loading, unloading, reloading): the job waits queued and is
      // tried again in a while, rather than failing for a moment's state.
      bool first = false;
      {
        absl::MutexLock l(&mu);
        running.erase(job.id);
        first = not_before.count(job.id) == 0;
        not_before[job.id] = Clock::now() + kNotReadyRetry;
        StatusOr<JobRecord> cur = store->GetJob(job.id);
        if (cur.ok() && cur->status == JobStatus::kRunning) {
          // The status first: a client that sees the warning then sees the job queued.
          cur->status = cur->cancel_requested  ? JobStatus::kCancelled
                        : cur->pause_requested ? JobStatus::kPaused
                                               : JobStatus::kQueued;
          if (cur->status == JobStatus::kCancelled) cur->finished_at = UnixNow();
          Save(*cur);
          if (first) {
            EventLocked(job.id, "warn",
                        StrCat("The base model is not ready (", model.status().message(),
                               "); the job waits queued and is retried every ",
                               kNotReadyRetry.count(), " s"));
          }
        }
      }
      RefreshGauges();
      return;
    }
    {
      absl::MutexLock l(&mu);
      not_before.erase(job.id);
    }
    StatusOr<FileRecord> train = store->GetFile(job.training_file);
    Status setup = !model.ok() ? model.status() : train.status();
    if (setup.ok()) {
      o.model = (*model)->config().path;
      o.train = train->path;
      if (!job.validation_file.empty()) {
        StatusOr<FileRecord> valid = store->GetFile(job.validation_file);
        if (valid.ok())
          o.valid = valid->path;
        else
          setup = valid.status();
      }
    }
    model = std::shared_ptr<Model>();  // the run opens the weights itself
    o.out = JobDir(job.id);
    o.method = h.method;
    o.lora.r = h.lora_r;
    o.lora.alpha = h.lora_alpha;
    o.lora.use_rslora = h.use_rslora;
    o.lora.dropout = h.lora_dropout;
    o.grad_accum = h.gradient_accumulation_steps;
    o.lora.target_modules = h.target_modules;
    o.lr = h.learning_rate;
    o.schedule = h.lr_scheduler;
    o.warmup_steps = h.warmup_steps;
    o.epochs = h.n_epochs;
    o.batch_size = h.batch_size;
    o.seq_len = h.max_seq_len;
    o.seed = static_cast<uint64_t>(job.seed);
    o.save_steps = ft.checkpoint_every_steps;
    o.save_seconds = ft.checkpoint_every_seconds;
    o.keep_checkpoints = ft.keep_checkpoints;
    o.threads = ft.threads;
    o.backend = ft.backend;
    o.metrics = registry;
    if (setup.ok()) {
      StatusOr<models::FoundCheckpoint> found = models::FindLatestCheckpoint(o.out);
      if (found.ok() && !found->dir.empty()) o.resume = o.out;
      job.output_dir = o.out;
      absl::MutexLock l(&mu);
      if (StatusOr<JobRecord> cur = store->GetJob(job.id); cur.ok()) {
        cur->output_dir = o.out;
        Save(*cur);
      }
    }
    if (o.resume.empty()) Event(job.id, "info", "Fine-tuning job started");

    double last_loss = 0, last_valid = -1;
    auto report = [&](const models::FinetuneProgress& p) -> bool {
      if (!p.checkpoint_dir.empty()) {
        CheckpointRecord c;
        c.job_id = job.id;
        c.step_number = p.checkpoint_step;
        c.metrics = {{"step", p.checkpoint_step}, {"train_loss", last_loss}};
        if (last_valid >= 0) c.metrics["valid_loss"] = last_valid;
        c.fine_tuned_model_checkpoint = StrCat(ModelName(job), ":ckpt-step-", p.checkpoint_step);
        c.path = p.checkpoint_dir;
        if (StatusOr<CheckpointRecord> r = store->AddCheckpoint(std::move(c)); !r.ok()) {
          spdlog::error("fine-tuning job {}: cannot record a checkpoint: {}", job.id,
                        r.status().ToString());
        }
        Event(job.id, "info", StrCat("Checkpoint created at step ", p.checkpoint_step));
        return true;
      }
      if (p.resumed_step > 0) {
        Event(job.id, "info", StrCat("Resumed from the checkpoint at step ", p.resumed_step));
        return true;
      }
      if (!p.message.empty()) {
        const bool warn = p.message.rfind("warning", 0) == 0;
        Event(job.id, warn ? "warn" : "info", p.message);
        return true;
      }
      last_loss = p.loss;
      if (p.valid_loss >= 0) last_valid = p.valid_loss;
      json data = {{"step", p.step},
                   {"total_steps", p.total_steps},
                   {"train_loss", p.loss},
                   {"learning_rate", p.lr},
                   {"tokens_per_second", p.tokens_per_second}};
      std::string msg = StrCat("Step ", p.step, "/", p.total_steps, ": training loss=", p.loss);
      if (p.valid_loss >= 0) {
        data["valid_loss"] = p.valid_loss;
        msg += StrCat(", validation loss=", p.valid_loss);
      }
      Event(job.id, "info", std::move(msg), std::move(data));
      {
        absl::MutexLock l(&mu);
        if (StatusOr<JobRecord> cur = store->GetJob(job.id); cur.ok()) {
          cur->last_step = p.step;
          cur->total_steps = p.total_steps;
          cur->trained_tokens += std::llround(p.tokens_per_second * p.step_seconds);
          cur->estimated_finish =
              UnixNow() +
              std::llround(p.step_seconds * static_cast<double>(p.total_steps - p.step));
          Save(*cur);
        }
      }
      if (control->cancel || control->pause || Stopping()) return false;
      if (ft.yield_to_serving) Yield(job, *control);
      return !(control->cancel || control->pause || Stopping());
    };

    StatusOr<models::FinetuneSummary> summary =
        setup.ok() ? models::RunFinetune(o, report) : StatusOr<models::FinetuneSummary>(setup);
    Finish(job, summary, *control);
  }

  // Ends a run: the job's status from how RunFinetune returned and what was asked meanwhile.
  // The job leaves `running` (the map) in the same critical section that writes its status,
  // so a cancel or pause either reached the run (its flags) or sees the final status — never
  // a gap in which its answer is overwritten.
  void Finish(const JobRecord& job, const StatusOr<models::FinetuneSummary>& summary,
              const Control& control) {
    const bool completed = summary.ok() && !summary->stopped;
    const std::string name = ModelName(job);
    // Serving reads the adapter from disk: before taking `mu`. Undone below if a cancel won.
    const bool served = completed && !control.cancel && ServeResult(job, name);
    bool unserve = false;
    {
      absl::MutexLock l(&mu);
      running.erase(job.id);
      StatusOr<JobRecord> cur = store->GetJob(job.id);
      if (!cur.ok()) return;
      if (cur->cancel_requested) {
        EventLocked(job.id, "info", "Job cancelled");
        cur->status = JobStatus::kCancelled;
        cur->finished_at = UnixNow();
        unserve = served;
      } else if (!summary.ok()) {
        if (stopping) return;  // stays running: the next start retries it from its checkpoint
        const std::string message(summary.status().message());
        EventLocked(job.id, "error", "Job failed: " + message);
        cur->status = JobStatus::kFailed;
        cur->finished_at = UnixNow();
        cur->error = {{"code", "training_failed"}, {"message", message}, {"param", nullptr}};
      } else if (summary->stopped) {
        if (cur->pause_requested) {
          EventLocked(job.id, "info", StrCat("Job paused after step ", cur->last_step));
          cur->status = JobStatus::kPaused;
        } else if (stopping) {
          return;  // stays running with its checkpoint: the next start resumes it
        } else {
          cur->status = JobStatus::kQueued;  // resumed while its pause was being checkpointed
        }
      } else {
        EventLocked(job.id, "info",
                    StrCat("New fine-tuned model created: ", name, served ? "" : " (not served)"));
        EventLocked(job.id, "info", "The job has successfully completed");
        cur->fine_tuned_model = name;
        cur->status = JobStatus::kSucceeded;
        cur->finished_at = UnixNow();
        cur->estimated_finish = 0;
      }
      Save(*cur);
    }
    if (unserve) (void)repository->RemoveLoraAdapter(name);
    RefreshGauges();
  }

  // Serves a succeeded job's result: a LoRA adapter (and its checkpoints) on the base model,
  // or a fully fine-tuned model as a model of its own. An event says why not, if not.
  bool ServeResult(const JobRecord& job, const std::string& name) {
    if (Hyper::FromJson(job.hyperparameters).method == "lora") {
      const bool served = Serve(job, name, job.output_dir);
      ServeCheckpoints(job);
      return served;
    }
    config::ModelConfig mc;
    if (StatusOr<std::shared_ptr<Model>> base = repository->GetReady(job.model); base.ok()) {
      mc = (*base)->config();
    }
    mc.name = name;
    mc.path = job.output_dir;
    mc.kind = "llm";
    mc.adapters.clear();  // the base's adapters stay the base's
    mc.location = {};
    Status s = repository->Load(name, mc);
    if (!s.ok()) Event(job.id, "warn", StrCat("'", name, "' is not served: ", s.message()));
    return s.ok();
  }

  void ServeCheckpoints(const JobRecord& job) {
    StatusOr<Page<CheckpointRecord>> cks = store->ListCheckpoints(job.id, "", 100);
    if (!cks.ok()) return;
    for (const CheckpointRecord& c : cks->data) {
      std::error_code ec;
      if (fs::is_directory(c.path, ec)) Serve(job, c.fine_tuned_model_checkpoint, c.path);
    }
  }

  // Waits while the base model has generation requests queued or running, at most
  // max_yield_seconds (a job must still progress under steady load).
  void Yield(const JobRecord& job, const Control& control) {
    const auto start = Clock::now();
    const auto limit = std::chrono::duration<double>(ft.max_yield_seconds);
    for (;;) {
      if (Clock::now() - start >= limit) break;
      StatusOr<std::shared_ptr<Model>> m = repository->GetReady(job.model);
      if (!m.ok() || (*m)->pending() == 0) break;
      if (control.cancel || control.pause || Stopping()) break;
      // The batcher drains within a few steps; polling keeps this independent of its internals.
      absl::MutexLock l(&mu);
      auto stop = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return stopping; };
      mu.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(20));
    }
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (yield_seconds != nullptr && s > 0) yield_seconds->Increment(s);
  }

  // At start: adapters of succeeded jobs served again; jobs a dead daemon left running queued
  // again (their checkpoints make RunFinetune resume).
  void Recover() {
    StatusOr<std::vector<JobRecord>> done = store->JobsWithStatus({JobStatus::kSucceeded});
    if (done.ok()) {
      for (const JobRecord& j : *done) {
        if (!j.fine_tuned_model.empty()) ServeResult(j, j.fine_tuned_model);
      }
    }
    StatusOr<std::vector<JobRecord>> interrupted = store->JobsWithStatus({JobStatus::kRunning});
    if (interrupted.ok()) {
      for (const JobRecord& j : *interrupted) {
        {
          absl::MutexLock l(&mu);
          StatusOr<JobRecord> cur = store->GetJob(j.id);
          if (!cur.ok()) continue;
          cur->status = cur->cancel_requested  ? JobStatus::kCancelled
                        : cur->pause_requested ? JobStatus::kPaused
                                               : JobStatus::kQueued;
          if (cur->status == JobStatus::kCancelled) cur->finished_at = UnixNow();
          EventLocked(j.id, "info",
                      StrCat("The server restarted while the job ran (last step ", j.last_step,
                             cur->status == JobStatus::kQueued
                                 ? "); it continues from its newest checkpoint"
                                 : StrCat("); it is ", JobStatusName(cur->status))));
          Save(*cur);
        }
      }
    }
    RefreshGauges();
  }
};

FineTuningService::FineTuningService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

FineTuningService::~FineTuningService() { Stop(); }

StatusOr<std::unique_ptr<FineTuningService>> FineTuningService::Create(const config::Config& config,
                                                                       ModelRepository* repository,
                                                                       metrics::Registry* metrics) {
  auto impl = std::make_unique<Impl>();
  impl->ft = config.fine_tuning;
  impl->root = config.server.storage_dir + "/finetune";
  impl->repository = repository;
  impl->registry = metrics;
  std::error_code ec;
  fs::create_directories(impl->root + "/files", ec);
  if (ec) return Unavailable("cannot create ", impl->root, "/files: ", ec.message());
  fs::create_directories(impl->root + "/jobs", ec);
  if (ec) return Unavailable("cannot create ", impl->root, "/jobs: ", ec.message());
  KILN_ASSIGN_OR_RETURN(impl->store, JobStore::Open(impl->root + "/jobs.db"));
  models::RegisterTrainMetrics(metrics);  // on /metrics before the first job
  if (metrics != nullptr) {
    impl->jobs_gauge = &metrics->AddGauge("kiln_finetune_jobs",
                                          "Fine-tuning jobs in the store, by status.", {"status"});
    impl->yield_seconds =
        metrics
            ->AddCounter("kiln_finetune_yield_seconds_total",
                         "Seconds fine-tuning jobs waited between steps for serving "
                         "(fine_tuning.yield_to_serving).")
            .WithLabels({});
  }
  return std::unique_ptr<FineTuningService>(new FineTuningService(std::move(impl)));
}

Status FineTuningService::Start() {
  impl_->Recover();
  impl_->threads.emplace_back([this] { impl_->ValidatorLoop(); });
  for (int i = 0; i < impl_->ft.max_concurrent_jobs; ++i) {
    impl_->threads.emplace_back([this] { impl_->RunnerLoop(); });
  }
  return OkStatus();
}

void FineTuningService::Stop() {
  {
    absl::MutexLock l(&impl_->mu);
    impl_->stopping = true;
    impl_->Bump();
  }
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
}

// ---- files ----

StatusOr<FileRecord> FineTuningService::UploadFile(std::string_view filename,
                                                   std::string_view purpose,
                                                   std::string_view content) {
  if (purpose != kPurpose) {
    return WithParam(InvalidArgument("`purpose` is \"", ValidUtf8(purpose),
                                     "\"; this server takes files for \"fine-tune\" only"),
                     "purpose");
  }
  if (static_cast<int64_t>(content.size()) > impl_->ft.max_file_bytes) {
    return WithParam(ResourceExhausted("the file is ", content.size(), " bytes; the limit is ",
                                       impl_->ft.max_file_bytes, " (fine_tuning.max_file_bytes)"),
                     "file");
  }
  std::string name(filename.empty() ? "upload.jsonl" : filename);
  name = ValidUtf8(name);
  if (name.size() > 256) name.resize(256);
  KILN_RETURN_IF_ERROR(CheckFineTuneJsonl(content, name));
  FileRecord f;
  f.id = NewId("file-");
  f.bytes = static_cast<int64_t>(content.size());
  f.created_at = UnixNow();
  f.filename = name;
  f.purpose = std::string(purpose);
  f.sha256 = Sha256Hex(content);
  f.path = StrCat(impl_->FilesDir(), "/", f.id, ".jsonl");
  // Contents first (durably), then the row: a crash between them leaves an orphan file,
  // never a row without contents.
  // Any failure (a full disk) removes what was written: no partial file is left behind.
  Status s = models::WriteFileDurably(f.path, content);
  if (s.ok()) s = models::FsyncDirectory(impl_->FilesDir());
  if (s.ok()) s = impl_->store->InsertFile(f);
  if (!s.ok()) {
    std::error_code ec;
    fs::remove(f.path, ec);
    return s;
  }
  return f;
}

StatusOr<FileRecord> FineTuningService::GetFile(std::string_view id) const {
  return impl_->store->GetFile(id);
}

StatusOr<std::string> FineTuningService::FileContent(std::string_view id) const {
  KILN_ASSIGN_OR_RETURN(FileRecord f, impl_->store->GetFile(id));
  return models::ReadWholeFile(f.path);
}

StatusOr<Page<FileRecord>> FineTuningService::ListFiles(std::string_view purpose,
                                                        std::string_view after, int limit) const {
  return impl_->store->ListFiles(purpose, after, limit);
}

Status FineTuningService::DeleteFile(std::string_view id) {
  KILN_ASSIGN_OR_RETURN(FileRecord f, impl_->store->GetFile(id));
  KILN_RETURN_IF_ERROR(impl_->store->DeleteFile(id));
  std::error_code ec;
  fs::remove(f.path, ec);
  return OkStatus();
}

// ---- jobs ----

StatusOr<JobRecord> FineTuningService::CreateJob(const json& r) {
  if (!r.is_object()) return InvalidArgument("the request body must be a JSON object");
  static const std::vector<std::string_view> kKeys = {
      "model",  "training_file", "validation_file", "hyperparameters", "method",
      "suffix", "seed",          "metadata",        "integrations"};
  for (const auto& [key, v] : r.items()) {
    if (std::find(kKeys.begin(), kKeys.end(), key) == kKeys.end()) {
      return Bad(key, StrCat("unknown field `", key, "`"));
    }
  }
  auto str = [&](std::string_view key, bool required) -> StatusOr<std::string> {
    auto it = r.find(key);
    if (it == r.end() || it->is_null()) {
      if (required) return Bad(key, StrCat("`", key, "` is required"));
      return std::string();
    }
    if (!it->is_string()) return Bad(key, StrCat("`", key, "` must be a string"));
    return it->get<std::string>();
  };
  JobRecord job;
  KILN_ASSIGN_OR_RETURN(job.model, str("model", true));
  KILN_ASSIGN_OR_RETURN(job.training_file, str("training_file", true));
  KILN_ASSIGN_OR_RETURN(job.validation_file, str("validation_file", false));
  KILN_ASSIGN_OR_RETURN(job.suffix, str("suffix", false));
  if (job.suffix.size() > kMaxSuffixLength) {
    return Bad("suffix", StrCat("`suffix` is ", job.suffix.size(), " characters; at most ",
                                kMaxSuffixLength, " are allowed"));
  }
  if (!std::all_of(job.suffix.begin(), job.suffix.end(), ValidSuffixChar)) {
    return Bad("suffix", "`suffix` may contain only letters, digits, '-', '_' and '.'");
  }
  if (auto it = r.find("integrations");
      it != r.end() && !it->is_null() && !(it->is_array() && it->empty())) {
    return Bad("integrations", "`integrations` are not supported by this server");
  }
  if (auto it = r.find("seed"); it != r.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 2147483647) {
      return Bad("seed", StrCat("`seed` must be an integer in [0, 2147483647], got ", it->dump()));
    }
    job.seed = it->get<int64_t>();
  } else {
    job.seed = static_cast<int64_t>(std::random_device{}() & 0x7fffffff);
  }
  if (auto it = r.find("metadata"); it != r.end() && !it->is_null()) {
    if (!it->is_object() || it->size() > kMaxMetadataKeys) {
      return Bad("metadata", StrCat("`metadata` must be an object of at most ", kMaxMetadataKeys,
                                    " string values"));
    }
    for (const auto& [k, v] : it->items()) {
      if (k.size() > kMaxMetadataKeyLength || !v.is_string() ||
          v.get<std::string>().size() > kMaxMetadataValueLength) {
        return Bad("metadata." + k,
                   StrCat("metadata keys are at most ", kMaxMetadataKeyLength,
                          " characters and values strings of at most ", kMaxMetadataValueLength));
      }
    }
    job.metadata = *it;
  }

  StatusOr<std::shared_ptr<Model>> model = impl_->BaseModel(job.model, "model");
  if (!model.ok()) return model.status();
  const int64_t context = (*model)->llm()->model().info().context_length;
  // What the result can be served with (a LoRA job's adapter goes into the base's slots).
  const bool serves_adapters = (*model)->llm()->model().max_adapters() > 0;
  const int64_t max_lora_rank = (*model)->config().max_lora_rank;
  model = std::shared_ptr<Model>();

  StatusOr<FileRecord> train = impl_->store->GetFile(job.training_file);
  if (!train.ok()) return WithParam(train.status(), "training_file");
  if (train->purpose != kPurpose) {
    return Bad("training_file", StrCat("file ", train->id, " has purpose \"", train->purpose,
                                       "\", not \"fine-tune\""));
  }
  if (!job.validation_file.empty()) {
    StatusOr<FileRecord> valid = impl_->store->GetFile(job.validation_file);
    if (!valid.ok()) return WithParam(valid.status(), "validation_file");
  }
  KILN_ASSIGN_OR_RETURN(std::string text, models::ReadWholeFile(train->path));
  const int64_t examples = CountExamples(text);

  // method.supervised.hyperparameters, or the legacy top-level hyperparameters.
  json hyper;
  std::string where = "hyperparameters";
  auto method = r.find("method");
  if (method != r.end() && !method->is_null()) {
    if (!method->is_object()) return Bad("method", "`method` must be an object");
    const json type = method->value("type", json("supervised"));
    if (type != "supervised") {
      return Bad("method.type", StrCat("`method.type` is ", type.dump(),
                                       "; this server supports \"supervised\" only"));
    }
    if (auto s = method->find("supervised"); s != method->end() && !s->is_null()) {
      if (!s->is_object()) return Bad("method.supervised", "`method.supervised` must be an object");
      hyper = s->value("hyperparameters", json());
      where = "method.supervised.hyperparameters";
    }
    if (auto legacy = r.find("hyperparameters");
        legacy != r.end() && !legacy->is_null() && !hyper.is_null()) {
      return Bad("hyperparameters",
                 "give the hyper-parameters in method.supervised.hyperparameters or at the top "
                 "level (deprecated), not both");
    }
  }
  if (hyper.is_null()) {
    if (auto legacy = r.find("hyperparameters"); legacy != r.end()) {
      hyper = *legacy;
      where = "hyperparameters";
    }
  }
  Hyper h;
  KILN_RETURN_IF_ERROR(ParseHyper(hyper, where, examples, context, &h));
  if (h.method == "lora" && !serves_adapters) {
    return Bad("model", StrCat("model '", job.model,
                               "' serves no LoRA adapters (its "
                               "max_loaded_adapters is 0), so a LoRA job's result could not be "
                               "served; raise it in the model's configuration"));
  }
  if (h.method == "lora" && h.lora_r > max_lora_rank) {
    return Bad(where + ".lora_r", StrCat("`", where, ".lora_r` is ", h.lora_r, " but model '",
                                         job.model, "' serves adapters up to rank ", max_lora_rank,
                                         " (its max_lora_rank); the result could not be served"));
  }
  job.hyperparameters = h.ToJson();
  job.method = {{"type", "supervised"}, {"supervised", {{"hyperparameters", job.hyperparameters}}}};
  job.id = NewId("ftjob-");
  job.created_at = UnixNow();
  job.status = JobStatus::kValidatingFiles;
  job.output_dir = impl_->JobDir(job.id);
  {
    absl::MutexLock l(&impl_->mu);
    KILN_RETURN_IF_ERROR(impl_->store->InsertJob(job));
    impl_->Bump();
  }
  impl_->Event(job.id, "info", StrCat("Created fine-tuning job: ", job.id));
  impl_->Event(job.id, "info", StrCat("Validating training file: ", job.training_file));
  impl_->RefreshGauges();
  return job;
}

StatusOr<JobRecord> FineTuningService::GetJob(std::string_view id) const {
  return impl_->store->GetJob(id);
}

StatusOr<Page<JobRecord>> FineTuningService::ListJobs(
    std::string_view after, int limit, const std::map<std::string, std::string>& metadata) const {
  return impl_->store->ListJobs(after, limit, metadata);
}

StatusOr<JobRecord> FineTuningService::CancelJob(std::string_view id) {
  {
    absl::MutexLock l(&impl_->mu);
    KILN_ASSIGN_OR_RETURN(JobRecord job, impl_->store->GetJob(id));
    if (IsTerminal(job.status)) {
      return FailedPrecondition("cannot cancel fine-tuning job ", job.id, ": it already ",
                                JobStatusName(job.status));
    }
    job.cancel_requested = true;
    auto run = impl_->running.find(job.id);
    if (run != impl_->running.end()) {
      run->second->cancel = true;  // the runner ends it after the step and marks it cancelled
      impl_->Save(job);
      return job;
    }
    job.status = JobStatus::kCancelled;
    job.finished_at = UnixNow();
    impl_->EventLocked(job.id, "info", "Job cancelled");
    impl_->Save(job);
  }
  impl_->RefreshGauges();
  return impl_->store->GetJob(id);
}

StatusOr<JobRecord> FineTuningService::PauseJob(std::string_view id) {
  {
    absl::MutexLock l(&impl_->mu);
    KILN_ASSIGN_OR_RETURN(JobRecord job, impl_->store->GetJob(id));
    if (job.status != JobStatus::kQueued && job.status != JobStatus::kRunning &&
        job.status != JobStatus::kValidatingFiles) {
      return FailedPrecondition("cannot pause fine-tuning job ", job.id, ": it is ",
                                JobStatusName(job.status),
                                " (only validating, queued or running jobs pause)");
    }
    job.pause_requested = true;
    auto run = impl_->running.find(job.id);
    if (run != impl_->running.end()) {
      run->second->pause = true;  // the runner checkpoints after the step and marks it paused
      impl_->Save(job);
      return job;
    }
    if (job.status == JobStatus::kQueued) job.status = JobStatus::kPaused;
    impl_->EventLocked(job.id, "info", "Job paused");
    impl_->Save(job);
  }
  impl_->RefreshGauges();
  return impl_->store->GetJob(id);
}

StatusOr<JobRecord> FineTuningService::ResumeJob(std::string_view id) {
  {
    absl::MutexLock l(&impl_->mu);
    KILN_ASSIGN_OR_RETURN(JobRecord job, impl_->store->GetJob(id));
    const bool pausing = job.pause_requested && !IsTerminal(job.status);
    if (job.status != JobStatus::kPaused && !pausing) {
      return FailedPrecondition("cannot resume fine-tuning job ", job.id, ": it is ",
                                JobStatusName(job.status), ", not paused");
    }
    job.pause_requested = false;
    if (auto run = impl_->running.find(job.id); run != impl_->running.end()) {
      run->second->pause = false;
    }
    if (job.status == JobStatus::kPaused) job.status = JobStatus::kQueued;
    impl_->EventLocked(job.id, "info", "Job resumed");
    impl_->Save(job);
  }
  impl_->RefreshGauges();
  return impl_->store->GetJob(id);
}

StatusOr<Page<EventRecord>> FineTuningService::ListEvents(std::string_view job_id,
                                                          std::string_view after, int limit) const {
  KILN_RETURN_IF_ERROR(impl_->store->GetJob(job_id).status());
  return impl_->store->ListEvents(job_id, after, limit);
}

StatusOr<Page<CheckpointRecord>> FineTuningService::ListCheckpoints(std::string_view job_id,
                                                                    std::string_view after,
                                                                    int limit) const {
  KILN_RETURN_IF_ERROR(impl_->store->GetJob(job_id).status());
  return impl_->store->ListCheckpoints(job_id, after, limit);
}

StatusOr<std::vector<EventRecord>> FineTuningService::EventsSince(std::string_view job_id,
                                                                  int64_t after_seq) const {
  KILN_RETURN_IF_ERROR(impl_->store->GetJob(job_id).status());
  return impl_->store->EventsSince(job_id, after_seq);
}

bool FineTuningService::WaitForChange(std::string_view job_id, int64_t after_seq,
                                      absl::Duration timeout) const {
  uint64_t seen = 0;
  {
    absl::MutexLock l(&impl_->mu);
    seen = impl_->version;
  }
  StatusOr<std::vector<EventRecord>> now = impl_->store->EventsSince(job_id, after_seq);
  if (now.ok() && !now->empty()) return true;
  absl::MutexLock l(&impl_->mu);
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mu) {
    return impl_->version != seen || impl_->stopping;
  };
  return impl_->mu.AwaitWithTimeout(absl::Condition(&changed), timeout) && !impl_->stopping;
}

// ---- JSON ----

json FineTuningService::FileJson(const FileRecord& f) {
  return {{"id", f.id},
          {"object", "file"},
          {"bytes", f.bytes},
          {"created_at", f.created_at},
          {"filename", f.filename},
          {"purpose", f.purpose},
          {"status", f.status},
          {"status_details", f.status_details.empty() ? json(nullptr) : json(f.status_details)},
          {"sha256", f.sha256}};
}

json FineTuningService::JobJson(const JobRecord& j) {
  const json& h = j.hyperparameters;
  json hyper = {{"n_epochs", h.value("n_epochs", json(nullptr))},
                {"batch_size", h.value("batch_size", json(nullptr))},
                {"learning_rate_multiplier", h.value("learning_rate_multiplier", json(nullptr))}};
  for (const auto& [k, v] : h.items()) hyper[k] = v;  // Kiln's own, after OpenAI's three
  json out = {
      {"id", j.id},
      {"object", "fine_tuning.job"},
      {"created_at", j.created_at},
      {"finished_at", j.finished_at > 0 ? json(j.finished_at) : json(nullptr)},
      {"model", j.model},
      {"fine_tuned_model", j.fine_tuned_model.empty() ? json(nullptr) : json(j.fine_tuned_model)},
      {"organization_id", "org-kiln"},
      {"status", JobStatusName(j.status)},
      {"training_file", j.training_file},
      {"validation_file", j.validation_file.empty() ? json(nullptr) : json(j.validation_file)},
      {"result_files", json::array()},
      {"trained_tokens",
       j.status == JobStatus::kSucceeded ? json(j.trained_tokens) : json(nullptr)},
      {"error", j.error.is_null() ? json(nullptr) : j.error},
      {"hyperparameters", hyper},
      {"method", {{"type", "supervised"}, {"supervised", {{"hyperparameters", hyper}}}}},
      {"seed", j.seed},
      {"suffix", j.suffix.empty() ? json(nullptr) : json(j.suffix)},
      {"integrations", json::array()},
      {"metadata", j.metadata.empty() ? json(nullptr) : j.metadata},
      {"estimated_finish", j.estimated_finish > 0 ? json(j.estimated_finish) : json(nullptr)},
      {"user_provided_suffix", j.suffix.empty() ? json(nullptr) : json(j.suffix)}};
  out["kiln"] = {{"step", j.last_step},
                 {"total_steps", j.total_steps},
                 {"cancel_requested", j.cancel_requested},
                 {"pause_requested", j.pause_requested}};
  return out;
}

json FineTuningService::EventJson(const EventRecord& e) {
  json out = {{"id", e.id},
              {"object", "fine_tuning.job.event"},
              {"created_at", e.created_at},
              {"level", e.level},
              {"message", e.message},
              {"type", e.type}};
  out["data"] = e.data.is_null() ? json::object() : e.data;
  return out;
}

json FineTuningService::CheckpointJson(const CheckpointRecord& c) {
  return {{"id", c.id},
          {"object", "fine_tuning.job.checkpoint"},
          {"created_at", c.created_at},
          {"fine_tuned_model_checkpoint", c.fine_tuned_model_checkpoint},
          {"fine_tuning_job_id", c.job_id},
          {"metrics", c.metrics},
          {"step_number", c.step_number}};
}

}  // namespace kiln::finetune
