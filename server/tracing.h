// Front ends' side of per-request traces (scheduler/trace.h): a request's trace begins from
// the client's W3C `traceparent` (HTTP header or gRPC metadata; `tracestate` is passed
// through) and the server span's context goes back in the response's `traceparent` header /
// gRPC initial metadata. All functions return or take null when tracing is off.
#pragma once

#include <memory>
#include <string>

#include "grpcpp/server_context.h"
#include "scheduler/trace.h"
#include "server/core.h"
#include "server/http/http_server.h"

namespace kiln {

// The root span's name is the method and the route template ("POST /v2/models/{model}/infer"),
// so that names stay few; `name` overrides it.
// `start`: the request's arrival.
std::shared_ptr<RequestTrace> BeginHttpTrace(const ServerCore& core, const http::Request& req,
                                             std::string name = "",
                                             SteadyClock::time_point start = SteadyClock::now());
// `traceparent` (and `tracestate` when the client sent one) for the response; none when null.
http::Headers TraceHeaders(const RequestTrace* trace);

// `name` is the RPC's method ("kiln.v1.Generation/GenerateStream").
std::shared_ptr<RequestTrace> BeginGrpcTrace(const ServerCore& core,
                                             const grpc::ServerContextBase& ctx, std::string name);
// Adds `traceparent` (and `tracestate`) to the RPC's initial metadata. REQUIRES: before the
// initial metadata is sent (the first write, or Finish).
void AddTraceMetadata(const RequestTrace* trace, grpc::ServerContextBase* ctx);

}  // namespace kiln
