// Token sampling for one sequence: penalties, temperature, top-k, top-p, min-p, seeded
// randomness, and log-probabilities — the host sampler, reference and fallback of the step
// program's `sample` op. The order of operations and the arithmetic are engine/sampling.h's.
// top-p is exact: it selects the largest logits by partial selection, growing the candidate
// set until it holds p of the mass, instead of sorting the whole vocabulary.
//
// Thread-safety: one sampler per sequence, used by one thread.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "engine/sampling.h"
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

// The sampling state of one sequence: its parameters, its random stream and the tokens the
// penalties act on. The arithmetic is engine/sampling.h's, shared with the step program's
// `sample` op, so a sequence samples the same tokens on the host (this class) and in a step
// program fed by DeviceInputs().
class SequenceSampler {
 public:
  // `prompt` feeds the repetition penalty. Without params.seed, the sampler draws its seed
  // from `fallback_seed` (the batcher passes a random one per request).
  SequenceSampler(const SamplingParams& params, std::span<const int32_t> prompt,
                  uint64_t fallback_seed);

  // Picks the next token from one row of logits (used as scratch: modified in place).
  // `end_ids` are the tokens that end generation (EOS + stop_token_ids); they are masked
  // while fewer than min_tokens tokens were accepted. `allowed`, when not empty, is the
  // grammar's allowed-token mask (engine/sampling.h ApplyAllowed; AllowedWords(vocab) words):
  // the token is sampling::kNoToken when it allows nothing that is left.
  SampledToken Sample(std::span<float> logits, std::span<const int32_t> end_ids,
                      std::span<const uint32_t> allowed = {});

  // Records a generated token (for penalties and min_tokens).
  void Accept(int32_t token);

  int32_t generated() const { return generated_; }

  // ---- For a step program that samples on the device (the `sample` op) ----
  const sampling::RowParams& row_params() const { return row_; }
  // Distinct prompt and output tokens with their output counts; empty when no penalty is on.
  std::span<const sampling::PenaltyToken> penalties() const { return penalties_; }
  // Whether `end_ids` are banned at the step `ahead` tokens after the next one (min_tokens
  // not reached by then).
  bool bans_end_ids(int32_t ahead = 0) const { return generated_ + ahead < params_.min_tokens; }
  // Whether the penalties count output tokens (repetition, presence or frequency penalty on).
  bool tracks_penalties() const { return track_penalties_; }
  // penalties()'s index of `token`, -1 when it is not listed.
  int32_t PenaltyIndex(int32_t token) const;
  // The uniform the next Sample would draw (advances the stream; 0 for greedy sequences).
  double NextUniform();

  // ---- Speculative decoding: rows sampled ahead of the tokens accepted so far ----
  // The stream is counter-based (draw i is a pure function of the seed and i), so a
  // verification row `ahead` tokens past the next one draws exactly what a sequential
  // decode would draw for that token: seeded output does not depend on speculation.
  // The uniform of the draw `ahead` past the next (does not advance; 0 when greedy).
  double PeekUniform(int32_t ahead) const;
  // Consumes one draw (a token a verification row sampled, now accepted).
  void SkipUniform() { ++draws_; }

 private:
  double UniformAt(uint64_t draw) const;  // [0, 1), platform-independent
  void Count(int32_t token, int32_t add);

  SamplingParams params_;
  sampling::RowParams row_;
  uint64_t seed_ = 0;
  uint64_t draws_ = 0;  // uniforms drawn so far
  bool track_penalties_ = false;
  std::vector<sampling::PenaltyToken> penalties_;
  std::unordered_map<int32_t, int32_t> penalty_index_;  // token -> index in penalties_
  int32_t generated_ = 0;
  sampling::Scratch scratch_;
};

// How each sequence of a step samples its next token, for a model that samples inside its
// step program (engine's sample op, engine/sampling.h). Rows follow the batch's sequences;
// penalty and ban lists are concatenated, row s owning [start[s], start[s + 1]). A row whose
// token is not wanted (a prompt still being prefilled) is best made greedy and plain.
struct StepSampling {
  std::span<const sampling::RowParams> params;  // [S]
  std::span<const double> uniforms;             // [S] in [0, 1); ignored by greedy rows
  std::span<const sampling::PenaltyToken> penalties;
  std::span<const int32_t> penalty_start;  // [S + 1]
  std::span<const int32_t> banned;         // tokens set to -inf (EOS before min_tokens)
  std::span<const int32_t> banned_start;   // [S + 1]
  // [S, allowed_words] allowed-token masks (engine/sampling.h ApplyAllowed), all bits set in
  // unconstrained rows; empty (allowed_words 0) when no row is constrained.
  std::span<const uint32_t> allowed;
  int32_t allowed_words = 0;
};

// Builds a step's StepSampling row by row from the sequences' samplers; its buffers are reused
// from step to step. The table is valid until the next Clear or Add.
class StepSamplingTable {
 public:
  void Clear();
  // The row of a sequence that gets its next token this step: its sampler's parameters and
  // penalty list, `end_ids` banned while min_tokens is not reached, and the next uniform of
  // its stream (advanced, as SequenceSampler::Sample would). `allowed`: its grammar's mask
  // (AllowedWords(vocab) words), or empty when it is unconstrained.
  // Speculative decoding: `pending` are tokens (drafts) assumed accepted before this row's
  // token. The row then counts them in its penalties and bans end_ids by min_tokens as of
  // them. A sequence's rows come in order, the first (no pending tokens) advancing the stream
  // as above; a row with pending tokens takes the draw pending.size() past that one without
  // advancing (the batcher consumes a draw per further token it accepts:
  // SequenceSampler::SkipUniform).
  void AddSampled(SequenceSampler& sampler, std::span<const int32_t> end_ids,
                  std::span<const uint32_t> allowed = {}, std::span<const int32_t> pending = {});
  // The row of a sequence whose token is not wanted (a prompt still prefilling): greedy.
  void AddIgnored();
  const StepSampling& table();

 private:
  std::vector<sampling::RowParams> params_;
  std::vector<double> uniforms_;
  std::vector<sampling::PenaltyToken> penalties_;
  std::vector<int32_t> penalty_start_ = {0}, banned_, banned_start_ = {0};
  // Rows' masks; row_allowed_[s] indexes allowed_ (in words), -1 for an unconstrained row.
  std::vector<uint32_t> allowed_, all_allowed_;
  std::vector<int64_t> row_allowed_;
  int32_t allowed_words_ = 0;
  StepSampling table_;
};

// log_softmax(logits)[token] and the n most likely tokens, under the raw distribution.
void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, SampledToken* out);

}  // namespace kiln::models
