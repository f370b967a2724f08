#include "server/server.h"

#include <optional>

#include "absl/strings/str_join.h"
#include "models/encoder/embedding_tensor_model.h"
#include "models/llm/loader.h"
#include "scheduler/device_metrics.h"
#include "scheduler/finetune/job_service.h"
#include "server/auth.h"
#include "server/flight_service.h"
#include "server/grpc_server.h"
#include "server/http_frontend.h"
#include "server/otlp_exporter.h"
#include "server/shared_memory.h"
#include "spdlog/spdlog.h"

#ifndef KILN_VERSION
#define KILN_VERSION "0.0.0"
#endif
#ifndef KILN_GIT_SHA
#define KILN_GIT_SHA "unknown"
#endif

namespace kiln {
namespace {

tls::Files TlsFiles(const config::TlsConfig& c) {
  return tls::Files{c.cert_file, c.key_file, c.client_ca_file, "server.tls"};
}

}  // namespace

std::string_view ServerVersion() { return KILN_VERSION; }

const std::vector<std::string>& ServerExtensions() {
  static const std::vector<std::string> extensions = {
      "model_repository", "schedule_policy", "model_configuration",  "binary_tensor_data",
      "statistics",       "parameters",      "system_shared_memory", "logging"};
  return extensions;
}

Server::Server(config::Config config, LlmLoader llm_loader) : config_(std::move(config)) {
  const config::ObservabilityConfig& obs = config_.observability;
  tracer_ = std::make_unique<TraceSink>(
      TraceSink::Options{.enabled = obs.tracing.enabled,
                         .export_spans = obs.tracing.enabled && !obs.otlp.endpoint.empty()},
      &registry_);
  families_ = std::make_unique<InferenceMetricFamilies>(registry_);
  llm_families_ = std::make_unique<LlmMetricFamilies>(registry_);
  ModelDeps deps;
  deps.tensor_metrics = families_.get();
  deps.llm_metrics = llm_families_.get();
  deps.tracer = tracer_.get();
  deps.llm_loader = std::move(llm_loader);
  if (config_.observability.flight_recorder.enabled) {
    deps.flight_recorder_entries = config_.observability.flight_recorder.entries;
    deps.watchdog_seconds = config_.observability.watchdog_seconds;
  }
  if (!deps.llm_loader) {
    deps.llm_loader = [this](const config::ModelConfig& c) {
      models::LlmLoadOptions options;
      options.metrics = &registry_;  // kiln_compile_*
      return models::LoadLlm(c, options);
    };
  }
  deps.tensor_loader = models::LoadEmbeddingTensorModel;  // kind: embedding
  repository_ = std::make_unique<ModelRepository>(config_.models, std::move(deps));
  limiter_ = std::make_unique<InflightLimiter>(config_.server.max_inflight_requests);
  core_.config = &config_;
  core_.repository = repository_.get();
  core_.limiter = limiter_.get();
  core_.registry = &registry_;
  core_.tracer = tracer_.get();
  // A request reads from shared memory at most what it could send inline.
  shared_memory_ = std::make_unique<SharedMemoryManager>(static_cast<uint64_t>(
      std::max(config_.server.grpc.max_message_bytes, config_.server.http.max_body_bytes)));
  core_.shared_memory = shared_memory_.get();
}

Server::~Server() {
  if (grpc_ || http_) Shutdown();
}

void Server::RegisterServerMetrics() {
  registry_
      .AddGauge("kiln_build_info", "Build information; the value is always 1.",
                {"version", "git_sha", "compiler"})
      .WithLabels({std::string(ServerVersion()), KILN_GIT_SHA, __VERSION__})
      ->Set(1);
  metrics::Gauge* ready =
      registry_.AddGauge("kiln_server_ready", "1 when the server is ready to serve.")
          .WithLabels({});
  metrics::Gauge* inflight =
      registry_
          .AddGauge("kiln_inflight_requests",
                    "Inference requests admitted and not yet answered, all front ends.")
          .WithLabels({});
  metrics::Gauge* limit =
      registry_.AddGauge("kiln_inflight_requests_limit", "server.max_inflight_requests.")
          .WithLabels({});
  auto& model_ready =
      registry_.AddGauge("kiln_model_ready", "1 when the model is READY, else 0.", {"model"});
  metrics::RegisterProcessMetrics(registry_);
  scheduler::RegisterDeviceMetrics(registry_, models::RegisteredDevices);
  registry_.AddCollector([this, ready, inflight, limit, &model_ready] {
    ready->Set(core_.ready() ? 1 : 0);
    inflight->Set(static_cast<double>(limiter_->inflight()));
    limit->Set(static_cast<double>(limiter_->limit()));
    for (const auto& e : repository_->Index()) {
      model_ready.WithLabels({e.name})->Set(e.state == ModelState::kReady ? 1 : 0);
    }
  });
}

Status Server::Start() {
  RegisterServerMetrics();
  // Key files first: a missing one fails start-up before anything listens.
  StatusOr<std::unique_ptr<Authenticator>> auth =
      Authenticator::Create(config_.server.auth, &registry_);
  if (!auth.ok()) return auth.status();  // names the config line and the file
  auth_ = *std::move(auth);
  core_.auth = auth_.get();
  if (auth_->enabled()) {
    spdlog::info("auth: {} API key(s); open without a key: {}", config_.server.auth.api_keys.size(),
                 config_.server.auth.open.empty() ? std::string("nothing")
                                                  : absl::StrJoin(config_.server.auth.open, ", "));
  }
  if (config_.fine_tuning.enabled) {
    StatusOr<std::unique_ptr<finetune::FineTuningService>> ft =
        finetune::FineTuningService::Create(config_, repository_.get(), &registry_);
    if (!ft.ok()) return Annotate(ft.status(), "fine-tuning");
    fine_tuning_ = *std::move(ft);
    core_.fine_tuning = fine_tuning_.get();
  }
  // TLS files are checked once, for every front end, before anything binds.
  std::optional<tls::Pem> tls_pem;
  if (config_.server.tls.enabled()) {
    StatusOr<tls::Pem> pem = tls::LoadFiles(TlsFiles(config_.server.tls));
    if (!pem.ok()) return pem.status();
    StatusOr<std::shared_ptr<tls::ServerContext>> context = tls::ServerContext::Create(*pem);
    if (!context.ok()) return Annotate(context.status(), "server.tls");
    tls_context_ = *std::move(context);
    tls_pem = *std::move(pem);
    spdlog::info(
        "TLS on ({}{}): {}", config_.server.tls.metrics ? "gRPC, HTTP, metrics" : "gRPC, HTTP",
        tls_pem->client_ca.empty() ? "" : "; client certificates required", tls_pem->summary);
  }
  flight_ = std::make_unique<FlightService>(config_, repository_.get(), &registry_);
  flight_->Start();
  core_.flight = flight_.get();
  if (config_.observability.tracing.enabled && !config_.observability.otlp.endpoint.empty()) {
    StatusOr<std::unique_ptr<OtlpExporter>> otlp =
        OtlpExporter::Create(config_.observability, tracer_.get(), &registry_);
    if (!otlp.ok()) return otlp.status();
    otlp_ = *std::move(otlp);
  }
  grpc_ = std::make_unique<GrpcFrontEnd>(&core_);
  http_ = std::make_unique<HttpFrontEnds>(&core_);
  repository_->SetStateListener([this](const std::string& name, ModelState state) {
    if (grpc_) grpc_->SetServing(name, state == ModelState::kReady);
  });
  // Bind first: a port conflict should fail fast, before minutes of model loading.
  if (config_.server.grpc.enabled) {
    Status s = grpc_->Start(tls_pem ? &*tls_pem : nullptr);
    if (!s.ok()) {
      grpc_.reset();
      http_.reset();
      return s;
    }
  }
  Status s = http_->Start(tls_context_);
  if (!s.ok()) {
    if (grpc_) grpc_->Shutdown(SteadyClock::now());
    grpc_.reset();
    http_.reset();
    return s;
  }
  spdlog::info("listening: gRPC {} (port {}), HTTP {} (port {}), metrics {} (port {})",
               config_.server.grpc.enabled ? config_.server.grpc.address : "off", grpc_port(),
               config_.server.http.enabled ? config_.server.http.address : "off", http_port(),
               config_.server.metrics.enabled ? config_.server.metrics.address : "off",
               metrics_port());
  s = repository_->LoadStartupModels();
  if (!s.ok()) return s;
  // Jobs start once their base models are loaded; finished adapters are served again.
  if (fine_tuning_) KILN_RETURN_IF_ERROR(fine_tuning_->Start());
  for (const auto& e : repository_->Index(/*ready_only=*/true)) grpc_->SetServing(e.name, true);
  core_.started = true;
  if (grpc_) {
    grpc_->SetServing("", true);
    grpc_->SetServing("inference.GRPCInferenceService", true);
  }
  spdlog::info("kilnd {} ready: {} model(s) loaded", ServerVersion(),
               repository_->Index(/*ready_only=*/true).size());
  return OkStatus();
}

bool Server::Shutdown() {
  const auto grace = std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(config_.server.shutdown_grace_seconds));
  const auto deadline = SteadyClock::now() + grace;
  core_.shutting_down = true;
  if (grpc_) {
    grpc_->SetServing("", false);
    grpc_->SetServing("inference.GRPCInferenceService", false);
    for (const auto& e : repository_->Index()) grpc_->SetServing(e.name, false);
  }
  // A running fine-tuning job stops after its current step (it stays `running` with its
  // checkpoint, so the next start resumes it).
  if (fine_tuning_) fine_tuning_->Stop();
  const int64_t inflight = limiter_->inflight();
  spdlog::info("shutting down: not ready; waiting up to {:.1f} s for {} in-flight request(s)",
               config_.server.shutdown_grace_seconds, inflight);
  const bool idle = limiter_->WaitIdle(absl::Now() + absl::FromChrono(grace));
  // Even when no request is in flight, a model's loop may still be finishing its last step
  // (a stream's final chunk is sent before the sequence is retired): give it the same deadline.
  const int cut = repository_->DrainAll(deadline);
  int http_cut = 0;
  if (http_) http_cut = http_->Shutdown(std::max(deadline, SteadyClock::now()));
  // Requests DrainAll cut are answered asynchronously ("cancelled: ... shutting down"): give
  // gRPC a moment to write those answers before it cancels what is left. Shutdown returns as
  // soon as every call is done, so the window only costs time when a call is truly stuck.
  constexpr auto kReplyFlush = std::chrono::seconds(1);
  if (grpc_) grpc_->Shutdown(std::max(deadline, SteadyClock::now() + kReplyFlush));
  grpc_.reset();
  http_.reset();
  shared_memory_->UnregisterAll();  // no front end can use a region any more
  if (flight_) flight_->Stop();
  otlp_.reset();  // sends the spans still queued
  const bool clean = idle && cut == 0 && http_cut == 0;
  if (clean) {
    spdlog::info("shutdown complete");
  } else {
    spdlog::error("shutdown grace period ({:.1f} s) expired: {} request(s) cancelled",
                  config_.server.shutdown_grace_seconds, cut + http_cut);
  }
  return clean;
}

Status Server::ReloadSecrets() {
  // Both reloads run; each keeps what was in force when it fails.
  std::vector<std::string> errors;
  if (tls_context_) {
    Status s = [&]() -> Status {
      KILN_ASSIGN_OR_RETURN(tls::Pem pem, tls::LoadFiles(TlsFiles(config_.server.tls)));
      KILN_RETURN_IF_ERROR(Annotate(tls_context_->Update(pem), "server.tls"));
      if (grpc_ && config_.server.grpc.enabled) {
        KILN_RETURN_IF_ERROR(Annotate(grpc_->ReloadTls(pem), "server.tls (gRPC)"));
      }
      spdlog::info("TLS certificates reloaded: {}", pem.summary);
      return OkStatus();
    }();
    if (!s.ok()) errors.emplace_back(StatusMessage(s));
  }
  if (auth_) {
    if (Status s = auth_->ReloadKeyFiles(); !s.ok()) {
      errors.emplace_back(StatusMessage(s));
    } else {
      spdlog::info("API key files reloaded");
    }
  }
  if (!errors.empty()) return InvalidArgument(absl::StrJoin(errors, "; "));
  return OkStatus();
}

void Server::DumpFlightRecorder(std::string_view reason) {
  if (flight_) flight_->RequestDump(reason);
}

int Server::grpc_port() const { return grpc_ ? grpc_->port() : 0; }
int Server::http_port() const { return http_ ? http_->http_port() : 0; }
int Server::metrics_port() const { return http_ ? http_->metrics_port() : 0; }

}  // namespace kiln
