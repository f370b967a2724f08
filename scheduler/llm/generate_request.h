// A generation request as the continuous batcher sees it, the events it streams back, and the
// field-naming of its errors.
//
// Ownership: the request path (scheduler/generation.h) builds the request (prompt already
// tokenized), hands it to ContinuousBatcher::Enqueue (on success the batcher owns it) and
// learns the result only through `on_event`, called from the batcher's loop thread: zero or
// more chunks, then exactly one final event (finish reason set, or an error status). on_event
// must not block: hand the event to the client's connection and return.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"
#include "models/sampling/sampler.h"
#include "models/sampling/sampling_params.h"
#include "scheduler/inference_request.h"
#include "scheduler/trace.h"

namespace kiln {

// max_tokens when a request leaves it out: OpenAI's semantics (up to the rest of the context)
// with this cap, so a forgotten limit cannot hold a sequence for a model's whole 128k context.
inline constexpr int32_t kDefaultMaxTokens = 4096;

enum class FinishReason {
  kNone,       // not finished (a streaming chunk)
  kStop,       // EOS, a stop token or a stop string
  kLength,     // max_tokens, or the model's context is full
  kCancelled,  // the client went away or cancelled
  kError,      // see GenerateEvent::status
};
std::string_view FinishReasonName(FinishReason r);  // "stop", "length", "cancelled", "error"

struct GenerateUsage {
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;  // prompt tokens served from the prefix cache
};

struct GenerateEvent {
  std::vector<int32_t> token_ids;  // new tokens (includes a final EOS/stop token)
  std::string text;                // new text: whole UTF-8 characters, stop strings removed
  std::vector<models::SampledToken> logprobs;  // one per token, when requested
  FinishReason finish = FinishReason::kNone;
  std::string stop;     // the stop string or token text that ended generation, if any
  Status status;        // not OK only with finish == kError
  GenerateUsage usage;  // filled on the final event
};

struct GenerateRequest {
  std::string model_name;
  std::string id;
  std::vector<int32_t> prompt;  // token ids, non-empty
  // Sampling as asked. Enqueue sets sampling.max_tokens from `max_tokens` below.
  models::SamplingParams sampling;
  // New tokens at most, as the client asked; absent: the rest of the context and of the KV
  // cache, capped at default_max_tokens.
  std::optional<int64_t> max_tokens;
  int32_t default_max_tokens = kDefaultMaxTokens;
  // Triton's convention: 0 = the model's default level, 1 = highest.
  int64_t priority = 0;
  // The adapter (LoRA) asked for by name; "" = the base model. An adapter the model does not
  // serve is refused with NotFound, as an unknown model is.
  std::string adapter;
  std::optional<SteadyClock::time_point> deadline;  // whole request, queue included
  std::shared_ptr<CancelFlag> cancel = std::make_shared<CancelFlag>();
  std::function<void(GenerateEvent&&)> on_event;
  SteadyClock::time_point received_at = SteadyClock::now();
  // The request's trace: the batcher adds queue, prefill, decode and detokenize spans
  // (llm/step_trace.h). Null: not traced.
  std::shared_ptr<RequestTrace> trace;

  // What the client calls these fields, for error messages and OpenAI's `param`: kiln.v1
  // says "sampling.max_tokens", chat completions "max_completion_tokens", KServe "text_input".
  struct Fields {
    std::string prompt = "prompt";
    std::string max_tokens = "max_tokens";
    std::string
        sampling;  // written before sampling errors ("sampling: `top_p` is 0; ..."); "": none
    std::string priority = "priority";
    std::string adapter = "model";
  } fields;
};

// InvalidArgument (param `field`): "`prompt[3]` is 99999, which is not a token of model 'm'
// (token ids are 0 to 49151)".
Status NotAToken(std::string_view field, size_t index, int64_t id, std::string_view model,
                 int32_t vocab_size);

// `text` with every invalid UTF-8 sequence replaced by U+FFFD (for text that must travel
// in a proto3 `string` or a JSON string, or into an error message).
std::string ValidUtf8(std::string_view text);

}  // namespace kiln
