// The flight recorder: a fixed-size ring of a model's recent events — its steps (LLMs) or
// batches (tensor models) with their composition and phase durations, and its requests' state
// changes — plus the step or batch in progress with its requests. Dumped as JSON on SIGUSR1,
// at GET /debug/flight_recorder and by the watchdog (server/flight_service.h), which asks
// FindStuck for work in progress too long.
//
// One recorder per loaded model (Model owns it; `observability.flight_recorder.enabled: false`
// means none, and the hooks cost one null check). The ring holds `entries` slots, all
// allocated by the constructor: recording copies a plain FlightEvent (request ids truncated to
// kFlightIdBytes - 1 bytes) into the next slot and never allocates.
//
// Work in progress: a model has `work_slots` of it at a time (an LLM: 1, its loop; a tensor
// model: one per instance). BeginWork marks a slot busy from a start time, with up to
// `max_work_requests` request ids (the capacity reserved at construction); EndWork records
// the end event and frees the slot. The watchdog's rule (FindStuck): work in progress for
// longer than the limit is stuck, reported once per BeginWork.
//
// Thread-safety: every method is thread-safe. One absl::Mutex guards the ring and the work
// slots (a seqlock would spare readers the lock, but the readers are rare dumps and the
// writers one loop per model: the mutex is uncontended). Record holds it for one copy of a
// FlightEvent (~220 bytes); a whole RecordRequest costs ~0.2 us on a busy 2-core VM (clock
// read included; flight_recorder_test's RecordCost). ToJson holds it only to copy the ring (4096
// events: ~0.9 MB) and builds the JSON outside it (~25 ms for 4096 events on that VM).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json_fwd.hpp"

namespace kiln {

using SteadyClock = std::chrono::steady_clock;

inline constexpr size_t kFlightIdBytes = 64;      // a request id, NUL-terminated
inline constexpr size_t kFlightDetailBytes = 48;  // a finish reason or status, NUL-terminated

enum class FlightEventKind : uint8_t {
  kStepBegin,   // LLM: a step was scheduled (composition, schedule time)
  kStepEnd,     // LLM: a step's outputs were processed (phase durations, launches, KV)
  kBatchBegin,  // tensor model: a batch went to an instance
  kBatchEnd,    // tensor model: the instance returned it
  kRequest,     // a request changed state
};

enum class FlightRequestState : uint8_t {
  kQueued,     // accepted into the model's queue
  kAdmitted,   // LLM: scheduled for the first time (its prompt starts prefilling)
  kResumed,    // LLM: scheduled again after a preemption
  kPreempted,  // LLM: its KV blocks were taken back; it waits to be recomputed
  kRunning,    // tensor model: in a batch handed to an instance (work_id: the batch)
  kFinished,   // answered normally (detail: stop, length, ...)
  kCancelled,  // the client went away
  kTimedOut,   // its deadline or queue timeout passed
  kFailed,     // answered with an error (detail: the status code), shutdown included
};

std::string_view FlightEventKindName(FlightEventKind kind);         // "step_begin", ...
std::string_view FlightRequestStateName(FlightRequestState state);  // "queued", ...

// One event: a plain value. Which fields mean something depends on `kind` (the JSON shows
// only those).
struct FlightEvent {
  int64_t wall_ns = 0;   // unix time of the event, ns (set by Record when 0)
  uint64_t work_id = 0;  // the step or batch (kRequest: the step or batch it concerns, or 0)
  FlightEventKind kind = FlightEventKind::kRequest;
  FlightRequestState state = FlightRequestState::kQueued;  // kRequest
  bool replayed = false;  // kStepEnd: a captured program ran (graph replay), else direct
  bool ok = true;         // kStepEnd, kBatchEnd: the model's step or execute succeeded
  int32_t seqs = 0;       // step: sequences; batch: requests
  int32_t rows = 0;       // batch: rows along dimension 0
  int32_t prefill_tokens = 0, decode_tokens = 0;    // step
  int32_t adapters = 0;                             // step: distinct LoRA adapters in it
  int32_t admitted = 0, preempted = 0;              // step: by its schedule
  int32_t launches = -1;                            // kStepEnd: kernel launches; -1 not counted
  int32_t padded_seqs = 0;                          // kStepEnd: batch size the step ran at
  int32_t kv_blocks_used = 0, kv_blocks_total = 0;  // step
  // Phase durations, ns. Step: schedule (begin), build, run, process (end). Batch: run (the
  // instance's execute) and total (end).
  int64_t schedule_ns = 0, build_ns = 0, run_ns = 0, process_ns = 0, total_ns = 0;
  char request_id[kFlightIdBytes] = {};
  char detail[kFlightDetailBytes] = {};
};

// Copies `s` into a fixed field, truncating (whole UTF-8 characters are not guaranteed; the
// JSON replaces a cut character).
template <size_t N>
void SetFlightField(char (&field)[N], std::string_view s) {
  const size_t n = std::min(s.size(), N - 1);
  for (size_t i = 0; i < n; ++i) field[i] = s[i];
  field[n] = '\0';
}

// What the watchdog reports: work in progress longer than the limit.
struct FlightStuckWork {
  std::string model;
  std::string kind;    // "step", "batch", or "request" (a running request without progress)
  uint64_t id = 0;     // the step or batch; 0 for a request
  double seconds = 0;  // in progress this long
  std::vector<std::string> requests;
};

class FlightRecorder {
 public:
  enum class WorkKind : uint8_t { kStep, kBatch };
  struct Options {
    int entries = 4096;         // ring size, >= 1
    int work_slots = 1;         // units of work in progress at once (LLM 1, tensor: instances)
    int max_work_requests = 0;  // request ids kept per unit of work (more are counted only)
    // The watchdog's limit, for a batcher that watches its running requests (LLMs: a running
    // sequence that no step included for this long); 0: not watched.
    double watchdog_seconds = 0;
  };
  FlightRecorder(std::string model, std::string model_kind, Options options);

  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  const std::string& model() const { return model_; }
  const Options& options() const { return options_; }

  // Appends `event` (overwriting the oldest when full); stamps wall_ns if it is 0.
  void Record(const FlightEvent& event) ABSL_LOCKS_EXCLUDED(mu_);
  // A request state change. `id` and `detail` are truncated to their fields.
  void RecordRequest(std::string_view id, FlightRequestState state, uint64_t work_id = 0,
                     std::string_view detail = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // Marks work slot `slot` busy with work `id` since `start` (no requests yet, no event).
  // REQUIRES: 0 <= slot < work_slots.
  void BeginWork(int slot, WorkKind kind, uint64_t id, SteadyClock::time_point start)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Sets the requests of slot `slot`'s work: `id_of(i)` for i in [0, n) gives each id as a
  // string_view (called under the lock; the first max_work_requests are kept), and records
  // `begin` (its work_id set to the slot's id).
  template <typename IdOf>
  void SetWorkRequests(int slot, int n, IdOf&& id_of, FlightEvent begin) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    Work& w = work_[slot];
    w.num_requests = n;
    const int kept = std::min(n, options_.max_work_requests);
    for (int i = 0; i < kept; ++i) SetFlightField(w.requests[i].id, std::string_view(id_of(i)));
    begin.work_id = w.id;
    RecordLocked(begin);
  }
  // Frees slot `slot`; records `end` (its work_id set) unless `record` is false (the work
  // turned out empty, e.g. a step that scheduled nothing).
  void EndWork(int slot, FlightEvent end, bool record = true) ABSL_LOCKS_EXCLUDED(mu_);

  // A request its batcher found running without progress for `seconds` (the batcher reports
  // each once); FindStuck hands it to the watchdog as kind "request".
  void ReportStuckRequest(std::string_view id, double seconds) ABSL_LOCKS_EXCLUDED(mu_);

  // Work in progress since before `now - limit` not yet reported by FindStuck; each is
  // reported once per BeginWork. Then the requests ReportStuckRequest reported since the last
  // call.
  std::vector<FlightStuckWork> FindStuck(SteadyClock::time_point now, SteadyClock::duration limit)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The ring as JSON (see docs/operations.md, "Flight recorder and watchdog"):
  //   {"model", "kind", "entries", "recorded" (events ever), "events": [oldest first],
  //    "in_progress": [{"kind", "id", "started", "seconds", "requests": [...],
  //                     "num_requests"}]}
  nlohmann::json ToJson() const ABSL_LOCKS_EXCLUDED(mu_);

  // Events ever recorded (the ring keeps the last `entries`).
  uint64_t recorded() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct RequestId {
    char id[kFlightIdBytes] = {};
  };
  struct Work {
    bool busy = false;
    bool reported = false;  // FindStuck reported it
    WorkKind kind = WorkKind::kStep;
    uint64_t id = 0;
    SteadyClock::time_point start;
    int64_t start_wall_ns = 0;
    int num_requests = 0;
    std::vector<RequestId> requests;  // max_work_requests, allocated once
  };
  void RecordLocked(const FlightEvent& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string model_;
  const std::string model_kind_;  // "llm" or "tensor"
  const Options options_;
  mutable absl::Mutex mu_;
  std::vector<FlightEvent> ring_ ABSL_GUARDED_BY(mu_);  // `entries` slots
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;              // events ever recorded
  std::vector<Work> work_ ABSL_GUARDED_BY(mu_);
  std::vector<FlightStuckWork> stuck_requests_ ABSL_GUARDED_BY(mu_);
};

// Unix time now, ns.
int64_t FlightWallNs();
// "2026-11-26T02:03:04.123456Z".
std::string FlightIsoTime(int64_t unix_ns);

}  // namespace kiln
