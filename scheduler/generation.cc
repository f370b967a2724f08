#include "scheduler/generation.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "models/chat/chat_template.h"
#include "models/llm/llm_model.h"
#include "scheduler/llm/continuous_batcher.h"
#include "scheduler/model.h"
#include "scheduler/model_repository.h"

namespace kiln {

std::function<void()> Canceller(std::shared_ptr<CancelFlag> flag, std::weak_ptr<Model> model) {
  return [flag = std::move(flag), model = std::move(model)] {
    flag->Cancel();
    if (auto m = model.lock()) m->WakeUp();
  };
}

std::function<void()> PreparedGeneration::Canceller() const {
  return kiln::Canceller(request_->cancel, model_);
}

std::string_view TokenTexts::Bytes(int32_t id) const { return tok_->TokenBytes(id); }
std::string_view TokenTexts::Piece(int32_t id) const { return tok_->Piece(id); }
bool TokenTexts::IsControl(int32_t id) const { return tok_->IsSpecial(id); }

StatusOr<LlmEndpoint> LlmEndpoint::Find(const ModelRepository& repository, std::string_view name,
                                        std::string_view field) {
  if (name.empty()) {
    return WithParam(InvalidArgument("`", field, "` is missing: name the model to use"), field);
  }
  auto model = repository.GetReady(name);
  if (!model.ok() && model.status().code() == StatusCode::kNotFound) {
    if (std::optional<LoraAdapterInfo> a = repository.FindLoraAdapter(name)) {
      auto base = repository.GetReady(a->base_model);
      if (!base.ok()) return WithParam(base.status(), field);
      KILN_ASSIGN_OR_RETURN(LlmEndpoint llm, Of(std::move(*base), field));
      llm.adapter_ = a->name;
      return llm;
    }
  }
  if (!model.ok()) return WithParam(model.status(), field);
  return Of(std::move(*model), field);
}

StatusOr<LlmEndpoint> LlmEndpoint::Of(std::shared_ptr<Model> model, std::string_view field) {
  if (!model->is_llm()) {
    return WithParam(InvalidArgument("model '", model->name(),
                                     "' does not generate text (it is a tensor model; use "
                                     "KServe ModelInfer)"),
                     field);
  }
  return LlmEndpoint(std::move(model));
}

const std::string& LlmEndpoint::name() const {
  return adapter_.empty() ? model_->name() : adapter_;
}

ModelStats& LlmEndpoint::stats() const { return model_->stats(); }

LlmInfo LlmEndpoint::info() const {
  const models::LlmModel& llm = model_->llm()->model();
  const models::ChatTemplate* tmpl = llm.chat_template();
  return {llm.info().architecture, llm.info().context_length, llm.info().vocab_size,
          tmpl != nullptr,
          tmpl != nullptr ? models::DetectToolSupport(tmpl->source()) : models::ToolSupport{}};
}

TokenTexts LlmEndpoint::tokens() const { return TokenTexts(&model_->llm()->model().tokenizer()); }

StatusOr<Prompt> LlmEndpoint::BuildPrompt(const PromptInput& input) const {
  return kiln::BuildPrompt(model_->llm()->model(), name(), input);
}

StatusOr<std::string> LlmEndpoint::Detokenize(std::span<const int32_t> ids,
                                              bool skip_special_tokens,
                                              std::string_view field) const {
  const models::Tokenizer& tok = model_->llm()->model().tokenizer();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= tok.vocab_size()) {
      return NotAToken(field, i, ids[i], name(), tok.vocab_size());
    }
  }
  return tok.Decode(ids, {.skip_special_tokens = skip_special_tokens});
}

StatusOr<PreparedGeneration> LlmEndpoint::Prepare(GenerationInput input) const {
  KILN_ASSIGN_OR_RETURN(Prompt prompt, BuildPrompt(input.prompt));
  PreparedGeneration p;
  p.request_ = std::make_unique<GenerateRequest>(std::move(input.request));
  GenerateRequest& r = *p.request_;
  r.model_name = name();
  if (r.adapter.empty()) r.adapter = adapter_;
  if (r.id.empty()) r.id = NewRequestId(input.id_prefix);
  r.prompt = std::move(prompt.ids);
  r.fields.prompt = input.prompt.field;
  p.prompt_text_ = std::move(prompt.text);
  p.model_ = model_;
  return p;
}

PreparedGeneration PreparedGeneration::Fork(int index) const {
  PreparedGeneration p;
  p.request_ = std::make_unique<GenerateRequest>(*request_);
  GenerateRequest& r = *p.request_;
  r.id = absl::StrCat(request_->id, "-", index);
  if (r.sampling.seed) *r.sampling.seed += static_cast<uint64_t>(index);
  r.trace = nullptr;
  r.on_event = nullptr;
  p.prompt_text_ = prompt_text_;
  p.model_ = model_;
  return p;
}

Status LlmEndpoint::Submit(PreparedGeneration prepared, InflightLimiter::Ticket ticket,
                           std::function<void(GenerateEvent&&)> on_event) const {
  auto held = std::make_shared<InflightLimiter::Ticket>(std::move(ticket));
  prepared.request_->on_event = [sink = std::move(on_event), held](GenerateEvent&& ev) {
    const bool final = ev.finish != FinishReason::kNone;
    sink(std::move(ev));
    if (final) held->Release();
  };
  const std::shared_ptr<RequestTrace> trace = prepared.request_->trace;
  Status s = model_->llm()->Enqueue(prepared.request_);
  // Admission: from the request's arrival (parsing, the prompt, the checks) until queued.
  if (trace)
    trace->Span("admission", trace->start(), SteadyClock::now(), {{"kiln.ok", int64_t{s.ok()}}});
  return s;
}

void GenerationResult::Add(GenerateEvent&& ev) {
  text += ev.text;
  token_ids.insert(token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
  for (auto& lp : ev.logprobs) logprobs.push_back(std::move(lp));
  if (ev.finish != FinishReason::kNone) {
    finish = ev.finish;
    stop = std::move(ev.stop);
    usage = ev.usage;
    status = std::move(ev.status);
  }
}

Status FinalStatus(FinishReason finish, const Status& status) {
  switch (finish) {
    case FinishReason::kStop:
    case FinishReason::kLength:
      return OkStatus();
    case FinishReason::kCancelled:
      return status.ok() ? Cancelled("request cancelled") : status;
    case FinishReason::kError:
      return status.ok() ? Internal("generation failed") : status;
    case FinishReason::kNone:
      break;
  }
  return Internal("generation has not finished");
}

std::string NewRequestId(std::string_view prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%s%016x%08x", ToAbsl(prefix), rng(), static_cast<uint32_t>(rng()));
}

}  // namespace kiln
