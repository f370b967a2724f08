#include "engine/sampling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace kiln::sampling {
namespace {

TEST(SamplingTest, ParamsRoundTripThroughARow) {
  RowParams p;
  p.temperature = 0.7f;
  p.top_k = 40;
  p.top_p = 0.9f;
  p.min_p = 0.05f;
  p.repetition_penalty = 1.1f;
  p.presence_penalty = -0.5f;
  p.frequency_penalty = 0.25f;
  p.logprobs = 5;
  float row[kNumParams];
  PackParams(p, row);
  const RowParams q = UnpackParams(row);
  EXPECT_EQ(q.temperature, p.temperature);
  EXPECT_EQ(q.top_k, p.top_k);
  EXPECT_EQ(q.top_p, p.top_p);
  EXPECT_EQ(q.min_p, p.min_p);
  EXPECT_EQ(q.repetition_penalty, p.repetition_penalty);
  EXPECT_EQ(q.presence_penalty, p.presence_penalty);
  EXPECT_EQ(q.frequency_penalty, p.frequency_penalty);
  EXPECT_EQ(q.logprobs, p.logprobs);
}

TEST(SamplingTest, PenaltiesActOncePerTokenAndBansWin) {
  RowParams p;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  std::vector<float> l = {4.0f, -4.0f, 4.0f, 1.0f, 1.0f};
  // Token 0 only in the prompt; token 1 and 2 generated twice and once; 7 is out of range.
  const std::vector<PenaltyToken> pen = {{0, 0}, {1, 2}, {2, 1}, {7, 3}};
  const std::vector<int32_t> banned = {3, -1};
  ApplyPenalties(p, l, pen, banned);
  EXPECT_FLOAT_EQ(l[0], 2.0f);                 // 4 / 2, no additive penalty
  EXPECT_FLOAT_EQ(l[1], -8.0f - 0.5f - 0.5f);  // -4 * 2 - (0.5 + 0.25 * 2)
  EXPECT_FLOAT_EQ(l[2], 2.0f - 0.5f - 0.25f);  // 4 / 2 - (0.5 + 0.25)
  EXPECT_EQ(l[3], -std::numeric_limits<float>::infinity());
  EXPECT_FLOAT_EQ(l[4], 1.0f);
}

TEST(SamplingTest, LogitBiasComesFirstAndBiasOnlyTokensAreNotPenalized) {
  RowParams p;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.5f;
  std::vector<float> l = {4.0f, 1.0f, 1.0f, -3.0f};
  // Token 0 in the prompt with bias 2; token 1 generated once with bias -1; token 2 listed for
  // its bias only; token 3 banned although biased.
  const std::vector<PenaltyToken> pen = {{0, 0, 2.0f}, {1, 1, -1.0f}, {2, -1, 0.5f}, {3, -1, 9}};
  const std::vector<int32_t> banned = {3};
  ApplyPenalties(p, l, pen, banned);
  EXPECT_FLOAT_EQ(l[0], 3.0f);                // (4 + 2) / 2
  EXPECT_FLOAT_EQ(l[1], 0.0f * 2.0f - 0.5f);  // (1 - 1) * 2 (not > 0) - 0.5
  EXPECT_FLOAT_EQ(l[2], 1.5f);                // 1 + 0.5, no penalty
  EXPECT_EQ(l[3], -std::numeric_limits<float>::infinity());
}

// The draw walks the candidates in the canonical order: descending logit (ties: lower id)
// under top-k/top-p, ascending id otherwise. u just below a candidate's cumulative share picks
// it, u just above picks the next one.
TEST(SamplingTest, DrawsWalkTheCanonicalOrder) {
  Scratch scratch;
  RowParams p;
  p.top_k = 3;
  const std::vector<float> base = {0.0f, 2.0f, 1.0f, 2.0f, -5.0f};
  // Top-3: ids 1 and 3 (equal, lower id first), then 2. Weights e^0, e^0, e^-1.
  const double w1 = 1.0, w3 = 1.0, w2 = std::exp(-1.0f);
  const double mass = w1 + w3 + w2;
  auto pick = [&](double u) {
    std::vector<float> l = base;
    return Pick(p, l, u, scratch);
  };
  EXPECT_EQ(pick(0.0), 1);
  EXPECT_EQ(pick(w1 / mass - 1e-9), 1);
  EXPECT_EQ(pick(w1 / mass + 1e-9), 3);
  EXPECT_EQ(pick((w1 + w3) / mass + 1e-9), 2);
  EXPECT_EQ(pick(1.0 - 1e-12), 2);
  // No top-k/top-p: ascending ids over the whole vocabulary.
  p.top_k = 0;
  const double e0 = std::exp(-2.0f), e1 = 1.0, e2 = std::exp(-1.0f), e3 = 1.0, e4 = std::exp(-7.0f);
  const double all = e0 + e1 + e2 + e3 + e4;
  EXPECT_EQ(pick(0.0), 0);
  EXPECT_EQ(pick((e0 + 1e-9) / all), 1);
  EXPECT_EQ(pick((e0 + e1 + 1e-9) / all), 2);
  // Greedy: the first maximum, whatever u.
  p.temperature = 0;
  EXPECT_EQ(pick(0.99), 1);
}

TEST(SamplingTest, LogprobsOfTheRawDistributionWithTiesByLowerId) {
  const std::vector<float> raw = {1.0f, 3.0f, 3.0f, 0.0f};
  int32_t ids[3];
  float lps[3];
  const float lp = Logprobs(raw, 3, 3, ids, lps);
  const double z = std::log(std::exp(1.0) + 2 * std::exp(3.0) + 1.0);
  EXPECT_NEAR(lp, 0.0 - z, 1e-6);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 2);
  EXPECT_EQ(ids[2], 0);
  EXPECT_NEAR(lps[0], 3.0 - z, 1e-6);
  EXPECT_NEAR(lps[2], 1.0 - z, 1e-6);
}

TEST(SamplingTest, AllowedMaskSetsClearBitsToMinusInfinity) {
  // 40 tokens in 2 words: allowed 0, 5, 31 (word 0) and 32, 39 (word 1); the bits of word 1
  // past token 39 are set and ignored.
  std::vector<float> l(40);
  for (int t = 0; t < 40; ++t) l[t] = static_cast<float>(t);
  const std::vector<uint32_t> allowed = {(1u << 0) | (1u << 5) | (1u << 31),
                                         (1u << 0) | (1u << 7) | 0xFFFFFF00u};
  ApplyAllowed(l, allowed);
  for (int t = 0; t < 40; ++t) {
    const bool ok = t == 0 || t == 5 || t == 31 || t == 32 || t == 39;
    if (ok) {
      EXPECT_EQ(l[t], static_cast<float>(t)) << t;
    } else {
      EXPECT_EQ(l[t], -std::numeric_limits<float>::infinity()) << t;
    }
  }
}

TEST(SamplingTest, AllowedMaskWithEveryBitSetChangesNothing) {
  const std::vector<float> base = {0.5f, -1.0f, 3.0f};
  std::vector<float> l = base;
  const std::vector<uint32_t> all = {0xFFFFFFFFu};
  ApplyAllowed(l, all);
  EXPECT_EQ(l, base);
}

// The mask comes after the penalties: a +100 logit bias does not let a masked token through.
TEST(SamplingTest, AllowedMaskWinsOverLogitBias) {
  Scratch scratch;
  RowParams p;
  p.temperature = 0;
  std::vector<float> l = {1.0f, 2.0f, 0.0f, 5.0f};
  const std::vector<PenaltyToken> pen = {{3, -1, 100.0f}};
  ApplyPenalties(p, l, pen, {});
  const std::vector<uint32_t> allowed = {0b0101u};  // tokens 0 and 2
  ApplyAllowed(l, allowed);
  EXPECT_EQ(Pick(p, l, 0.5, scratch), 0);
}

// With one token allowed every configuration picks it, whatever u.
TEST(SamplingTest, ASingleAllowedTokenIsAlwaysPicked) {
  Scratch scratch;
  const std::vector<float> base = {3.0f, 2.0f, -1.0f, 4.0f, 0.5f};
  const std::vector<uint32_t> only2 = {1u << 2};
  for (const RowParams& p : {RowParams{0}, RowParams{1}, RowParams{0.7f, 3}, RowParams{1, 0, 0.5f},
                             RowParams{1.3f, 2, 0.9f, 0.1f}}) {
    for (double u : {0.0, 0.3, 0.999999}) {
      std::vector<float> l = base;
      ApplyAllowed(l, only2);
      EXPECT_EQ(Pick(p, l, u, scratch), 2) << "temperature " << p.temperature << " u " << u;
    }
  }
}

// Every token banned or masked: no token (kNoToken), greedy or drawn, and the logprob of
// kNoToken is 0 while the top-n are still the raw distribution's.
TEST(SamplingTest, AllMaskedRowHasNoToken) {
  Scratch scratch;
  const std::vector<float> raw = {1.0f, 3.0f, 2.0f};
  const std::vector<uint32_t> none = {0u};
  for (const RowParams& p : {RowParams{0}, RowParams{1}, RowParams{0.7f, 2}, RowParams{1, 0, 0.9f},
                             RowParams{1, 0, 1, 0.2f}}) {
    std::vector<float> l = raw;
    ApplyAllowed(l, none);
    EXPECT_EQ(Pick(p, l, 0.5, scratch), kNoToken) << "temperature " << p.temperature;
  }
  // Banned tokens alone behave the same.
  RowParams greedy;
  greedy.temperature = 0;
  std::vector<float> l = raw;
  const std::vector<int32_t> banned = {0, 1, 2};
  ApplyPenalties(greedy, l, {}, banned);
  EXPECT_EQ(Pick(greedy, l, 0.5, scratch), kNoToken);

  int32_t ids[2];
  float lps[2];
  EXPECT_EQ(Logprobs(raw, kNoToken, 2, ids, lps), 0.0f);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 2);
}

// Regression: when rounding leaves the draw's remainder >= 0 after the last candidate, the
// draw returned the last candidate even if its weight was 0 (a banned or masked token). u = 1
// stands in for that rounding: the token must be the last one of nonzero weight.
TEST(SamplingTest, DrawNeverFallsBackToAMaskedToken) {
  Scratch scratch;
  RowParams p;  // no top-k/top-p: candidates in id order, masked ones last
  std::vector<float> l = {1.0f, 2.0f, 0.0f, 7.0f};
  const std::vector<uint32_t> allowed = {0b0011u};
  ApplyAllowed(l, allowed);
  EXPECT_EQ(Pick(p, l, 1.0, scratch), 1);
}

}  // namespace
}  // namespace kiln::sampling
