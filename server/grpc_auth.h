// The API-key check of every gRPC handler (server/auth.h), and reactors that refuse a
// streaming call at once.
//
// gRPC 1.51's server interceptors cannot end a call, so each handler of
// inference.GRPCInferenceService, kiln.v1.Generation and kiln.v1.FineTuning starts with
//   if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
// (streaming ones with AuthorizeGrpc and a Refused*Reactor) before it looks at the request.
// tests/system/test_auth.py walks every method the server serves (through reflection) to prove none
// is missed. grpc.health.v1.Health and server reflection are gRPC's own services and stay open.
//
// Thread-safety: as Authenticator.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string_view>

#include "server/core.h"
#include "server/http_routes.h"
#include "server/status_mapping.h"

namespace kiln {

// Checks the call's `authorization` metadata for class `c`; OK when it passes (or auth is
// off). `method` names the RPC in the refusal's log line; by default the calling handler's
// name ("ModelInfer").
Status AuthorizeGrpc(const ServerCore& core, const grpc::CallbackServerContext& ctx, RouteClass c,
                     std::string_view method = __builtin_FUNCTION());

// For a unary handler: nullptr when the caller's key passes for `c`; else the call's default
// reactor, already finished with the refusal, for the handler to return.
grpc::ServerUnaryReactor* RefuseUnary(const ServerCore& core, grpc::CallbackServerContext* ctx,
                                      RouteClass c, std::string_view method = __builtin_FUNCTION());

// A server-streaming call refused before it started.
template <typename Response>
class RefusedWriteReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  explicit RefusedWriteReactor(const Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// A bidirectional-streaming call refused before it read anything.
template <typename Request, typename Response>
class RefusedBidiReactor final : public grpc::ServerBidiReactor<Request, Response> {
 public:
  explicit RefusedBidiReactor(const Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace kiln
