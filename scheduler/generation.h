// The one request path every LLM front end shares (OpenAI-compatible HTTP, kiln.v1.Generation,
// KServe text_input/text_output): finding the model, building the prompt (chat template,
// tokenization), checking the request, submitting it (admission ticket, queue, cancellation)
// and collecting what it streams back. A front end only translates its wire format into a
// GenerationInput and the GenerateEvents back into its wire format; this header is all it
// includes of the scheduler's LLM side.
//
//   StatusOr<LlmEndpoint> llm = LlmEndpoint::Find(repository, name);      // 404-style errors
//   GenerationInput in;  in.prompt = ...;  in.request.sampling = ...;     // from the wire
//   StatusOr<PreparedGeneration> p = llm->Prepare(std::move(in));         // prompt errors
//   // (p->prompt_text(), p->Canceller() are known before any event arrives)
//   Status s = llm->Submit(std::move(*p), std::move(ticket), on_event);   // checks, queue full
//
// Errors are Status values that name the client's field (WithParam/ParamOf) and the numbers
// ("the prompt is 9000 tokens but model 'smollm2' has a context of 8192 tokens"): NotFound for
// an unknown model or adapter, InvalidArgument for bad input, ResourceExhausted for a full
// queue, Unavailable while the model drains. Each check is made once, in one place:
// BuildPrompt (llm/prompt.h) for the prompt's form, ContinuousBatcher::Check for everything
// that depends on the model and its limits.
//
// Thread-safety: every function and method is thread-safe. Lifetime: an LlmEndpoint keeps its
// model loaded (it holds a reference); a TokenTexts view does not, and is valid as long as the
// model is loaded — which covers every event of the model's requests.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "models/chat/tool_calls.h"
#include "scheduler/inflight.h"
#include "scheduler/llm/generate_request.h"
#include "scheduler/llm/prompt.h"

namespace kiln {

namespace models {
class Tokenizer;
}
class Model;
class ModelRepository;
class ModelStats;

// A generation request as a front end read it off its wire.
struct GenerationInput {
  PromptInput prompt;
  // Everything else, as the batcher takes it (sampling, max_tokens, priority, adapter,
  // deadline, cancel flag, the client's field names, the trace: Submit records its admission
  // span, the batcher the rest up to detokenisation). Prepare fills in model_name, prompt
  // (the token ids), fields.prompt (= prompt.field) and, when `id` is empty, a fresh id;
  // Submit sets on_event.
  GenerateRequest request;
  std::string id_prefix;  // of a fresh id ("chatcmpl-")
};

// A request whose prompt is built, not yet submitted.
class PreparedGeneration {
 public:
  const GenerateRequest& request() const { return *request_; }
  const std::string& id() const { return request_->id; }
  // The prompt as text: as given, as the chat template rendered it, or decoded from token ids
  // (completions' echo, KServe's exclude_input_in_output = false).
  const std::string& prompt_text() const { return prompt_text_; }
  // Cancels the request: a submitted one leaves the queue or the batch within one step, its
  // final event finishing with FinishReason::kCancelled. Safe from any thread, more than once,
  // before submission and after the model was unloaded.
  std::function<void()> Canceller() const;
  // Choice `index` (>= 1) of a request for several choices (OpenAI's `n`): the same prompt and
  // parameters, sampled on its own — with seed + index when the request has a seed, so each
  // choice is reproducible — under the id "<id>-<index>", untraced, and cancelled together
  // with this request (one Canceller stops every choice).
  PreparedGeneration Fork(int index) const;

 private:
  friend class LlmEndpoint;
  std::unique_ptr<GenerateRequest> request_;
  std::string prompt_text_;
  std::weak_ptr<Model> model_;
};

// Token texts of a model, for logprobs and token lists. Valid while the model is loaded.
class TokenTexts {
 public:
  std::string_view Bytes(int32_t id) const;  // the token's exact bytes (maybe part of a character)
  std::string_view Piece(int32_t id) const;  // the vocabulary entry ("<|im_end|>", "Ġworld")
  bool IsControl(int32_t id) const;          // a control token (EOS, end of turn): not text

 private:
  friend class LlmEndpoint;
  explicit TokenTexts(const models::Tokenizer* tokenizer) : tok_(tokenizer) {}
  const models::Tokenizer* tok_;
};

struct LlmInfo {
  std::string architecture;
  int32_t context_length = 0;
  int32_t vocab_size = 0;
  bool has_chat_template = false;
  // How its chat template takes tools and how the model writes calls (models/chat/tool_calls.h).
  models::ToolSupport tool_support;
};

// A ready LLM, as front ends see it. Cheap to copy.
class LlmEndpoint {
 public:
  // The ready model `name` if it generates text, or the LLM a LoRA adapter `name` is served on
  // (ModelRepository::AddLoraAdapter): Prepare then names the adapter in the request, and
  // name() is the adapter's name (what responses report). NotFound (unknown name),
  // Unavailable (not ready), InvalidArgument (a tensor model: "model 'simple' does not
  // generate text"); the error's param is `field`.
  static StatusOr<LlmEndpoint> Find(const ModelRepository& repository, std::string_view name,
                                    std::string_view field = "model");
  // The same for a model already looked up (InvalidArgument for a tensor model).
  static StatusOr<LlmEndpoint> Of(std::shared_ptr<Model> model, std::string_view field = "model");

  // The name requested: the model's, or the adapter's.
  const std::string& name() const;
  const Model& model() const { return *model_; }
  // The LoRA adapter requests go to; empty: the base model.
  const std::string& adapter() const { return adapter_; }
  ModelStats& stats() const;  // Triton's statistics, for the KServe paths
  LlmInfo info() const;
  TokenTexts tokens() const;

  // The prompt's token ids and text (prompt.h); the Tokenize RPC's answer.
  StatusOr<Prompt> BuildPrompt(const PromptInput& input) const;
  // `ids` as text. InvalidArgument naming `field`[i] for an id outside the vocabulary.
  StatusOr<std::string> Detokenize(std::span<const int32_t> ids, bool skip_special_tokens,
                                   std::string_view field) const;

  // Builds the prompt and the batcher's request. Errors: BuildPrompt's.
  StatusOr<PreparedGeneration> Prepare(GenerationInput input) const;
  // Checks the request (ContinuousBatcher::Check) and queues it. `on_event` receives its
  // events on the batcher's thread (generate_request.h); `ticket` (the server's admission)
  // is released right after the final event was delivered. On error nothing was queued,
  // on_event is never called and the ticket is released: Check's errors, ResourceExhausted
  // (queue full), Unavailable (draining).
  Status Submit(PreparedGeneration prepared, InflightLimiter::Ticket ticket,
                std::function<void(GenerateEvent&&)> on_event) const;

 private:
  explicit LlmEndpoint(std::shared_ptr<Model> model) : model_(std::move(model)) {}
  std::shared_ptr<Model> model_;  // an LLM
  std::string adapter_;
};

// Everything a request produced, for the APIs that answer once.
struct GenerationResult {
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<models::SampledToken> logprobs;
  FinishReason finish = FinishReason::kNone;
  std::string stop;
  GenerateUsage usage;
  Status status;

  bool done() const { return finish != FinishReason::kNone; }
  // Appends a chunk; the final event also sets finish, stop, usage and status.
  void Add(GenerateEvent&& event);
};

// The status to answer a finished request with: OK for stop/length, the event's error for
// kError, Cancelled for kCancelled.
Status FinalStatus(FinishReason finish, const Status& status);

// Sets `flag` and wakes `model` so the request it marks leaves the queue or the batch within
// one step. The function is safe from any thread, more than once, after the model was unloaded.
std::function<void()> Canceller(std::shared_ptr<CancelFlag> flag, std::weak_ptr<Model> model);

// A fresh request id: `prefix` + 24 hex digits.
std::string NewRequestId(std::string_view prefix = "");

}  // namespace kiln
