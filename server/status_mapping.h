// The one place where a kiln::Status becomes a gRPC status or an HTTP status code.
#pragma once

#include <grpcpp/support/status.h>

#include "engine/base/status.h"

namespace kiln {

// Same code (absl and gRPC share the numbering), same message.
grpc::Status ToGrpcStatus(const Status& status);

// 400 bad input, 401 no or unknown API key, 403 the key lacks the scope, 404 unknown
// model/route, 429 queue full or too many requests in flight,
// 499 cancelled by the client, 500 internal, 501 unimplemented, 503 unavailable (not ready,
// shutting down), 504 queue timeout.
int ToHttpStatus(const Status& status);

}  // namespace kiln
