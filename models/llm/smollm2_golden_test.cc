// SmolLM2-135M-Instruct Q4_1 (the default model) against llama.cpp: greedy continuations and
// logits from tests/fixtures/models/smollm2/ (scripts/fixtures/make_smollm2_reference.py,
// llama-cpp-python). Prompts are plain text and chat-templated; Kiln renders the template and
// tokenizes itself, and both must agree with the fixture before the model runs.
//
// The fixture holds two llama.cpp references (see the script):
//   f32   llama.cpp on the same weights expanded exactly to F32, f32 KV cache: the arithmetic
//         Kiln does by default (f32 activations, Q4_1 weights decoded exactly, f32 KV). Kiln
//         must give the same greedy continuation on every prompt.
//   q4_1  llama.cpp as users run it: activations quantized to Q8_1 for the quantized matmuls,
//         f16 KV cache and f16 attention products. Its logits differ from exact arithmetic by
//         up to ~1.0 (the fixture's transformers cross-check), so near-ties go either way, and
//         it disagrees with itself under its other settings (the fixture's
//         llama_cpp_q4_1_self_agreement: prompt one token at a time 5/10, f32 KV 3/10, flash
//         attention 4/10). It is *not* a reference: Kiln's quantized numerics
//         (`activations: q8`, `kv_cache_dtype: f16`) are gated against exact arithmetic (the
//         f32 reference, kQ8VsExactLogitTolerance) and their agreement with llama.cpp's q4_1 is
//         printed as a report (4/10 identical with the AVX-512 kernels, 3/10 with AVX2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/io/test_paths.h"
#include "models/llm/loader.h"
#include "models/llm/paged_llm.h"
#include "models/llm/testing/greedy_driver.h"

namespace kiln::models {
namespace {

using nlohmann::json;

// Largest |kiln - llama.cpp| over the whole vocabulary, at step 0 and a later step.
constexpr double kF32LogitTolerance = 0.02;  // same arithmetic up to summation order
// Kiln's q8 path vs exact arithmetic: measured max |dlogit| 0.85-1.17 at step 0 and <= 1.15
// later, with the AVX-512, AVX2 and scalar kernels (KILN_CPU_ISA); llama.cpp's own quantized
// path is ~1.0 from exact.
constexpr double kQ8VsExactLogitTolerance = 2.0;

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

std::vector<float> ReadF32(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EXPECT_TRUE(in.good()) << path;
  if (!in.good()) return {};
  std::vector<float> v(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  return v;
}

const json& Fixture() {
  static const json* fixture =
      new json(ReadJson(testing::FixturePath("models/smollm2/llama_cpp.json")));
  return *fixture;
}

// The default model, with Kiln's exact numerics or with llama.cpp's (q8 activations, f16 KV).
StatusOr<std::unique_ptr<PagedLlm>> LoadSmolLm2(bool llama_cpp_numerics) {
  config::ModelConfig c;
  c.name = "smollm2";
  c.kind = "llm";
  c.path = testing::DefaultModelPath();
  c.threads = 2;
  c.scheduler.max_num_batched_tokens = 512;
  c.scheduler.max_num_seqs = 16;
  // 10: the prompts decode together, and on cpu only a capture of a step's own size replays
  // (a padded row costs as much as a real one there), so that the captured path is checked.
  c.scheduler.capture_batch_sizes = {1, 2, 4, 8, 10, 16};
  if (llama_cpp_numerics) {
    c.activations = "q8";
    c.kv_cache_dtype = "f16";
  }
  return LoadPagedLlm(c);
}

struct Comparison {
  int identical = 0, cases = 0;
  double max_first = 0, max_later = 0, max_top = 0;
  bool logits_within = true;
};

// Runs every fixture prompt greedily and compares with reference `ref` ("f32" or "q4_1").
Comparison CompareWithLlamaCpp(PagedLlm& model, const std::string& ref, double tolerance) {
  const json& fx = Fixture();
  Comparison out;
  EXPECT_EQ(model.info().vocab_size, fx["vocab_size"].get<int32_t>());
  const std::vector<float> full =
      ReadF32(testing::FixturePath("models/smollm2/llama_cpp_" + ref + "_logits.f32"));
  const size_t V = static_cast<size_t>(model.info().vocab_size);
  std::vector<std::vector<int32_t>> prompts;
  for (const json& c : fx["cases"]) prompts.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
  EXPECT_GE(prompts.size(), 10u);
  out.cases = static_cast<int>(prompts.size());

  // Per case: logit differences at the steps that have full rows (and on the top-20 ids at
  // every step while the continuation still matches llama.cpp's).
  const int later = fx["later_step"];
  std::vector<double> first_diff(prompts.size(), -1), later_diff(prompts.size(), -1);
  std::vector<double> top_diff(prompts.size(), 0);
  std::vector<char> diverged(prompts.size(), 0);
  testing::GreedyOptions opt;
  opt.max_new_tokens = fx["max_new_tokens"];
  opt.stop_ids = fx["eog_ids"].get<std::vector<int32_t>>();
  opt.on_logits = [&](size_t seq, int32_t step, std::span<const float> logits) {
    const json& c = fx["cases"][seq][ref];
    const bool same_context = !diverged[seq];
    // The top-20 comparison holds while both continuations are the same (same context).
    if (!diverged[seq] && step < static_cast<int32_t>(c["top"].size())) {
      for (const json& e : c["top"][step]) {
        top_diff[seq] =
            std::max(top_diff[seq], std::abs(logits[e[0].get<size_t>()] - e[1].get<double>()));
      }
      const auto argmax = std::max_element(logits.begin(), logits.end()) - logits.begin();
      diverged[seq] = argmax != c["greedy"][step].get<int64_t>();
    }
    const json& rows = c["full_logits"];
    const std::string key = std::to_string(step);
    if (!same_context) return;  // different contexts: nothing to compare
    if (!rows.contains(key)) return;
    const size_t row = rows[key].get<size_t>();
    if ((row + 1) * V > full.size()) return;
    double d = 0;
    for (size_t i = 0; i < V; ++i) d = std::max(d, std::abs(double(logits[i]) - full[row * V + i]));
    (step == 0 ? first_diff : later_diff)[seq] = d;
  };
  auto result = testing::RunGreedy(model, prompts, opt);
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) return out;
  EXPECT_GT(result->replayed_steps, 0) << "decode steps should replay captured programs";

  for (size_t i = 0; i < prompts.size(); ++i) {
    const json& c = fx["cases"][i];
    const auto want = c[ref]["greedy"].get<std::vector<int32_t>>();
    const auto& got = result->generated[i];
    size_t k = 0;
    while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
    const bool same = got == want;
    out.identical += same;
    EXPECT_GE(first_diff[i], 0) << c["name"] << ": no logits at step 0";
    out.logits_within = out.logits_within && first_diff[i] < tolerance && later_diff[i] < tolerance;
    out.max_first = std::max(out.max_first, first_diff[i]);
    out.max_later = std::max(out.max_later, later_diff[i]);
    out.max_top = std::max(out.max_top, top_diff[i]);
    std::printf(
        "[%s] %-44.44s %s %2zu/%2zu tokens agree  |dlogit| step0 %.4f  step%d %s  "
        "top20 %.4f  (llama.cpp min top-2 margin %.4f)\n",
        ref.c_str(), c["name"].get<std::string>().c_str(), same ? "==" : "!=", k, want.size(),
        first_diff[i], later,
        later_diff[i] < 0 ? "  -   " : std::to_string(later_diff[i]).substr(0, 6).c_str(),
        top_diff[i], c[ref]["min_margin"].get<double>());
  }
  std::printf(
      "[%s] identical continuations: %d/%d; max |dlogit| vs llama.cpp: step 0 %.3g, "
      "step %d %.3g, top-20 while equal %.3g\n",
      ref.c_str(), out.identical, out.cases, out.max_first, later, out.max_later, out.max_top);
  return out;
}

TEST(SmolLm2GoldenTest, PromptsTokenizeAndRenderLikeTheFixture) {
  auto model = LoadSmolLm2(/*llama_cpp_numerics=*/false);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_NE((*model)->chat_template(), nullptr);
  for (const json& c : Fixture()["cases"]) {
    std::string text = c["text"];
    if (c["chat"]) {
      ChatTemplate::Inputs in;
      in.messages = c["messages"];
      auto rendered = (*model)->chat_template()->Apply(in);
      ASSERT_TRUE(rendered.ok()) << rendered.status();
      EXPECT_EQ(*rendered, text) << c["name"];
    }
    auto ids = (*model)->tokenizer().Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, c["prompt_ids"].get<std::vector<int32_t>>()) << c["name"];
  }
}

// Default numerics against llama.cpp computing the same arithmetic: every continuation equal.
TEST(SmolLm2GoldenTest, GreedyContinuationsEqualLlamaCppF32) {
  auto model = LoadSmolLm2(/*llama_cpp_numerics=*/false);
  ASSERT_TRUE(model.ok()) << model.status();
  const Comparison c = CompareWithLlamaCpp(**model, "f32", kF32LogitTolerance);
  EXPECT_EQ(c.identical, c.cases);
  EXPECT_TRUE(c.logits_within) << "max |dlogit| " << c.max_first << " / " << c.max_later;
  ::testing::Test::RecordProperty("identical", c.identical);
  ::testing::Test::RecordProperty("max_logit_diff",
                                  std::to_string(std::max(c.max_first, c.max_later)));
}

// Kiln's quantized numerics (`activations: q8`, `kv_cache_dtype: f16`) against exact
// arithmetic (the f32 reference): the gate. Their agreement with llama.cpp's own quantized path
// is printed as a report, never gated: llama.cpp disagrees with itself at that level (the
// fixture's llama_cpp_q4_1_self_agreement), and summation order differs between AVX2 and
// AVX-512 kernels, so a near-tie can flip on one machine and not on another.
TEST(SmolLm2GoldenTest, QuantizedActivationsStayNearExactArithmetic) {
  auto model = LoadSmolLm2(/*llama_cpp_numerics=*/true);
  ASSERT_TRUE(model.ok()) << model.status();
  const Comparison exact = CompareWithLlamaCpp(**model, "f32", kQ8VsExactLogitTolerance);
  EXPECT_TRUE(exact.logits_within)
      << "q8 vs exact: max |dlogit| " << exact.max_first << " / " << exact.max_later << " (bound "
      << kQ8VsExactLogitTolerance << ")";
  // Continuations are printed, not gated: near-ties flip (2-4/10 identical to exact across
  // the AVX-512, AVX2 and scalar kernels).

  // The report: Kiln's q8 path against llama.cpp's quantized path, beside llama.cpp's
  // agreement with itself under its other settings.
  const Comparison q = CompareWithLlamaCpp(**model, "q4_1", /*tolerance=*/1e9);
  for (const auto& [name, v] : Fixture()["llama_cpp_q4_1_self_agreement"].items()) {
    std::printf("[q4_1] llama.cpp with %s: %d/%d identical to its default\n", name.c_str(),
                v["identical"].get<int>(), v["of"].get<int>());
  }
  std::printf(
      "[q4_1] report only: Kiln q8 vs llama.cpp q4_1: %d/%d identical, max |dlogit| "
      "step 0 %.3f, later %.3f\n",
      q.identical, q.cases, q.max_first, q.max_later);
  ::testing::Test::RecordProperty("identical_to_llama_cpp_q4_1", q.identical);
  ::testing::Test::RecordProperty("identical_to_exact", exact.identical);
  ::testing::Test::RecordProperty("max_logit_diff_to_exact",
                                  std::to_string(std::max(exact.max_first, exact.max_later)));
}

// Logits of every step of every prompt, run by RunGreedy: alone (each prompt its own run)
// or together (one batch), prefilled in steps of at most `chunk` tokens.
std::vector<std::vector<float>> StepLogits(PagedLlm& model,
                                           const std::vector<std::vector<int32_t>>& prompts,
                                           int32_t chunk, bool together) {
  std::vector<std::vector<float>> logits;  // [prompt * kSteps + step]
  constexpr int32_t kSteps = 4;
  logits.resize(prompts.size() * kSteps);
  auto run = [&](const std::vector<std::vector<int32_t>>& batch, size_t first) {
    testing::GreedyOptions opt;
    opt.max_new_tokens = kSteps;
    opt.max_step_tokens = chunk;
    opt.on_logits = [&](size_t seq, int32_t step, std::span<const float> l) {
      logits[(first + seq) * kSteps + step].assign(l.begin(), l.end());
    };
    auto r = testing::RunGreedy(model, batch, opt);
    EXPECT_TRUE(r.ok()) << r.status();
  };
  if (together) {
    run(prompts, 0);
  } else {
    for (size_t i = 0; i < prompts.size(); ++i) run({prompts[i]}, i);
  }
  return logits;
}

// A prompt's logits must not depend on how its steps are cut: prefilled at once, in chunks
// (as after a prefix-cache hit, which computes only the uncached tail), one token per step
// (through the decode path and the split of long rows over threads), or beside other
// sequences. With `activations: q8` they are bit-identical: that path needs it, since a one-ulp
// difference flips roundings of its 8-bit activations and greedy answers then differ (the same
// request twice through the prefix cache answered differently before the attention kernels
// were made independent of the cut). Exact arithmetic is not (GEMV for a few rows, packed GEMM
// for many: another summation order), but within 1e-3.
TEST(SmolLm2GoldenTest, LogitsDoNotDependOnHowThePromptIsCut) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int32_t> all;  // every prompt in one: 237 tokens, decode rows split over threads
  for (const json& c : Fixture()["cases"]) {
    prompts.push_back(c["prompt_ids"].get<std::vector<int32_t>>());
    all.insert(all.end(), prompts.back().begin(), prompts.back().end());
  }
  prompts.push_back(all);
  for (const bool q8 : {true, false}) {
    auto model = LoadSmolLm2(/*llama_cpp_numerics=*/q8);
    ASSERT_TRUE(model.ok()) << model.status();
    const auto want = StepLogits(**model, prompts, 512, /*together=*/false);
    struct Cut {
      int32_t chunk;
      bool together;
    };
    const std::vector<Cut> cuts =
        q8 ? std::vector<Cut>{{16, false}, {1, false}, {512, true}, {5, true}}
           : std::vector<Cut>{{16, false}, {512, true}};
    for (const Cut& cut : cuts) {
      const auto got = StepLogits(**model, prompts, cut.chunk, cut.together);
      double max_diff = 0;
      int identical = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i].size(), want[i].size());
        double d = 0;
        for (size_t v = 0; v < want[i].size(); ++v) {
          d = std::max(d, static_cast<double>(std::abs(got[i][v] - want[i][v])));
        }
        max_diff = std::max(max_diff, d);
        identical += std::memcmp(got[i].data(), want[i].data(), want[i].size() * 4) == 0;
      }
      std::printf("%s, steps of %d tokens%s: %d/%zu logit rows bit-identical, max |dlogit| %g\n",
                  q8 ? "q8" : "exact", cut.chunk, cut.together ? ", prompts together" : "",
                  identical, want.size(), max_diff);
      if (q8) {
        EXPECT_EQ(identical, static_cast<int>(want.size())) << "steps of " << cut.chunk;
      } else {
        EXPECT_LT(max_diff, 1e-3) << "steps of " << cut.chunk;
      }
    }
  }
}

}  // namespace
}  // namespace kiln::models
