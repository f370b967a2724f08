#include "models/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kiln::models {
namespace {

bool Finite(float v) { return std::isfinite(v); }

Status CheckRange(const char* name, float v, float lo, float hi, bool lo_open, const char* rule) {
  const bool ok = Finite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
  if (!ok) return InvalidArgument("`", name, "` is ", v, "; it must be in ", rule);
  return OkStatus();
}

}  // namespace

Status ValidateSamplingParams(const SamplingParams& p, int32_t vocab_size) {
  if (!Finite(p.temperature) || p.temperature < 0 || p.temperature > 100) {
    return InvalidArgument("`temperature` is ", p.temperature,
                           "; it must be in [0, 100] (0 = greedy)");
  }
  if (p.top_k < 0) {
    return InvalidArgument("`top_k` is ", p.top_k, "; it must be >= 0 (0 = off)");
  }
  KILN_RETURN_IF_ERROR(CheckRange("top_p", p.top_p, 0, 1, true, "(0, 1]"));
  KILN_RETURN_IF_ERROR(CheckRange("min_p", p.min_p, 0, 1, false, "[0, 1]"));
  KILN_RETURN_IF_ERROR(
      CheckRange("repetition_penalty", p.repetition_penalty, 0, 10, true, "(0, 10]"));
  KILN_RETURN_IF_ERROR(CheckRange("presence_penalty", p.presence_penalty, -2, 2, false, "[-2, 2]"));
  KILN_RETURN_IF_ERROR(
      CheckRange("frequency_penalty", p.frequency_penalty, -2, 2, false, "[-2, 2]"));
  if (p.max_tokens < 1) {
    return InvalidArgument("`max_tokens` is ", p.max_tokens, "; it must be at least 1");
  }
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) {
    return InvalidArgument("`min_tokens` is ", p.min_tokens,
                           "; it must be in [0, max_tokens = ", p.max_tokens, "]");
  }
  if (p.stop.size() > 16) {
    return InvalidArgument("`stop` has ", p.stop.size(), " strings; at most 16 are allowed");
  }
  for (const auto& s : p.stop) {
    if (s.empty()) return InvalidArgument("`stop` contains an empty string");
    if (s.size() > 256) {
      return InvalidArgument("a `stop` string is ", s.size(), " bytes; at most 256 are allowed");
    }
  }
  if (p.stop_token_ids.size() > 64) {
    return InvalidArgument("`stop_token_ids` has ", p.stop_token_ids.size(),
                           " entries; at most 64 are allowed");
  }
  for (int32_t id : p.stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return InvalidArgument("`stop_token_ids` contains ", id,
                             ", which is not a token of this model (vocabulary size ", vocab_size,
                             ")");
    }
  }
  if (p.logprobs < -1 || p.logprobs > 20) {
    return InvalidArgument("`logprobs` is ", p.logprobs, "; it must be in [0, 20]");
  }
  if (p.logit_bias.size() > static_cast<size_t>(kMaxLogitBias)) {
    return WithParam(InvalidArgument("`logit_bias` has ", p.logit_bias.size(), " tokens; at most ",
                                     kMaxLogitBias, " are allowed"),
                     "logit_bias");
  }
  for (const auto& [token, bias] : p.logit_bias) {
    if (token < 0 || token >= vocab_size) {
      return WithParam(
          InvalidArgument("`logit_bias` names token ", token,
                          ", which is not a token of this model (ids 0 to ", vocab_size - 1, ")"),
          "logit_bias");
    }
    if (!Finite(bias) || bias < -100 || bias > 100) {
      return WithParam(InvalidArgument("`logit_bias` gives token ", token, " the bias ", bias,
                                       "; it must be in [-100, 100]"),
                       "logit_bias");
    }
  }
  return OkStatus();
}

SequenceSampler::SequenceSampler(const SamplingParams& params, std::span<const int32_t> prompt,
                                 uint64_t fallback_seed)
    : params_(params), seed_(params.seed.value_or(fallback_seed)) {
  row_.temperature = params.temperature;
  row_.top_k = params.top_k;
  row_.top_p = params.top_p;
  row_.min_p = params.min_p;
  row_.repetition_penalty = params.repetition_penalty;
  row_.presence_penalty = params.presence_penalty;
  row_.frequency_penalty = params.frequency_penalty;
  row_.logprobs = params.logprobs;
  track_penalties_ = params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f ||
                     params.frequency_penalty != 0.0f;
  if (params.repetition_penalty != 1.0f) {
    for (int32_t t : prompt) Count(t, 0);
  }
  // Tokens listed for their bias only have count -1 (until they appear: Count).
  for (const auto& [token, bias] : params.logit_bias) {
    auto [it, inserted] =
        penalty_index_.try_emplace(token, static_cast<int32_t>(penalties_.size()));
    if (inserted) penalties_.push_back({token, -1, 0.0f});
    penalties_[it->second].bias = bias;
  }
}

void SequenceSampler::Count(int32_t token, int32_t add) {
  auto [it, inserted] = penalty_index_.try_emplace(token, static_cast<int32_t>(penalties_.size()));
  if (inserted) penalties_.push_back({token, 0});
  sampling::PenaltyToken& e = penalties_[it->second];
  e.count = std::max(e.count, 0) + add;
}

void SequenceSampler::Accept(int32_t token) {
  if (track_penalties_) Count(token, 1);
  ++generated_;
}

int32_t SequenceSampler::PenaltyIndex(int32_t token) const {
  auto it = penalty_index_.find(token);
  return it == penalty_index_.end() ? -1 : it->second;
}

double SequenceSampler::UniformAt(uint64_t draw) const {
  // SplitMix64 (Steele, Lea and Flood): output `draw` of the stream that starts at the seed,
  // reachable without the ones before it. 53 random bits -> [0, 1): identical on every
  // platform for the same seed (unlike std::uniform_real_distribution).
  uint64_t z = seed_ + (draw + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

double SequenceSampler::NextUniform() {
  const double u = PeekUniform(0);
  ++draws_;
  return u;
}

double SequenceSampler::PeekUniform(int32_t ahead) const {
  return params_.temperature == 0.0f ? 0.0 : UniformAt(draws_ + static_cast<uint64_t>(ahead));
}

SampledToken SequenceSampler::Sample(std::span<float> logits, std::span<const int32_t> end_ids,
                                     std::span<const uint32_t> allowed) {
  SampledToken out;
  std::vector<float> raw;
  if (params_.logprobs >= 0) raw.assign(logits.begin(), logits.end());
  sampling::ApplyPenalties(row_, logits, penalties_,
                           bans_end_ids() ? end_ids : std::span<const int32_t>());
  if (!allowed.empty()) sampling::ApplyAllowed(logits, allowed);
  out.token = sampling::Pick(row_, logits, NextUniform(), scratch_);
  if (params_.logprobs >= 0) ComputeLogprobs(raw, out.token, params_.logprobs, &out);
  return out;
}

void StepSamplingTable::Clear() {
  params_.clear();
  uniforms_.clear();
  penalties_.clear();
  banned_.clear();
  penalty_start_.assign(1, 0);
  banned_start_.assign(1, 0);
  allowed_.clear();
  row_allowed_.clear();
  allowed_words_ = 0;
}

void StepSamplingTable::AddSampled(SequenceSampler& sampler, std::span<const int32_t> end_ids,
                                   std::span<const uint32_t> allowed,
                                   std::span<const int32_t> pending) {
  row_allowed_.push_back(allowed.empty() ? -1 : static_cast<int64_t>(allowed_.size()));
  allowed_.insert(allowed_.end(), allowed.begin(), allowed.end());
  if (!allowed.empty()) allowed_words_ = static_cast<int32_t>(allowed.size());
  params_.push_back(sampler.row_params());
  const auto ahead = static_cast<int32_t>(pending.size());
  // The row without pending tokens drew (advanced) its token's draw: the draft rows after it
  // take the draws that follow.
  uniforms_.push_back(ahead == 0 ? sampler.NextUniform() : sampler.PeekUniform(ahead - 1));
  const size_t row_start = penalties_.size();
  penalties_.insert(penalties_.end(), sampler.penalties().begin(), sampler.penalties().end());
  if (sampler.tracks_penalties()) {
    // The pending tokens count as generated (Count's arithmetic on this row's copy).
    for (int32_t t : pending) {
      int32_t i = sampler.PenaltyIndex(t);
      if (i < 0) {
        auto it = std::find_if(penalties_.begin() + static_cast<std::ptrdiff_t>(row_start) +
                                   static_cast<std::ptrdiff_t>(sampler.penalties().size()),
                               penalties_.end(), [t](const auto& p) { return p.token == t; });
        if (it == penalties_.end()) {
          penalties_.push_back({t, 0});
          it = penalties_.end() - 1;
        }
        i = static_cast<int32_t>(it - penalties_.begin() - static_cast<std::ptrdiff_t>(row_start));
      }
      sampling::PenaltyToken& e = penalties_[row_start + static_cast<size_t>(i)];
      e.count = std::max(e.count, 0) + 1;
    }
  }
  if (sampler.bans_end_ids(ahead)) banned_.insert(banned_.end(), end_ids.begin(), end_ids.end());
  penalty_start_.push_back(static_cast<int32_t>(penalties_.size()));
  banned_start_.push_back(static_cast<int32_t>(banned_.size()));
}

void StepSamplingTable::AddIgnored() {
  sampling::RowParams greedy;
  greedy.temperature = 0;
  row_allowed_.push_back(-1);
  params_.push_back(greedy);
  uniforms_.push_back(0.0);
  penalty_start_.push_back(static_cast<int32_t>(penalties_.size()));
  banned_start_.push_back(static_cast<int32_t>(banned_.size()));
}

const StepSampling& StepSamplingTable::table() {
  table_ = StepSampling{};
  table_.params = params_;
  table_.uniforms = uniforms_;
  table_.penalties = penalties_;
  table_.penalty_start = penalty_start_;
  table_.banned = banned_;
  table_.banned_start = banned_start_;
  if (allowed_words_ > 0) {
    // One [S, W] block: constrained rows' masks, all ones elsewhere.
    const size_t W = static_cast<size_t>(allowed_words_);
    all_allowed_.assign(row_allowed_.size() * W, ~0u);
    for (size_t s = 0; s < row_allowed_.size(); ++s) {
      if (row_allowed_[s] < 0) continue;
      std::copy_n(allowed_.begin() + row_allowed_[s], W, all_allowed_.begin() + s * W);
    }
    table_.allowed = all_allowed_;
    table_.allowed_words = allowed_words_;
  }
  return table_;
}

void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, SampledToken* out) {
  const int32_t k = std::min<int32_t>(std::max(n, 0), static_cast<int32_t>(logits.size()));
  std::vector<int32_t> ids(k);
  std::vector<float> lps(k);
  out->logprob = sampling::Logprobs(logits, token, k, ids.data(), lps.data());
  out->top.clear();
  for (int32_t i = 0; i < k; ++i) out->top.push_back({ids[i], lps[i]});
}

}  // namespace kiln::models
