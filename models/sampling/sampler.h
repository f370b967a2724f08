// Token sampling for one sequence: penalties, temperature, top-k, top-p, min-p, seeded
// randomness, and log-probabilities.
//
// Order of operations (the same as vLLM and Hugging Face):
//   raw logits -> (logprobs are taken here: the model's own distribution)
//   -> repetition penalty (prompt + output tokens) -> presence/frequency penalties (output)
//   -> EOS/stop tokens masked while fewer than min_tokens were generated
//   -> greedy argmax if temperature == 0, else: / temperature -> top-k -> softmax -> top-p
//   -> min-p -> draw.
// top-p is exact: it selects the largest logits by partial selection, growing the candidate
// set until it holds p of the mass, instead of sorting the whole vocabulary.
//
// Thread-safety: one sampler per sequence, used by one thread.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "models/sampling/sampling_params.h"

namespace kiln::models {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0;              // of `token`, under the raw model distribution
  std::vector<TokenLogprob> top;  // the `logprobs` most likely tokens, most likely first
};

class SequenceSampler {
 public:
  // `prompt` feeds the repetition penalty. Without params.seed, the sampler draws its seed
  // from `fallback_seed` (the batcher passes a random one per request).
  SequenceSampler(const SamplingParams& params, std::span<const int32_t> prompt,
                  uint64_t fallback_seed);

  // Picks the next token from one row of logits (used as scratch: modified in place).
  // `end_ids` are the tokens that end generation (EOS + stop_token_ids); they are masked
  // while fewer than min_tokens tokens were accepted.
  SampledToken Sample(std::span<float> logits, std::span<const int32_t> end_ids);

  // Records a generated token (for penalties and min_tokens).
  void Accept(int32_t token);

  int32_t generated() const { return generated_; }

 private:
  void ApplyPenalties(std::span<float> logits) const;
  int32_t Draw(std::span<float> logits);
  double Uniform();  // [0, 1), platform-independent

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::unordered_set<int32_t> prompt_tokens_;
  std::unordered_map<int32_t, int32_t> output_counts_;
  int32_t generated_ = 0;
  std::vector<int32_t> order_;  // scratch: candidate token ids
  std::vector<float> weights_;  // scratch: exp(logit - max) per token
};

// log_softmax(logits)[token] and the n most likely tokens, under the raw distribution.
void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, SampledToken* out);

}  // namespace kiln::models
