// The daemon's fine-tuning service: OpenAI's files and fine_tuning.jobs semantics over the job
// store (job_store.h), with a runner that trains inside kilnd and serves each result at once.
// Front ends (server/finetune/: the OpenAI-compatible HTTP routes and kiln.v1.FineTuning) are
// adapters over this header: they translate their wire format, call here, and render records.
//
// Job life: CreateJob checks the request (fields named as OpenAI names them), stores the job as
// validating_files, checks the files against the base model (tokenizing them with its chat
// template), then queued. The runner takes queued jobs oldest first, up to
// fine_tuning.max_concurrent_jobs at once, and trains (models/train/finetune.h) into
// `<storage_dir>/finetune/jobs/<job id>/`, writing a checkpoint every checkpoint_every_steps
// steps or checkpoint_every_seconds seconds (whichever comes first) and recording it with an
// event. Cancel and pause are seen after the next step (the step's checkpoint is written on
// pause, so resume continues it). A job whose daemon died while running is found `running` on
// the next start and continues from its newest checkpoint ("resumed from step N" event). A
// succeeded LoRA job's adapter is served as `ft:<base>:<suffix>:<job id>` at once
// (ModelRepository::AddLoraAdapter), and again after every restart.
//
// Serving comes first (fine_tuning.yield_to_serving): between steps the runner waits while the
// base model has requests queued or running, and records the time as yield.
//
// Errors are Status values with WithParam naming the request field ("training_file",
// "hyperparameters.n_epochs"): InvalidArgument for bad values, NotFound for unknown ids or
// models, FailedPrecondition for an operation the job's status does not allow ("cannot cancel
// job ftjob-... : it already succeeded"), AlreadyExists for a taken suffix, ResourceExhausted
// (-> 413) for a file over fine_tuning.max_file_bytes.
//
// Thread-safety: every method is thread-safe and returns promptly (training runs on the
// service's own threads).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "absl/time/time.h"
#include "config/config.h"
#include "engine/base/metrics.h"
#include "engine/base/status.h"
#include "nlohmann/json.hpp"
#include "scheduler/finetune/job_store.h"

namespace kiln {
class ModelRepository;
}

namespace kiln::finetune {

class FineTuningService {
 public:
  // Opens (or creates) the store under config.server.storage_dir. `repository` serves the base
  // models and receives the finished adapters; not owned, must outlive the service. `metrics`
  // may be null.
  static StatusOr<std::unique_ptr<FineTuningService>> Create(const config::Config& config,
                                                             ModelRepository* repository,
                                                             metrics::Registry* metrics);
  // Stops the runner: a running job stops after its current step and stays `running` in the
  // store with its checkpoint, so the next start resumes it.
  ~FineTuningService();

  // Serves the adapters of succeeded jobs, re-queues interrupted jobs, starts the runner.
  // Call after the configured models are loaded.
  Status Start();
  // What the destructor does: stops the runner and waits for the running step (and the
  // checkpoint it then writes) to end. No deadline: a step of a large model may take minutes.
  void Stop();

  // ---- files (POST/GET/DELETE /v1/files) ----
  // Stores `content` (sha256, durable write, then the row); purpose must be "fine-tune";
  // a fine-tune file is checked as JSONL of OpenAI's chat or prompt/completion format (the
  // error names the line and the key). ResourceExhausted past max_file_bytes.
  StatusOr<FileRecord> UploadFile(std::string_view filename, std::string_view purpose,
                                  std::string_view content);
  StatusOr<FileRecord> GetFile(std::string_view id) const;
  StatusOr<std::string> FileContent(std::string_view id) const;
  StatusOr<Page<FileRecord>> ListFiles(std::string_view purpose, std::string_view after,
                                       int limit) const;
  Status DeleteFile(std::string_view id);  // FailedPrecondition while a job uses it

  // ---- jobs ----
  // `request` is the body of POST /v1/fine_tuning/jobs, OpenAI's shape (docs/fine-tuning.md
  // lists Kiln's extra hyper-parameters). Returns the stored job (validating_files).
  StatusOr<JobRecord> CreateJob(const nlohmann::json& request);
  StatusOr<JobRecord> GetJob(std::string_view id) const;
  StatusOr<Page<JobRecord>> ListJobs(std::string_view after, int limit,
                                     const std::map<std::string, std::string>& metadata) const;
  StatusOr<JobRecord> CancelJob(std::string_view id);  // FailedPrecondition once finished
  // Only validating_files, queued or running jobs; a validating one is paused once valid.
  StatusOr<JobRecord> PauseJob(std::string_view id);
  StatusOr<JobRecord> ResumeJob(std::string_view id);  // only paused jobs
  StatusOr<Page<EventRecord>> ListEvents(std::string_view job_id, std::string_view after,
                                         int limit) const;
  StatusOr<Page<CheckpointRecord>> ListCheckpoints(std::string_view job_id, std::string_view after,
                                                   int limit) const;
  // Events of the job with sequence number > after_seq, oldest first (JobStore::EventSeq).
  StatusOr<std::vector<EventRecord>> EventsSince(std::string_view job_id, int64_t after_seq) const;
  // Blocks until the job gets an event with sequence > after_seq or changes status, or
  // `timeout` passes, or Stop is called; returns whether something changed. For WatchJob.
  bool WaitForChange(std::string_view job_id, int64_t after_seq, absl::Duration timeout) const;

  // ---- OpenAI's JSON shapes (shared by the HTTP routes and tests) ----
  static nlohmann::json FileJson(const FileRecord& f);              // object "file"
  static nlohmann::json JobJson(const JobRecord& j);                // object "fine_tuning.job"
  static nlohmann::json EventJson(const EventRecord& e);            // "fine_tuning.job.event"
  static nlohmann::json CheckpointJson(const CheckpointRecord& c);  // "fine_tuning.job.checkpoint"

  struct Impl;

 private:
  explicit FineTuningService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::finetune
