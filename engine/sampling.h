// Token sampling on one row of logits: the one algorithm behind the step program's `sample`
// op (its reference and cpu kernels call these functions; device kernels port them) and the
// host sampler (models/sampling/sampler.h, the reference and the fallback).
//
// Order of operations (vLLM's and Hugging Face's):
//   raw logits -> (logprobs are taken here: the model's own distribution)
//   -> logit bias (OpenAI's logit_bias, added) -> repetition penalty (prompt and output tokens)
//   -> presence/frequency penalties (output)
//   -> banned tokens (EOS/stop tokens while fewer than min_tokens were generated) -> -inf
//   -> allowed-token mask (grammar-constrained decoding: tokens outside it) -> -inf
//   -> greedy argmax if temperature == 0, else: / temperature -> top-k -> exp(l - max)
//   -> top-p -> min-p -> draw with a uniform u in [0, 1).
// A row whose logits are all -inf at the pick (every token banned or masked) has no token:
// Pick returns -1 (kNoToken), greedy or not.
//
// The draw walks the candidates in a canonical order, so every implementation that sums in
// that order picks the same token for the same u: descending logit (ties: lower token id
// first) when top-k or top-p chose the candidates, else ascending token id. Probability mass
// is summed in double, each weight exp(l - max) computed in float.
//
// Thread-safety: pure functions; a Scratch is used by one thread at a time.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kiln::sampling {

// One sequence's parameters. The `sample` op takes them as one f32 row of its `params`
// input, in the order of ParamIndex.
struct RowParams {
  float temperature = 1.0f;         // 0: greedy
  int32_t top_k = 0;                // 0: off
  float top_p = 1.0f;               // 1: off
  float min_p = 0.0f;               // 0: off
  float repetition_penalty = 1.0f;  // 1: off
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int32_t logprobs = -1;  // -1: none; else the top-n alternatives wanted (n <= kMaxLogprobs)
};
enum ParamIndex : int {
  kTemperature,
  kTopK,
  kTopP,
  kMinP,
  kRepetitionPenalty,
  kPresencePenalty,
  kFrequencyPenalty,
  kLogprobs,
  kNumParams,
};
inline constexpr int kMaxLogprobs = 20;

// Packs `p` into a params row (kNumParams floats) and back.
void PackParams(const RowParams& p, float* row);
RowParams UnpackParams(const float* row);

// A token the penalties act on: generated `count` times so far (0: it is only in the prompt,
// which only the repetition penalty sees; -1: in neither, listed for its bias only), and the
// request's logit bias for it. Each token appears at most once in a list.
struct PenaltyToken {
  int32_t token = 0;
  int32_t count = 0;
  float bias = 0.0f;
};

// Adds each listed token's bias to `logits` and applies the repetition, presence and
// frequency penalties, in place, then sets the `banned` tokens to -inf. Tokens outside the
// vocabulary are ignored.
void ApplyPenalties(const RowParams& p, std::span<float> logits,
                    std::span<const PenaltyToken> penalties, std::span<const int32_t> banned);

// The allowed-token mask of one row: 32 tokens per word, token t is bit (t % 32) of word
// t / 32 (LSB first); a set bit allows the token. The `sample` op takes the words as i32.
inline constexpr int64_t AllowedWords(int64_t vocab) { return (vocab + 31) / 32; }

// Sets every token whose bit in `allowed` is clear to -inf, in place (bits past the
// vocabulary in the last word are ignored). All bits set changes nothing.
// REQUIRES: allowed.size() == AllowedWords(logits.size()).
void ApplyAllowed(std::span<float> logits, std::span<const uint32_t> allowed);

// What Pick returns when no token can be drawn (every logit -inf).
inline constexpr int32_t kNoToken = -1;

// Reused buffers (sized to the vocabulary on first use).
struct Scratch {
  std::vector<int32_t> order;
  std::vector<float> weights;
};

// The next token from penalized logits (`logits` is modified: divided by the temperature):
// the first maximum when temperature == 0, else a draw with `u` in [0, 1) over the candidates
// (see the file comment); never a token whose logit is -inf: kNoToken if every logit is -inf.
// REQUIRES: logits not empty.
int32_t Pick(const RowParams& p, std::span<float> logits, double u, Scratch& scratch);

// Under the raw distribution log_softmax(raw): the logprob of `token` and the `n` most likely
// tokens (most likely first; ties: lower id first) into top_ids/top_logprobs, which hold at
// least min(n, vocab) entries. Returns the logprob of `token`, or 0 if `token` is outside the
// vocabulary (kNoToken: the row had no token to sample).
float Logprobs(std::span<const float> raw, int32_t token, int32_t n, int32_t* top_ids,
               float* top_logprobs);

}  // namespace kiln::sampling
