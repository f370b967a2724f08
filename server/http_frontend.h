// The HTTP front ends: KServe v2 REST on server.http.address and Prometheus /metrics on
// server.metrics.address.
//
// KServe v2 REST routes (docs/api.md has examples):
//   GET  /v2/health/live, /v2/health/ready
//   GET  /v2                                        server metadata
//   GET  /v2/models/{m}[/versions/{v}]               model metadata
//   GET  /v2/models/{m}[/versions/{v}]/ready
//   GET  /v2/models/{m}[/versions/{v}]/config        (Triton extension)
//   GET  /v2/models[/{m}[/versions/{v}]]/stats       (Triton extension)
//   POST /v2/models/{m}[/versions/{v}]/infer         JSON, or JSON + binary tensor data
//   POST /v2/repository/index, /v2/repository/models/{m}/load, .../unload
// Errors are {"error": "<message>"} with the status from server/status_mapping.h.
//
// Before any handler runs, both listeners look the request up in server/http_routes.h (a path
// no route matches is 404 there) and check its API key for the route's class (server/auth.h):
// 401 (with `WWW-Authenticate: Bearer`) or 403, in OpenAI's error shape under /v1 and in the
// one above elsewhere.
#pragma once

#include <memory>

#include "server/core.h"
#include "server/tls/tls.h"

namespace kiln {

namespace http {
class Server;
}
namespace finetune {
class FineTuningHttp;
}

class HttpFrontEnds {
 public:
  explicit HttpFrontEnds(ServerCore* core);
  ~HttpFrontEnds();

  // Binds whichever of server.http / server.metrics are enabled; with `tls`, server.http
  // serves TLS with it, and so does server.metrics if server.tls.metrics. Updating `tls`
  // changes the certificate for new connections on both.
  Status Start(std::shared_ptr<tls::ServerContext> tls = nullptr);
  int http_port() const;
  int metrics_port() const;

  // Stops accepting connections; waits for in-flight responses until `deadline`; closes the
  // rest. Returns the number of HTTP requests cut off.
  int Shutdown(SteadyClock::time_point deadline);

 private:
  ServerCore* core_;
  std::unique_ptr<finetune::FineTuningHttp> fine_tuning_;  // /v1/files, /v1/fine_tuning
  std::unique_ptr<http::Server> http_;
  std::unique_ptr<http::Server> metrics_;
};

}  // namespace kiln
