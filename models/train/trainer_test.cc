// The training engine against PyTorch + PEFT (tests/fixtures/training/, made by
// scripts/fixtures/make_training_fixtures.py): the loss and every LoRA gradient of a packed
// batch, on random-weight Hugging Face models and on SmolLM2's Q4_1 GGUF (frozen weights stay
// quantized; transformers dequantized them), within a relative error of 1e-4.
#include "models/train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

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
  bool recompute = false;  // TrainerOptions::recompute
  std::string label() const { return recompute ? name + "_recompute" : name; }
};

// A trainer on the case's model with the fixture's adapter, and the fixture's batch.
void MakeTrainer(const Case& c, const SafetensorsFile& f, std::unique_ptr<Trainer>* out,
                 TrainBatch* batch, bool* gguf_qk) {
  const int64_t r = std::stoll(f.metadata().at("r"));
  const double alpha = std::stod(f.metadata().at("alpha"));
  config::ModelConfig mc;
  mc.path = Cat(testing::SourceDir(), "/", c.model_path);
  mc.backend = "cpu";
  mc.threads = 2;
  auto parts = OpenLlmParts(mc);
  ASSERT_TRUE(parts.ok()) << parts.status();
  const LlmHParams hp = parts->hparams;
  *gguf_qk = parts->files->is_gguf() && hp.rope.layout == RopeParams::Layout::kInterleaved;
  TrainerOptions opts;
  opts.lora.r = r;
  opts.lora.alpha = alpha;
  opts.batch_size = std::stoll(f.metadata().at("rows"));
  opts.seq_len = std::stoll(f.metadata().at("seq"));
  opts.recompute = c.recompute;
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
      if (*gguf_qk && (suffix == "attn_q" || suffix == "attn_k")) {
        bv = PermuteRows(bv, heads_of(suffix), r, /*to_gguf=*/true);
      }
      ASSERT_TRUE(t.Write(stem + ".lora_A", FormulaA(r, in, l, static_cast<int64_t>(m))).ok());
      ASSERT_TRUE(t.Write(stem + ".lora_B", bv).ok());
    }
  }
  batch->rows = opts.batch_size;
  batch->seq_len = opts.seq_len;
  batch->tokens = IntsOf(*f.Find("tokens"));
  batch->targets = IntsOf(*f.Find("targets"));
  batch->positions = IntsOf(*f.Find("positions"));
  batch->doc_ids = IntsOf(*f.Find("doc_ids"));
  batch->target_count = std::count_if(batch->targets.begin(), batch->targets.end(),
                                      [](int32_t t) { return t != train::kIgnoreIndex; });
  *out = *std::move(trainer);
}

SafetensorsFile* OpenFixture(const Case& c) {
  static std::map<std::string, std::unique_ptr<SafetensorsFile>> files;
  auto& slot = files[c.name];
  if (slot == nullptr) {
    auto f = SafetensorsFile::Open(
        Cat(testing::SourceDir(), "/tests/fixtures/training/", c.name, "/lora_grads.safetensors"));
    EXPECT_TRUE(f.ok()) << f.status();
    if (f.ok()) slot = *std::move(f);
  }
  return slot.get();
}

class TrainerGradientTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerGradientTest, LossAndEveryLoraGradientEqualPyTorchPeft) {
  const Case& c = GetParam();
  const SafetensorsFile* fixture = OpenFixture(c);
  ASSERT_NE(fixture, nullptr);
  const SafetensorsFile& f = *fixture;
  const int64_t r = std::stoll(f.metadata().at("r"));
  const double want_loss = std::stod(f.metadata().at("loss"));
  std::unique_ptr<Trainer> trainer;
  TrainBatch batch;
  bool gguf_qk = false;
  MakeTrainer(c, f, &trainer, &batch, &gguf_qk);
  ASSERT_NE(trainer, nullptr);
  Trainer& t = *trainer;
  const LlmHParams& hp = t.parts().hparams;
  auto heads_of = [&](std::string_view suffix) {
    return suffix == "attn_q" ? hp.num_heads : hp.num_kv_heads;
  };

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
              c.label().c_str(), res->loss, want_loss, compared, worst, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Models, TrainerGradientTest,
    ::testing::Values(Case{"llama_gqa_f32", "tests/fixtures/models/llama_gqa_f32"},
                      Case{"qwen2_bias_f32", "tests/fixtures/models/qwen2_bias_f32"},
                      Case{"smollm2", ".kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf"},
                      Case{"llama_gqa_f32", "tests/fixtures/models/llama_gqa_f32", true},
                      Case{"smollm2", ".kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf", true}),
    [](const auto& info) { return info.param.label(); });

// Recomputation changes where activations come from, not what they are: the same loss,
// gradients and optimizer step from a smaller step arena. Bit for bit without fusion; with it,
// to float rounding: a forward value the backward no longer reads may fuse into its forward
// consumer (a GEMM epilogue, a longer map), which rounds differently.
TEST(TrainerRecomputeTest, SameStepFromASmallerArena) {
  const Case cases[2] = {{"llama_gqa_f32", "tests/fixtures/models/llama_gqa_f32", false},
                         {"llama_gqa_f32", "tests/fixtures/models/llama_gqa_f32", true}};
  const SafetensorsFile* f = OpenFixture(cases[0]);
  ASSERT_NE(f, nullptr);
  const char* saved = std::getenv("KILN_FUSE");
  const std::string saved_value = saved != nullptr ? saved : "";
  for (const bool fuse : {false, true}) {
    SCOPED_TRACE(fuse ? "fused" : "unfused");
    setenv("KILN_FUSE", fuse ? "1" : "0", 1);
    std::unique_ptr<Trainer> t[2];
    TrainBatch batch[2];
    std::map<std::string, std::vector<float>> grads[2], params[2];
    double loss[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      bool gguf_qk = false;
      MakeTrainer(cases[i], *f, &t[i], &batch[i], &gguf_qk);
      ASSERT_NE(t[i], nullptr);
      auto g = t[i]->Gradients(batch[i], &grads[i]);
      ASSERT_TRUE(g.ok()) << g.status();
      auto s = t[i]->Step(batch[i], 1e-2);
      ASSERT_TRUE(s.ok()) << s.status();
      loss[i] = s->loss;
      for (const TrainableTensor& tt : t[i]->trainable()) {
        params[i][tt.name] = *t[i]->Read(tt.name);
      }
    }
    ASSERT_EQ(grads[0].size(), grads[1].size());
    double worst_grad = 0, worst_param = 0;
    for (const auto& [name, g] : grads[0]) {
      worst_grad = std::max(worst_grad, RelativeError(grads[1][name], g));
      if (!fuse) {
        EXPECT_EQ(grads[1][name], g) << name;
      }
    }
    for (const auto& [name, p] : params[0]) {
      worst_param = std::max(worst_param, RelativeError(params[1][name], p));
      if (!fuse) {
        EXPECT_EQ(params[1][name], p) << name;
      }
    }
    if (!fuse) {
      EXPECT_EQ(loss[1], loss[0]);
    }
    EXPECT_NEAR(loss[1], loss[0], 1e-6 * std::fabs(loss[0]));
    EXPECT_LE(worst_grad, 1e-5);
    // Adam's first step is about lr * sign(g): tiny gradients amplify rounding differences.
    EXPECT_LE(worst_param, 1e-4);
    EXPECT_LT(t[1]->step_arena_bytes(), t[0]->step_arena_bytes());
    std::printf(
        "llama_gqa_f32 (%s): step arena %zu bytes, %zu with recomputation; worst relative "
        "difference %.2e (gradients), %.2e (parameters after a step)\n",
        fuse ? "fused" : "unfused", t[0]->step_arena_bytes(), t[1]->step_arena_bytes(), worst_grad,
        worst_param);
  }
  if (saved != nullptr) {
    setenv("KILN_FUSE", saved_value.c_str(), 1);
  } else {
    unsetenv("KILN_FUSE");
  }
}

}  // namespace
}  // namespace kiln::models
