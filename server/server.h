// kilnd's server: owns the model repository, the metrics registry and every front end, and
// runs the start-up and shutdown sequences.
//
// Shutdown (SIGTERM/SIGINT, see main.cc):
//   1. readiness goes false at once (ServerReady, /v2/health/ready, gRPC health NOT_SERVING);
//      new inference requests are refused with UNAVAILABLE / 503; health probes still answer;
//   2. in-flight requests finish, until server.shutdown_grace_seconds;
//   3. what is left is cancelled with a clear status ("cancelled: ... shutting down");
//   4. the front ends close.
// Shutdown() reports whether everything finished in time; kilnd exits 0 if so, 1 if not.
//
// Thread-safety: Start, then Shutdown once, from one thread; the accessors from any thread.
#pragma once

#include <memory>

#include "config/config.h"
#include "engine/base/metrics.h"
#include "server/core.h"

namespace kiln {

class GrpcFrontEnd;
class OtlpExporter;
class TraceSink;
class HttpFrontEnds;
namespace finetune {
class FineTuningService;
}

class Server {
 public:
  // `llm_loader` builds the models of `kind: llm` entries; unset, models::LoadLlm (weights from
  // `path`). Tests pass a fake; everything else is kilnd's own wiring.
  explicit Server(config::Config config, LlmLoader llm_loader = {});
  ~Server();

  // Registers metrics, loads the start-up models, binds every front end. On error nothing is
  // left listening.
  Status Start();

  // The shutdown sequence above. Returns true if all in-flight work finished within the
  // grace period.
  bool Shutdown();

  int grpc_port() const;
  int http_port() const;
  int metrics_port() const;
  const ServerCore& core() const { return core_; }
  ServerCore& core() { return core_; }
  metrics::Registry& registry() { return registry_; }

 private:
  void RegisterServerMetrics();

  config::Config config_;
  metrics::Registry registry_;
  std::unique_ptr<TraceSink> tracer_;  // before the repository: its batchers record into it
  std::unique_ptr<InferenceMetricFamilies> families_;
  std::unique_ptr<LlmMetricFamilies> llm_families_;
  std::unique_ptr<ModelRepository> repository_;
  std::unique_ptr<InflightLimiter> limiter_;
  ServerCore core_;
  std::unique_ptr<finetune::FineTuningService> fine_tuning_;  // after the repository it uses
  std::unique_ptr<GrpcFrontEnd> grpc_;
  std::unique_ptr<HttpFrontEnds> http_;
  std::unique_ptr<OtlpExporter> otlp_;  // observability.otlp.endpoint set
};

}  // namespace kiln
