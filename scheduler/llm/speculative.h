// Speculative decoding inside the continuous batcher: a decode step that also verifies drafted
// tokens, so one forward pass over the model's weights can produce several tokens.
//
// How a step verifies. A sequence that decodes next has one token t0 not yet in the KV cache.
// With drafts d1..dK its step computes t0, d1, ..., dK at positions n..n+K (n = tokens in the
// cache) as K+1 rows of one token each (StepBatchBuilder): row j attends to the cache up to
// its own position, which the step's KV write already filled, so its logits are those a
// sequential decode would see after t0, d1..dj. Row j's token is sampled with the
// sequence's own sampler (penalties, bans, masks as of the tokens before it, and the random
// draw that token index would get: SequenceSampler's stream is counter-based). Tokens are
// taken in order while the sampled token equals the next draft; the first that differs (or
// row K's, when all K match) is the last token of the step. The KV of rejected drafts stays
// in the cache past num_computed and is overwritten later.
//
// Why the output does not change. The drafts are deterministic (copied, not sampled), so this
// is rejection sampling with a point-mass proposal: draft x is accepted with probability
// p(x) and on rejection the token comes from p restricted to the other tokens, which together
// is exactly "sample from p, keep the draft if it matches". Each emitted token is therefore
// the one sequential decoding would emit with the same random draw: greedy output is
// identical, seeded sampling is identical, and unseeded sampling has the same distribution.
//
// Method "ngram" (prompt lookup): the longest suffix of the sequence (prompt_lookup_max down
// to prompt_lookup_min tokens) that occurred before in the sequence; the draft is the tokens
// that followed its most recent earlier occurrence. Free to compute, and right whenever the
// output copies its input: rewriting code or a document, quoting, extraction.
//
// Method "draft": a smaller model with the same vocabulary (scheduler.speculative.draft_model)
// drafts greedily. It shares the batcher's paged KV layout — its own cache of as many blocks
// of the same size, indexed by the same block tables and slots — so it needs no allocation of
// its own. Per sequence, `draft_computed` tokens have their keys and values in the draft's
// cache (<= num_computed). Before scheduling, the draft catches up on tokens the target
// computed without it (after prefill, after a step that accepted every draft), at most
// max_num_batched_tokens a step over all sequences, and only a caught-up sequence drafts.
// After scheduling (which allocated the blocks of the drafted positions), single-token draft
// steps of every drafting sequence together feed t0 and each draft in turn, the next draft
// being the argmax of the draft's logits. After verification `draft_computed` drops to what
// matches the accepted tokens (rejected drafts' keys and values are overwritten later), and
// to 0 on preemption. Blocks shared through the prefix cache hold the same tokens at the same
// positions, so the draft's keys and values there are the same whoever wrote them. The
// adaptive length counts the draft's own step time and, for a sequence it has fallen behind
// (it does not follow sequences that are not drafting), its catch-up (ChooseDraftLength's
// per_draft and fixed, measured).
//
// How many drafts (adaptive, the default). A draft costs a row of the step whether it is
// accepted or not, and what a row costs depends on the device: on a GPU a decode step's time
// hardly depends on its rows, on a CPU each row adds a share of the weights' arithmetic. So
// each sequence drafts the k <= num_tokens that maximises the step's expected tokens per unit
// of time (alone: (1 - a^(k+1)) / (1 - a) / t(1 + k); ChooseDraftLength), with `a` its own
// recent acceptance rate (AcceptanceEstimate) and t the batcher's measured decode-step time by
// rows (StepCostModel), so that in a batch drafts must pay for the time they add to everyone:
// a sequence whose drafts keep failing (ordinary chat) drafts little or nothing and pays
// little, one that copies its input drafts many. A sequence not drafting drifts back towards
// the prior, so it tries again later. `adaptive: false` always drafts num_tokens.
//
// Who gets drafts: sequences in plain decode (no grammar), as many drafted tokens as their
// max_tokens and the context leave room for, and only in steps that have no prompt to
// prefill and no request waiting for their rows or tokens (the batcher and StepScheduler
// drop drafts otherwise): speculation never delays a first token.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "engine/base/status.h"
#include "models/sampling/sampling_params.h"
#include "scheduler/llm/step_cost.h"

namespace kiln {

// A sequence's speculation, resolved from its request and its model.
struct SpeculationSettings {
  enum class Method { kNgram, kDraft };
  Method method = Method::kNgram;
  int32_t num_tokens = 0;  // drafted tokens per step (at most, when adaptive); 0: none
  int32_t lookup_min = 1;  // ngram suffix lengths tried, longest first
  int32_t lookup_max = 4;
  bool adaptive = true;
};

inline constexpr int32_t kMaxSpeculativeTokens = 16;

// A sequence's recent acceptance rate: the chance that a draft is accepted given the drafts
// before it were, from decayed counts of accepted and first-rejected drafts (the tokens after
// a rejection are never judged) with a prior of one of each.
class AcceptanceEstimate {
 public:
  // A verification of `drafted` tokens of which the first `accepted` were accepted.
  void Observe(int32_t drafted, int32_t accepted);
  // A step without drafts: the estimate drifts back towards the prior.
  void Idle();
  double rate() const { return (accepted_ + 1.0) / (accepted_ + rejected_ + 2.0); }

 private:
  double accepted_ = 0, rejected_ = 0;
};

// The number of drafts, in [0, max_draft], for a sequence with acceptance `rate` joining a
// step of `rows` rows expected to yield `tokens` tokens: the k that maximises the step's
// expected tokens per unit of time, (tokens + rate + ... + rate^k) / t(rows + k). Alone in
// a step (rows 1, tokens 1) that is the sequence's own speed; in a batch, drafts must pay
// for the time they add to every sequence's step.
// `per_draft`: what drafting one more token costs apart from its row, and `fixed`: what
// drafting at all costs first, both in one-row steps (a draft model's step, and its catch-up
// on the tokens it has not seen; 0 for prompt lookup).
int32_t ChooseDraftLength(double rate, int32_t max_draft, const StepCostModel& cost,
                          int32_t rows = 1, double tokens = 1.0, double per_draft = 0.0,
                          double fixed = 0.0);

// The request's `speculative` (when given) over the model's scheduler.speculative.
// InvalidArgument naming the field ("speculative.num_tokens", param set) for an unknown
// method, "draft" for a model without a draft model (`draft_model`: the loaded one as its
// config names it; empty: none), a `model` that is not it or without "draft", or a number out
// of range.
StatusOr<SpeculationSettings> ResolveSpeculation(
    const config::SpeculativeConfig& model, const std::optional<models::SpeculativeParams>& asked,
    std::string_view model_name, std::string_view draft_model = {});

// Prompt lookup: fills `draft` with up to `max_draft` tokens that followed the most recent
// earlier occurrence of the longest suffix of `tokens` (settings' lengths) that occurs
// earlier; empty when none does.
void ProposeNgram(std::span<const int32_t> tokens, const SpeculationSettings& settings,
                  int32_t max_draft, std::vector<int32_t>* draft);

}  // namespace kiln
