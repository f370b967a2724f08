#include "server/llm/generation_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <deque>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/kiln/v1/generation.grpc.pb.h"
#include "scheduler/generation.h"
#include "scheduler/output_format.h"
#include "server/grpc_auth.h"
#include "server/status_mapping.h"
#include "server/tracing.h"

namespace kiln::llm {
namespace {

using grpc::CallbackServerContext;
using grpc::ServerUnaryReactor;

grpc::ServerUnaryReactor* FinishNow(CallbackServerContext* ctx, const Status& status) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The prompt of a GenerateRequest or TokenizeRequest (`Chat` or plain text).
PromptInput ChatInput(const v1::Chat& chat) {
  PromptInput pr;
  pr.kind = PromptInput::Kind::kChat;
  pr.field = "chat.messages";
  for (const auto& m : chat.messages()) {
    pr.messages.push_back({{"role", m.role()}, {"content", m.content()}});
  }
  pr.add_generation_prompt = chat.add_generation_prompt();
  return pr;
}

PromptInput TextInput(std::string text, std::string field, bool has_add_special, bool add_special) {
  PromptInput pr;
  pr.kind = PromptInput::Kind::kText;
  pr.field = std::move(field);
  pr.text = std::move(text);
  pr.add_special_tokens = !has_add_special || add_special;
  return pr;
}

// A request with its model, ready to submit.
struct Prepared {
  LlmEndpoint llm;
  PreparedGeneration generation;
};

// sampling.output_constraint, compiled (a bad schema or grammar is the request's error).
Status ReadOutputConstraint(const v1::SamplingParams& s, models::SamplingParams* sp) {
  using grammar::Constraint;
  Constraint c;
  std::string field;
  switch (s.output_constraint_case()) {
    case v1::SamplingParams::kJsonSchema:
      c = {Constraint::Kind::kJsonSchema, s.json_schema(), /*strict=*/true};
      field = "sampling.json_schema";
      break;
    case v1::SamplingParams::kJsonObject:
      if (!s.json_object()) return OkStatus();
      c = {Constraint::Kind::kJsonObject, "", false};
      field = "sampling.json_object";
      break;
    case v1::SamplingParams::kGrammar:
      c = {Constraint::Kind::kGbnf, s.grammar(), false};
      field = "sampling.grammar";
      break;
    case v1::SamplingParams::kRegex:
      c = {Constraint::Kind::kRegex, s.regex(), false};
      field = "sampling.regex";
      break;
    default:
      return OkStatus();
  }
  StatusOr<std::shared_ptr<const grammar::Grammar>> g = grammar::CompileConstraint(c);
  if (!g.ok()) {
    return WithParam(
        Status(g.status().code(), absl::StrCat("`", field, "`: ", g.status().message())), field);
  }
  sp->grammar = *std::move(g);
  return OkStatus();
}

StatusOr<Prepared> Prepare(const ServerCore& core, const v1::GenerateRequest& req,
                           const CallbackServerContext& ctx, std::shared_ptr<RequestTrace> trace) {
  KILN_ASSIGN_OR_RETURN(LlmEndpoint llm, LlmEndpoint::Find(*core.repository, req.model()));
  GenerationInput in;
  switch (req.input_case()) {
    case v1::GenerateRequest::kPrompt:
      in.prompt =
          TextInput(req.prompt(), "prompt", req.has_add_special_tokens(), req.add_special_tokens());
      break;
    case v1::GenerateRequest::kPromptIds:
      in.prompt.kind = PromptInput::Kind::kTokenIds;
      in.prompt.field = "prompt_ids.ids";
      in.prompt.token_ids.assign(req.prompt_ids().ids().begin(), req.prompt_ids().ids().end());
      break;
    case v1::GenerateRequest::kChat:
      in.prompt = ChatInput(req.chat());
      break;
    default:
      return InvalidArgument(
          "the request has no input: set one of `prompt`, `prompt_ids` or "
          "`chat`");
  }
  GenerateRequest& r = in.request;
  const v1::SamplingParams& s = req.sampling();
  models::SamplingParams& sp = r.sampling;
  if (s.has_max_tokens()) r.max_tokens = s.max_tokens();
  r.fields.max_tokens = "sampling.max_tokens";
  r.fields.sampling = "sampling";
  if (s.has_temperature()) sp.temperature = s.temperature();
  if (s.has_top_k()) sp.top_k = s.top_k();
  if (s.has_top_p()) sp.top_p = s.top_p();
  if (s.has_min_p()) sp.min_p = s.min_p();
  if (s.has_repetition_penalty()) sp.repetition_penalty = s.repetition_penalty();
  if (s.has_presence_penalty()) sp.presence_penalty = s.presence_penalty();
  if (s.has_frequency_penalty()) sp.frequency_penalty = s.frequency_penalty();
  if (s.has_seed()) sp.seed = s.seed();
  if (s.has_logprobs()) sp.logprobs = s.logprobs();
  sp.min_tokens = s.min_tokens();
  sp.ignore_eos = s.ignore_eos();
  sp.stop.assign(s.stop().begin(), s.stop().end());
  sp.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  // Sorted by token id: a protobuf map's order is unspecified.
  sp.logit_bias.assign(s.logit_bias().begin(), s.logit_bias().end());
  std::sort(sp.logit_bias.begin(), sp.logit_bias.end());
  KILN_RETURN_IF_ERROR(ReadOutputConstraint(s, &sp));
  if (s.has_speculative()) {
    const v1::Speculative& spec = s.speculative();
    sp.speculative =
        models::SpeculativeParams{spec.method(), spec.num_tokens(), spec.prompt_lookup_min(),
                                  spec.prompt_lookup_max(), spec.model()};
  }
  r.id = req.request_id();
  r.priority = req.priority();
  if (req.timeout_ms() > 0) {
    r.deadline = r.received_at +
                 std::chrono::milliseconds(std::min<uint64_t>(req.timeout_ms(), 365ull * 86400000));
  }
  // The RPC's own deadline (the client's timeout) bounds the request too.
  const auto rpc_deadline = ctx.deadline();
  if (rpc_deadline < std::chrono::system_clock::time_point::max() - std::chrono::hours(24)) {
    const auto d = SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(
                                            rpc_deadline - std::chrono::system_clock::now());
    if (!r.deadline || d < *r.deadline) r.deadline = d;
  }
  in.request.trace = std::move(trace);
  KILN_ASSIGN_OR_RETURN(PreparedGeneration p, llm.Prepare(std::move(in)));
  return Prepared{std::move(llm), std::move(p)};
}

void FillLogprobs(const TokenTexts& tok, const std::vector<models::SampledToken>& lps,
                  google::protobuf::RepeatedPtrField<v1::TokenLogprobs>* out) {
  for (const auto& t : lps) {
    v1::TokenLogprobs* e = out->Add();
    e->set_id(t.token);
    // proto3 strings must be UTF-8: a token that is part of a character reads as U+FFFD.
    e->set_text(ValidUtf8(tok.Bytes(t.token)));
    e->set_logprob(t.logprob);
    for (const auto& alt : t.top) {
      v1::TopLogprob* a = e->add_top();
      a->set_id(alt.token);
      a->set_text(ValidUtf8(tok.Bytes(alt.token)));
      a->set_logprob(alt.logprob);
    }
  }
}

void FillUsage(const GenerateUsage& u, v1::Usage* out) {
  out->set_prompt_tokens(u.prompt_tokens);
  out->set_completion_tokens(u.completion_tokens);
  out->set_cached_tokens(u.cached_tokens);
}

// Generate: collects the events, answers once.
class GenerateReactor final : public ServerUnaryReactor {
 public:
  GenerateReactor(ServerCore* core, CallbackServerContext* ctx, const v1::GenerateRequest* req,
                  v1::GenerateResponse* resp) {
    auto trace = BeginGrpcTrace(*core, *ctx, "kiln.v1.Generation/Generate");
    AddTraceMetadata(trace.get(), ctx);
    Status s = Start(core, ctx, *req, resp, trace);
    if (s.ok()) return;
    if (trace) trace->End(s);
    Finish(ToGrpcStatus(s));
  }
  void OnCancel() override { cancel_(); }
  void OnDone() override { delete this; }

 private:
  Status Start(ServerCore* core, CallbackServerContext* ctx, const v1::GenerateRequest& req,
               v1::GenerateResponse* resp, std::shared_ptr<RequestTrace> trace) {
    KILN_ASSIGN_OR_RETURN(auto ticket, core->Admit());
    KILN_ASSIGN_OR_RETURN(Prepared p, Prepare(*core, req, *ctx, trace));
    cancel_ = p.generation.Canceller();
    resp->set_request_id(p.generation.id());
    resp->set_model(req.model());
    auto result = std::make_shared<GenerationResult>();
    auto on_event = [this, resp, tok = p.llm.tokens(), result, trace](GenerateEvent&& ev) {
      result->Add(std::move(ev));
      if (!result->done()) return;
      const auto start = SteadyClock::now();
      Status s = FinalStatus(result->finish, result->status);
      if (s.ok()) {
        resp->set_text(std::move(result->text));
        resp->mutable_token_ids()->Assign(result->token_ids.begin(), result->token_ids.end());
        resp->set_finish_reason(std::string(FinishReasonName(result->finish)));
        resp->set_stop_reason(ValidUtf8(result->stop));
        FillUsage(result->usage, resp->mutable_usage());
        FillLogprobs(tok, result->logprobs, resp->mutable_logprobs());
      }
      if (trace) {
        trace->Span("response", start, SteadyClock::now());
        trace->End(s);
      }
      Finish(ToGrpcStatus(s));  // last: the reactor may be gone once it returns
    };
    return p.llm.Submit(std::move(p.generation), std::move(ticket), std::move(on_event));
  }

  std::function<void()> cancel_ = [] {};
};

// GenerateStream: one message per event, written in order; the last carries finish_reason
// and usage. An error or cancellation ends the RPC with that status after what was queued.
class StreamReactor final : public grpc::ServerWriteReactor<v1::GenerateStreamResponse> {
 public:
  StreamReactor(ServerCore* core, CallbackServerContext* ctx, const v1::GenerateRequest* req)
      : state_(std::make_shared<State>()) {
    state_->reactor = this;
    state_->trace = BeginGrpcTrace(*core, *ctx, "kiln.v1.Generation/GenerateStream");
    AddTraceMetadata(state_->trace.get(), ctx);
    Status s = Start(core, ctx, *req);
    if (s.ok()) return;
    if (state_->trace) state_->trace->End(s);
    Finish(ToGrpcStatus(s));
  }

  void OnWriteDone(bool ok) override {
    auto state = state_;  // keeps the state alive past Finish (OnDone may delete us)
    absl::MutexLock lock(&state->mu);
    state->queue.pop_front();
    if (!ok && !state->broken) {
      // The client is gone: stop generating; the final event ends the RPC.
      state->broken = true;
      state->queue.clear();
      cancel_();
    }
    if (!state->queue.empty()) {
      StartWrite(&state->queue.front());
      return;
    }
    state->writing = false;
    state->MaybeFinish();
  }
  void OnCancel() override { cancel_(); }
  void OnDone() override { delete this; }

 private:
  struct State {
    absl::Mutex mu;
    StreamReactor* reactor = nullptr;                                  // set once, before any event
    std::deque<v1::GenerateStreamResponse> queue ABSL_GUARDED_BY(mu);  // front: being written
    bool writing ABSL_GUARDED_BY(mu) = false;
    bool broken ABSL_GUARDED_BY(mu) = false;  // the client is gone: drop messages
    bool final_seen ABSL_GUARDED_BY(mu) = false;
    bool finished ABSL_GUARDED_BY(mu) = false;
    grpc::Status status ABSL_GUARDED_BY(mu);
    Status final_status ABSL_GUARDED_BY(mu);  // for the trace
    std::shared_ptr<RequestTrace> trace;      // set once, before any event; may be null
    // The first message queued: the response span's start.
    SteadyClock::time_point first_push ABSL_GUARDED_BY(mu);

    void Push(v1::GenerateStreamResponse&& msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (trace && first_push == SteadyClock::time_point{}) first_push = SteadyClock::now();
      if (broken) return;
      queue.push_back(std::move(msg));
      if (!writing) {
        writing = true;
        reactor->StartWrite(&queue.front());
      }
    }
    void MaybeFinish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (!final_seen || writing || finished) return;
      finished = true;
      if (trace) {
        const auto now = SteadyClock::now();
        trace->Span("response", first_push == SteadyClock::time_point{} ? now : first_push, now,
                    {{"kiln.stream", int64_t{1}}});
        trace->End(final_status, now);
      }
      reactor->Finish(status);
    }
  };

  Status Start(ServerCore* core, CallbackServerContext* ctx, const v1::GenerateRequest& req) {
    KILN_ASSIGN_OR_RETURN(auto ticket, core->Admit());
    KILN_ASSIGN_OR_RETURN(Prepared p, Prepare(*core, req, *ctx, state_->trace));
    cancel_ = p.generation.Canceller();
    auto on_event = [state = state_, tok = p.llm.tokens(),
                     id = p.generation.id()](GenerateEvent&& ev) {
      const bool final = ev.finish != FinishReason::kNone;
      const Status s = final ? FinalStatus(ev.finish, ev.status) : OkStatus();
      absl::MutexLock lock(&state->mu);
      if (s.ok() && (final || !ev.text.empty() || !ev.token_ids.empty())) {
        v1::GenerateStreamResponse msg;
        msg.set_request_id(id);
        msg.set_text(std::move(ev.text));
        msg.mutable_token_ids()->Assign(ev.token_ids.begin(), ev.token_ids.end());
        FillLogprobs(tok, ev.logprobs, msg.mutable_logprobs());
        if (final) {
          msg.set_finish_reason(std::string(FinishReasonName(ev.finish)));
          msg.set_stop_reason(ValidUtf8(ev.stop));
          FillUsage(ev.usage, msg.mutable_usage());
        }
        state->Push(std::move(msg));
      }
      if (!final) return;
      state->final_seen = true;
      state->final_status = s;
      state->status = ToGrpcStatus(s);
      state->MaybeFinish();
    };
    return p.llm.Submit(std::move(p.generation), std::move(ticket), std::move(on_event));
  }

  std::shared_ptr<State> state_;
  std::function<void()> cancel_ = [] {};
};

class GenerationService final : public v1::Generation::CallbackService {
 public:
  explicit GenerationService(ServerCore* core) : core_(core) {}

  ServerUnaryReactor* Generate(CallbackServerContext* ctx, const v1::GenerateRequest* req,
                               v1::GenerateResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    return new GenerateReactor(core_, ctx, req, resp);
  }

  grpc::ServerWriteReactor<v1::GenerateStreamResponse>* GenerateStream(
      CallbackServerContext* ctx, const v1::GenerateRequest* req) override {
    if (Status s = AuthorizeGrpc(*core_, *ctx, RouteClass::kInference); !s.ok()) {
      return new RefusedWriteReactor<v1::GenerateStreamResponse>(s);
    }
    return new StreamReactor(core_, ctx, req);
  }

  ServerUnaryReactor* Tokenize(CallbackServerContext* ctx, const v1::TokenizeRequest* req,
                               v1::TokenizeResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    return FinishNow(ctx, DoTokenize(*req, resp));
  }

  ServerUnaryReactor* Detokenize(CallbackServerContext* ctx, const v1::DetokenizeRequest* req,
                                 v1::DetokenizeResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    return FinishNow(ctx, DoDetokenize(*req, resp));
  }

  ServerUnaryReactor* ListModels(CallbackServerContext* ctx, const v1::ListModelsRequest*,
                                 v1::ListModelsResponse* resp) override {
    if (auto* refused = RefuseUnary(*core_, ctx, RouteClass::kInference)) return refused;
    std::map<std::string, std::shared_ptr<Model>> ready;
    for (auto& m : core_->repository->ReadyModels()) ready[m->name()] = m;
    for (const auto& e : core_->repository->Index()) {
      v1::ModelInfo* info = resp->add_models();
      info->set_name(e.name);
      info->set_state(std::string(ModelStateName(e.state)));
      auto it = ready.find(e.name);
      if (it == ready.end()) {
        if (const auto* cfg = core_->config->FindModel(e.name)) info->set_kind(cfg->kind);
        continue;
      }
      const Model& m = *it->second;
      info->set_kind(m.config().kind);
      auto llm = LlmEndpoint::Of(it->second);
      if (!llm.ok()) continue;
      const LlmInfo li = llm->info();
      info->set_architecture(li.architecture);
      info->set_context_length(li.context_length);
      info->set_vocab_size(li.vocab_size);
      info->set_has_chat_template(li.has_chat_template);
    }
    for (const LoraAdapterInfo& a : core_->repository->LoraAdapters()) {
      v1::ModelInfo* info = resp->add_models();
      info->set_name(a.name);
      info->set_kind("lora");
      info->set_parent(a.base_model);
      auto llm = LlmEndpoint::Find(*core_->repository, a.name);
      info->set_state(llm.ok() ? "READY" : "UNAVAILABLE");
      if (!llm.ok()) continue;
      const LlmInfo li = llm->info();
      info->set_architecture(li.architecture);
      info->set_context_length(li.context_length);
      info->set_vocab_size(li.vocab_size);
      info->set_has_chat_template(li.has_chat_template);
    }
    return FinishNow(ctx, OkStatus());
  }

 private:
  Status DoTokenize(const v1::TokenizeRequest& req, v1::TokenizeResponse* resp) {
    KILN_ASSIGN_OR_RETURN(LlmEndpoint llm, LlmEndpoint::Find(*core_->repository, req.model()));
    const PromptInput in =
        req.input_case() == v1::TokenizeRequest::kChat
            ? ChatInput(req.chat())
            : TextInput(req.text(), "text", req.has_add_special_tokens(), req.add_special_tokens());
    KILN_ASSIGN_OR_RETURN(Prompt prompt, llm.BuildPrompt(in));
    const TokenTexts tokens = llm.tokens();
    for (int32_t id : prompt.ids) {
      resp->add_token_ids(id);
      resp->add_pieces(ValidUtf8(tokens.Piece(id)));
    }
    return OkStatus();
  }

  Status DoDetokenize(const v1::DetokenizeRequest& req, v1::DetokenizeResponse* resp) {
    KILN_ASSIGN_OR_RETURN(LlmEndpoint llm, LlmEndpoint::Find(*core_->repository, req.model()));
    std::vector<int32_t> ids(req.token_ids().begin(), req.token_ids().end());
    KILN_ASSIGN_OR_RETURN(std::string text,
                          llm.Detokenize(ids, req.skip_special_tokens(), "token_ids"));
    resp->set_text(std::move(text));
    return OkStatus();
  }

  ServerCore* const core_;
};

}  // namespace

std::unique_ptr<grpc::Service> NewGenerationService(ServerCore* core) {
  return std::make_unique<GenerationService>(core);
}

}  // namespace kiln::llm
