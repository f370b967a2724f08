#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "engine/base/status.h"

namespace kiln::sampling {

void PackParams(const RowParams& p, float* row) {
  row[kTemperature] = p.temperature;
  row[kTopK] = static_cast<float>(p.top_k);
  row[kTopP] = p.top_p;
  row[kMinP] = p.min_p;
  row[kRepetitionPenalty] = p.repetition_penalty;
  row[kPresencePenalty] = p.presence_penalty;
  row[kFrequencyPenalty] = p.frequency_penalty;
  row[kLogprobs] = static_cast<float>(p.logprobs);
}

RowParams UnpackParams(const float* row) {
  RowParams p;
  p.temperature = row[kTemperature];
  p.top_k = static_cast<int32_t>(row[kTopK]);
  p.top_p = row[kTopP];
  p.min_p = row[kMinP];
  p.repetition_penalty = row[kRepetitionPenalty];
  p.presence_penalty = row[kPresencePenalty];
  p.frequency_penalty = row[kFrequencyPenalty];
  p.logprobs = static_cast<int32_t>(row[kLogprobs]);
  return p;
}

void ApplyPenalties(const RowParams& p, std::span<float> logits,
                    std::span<const PenaltyToken> penalties, std::span<const int32_t> banned) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const float rp = p.repetition_penalty;
  const bool additive = p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  for (const PenaltyToken& e : penalties) {
    if (e.token < 0 || e.token >= vocab) continue;
    float& l = logits[e.token];
    l += e.bias;
    if (e.count < 0) continue;  // biased only
    if (rp != 1.0f) l = l > 0 ? l / rp : l * rp;
    if (additive && e.count > 0) {
      l -= p.presence_penalty + p.frequency_penalty * static_cast<float>(e.count);
    }
  }
  for (int32_t t : banned) {
    if (t >= 0 && t < vocab) logits[t] = -std::numeric_limits<float>::infinity();
  }
}

void ApplyAllowed(std::span<float> logits, std::span<const uint32_t> allowed) {
  KILN_CHECK(static_cast<int64_t>(allowed.size()) == AllowedWords(logits.size()),
             "ApplyAllowed: the mask must have ceil(vocab / 32) words");
  // Word by word: an unconstrained row (all bits set) costs one compare per 32 tokens.
  const size_t V = logits.size();
  for (size_t w = 0; w < allowed.size(); ++w) {
    const uint32_t bits = allowed[w];
    if (bits == ~0u) continue;
    for (size_t t = w * 32; t < std::min(V, w * 32 + 32); ++t) {
      if (!((bits >> (t % 32)) & 1u)) logits[t] = -std::numeric_limits<float>::infinity();
    }
  }
}

int32_t Pick(const RowParams& p, std::span<float> logits, double u, Scratch& scratch) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (p.temperature == 0.0f) {
    const auto best = std::max_element(logits.begin(), logits.end());
    return *best == kNegInf ? kNoToken : static_cast<int32_t>(best - logits.begin());
  }
  const float inv_t = 1.0f / p.temperature;
  for (float& l : logits) l *= inv_t;
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  // Nothing to draw (and exp(l - max) would be NaN).
  if (max_logit == kNegInf) return kNoToken;
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };

  // Candidates: the top-k in canonical (descending) order, else the whole vocabulary in id
  // order.
  std::vector<int32_t>& order = scratch.order;
  order.resize(vocab);
  std::iota(order.begin(), order.end(), 0);
  const int32_t limit = p.top_k > 0 ? std::min(p.top_k, vocab) : vocab;
  if (limit < vocab) {
    std::nth_element(order.begin(), order.begin() + limit, order.end(), by_logit);
    order.resize(limit);
    std::sort(order.begin(), order.end(), by_logit);
  }
  // Unnormalized probabilities, computed once per candidate.
  std::vector<float>& weights = scratch.weights;
  weights.resize(vocab);
  for (int32_t t : order) weights[t] = std::exp(logits[t] - max_logit);
  auto weight = [&](int32_t t) { return static_cast<double>(weights[t]); };
  // top-p: the smallest prefix (by logit) holding top_p of the candidates' mass. Sort only as
  // much as needed: the m largest, growing m until the prefix reaches top_p.
  if (p.top_p < 1.0f) {
    double total = 0;
    for (int32_t t : order) total += weight(t);
    const double target = static_cast<double>(p.top_p) * total;
    int32_t m = std::min<int32_t>(limit, 256);
    for (;;) {
      std::partial_sort(order.begin(), order.begin() + m, order.end(), by_logit);
      double cum = 0;
      int32_t i = 0;
      while (i < m && cum < target) cum += weight(order[i++]);
      if (cum >= target || m == limit) {
        order.resize(i);
        break;
      }
      m = std::min(limit, m * 4);
    }
  }
  // min-p: drop candidates below min_p times the most likely token's probability.
  if (p.min_p > 0) {
    const float threshold = std::log(p.min_p);
    std::erase_if(order, [&](int32_t t) { return logits[t] - max_logit < threshold; });
  }
  double mass = 0;
  for (int32_t t : order) mass += weight(t);
  double r = u * mass;
  // If rounding leaves r >= 0 after the walk: the last candidate of nonzero weight (the
  // maximum has weight 1 and is always a candidate), never a banned or masked one.
  int32_t last = kNoToken;
  for (int32_t t : order) {
    if (weight(t) > 0) last = t;
    r -= weight(t);
    if (r < 0) return t;
  }
  return last;
}

float Logprobs(std::span<const float> raw, int32_t token, int32_t n, int32_t* top_ids,
               float* top_logprobs) {
  const float max_logit = *std::max_element(raw.begin(), raw.end());
  double sum = 0;
  for (float l : raw) sum += std::exp(static_cast<double>(l - max_logit));
  const double log_z = static_cast<double>(max_logit) + std::log(sum);
  const int32_t vocab = static_cast<int32_t>(raw.size());
  const int32_t k = std::min(std::max(n, 0), vocab);
  if (k > 0) {
    std::vector<int32_t> idx(vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
      return raw[a] > raw[b] || (raw[a] == raw[b] && a < b);
    });
    for (int32_t i = 0; i < k; ++i) {
      top_ids[i] = idx[i];
      top_logprobs[i] = static_cast<float>(raw[idx[i]] - log_z);
    }
  }
  if (token < 0 || token >= vocab) return 0.0f;
  return static_cast<float>(raw[token] - log_z);
}

}  // namespace kiln::sampling
