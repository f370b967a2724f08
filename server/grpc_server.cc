#include "server/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <deque>
#include <optional>
#include <thread>

#include "config/config.h"
#include "proto/grpc/health/v1/health.pb.h"
#include "proto/kserve/grpc_service.grpc.pb.h"
#include "server/finetune/finetune_grpc.h"
#include "server/grpc_auth.h"
#include "server/kserve_codec.h"
#include "server/llm/generation_service.h"
#include "server/llm/kserve_llm.h"
#include "server/logging.h"
#include "server/net_util.h"
#include "server/shared_memory.h"
#include "server/status_mapping.h"
#include "server/tracing.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

using grpc::CallbackServerContext;
using grpc::ServerUnaryReactor;

// Finishes a unary RPC at once with `status`.
ServerUnaryReactor* FinishNow(CallbackServerContext* ctx, const Status& status) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// ModelInfer: decode, admit, enqueue; the scheduler answers through on_complete. A client
// cancellation (or a deadline passing) marks the queued request cancelled so it leaves the
// queue at the batcher's next step.
class InferReactor final : public ServerUnaryReactor {
 public:
  InferReactor(ServerCore* core, CallbackServerContext* ctx,
               const inference::ModelInferRequest* request, inference::ModelInferResponse* response)
      : response_(response) {
    trace_ = BeginGrpcTrace(*core, *ctx, "inference.GRPCInferenceService/ModelInfer");
    AddTraceMetadata(trace_.get(), ctx);
    Status s = Start(core, const_cast<inference::ModelInferRequest*>(request));
    if (s.ok()) return;
    if (trace_) trace_->End(s);
    Finish(ToGrpcStatus(s));
  }

  void OnCancel() override {
    cancel_->Cancel();
    if (auto model = model_.lock()) model->WakeUp();
  }
  void OnDone() override { delete this; }

 private:
  // The request message stays ours until Finish; the codec moves raw contents out of it.
  Status Start(ServerCore* core, inference::ModelInferRequest* wire) {
    KILN_ASSIGN_OR_RETURN(ticket_, core->Admit());
    KILN_ASSIGN_OR_RETURN(auto request,
                          DecodeInferRequest(*wire, core->shared_memory, &shm_outputs_));
    std::string adapter;  // a LoRA adapter's name reaches SubmitText as the model name
    KILN_ASSIGN_OR_RETURN(auto model, core->repository->GetReady(request->model_name,
                                                                 request->model_version, &adapter));
    model_ = model;
    cancel_ = request->cancel;
    const std::string name = request->model_name, id = request->id;
    // The response span and the root end before Finish: the reactor may be gone after it.
    auto end_trace = [trace = trace_](SteadyClock::time_point start, const Status& s) {
      if (!trace) return;
      trace->Span("response", start, SteadyClock::now());
      trace->End(s);
    };
    if (model->is_llm()) {
      KILN_RETURN_IF_ERROR(RefuseShmOutputs(shm_outputs_, name));
      KILN_ASSIGN_OR_RETURN(auto text,
                            llm::ReadKServeRequest(*model, *request, llm::ParametersJson(*wire)));
      text.trace = trace_;
      return llm::SubmitText(model, std::move(text), std::move(ticket_), /*may_stream=*/false,
                             [this, name, id, end_trace](std::string out, bool, const Status& s) {
                               const auto start = SteadyClock::now();
                               if (s.ok()) {
                                 EncodeInferResponse(name, id, llm::TextResponse(out), response_);
                               }
                               end_trace(start, s);
                               Finish(ToGrpcStatus(s));
                             });
    }
    if (model->signature().decoupled) {
      return Unimplemented(
          "ModelInfer RPC doesn't support models with decoupled transaction "
          "policy: model '",
          name,
          "' sends zero, one or many responses per request; use the "
          "ModelStreamInfer RPC");
    }
    request->trace = trace_;
    request->on_complete = [this, name, id, end_trace](InferenceResponse&& resp) {
      ticket_.Release();
      const auto start = SteadyClock::now();
      Status status = resp.status;
      if (status.ok()) status = WriteShmOutputs(shm_outputs_, resp.outputs);
      if (status.ok()) EncodeInferResponse(name, id, std::move(resp), response_, &shm_outputs_);
      end_trace(start, status);
      Finish(ToGrpcStatus(status));
    };
    Status s = model->Infer(request);
    if (trace_) {
      trace_->Span("admission", trace_->start(), SteadyClock::now(),
                   {{"kiln.ok", int64_t{s.ok()}}});
    }
    return s;
  }

  inference::ModelInferResponse* response_;
  ShmOutputs shm_outputs_;  // outputs to write into shared memory
  InflightLimiter::Ticket ticket_;
  std::shared_ptr<CancelFlag> cancel_ = std::make_shared<CancelFlag>();
  std::weak_ptr<Model> model_;
  std::shared_ptr<RequestTrace> trace_;  // null: not traced
};

// ModelStreamInfer: each request on the stream is independent; responses (or per-request
// errors, in error_message) are written in completion order. Decoupled models and streaming
// LLMs answer a request with any number of responses, each with triton_final_response. The stream
// finishes once the client half-closed and every request was answered.
class StreamInferReactor final
    : public grpc::ServerBidiReactor<inference::ModelInferRequest,
                                     inference::ModelStreamInferResponse> {
 public:
  explicit StreamInferReactor(ServerCore* core) : core_(core) { StartRead(&incoming_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    Handle(incoming_);
    incoming_.Clear();
    StartRead(&incoming_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writes_.pop_front();
    if (!ok) broken_ = true;
    if (!writes_.empty() && !broken_) {
      StartWrite(&writes_.front());
    } else {
      writes_.clear();
      MaybeFinishLocked();
    }
  }

  void OnCancel() override {
    std::vector<std::pair<std::shared_ptr<CancelFlag>, std::weak_ptr<Model>>> pending;
    {
      absl::MutexLock lock(&mu_);
      broken_ = true;
      pending = pending_cancels_;
    }
    for (auto& [flag, model] : pending) {
      flag->Cancel();
      if (auto m = model.lock()) m->WakeUp();
    }
  }

  void OnDone() override { delete this; }

 private:
  void Handle(inference::ModelInferRequest& wire) {
    std::string id = wire.id();
    std::string model_name = wire.model_name();
    Status s = Submit(wire);
    if (!s.ok()) {
      inference::ModelStreamInferResponse out;
      out.set_error_message(std::string(StatusMessage(s)));
      out.mutable_infer_response()->set_id(id);
      out.mutable_infer_response()->set_model_name(model_name);
      absl::MutexLock lock(&mu_);
      WriteLocked(std::move(out));
    }
  }

  Status Submit(inference::ModelInferRequest& wire) {
    KILN_ASSIGN_OR_RETURN(auto ticket, core_->Admit());
    ShmOutputs shm_outputs;
    KILN_ASSIGN_OR_RETURN(auto request,
                          DecodeInferRequest(wire, core_->shared_memory, &shm_outputs));
    std::string adapter;  // a LoRA adapter's name reaches SubmitText as the model name
    KILN_ASSIGN_OR_RETURN(auto model, core_->repository->GetReady(
                                          request->model_name, request->model_version, &adapter));
    auto flag = request->cancel;
    const std::string name = request->model_name, id = request->id;
    if (model->is_llm()) {
      KILN_RETURN_IF_ERROR(RefuseShmOutputs(shm_outputs, name));
      return SubmitLlm(wire, model, std::move(request), std::move(ticket));
    }
    auto shared_ticket = std::make_shared<InflightLimiter::Ticket>(std::move(ticket));
    // A decoupled model (Triton's convention): each response as it comes, marked with
    // triton_final_response; the end of the request is an empty final response only when
    // the client asked for one (triton_enable_empty_final_response) and the model did not
    // mark a response final itself. Outputs in shared memory are written for every response.
    const bool decoupled = model->signature().decoupled;
    const bool empty_final = decoupled && llm::EmptyFinalResponseRequested(wire);
    auto final_sent = std::make_shared<bool>(false);  // guarded by mu_
    auto shm = std::make_shared<const ShmOutputs>(std::move(shm_outputs));
    auto error = [name, id](const Status& status) {
      inference::ModelStreamInferResponse out;
      out.set_error_message(std::string(StatusMessage(status)));
      out.mutable_infer_response()->set_id(id);
      out.mutable_infer_response()->set_model_name(name);
      return out;
    };
    if (decoupled) {
      request->on_response = [this, name, id, final_sent, shm, error](InferenceResponse&& resp) {
        inference::ModelStreamInferResponse out;
        bool final = resp.final;
        if (Status status = WriteShmOutputs(*shm, resp.outputs); !status.ok()) {
          out = error(status);  // the request goes on; its end is still to come
          final = false;
        } else {
          EncodeInferResponse(name, id, std::move(resp), out.mutable_infer_response(), shm.get());
          llm::MarkFinal(out.mutable_infer_response(), final);
        }
        absl::MutexLock lock(&mu_);
        *final_sent = *final_sent || final;
        WriteLocked(std::move(out));
      };
    }
    request->on_complete = [this, name, id, flag, shared_ticket, decoupled, empty_final, final_sent,
                            shm, error](InferenceResponse&& resp) {
      shared_ticket->Release();
      std::optional<inference::ModelStreamInferResponse> out;
      Status status = resp.status;
      if (status.ok() && !decoupled) status = WriteShmOutputs(*shm, resp.outputs);
      if (!status.ok()) {
        out = error(status);
        // An error ends a decoupled request: say so, as the LLM streams do.
        if (decoupled) llm::MarkFinal(out->mutable_infer_response(), true);
      } else if (!decoupled) {
        EncodeInferResponse(name, id, std::move(resp), out.emplace().mutable_infer_response(),
                            shm.get());
      }
      absl::MutexLock lock(&mu_);
      if (decoupled && resp.status.ok() && empty_final && !*final_sent) {
        EncodeInferResponse(name, id, InferenceResponse{}, out.emplace().mutable_infer_response());
        llm::MarkFinal(out->mutable_infer_response(), true);
      }
      std::erase_if(pending_cancels_, [&](const auto& p) { return p.first == flag; });
      --pending_;
      if (out) WriteLocked(*std::move(out));
      MaybeFinishLocked();
    };
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
      pending_cancels_.emplace_back(flag, model);
    }
    Status s = model->Infer(request);
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      --pending_;
      std::erase_if(pending_cancels_, [&](const auto& p) { return p.first == flag; });
    }
    return s;
  }

  // An LLM request (Triton's decoupled convention): one response per piece of text when it
  // streams, each marked with triton_final_response.
  Status SubmitLlm(const inference::ModelInferRequest& wire, const std::shared_ptr<Model>& model,
                   std::unique_ptr<InferenceRequest> request, InflightLimiter::Ticket ticket) {
    KILN_ASSIGN_OR_RETURN(auto text,
                          llm::ReadKServeRequest(*model, *request, llm::ParametersJson(wire)));
    const bool empty_final = llm::EmptyFinalResponseRequested(wire);
    auto flag = request->cancel;
    const std::string name = request->model_name, id = request->id;
    auto sink = [this, name, id, flag, empty_final](std::string out, bool final, const Status& s) {
      std::vector<inference::ModelStreamInferResponse> msgs;
      auto make = [&](const std::string& text, bool is_final, bool empty) {
        inference::ModelStreamInferResponse& msg = msgs.emplace_back();
        if (s.ok()) {
          EncodeInferResponse(name, id, llm::TextResponse(text, empty),
                              msg.mutable_infer_response());
        } else {
          msg.set_error_message(std::string(StatusMessage(s)));
          msg.mutable_infer_response()->set_id(id);
          msg.mutable_infer_response()->set_model_name(name);
        }
        llm::MarkFinal(msg.mutable_infer_response(), is_final);
      };
      if (final && empty_final && s.ok()) {
        if (!out.empty()) make(out, false, false);
        make("", true, true);
      } else {
        make(out, final, false);
      }
      absl::MutexLock lock(&mu_);
      for (auto& msg : msgs) WriteLocked(std::move(msg));
      if (!final) return;
      std::erase_if(pending_cancels_, [&](const auto& p) { return p.first == flag; });
      --pending_;
      MaybeFinishLocked();
    };
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
      pending_cancels_.emplace_back(flag, model);
    }
    Status s = llm::SubmitText(model, std::move(text), std::move(ticket), /*may_stream=*/true,
                               std::move(sink));
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      --pending_;
      std::erase_if(pending_cancels_, [&](const auto& p) { return p.first == flag; });
    }
    return s;
  }

  void WriteLocked(inference::ModelStreamInferResponse&& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (broken_) return;  // the client is gone; nothing to deliver to
    writes_.push_back(std::move(out));
    if (writes_.size() == 1) StartWrite(&writes_.front());
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || (!reads_done_ && !broken_)) return;
    if (pending_ > 0 || !writes_.empty()) return;
    finished_ = true;
    Finish(broken_ ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled")
                   : grpc::Status::OK);
  }

  ServerCore* const core_;
  inference::ModelInferRequest incoming_;  // only touched by the read path
  absl::Mutex mu_;
  std::deque<inference::ModelStreamInferResponse> writes_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::shared_ptr<CancelFlag>, std::weak_ptr<Model>>> pending_cancels_
      ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

class KServeGrpcService final : public inference::GRPCInferenceService::CallbackService {
 public:
  explicit KServeGrpcService(ServerCore* core)
      : core_(core),
        generation_(llm::NewGenerationService(core)),
        fine_tuning_(finetune::NewFineTuningGrpcService(core)) {}

  // kiln.v1.Generation and kiln.v1.FineTuning, served on the same port.
  grpc::Service* generation() const { return generation_.get(); }
  grpc::Service* fine_tuning() const { return fine_tuning_.get(); }

  ServerUnaryReactor* ServerLive(CallbackServerContext* ctx, const inference::ServerLiveRequest*,
                                 inference::ServerLiveResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kHealth)) return refused;
    resp->set_live(core_->live());
    return FinishNow(ctx, OkStatus());
  }

  ServerUnaryReactor* ServerReady(CallbackServerContext* ctx, const inference::ServerReadyRequest*,
                                  inference::ServerReadyResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kHealth)) return refused;
    resp->set_ready(core_->ready());
    return FinishNow(ctx, OkStatus());
  }

  ServerUnaryReactor* ModelReady(CallbackServerContext* ctx,
                                 const inference::ModelReadyRequest* req,
                                 inference::ModelReadyResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kHealth)) return refused;
    std::string adapter;
    auto model = core_->repository->GetReady(req->name(), req->version(), &adapter);
    if (!model.ok() && model.status().code() == StatusCode::kNotFound) {
      return FinishNow(ctx, model.status());
    }
    resp->set_ready(core_->model_ready(model.ok()));
    return FinishNow(ctx, OkStatus());
  }

  ServerUnaryReactor* ServerMetadata(CallbackServerContext* ctx,
                                     const inference::ServerMetadataRequest*,
                                     inference::ServerMetadataResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    resp->set_name(std::string(kServerName));
    resp->set_version(std::string(ServerVersion()));
    for (const auto& e : ServerExtensions()) resp->add_extensions(e);
    return FinishNow(ctx, OkStatus());
  }

  ServerUnaryReactor* ModelMetadata(CallbackServerContext* ctx,
                                    const inference::ModelMetadataRequest* req,
                                    inference::ModelMetadataResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    std::string adapter;
    auto model = core_->repository->GetReady(req->name(), req->version(), &adapter);
    if (!model.ok()) return FinishNow(ctx, model.status());
    FillModelMetadata(**model, resp);
    if (!adapter.empty()) resp->set_name(adapter);  // a LoRA adapter: its base's signature
    return FinishNow(ctx, OkStatus());
  }

  ServerUnaryReactor* ModelConfig(CallbackServerContext* ctx,
                                  const inference::ModelConfigRequest* req,
                                  inference::ModelConfigResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    auto model = core_->repository->GetReady(req->name(), req->version());
    if (!model.ok()) return FinishNow(ctx, model.status());
    FillModelConfig(**model, resp->mutable_config());
    return FinishNow(ctx, OkStatus());
  }

  ServerUnaryReactor* ModelInfer(CallbackServerContext* ctx,
                                 const inference::ModelInferRequest* req,
                                 inference::ModelInferResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    return new InferReactor(core_, ctx, req, resp);
  }

  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
  ModelStreamInfer(CallbackServerContext* ctx) override {
    if (Status s = AuthorizeGrpc(*core_, *ctx, RouteClass::kInference); !s.ok()) {
      return new RefusedBidiReactor<inference::ModelInferRequest,
                                    inference::ModelStreamInferResponse>(s);
    }
    return new StreamInferReactor(core_);
  }

  ServerUnaryReactor* ModelStatistics(CallbackServerContext* ctx,
                                      const inference::ModelStatisticsRequest* req,
                                      inference::ModelStatisticsResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    if (!req->name().empty()) {
      auto model = core_->repository->GetReady(req->name(), req->version());
      if (!model.ok()) return FinishNow(ctx, model.status());
      FillModelStatistics(**model, resp->add_model_stats());
    } else {
      for (const auto& m : core_->repository->ReadyModels()) {
        FillModelStatistics(*m, resp->add_model_stats());
      }
    }
    return FinishNow(ctx, OkStatus());
  }

  ServerUnaryReactor* RepositoryIndex(CallbackServerContext* ctx,
                                      const inference::RepositoryIndexRequest* req,
                                      inference::RepositoryIndexResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    for (const auto& e : core_->repository->Index(req->ready(), /*with_adapters=*/true)) {
      auto* m = resp->add_models();
      m->set_name(e.name);
      m->set_version(e.version);
      m->set_state(std::string(ModelStateName(e.state)));
      m->set_reason(e.reason);
    }
    return FinishNow(ctx, OkStatus());
  }

  // Loading and unloading block (model start-up, draining), so they run on their own thread
  // and finish the RPC from there.
  ServerUnaryReactor* RepositoryModelLoad(CallbackServerContext* ctx,
                                          const inference::RepositoryModelLoadRequest* req,
                                          inference::RepositoryModelLoadResponse*) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kAdmin)) return refused;
    std::optional<config::ModelConfig> inline_config;
    for (const auto& [key, value] : req->parameters()) {
      if (key == "config") {
        if (value.parameter_choice_case() != inference::ModelRepositoryParameter::kStringParam) {
          return FinishNow(ctx, InvalidArgument("parameter 'config' must be a string (JSON)"));
        }
        const auto current = core_->repository->CurrentConfig(req->model_name());
        auto parsed =
            ParseLoadConfig(req->model_name(), value.string_param(), current ? &*current : nullptr);
        if (!parsed.ok()) return FinishNow(ctx, parsed.status());
        inline_config = std::move(*parsed);
      } else if (key.rfind("file:", 0) == 0) {
        return FinishNow(ctx, InvalidArgument("parameter '", key,
                                              "': model files in load requests are not "
                                              "supported; put weights on the server's disk"));
      }
    }
    if (core_->shutting_down) return FinishNow(ctx, Unavailable("the server is shutting down"));
    ServerUnaryReactor* reactor = ctx->DefaultReactor();
    std::thread([this, reactor, name = req->model_name(),
                 cfg = std::move(inline_config)]() mutable {
      reactor->Finish(ToGrpcStatus(core_->repository->Load(name, std::move(cfg))));
    }).detach();
    return reactor;
  }

  ServerUnaryReactor* RepositoryModelUnload(CallbackServerContext* ctx,
                                            const inference::RepositoryModelUnloadRequest* req,
                                            inference::RepositoryModelUnloadResponse*) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kAdmin)) return refused;
    ServerUnaryReactor* reactor = ctx->DefaultReactor();
    const auto deadline =
        SteadyClock::now() +
        std::chrono::duration_cast<SteadyClock::duration>(
            std::chrono::duration<double>(core_->config->server.shutdown_grace_seconds));
    std::thread([this, reactor, name = req->model_name(), deadline] {
      reactor->Finish(ToGrpcStatus(core_->repository->Unload(name, deadline)));
    }).detach();
    return reactor;
  }

  // ---- Triton's shared memory extensions (server/shared_memory.h). ----
  ServerUnaryReactor* SystemSharedMemoryStatus(
      CallbackServerContext* ctx, const inference::SystemSharedMemoryStatusRequest* req,
      inference::SystemSharedMemoryStatusResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    auto regions = core_->shared_memory->GetStatus(req->name());
    if (!regions.ok()) return FinishNow(ctx, regions.status());
    for (const auto& r : *regions) {
      auto& out = (*resp->mutable_regions())[r.name];
      out.set_name(r.name);
      out.set_key(r.key);
      out.set_offset(r.offset);
      out.set_byte_size(r.byte_size);
    }
    return FinishNow(ctx, OkStatus());
  }
  ServerUnaryReactor* SystemSharedMemoryRegister(
      CallbackServerContext* ctx, const inference::SystemSharedMemoryRegisterRequest* req,
      inference::SystemSharedMemoryRegisterResponse*) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kAdmin)) return refused;
    return FinishNow(ctx, core_->shared_memory->Register(req->name(), req->key(), req->offset(),
                                                         req->byte_size()));
  }
  ServerUnaryReactor* SystemSharedMemoryUnregister(
      CallbackServerContext* ctx, const inference::SystemSharedMemoryUnregisterRequest* req,
      inference::SystemSharedMemoryUnregisterResponse*) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kAdmin)) return refused;
    if (req->name().empty()) {
      core_->shared_memory->UnregisterAll();
    } else {
      core_->shared_memory->Unregister(req->name());
    }
    return FinishNow(ctx, OkStatus());
  }
  ServerUnaryReactor* CudaSharedMemoryStatus(CallbackServerContext* ctx,
                                             const inference::CudaSharedMemoryStatusRequest* req,
                                             inference::CudaSharedMemoryStatusResponse*) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    // None can be registered: every region is unknown, the list of all is empty.
    return FinishNow(ctx, kiln::CudaSharedMemoryStatus(req->name()));
  }
  ServerUnaryReactor* CudaSharedMemoryRegister(
      CallbackServerContext* ctx, const inference::CudaSharedMemoryRegisterRequest*,
      inference::CudaSharedMemoryRegisterResponse*) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kAdmin)) return refused;
    return FinishNow(ctx, CudaSharedMemoryUnsupported());
  }
  ServerUnaryReactor* CudaSharedMemoryUnregister(
      CallbackServerContext* ctx, const inference::CudaSharedMemoryUnregisterRequest*,
      inference::CudaSharedMemoryUnregisterResponse*) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kAdmin)) return refused;
    // Nothing to unregister, which is not an error: Triton's simple_*_shm_client.py examples
    // unregister all CUDA regions first.
    return FinishNow(ctx, OkStatus());
  }
  ServerUnaryReactor* TraceSetting(CallbackServerContext* ctx,
                                   const inference::TraceSettingRequest* req,
                                   inference::TraceSettingResponse*) override {
    // Reading settings is an inference client's business; changing them an operator's.
    const RouteClass c = req->settings().empty() ? RouteClass::kInference : RouteClass::kAdmin;
    if (auto* refused = RefuseUnary(*core_, ctx, c)) return refused;
    return FinishNow(ctx, Unimplemented("trace settings are not supported by Kiln"));
  }

  // LogSettings: Triton's logging extension (server/logging.h).
  ServerUnaryReactor* LogSettings(CallbackServerContext* ctx,
                                  const inference::LogSettingsRequest* req,
                                  inference::LogSettingsResponse* resp) override {
    const RouteClass c = req->settings().empty() ? RouteClass::kInference : RouteClass::kAdmin;
    if (auto* refused = RefuseUnary(*core_, ctx, c)) return refused;
    const std::string& format = core_->config->logging.format;
    using Choice = inference::LogSettingsRequest::SettingValue;
    for (const auto& [key, v] : req->settings()) {
      LogSettingValue value;
      switch (v.parameter_choice_case()) {
        case Choice::kBoolParam:
          value = v.bool_param();
          break;
        case Choice::kUint32Param:
          value = uint64_t{v.uint32_param()};
          break;
        case Choice::kStringParam:
          value = v.string_param();
          break;
        default:
          return FinishNow(ctx, InvalidArgument("log setting '", key, "' has no value"));
      }
      if (Status s = ApplyLogSetting(key, value, format); !s.ok()) return FinishNow(ctx, s);
    }
    const kiln::LogSettings now = CurrentLogSettings(format);
    auto& out = *resp->mutable_settings();
    out["log_info"].set_bool_param(now.log_info);
    out["log_warning"].set_bool_param(now.log_warning);
    out["log_error"].set_bool_param(now.log_error);
    out["log_verbose_level"].set_uint32_param(now.log_verbose_level);
    out["log_format"].set_string_param(now.log_format);
    out["log_file"].set_string_param(now.log_file);
    return FinishNow(ctx, OkStatus());
  }

 private:
  ServerCore* const core_;
  std::unique_ptr<grpc::Service> generation_;
  std::unique_ptr<grpc::Service> fine_tuning_;
};

GrpcFrontEnd::GrpcFrontEnd(ServerCore* core)
    : core_(core), service_(std::make_unique<KServeGrpcService>(core)) {}

GrpcFrontEnd::~GrpcFrontEnd() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
}

namespace {

// How often gRPC's certificate watcher re-reads kilnd's in-memory copy of the TLS files
// (gRPC's minimum). Reading three small memfds is cheap; the copy changes only on SIGHUP.
constexpr unsigned kTlsRefreshSeconds = 1;

}  // namespace

Status GrpcFrontEnd::Start(const tls::Pem* tls) {
  const config::GrpcConfig& cfg = core_->config->server.grpc;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (tls) {
    // gRPC 1.51 has no public certificate provider that takes new material from the caller,
    // only files on a watch: kilnd hands it in-memory files it has checked and rewrites them
    // on SIGHUP (tls::MemoryFiles), so gRPC reloads what the HTTP side reloads, and only that.
    KILN_ASSIGN_OR_RETURN(tls_files_, tls::MemoryFiles::Create(*tls));
    tls_provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        tls_files_->key_path(), tls_files_->cert_path(), tls_files_->client_ca_path(),
        kTlsRefreshSeconds);
    grpc::experimental::TlsServerCredentialsOptions options(tls_provider_);
    options.watch_identity_key_cert_pairs();
    if (!tls->client_ca.empty()) {
      options.watch_root_certs();
      options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    } else {
      options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    }
    credentials = grpc::experimental::TlsServerCredentials(options);
  }
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC 1.51's default health service carries no C++ descriptor: reflection would list
  // grpc.health.v1.Health but answer "not found" for its file, and grpcurl could not call it.
  // Touching our compiled health.proto links it in, so its descriptor is in the generated pool
  // that reflection serves from.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Without this, a second process could bind the same port and silently share traffic.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, cfg.max_concurrent_streams);
  builder.SetMaxReceiveMessageSize(static_cast<int>(cfg.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(cfg.max_message_bytes));
  builder.AddListeningPort(cfg.address, credentials, &port_);
  builder.RegisterService(service_.get());
  builder.RegisterService(service_->generation());
  builder.RegisterService(service_->fine_tuning());
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    server_.reset();
    Status why = ProbeListen(cfg.address);
    return Unavailable("grpc: cannot listen on ", cfg.address, ": ",
                       why.ok() ? absl::string_view("gRPC could not bind it") : why.message(),
                       " (server.grpc.address)");
  }
  SetServing("", core_->ready());
  SetServing("inference.GRPCInferenceService", core_->ready());
  return OkStatus();
}

Status GrpcFrontEnd::ReloadTls(const tls::Pem& pem) {
  if (!tls_files_) return FailedPrecondition("gRPC is not serving TLS");
  return tls_files_->Update(pem);
}

void GrpcFrontEnd::SetServing(const std::string& service, bool serving) {
  if (!server_) return;
  auto* health = server_->GetHealthCheckService();
  if (!health) return;
  health->SetServingStatus(service, serving);
  // kiln.v1.Generation serves whenever the server does; kiln.v1.FineTuning when it is enabled.
  if (service.empty()) {
    health->SetServingStatus("kiln.v1.Generation", serving);
    health->SetServingStatus("kiln.v1.FineTuning", serving && core_->fine_tuning != nullptr);
  }
}

void GrpcFrontEnd::Shutdown(SteadyClock::time_point deadline) {
  if (!server_) return;
  if (auto* health = server_->GetHealthCheckService()) health->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + (deadline - SteadyClock::now()));
  server_->Wait();
  server_.reset();
}

}  // namespace kiln
