#include "server/otlp_exporter.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <chrono>

#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

using nlohmann::json;
constexpr size_t kBatchSpans = 512;
constexpr int kRetries = 3;

json AnyValue(const std::variant<int64_t, std::string>& v) {
  if (const int64_t* i = std::get_if<int64_t>(&v)) return {{"intValue", std::to_string(*i)}};
  return {{"stringValue", std::get<std::string>(v)}};
}

}  // namespace

StatusOr<OtlpEndpoint> ParseOtlpEndpoint(std::string_view url) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument("observability.otlp.endpoint `", url, "`: ", why);
  };
  if (url.rfind("https://", 0) == 0) {
    return bad(
        "https is not supported by Kiln's OTLP exporter; export to an http:// collector (e.g. "
        "an OpenTelemetry Collector sidecar on localhost that forwards over TLS)");
  }
  if (url.rfind("http://", 0) != 0) return bad("it must start with http://");
  std::string_view rest = url.substr(7);
  OtlpEndpoint e;
  const size_t slash = rest.find('/');
  e.target = slash == std::string_view::npos ? "/v1/traces" : std::string(rest.substr(slash));
  std::string_view hostport = rest.substr(0, slash);
  size_t colon = hostport.rfind(':');
  if (!hostport.empty() && hostport.front() == '[') {  // [v6]:port
    const size_t close = hostport.find(']');
    if (close == std::string_view::npos) return bad("an IPv6 address needs its closing `]`");
    e.host = std::string(hostport.substr(1, close - 1));
    colon = close + 1 < hostport.size() && hostport[close + 1] == ':' ? close + 1
                                                                      : std::string_view::npos;
  } else {
    e.host = std::string(hostport.substr(0, colon));
  }
  e.port = colon == std::string_view::npos ? "80" : std::string(hostport.substr(colon + 1));
  if (e.host.empty()) return bad("no host");
  if (e.port.empty() || e.port.find_first_not_of("0123456789") != std::string::npos) {
    return bad("the port is not a number");
  }
  return e;
}

std::string OtlpJson(const std::vector<SpanRecord>& spans, const TraceSink& sink,
                     std::string_view service_name) {
  json out = json::array();
  for (const SpanRecord& s : spans) {
    json attrs = json::array();
    for (const SpanAttr& a : s.attrs)
      attrs.push_back({{"key", a.key}, {"value", AnyValue(a.value)}});
    json span = {{"traceId", TraceIdHex(s.trace_hi, s.trace_lo)},
                 {"spanId", SpanIdHex(s.span_id)},
                 {"name", s.name},
                 {"kind", static_cast<int>(s.kind)},
                 {"startTimeUnixNano", std::to_string(sink.UnixNanos(s.start_ns))},
                 {"endTimeUnixNano", std::to_string(sink.UnixNanos(s.end_ns))},
                 {"attributes", std::move(attrs)}};
    if (s.parent_id != 0) span["parentSpanId"] = SpanIdHex(s.parent_id);
    // STATUS_CODE_OK = 1, STATUS_CODE_ERROR = 2.
    span["status"] = s.error ? json{{"code", 2}, {"message", s.status_message}} : json{{"code", 1}};
    out.push_back(std::move(span));
  }
  json resource = {{"attributes", json::array({{{"key", "service.name"},
                                                {"value", {{"stringValue", service_name}}}}})}};
  json doc = {{"resourceSpans",
               json::array({{{"resource", std::move(resource)},
                             {"scopeSpans", json::array({{{"scope", {{"name", "kiln"}}},
                                                          {"spans", std::move(out)}}})}}})}};
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

StatusOr<std::unique_ptr<OtlpExporter>> OtlpExporter::Create(
    const config::ObservabilityConfig& config, TraceSink* sink, metrics::Registry* registry) {
  KILN_ASSIGN_OR_RETURN(OtlpEndpoint endpoint, ParseOtlpEndpoint(config.otlp.endpoint));
  return std::unique_ptr<OtlpExporter>(
      new OtlpExporter(std::move(endpoint), config, sink, registry));
}

OtlpExporter::OtlpExporter(OtlpEndpoint endpoint, const config::ObservabilityConfig& config,
                           TraceSink* sink, metrics::Registry* registry)
    : endpoint_(std::move(endpoint)),
      service_name_(config.otlp.service_name),
      timeout_seconds_(config.otlp.timeout_seconds),
      sink_(sink) {
  if (registry != nullptr) {
    exported_ = registry
                    ->AddCounter("kiln_trace_spans_exported_total",
                                 "Spans the OTLP exporter delivered to the collector.")
                    .WithLabels({});
    auto& requests = registry->AddCounter(
        "kiln_trace_export_requests_total",
        "OTLP export requests by result: ok, retried (429/5xx/unreachable, tried again), failed "
        "(given up; its spans are dropped).",
        {"result"});
    requests_ok_ = requests.WithLabels({"ok"});
    requests_retried_ = requests.WithLabels({"retried"});
    requests_failed_ = requests.WithLabels({"failed"});
  }
  spdlog::info("tracing: exporting spans over OTLP/HTTP JSON to http://{}:{}{}", endpoint_.host,
               endpoint_.port, endpoint_.target);
  thread_ = std::thread([this] { Loop(); });
}

OtlpExporter::~OtlpExporter() {
  sink_->CloseExport();
  if (thread_.joinable()) thread_.join();
}

StatusOr<int> OtlpExporter::Post(const std::string& body) const {
  namespace beast = boost::beast;
  namespace http = beast::http;
  using tcp = boost::asio::ip::tcp;
  const auto timeout = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(timeout_seconds_));
  boost::asio::io_context io;
  beast::tcp_stream stream(io);
  beast::error_code ec;
  tcp::resolver resolver(io);
  auto results = resolver.resolve(endpoint_.host, endpoint_.port, ec);
  if (ec) return Unavailable("cannot resolve ", endpoint_.host, ": ", ec.message());
  stream.expires_after(timeout);
  stream.connect(results, ec);
  if (ec) return Unavailable("cannot connect: ", ec.message());
  http::request<http::string_body> req{http::verb::post, endpoint_.target, 11};
  req.set(http::field::host, endpoint_.host + ":" + endpoint_.port);
  req.set(http::field::content_type, "application/json");
  req.set(http::field::user_agent, "kilnd-otlp");
  req.body() = body;
  req.prepare_payload();
  stream.expires_after(timeout);
  http::write(stream, req, ec);
  if (ec) return Unavailable("cannot send: ", ec.message());
  beast::flat_buffer buffer;
  http::response<http::string_body> resp;
  http::read(stream, buffer, resp, ec);
  if (ec) return Unavailable("no answer: ", ec.message());
  stream.socket().shutdown(tcp::socket::shutdown_both, ec);
  return static_cast<int>(resp.result_int());
}

void OtlpExporter::Loop() {
  std::vector<SpanRecord> batch;
  uint64_t failures = 0;
  while (sink_->PopExport(&batch, kBatchSpans, absl::Seconds(1))) {
    if (batch.empty()) continue;
    const std::string body = OtlpJson(batch, *sink_, service_name_);
    std::string last_error;
    bool ok = false;
    for (int attempt = 0; attempt <= kRetries; ++attempt) {
      StatusOr<int> code = Post(body);
      if (code.ok() && *code >= 200 && *code < 300) {
        ok = true;
        break;
      }
      last_error = code.ok() ? StrCat("HTTP ", *code) : std::string(StatusMessage(code.status()));
      const bool retryable =
          !code.ok() || *code == 429 || *code == 502 || *code == 503 || *code == 504;
      // While shutting down (queue closed) a batch gets one try.
      if (!retryable || attempt == kRetries || sink_->export_closed()) break;
      if (requests_retried_) requests_retried_->Increment();
      std::this_thread::sleep_for(std::chrono::milliseconds(500 << attempt));
    }
    if (ok) {
      if (requests_ok_) requests_ok_->Increment();
      if (exported_) exported_->Increment(static_cast<double>(batch.size()));
    } else {
      if (requests_failed_) requests_failed_->Increment();
      sink_->CountExportFailed(batch.size());
      // The first failure and then every 100th: a dead collector must not flood the log.
      if (failures++ % 100 == 0) {
        spdlog::warn("tracing: OTLP export to http://{}:{}{} failed ({}); {} span(s) dropped",
                     endpoint_.host, endpoint_.port, endpoint_.target, last_error, batch.size());
      }
    }
    batch.clear();
  }
}

}  // namespace kiln
