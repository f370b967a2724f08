// The training engine against PyTorch + PEFT (tests/fixtures/training/, made by
// scripts/fixtures/make_training_fixtures.py): the loss and every LoRA gradient of a packed
// batch, on random-weight Hugging Face models and on SmolLM2's Q4_1 GGUF (frozen weights stay
// quantized; transformers dequantized them), within a relative error of 1e-4.
#include "models/train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "models/io/errors.h"
#include "models/io/test_paths.h"
#include "models/llm/loader.h"
#include "models/safetensors/safetensors.h"

namespace kiln::models {
namespace {

// The fixture's A and B formulas (see the script), in Hugging Face's row order.
std::vector<float> FormulaA(int64_t r, int64_t in, int64_t layer, int64_t module) {
  std::vector<float> v(static_cast<size_t>(r * in));
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < in; ++j) {
      v[i * in + j] = static_cast<float>(0.05 * std::sin(0.37 * static_cast<double>(i * in + j) +
                                                         1.3 * layer + 0.7 * module + 0.1));
    }
  }
  return v;
}
std::vector<float> FormulaB(int64_t out, int64_t r, int64_t layer, int64_t module) {
  std::vector<float> v(static_cast<size_t>(out * r));
  for (int64_t i = 0; i < out; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      v[i * r + j] = static_cast<float>(0.05 * std::cos(0.23 * static_cast<double>(i * r + j) +
                                                        0.9 * layer + 0.5 * module + 0.2));
    }
  }
  return v;
}

// llama.cpp's converter stores q/k rows of `llama` GGUF files permuted: GGUF row h*D + 2i + s
// holds Hugging Face row h*D + s*D/2 + i. `to_gguf` maps HF rows to GGUF rows.
std::vector<float> PermuteRows(const std::vector<float>& m, int64_t heads, int64_t cols,
                               bool to_gguf) {
  const int64_t rows = static_cast<int64_t>(m.size()) / cols, d = rows / heads;
  std::vector<float> out(m.size());
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d / 2; ++i) {
      for (int64_t s = 0; s < 2; ++s) {
        const int64_t g = h * d + 2 * i + s, f = h * d + s * (d / 2) + i;
        const int64_t src = to_gguf ? f : g, dst = to_gguf ? g : f;
        std::memcpy(&out[dst * cols], &m[src * cols], cols * sizeof(float));
      }
    }
  }
  return out;
}

std::vector<float> FloatsOf(const SafetensorsTensor& t) {
  std::vector<float> v(t.n_elements);
  std::memcpy(v.data(), t.data, v.size() * sizeof(float));
  return v;
}
std::vector<int32_t> IntsOf(const SafetensorsTensor& t) {
  std::vector<int32_t> v(t.n_elements);
  std::memcpy(v.data(), t.data, v.size() * sizeof(int32_t));
  return v;
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    den += double{want[i]} * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

struct Case {
  std::string name;        // fixture folder under tests/fixtures/training/
  std::string model_path;  // relative to the source dir
};

class TrainerGradientTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerGradientTest, LossAndEveryLoraGradientEqualPyTorchPeft) {
  const Case& c = GetParam();
  auto fixture = SafetensorsFile::Open(
      Cat(testing::SourceDir(), "/tests/fixtures/training/", c.name, "/lora_grads.safetensors"));
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  const SafetensorsFile& f = **fixture;
  const int64_t r = std::stoll(f.metadata().at("r"));
  const double alpha = std::stod(f.metadata().at("alpha"));
  const double want_loss = std::stod(f.metadata().at("loss"));

  config::ModelConfig mc;
  mc.path = Cat(testing::SourceDir(), "/", c.model_path);
  mc.backend = "cpu";
  mc.threads = 2;
  auto parts = OpenLlmParts(mc);
  ASSERT_TRUE(parts.ok()) << parts.status();
  const LlmHParams hp = parts->hparams;
  const bool gguf_qk =
      parts->files->is_gguf() && hp.rope.layout == RopeParams::Layout::kInterleaved;
  TrainerOptions opts;
  opts.lora.r = r;
  opts.lora.alpha = alpha;
  opts.batch_size = std::stoll(f.metadata().at("rows"));
  opts.seq_len = std::stoll(f.metadata().at("seq"));
  auto trainer = Trainer::Create(*std::move(parts), opts);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Trainer& t = **trainer;

  // The fixture's adapter, q/k rows of B in the model's order.
  const std::vector<std::string_view>& modules = PeftModuleNames();
  auto heads_of = [&](std::string_view suffix) {
    return suffix == "attn_q" ? hp.num_heads : hp.num_kv_heads;
  };
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    for (size_t m = 0; m < modules.size(); ++m) {
      const std::string_view suffix = GgufSuffixForPeftModule(modules[m]);
      const std::string stem = Cat("blk.", l, ".", suffix);
      auto a = t.Read(stem + ".lora_A");
      auto b = t.Read(stem + ".lora_B");
      ASSERT_TRUE(a.ok() && b.ok()) << stem;
      const int64_t in = static_cast<int64_t>(a->size()) / r,
                    out = static_cast<int64_t>(b->size()) / r;
      std::vector<float> bv = FormulaB(out, r, l, static_cast<int64_t>(m));
      if (gguf_qk && (suffix == "attn_q" || suffix == "attn_k")) {
        bv = PermuteRows(bv, heads_of(suffix), r, /*to_gguf=*/true);
      }
      ASSERT_TRUE(t.Write(stem + ".lora_A", FormulaA(r, in, l, static_cast<int64_t>(m))).ok());
      ASSERT_TRUE(t.Write(stem + ".lora_B", bv).ok());
    }
  }
  TrainBatch batch;
  batch.rows = opts.batch_size;
  batch.seq_len = opts.seq_len;
  batch.tokens = IntsOf(*f.Find("tokens"));
  batch.targets = IntsOf(*f.Find("targets"));
  batch.positions = IntsOf(*f.Find("positions"));
  batch.doc_ids = IntsOf(*f.Find("doc_ids"));
  batch.target_count = std::count_if(batch.targets.begin(), batch.targets.end(),
                                     [](int32_t t) { return t != train::kIgnoreIndex; });

  std::map<std::string, std::vector<float>> grads;
  auto res = t.Gradients(batch, &grads);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_NEAR(res->loss, want_loss, 1e-4 * std::fabs(want_loss));
  EXPECT_EQ(res->tokens, batch.target_count);
  int compared = 0;
  double worst = 0;
  std::string worst_name;
  for (const auto& [name, g] : grads) {
    const SafetensorsTensor* ref = f.Find(name + ".grad");
    ASSERT_NE(ref, nullptr) << name;
    std::vector<float> got = g;
    const std::string_view suffix = std::string_view(name).substr(
        name.find('.', 4) + 1, name.rfind('.') - name.find('.', 4) - 1);
    if (gguf_qk && name.ends_with(".lora_B") && (suffix == "attn_q" || suffix == "attn_k")) {
      got = PermuteRows(got, heads_of(suffix), r, /*to_gguf=*/false);
    }
    const double err = RelativeError(got, FloatsOf(*ref));
    EXPECT_LE(err, 1e-4) << name;
    if (err > worst) worst = err, worst_name = name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(f.tensors().size()) - 4);
  std::printf("%s: loss %.6f (PyTorch %.6f), %d gradients, worst relative error %.2e (%s)\n",
              c.name.c_str(), res->loss, want_loss, compared, worst, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Models, TrainerGradientTest,
    ::testing::Values(Case{"llama_gqa_f32", "tests/fixtures/models/llama_gqa_f32"},
                      Case{"qwen2_bias_f32", "tests/fixtures/models/qwen2_bias_f32"},
                      Case{"smollm2", ".kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf"}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kiln::models
