#include "server/finetune/finetune_grpc.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "boost/asio/post.hpp"
#include "boost/asio/thread_pool.hpp"
#include "nlohmann/json.hpp"
#include "proto/kiln/v1/fine_tuning.grpc.pb.h"
#include "scheduler/finetune/job_service.h"
#include "server/grpc_auth.h"
#include "server/status_mapping.h"

namespace kiln::finetune {
namespace {

using grpc::CallbackServerContext;
using grpc::ServerUnaryReactor;
using nlohmann::json;

Status Disabled() {
  return Unimplemented(
      "fine-tuning is disabled in this server's configuration (fine_tuning.enabled)");
}

// ---- records -> messages ----

void ToValue(const json& j, google::protobuf::Value* v);

void ToStruct(const json& j, google::protobuf::Struct* s) {
  if (!j.is_object()) return;
  for (const auto& [k, x] : j.items()) ToValue(x, &(*s->mutable_fields())[k]);
}

void ToValue(const json& j, google::protobuf::Value* v) {
  if (j.is_boolean()) {
    v->set_bool_value(j.get<bool>());
  } else if (j.is_number()) {
    v->set_number_value(j.get<double>());
  } else if (j.is_string()) {
    v->set_string_value(j.get<std::string>());
  } else if (j.is_array()) {
    for (const json& x : j) ToValue(x, v->mutable_list_value()->add_values());
  } else if (j.is_object()) {
    ToStruct(j, v->mutable_struct_value());
  } else {
    v->set_null_value(google::protobuf::NULL_VALUE);
  }
}

void ToProto(const FileRecord& f, v1::File* out) {
  out->set_id(f.id);
  out->set_bytes(f.bytes);
  out->set_created_at(f.created_at);
  out->set_filename(f.filename);
  out->set_purpose(f.purpose);
  out->set_status(f.status);
  out->set_status_details(f.status_details);
  out->set_sha256(f.sha256);
}

// The resolved hyper-parameters (JobRecord::hyperparameters) as the message.
void ToProto(const json& h, v1::Hyperparameters* out) {
  if (!h.is_object()) return;
  auto integer = [&](const char* key) -> std::optional<int32_t> {
    auto it = h.find(key);
    if (it == h.end() || !it->is_number_integer()) return std::nullopt;
    return static_cast<int32_t>(it->get<int64_t>());
  };
  auto number = [&](const char* key) -> std::optional<double> {
    auto it = h.find(key);
    if (it == h.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  };
  auto string = [&](const char* key) -> std::string {
    auto it = h.find(key);
    return it != h.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  if (auto v = integer("n_epochs")) out->set_n_epochs(*v);
  if (auto v = integer("batch_size")) out->set_batch_size(*v);
  if (auto v = number("learning_rate_multiplier")) out->set_learning_rate_multiplier(*v);
  if (auto v = number("learning_rate")) out->set_learning_rate(*v);
  out->set_method(string("method"));
  if (auto v = integer("lora_r")) out->set_lora_r(*v);
  if (auto v = number("lora_alpha")) out->set_lora_alpha(*v);
  if (auto v = number("lora_dropout")) out->set_lora_dropout(*v);
  if (auto v = integer("gradient_accumulation_steps")) out->set_gradient_accumulation_steps(*v);
  if (auto it = h.find("target_modules"); it != h.end()) {
    if (it->is_string()) out->add_target_modules(it->get<std::string>());
    if (it->is_array()) {
      for (const json& m : *it) {
        if (m.is_string()) out->add_target_modules(m.get<std::string>());
      }
    }
  }
  if (auto v = integer("max_seq_len")) out->set_max_seq_len(*v);
  if (auto it = h.find("use_rslora"); it != h.end() && it->is_boolean()) {
    out->set_use_rslora(it->get<bool>());
  }
  out->set_lr_scheduler(string("lr_scheduler"));
  if (auto v = integer("warmup_steps")) out->set_warmup_steps(*v);
}

void ToProto(const JobRecord& j, v1::Job* out) {
  out->set_id(j.id);
  out->set_created_at(j.created_at);
  out->set_finished_at(j.finished_at);
  out->set_model(j.model);
  out->set_fine_tuned_model(j.fine_tuned_model);
  out->set_status(std::string(JobStatusName(j.status)));
  out->set_training_file(j.training_file);
  out->set_validation_file(j.validation_file);
  if (j.status == JobStatus::kSucceeded) out->set_trained_tokens(j.trained_tokens);
  if (j.error.is_object()) {
    v1::JobError* e = out->mutable_error();
    auto str = [&](const char* key) {
      auto it = j.error.find(key);
      return it != j.error.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    e->set_code(str("code"));
    e->set_message(str("message"));
    e->set_param(str("param"));
  }
  ToProto(j.hyperparameters, out->mutable_hyperparameters());
  out->set_seed(j.seed);
  out->set_suffix(j.suffix);
  if (j.metadata.is_object()) {
    for (const auto& [k, v] : j.metadata.items()) {
      if (v.is_string()) (*out->mutable_metadata())[k] = v.get<std::string>();
    }
  }
  out->set_estimated_finish(j.estimated_finish);
  out->set_step(j.last_step);
  out->set_total_steps(j.total_steps);
}

void ToProto(const EventRecord& e, v1::Event* out) {
  out->set_id(e.id);
  out->set_created_at(e.created_at);
  out->set_level(e.level);
  out->set_message(e.message);
  out->set_type(e.type);
  ToStruct(e.data, out->mutable_data());
}

void ToProto(const CheckpointRecord& c, v1::Checkpoint* out) {
  out->set_id(c.id);
  out->set_created_at(c.created_at);
  out->set_fine_tuned_model_checkpoint(c.fine_tuned_model_checkpoint);
  out->set_fine_tuning_job_id(c.job_id);
  ToStruct(c.metrics, out->mutable_metrics());
  out->set_step_number(c.step_number);
}

// ---- messages -> the service's input ----

json HyperJson(const v1::Hyperparameters& h) {
  json out = json::object();
  if (h.has_n_epochs()) out["n_epochs"] = h.n_epochs();
  if (h.has_batch_size()) out["batch_size"] = h.batch_size();
  if (h.has_learning_rate_multiplier()) {
    out["learning_rate_multiplier"] = h.learning_rate_multiplier();
  }
  if (h.has_learning_rate()) out["learning_rate"] = h.learning_rate();
  if (!h.method().empty()) out["method"] = h.method();
  if (h.has_lora_r()) out["lora_r"] = h.lora_r();
  if (h.has_lora_alpha()) out["lora_alpha"] = h.lora_alpha();
  if (h.has_lora_dropout()) out["lora_dropout"] = h.lora_dropout();
  if (h.has_gradient_accumulation_steps()) {
    out["gradient_accumulation_steps"] = h.gradient_accumulation_steps();
  }
  if (h.target_modules_size() > 0) {
    out["target_modules"] =
        std::vector<std::string>(h.target_modules().begin(), h.target_modules().end());
  }
  if (h.has_max_seq_len()) out["max_seq_len"] = h.max_seq_len();
  if (h.has_use_rslora()) out["use_rslora"] = h.use_rslora();
  if (!h.lr_scheduler().empty()) out["lr_scheduler"] = h.lr_scheduler();
  if (h.has_warmup_steps()) out["warmup_steps"] = h.warmup_steps();
  return out;
}

// The body POST /v1/fine_tuning/jobs would get. Hyper-parameters go at the top level so that
// the service's errors name `hyperparameters.<field>`, the message's own path.
json CreateJobJson(const v1::CreateJobRequest& r) {
  json out = json::object();
  auto put = [&](const char* key, const std::string& v) {
    if (!v.empty()) out[key] = v;  // empty: absent, so a missing field is named as missing
  };
  put("model", r.model());
  put("training_file", r.training_file());
  put("validation_file", r.validation_file());
  put("suffix", r.suffix());
  if (r.has_seed()) out["seed"] = r.seed();
  if (!r.metadata().empty()) {
    json m = json::object();
    for (const auto& [k, v] : r.metadata()) m[k] = v;
    out["metadata"] = std::move(m);
  }
  if (r.has_hyperparameters()) out["hyperparameters"] = HyperJson(r.hyperparameters());
  return out;
}

// A request's `limit`: 0 is 20; a page holds at most 100 (has_more tells the client).
StatusOr<int> PageSize(int32_t limit) {
  if (limit < 0) {
    return WithParam(InvalidArgument("`limit` is ", limit, "; allowed: 0 (20) or more"), "limit");
  }
  return limit == 0 ? 20 : std::min(limit, 100);
}

// ---- WatchJob ----

class WatchReactor final : public grpc::ServerWriteReactor<v1::WatchJobResponse> {
 public:
  WatchReactor(ServerCore* core, std::atomic<int>* watches, const v1::WatchJobRequest& req)
      : core_(core), ft_(core->fine_tuning), watches_(watches), job_id_(req.job_id()) {
    if (ft_ == nullptr) {
      Finish(ToGrpcStatus(Disabled()));
      return;
    }
    if (!req.after_event_id().empty()) {
      after_seq_ = JobStore::EventSeq(req.after_event_id());
      if (after_seq_ <= 0) {
        Finish(ToGrpcStatus(
            WithParam(InvalidArgument("`after_event_id` is not an event id (ftevent-<n>)"),
                      "after_event_id")));
        return;
      }
    }
    if (watches_->fetch_add(1) >= kMaxWatches) {
      watches_->fetch_sub(1);
      Finish(ToGrpcStatus(ResourceExhausted("too many WatchJob streams (", kMaxWatches,
                                            "); close one or poll ListEvents")));
      return;
    }
    counted_ = true;
    thread_ = std::thread([this] {
      Finish(ToGrpcStatus(Watch()));  // the last use of `this` here: OnDone may follow at once
    });
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock l(&mu_);
    writing_ = false;
    write_ok_ = ok;
  }
  void OnCancel() override {
    absl::MutexLock l(&mu_);
    cancelled_ = true;
  }
  void OnDone() override {
    if (counted_) watches_->fetch_sub(1);
    if (thread_.joinable()) {
      // OnDone may run inline in the watch thread's Finish(); that thread ends right after.
      if (thread_.get_id() == std::this_thread::get_id()) {
        thread_.detach();
      } else {
        thread_.join();
      }
    }
    delete this;
  }

 private:
  bool ClientCancelled() {
    absl::MutexLock l(&mu_);
    return cancelled_;
  }

  // Writes one message and waits until it is sent. False once the client is gone.
  bool Write(const v1::WatchJobResponse& msg) {
    {
      absl::MutexLock l(&mu_);
      if (cancelled_) return false;
      writing_ = true;
    }
    StartWrite(&msg);
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](bool* writing) { return !*writing; }, &writing_));
    return write_ok_;
  }

  bool WriteJob(const JobRecord& job) {
    v1::WatchJobResponse msg;
    ToProto(job, msg.mutable_job());
    return Write(msg);
  }

  Status Watch() {
    int64_t seq = after_seq_;
    std::optional<JobStatus> sent;
    for (bool first = true;; first = false) {
      if (ClientCancelled()) return Cancelled("the client cancelled the watch");
      if (core_->shutting_down.load()) {
        return Unavailable(
            "the server is shutting down; watch again with after_event_id set "
            "to the last event received");
      }
      KILN_ASSIGN_OR_RETURN(JobRecord job, ft_->GetJob(job_id_));
      const bool terminal = IsTerminal(job.status);
      if (terminal) {
        // The runner stores a terminal status just before its event: let that event land.
        ft_->WaitForChange(job_id_, seq, absl::Milliseconds(200));
      }
      KILN_ASSIGN_OR_RETURN(std::vector<EventRecord> events, ft_->EventsSince(job_id_, seq));
      if (first && !terminal) {  // the job as it is now, first (a finished one comes last)
        if (!WriteJob(job)) return Cancelled("the client went away");
        sent = job.status;
      }
      for (const EventRecord& e : events) {
        v1::WatchJobResponse msg;
        ToProto(e, msg.mutable_event());
        if (!Write(msg)) return Cancelled("the client went away");
        seq = std::max(seq, JobStore::EventSeq(e.id));
      }
      if (sent != job.status) {
        if (!WriteJob(job)) return Cancelled("the client went away");
        sent = job.status;
      }
      if (terminal) return OkStatus();
      const absl::Time start = absl::Now();
      if (!ft_->WaitForChange(job_id_, seq, absl::Seconds(1)) &&
          absl::Now() - start < absl::Milliseconds(50)) {
        absl::SleepFor(absl::Milliseconds(50));  // the service stopped: no busy loop
      }
    }
  }

  ServerCore* const core_;
  FineTuningService* const ft_;
  std::atomic<int>* const watches_;
  const std::string job_id_;
  int64_t after_seq_ = 0;
  bool counted_ = false;
  std::thread thread_;

  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = true;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// ---- the service ----

class FineTuningGrpc final : public v1::FineTuning::CallbackService {
 public:
  explicit FineTuningGrpc(ServerCore* core) : core_(core), pool_(2) {}
  ~FineTuningGrpc() override { pool_.join(); }

  ServerUnaryReactor* UploadFile(CallbackServerContext* ctx, const v1::UploadFileRequest* req,
                                 v1::File* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(FileRecord f,
                            ft->UploadFile(req->filename(), req->purpose(), req->content()));
      ToProto(f, resp);
      return OkStatus();
    });
  }

  ServerUnaryReactor* GetFile(CallbackServerContext* ctx, const v1::GetFileRequest* req,
                              v1::File* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(FileRecord f, ft->GetFile(req->file_id()));
      ToProto(f, resp);
      return OkStatus();
    });
  }

  ServerUnaryReactor* ListFiles(CallbackServerContext* ctx, const v1::ListFilesRequest* req,
                                v1::ListFilesResponse* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(int limit, PageSize(req->limit()));
      KILN_ASSIGN_OR_RETURN(Page<FileRecord> page,
                            ft->ListFiles(req->purpose(), req->after(), limit));
      for (const FileRecord& f : page.data) ToProto(f, resp->add_data());
      resp->set_has_more(page.has_more);
      if (!page.data.empty()) {
        resp->set_first_id(page.data.front().id);
        resp->set_last_id(page.data.back().id);
      }
      return OkStatus();
    });
  }

  ServerUnaryReactor* DeleteFile(CallbackServerContext* ctx, const v1::DeleteFileRequest* req,
                                 v1::DeleteFileResponse* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_RETURN_IF_ERROR(ft->DeleteFile(req->file_id()));
      resp->set_id(req->file_id());
      resp->set_deleted(true);
      return OkStatus();
    });
  }

  ServerUnaryReactor* GetFileContent(CallbackServerContext* ctx,
                                     const v1::GetFileContentRequest* req,
                                     v1::GetFileContentResponse* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(std::string content, ft->FileContent(req->file_id()));
      resp->set_content(std::move(content));
      return OkStatus();
    });
  }

  ServerUnaryReactor* CreateJob(CallbackServerContext* ctx, const v1::CreateJobRequest* req,
                                v1::Job* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(JobRecord job, ft->CreateJob(CreateJobJson(*req)));
      ToProto(job, resp);
      return OkStatus();
    });
  }

  ServerUnaryReactor* GetJob(CallbackServerContext* ctx, const v1::GetJobRequest* req,
                             v1::Job* resp) override {
    return JobCall(ctx, resp,
                   [id = req->job_id()](FineTuningService* ft) { return ft->GetJob(id); });
  }
  ServerUnaryReactor* CancelJob(CallbackServerContext* ctx, const v1::CancelJobRequest* req,
                                v1::Job* resp) override {
    return JobCall(ctx, resp,
                   [id = req->job_id()](FineTuningService* ft) { return ft->CancelJob(id); });
  }
  ServerUnaryReactor* PauseJob(CallbackServerContext* ctx, const v1::PauseJobRequest* req,
                               v1::Job* resp) override {
    return JobCall(ctx, resp,
                   [id = req->job_id()](FineTuningService* ft) { return ft->PauseJob(id); });
  }
  ServerUnaryReactor* ResumeJob(CallbackServerContext* ctx, const v1::ResumeJobRequest* req,
                                v1::Job* resp) override {
    return JobCall(ctx, resp,
                   [id = req->job_id()](FineTuningService* ft) { return ft->ResumeJob(id); });
  }

  ServerUnaryReactor* ListJobs(CallbackServerContext* ctx, const v1::ListJobsRequest* req,
                               v1::ListJobsResponse* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(int limit, PageSize(req->limit()));
      const std::map<std::string, std::string> metadata(req->metadata().begin(),
                                                        req->metadata().end());
      KILN_ASSIGN_OR_RETURN(Page<JobRecord> page, ft->ListJobs(req->after(), limit, metadata));
      for (const JobRecord& j : page.data) ToProto(j, resp->add_data());
      resp->set_has_more(page.has_more);
      return OkStatus();
    });
  }

  ServerUnaryReactor* ListEvents(CallbackServerContext* ctx, const v1::ListEventsRequest* req,
                                 v1::ListEventsResponse* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(int limit, PageSize(req->limit()));
      KILN_ASSIGN_OR_RETURN(Page<EventRecord> page,
                            ft->ListEvents(req->job_id(), req->after(), limit));
      for (const EventRecord& e : page.data) ToProto(e, resp->add_data());
      resp->set_has_more(page.has_more);
      return OkStatus();
    });
  }

  ServerUnaryReactor* ListCheckpoints(CallbackServerContext* ctx,
                                      const v1::ListCheckpointsRequest* req,
                                      v1::ListCheckpointsResponse* resp) override {
    return Run(ctx, [req, resp](FineTuningService* ft) -> Status {
      KILN_ASSIGN_OR_RETURN(int limit, PageSize(req->limit()));
      KILN_ASSIGN_OR_RETURN(Page<CheckpointRecord> page,
                            ft->ListCheckpoints(req->job_id(), req->after(), limit));
      for (const CheckpointRecord& c : page.data) ToProto(c, resp->add_data());
      resp->set_has_more(page.has_more);
      return OkStatus();
    });
  }

  grpc::ServerWriteReactor<v1::WatchJobResponse>* WatchJob(
      CallbackServerContext* ctx, const v1::WatchJobRequest* req) override {
    if (Status s = AuthorizeGrpc(*core_, *ctx, RouteClass::kFineTuning); !s.ok()) {
      return new RefusedWriteReactor<v1::WatchJobResponse>(s);
    }
    return new WatchReactor(core_, &watches_, *req);
  }

 private:
  // Checks the caller's key, runs `fn(service)` on the workers and finishes the RPC with its
  // Status. Every unary RPC of the service goes through here; `method` names it in logs.
  template <typename Fn>
  ServerUnaryReactor* Run(CallbackServerContext* ctx, Fn fn,
                          std::string_view method = __builtin_FUNCTION()) {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kFineTuning, method)) return refused;
    ServerUnaryReactor* reactor = ctx->DefaultReactor();
    FineTuningService* ft = core_->fine_tuning;
    if (ft == nullptr) {
      reactor->Finish(ToGrpcStatus(Disabled()));
      return reactor;
    }
    boost::asio::post(pool_, [reactor, ft, fn = std::move(fn)]() mutable {
      reactor->Finish(ToGrpcStatus(fn(ft)));
    });
    return reactor;
  }

  template <typename Fn>
  ServerUnaryReactor* JobCall(CallbackServerContext* ctx, v1::Job* resp, Fn fn,
                              std::string_view method = __builtin_FUNCTION()) {
    return Run(
        ctx,
        [resp, fn = std::move(fn)](FineTuningService* ft) -> Status {
          KILN_ASSIGN_OR_RETURN(JobRecord job, fn(ft));
          ToProto(job, resp);
          return OkStatus();
        },
        method);
  }

  ServerCore* const core_;
  boost::asio::thread_pool pool_;
  std::atomic<int> watches_{0};
};

}  // namespace

std::unique_ptr<grpc::Service> NewFineTuningGrpcService(ServerCore* core) {
  return std::make_unique<FineTuningGrpc>(core);
}

}  // namespace kiln::finetune
