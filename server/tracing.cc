#include "server/tracing.h"

#include "server/http_routes.h"

namespace kiln {
namespace {

std::optional<std::string> Metadata(const grpc::ServerContextBase& ctx, std::string_view key) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(grpc::string_ref(key.data(), key.size()));
  if (it == md.end()) return std::nullopt;
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

std::shared_ptr<RequestTrace> BeginHttpTrace(const ServerCore& core, const http::Request& req,
                                             std::string name, SteadyClock::time_point start) {
  if (core.tracer == nullptr || !core.tracer->enabled()) return nullptr;
  if (name.empty()) {
    const HttpRoute* route = FindHttpRoute(RoutePort::kHttp, req.method, req.path);
    name = StrCat(req.method, " ", route ? route->path : std::string_view("(unrouted)"));
  }
  const std::optional<std::string> parent = req.Header("traceparent");
  const std::optional<std::string> state = req.Header("tracestate");
  return RequestTrace::Begin(core.tracer, std::move(name), parent, state, start);
}

http::Headers TraceHeaders(const RequestTrace* trace) {
  http::Headers h;
  if (trace == nullptr) return h;
  h.emplace_back("traceparent", trace->traceparent());
  if (!trace->tracestate().empty()) h.emplace_back("tracestate", trace->tracestate());
  return h;
}

std::shared_ptr<RequestTrace> BeginGrpcTrace(const ServerCore& core,
                                             const grpc::ServerContextBase& ctx, std::string name) {
  if (core.tracer == nullptr || !core.tracer->enabled()) return nullptr;
  const auto start = SteadyClock::now();
  const std::optional<std::string> parent = Metadata(ctx, "traceparent");
  const std::optional<std::string> state = Metadata(ctx, "tracestate");
  return RequestTrace::Begin(core.tracer, std::move(name), parent, state, start);
}

void AddTraceMetadata(const RequestTrace* trace, grpc::ServerContextBase* ctx) {
  if (trace == nullptr) return;
  ctx->AddInitialMetadata("traceparent", trace->traceparent());
  if (!trace->tracestate().empty()) ctx->AddInitialMetadata("tracestate", trace->tracestate());
}

}  // namespace kiln
