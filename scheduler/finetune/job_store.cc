#include "scheduler/finetune/job_store.h"

#include <sqlite3.h>

#include <array>
#include <chrono>
#include <cinttypes>
#include <filesystem>
#include <limits>
#include <mutex>
#include <random>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace kiln::finetune {
namespace {

using json = nlohmann::json;

constexpr std::string_view kEventPrefix = "ftevent-";
constexpr std::string_view kCheckpointPrefix = "ftckpt-";
constexpr int kMaxPageLimit = 100;
// How long a write waits for another connection's transaction (another kilnd, a sqlite3 shell)
// before it fails with Unavailable.
constexpr int kBusyTimeoutMs = 10000;

// migrations[v] takes a database from user_version v to v + 1. Append only: a released step is
// never edited, since databases out there have already run it.
constexpr std::array<std::string_view, JobStore::kSchemaVersion> kMigrations = {
    // v0 -> v1. `seq` gives every table its creation order (listings are newest first) and
    // stays fixed under VACUUM, which an implicit rowid does not. Jobs do not reference files
    // with a foreign key: a file may be deleted once its jobs have finished (OpenAI's rule).
    R"sql(
CREATE TABLE files (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  bytes INTEGER NOT NULL,
  created_at INTEGER NOT NULL,
  filename TEXT NOT NULL,
  purpose TEXT NOT NULL,
  sha256 TEXT NOT NULL,
  path TEXT NOT NULL,
  status TEXT NOT NULL,
  status_details TEXT NOT NULL
);
CREATE INDEX files_purpose ON files (purpose, seq);

CREATE TABLE jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  model TEXT NOT NULL,
  training_file TEXT NOT NULL,
  validation_file TEXT NOT NULL,
  status TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  finished_at INTEGER NOT NULL,
  estimated_finish INTEGER NOT NULL,
  suffix TEXT NOT NULL,
  seed INTEGER NOT NULL,
  hyperparameters TEXT NOT NULL,
  method TEXT NOT NULL,
  metadata TEXT NOT NULL,
  error TEXT NOT NULL,
  fine_tuned_model TEXT NOT NULL,
  trained_tokens INTEGER NOT NULL,
  total_steps INTEGER NOT NULL,
  last_step INTEGER NOT NULL,
  output_dir TEXT NOT NULL,
  cancel_requested INTEGER NOT NULL,
  pause_requested INTEGER NOT NULL
);
CREATE INDEX jobs_status ON jobs (status, seq);
CREATE INDEX jobs_training_file ON jobs (training_file);
CREATE INDEX jobs_validation_file ON jobs (validation_file);
-- Backstops for InsertJob's checks (which give the readable message), also against UpdateJob
-- and against writers that are not this code.
CREATE UNIQUE INDEX jobs_model_suffix ON jobs (model, suffix)
  WHERE suffix != '' AND status NOT IN ('failed', 'cancelled');
CREATE UNIQUE INDEX jobs_fine_tuned_model ON jobs (fine_tuned_model)
  WHERE fine_tuned_model != '' AND status NOT IN ('failed', 'cancelled');

CREATE TABLE events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
  created_at INTEGER NOT NULL,
  level TEXT NOT NULL,
  type TEXT NOT NULL,
  message TEXT NOT NULL,
  data TEXT NOT NULL
);
CREATE INDEX events_job ON events (job_id, seq);

CREATE TABLE checkpoints (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
  created_at INTEGER NOT NULL,
  step_number INTEGER NOT NULL,
  metrics TEXT NOT NULL,
  fine_tuned_model_checkpoint TEXT NOT NULL,
  path TEXT NOT NULL
);
CREATE INDEX checkpoints_job ON checkpoints (job_id, seq);
)sql",
};

// The statuses in which a job still needs its files.
constexpr std::string_view kActiveStatusSql = "('validating_files', 'queued', 'running', 'paused')";

constexpr std::string_view kJobColumns =
    "id, model, training_file, validation_file, status, created_at, finished_at, "
    "estimated_finish, suffix, seed, hyperparameters, method, metadata, error, fine_tuned_model, "
    "trained_tokens, total_steps, last_step, output_dir, cancel_requested, pause_requested";
constexpr std::string_view kFileColumns =
    "id, bytes, created_at, filename, purpose, sha256, path, status, status_details";
constexpr std::string_view kEventColumns = "seq, job_id, created_at, level, type, message, data";
constexpr std::string_view kCheckpointColumns =
    "seq, job_id, created_at, step_number, metrics, fine_tuned_model_checkpoint, path";

// A SQLite result code as a Status of the nearest kind; the message names the database, the
// operation and SQLite's own explanation.
Status SqlError(sqlite3* db, int rc, std::string_view path, std::string_view what) {
  const char* msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  std::string text = StrCat(path, ": ", what, ": ", msg);
  if (rc == SQLITE_CONSTRAINT_UNIQUE || rc == SQLITE_CONSTRAINT_PRIMARYKEY) {
    return AlreadyExists(text);
  }
  switch (rc & 0xff) {  // the primary code of an extended one
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return Unavailable(text);
    case SQLITE_NOTADB:
    case SQLITE_CORRUPT:
      return DataLoss(text);
    case SQLITE_CANTOPEN:
    case SQLITE_PERM:
    case SQLITE_READONLY:
      return PermissionDenied(text);
    case SQLITE_FULL:
      return ResourceExhausted(text);
    case SQLITE_CONSTRAINT:  // e.g. a foreign key: the row depends on one that is not there
      return FailedPrecondition(text);
    default:
      return Internal(text);
  }
}

// One prepared statement; parameters are bound, never spliced into the SQL.
class Stmt {
 public:
  Stmt(sqlite3* db, std::string_view path, std::string_view sql) : db_(db), path_(path) {
    rc_ = sqlite3_prepare_v2(db, sql.data(), static_cast<int>(sql.size()), &stmt_, nullptr);
  }
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& Bind(int i, int64_t v) {
    if (ok()) rc_ = sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  Stmt& Bind(int i, std::string_view v) {
    // SQLITE_TRANSIENT: SQLite copies, so temporaries may be bound.
    if (ok()) {
      rc_ = sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    }
    return *this;
  }
  Stmt& BindJson(int i, const json& v) { return Bind(i, std::string_view(v.dump())); }

  // True while there is a row; false once done.
  StatusOr<bool> Step() {
    if (!ok()) return SqlError(db_, rc_, path_, "preparing a statement");
    rc_ = sqlite3_step(stmt_);
    if (rc_ == SQLITE_ROW) return true;
    if (rc_ == SQLITE_DONE) {
      rc_ = SQLITE_OK;
      return false;
    }
    return SqlError(db_, rc_, path_, "statement failed");
  }
  // Runs a statement that returns no rows.
  Status Run() { return Step().status(); }
  // The last SQLite result code.
  int rc() const { return rc_; }

  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }
  std::string Text(int col) const {
    const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, col));
    return p != nullptr ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, col)))
                        : std::string();
  }
  // A JSON column; text that does not parse means the file was edited or damaged.
  StatusOr<json> Json(int col) const {
    json j = json::parse(Text(col), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return DataLoss(path_, ": column ", sqlite3_column_name(stmt_, col), " holds invalid JSON");
    }
    return j;
  }

 private:
  bool ok() const { return rc_ == SQLITE_OK || rc_ == SQLITE_ROW; }

  sqlite3* db_;
  std::string_view path_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_OK;
};

StatusOr<FileRecord> ReadFile(const Stmt& s) {
  FileRecord f;
  f.id = s.Text(0);
  f.bytes = s.Int(1);
  f.created_at = s.Int(2);
  f.filename = s.Text(3);
  f.purpose = s.Text(4);
  f.sha256 = s.Text(5);
  f.path = s.Text(6);
  f.status = s.Text(7);
  f.status_details = s.Text(8);
  return f;
}

StatusOr<JobRecord> ReadJob(const Stmt& s, std::string_view path) {
  JobRecord j;
  j.id = s.Text(0);
  j.model = s.Text(1);
  j.training_file = s.Text(2);
  j.validation_file = s.Text(3);
  const std::string status = s.Text(4);
  std::optional<JobStatus> st = ParseJobStatus(status);
  if (!st) return DataLoss(path, ": job ", j.id, " has unknown status '", status, "'");
  j.status = *st;
  j.created_at = s.Int(5);
  j.finished_at = s.Int(6);
  j.estimated_finish = s.Int(7);
  j.suffix = s.Text(8);
  j.seed = s.Int(9);
  KILN_ASSIGN_OR_RETURN(j.hyperparameters, s.Json(10));
  KILN_ASSIGN_OR_RETURN(j.method, s.Json(11));
  KILN_ASSIGN_OR_RETURN(j.metadata, s.Json(12));
  KILN_ASSIGN_OR_RETURN(j.error, s.Json(13));
  j.fine_tuned_model = s.Text(14);
  j.trained_tokens = s.Int(15);
  j.total_steps = s.Int(16);
  j.last_step = s.Int(17);
  j.output_dir = s.Text(18);
  j.cancel_requested = s.Int(19) != 0;
  j.pause_requested = s.Int(20) != 0;
  return j;
}

// Binds every column of kJobColumns from ?1 on.
void BindJob(Stmt& s, const JobRecord& j) {
  s.Bind(1, j.id)
      .Bind(2, j.model)
      .Bind(3, j.training_file)
      .Bind(4, j.validation_file)
      .Bind(5, JobStatusName(j.status))
      .Bind(6, j.created_at)
      .Bind(7, j.finished_at)
      .Bind(8, j.estimated_finish)
      .Bind(9, j.suffix)
      .Bind(10, j.seed)
      .BindJson(11, j.hyperparameters)
      .BindJson(12, j.method)
      .BindJson(13, j.metadata)
      .BindJson(14, j.error)
      .Bind(15, j.fine_tuned_model)
      .Bind(16, j.trained_tokens)
      .Bind(17, j.total_steps)
      .Bind(18, j.last_step)
      .Bind(19, j.output_dir)
      .Bind(20, int64_t{j.cancel_requested})
      .Bind(21, int64_t{j.pause_requested});
}

StatusOr<EventRecord> ReadEvent(const Stmt& s) {
  EventRecord e;
  e.id = StrCat(kEventPrefix, s.Int(0));
  e.job_id = s.Text(1);
  e.created_at = s.Int(2);
  e.level = s.Text(3);
  e.type = s.Text(4);
  e.message = s.Text(5);
  KILN_ASSIGN_OR_RETURN(e.data, s.Json(6));
  return e;
}

StatusOr<CheckpointRecord> ReadCheckpoint(const Stmt& s) {
  CheckpointRecord c;
  c.id = StrCat(kCheckpointPrefix, s.Int(0));
  c.job_id = s.Text(1);
  c.created_at = s.Int(2);
  c.step_number = s.Int(3);
  KILN_ASSIGN_OR_RETURN(c.metrics, s.Json(4));
  c.fine_tuned_model_checkpoint = s.Text(5);
  c.path = s.Text(6);
  return c;
}

Status CheckLimit(int limit) {
  if (limit >= 1 && limit <= kMaxPageLimit) return OkStatus();
  return WithParam(
      InvalidArgument("`limit` is ", limit, "; it must be between 1 and ", kMaxPageLimit), "limit");
}

// The number n of "<prefix><n>" (n > 0), or 0.
int64_t SeqOf(std::string_view id, std::string_view prefix) {
  if (!id.starts_with(prefix)) return 0;
  id.remove_prefix(prefix.size());
  if (id.empty() || id.size() > 18) return 0;  // 18 digits cannot overflow int64
  int64_t n = 0;
  for (char c : id) {
    if (c < '0' || c > '9') return 0;
    n = n * 10 + (c - '0');
  }
  return n;
}

// Reads rows of `s` into a page of at most `limit` records (one more row only sets has_more).
// `keep` filters rows after reading (true: all).
template <typename T, typename Read, typename Keep>
StatusOr<Page<T>> ReadPage(Stmt& s, int limit, Read read, Keep keep) {
  Page<T> page;
  while (true) {
    KILN_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) break;
    KILN_ASSIGN_OR_RETURN(T rec, read(s));
    if (!keep(rec)) continue;
    if (static_cast<int>(page.data.size()) == limit) {
      page.has_more = true;
      break;
    }
    page.data.push_back(std::move(rec));
  }
  return page;
}

// Every row of `s`, in the statement's order.
template <typename T, typename Read>
StatusOr<std::vector<T>> ReadAll(Stmt& s, Read read) {
  KILN_ASSIGN_OR_RETURN(Page<T> all, ReadPage<T>(s, std::numeric_limits<int>::max(), read,
                                                 [](const T&) { return true; }));
  return std::move(all.data);
}

}  // namespace

std::string NewId(std::string_view prefix) {
  // Ids are handed to clients and must not be guessable or collide across restarts: a
  // generator per thread (no lock), seeded from the OS's entropy.
  thread_local std::mt19937_64 gen = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  const uint64_t hi = gen(), lo = gen();
  return absl::StrFormat("%s%016x%08x", ToAbsl(prefix), hi, static_cast<uint32_t>(lo));
}

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string_view JobStatusName(JobStatus s) {
  switch (s) {
    case JobStatus::kValidatingFiles:
      return "validating_files";
    case JobStatus::kQueued:
      return "queued";
    case JobStatus::kRunning:
      return "running";
    case JobStatus::kPaused:
      return "paused";
    case JobStatus::kSucceeded:
      return "succeeded";
    case JobStatus::kFailed:
      return "failed";
    case JobStatus::kCancelled:
      return "cancelled";
  }
  return "";
}

std::optional<JobStatus> ParseJobStatus(std::string_view name) {
  for (JobStatus s :
       {JobStatus::kValidatingFiles, JobStatus::kQueued, JobStatus::kRunning, JobStatus::kPaused,
        JobStatus::kSucceeded, JobStatus::kFailed, JobStatus::kCancelled}) {
    if (JobStatusName(s) == name) return s;
  }
  return std::nullopt;
}

bool IsTerminal(JobStatus s) {
  return s == JobStatus::kSucceeded || s == JobStatus::kFailed || s == JobStatus::kCancelled;
}

struct JobStore::Impl {
  std::string path;
  int version = 0;
  mutable absl::Mutex mu;
  sqlite3* db ABSL_GUARDED_BY(mu) = nullptr;

  ~Impl() {
    absl::MutexLock lock(&mu);
    sqlite3_close_v2(db);
  }

  // Runs SQL without parameters (schema, pragmas, transaction control).
  Status Exec(std::string_view sql, std::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const std::string s(sql);
    int rc = sqlite3_exec(db, s.c_str(), nullptr, nullptr, nullptr);
    return rc == SQLITE_OK ? OkStatus() : SqlError(db, rc, path, what);
  }

  // One transaction around `body`: committed if body returns OK, rolled back otherwise.
  // `write`: BEGIN IMMEDIATE takes the write lock up front, so a check and the write it guards
  // (InsertJob's suffix) cannot interleave with another connection's, and a busy database
  // fails at BEGIN (after busy_timeout) rather than at a later upgrade, where SQLite could not
  // wait without risking deadlock.
  template <typename F>
  auto Transaction(bool write, F body) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) -> decltype(body()) {
    KILN_RETURN_IF_ERROR(
        Exec(write ? "BEGIN IMMEDIATE" : "BEGIN DEFERRED", "starting a transaction"));
    auto result = body();
    if (!result.ok()) {
      (void)Exec("ROLLBACK", "rolling back");  // the body's error is the one worth reporting
      return result;
    }
    Status commit = Exec("COMMIT", "committing");
    if (!commit.ok()) {
      (void)Exec("ROLLBACK", "rolling back");
      return commit;
    }
    return result;
  }

  Stmt Prepare(std::string_view sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return Stmt(db, path, sql);
  }

  // NotFound unless a job with this id exists.
  Status JobExists(std::string_view id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Stmt s = Prepare("SELECT 1 FROM jobs WHERE id = ?1");
    s.Bind(1, id);
    KILN_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return NotFound("no fine-tuning job '", id, "'");
    return OkStatus();
  }

  // Inserts a row of one job's events or checkpoints with `sql` (`bind` binds its parameters)
  // and returns the row's seq. NotFound for an unknown job.
  StatusOr<int64_t> InsertOfJob(std::string_view job_id, std::string_view sql,
                                absl::FunctionRef<void(Stmt&)> bind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    KILN_RETURN_IF_ERROR(JobExists(job_id));
    Stmt s = Prepare(sql);
    bind(s);
    KILN_RETURN_IF_ERROR(s.Run());
    return sqlite3_last_insert_rowid(db);
  }

  // A page of one job's rows of `table` (events or checkpoints, whose ids are `prefix` + seq),
  // newest first.
  template <typename T>
  StatusOr<Page<T>> ListOfJob(std::string_view table, std::string_view columns,
                              std::string_view prefix, std::string_view job_id,
                              std::string_view after, int limit, StatusOr<T> (*read)(const Stmt&))
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    KILN_RETURN_IF_ERROR(CheckLimit(limit));
    int64_t before = std::numeric_limits<int64_t>::max();
    if (!after.empty()) {
      before = SeqOf(after, prefix);
      if (before == 0) {
        return WithParam(InvalidArgument("`after` is '", after, "', which is not an id of the ",
                                         table, " list (", prefix, "<n>)"),
                         "after");
      }
    }
    return Transaction(false, [&]() -> StatusOr<Page<T>> {
      KILN_RETURN_IF_ERROR(JobExists(job_id));
      Stmt s = Prepare(StrCat("SELECT ", columns, " FROM ", table,
                              " WHERE job_id = ?1 AND seq < ?2 ORDER BY seq DESC LIMIT ?3"));
      s.Bind(1, job_id).Bind(2, before).Bind(3, int64_t{limit} + 1);
      return ReadPage<T>(s, limit, read, [](const T&) { return true; });
    });
  }

  // The seq of row `id` of `table` (files or jobs), for `after`.
  StatusOr<int64_t> AfterSeq(std::string_view table, std::string_view id, std::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (id.empty()) return std::numeric_limits<int64_t>::max();
    Stmt s = Prepare(StrCat("SELECT seq FROM ", table, " WHERE id = ?1"));
    s.Bind(1, id);
    KILN_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) {
      return WithParam(InvalidArgument("`after` is '", id, "', which is not a ", what, " id"),
                       "after");
    }
    return s.Int(0);
  }

  Status Migrate() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return Transaction(true, [&]() -> Status {
      {  // read inside the write transaction: another process may have migrated meanwhile
        Stmt v = Prepare("PRAGMA user_version");
        KILN_ASSIGN_OR_RETURN(bool row, v.Step());
        version = row ? static_cast<int>(v.Int(0)) : 0;
      }  // (closed before the schema changes)
      if (version > kSchemaVersion) {
        return FailedPrecondition(path, ": the fine-tuning database has schema version ", version,
                                  ", but this build of Kiln knows versions up to ", kSchemaVersion,
                                  "; it was written by a newer Kiln: run that, or point "
                                  "server.storage_dir elsewhere");
      }
      for (; version < kSchemaVersion; ++version) {
        KILN_RETURN_IF_ERROR(
            Exec(kMigrations[version], StrCat("migrating the schema to version ", version + 1)));
      }
      // PRAGMA takes no parameters; the value is our own constant.
      return Exec(StrCat("PRAGMA user_version = ", kSchemaVersion), "setting the schema version");
    });
  }
};

JobStore::JobStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JobStore::~JobStore() = default;

StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) {
      return PermissionDenied(path, ": cannot create directory ", parent.string(), ": ",
                              ec.message());
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  absl::MutexLock lock(&impl->mu);
  // NOMUTEX: Impl::mu serializes every use of the connection already.
  int rc =
      sqlite3_open_v2(path.c_str(), &impl->db,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) return SqlError(impl->db, rc, path, "cannot open the database");
  sqlite3_extended_result_codes(impl->db, 1);
  sqlite3_busy_timeout(impl->db, kBusyTimeoutMs);
  // journal_mode is the first statement to read the file, so a file that is not a database
  // fails here ("file is not a database").
  {  // scoped: a statement still open would keep the migration from committing
    Stmt wal = impl->Prepare("PRAGMA journal_mode = WAL");
    auto row = wal.Step();
    if (!row.ok()) {
      return SqlError(impl->db, wal.rc(), path, "cannot open the fine-tuning database");
    }
    if (!*row || wal.Text(0) != "wal") {
      return FailedPrecondition(path, ": cannot switch the database to WAL journal mode (got '",
                                *row ? wal.Text(0) : "", "')");
    }
  }
  KILN_RETURN_IF_ERROR(impl->Exec("PRAGMA synchronous = FULL", "setting synchronous"));
  KILN_RETURN_IF_ERROR(impl->Exec("PRAGMA foreign_keys = ON", "enabling foreign keys"));
  KILN_RETURN_IF_ERROR(impl->Migrate());
  return std::unique_ptr<JobStore>(new JobStore(std::move(impl)));
}

int JobStore::schema_version() const { return impl_->version; }

// ---- files ----

Status JobStore::InsertFile(const FileRecord& f) {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(true, [&]() -> Status {
    Stmt dup = impl_->Prepare("SELECT 1 FROM files WHERE id = ?1");
    dup.Bind(1, f.id);
    KILN_ASSIGN_OR_RETURN(bool exists, dup.Step());
    if (exists) return AlreadyExists("file '", f.id, "' already exists");
    Stmt s = impl_->Prepare(StrCat("INSERT INTO files (", kFileColumns,
                                   ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"));
    s.Bind(1, f.id)
        .Bind(2, f.bytes)
        .Bind(3, f.created_at)
        .Bind(4, f.filename)
        .Bind(5, f.purpose)
        .Bind(6, f.sha256)
        .Bind(7, f.path)
        .Bind(8, f.status)
        .Bind(9, f.status_details);
    return s.Run();
  });
}

StatusOr<FileRecord> JobStore::GetFile(std::string_view id) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(false, [&]() -> StatusOr<FileRecord> {
    Stmt s = impl_->Prepare(StrCat("SELECT ", kFileColumns, " FROM files WHERE id = ?1"));
    s.Bind(1, id);
    KILN_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return NotFound("no file '", id, "'");
    return ReadFile(s);
  });
}

StatusOr<Page<FileRecord>> JobStore::ListFiles(std::string_view purpose, std::string_view after,
                                               int limit) const {
  KILN_RETURN_IF_ERROR(CheckLimit(limit));
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(false, [&]() -> StatusOr<Page<FileRecord>> {
    KILN_ASSIGN_OR_RETURN(int64_t before, impl_->AfterSeq("files", after, "file"));
    Stmt s = impl_->Prepare(StrCat("SELECT ", kFileColumns,
                                   " FROM files WHERE seq < ?1 AND (?2 = '' OR purpose = ?2) "
                                   "ORDER BY seq DESC LIMIT ?3"));
    s.Bind(1, before).Bind(2, purpose).Bind(3, int64_t{limit} + 1);
    return ReadPage<FileRecord>(s, limit, ReadFile, [](const FileRecord&) { return true; });
  });
}

Status JobStore::DeleteFile(std::string_view id) {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(true, [&]() -> Status {
    Stmt exists = impl_->Prepare("SELECT 1 FROM files WHERE id = ?1");
    exists.Bind(1, id);
    KILN_ASSIGN_OR_RETURN(bool row, exists.Step());
    if (!row) return NotFound("no file '", id, "'");
    Stmt user = impl_->Prepare(
        StrCat("SELECT id, status FROM jobs WHERE (training_file = ?1 OR validation_file = ?1) "
               "AND status IN ",
               kActiveStatusSql, " ORDER BY seq LIMIT 1"));
    user.Bind(1, id);
    KILN_ASSIGN_OR_RETURN(bool used, user.Step());
    if (used) {
      return FailedPrecondition("file '", id, "' is in use by fine-tuning job ", user.Text(0),
                                " (status ", user.Text(1),
                                "); delete it after the job has finished or been cancelled");
    }
    Stmt del = impl_->Prepare("DELETE FROM files WHERE id = ?1");
    del.Bind(1, id);
    return del.Run();
  });
}

// ---- jobs ----

Status JobStore::InsertJob(const JobRecord& job) {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(true, [&]() -> Status {
    Stmt dup = impl_->Prepare("SELECT 1 FROM jobs WHERE id = ?1");
    dup.Bind(1, job.id);
    KILN_ASSIGN_OR_RETURN(bool exists, dup.Step());
    if (exists) return AlreadyExists("fine-tuning job '", job.id, "' already exists");
    if (!job.suffix.empty()) {
      Stmt taken = impl_->Prepare(
          "SELECT id FROM jobs WHERE model = ?1 AND suffix = ?2 "
          "AND status NOT IN ('failed', 'cancelled') ORDER BY seq LIMIT 1");
      taken.Bind(1, job.model).Bind(2, job.suffix);
      KILN_ASSIGN_OR_RETURN(bool row, taken.Step());
      if (row) {
        return WithParam(
            AlreadyExists("suffix '", job.suffix, "' is already used by fine-tuning job ",
                          taken.Text(0), " of model '", job.model, "'"),
            "suffix");
      }
    }
    if (!job.fine_tuned_model.empty()) {
      Stmt taken = impl_->Prepare(
          "SELECT id FROM jobs WHERE fine_tuned_model = ?1 "
          "AND status NOT IN ('failed', 'cancelled') ORDER BY seq LIMIT 1");
      taken.Bind(1, job.fine_tuned_model);
      KILN_ASSIGN_OR_RETURN(bool row, taken.Step());
      if (row) {
        return AlreadyExists("fine-tuned model '", job.fine_tuned_model,
                             "' is already the result of fine-tuning job ", taken.Text(0));
      }
    }
    Stmt s = impl_->Prepare(StrCat("INSERT INTO jobs (", kJobColumns,
                                   ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, "
                                   "?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21)"));
    BindJob(s, job);
    return s.Run();
  });
}

Status JobStore::UpdateJob(const JobRecord& job) {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(true, [&]() -> Status {
    Stmt s = impl_->Prepare(
        "UPDATE jobs SET model = ?2, training_file = ?3, validation_file = ?4, status = ?5, "
        "created_at = ?6, finished_at = ?7, estimated_finish = ?8, suffix = ?9, seed = ?10, "
        "hyperparameters = ?11, method = ?12, metadata = ?13, error = ?14, "
        "fine_tuned_model = ?15, trained_tokens = ?16, total_steps = ?17, last_step = ?18, "
        "output_dir = ?19, cancel_requested = ?20, pause_requested = ?21 WHERE id = ?1");
    BindJob(s, job);
    KILN_RETURN_IF_ERROR(s.Run());
    if (sqlite3_changes(impl_->db) == 0) return NotFound("no fine-tuning job '", job.id, "'");
    return OkStatus();
  });
}

StatusOr<JobRecord> JobStore::GetJob(std::string_view id) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(false, [&]() -> StatusOr<JobRecord> {
    Stmt s = impl_->Prepare(StrCat("SELECT ", kJobColumns, " FROM jobs WHERE id = ?1"));
    s.Bind(1, id);
    KILN_ASSIGN_OR_RETURN(bool row, s.Step());
    if (!row) return NotFound("no fine-tuning job '", id, "'");
    return ReadJob(s, impl_->path);
  });
}

StatusOr<Page<JobRecord>> JobStore::ListJobs(
    std::string_view after, int limit, const std::map<std::string, std::string>& metadata) const {
  KILN_RETURN_IF_ERROR(CheckLimit(limit));
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(false, [&]() -> StatusOr<Page<JobRecord>> {
    KILN_ASSIGN_OR_RETURN(int64_t before, impl_->AfterSeq("jobs", after, "fine-tuning job"));
    // The metadata filter runs here rather than in SQL: keys are arbitrary strings, which a
    // JSON path would have to quote, and a user has few jobs.
    Stmt s = impl_->Prepare(
        StrCat("SELECT ", kJobColumns, " FROM jobs WHERE seq < ?1 ORDER BY seq DESC"));
    s.Bind(1, before);
    auto read = [&](const Stmt& st) { return ReadJob(st, impl_->path); };
    auto keep = [&](const JobRecord& j) {
      for (const auto& [key, value] : metadata) {
        auto it = j.metadata.find(key);
        if (it == j.metadata.end() || !it->is_string() ||
            it->get_ref<const std::string&>() != value) {
          return false;
        }
      }
      return true;
    };
    return ReadPage<JobRecord>(s, limit, read, keep);
  });
}

StatusOr<std::map<JobStatus, int64_t>> JobStore::CountJobsByStatus() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(false, [&]() -> StatusOr<std::map<JobStatus, int64_t>> {
    Stmt s = impl_->Prepare("SELECT status, COUNT(*) FROM jobs GROUP BY status");
    std::map<JobStatus, int64_t> out;
    for (;;) {
      KILN_ASSIGN_OR_RETURN(bool row, s.Step());
      if (!row) break;
      if (std::optional<JobStatus> st = ParseJobStatus(s.Text(0))) out[*st] = s.Int(1);
    }
    return out;
  });
}

StatusOr<std::vector<JobRecord>> JobStore::JobsWithStatus(
    const std::vector<JobStatus>& statuses) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(false, [&]() -> StatusOr<std::vector<JobRecord>> {
    if (statuses.empty()) return std::vector<JobRecord>();
    // One placeholder per status; the values are bound.
    std::string in = "?1";
    for (size_t i = 1; i < statuses.size(); ++i) in += StrCat(", ?", i + 1);
    Stmt s = impl_->Prepare(
        StrCat("SELECT ", kJobColumns, " FROM jobs WHERE status IN (", in, ") ORDER BY seq"));
    for (size_t i = 0; i < statuses.size(); ++i) {
      s.Bind(static_cast<int>(i + 1), JobStatusName(statuses[i]));
    }
    return ReadAll<JobRecord>(s, [&](const Stmt& st) { return ReadJob(st, impl_->path); });
  });
}

// ---- events and checkpoints ----

StatusOr<EventRecord> JobStore::AddEvent(EventRecord event) {
  if (event.created_at == 0) event.created_at = UnixNow();
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(true, [&]() -> StatusOr<EventRecord> {
    KILN_ASSIGN_OR_RETURN(
        int64_t seq,
        impl_->InsertOfJob(event.job_id,
                           "INSERT INTO events (job_id, created_at, level, type, message, data) "
                           "VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                           [&](Stmt& s) {
                             s.Bind(1, event.job_id)
                                 .Bind(2, event.created_at)
                                 .Bind(3, event.level)
                                 .Bind(4, event.type)
                                 .Bind(5, event.message)
                                 .BindJson(6, event.data);
                           }));
    event.id = StrCat(kEventPrefix, seq);
    return event;
  });
}

StatusOr<Page<EventRecord>> JobStore::ListEvents(std::string_view job_id, std::string_view after,
                                                 int limit) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->ListOfJob<EventRecord>("events", kEventColumns, kEventPrefix, job_id, after, limit,
                                       ReadEvent);
}

StatusOr<std::vector<EventRecord>> JobStore::EventsSince(std::string_view job_id,
                                                         int64_t after_seq) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(false, [&]() -> StatusOr<std::vector<EventRecord>> {
    KILN_RETURN_IF_ERROR(impl_->JobExists(job_id));
    Stmt s = impl_->Prepare(StrCat("SELECT ", kEventColumns,
                                   " FROM events WHERE job_id = ?1 AND seq > ?2 ORDER BY seq"));
    s.Bind(1, job_id).Bind(2, after_seq);
    return ReadAll<EventRecord>(s, ReadEvent);
  });
}

int64_t JobStore::EventSeq(std::string_view event_id) { return SeqOf(event_id, kEventPrefix); }

StatusOr<CheckpointRecord> JobStore::AddCheckpoint(CheckpointRecord c) {
  if (c.created_at == 0) c.created_at = UnixNow();
  absl::MutexLock lock(&impl_->mu);
  return impl_->Transaction(true, [&]() -> StatusOr<CheckpointRecord> {
    KILN_ASSIGN_OR_RETURN(
        int64_t seq,
        impl_->InsertOfJob(c.job_id,
                           "INSERT INTO checkpoints (job_id, created_at, step_number, metrics, "
                           "fine_tuned_model_checkpoint, path) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                           [&](Stmt& s) {
                             s.Bind(1, c.job_id)
                                 .Bind(2, c.created_at)
                                 .Bind(3, c.step_number)
                                 .BindJson(4, c.metrics)
                                 .Bind(5, c.fine_tuned_model_checkpoint)
                                 .Bind(6, c.path);
                           }));
    c.id = StrCat(kCheckpointPrefix, seq);
    return c;
  });
}

StatusOr<Page<CheckpointRecord>> JobStore::ListCheckpoints(std::string_view job_id,
                                                           std::string_view after,
                                                           int limit) const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->ListOfJob<CheckpointRecord>("checkpoints", kCheckpointColumns, kCheckpointPrefix,
                                            job_id, after, limit, ReadCheckpoint);
}

}  // namespace kiln::finetune
