// A generation request as the continuous batcher sees it, and the events it streams back.
//
// Ownership: a front end builds the request (prompt already tokenized: chat template and
// tokenizer are front-end work), hands it to ContinuousBatcher::Enqueue (on success the
// batcher owns it) and learns the result only through `on_event`, called from the batcher's
// loop thread: zero or more chunks, then exactly one final event (finish reason set, or an
// error status). on_event must not block: hand the event to the client's connection and
// return.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/sampling/sampler.h"
#include "models/sampling/sampling_params.h"
#include "scheduler/inference_request.h"

namespace kiln {

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
  models::SamplingParams sampling;
  // Triton's convention: 0 = the model's default level, 1 = highest.
  uint32_t priority = 0;
  std::optional<SteadyClock::time_point> deadline;  // whole request, queue included
  std::shared_ptr<CancelFlag> cancel = std::make_shared<CancelFlag>();
  std::function<void(GenerateEvent&&)> on_event;
  SteadyClock::time_point received_at = SteadyClock::now();
};

}  // namespace kiln
