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
#include <string_view>

#include "config/config.h"
#include "engine/base/metrics.h"
#include "server/core.h"
#include "server/tls/tls.h"

namespace kiln {

class Authenticator;
class FlightService;
class GrpcFrontEnd;
class OtlpExporter;
class SharedMemoryManager;
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

  // Re-reads the secrets kept in files (SIGHUP, see main.cc): the TLS certificate, key and
  // client CA of server.tls, checked as at start-up, and the API key files of server.auth.
  // New connections use the new certificates; open connections keep theirs. Each reload
  // that fails (the message names the key and the file) leaves its part as it was; the
  // errors are returned together. Call from the thread that called Start, between Start and
  // Shutdown.
  Status ReloadSecrets();
  // Asks for a flight recorder dump of every model to <storage_dir>/flight/ (SIGUSR1, see
  // server/flight_service.h); returns at once, dumps requested meanwhile coalesce.
  void DumpFlightRecorder(std::string_view reason);

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
  std::unique_ptr<SharedMemoryManager> shared_memory_;
  ServerCore core_;
  std::unique_ptr<Authenticator> auth_;                       // set by Start
  std::unique_ptr<finetune::FineTuningService> fine_tuning_;  // after the repository it uses
  std::shared_ptr<tls::ServerContext> tls_context_;           // null without server.tls
  std::unique_ptr<FlightService> flight_;                     // likewise
  std::unique_ptr<GrpcFrontEnd> grpc_;
  std::unique_ptr<HttpFrontEnds> http_;
  std::unique_ptr<OtlpExporter> otlp_;  // observability.otlp.endpoint set
};

}  // namespace kiln
