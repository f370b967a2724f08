// Random-weight models made with transformers (tests/fixtures/models/<name>/, written by
// scripts/fixtures/make_llm_fixtures.py): Kiln loads each Hugging Face folder and must give
// transformers' last-position logits (at the first and a later generation step) within a
// tight tolerance and the same greedy continuation. One model per feature flag: GQA and
// rope_theta, llama3 RoPE scaling (bf16, tied), Qwen2 biases, Qwen3 q/k norms (bf16,
// head_dim != hidden / heads), Mistral's sliding window, GPT-2, Gemma 2 (attention and
// final-logit soft-capping, alternating sliding/global layers), Gemma 3 text (q/k norms, a
// RoPE per layer type; bf16), Phi-3 (fused projections, partial RoPE, sliding window).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "models/io/test_paths.h"
#include "models/llm/loader.h"
#include "models/llm/paged_llm.h"
#include "models/llm/testing/greedy_driver.h"

namespace kiln::models {
namespace {

using nlohmann::json;

// transformers and Kiln both compute in f32 (Kiln's reference kernels accumulate in f64);
// logits are O(10). The models of issue 16 (Gemma 2, Gemma 3, Phi-3) are held to its 1e-4
// (measured: 2.3e-5 to 3.4e-5 on AVX-512); the older ones keep their first bound.
constexpr double kLogitTolerance = 2e-3;
constexpr double kTightLogitTolerance = 1e-4;

struct Case {
  std::string name;
  std::string architecture;
  // Loaded instead of the folder where set: the same weights as llama.cpp's converter writes
  // them (tests/fixtures/models/<gguf>), checked against the folder's reference.
  std::string gguf = {};
  double tolerance = kLogitTolerance;
};

class HfGoldenTest : public ::testing::TestWithParam<Case> {
 protected:
  std::string Folder() const { return testing::FixturePath("models/" + GetParam().name); }
};

std::vector<float> ReadF32(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EXPECT_TRUE(in.good()) << path;
  std::vector<float> v(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  return v;
}

config::ModelConfig ConfigFor(const std::string& path) {
  config::ModelConfig c;
  c.name = "fixture";
  c.kind = "llm";
  c.path = path;
  c.threads = 2;
  c.scheduler.max_num_seqs = 4;
  c.scheduler.max_num_batched_tokens = 64;
  c.scheduler.capture_batch_sizes = {1, 2, 4};
  return c;
}

TEST_P(HfGoldenTest, LogitsAndGreedyContinuationsMatchTransformers) {
  std::ifstream in(Folder() + "/kiln_reference.json");
  ASSERT_TRUE(in.good()) << Folder();
  const json ref = json::parse(in);
  const std::vector<float> full = ReadF32(Folder() + "/kiln_reference_logits.f32");

  const std::string weights =
      GetParam().gguf.empty() ? Folder() : testing::FixturePath("models/" + GetParam().gguf);
  auto loaded = LoadPagedLlm(ConfigFor(weights));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  PagedLlm& model = **loaded;
  EXPECT_EQ(model.info().architecture, GetParam().architecture);
  const size_t V = static_cast<size_t>(model.info().vocab_size);
  ASSERT_EQ(V, ref["vocab_size"].get<size_t>());

  std::vector<std::vector<int32_t>> prompts;
  for (const json& p : ref["prompts"]) {
    prompts.push_back(p["ids"].get<std::vector<int32_t>>());
    // The tokenizer is checked elsewhere; here it must only agree on these prompts.
    auto ids = model.tokenizer().Encode(p["text"].get<std::string>());
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, prompts.back()) << p["text"];
  }
  std::vector<std::map<int32_t, double>> diffs(prompts.size());
  testing::GreedyOptions opt;
  opt.max_new_tokens = ref["greedy_tokens"];
  opt.on_logits = [&](size_t seq, int32_t step, std::span<const float> logits) {
    const json& rows = ref["prompts"][seq]["full_logits"];
    if (!rows.contains(std::to_string(step))) return;
    const size_t row = rows[std::to_string(step)].get<size_t>();
    double d = 0;
    for (size_t i = 0; i < V; ++i) d = std::max(d, std::abs(double(logits[i]) - full[row * V + i]));
    diffs[seq][step] = d;
  };
  // Prompts are prefilled in chunks of at most 16 tokens (chunked prefill), then decoded
  // together through captured programs.
  opt.max_step_tokens = 16;
  auto result = testing::RunGreedy(model, prompts, opt);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(result->replayed_steps, 0);
  double worst = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const json& p = ref["prompts"][i];
    EXPECT_EQ(result->generated[i], p["greedy"].get<std::vector<int32_t>>()) << p["text"];
    ASSERT_EQ(diffs[i].size(), 2u) << p["text"];
    for (const auto& [step, d] : diffs[i]) {
      EXPECT_LT(d, GetParam().tolerance) << p["text"] << " at step " << step;
      worst = std::max(worst, d);
    }
  }
  std::printf("%s%s: max |dlogit| vs transformers %.2e over %zu prompts\n", GetParam().name.c_str(),
              GetParam().gguf.empty() ? "" : " (GGUF)", worst, prompts.size());
  RecordProperty("max_logit_diff", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, HfGoldenTest,
    ::testing::Values(Case{"llama_gqa_f32", "llama"}, Case{"llama3_rope_bf16", "llama"},
                      Case{"qwen2_bias_f32", "qwen2"}, Case{"qwen3_qknorm_bf16", "qwen3"},
                      Case{"mistral_swa_f32", "mistral"}, Case{"gpt2_f32", "gpt2"},
                      Case{"gemma2_softcap_f32", "gemma2", "", kTightLogitTolerance},
                      Case{"gemma3_text_bf16", "gemma3", "", kTightLogitTolerance},
                      Case{"phi3_fused_f32", "phi3", "", kTightLogitTolerance},
                      Case{"gemma3_text_bf16", "gemma3", "gemma3_text_bf16.gguf",
                           kTightLogitTolerance}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return info.param.name + (info.param.gguf.empty() ? "" : "_gguf");
    });

}  // namespace
}  // namespace kiln::models
