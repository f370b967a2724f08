// kiln.v1.FineTuning (proto/kiln/v1/fine_tuning.proto) on the gRPC port: an adapter over
// FineTuningService (scheduler/finetune/job_service.h). CreateJob builds the JSON body of
// POST /v1/fine_tuning/jobs from its message (hyper-parameters at the top level, so errors
// name `hyperparameters.<field>` as the message does) and calls the service: one validation
// path for both front ends.
//
// Threading: the service writes SQLite with fsync, so unary RPCs run on this service's two
// worker threads, never on gRPC's. Each WatchJob has a thread of its own that polls the job
// (FineTuningService::WaitForChange, 1 s at a time) and writes the stream; it ends within
// about a second of the client cancelling or of the server shutting down (UNAVAILABLE), so
// grpc::Server::Shutdown never waits on a watch. At most kMaxWatches watches at once
// (RESOURCE_EXHAUSTED past it).
//
// Errors: the service's Status through server/status_mapping.h; UNIMPLEMENTED when the
// service is absent (fine_tuning.enabled false).
#pragma once

#include <memory>

#include "server/core.h"

namespace grpc {
class Service;
}

namespace kiln::finetune {

inline constexpr int kMaxWatches = 64;

// The service, to register on the server's builder. `core` (and core->fine_tuning, which may
// be null) must outlive it; destroy it after the grpc::Server that served it has shut down.
std::unique_ptr<grpc::Service> NewFineTuningGrpcService(ServerCore* core);

}  // namespace kiln::finetune
