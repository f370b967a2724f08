// Exports the TraceSink's request spans to an OpenTelemetry collector over OTLP/HTTP with the
// JSON encoding (POST {endpoint} with Content-Type: application/json; ids as hex, times as
// decimal strings of Unix nanoseconds). Our own small exporter: opentelemetry-cpp is not
// packaged in Debian 12 or on PyPI, and what Kiln needs of it is this one request.
//
// A background thread takes batches of up to 512 spans (or what arrived within a second),
// POSTs each with a timeout of otlp.timeout_seconds, and retries 429, 502, 503, 504 and
// connection failures 3 times with backoff (0.5, 1, 2 s); then the batch is dropped and
// counted (kiln_trace_spans_dropped_total{reason="export_failed"}). Only http:// endpoints:
// Create refuses https:// with a message saying so (put a local collector or sidecar in
// front). Metrics: kiln_trace_spans_exported_total, kiln_trace_export_requests_total{result}.
//
// Thread-safety: Create, then the destructor, from one thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "config/config.h"
#include "engine/base/metrics.h"
#include "scheduler/trace.h"

namespace kiln {

struct OtlpEndpoint {
  std::string host, port, target;  // "collector", "4318", "/v1/traces"
};
// "http://HOST[:PORT][/PATH]" (port 80 and path /v1/traces when left out). InvalidArgument
// naming observability.otlp.endpoint otherwise, https:// included.
StatusOr<OtlpEndpoint> ParseOtlpEndpoint(std::string_view url);

// The ExportTraceServiceRequest of `spans` in OTLP's JSON encoding.
std::string OtlpJson(const std::vector<SpanRecord>& spans, const TraceSink& sink,
                     std::string_view service_name);

class OtlpExporter {
 public:
  // Starts the export thread. Errors: ParseOtlpEndpoint's. `sink` (created with
  // export_spans) and `registry` (may be null) must outlive the exporter.
  static StatusOr<std::unique_ptr<OtlpExporter>> Create(const config::ObservabilityConfig& config,
                                                        TraceSink* sink,
                                                        metrics::Registry* registry);
  // Closes the sink's export queue, sends what is queued (one try per batch), joins.
  ~OtlpExporter();

 private:
  OtlpExporter(OtlpEndpoint endpoint, const config::ObservabilityConfig& config, TraceSink* sink,
               metrics::Registry* registry);
  void Loop();
  // One POST; the HTTP status, or Unavailable for a connection failure or a timeout.
  StatusOr<int> Post(const std::string& body) const;

  const OtlpEndpoint endpoint_;
  const std::string service_name_;
  const double timeout_seconds_;
  TraceSink* const sink_;
  metrics::Counter* exported_ = nullptr;
  metrics::Counter* requests_ok_ = nullptr;
  metrics::Counter* requests_retried_ = nullptr;
  metrics::Counter* requests_failed_ = nullptr;
  std::thread thread_;
};

}  // namespace kiln
