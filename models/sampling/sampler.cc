#include "models/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kiln::models {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
  return OkStatus();
}

SequenceSampler::SequenceSampler(const SamplingParams& params, std::span<const int32_t> prompt,
                                 uint64_t fallback_seed)
    : params_(params), rng_(params.seed.value_or(fallback_seed)) {
  if (params_.repetition_penalty != 1.0f) prompt_tokens_.insert(prompt.begin(), prompt.end());
}

void SequenceSampler::Accept(int32_t token) {
  ++output_counts_[token];
  ++generated_;
}

double SequenceSampler::Uniform() {
  // 53 random bits -> [0, 1): identical on every platform for the same seed (unlike
  // std::uniform_real_distribution, whose algorithm is implementation-defined).
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

void SequenceSampler::ApplyPenalties(std::span<float> logits) const {
  const float rp = params_.repetition_penalty;
  auto repeat = [&](int32_t t) {
    float& l = logits[t];
    l = l > 0 ? l / rp : l * rp;
  };
  if (rp != 1.0f) {
    for (int32_t t : prompt_tokens_) repeat(t);
    for (const auto& [t, n] : output_counts_) {
      if (!prompt_tokens_.contains(t)) repeat(t);
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    for (const auto& [t, n] : output_counts_) {
      logits[t] -= params_.presence_penalty + params_.frequency_penalty * static_cast<float>(n);
    }
  }
}

int32_t SequenceSampler::Draw(std::span<float> logits) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  const float inv_t = 1.0f / params_.temperature;
  for (float& l : logits) l *= inv_t;
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };

  // Candidates: the top-k (by partial selection), else the whole vocabulary.
  order_.resize(vocab);
  std::iota(order_.begin(), order_.end(), 0);
  const int32_t limit = params_.top_k > 0 ? std::min(params_.top_k, vocab) : vocab;
  if (limit < vocab) {
    std::nth_element(order_.begin(), order_.begin() + limit, order_.end(), by_logit);
    order_.resize(limit);
  }
  // Unnormalized probabilities, computed once per candidate.
  weights_.resize(vocab);
  for (int32_t t : order_) weights_[t] = std::exp(logits[t] - max_logit);
  auto weight = [&](int32_t t) { return static_cast<double>(weights_[t]); };
  // top-p: the smallest prefix (by logit) holding top_p of the candidates' mass. Sort only
  // as much as needed: the m largest, growing m until the prefix reaches top_p.
  if (params_.top_p < 1.0f) {
    double total = 0;
    for (int32_t t : order_) total += weight(t);
    const double target = static_cast<double>(params_.top_p) * total;
    int32_t m = std::min<int32_t>(limit, 256);
    for (;;) {
      std::partial_sort(order_.begin(), order_.begin() + m, order_.end(), by_logit);
      double cum = 0;
      int32_t i = 0;
      while (i < m && cum < target) cum += weight(order_[i++]);
      if (cum >= target || m == limit) {
        order_.resize(i);
        break;
      }
      m = std::min(limit, m * 4);
    }
  }
  // min-p: drop candidates below min_p times the most likely token's probability.
  if (params_.min_p > 0) {
    const float threshold = std::log(params_.min_p);
    std::erase_if(order_, [&](int32_t t) { return logits[t] - max_logit < threshold; });
  }
  double mass = 0;
  for (int32_t t : order_) mass += weight(t);
  double u = Uniform() * mass;
  for (int32_t t : order_) {
    u -= weight(t);
    if (u < 0) return t;
  }
  return order_.back();
}

SampledToken SequenceSampler::Sample(std::span<float> logits, std::span<const int32_t> end_ids) {
  SampledToken out;
  std::vector<float> raw;
  if (params_.logprobs >= 0) raw.assign(logits.begin(), logits.end());
  ApplyPenalties(logits);
  if (generated_ < params_.min_tokens) {
    for (int32_t t : end_ids) {
      if (t >= 0 && t < static_cast<int32_t>(logits.size())) logits[t] = kNegInf;
    }
  }
  if (params_.temperature == 0.0f) {
    out.token =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  } else {
    out.token = Draw(logits);
  }
  if (params_.logprobs >= 0) ComputeLogprobs(raw, out.token, params_.logprobs, &out);
  return out;
}

void ComputeLogprobs(std::span<const float> logits, int32_t token, int32_t n, SampledToken* out) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l - max_logit));
  const double log_z = static_cast<double>(max_logit) + std::log(sum);
  out->logprob = static_cast<float>(logits[token] - log_z);
  out->top.clear();
  if (n <= 0) return;
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  const int32_t k = std::min<int32_t>(n, static_cast<int32_t>(idx.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int32_t i = 0; i < k; ++i) {
    out->top.push_back({idx[i], static_cast<float>(logits[idx[i]] - log_z)});
  }
}

}  // namespace kiln::models
