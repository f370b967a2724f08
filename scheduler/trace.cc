#include "scheduler/trace.h"

#include <chrono>
#include <map>
#include <optional>
#include <random>

#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

// Strict lowercase hex of exactly `s.size()` digits into `out` (at most 16 digits).
bool Hex(std::string_view s, uint64_t* out) {
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return false;
    }
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

int64_t UnixOffsetNs() {
  const int64_t unix_now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
  return unix_now - SteadyNanos(SteadyClock::now());
}

std::mt19937_64& Rng() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng;
}

}  // namespace

int64_t SteadyNanos(SteadyClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

std::optional<TraceContext> ParseTraceparent(std::string_view h) {
  // version "-" trace-id "-" parent-id "-" flags: 2 + 1 + 32 + 1 + 16 + 1 + 2 = 55.
  if (h.size() < 55 || h[2] != '-' || h[35] != '-' || h[52] != '-') return std::nullopt;
  uint64_t version = 0, flags = 0;
  TraceContext c;
  if (!Hex(h.substr(0, 2), &version) || version == 0xff) return std::nullopt;
  // Version 00 is exactly 55 characters; a later version may append "-..." fields.
  if (version == 0 ? h.size() != 55 : (h.size() > 55 && h[55] != '-')) return std::nullopt;
  if (!Hex(h.substr(3, 16), &c.trace_hi) || !Hex(h.substr(19, 16), &c.trace_lo) ||
      !Hex(h.substr(36, 16), &c.span_id) || !Hex(h.substr(53, 2), &flags)) {
    return std::nullopt;
  }
  if ((c.trace_hi | c.trace_lo) == 0 || c.span_id == 0) return std::nullopt;
  c.flags = static_cast<uint8_t>(flags);
  return c;
}

std::string TraceIdHex(uint64_t hi, uint64_t lo) { return absl::StrFormat("%016x%016x", hi, lo); }

std::string SpanIdHex(uint64_t id) { return id == 0 ? "" : absl::StrFormat("%016x", id); }

std::string FormatTraceparent(const TraceContext& c) {
  return absl::StrFormat("00-%016x%016x-%016x-%02x", c.trace_hi, c.trace_lo, c.span_id, c.flags);
}

// ---- TraceSink -------------------------------------------------------------------------------

TraceSink::TraceSink(Options options, metrics::Registry* registry)
    : options_(options), unix_offset_ns_(UnixOffsetNs()) {
  if (registry == nullptr) return;
  auto& dropped = registry->AddCounter(
      "kiln_trace_spans_dropped_total",
      "Spans dropped: capture_full (a /debug/trace capture hit its limit), export_queue_full "
      "(the OTLP exporter fell behind), export_failed (the collector refused or was "
      "unreachable after retries).",
      {"reason"});
  dropped_capture_ = dropped.WithLabels({"capture_full"});
  dropped_queue_ = dropped.WithLabels({"export_queue_full"});
  dropped_export_ = dropped.WithLabels({"export_failed"});
}

TraceSink::~TraceSink() {
  {
    absl::MutexLock lock(&capture_mu_);
    stop_ = true;
  }
  if (timer_.joinable()) timer_.join();
  CloseExport();
}

uint64_t TraceSink::NewSpanId() {
  uint64_t id = 0;
  while (id == 0) id = Rng()();
  return id;
}

void TraceSink::NewTraceId(uint64_t* hi, uint64_t* lo) {
  do {
    *hi = Rng()();
    *lo = Rng()();
  } while ((*hi | *lo) == 0);
}

void TraceSink::Record(SpanRecord&& span) {
  const bool to_export = options_.export_spans && span.sampled && (span.trace_hi | span.trace_lo);
  if (capturing()) {
    absl::MutexLock lock(&capture_mu_);
    if (capture_end_) {
      if (captured_.size() < options_.capture_capacity) {
        captured_.push_back(to_export ? span : std::move(span));
      } else {
        ++capture_dropped_;
        if (dropped_capture_) dropped_capture_->Increment();
      }
    }
  }
  if (!to_export) return;
  absl::MutexLock lock(&export_mu_);
  if (export_closed_) return;
  if (export_.size() >= options_.export_capacity) {
    if (dropped_queue_) dropped_queue_->Increment();
    return;
  }
  export_.push_back(std::move(span));
}

Status TraceSink::Capture(absl::Duration duration, std::function<void(std::string)> done) {
  if (!options_.enabled) {
    return FailedPrecondition(
        "tracing is off (observability.tracing.enabled is false); there is nothing to capture");
  }
  absl::MutexLock lock(&capture_mu_);
  if (capture_end_) {
    return AlreadyExists("a trace capture is already running; retry when it has finished");
  }
  captured_.clear();
  capture_dropped_ = 0;
  capture_end_ = absl::Now() + duration;
  capture_done_ = std::move(done);
  capturing_.store(true, std::memory_order_relaxed);
  if (!timer_.joinable()) timer_ = std::thread([this] { TimerLoop(); });
  return OkStatus();
}

void TraceSink::TimerLoop() {
  for (;;) {
    std::vector<SpanRecord> spans;
    uint64_t dropped = 0;
    std::function<void(std::string)> done;
    {
      absl::MutexLock lock(&capture_mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(capture_mu_) {
        return stop_ || capture_end_.has_value();
      };
      capture_mu_.Await(absl::Condition(&woken));
      if (!stop_) {
        auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(capture_mu_) { return stop_; };
        capture_mu_.AwaitWithDeadline(absl::Condition(&stop), *capture_end_);
      }
      if (!capture_end_) return;  // stopped, no capture running
      capturing_.store(false, std::memory_order_relaxed);
      spans.swap(captured_);
      dropped = capture_dropped_;
      done = std::move(capture_done_);
      capture_done_ = nullptr;
      capture_end_.reset();
    }
    done(ChromeJson(spans, dropped));
    absl::MutexLock lock(&capture_mu_);
    if (stop_) return;
  }
}

std::string TraceSink::ChromeJson(const std::vector<SpanRecord>& spans, uint64_t dropped) const {
  using nlohmann::json;
  // pid 1: the step loops, a lane (tid) each; pid 2: the requests, a lane per trace.
  constexpr int kStepsPid = 1, kRequestsPid = 2;
  std::map<std::string, int> step_lanes;
  std::map<std::pair<uint64_t, uint64_t>, int> trace_lanes;
  json events = json::array();
  // The Chrome trace format's metadata events naming a process (pid) or a lane (tid).
  auto name_event = [&events](const char* what, int pid, std::optional<int> tid, std::string name) {
    json e = {{"name", what}, {"ph", "M"}, {"pid", pid}};
    if (tid) e["tid"] = *tid;
    e["args"] = {{"name", std::move(name)}};
    events.push_back(std::move(e));
  };
  name_event("process_name", kStepsPid, std::nullopt, "steps");
  name_event("process_name", kRequestsPid, std::nullopt, "requests");
  for (const SpanRecord& s : spans) {
    const bool step = (s.trace_hi | s.trace_lo) == 0;
    int pid = kStepsPid, tid = 0;
    if (step) {
      auto [it, added] = step_lanes.emplace(s.lane, static_cast<int>(step_lanes.size()) + 1);
      tid = it->second;
      if (added) name_event("thread_name", pid, tid, s.lane);
    } else {
      pid = kRequestsPid;
      auto [it, added] = trace_lanes.emplace(std::make_pair(s.trace_hi, s.trace_lo),
                                             static_cast<int>(trace_lanes.size()) + 1);
      tid = it->second;
      if (added) name_event("thread_name", pid, tid, "trace " + TraceIdHex(s.trace_hi, s.trace_lo));
    }
    json args = json::object();
    if (!step) {
      args["trace_id"] = TraceIdHex(s.trace_hi, s.trace_lo);
      args["span_id"] = SpanIdHex(s.span_id);
      args["parent_id"] = SpanIdHex(s.parent_id);
    }
    for (const SpanAttr& a : s.attrs) {
      std::visit([&](const auto& v) { args[a.key] = v; }, a.value);
    }
    if (s.error) args["error"] = s.status_message;
    // Microseconds since the Unix epoch, to the nanosecond.
    events.push_back({{"name", s.name},
                      {"cat", step ? "step" : "request"},
                      {"ph", "X"},
                      {"ts", static_cast<double>(UnixNanos(s.start_ns)) / 1e3},
                      {"dur", static_cast<double>(s.end_ns - s.start_ns) / 1e3},
                      {"pid", pid},
                      {"tid", tid},
                      {"args", std::move(args)}});
  }
  json doc = {{"traceEvents", std::move(events)},
              {"displayTimeUnit", "ms"},
              {"otherData", {{"spans", spans.size()}, {"dropped_spans", dropped}}}};
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

bool TraceSink::PopExport(std::vector<SpanRecord>* out, size_t max, absl::Duration wait) {
  absl::MutexLock lock(&export_mu_);
  auto ready = [this, max]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(export_mu_) {
    return export_closed_ || export_.size() >= max;
  };
  export_mu_.AwaitWithTimeout(absl::Condition(&ready), wait);
  while (!export_.empty() && out->size() < max) {
    out->push_back(std::move(export_.front()));
    export_.pop_front();
  }
  return !(export_closed_ && out->empty());
}

void TraceSink::CloseExport() {
  absl::MutexLock lock(&export_mu_);
  export_closed_ = true;
}

bool TraceSink::export_closed() {
  absl::MutexLock lock(&export_mu_);
  return export_closed_;
}

void TraceSink::CountExportFailed(size_t n) {
  if (dropped_export_) dropped_export_->Increment(static_cast<double>(n));
}

// ---- RequestTrace ----------------------------------------------------------------------------

std::shared_ptr<RequestTrace> RequestTrace::Begin(TraceSink* sink, std::string name,
                                                  std::optional<std::string_view> traceparent,
                                                  std::optional<std::string_view> tracestate,
                                                  SteadyClock::time_point start) {
  if (sink == nullptr || !sink->enabled()) return nullptr;
  std::shared_ptr<RequestTrace> t(new RequestTrace(sink, std::move(name), start));
  std::optional<TraceContext> parent;
  if (traceparent) parent = ParseTraceparent(*traceparent);
  if (parent) {
    t->root_ = *parent;
    t->remote_parent_ = parent->span_id;
    // tracestate belongs to the parent; without a valid traceparent it is dropped (W3C).
    if (tracestate) t->tracestate_ = std::string(*tracestate);
  } else {
    TraceSink::NewTraceId(&t->root_.trace_hi, &t->root_.trace_lo);
    t->root_.flags = 1;  // sampled
  }
  t->root_.span_id = TraceSink::NewSpanId();
  return t;
}

RequestTrace::~RequestTrace() { End(); }

std::string RequestTrace::traceparent() const { return FormatTraceparent(root_); }

void RequestTrace::Span(std::string_view name, SteadyClock::time_point start,
                        SteadyClock::time_point end, std::vector<SpanAttr> attrs) {
  if (!sink_->recording()) return;
  SpanRecord s;
  s.trace_hi = root_.trace_hi;
  s.trace_lo = root_.trace_lo;
  s.span_id = TraceSink::NewSpanId();
  s.parent_id = root_.span_id;
  s.name = std::string(name);
  s.start_ns = SteadyNanos(start);
  s.end_ns = SteadyNanos(end);
  s.sampled = root_.sampled();
  s.attrs = std::move(attrs);
  sink_->Record(std::move(s));
}

void RequestTrace::Attr(std::string key, std::variant<int64_t, std::string> value) {
  absl::MutexLock lock(&mu_);
  attrs_.push_back({std::move(key), std::move(value)});
}

void RequestTrace::End(const Status& status, SteadyClock::time_point end) {
  SpanRecord s;
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    s.attrs = std::move(attrs_);
  }
  if (!sink_->recording()) return;
  s.trace_hi = root_.trace_hi;
  s.trace_lo = root_.trace_lo;
  s.span_id = root_.span_id;
  s.parent_id = remote_parent_;
  s.name = name_;
  s.kind = SpanKind::kServer;
  s.start_ns = SteadyNanos(start_);
  s.end_ns = SteadyNanos(end);
  s.sampled = root_.sampled();
  if (!status.ok()) {
    s.error = true;
    s.status_message = std::string(status.message());
  }
  sink_->Record(std::move(s));
}

}  // namespace kiln
