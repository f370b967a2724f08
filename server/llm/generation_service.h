// kiln.v1.Generation (proto/kiln/v1/generation.proto) on the gRPC port, next to KServe:
// Generate, GenerateStream, Tokenize, Detokenize, ListModels.
//
// Errors: INVALID_ARGUMENT naming the field ("sampling.max_tokens", "chat.messages[1].role"),
// NOT_FOUND (unknown model), RESOURCE_EXHAUSTED (the model's queue is full, or
// server.max_inflight_requests), UNAVAILABLE (not ready, shutting down), CANCELLED,
// DEADLINE_EXCEEDED (timeout_ms or the RPC's deadline passed). Cancelling an RPC (or its
// deadline passing) cancels the generation: it leaves the batch within one step.
//
// Thread-safety: the service is shared by gRPC's threads; each RPC has its own reactor.
#pragma once

#include <memory>

#include "server/core.h"

namespace grpc {
class Service;
}

namespace kiln::llm {

// The service, to register on the server's builder. `core` must outlive it.
std::unique_ptr<grpc::Service> NewGenerationService(ServerCore* core);

}  // namespace kiln::llm
