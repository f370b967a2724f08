#include "server/llm/generation.h"

#include <random>

#include "absl/strings/str_format.h"
#include "server/llm/params.h"

namespace kiln::llm {

StatusOr<std::shared_ptr<Model>> GetLlm(const ServerCore& core, std::string_view name,
                                        std::string_view field) {
  if (name.empty()) {
    return WithParam(InvalidArgument("`", field, "` is missing: name the model to use"), field);
  }
  auto model = core.repository->GetReady(name);
  if (!model.ok()) return WithParam(model.status(), field);
  if (!(*model)->is_llm()) {
    return WithParam(InvalidArgument("model '", name,
                                     "' does not generate text (it is a tensor model; use "
                                     "KServe ModelInfer)"),
                     field);
  }
  return model;
}

Status Submit(const std::shared_ptr<Model>& model, std::unique_ptr<GenerateRequest> request,
              InflightLimiter::Ticket ticket) {
  auto held = std::make_shared<InflightLimiter::Ticket>(std::move(ticket));
  request->on_event = [sink = std::move(request->on_event), held](GenerateEvent&& ev) {
    const bool final = ev.finish != FinishReason::kNone;
    sink(std::move(ev));
    if (final) held->Release();
  };
  return model->llm()->Enqueue(request);
}

void Cancel(const std::shared_ptr<CancelFlag>& flag, const std::weak_ptr<Model>& model) {
  flag->Cancel();
  if (auto m = model.lock()) m->WakeUp();
}

std::string NewRequestId(std::string_view prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%s%016x%08x", ToAbsl(prefix), rng(), static_cast<uint32_t>(rng()));
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

void HttpStreamGate::Start(int status, std::string content_type, http::Headers headers,
                           std::string first) {
  absl::MutexLock lock(&mu_);
  r_->StartStream(status, std::move(content_type), std::move(headers));
  started_ = true;
  if (!first.empty()) r_->Write(std::move(first));
  for (auto& chunk : held_) r_->Write(std::move(chunk));
  held_.clear();
  if (finished_) r_->Finish();
}

void HttpStreamGate::Write(std::string chunk) {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  if (started_) {
    r_->Write(std::move(chunk));
  } else {
    held_.push_back(std::move(chunk));
  }
}

void HttpStreamGate::Finish() {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  finished_ = true;
  if (started_) r_->Finish();
}

}  // namespace kiln::llm
