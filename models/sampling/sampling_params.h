// What a client may ask of token sampling, with the limits Kiln enforces. Front ends fill
// this from their wire format and call Validate before queueing a request.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/base/status.h"

namespace kiln::grammar {
class Grammar;
}  // namespace kiln::grammar

namespace kiln::models {

// Speculative decoding as a request asks for it (Kiln's `speculative` field), overriding the
// model's scheduler.speculative. Speculation never changes which tokens come out (see
// scheduler/llm/speculative.h), only how many one step produces.
struct SpeculativeParams {
  std::string method;             // "none", "ngram" or "draft"
  int32_t num_tokens = 0;         // drafted tokens per step, [1, 16]; 0: the model's
  int32_t prompt_lookup_min = 0;  // ngram: shortest suffix looked up; 0: the model's
  int32_t prompt_lookup_max = 0;  // ngram: longest suffix looked up, <= 16; 0: the model's
  std::string model = {};         // draft: the draft model as the model's config names it
};

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy (argmax); else in (0, 100]
  int32_t top_k = 0;                // 0: off; else keep the k most likely tokens
  float top_p = 1.0f;               // (0, 1]: keep the smallest set whose probability reaches p
  float min_p = 0.0f;               // [0, 1]: drop tokens below min_p * p(most likely)
  float repetition_penalty = 1.0f;  // (0, 10]: CTRL-style, on tokens in prompt and output
  float presence_penalty = 0.0f;    // [-2, 2]: OpenAI's, on tokens already generated
  float frequency_penalty = 0.0f;   // [-2, 2]: OpenAI's, times the count in the output
  std::optional<uint64_t> seed;     // same seed + same request -> same tokens
  int32_t max_tokens = 256;         // new tokens, >= 1
  int32_t min_tokens = 0;           // EOS and stop tokens are ignored before this many
  std::vector<std::string> stop;    // stop strings (not included in the output), <= 16
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t logprobs = -1;  // -1: none; 0..20: the sampled token's logprob plus top-n others
  // OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the token's logit before
  // the penalties; at most kMaxLogitBias distinct tokens.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Structured output: the grammar the output must match (models/grammar/constraint.h), or
  // null. The batcher masks every step's tokens with it and ends the sequence once the output
  // is complete.
  std::shared_ptr<const grammar::Grammar> grammar;
  // Absent: the model's configured speculation (scheduler.speculative).
  std::optional<SpeculativeParams> speculative;
};

inline constexpr int32_t kMaxLogitBias = 1024;

// Checks every field against the limits above. `vocab_size` bounds stop_token_ids; the
// message names the field, its value and what is allowed ("`top_p` is 1.5; it must be in
// (0, 1]"). NaN and infinities are rejected for every float.
Status ValidateSamplingParams(const SamplingParams& params, int32_t vocab_size);

}  // namespace kiln::models
