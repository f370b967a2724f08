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
#include "server/tls/tls.h"

namespace grpc {
class Server;
namespace experimental {
class CertificateProviderInterface;
}
}  // namespace grpc

namespace kiln {

class KServeGrpcService;

class GrpcFrontEnd {
 public:
  explicit GrpcFrontEnd(ServerCore* core);
  ~GrpcFrontEnd();

  // Binds server.grpc.address and starts serving, over TLS when `tls` is given (checked by
  // tls::LoadFiles). A clear error if the address is in use or invalid.
  Status Start(const tls::Pem* tls = nullptr);

  // New TLS material for new connections (open ones keep theirs). gRPC's certificate watcher
  // reads kilnd's in-memory copy of the files once a second, so the change takes effect within
  // about a second of the call. REQUIRES: started with TLS.
  Status ReloadTls(const tls::Pem& pem);
  int port() const { return port_; }

  // Updates the health status of one service name.
  void SetServing(const std::string& service, bool serving);

  // Sets every health status to NOT_SERVING; then waits for in-flight RPCs until `deadline`
  // and cancels the rest.
  void Shutdown(SteadyClock::time_point deadline);

 private:
  ServerCore* core_;
  std::unique_ptr<KServeGrpcService> service_;
  // TLS: what the certificate watcher reads; both outlive server_ (declared before it).
  std::unique_ptr<tls::MemoryFiles> tls_files_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> tls_provider_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace kiln
