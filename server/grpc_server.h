// The gRPC front end: inference.GRPCInferenceService (KServe v2 + Triton extensions),
// kiln.v1.Generation, kiln.v1.FineTuning (server/finetune/finetune_grpc.h),
// grpc.health.v1.Health and server reflection on one port.
//
// Health service names: "" (the server), "inference.GRPCInferenceService" (same), and each
// model's name (SERVING while the model is READY).
//
// Thread-safety: Start, SetModelServing and Shutdown may be called from any thread; Start
// before the others.
#pragma once

#include <memory>
#include <string>

#include "server/core.h"

namespace grpc {
class Server;
}

namespace kiln {

class KServeGrpcService;

class GrpcFrontEnd {
 public:
  explicit GrpcFrontEnd(ServerCore* core);
  ~GrpcFrontEnd();

  // Binds server.grpc.address and starts serving. A clear error if the address is in use or
  // invalid.
  Status Start();
  int port() const { return port_; }

  // Updates the health status of one service name.
  void SetServing(const std::string& service, bool serving);

  // Sets every health status to NOT_SERVING; then waits for in-flight RPCs until `deadline`
  // and cancels the rest.
  void Shutdown(SteadyClock::time_point deadline);

 private:
  ServerCore* core_;
  std::unique_ptr<KServeGrpcService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace kiln
