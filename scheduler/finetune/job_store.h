// The fine-tuning job store: files, jobs, their events and checkpoints in one SQLite database
// (`<server.storage_dir>/finetune/jobs.db`), so that everything a user submitted survives a restart
// or a `kill -9`.
//
//   KILN_ASSIGN_OR_RETURN(std::unique_ptr<JobStore> store,
//   JobStore::Open(".kiln/finetune/jobs.db")); KILN_RETURN_IF_ERROR(store->InsertFile(file));
//   KILN_ASSIGN_OR_RETURN(JobRecord job, store->GetJob("ftjob-..."));
//
// Durability: WAL journal mode, synchronous=FULL (a committed row survives power loss), one
// connection used under one mutex (SQLite's single writer); every method is one transaction,
// so a crash leaves each row either fully written or absent — never half of a job. The schema
// is versioned (PRAGMA user_version) and migrated forward on Open; a database from a newer
// Kiln is refused (FailedPrecondition naming both versions) rather than guessed at.
//
// Records hold what the OpenAI API shows plus what the runner needs; the JSON columns
// (hyperparameters, method, metadata, error, integrations, metrics, data) are stored as text
// and handed back unchanged. Timestamps are Unix seconds. Ids are made by the caller
// (NewId), except event and checkpoint ids, which the store assigns in insertion order.
//
// Thread-safety: every method is thread-safe (one internal mutex). Several processes may open
// the same file: writes take SQLite's write lock for their whole transaction and wait up to a
// busy timeout for another's (then Unavailable).
//
// Errors from SQLite name the database's path and SQLite's message: DataLoss for a file that
// is not a database or is corrupt, PermissionDenied when it cannot be opened or written,
// ResourceExhausted for a full disk, Unavailable while another process holds the lock too long.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"
#include "nlohmann/json.hpp"

namespace kiln::finetune {

// A fresh random id with the given prefix: "file-", "ftjob-" + 24 lowercase hex characters.
std::string NewId(std::string_view prefix);

// Unix seconds now.
int64_t UnixNow();

struct FileRecord {
  std::string id;  // "file-..."
  int64_t bytes = 0;
  int64_t created_at = 0;
  std::string filename;              // as uploaded (sanitized by the caller)
  std::string purpose;               // "fine-tune"
  std::string sha256;                // lowercase hex of the contents
  std::string path;                  // where the contents are on disk
  std::string status = "processed";  // OpenAI's (deprecated) field: uploaded|processed|error
  std::string status_details;
};

enum class JobStatus {
  kValidatingFiles,
  kQueued,
  kRunning,
  kPaused,
  kSucceeded,
  kFailed,
  kCancelled
};
std::string_view JobStatusName(JobStatus s);  // "validating_files", ..., "cancelled"
std::optional<JobStatus> ParseJobStatus(std::string_view name);
bool IsTerminal(JobStatus s);  // succeeded, failed, cancelled

struct JobRecord {
  std::string id;               // "ftjob-..."
  std::string model;            // the base model's name (a configured LLM)
  std::string training_file;    // file id
  std::string validation_file;  // file id or empty
  JobStatus status = JobStatus::kValidatingFiles;
  int64_t created_at = 0;
  int64_t finished_at = 0;       // 0: not finished
  int64_t estimated_finish = 0;  // 0: unknown
  std::string suffix;            // may be empty
  int64_t seed = 0;
  nlohmann::json hyperparameters = nlohmann::json::object();  // resolved (no "auto" left)
  nlohmann::json method = nlohmann::json::object();           // {"type": "supervised", ...}
  nlohmann::json metadata = nlohmann::json::object();         // string -> string, <= 16 keys
  nlohmann::json error;          // null, or {"code", "message", "param"}
  std::string fine_tuned_model;  // "ft:<base>:<suffix>:<job id>" once succeeded; unique
  int64_t trained_tokens = 0;
  int64_t total_steps = 0;        // 0: not known yet
  int64_t last_step = 0;          // last completed optimizer step seen by the runner
  std::string output_dir;         // the run's out dir (checkpoints, final adapter)
  bool cancel_requested = false;  // set by cancel; the runner stops within one step
  bool pause_requested = false;   // set by pause; cleared by resume
};

struct EventRecord {
  std::string id;  // "ftevent-<n>", assigned by AddEvent (n increases with every event)
  std::string job_id;
  int64_t created_at = 0;
  std::string level = "info";    // info | warn | error
  std::string type = "message";  // message | metrics
  std::string message;
  nlohmann::json data;  // null, or for metrics {"step", "train_loss", ...}
};

struct CheckpointRecord {
  std::string id;  // "ftckpt-<n>", assigned by AddCheckpoint
  std::string job_id;
  int64_t created_at = 0;
  int64_t step_number = 0;
  nlohmann::json metrics = nlohmann::json::object();  // {"step", "train_loss", ...}
  std::string fine_tuned_model_checkpoint;            // "ft:<base>:<suffix>:<job id>:ckpt-step-<n>"
  std::string path;                                   // the checkpoint directory
};

// Listing: ids come back newest first (OpenAI's order); `after` is an id of the previous page
// (its last item), empty for the first page; `limit` in [1, 100]. has_more says whether more
// items follow the last one returned. A limit outside [1, 100] or an `after` that is not an id
// of the list is InvalidArgument with WithParam "limit" / "after" (engine/base/status.h).
template <typename T>
struct Page {
  std::vector<T> data;
  bool has_more = false;
};

class JobStore {
 public:
  // Opens (creating the file and its directory if needed) and migrates the database.
  // Errors: the path (unwritable, not a database, corrupt: "...: file is not a database"),
  // FailedPrecondition for a schema newer than this build knows.
  static StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();

  static constexpr int kSchemaVersion = 1;
  int schema_version() const;

  // ---- files ----
  // AlreadyExists for a duplicate id.
  Status InsertFile(const FileRecord& file);
  StatusOr<FileRecord> GetFile(std::string_view id) const;  // NotFound("no file '<id>'")
  // `purpose` empty: all. Newest first.
  StatusOr<Page<FileRecord>> ListFiles(std::string_view purpose, std::string_view after,
                                       int limit) const;
  // Deletes the row (the caller removes the contents). NotFound; FailedPrecondition when a job
  // that is not finished (validating_files, queued, running, paused) uses it as training or
  // validation file, naming the job.
  Status DeleteFile(std::string_view id);

  // ---- jobs ----
  // AlreadyExists for a duplicate id, or for a fine_tuned_model / non-empty suffix another job
  // that is not failed or cancelled already has for the same base model ("suffix 'x' is
  // already used by fine-tuning job ftjob-... of model 'm'", WithParam "suffix"), checked in
  // the same write transaction as the insert (two racing creates, even from two processes
  // sharing the file: exactly one wins).
  Status InsertJob(const JobRecord& job);
  // Replaces every field of the job with this id. NotFound; AlreadyExists if the new
  // fine_tuned_model or suffix collides as above (a unique index guards both).
  Status UpdateJob(const JobRecord& job);
  StatusOr<JobRecord> GetJob(std::string_view id) const;  // NotFound("no fine-tuning job '<id>'")
  // Newest first; `metadata` filters on equal key/value pairs (all must match).
  StatusOr<Page<JobRecord>> ListJobs(std::string_view after, int limit,
                                     const std::map<std::string, std::string>& metadata) const;
  // How many jobs have each status (statuses without jobs are absent): the metrics' gauge.
  StatusOr<std::map<JobStatus, int64_t>> CountJobsByStatus() const;
  // Jobs in any of these statuses, oldest first (the runner's queue order).
  StatusOr<std::vector<JobRecord>> JobsWithStatus(const std::vector<JobStatus>& statuses) const;

  // ---- events and checkpoints ----
  // Assigns id and created_at (if 0) and returns the stored record. NotFound for an unknown job.
  StatusOr<EventRecord> AddEvent(EventRecord event);
  // Newest first (OpenAI's order for list_events); `after` an event id. NotFound for an
  // unknown job (as are EventsSince and ListCheckpoints).
  StatusOr<Page<EventRecord>> ListEvents(std::string_view job_id, std::string_view after,
                                         int limit) const;
  // Events with id number > `after_seq` (0: all), oldest first: what WatchJob streams.
  StatusOr<std::vector<EventRecord>> EventsSince(std::string_view job_id, int64_t after_seq) const;
  static int64_t EventSeq(std::string_view event_id);  // "ftevent-12" -> 12; 0 if malformed

  StatusOr<CheckpointRecord> AddCheckpoint(CheckpointRecord checkpoint);
  StatusOr<Page<CheckpointRecord>> ListCheckpoints(std::string_view job_id, std::string_view after,
                                                   int limit) const;

 private:
  struct Impl;
  explicit JobStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::finetune
