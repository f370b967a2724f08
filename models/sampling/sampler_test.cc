#include "models/sampling/sampler.h"

#include <cmath>
#include <map>

#include "gtest/gtest.h"

namespace kiln::models {
namespace {

std::vector<float> Logits(std::initializer_list<float> v) { return std::vector<float>(v); }

SampledToken Once(SamplingParams p, std::vector<float> logits, uint64_t seed = 1) {
  SequenceSampler s(p, {}, seed);
  return s.Sample(logits, {});
}

// Empirical distribution of `n` draws.
std::map<int32_t, double> Frequencies(const SamplingParams& p, const std::vector<float>& logits,
                                      int n) {
  SequenceSampler s(p, {}, 12345);
  std::map<int32_t, double> f;
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = logits;
    f[s.Sample(l, {}).token] += 1.0 / n;
  }
  return f;
}

TEST(SamplerTest, GreedyPicksArgmax) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(Once(p, Logits({0.1f, 3.0f, 2.9f, -1.0f})).token, 1);
}

TEST(SamplerTest, TemperatureSamplingMatchesSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto f = Frequencies(p, logits, 40000);
  EXPECT_NEAR(f[0], 0.5, 0.01);
  EXPECT_NEAR(f[1], 0.3, 0.01);
  EXPECT_NEAR(f[2], 0.2, 0.01);
}

TEST(SamplerTest, LowTemperatureSharpens) {
  SamplingParams p;
  p.temperature = 0.5f;  // probabilities ∝ p^2: 0.25, 0.09, 0.04 -> 0.657, 0.237, 0.105
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto f = Frequencies(p, logits, 40000);
  EXPECT_NEAR(f[0], 0.25 / 0.38, 0.012);
  EXPECT_NEAR(f[2], 0.04 / 0.38, 0.01);
}

TEST(SamplerTest, TopKKeepsOnlyTheKBest) {
  SamplingParams p;
  p.top_k = 2;
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.0f};
  auto f = Frequencies(p, logits, 5000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_TRUE(f.contains(1) && f.contains(2));
}

TEST(SamplerTest, TopPKeepsTheSmallestSetReachingP) {
  SamplingParams p;
  p.top_p = 0.75f;  // 0.5 + 0.3 >= 0.75: tokens 0 and 1 only, renormalized 5/8, 3/8
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                                     std::log(0.05f)};
  auto f = Frequencies(p, logits, 40000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[0], 0.625, 0.012);
}

TEST(SamplerTest, TopPOverALargeVocabularyGrowsTheCandidateSet) {
  // 5,000 equally likely tokens: top_p 0.5 must keep 2,500 of them (past the first 256).
  SamplingParams p;
  p.top_p = 0.5f;
  std::vector<float> logits(5000, 0.0f);
  auto f = Frequencies(p, logits, 3000);
  int32_t max_token = 0;
  for (const auto& [t, _] : f) max_token = std::max(max_token, t);
  EXPECT_GT(f.size(), 1500u);  // 3,000 draws over 2,500 kept tokens
  EXPECT_LT(max_token, 2500);  // ties break by token id: the kept half is 0..2499
}

TEST(SamplerTest, MinPDropsUnlikelyTokens) {
  SamplingParams p;
  p.min_p = 0.5f;  // keep tokens with p >= 0.5 * 0.5 = 0.25
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto f = Frequencies(p, logits, 5000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_FALSE(f.contains(2));
}

TEST(SamplerTest, SameSeedSameTokens) {
  SamplingParams p;
  p.seed = 42;
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  SequenceSampler a(p, {}, 1), b(p, {}, 2);  // fallback seeds differ, explicit seed wins
  for (int i = 0; i < 50; ++i) {
    std::vector<float> la = logits, lb = logits;
    auto ta = a.Sample(la, {}).token, tb = b.Sample(lb, {}).token;
    ASSERT_EQ(ta, tb) << "step " << i;
    a.Accept(ta);
    b.Accept(tb);
  }
}

TEST(SamplerTest, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  std::vector<int32_t> prompt = {0, 2};
  SequenceSampler s(p, prompt, 1);
  // Token 0: 3.0 -> 1.5 (below token 1's 2.0). Token 2: -1 -> -2.
  std::vector<float> logits = {3.0f, 2.0f, -1.0f};
  EXPECT_EQ(s.Sample(logits, {}).token, 1);
  EXPECT_FLOAT_EQ(logits[0], 1.5f);
  EXPECT_FLOAT_EQ(logits[2], -2.0f);
}

TEST(SamplerTest, PresenceAndFrequencyPenalties) {
  SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  SequenceSampler s(p, {}, 1);
  s.Accept(0);
  s.Accept(0);
  std::vector<float> logits = {2.0f, 1.5f};
  // token 0: 2.0 - 0.5 - 0.25*2 = 1.0 < 1.5
  EXPECT_EQ(s.Sample(logits, {}).token, 1);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);
}

TEST(SamplerTest, MinTokensMasksEndTokens) {
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 1;
  SequenceSampler s(p, {}, 1);
  std::vector<int32_t> eos = {0};
  std::vector<float> logits = {5.0f, 1.0f};
  EXPECT_EQ(s.Sample(logits, eos).token, 1);
  s.Accept(1);
  logits = {5.0f, 1.0f};
  EXPECT_EQ(s.Sample(logits, eos).token, 0);
}

TEST(SamplerTest, LogprobsAreOfTheRawDistribution) {
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 2;
  p.repetition_penalty = 5.0f;  // must not change reported logprobs
  std::vector<int32_t> prompt = {0};
  SequenceSampler s(p, prompt, 1);
  std::vector<float> logits = {std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  auto out = s.Sample(logits, {});
  EXPECT_EQ(out.token, 1);  // penalty moved the argmax
  EXPECT_NEAR(out.logprob, std::log(0.3f), 1e-5);
  ASSERT_EQ(out.top.size(), 2u);
  EXPECT_EQ(out.top[0].token, 0);
  EXPECT_NEAR(out.top[0].logprob, std::log(0.6f), 1e-5);
}

TEST(SamplingParamsTest, RejectsAbsurdValuesWithTheRule) {
  auto err = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    Status s = ValidateSamplingParams(p, 100);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    return std::string(StatusMessage(s));
  };
  EXPECT_EQ(err([](SamplingParams& p) { p.temperature = NAN; }),
            "`temperature` is nan; it must be in [0, 100] (0 = greedy)");
  EXPECT_NE(err([](SamplingParams& p) { p.temperature = -1; }).find("[0, 100]"), std::string::npos);
  EXPECT_EQ(err([](SamplingParams& p) { p.top_p = 0; }), "`top_p` is 0; it must be in (0, 1]");
  EXPECT_NE(err([](SamplingParams& p) { p.top_p = 1.5f; }).find("(0, 1]"), std::string::npos);
  EXPECT_NE(err([](SamplingParams& p) { p.max_tokens = 0; }).find("at least 1"), std::string::npos);
  EXPECT_NE(err([](SamplingParams& p) { p.max_tokens = -5; }).find("-5"), std::string::npos);
  EXPECT_NE(err([](SamplingParams& p) { p.stop_token_ids = {100}; }).find("vocabulary size 100"),
            std::string::npos);
  EXPECT_NE(err([](SamplingParams& p) { p.stop = {""}; }).find("empty"), std::string::npos);
  EXPECT_NE(err([](SamplingParams& p) { p.presence_penalty = INFINITY; }).find("presence_penalty"),
            std::string::npos);
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}, 100).ok());
}

}  // namespace
}  // namespace kiln::models
