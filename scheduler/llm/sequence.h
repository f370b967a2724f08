// One generation request inside the continuous batcher: its tokens, its place in the paged KV
// cache, and its output state (sampler, detokenizer, held-back text).
//
// Internal to scheduler/llm/. Ownership: the batcher owns every Sequence; StepScheduler moves
// them between its waiting queues and its running list, and SchedulerOutput points at them
// for the duration of one step.
//
// Thread-safety: created on the caller's thread in Enqueue, used only by the loop thread after.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/grammar/token_mask.h"
#include "models/lora/lora_config.h"
#include "models/sampling/sampler.h"
#include "models/tokenizer/detokenizer.h"
#include "scheduler/llm/generate_request.h"
#include "scheduler/llm/speculative.h"

namespace kiln {

struct Sequence {
  // REQUIRES: `req` is valid (ContinuousBatcher::Check passed).
  Sequence(std::unique_ptr<GenerateRequest> r, const models::Tokenizer& tok, uint64_t seed)
      : req(std::move(r)),
        tokens(req->prompt),
        prompt_len(static_cast<int32_t>(req->prompt.size())),
        sampler(req->sampling, req->prompt, seed),
        detok(tok, {.skip_special_tokens = true, .strip_leading_space = false}) {}

  int32_t generated() const { return static_cast<int32_t>(tokens.size()) - prompt_len; }
  // Tokens known but not yet in the KV cache (1 for a sequence that decodes next).
  int32_t uncomputed() const { return static_cast<int32_t>(tokens.size()) - num_computed; }
  // The token at `pos`: a known one, or past them a drafted one.
  int32_t TokenAt(int32_t pos) const {
    const auto known = static_cast<int32_t>(tokens.size());
    return pos < known ? tokens[static_cast<size_t>(pos)] : draft[static_cast<size_t>(pos - known)];
  }

  std::unique_ptr<GenerateRequest> req;
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int32_t prompt_len;

  // ---- Scheduling (StepScheduler) ----
  int32_t num_computed = 0;      // tokens whose KV is in the cache
  std::vector<int32_t> blocks;   // block table
  std::vector<uint64_t> hashes;  // chained hashes of blocks [0, published)
  int32_t published = 0;
  uint32_t level = 0;  // index into the waiting queues (0 = priority level 1)
  uint64_t arrival = 0;
  // The LoRA adapter (resolved from req->adapter at Enqueue; null: the base model) and its
  // slot in the model, pinned from admission until the sequence ends (-1: none yet / base).
  std::shared_ptr<const models::LoraAdapter> adapter;
  int32_t adapter_slot = -1;
  uint64_t prefix_seed = 0;   // namespaces its prefix-cache blocks (model + adapter)
  int32_t cached_tokens = 0;  // prompt tokens served from the prefix cache at admission
  bool admitted = false;      // scheduled at least once
  bool done = false;          // finished: its final event was sent

  // ---- Speculative decoding (speculative.h) ----
  SpeculationSettings spec;    // num_tokens 0: off
  std::vector<int32_t> draft;  // drafted tokens after tokens.back(), verified by this step
  AcceptanceEstimate acceptance;
  int32_t draft_computed = 0;  // draft model: tokens whose KV is in its cache (<= num_computed)

  // ---- Output processing (ContinuousBatcher::ProcessOutputs) ----
  models::SequenceSampler sampler;
  models::Detokenizer detok;
  std::vector<int32_t> end_ids;  // EOS (unless ignore_eos) and stop_token_ids
  std::string held;              // text not yet sent: may be the start of a stop string
  // Structured output (structured_output.h): the sequence's place in its grammar (none:
  // unconstrained), its next step's allowed-token mask and the first grammar error.
  std::optional<grammar::TokenMatcher> matcher;
  std::vector<uint32_t> allowed;
  Status grammar_status;
  SteadyClock::time_point enqueued, first_scheduled, first_token, last_token;

  // ---- Flight recorder (ContinuousBatcher::FlightStepBegin) ----
  SteadyClock::time_point flight_progress;  // the last step that included it
  bool flight_reported = false;             // reported to the watchdog as making no progress
};

}  // namespace kiln
