// Per-request traces: W3C trace context, span records, and the process-wide sink that feeds
// GET /debug/trace (a Chrome trace capture) and the OTLP exporter.
//
//   TraceSink sink({.enabled = true, .export_spans = true}, &registry);  // owned by the Server
//   auto trace = RequestTrace::Begin(&sink, "POST /v1/chat/completions", header("traceparent"),
//                                    header("tracestate"), received_at);  // null when off
//   response.headers.emplace_back("traceparent", trace->traceparent());
//   trace->Span("admission", received_at, SteadyClock::now());
//   ...
//   trace->End(status);  // the root (server) span; the destructor ends it if nobody did
//
// A request's spans: the root span (the front end's server span, parented on the client's
// traceparent when one was sent) and its children — admission, queue, one per prefill chunk,
// decode, detokenize and response for LLMs; admission, queue, execute and response for tensor
// models. The model step loops add step spans (trace id zero, a lane per loop) while a capture
// runs, so a capture shows what every step computed next to the requests it served.
//
// Cost: with tracing disabled Begin returns null and every hook is one branch on a null
// pointer. Enabled, a request costs a few ids and a traceparent string; span records are only
// built while someone wants them (recording(): a capture runs or the exporter is on).
//
// Buffers are bounded: a capture keeps at most Options::capture_capacity spans, the export
// queue Options::export_capacity; spans beyond either are dropped and counted
// (kiln_trace_spans_dropped_total{reason}).
//
// Thread-safety: TraceSink and RequestTrace are thread-safe, except RequestTrace::llm, which
// only the request's continuous batcher loop touches.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/base/metrics.h"
#include "engine/base/status.h"

namespace kiln {

using SteadyClock = std::chrono::steady_clock;

// W3C trace context (https://www.w3.org/TR/trace-context/): a 128-bit trace id, the 64-bit id
// of the parent span, and the trace flags (bit 0: sampled).
struct TraceContext {
  uint64_t trace_hi = 0, trace_lo = 0;
  uint64_t span_id = 0;
  uint8_t flags = 0;
  bool sampled() const { return (flags & 1) != 0; }
};

// Parses a `traceparent` header strictly: version 00, lowercase hex, the four fields of
// exactly 2-32-16-2 digits, non-zero trace and span ids. Anything else: nullopt (the caller
// starts a new trace; an invalid header is never an error). Version ff is invalid; a future
// version (01..fe) is read by its first four fields when what follows is "-"-separated.
std::optional<TraceContext> ParseTraceparent(std::string_view header);
// "00-<trace id>-<span id>-<flags>".
std::string FormatTraceparent(const TraceContext& context);
std::string TraceIdHex(uint64_t hi, uint64_t lo);  // 32 lowercase hex digits
std::string SpanIdHex(uint64_t id);                // 16 lowercase hex digits (0 -> "")

// OTLP's SpanKind numbers.
enum class SpanKind : uint8_t { kInternal = 1, kServer = 2 };

struct SpanAttr {
  std::string key;
  std::variant<int64_t, std::string> value;
};

// One finished span. Times are steady-clock nanoseconds (TraceSink::UnixNanos converts).
struct SpanRecord {
  uint64_t trace_hi = 0, trace_lo = 0;  // zero: a step span (not part of a request)
  uint64_t span_id = 0;
  uint64_t parent_id = 0;  // 0: none (a root without a remote parent)
  std::string name;
  SpanKind kind = SpanKind::kInternal;
  int64_t start_ns = 0, end_ns = 0;
  bool error = false;
  std::string status_message;  // with error
  bool sampled = true;         // exported only when sampled
  std::string lane;            // step spans: the step loop ("model smollm2")
  std::vector<SpanAttr> attrs;
};

int64_t SteadyNanos(SteadyClock::time_point t);

class TraceSink {
 public:
  struct Options {
    bool enabled = true;                // observability.tracing.enabled
    bool export_spans = false;          // an exporter drains the export queue (PopExport)
    size_t capture_capacity = 1 << 18;  // spans one capture keeps
    size_t export_capacity = 1 << 14;   // spans waiting for the exporter
  };
  // `registry` may be null (no metrics).
  TraceSink(Options options, metrics::Registry* registry);
  // Ends a running capture (its callback gets what was captured) and joins the timer thread.
  ~TraceSink();
  TraceSink(const TraceSink&) = delete;
  TraceSink& operator=(const TraceSink&) = delete;

  bool enabled() const { return options_.enabled; }
  // Whether span records are wanted now (a capture runs or export is on). Relaxed: a span
  // ending as a capture starts may or may not be in it.
  bool recording() const {
    return options_.export_spans || capturing_.load(std::memory_order_relaxed);
  }
  bool capturing() const { return capturing_.load(std::memory_order_relaxed); }

  // Takes a finished span: into the running capture, and (when sampled and not a step span)
  // into the export queue.
  void Record(SpanRecord&& span);

  // Unix-epoch nanoseconds of a steady-clock time (offset measured once, at construction).
  int64_t UnixNanos(int64_t steady_ns) const { return steady_ns + unix_offset_ns_; }

  // Random non-zero ids.
  static uint64_t NewSpanId();
  static void NewTraceId(uint64_t* hi, uint64_t* lo);

  // ---- /debug/trace ----
  // Captures spans for `duration`, then calls `done` (on the sink's timer thread) with the
  // Chrome Trace Event Format JSON. FailedPrecondition when tracing is disabled, AlreadyExists when
  // a capture is already running (one at a time). `done` must not block.
  Status Capture(absl::Duration duration, std::function<void(std::string json)> done);

  // ---- export (OTLP) ----
  // Moves up to `max` queued spans into `out`, waiting until `max` are queued, `wait`
  // passed, or CloseExport. Returns false once closed and empty.
  bool PopExport(std::vector<SpanRecord>* out, size_t max, absl::Duration wait);
  // Wakes PopExport for good (shutdown).
  void CloseExport();
  bool export_closed();
  // Counts spans the exporter gave up on (kiln_trace_spans_dropped_total{reason="export_failed"}).
  void CountExportFailed(size_t n);

  // The Chrome Trace Event Format document of `spans` (exposed for tests).
  std::string ChromeJson(const std::vector<SpanRecord>& spans, uint64_t dropped) const;

 private:
  void TimerLoop();

  const Options options_;
  const int64_t unix_offset_ns_;
  std::atomic<bool> capturing_{false};
  metrics::Counter* dropped_capture_ = nullptr;
  metrics::Counter* dropped_queue_ = nullptr;
  metrics::Counter* dropped_export_ = nullptr;

  absl::Mutex capture_mu_;
  std::vector<SpanRecord> captured_ ABSL_GUARDED_BY(capture_mu_);
  uint64_t capture_dropped_ ABSL_GUARDED_BY(capture_mu_) = 0;
  std::optional<absl::Time> capture_end_ ABSL_GUARDED_BY(capture_mu_);
  std::function<void(std::string)> capture_done_ ABSL_GUARDED_BY(capture_mu_);
  bool stop_ ABSL_GUARDED_BY(capture_mu_) = false;
  std::thread timer_;  // started by the first Capture

  absl::Mutex export_mu_;
  std::deque<SpanRecord> export_ ABSL_GUARDED_BY(export_mu_);
  bool export_closed_ ABSL_GUARDED_BY(export_mu_) = false;
};

// One request's trace: its root (server) span and the children recorded against it.
class RequestTrace {
 public:
  // Starts the trace of a request received at `start`: a child of `traceparent` when that
  // parses, else a new trace. Returns null when `sink` is null or tracing is disabled.
  static std::shared_ptr<RequestTrace> Begin(TraceSink* sink, std::string name,
                                             std::optional<std::string_view> traceparent,
                                             std::optional<std::string_view> tracestate,
                                             SteadyClock::time_point start);
  // Ends the root span now if End was not called.
  ~RequestTrace();

  // The root span's context, to return to the client ("traceparent" response header / gRPC
  // initial metadata), and the client's tracestate (passed through; may be empty).
  std::string traceparent() const;
  const std::string& tracestate() const { return tracestate_; }
  const TraceContext& root() const { return root_; }
  bool recording() const { return sink_->recording(); }
  SteadyClock::time_point start() const { return start_; }  // the request's arrival
  TraceSink* sink() const { return sink_; }

  // Records a child span of the root, [start, end). Does nothing unless recording().
  void Span(std::string_view name, SteadyClock::time_point start, SteadyClock::time_point end,
            std::vector<SpanAttr> attrs = {});
  // Adds an attribute to the root span.
  void Attr(std::string key, std::variant<int64_t, std::string> value);
  // Ends the root span (once; later calls do nothing). A non-OK status marks it an error.
  void End(const Status& status = OkStatus(), SteadyClock::time_point end = SteadyClock::now());

  // What the continuous batcher keeps between steps to build the decode and detokenize
  // spans. Touched only on the request's batcher loop thread.
  struct LlmState {
    bool queued_span = false;  // the queue span was recorded
    int32_t prefill_chunks = 0;
    int64_t decode_steps = 0;
    SteadyClock::time_point decode_start{}, decode_end{};
    SteadyClock::time_point first_token{};
    int64_t detokenize_ns = 0;
    int64_t detokenized = 0;
  } llm;

 private:
  RequestTrace(TraceSink* sink, std::string name, SteadyClock::time_point start)
      : sink_(sink), name_(std::move(name)), start_(start) {}

  TraceSink* const sink_;
  const std::string name_;
  const SteadyClock::time_point start_;
  TraceContext root_;           // trace id, this request's server span id, flags
  uint64_t remote_parent_ = 0;  // the client's span, when it sent one
  std::string tracestate_;
  absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<SpanAttr> attrs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
