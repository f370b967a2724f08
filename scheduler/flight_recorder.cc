#include "scheduler/flight_recorder.h"

#include <ctime>

#include "engine/base/status.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

using nlohmann::json;

double Ms(int64_t ns) { return static_cast<double>(ns) / 1e6; }

json EventJson(const FlightEvent& e) {
  json j{{"time", FlightIsoTime(e.wall_ns)},
         {"unix_ns", e.wall_ns},
         {"kind", FlightEventKindName(e.kind)}};
  if (e.work_id != 0) j["id"] = e.work_id;
  switch (e.kind) {
    case FlightEventKind::kStepBegin:
      j["seqs"] = e.seqs;
      j["prefill_tokens"] = e.prefill_tokens;
      j["decode_tokens"] = e.decode_tokens;
      j["adapters"] = e.adapters;
      j["admitted"] = e.admitted;
      j["preempted"] = e.preempted;
      j["kv_blocks_used"] = e.kv_blocks_used;
      j["kv_blocks_total"] = e.kv_blocks_total;
      j["schedule_ms"] = Ms(e.schedule_ns);
      break;
    case FlightEventKind::kStepEnd:
      j["ok"] = e.ok;
      j["seqs"] = e.seqs;
      j["mode"] = e.replayed ? "captured" : "direct";
      j["padded_seqs"] = e.padded_seqs;
      if (e.launches >= 0) {
        j["launches"] = e.launches;
      } else {
        j["launches"] = nullptr;  // the model does not count them
      }
      j["kv_blocks_used"] = e.kv_blocks_used;
      j["kv_blocks_total"] = e.kv_blocks_total;
      j["build_ms"] = Ms(e.build_ns);
      j["run_ms"] = Ms(e.run_ns);
      j["process_ms"] = Ms(e.process_ns);
      j["total_ms"] = Ms(e.total_ns);
      break;
    case FlightEventKind::kBatchBegin:
      j["requests"] = e.seqs;
      j["rows"] = e.rows;
      break;
    case FlightEventKind::kBatchEnd:
      j["ok"] = e.ok;
      j["requests"] = e.seqs;
      j["rows"] = e.rows;
      j["run_ms"] = Ms(e.run_ns);
      j["total_ms"] = Ms(e.total_ns);
      break;
    case FlightEventKind::kRequest:
      j["request"] = std::string(e.request_id);
      j["state"] = FlightRequestStateName(e.state);
      if (e.detail[0] != '\0') j["detail"] = std::string(e.detail);
      break;
  }
  return j;
}

}  // namespace

std::string_view FlightEventKindName(FlightEventKind kind) {
  switch (kind) {
    case FlightEventKind::kStepBegin:
      return "step_begin";
    case FlightEventKind::kStepEnd:
      return "step_end";
    case FlightEventKind::kBatchBegin:
      return "batch_begin";
    case FlightEventKind::kBatchEnd:
      return "batch_end";
    case FlightEventKind::kRequest:
      return "request";
  }
  return "unknown";
}

std::string_view FlightRequestStateName(FlightRequestState state) {
  switch (state) {
    case FlightRequestState::kQueued:
      return "queued";
    case FlightRequestState::kAdmitted:
      return "admitted";
    case FlightRequestState::kResumed:
      return "resumed";
    case FlightRequestState::kPreempted:
      return "preempted";
    case FlightRequestState::kRunning:
      return "running";
    case FlightRequestState::kFinished:
      return "finished";
    case FlightRequestState::kCancelled:
      return "cancelled";
    case FlightRequestState::kTimedOut:
      return "timed_out";
    case FlightRequestState::kFailed:
      return "failed";
  }
  return "unknown";
}

int64_t FlightWallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string FlightIsoTime(int64_t unix_ns) {
  const std::time_t secs = static_cast<std::time_t>(unix_ns / 1000000000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%06dZ", static_cast<int>((unix_ns % 1000000000) / 1000));
  return buf;
}

FlightRecorder::FlightRecorder(std::string model, std::string model_kind, Options options)
    : model_(std::move(model)), model_kind_(std::move(model_kind)), options_(options) {
  KILN_CHECK(options_.entries >= 1 && options_.work_slots >= 1 && options_.max_work_requests >= 0,
             "FlightRecorder: entries and work_slots must be >= 1");
  absl::MutexLock lock(&mu_);
  ring_.resize(options_.entries);
  work_.resize(options_.work_slots);
  for (Work& w : work_) w.requests.resize(options_.max_work_requests);
}

void FlightRecorder::RecordLocked(const FlightEvent& event) {
  FlightEvent& slot = ring_[next_ % ring_.size()];
  slot = event;
  if (slot.wall_ns == 0) slot.wall_ns = FlightWallNs();
  ++next_;
}

void FlightRecorder::Record(const FlightEvent& event) {
  absl::MutexLock lock(&mu_);
  RecordLocked(event);
}

void FlightRecorder::RecordRequest(std::string_view id, FlightRequestState state, uint64_t work_id,
                                   std::string_view detail) {
  FlightEvent e;
  e.wall_ns = FlightWallNs();  // outside the lock
  e.kind = FlightEventKind::kRequest;
  e.state = state;
  e.work_id = work_id;
  SetFlightField(e.request_id, id);
  SetFlightField(e.detail, detail);
  Record(e);
}

void FlightRecorder::BeginWork(int slot, WorkKind kind, uint64_t id,
                               SteadyClock::time_point start) {
  const int64_t wall =
      FlightWallNs() -
      std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - start).count();
  absl::MutexLock lock(&mu_);
  KILN_CHECK(slot >= 0 && slot < static_cast<int>(work_.size()), "BeginWork: bad work slot");
  Work& w = work_[slot];
  w.busy = true;
  w.reported = false;
  w.kind = kind;
  w.id = id;
  w.start = start;
  w.start_wall_ns = wall;
  w.num_requests = 0;
}

void FlightRecorder::EndWork(int slot, FlightEvent end, bool record) {
  if (record && end.wall_ns == 0) end.wall_ns = FlightWallNs();
  absl::MutexLock lock(&mu_);
  Work& w = work_[slot];
  w.busy = false;
  if (!record) return;
  end.work_id = w.id;
  RecordLocked(end);
}

void FlightRecorder::ReportStuckRequest(std::string_view id, double seconds) {
  FlightStuckWork s;
  s.model = model_;
  s.kind = "request";
  s.seconds = seconds;
  s.requests.emplace_back(id);
  absl::MutexLock lock(&mu_);
  stuck_requests_.push_back(std::move(s));
}

std::vector<FlightStuckWork> FlightRecorder::FindStuck(SteadyClock::time_point now,
                                                       SteadyClock::duration limit) {
  std::vector<FlightStuckWork> out;
  absl::MutexLock lock(&mu_);
  for (Work& w : work_) {
    if (!w.busy || w.reported || now - w.start < limit) continue;
    w.reported = true;
    FlightStuckWork s;
    s.model = model_;
    s.kind = w.kind == WorkKind::kStep ? "step" : "batch";
    s.id = w.id;
    s.seconds = std::chrono::duration<double>(now - w.start).count();
    const int kept = std::min(w.num_requests, options_.max_work_requests);
    for (int i = 0; i < kept; ++i) s.requests.emplace_back(w.requests[i].id);
    out.push_back(std::move(s));
  }
  for (FlightStuckWork& s : stuck_requests_) out.push_back(std::move(s));
  stuck_requests_.clear();
  return out;
}

uint64_t FlightRecorder::recorded() const {
  absl::MutexLock lock(&mu_);
  return next_;
}

json FlightRecorder::ToJson() const {
  // Copy under the lock, serialise outside it.
  std::vector<FlightEvent> events;
  std::vector<Work> work;
  uint64_t recorded = 0;
  const SteadyClock::time_point now = SteadyClock::now();
  {
    absl::MutexLock lock(&mu_);
    recorded = next_;
    const uint64_t n = std::min<uint64_t>(next_, ring_.size());
    events.reserve(n);
    for (uint64_t i = next_ - n; i < next_; ++i) events.push_back(ring_[i % ring_.size()]);
    for (const Work& w : work_) {
      if (w.busy) work.push_back(w);
    }
  }
  json j{{"model", model_},
         {"kind", model_kind_},
         {"entries", options_.entries},
         {"recorded", recorded}};
  json& ev = j["events"] = json::array();
  for (const FlightEvent& e : events) ev.push_back(EventJson(e));
  json& progress = j["in_progress"] = json::array();
  for (const Work& w : work) {
    json requests = json::array();
    const int kept = std::min(w.num_requests, options_.max_work_requests);
    for (int i = 0; i < kept; ++i) requests.push_back(std::string(w.requests[i].id));
    progress.push_back({{"kind", w.kind == WorkKind::kStep ? "step" : "batch"},
                        {"id", w.id},
                        {"started", FlightIsoTime(w.start_wall_ns)},
                        {"seconds", std::chrono::duration<double>(now - w.start).count()},
                        {"num_requests", w.num_requests},
                        {"requests", std::move(requests)}});
  }
  return j;
}

}  // namespace kiln
