#include "server/grpc_auth.h"

#include "server/auth.h"

namespace kiln {

Status AuthorizeGrpc(const ServerCore& core, const grpc::CallbackServerContext& ctx, RouteClass c,
                     std::string_view method) {
  if (core.auth == nullptr || core.auth->IsOpen(c)) return OkStatus();
  std::optional<std::string_view> value;
  const auto& metadata = ctx.client_metadata();  // keys are lower case on the wire
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    value = std::string_view(it->second.data(), it->second.size());
  }
  const std::string peer = ctx.peer();
  return core.auth->Check(AuthProtocol::kGrpc, value, c, peer, method).status();
}

grpc::ServerUnaryReactor* RefuseUnary(const ServerCore& core, grpc::CallbackServerContext* ctx,
                                      RouteClass c, std::string_view method) {
  Status s = AuthorizeGrpc(core, *ctx, c, method);
  if (s.ok()) return nullptr;
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

}  // namespace kiln
