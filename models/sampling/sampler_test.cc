// The sampler's behaviour, checked where it runs: on the host (SequenceSampler::Sample, the
// reference and the fallback) and in a step program's sample op on every device this build has
// (ref, cpu, and xpu where an OpenCL device exists), fed from a SequenceSampler the way the
// continuous batcher feeds it. Every test runs on each: the same draws, the same tokens.
#include "models/sampling/sampler.h"

#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "engine/builder.h"
#include "engine/program.h"
#include "engine/testing/devices.h"
#include "gtest/gtest.h"

namespace kiln::models {
namespace {

// Samples rows on a device through the sample op: row r uses logits[r], the row parameters,
// penalty list and end-id ban of samplers[r] (as a step's sampling table does), and draws the
// next uniform of samplers[r]'s stream.
class DeviceSampler {
 public:
  explicit DeviceSampler(backend::Device& dev) : dev_(dev) {}

  std::vector<SampledToken> Sample(std::span<SequenceSampler* const> samplers,
                                   std::span<const std::vector<float>> logits,
                                   std::span<const int32_t> end_ids,
                                   std::span<const uint32_t> allowed = {}) {
    const int64_t S = static_cast<int64_t>(samplers.size()), V = logits[0].size();
    int64_t P = 0, E = 0;
    for (SequenceSampler* s : samplers) {
      P = std::max<int64_t>(P, s->penalties().size());
      if (s->bans_end_ids()) E = end_ids.size();
    }
    std::vector<float> l(S * V), params(S * sampling::kNumParams);
    std::vector<double> u(S);
    std::vector<int32_t> pt(S * P, -1), pc(S * P, 0), ban(S * E, -1);
    std::vector<float> pb(S * P, 0.0f);
    for (int64_t r = 0; r < S; ++r) {
      SequenceSampler& s = *samplers[r];
      std::copy(logits[r].begin(), logits[r].end(), l.begin() + r * V);
      sampling::PackParams(s.row_params(), params.data() + r * sampling::kNumParams);
      u[r] = s.NextUniform();
      for (size_t j = 0; j < s.penalties().size(); ++j) {
        pt[r * P + j] = s.penalties()[j].token;
        pc[r * P + j] = s.penalties()[j].count;
        pb[r * P + j] = s.penalties()[j].bias;
      }
      if (s.bans_end_ids()) std::copy(end_ids.begin(), end_ids.end(), ban.begin() + r * E);
    }
    Graph g;
    Builder b(&g);
    const SampleOutputs o = b.Sample(
        b.Input("logits", DType::kF32, {S, V}),
        b.Input("params", DType::kF32, {S, sampling::kNumParams}), b.Input("u", DType::kF64, {S}),
        b.Input("pt", DType::kI32, {S, P}), b.Input("pc", DType::kI32, {S, P}),
        b.Input("ban", DType::kI32, {S, E}), b.Input("pb", DType::kF32, {S, P}),
        allowed.empty() ? Value{}
                        : b.Input("allowed", DType::kI32, {S, sampling::AllowedWords(V)}));
    EXPECT_TRUE(b.ok()) << b.status();
    auto program = Compile(g, {o.token, o.logprob, o.top_ids, o.top_logprobs}, dev_);
    EXPECT_TRUE(program.ok()) << program.status();
    auto stream = dev_.CreateStream();
    EXPECT_TRUE(stream.ok());
    auto bind = [&](const char* name, DType t, std::vector<int64_t> shape, const void* data) {
      auto tensor = Tensor::Empty(dev_, t, shape);
      ASSERT_TRUE(tensor.ok()) << tensor.status();
      if (tensor->nbytes() > 0) {
        ASSERT_TRUE((*stream)->CopyToDevice(*tensor->buffer(), 0, data, tensor->nbytes()).ok());
      }
      ASSERT_TRUE((*program)->Bind(name, *tensor).ok());
    };
    bind("logits", DType::kF32, {S, V}, l.data());
    bind("params", DType::kF32, {S, sampling::kNumParams}, params.data());
    bind("u", DType::kF64, {S}, u.data());
    bind("pt", DType::kI32, {S, P}, pt.data());
    bind("pc", DType::kI32, {S, P}, pc.data());
    bind("ban", DType::kI32, {S, E}, ban.data());
    bind("pb", DType::kF32, {S, P}, pb.data());
    if (!allowed.empty())
      bind("allowed", DType::kI32, {S, sampling::AllowedWords(V)}, allowed.data());
    EXPECT_TRUE((*program)->Run(**stream).ok());
    const int W = sampling::kMaxLogprobs;
    std::vector<int32_t> tok(S), ids(S * W);
    std::vector<float> lp(S), lps(S * W);
    auto read = [&](int i, void* dst, size_t bytes) {
      auto t = (*program)->Output(i);
      ASSERT_TRUE(t.ok());
      ASSERT_TRUE((*stream)->CopyToHost(dst, *t->buffer(), t->offset() * 4, bytes).ok());
    };
    read(0, tok.data(), S * 4);
    read(1, lp.data(), S * 4);
    read(2, ids.data(), S * W * 4);
    read(3, lps.data(), S * W * 4);
    EXPECT_TRUE((*stream)->Synchronize().ok());
    std::vector<SampledToken> out(S);
    for (int64_t r = 0; r < S; ++r) {
      out[r].token = tok[r];
      if (samplers[r]->row_params().logprobs < 0) continue;
      out[r].logprob = lp[r];
      for (int i = 0; i < std::min(samplers[r]->row_params().logprobs, W); ++i) {
        if (ids[r * W + i] >= 0) out[r].top.push_back({ids[r * W + i], lps[r * W + i]});
      }
    }
    return out;
  }

 private:
  backend::Device& dev_;
};

class SamplerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "host") return;
    backend_ = MakeTestBackend(GetParam(), 2);
    if (backend_ == nullptr) GTEST_SKIP() << "no " << GetParam() << " device here";
    device_ = std::make_unique<DeviceSampler>(*backend_->device(0));
  }
  bool host() const { return device_ == nullptr; }

  // s.Sample(logits, end_ids), where this test samples.
  SampledToken Draw(SequenceSampler& s, std::vector<float>& logits,
                    std::span<const int32_t> end_ids = {}) {
    if (host()) return s.Sample(logits, end_ids);
    SequenceSampler* one[] = {&s};
    return device_->Sample(one, std::span(&logits, 1), end_ids)[0];
  }
  SampledToken Once(SamplingParams p, std::vector<float> logits, uint64_t seed = 1) {
    SequenceSampler s(p, {}, seed);
    return Draw(s, logits);
  }
  // Empirical distribution of `n` draws from one sampler (on a device: n rows in one step).
  std::map<int32_t, double> Frequencies(const SamplingParams& p, const std::vector<float>& logits,
                                        int n) {
    SequenceSampler s(p, {}, 12345);
    std::map<int32_t, double> f;
    if (host()) {
      for (int i = 0; i < n; ++i) {
        std::vector<float> l = logits;
        f[s.Sample(l, {}).token] += 1.0 / n;
      }
      return f;
    }
    std::vector<SequenceSampler*> rows(n, &s);
    std::vector<std::vector<float>> all(n, logits);
    for (const SampledToken& t : device_->Sample(rows, all, {})) f[t.token] += 1.0 / n;
    return f;
  }

  std::unique_ptr<backend::Backend> backend_;
  std::unique_ptr<DeviceSampler> device_;
};

std::vector<float> Logits(std::initializer_list<float> v) { return std::vector<float>(v); }

TEST_P(SamplerTest, GreedyPicksArgmax) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(Once(p, Logits({0.1f, 3.0f, 2.9f, -1.0f})).token, 1);
}

TEST_P(SamplerTest, TemperatureSamplingMatchesSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto f = Frequencies(p, logits, 40000);
  EXPECT_NEAR(f[0], 0.5, 0.01);
  EXPECT_NEAR(f[1], 0.3, 0.01);
  EXPECT_NEAR(f[2], 0.2, 0.01);
}

TEST_P(SamplerTest, LowTemperatureSharpens) {
  SamplingParams p;
  p.temperature = 0.5f;  // probabilities ∝ p^2: 0.25, 0.09, 0.04 -> 0.657, 0.237, 0.105
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto f = Frequencies(p, logits, 40000);
  EXPECT_NEAR(f[0], 0.25 / 0.38, 0.012);
  EXPECT_NEAR(f[2], 0.04 / 0.38, 0.01);
}

TEST_P(SamplerTest, TopKKeepsOnlyTheKBest) {
  SamplingParams p;
  p.top_k = 2;
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.0f};
  auto f = Frequencies(p, logits, 5000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_TRUE(f.contains(1) && f.contains(2));
}

TEST_P(SamplerTest, TopPKeepsTheSmallestSetReachingP) {
  SamplingParams p;
  p.top_p = 0.75f;  // 0.5 + 0.3 >= 0.75: tokens 0 and 1 only, renormalized 5/8, 3/8
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                                     std::log(0.05f)};
  auto f = Frequencies(p, logits, 40000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[0], 0.625, 0.012);
}

TEST_P(SamplerTest, TopPOverALargeVocabularyGrowsTheCandidateSet) {
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

TEST_P(SamplerTest, MinPDropsUnlikelyTokens) {
  SamplingParams p;
  p.min_p = 0.5f;  // keep tokens with p >= 0.5 * 0.5 = 0.25
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto f = Frequencies(p, logits, 5000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_FALSE(f.contains(2));
}

TEST_P(SamplerTest, SameSeedSameTokens) {
  SamplingParams p;
  p.seed = 42;
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(static_cast<float>(i));
  SequenceSampler a(p, {}, 1), b(p, {}, 2);  // fallback seeds differ, explicit seed wins
  for (int i = 0; i < 50; ++i) {
    std::vector<float> la = logits, lb = logits;
    auto ta = Draw(a, la).token, tb = Draw(b, lb).token;
    ASSERT_EQ(ta, tb) << "step " << i;
    a.Accept(ta);
    b.Accept(tb);
  }
}

TEST_P(SamplerTest, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  std::vector<int32_t> prompt = {0, 2};
  SequenceSampler s(p, prompt, 1);
  // Token 0: 3.0 -> 1.5 (below token 1's 2.0). Token 2: -1 -> -2.
  std::vector<float> logits = {3.0f, 2.0f, -1.0f};
  EXPECT_EQ(Draw(s, logits).token, 1);
  if (host()) {  // the host sampler penalizes its row in place
    EXPECT_FLOAT_EQ(logits[0], 1.5f);
    EXPECT_FLOAT_EQ(logits[2], -2.0f);
  }
}

TEST_P(SamplerTest, PresenceAndFrequencyPenalties) {
  SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  SequenceSampler s(p, {}, 1);
  s.Accept(0);
  s.Accept(0);
  std::vector<float> logits = {2.0f, 1.5f};
  // token 0: 2.0 - 0.5 - 0.25*2 = 1.0 < 1.5
  EXPECT_EQ(Draw(s, logits).token, 1);
  if (host()) {
    EXPECT_FLOAT_EQ(logits[0], 1.0f);
  }
}

TEST_P(SamplerTest, LogitBiasIsAddedBeforeThePenalties) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0f;
  // Token 2 is biased only (not in the prompt); token 0 is in the prompt and biased too.
  p.logit_bias = {{2, 2.5f}, {0, 1.0f}};
  const std::vector<int32_t> prompt = {0};
  SequenceSampler s(p, prompt, 1);
  // Token 0: (3 + 1) / 2 = 2.0; token 1: 2.2; token 2: 0 + 2.5 = 2.5 (no penalty: not seen).
  std::vector<float> logits = {3.0f, 2.2f, 0.0f};
  EXPECT_EQ(Draw(s, logits).token, 2);
  if (host()) {
    EXPECT_FLOAT_EQ(logits[0], 2.0f);
    EXPECT_FLOAT_EQ(logits[2], 2.5f);
  }
  // Once generated, a biased token is penalized too: (0 + 2.5) / 2 = 1.25 < 2.2.
  s.Accept(2);
  logits = {3.0f, 2.2f, 0.0f};
  EXPECT_EQ(Draw(s, logits).token, 1);
  // -100 removes a token in practice; at temperature > 0 it is never drawn.
  SamplingParams q;
  q.logit_bias = {{0, -100.0f}};
  std::map<int32_t, double> f = Frequencies(q, Logits({5.0f, 0.0f, 0.0f}), 200);
  EXPECT_EQ(f.count(0), 0u);
}

TEST_P(SamplerTest, MinTokensMasksEndTokens) {
  SamplingParams p;
  p.temperature = 0;
  p.min_tokens = 1;
  SequenceSampler s(p, {}, 1);
  std::vector<int32_t> eos = {0};
  std::vector<float> logits = {5.0f, 1.0f};
  EXPECT_EQ(Draw(s, logits, eos).token, 1);
  s.Accept(1);
  logits = {5.0f, 1.0f};
  EXPECT_EQ(Draw(s, logits, eos).token, 0);
}

TEST_P(SamplerTest, LogprobsAreOfTheRawDistribution) {
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 2;
  p.repetition_penalty = 5.0f;  // must not change reported logprobs
  std::vector<int32_t> prompt = {0};
  SequenceSampler s(p, prompt, 1);
  std::vector<float> logits = {std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  auto out = Draw(s, logits);
  EXPECT_EQ(out.token, 1);  // penalty moved the argmax
  EXPECT_NEAR(out.logprob, std::log(0.3f), 1e-5);
  ASSERT_EQ(out.top.size(), 2u);
  EXPECT_EQ(out.top[0].token, 0);
  EXPECT_NEAR(out.top[0].logprob, std::log(0.6f), 1e-5);
}

// The host sampler and the sample op on the same draws of many random configurations pick the
// same tokens with the same logprobs.
TEST_P(SamplerTest, ManyRandomConfigurationsAgreeWithTheHost) {
  if (host()) GTEST_SKIP() << "the host is the reference";
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0, 2);
  std::uniform_int_distribution<int> pick(0, 99);
  const int32_t V = 300;
  std::vector<std::unique_ptr<SequenceSampler>> hs, ds;
  std::vector<std::vector<float>> logits;
  const std::vector<int32_t> end_ids = {2, 17};
  for (int r = 0; r < 64; ++r) {
    SamplingParams p;
    p.temperature = r % 5 == 0 ? 0.0f : 0.3f + (r % 7) * 0.2f;
    p.top_k = r % 3 == 0 ? 0 : 1 + pick(rng) % 50;
    p.top_p = r % 4 == 0 ? 1.0f : 0.5f + (r % 5) * 0.1f;
    p.min_p = r % 6 == 0 ? 0.1f : 0.0f;
    p.repetition_penalty = r % 2 ? 1.0f : 1.3f;
    p.presence_penalty = r % 3 == 1 ? 0.7f : 0.0f;
    p.frequency_penalty = r % 5 == 2 ? -0.4f : 0.0f;
    p.min_tokens = r % 4 == 3 ? 5 : 0;
    p.logprobs = r % 3 == 2 ? r % 21 : -1;
    p.seed = 1000 + r;
    std::vector<int32_t> prompt(1 + pick(rng) % 20);
    for (int32_t& t : prompt) t = pick(rng) * 3;
    hs.push_back(std::make_unique<SequenceSampler>(p, prompt, 1));
    for (int k = 0; k < pick(rng) % 6; ++k) hs.back()->Accept(pick(rng));
    ds.push_back(std::make_unique<SequenceSampler>(*hs.back()));
    std::vector<float> l(V);
    for (float& x : l) x = normal(rng);
    logits.push_back(std::move(l));
  }
  // Grammar masks (structured output) on some rows: a random third of the vocabulary, a
  // single token, or all but the end ids; the other rows are unconstrained (all bits set).
  const int64_t W = sampling::AllowedWords(V);
  std::vector<uint32_t> allowed(hs.size() * W, ~0u);
  for (size_t r = 0; r < hs.size(); r += 2) {
    uint32_t* row = allowed.data() + r * W;
    std::fill(row, row + W, 0u);
    for (int32_t t = 0; t < V; ++t) {
      const bool on = r % 6 == 0 ? pick(rng) < 33 : r % 6 == 2 ? t == 41 : t != 2 && t != 17;
      if (on) row[t >> 5] |= 1u << (t & 31);
    }
  }
  std::vector<SequenceSampler*> rows;
  for (auto& d : ds) rows.push_back(d.get());
  const std::vector<SampledToken> got = device_->Sample(rows, logits, end_ids, allowed);
  for (size_t r = 0; r < hs.size(); ++r) {
    std::vector<float> l = logits[r];
    const SampledToken want =
        hs[r]->Sample(l, hs[r]->bans_end_ids() ? end_ids : std::vector<int32_t>{},
                      std::span<const uint32_t>(allowed).subspan(r * W, W));
    if (r % 6 == 2) {
      EXPECT_EQ(want.token, 41) << "row " << r;  // the only allowed token
    }
    EXPECT_EQ(got[r].token, want.token) << "row " << r;
    EXPECT_NEAR(got[r].logprob, want.logprob, 1e-5) << "row " << r;
    ASSERT_EQ(got[r].top.size(), want.top.size()) << "row " << r;
    for (size_t i = 0; i < want.top.size(); ++i) {
      EXPECT_EQ(got[r].top[i].token, want.top[i].token) << "row " << r;
      EXPECT_NEAR(got[r].top[i].logprob, want.top[i].logprob, 1e-5) << "row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Where, SamplerTest, ::testing::Values("host", "ref", "cpu", "xpu"),
                         [](const auto& info) { return info.param; });

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
  EXPECT_EQ(err([](SamplingParams& p) {
              p.logit_bias = {{100, 1}};
            }),
            "`logit_bias` names token 100, which is not a token of this model (ids 0 to 99)");
  EXPECT_EQ(err([](SamplingParams& p) {
              p.logit_bias = {{3, 100.5f}};
            }),
            "`logit_bias` gives token 3 the bias 100.5; it must be in [-100, 100]");
  EXPECT_NE(err([](SamplingParams& p) {
              p.logit_bias.assign(1025, {1, 0.0f});
            }).find("at most 1024"),
            std::string::npos);
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}, 100).ok());
}

}  // namespace
}  // namespace kiln::models
