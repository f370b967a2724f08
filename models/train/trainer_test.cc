// The training engine against PyTorch + PEFT (tests/fixtures/training/, made by
// scripts/fixtures/make_training_fixtures.py), on random-weight Hugging Face models and on
// SmolLM2's Q4_1 GGUF (frozen weights stay quantized; transformers dequantized them):
//   - the loss and every LoRA gradient of a packed batch (llama family and GPT-2) and every
//     full fine-tuning gradient, within a relative error of 1e-4;
//   - 50 AdamW steps with global-norm clipping (SmolLM2: the first 10; docs/training.md says
//     why): each step's loss within 1% of PyTorch's;
//   - resuming from a checkpoint (WriteCheckpoint / LoadCheckpoint) after step 20 gives steps
//     21-50 bit for bit;
//   - an adapter written as PEFT files and read back gives PEFT's logits (1e-4).
#include "models/train/trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "backends/builtin.h"
#include "engine/autograd.h"
#include "engine/program.h"
#include "models/io/errors.h"
#include "models/io/test_paths.h"
#include "models/llm/loader.h"
#include "models/lora/peft_io.h"
#include "models/safetensors/safetensors.h"
#include "models/train/checkpoint.h"

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

// The q/k rows of a `llama` GGUF in llama.cpp's order (`to_gguf`) or back in Hugging Face's.
std::vector<float> PermuteRows(const std::vector<float>& m, int64_t heads, int64_t cols,
                               bool to_gguf) {
  const int64_t rows = static_cast<int64_t>(m.size()) / cols;
  return to_gguf ? HfToGgufQkRows(m, rows, cols, heads) : GgufToHfQkRows(m, rows, cols, heads);
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

std::unique_ptr<SafetensorsFile> OpenFixture(const std::string& name, const std::string& file) {
  auto f = SafetensorsFile::Open(
      Cat(testing::SourceDir(), "/tests/fixtures/training/", name, "/", file));
  KILN_CHECK(f.ok(), "a training fixture is missing; see scripts/fixtures/README.md");
  return *std::move(f);
}

StatusOr<PagedLlmParts> OpenModel(const std::string& model_path) {
  config::ModelConfig mc;
  mc.path = Cat(testing::SourceDir(), "/", model_path);
  mc.backend = "cpu";
  mc.threads = 2;
  return OpenLlmParts(mc);
}

// Rows of a llama-variant GGUF's q/k weights are permuted (see PermuteRows).
bool GgufQkRows(const PagedLlmParts& parts) {
  return parts.files->is_gguf() && parts.hparams.rope.layout == RopeParams::Layout::kInterleaved;
}

// The fixture's adapter (formula A and B, or B = 0 as PEFT initialises it), shaped after
// `t`'s trainable tensors, q/k rows of B in the model's order.
LoraAdapter FormulaAdapter(const Trainer& t, bool gguf_qk, bool zero_b) {
  const LlmHParams& hp = t.parts().hparams;
  const std::vector<LoraModule>& modules = LoraModules(hp.architecture);
  LoraAdapter adapter;
  adapter.config = t.options().lora;
  const int64_t r = adapter.config.r;
  for (const TrainableTensor& tt : t.trainable()) {
    if (!tt.name.ends_with(".lora_A")) continue;
    const size_t dot = tt.name.find('.', 4);
    const int64_t l = std::stoll(tt.name.substr(4, dot - 4));
    const std::string suffix = tt.name.substr(dot + 1, tt.name.size() - dot - 1 - 7);
    const int64_t m = std::find_if(modules.begin(), modules.end(),
                                   [&](const LoraModule& x) { return x.gguf == suffix; }) -
                      modules.begin();
    KILN_CHECK(m < static_cast<int64_t>(modules.size()), "a LoRA weight of no module");
    LoraLayer& layer = adapter.layers[Cat("blk.", l, ".", suffix, ".weight")];
    layer.in = tt.shape[1];
    auto b = t.Read(Cat("blk.", l, ".", suffix, ".lora_B"));
    KILN_CHECK(b.ok(), "lora_B beside lora_A");
    layer.out = static_cast<int64_t>(b->size()) / r;
    layer.a = FormulaA(r, layer.in, l, m);
    layer.b = zero_b ? std::vector<float>(b->size(), 0.0f) : FormulaB(layer.out, r, l, m);
    if (gguf_qk && (suffix == "attn_q" || suffix == "attn_k")) {
      layer.b = PermuteRows(layer.b, suffix == "attn_q" ? hp.num_heads : hp.num_kv_heads, r,
                            /*to_gguf=*/true);
    }
  }
  return adapter;
}

// Batch `index` of the fixture's batches (each rows * seq tokens, stored one after another).
TrainBatch BatchOf(const SafetensorsFile& f, int64_t index = 0) {
  TrainBatch batch;
  batch.rows = std::stoll(f.metadata().at("rows"));
  batch.seq_len = std::stoll(f.metadata().at("seq"));
  const size_t n = static_cast<size_t>(batch.rows * batch.seq_len), at = index * n;
  auto slice = [&](const char* name) {
    std::vector<int32_t> all = IntsOf(*f.Find(name));
    KILN_CHECK(at + n <= all.size(), "batch index past the fixture's batches");
    return std::vector<int32_t>(all.begin() + at, all.begin() + at + n);
  };
  batch.tokens = slice("tokens");
  batch.targets = slice("targets");
  batch.positions = slice("positions");
  batch.doc_ids = slice("doc_ids");
  batch.target_count = std::count_if(batch.targets.begin(), batch.targets.end(),
                                     [](int32_t t) { return t != train::kIgnoreIndex; });
  return batch;
}

TrainerOptions LoraOptions(const SafetensorsFile& f) {
  TrainerOptions opts;
  opts.lora.r = std::stoll(f.metadata().at("r"));
  opts.lora.alpha = std::stod(f.metadata().at("alpha"));
  opts.batch_size = std::stoll(f.metadata().at("rows"));
  opts.seq_len = std::stoll(f.metadata().at("seq"));
  return opts;
}

std::vector<double> JsonDoubles(const SafetensorsFile& f, const char* key) {
  return nlohmann::json::parse(f.metadata().at(key)).get<std::vector<double>>();
}

std::string TempDir(const std::string& what) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / Cat("kiln_trainer_test_", what, "_", getpid()))
          .string();
  std::filesystem::remove_all(dir);
  return dir;
}

struct Case {
  std::string name;        // fixture folder under tests/fixtures/training/
  std::string model_path;  // relative to the source dir
  int64_t steps = 0;       // TrainerAdamWTest: the fixture's first `steps` steps; 0: all
  bool recompute = false;  // TrainerOptions::recompute
  // TrainerGradientTest: the fixture file (lora_dropout_grads: PEFT's lora_dropout with
  // Kiln's masks, models/lora/lora_dropout.h).
  std::string file = "lora_grads.safetensors";
  std::string label() const {
    return name + (file == "lora_grads.safetensors" ? "" : "_dropout") +
           (recompute ? "_recompute" : "");
  }
};
const Case kLlama{"llama_gqa_f32", "tests/fixtures/models/llama_gqa_f32"};
const Case kQwen2{"qwen2_bias_f32", "tests/fixtures/models/qwen2_bias_f32"};
const Case kGpt2{"gpt2_f32", "tests/fixtures/models/gpt2_f32"};
// Issue 16's models: Gemma 2's soft-capped attention (trained through the decomposition) and
// sliding layers, Gemma 3's q/k norms and alternating RoPEs, Phi-3's fused projections (LoRA
// on qkv_proj and gate_up_proj) and window — all with packed rows (document masks).
const Case kGemma2{"gemma2_softcap_f32", "tests/fixtures/models/gemma2_softcap_f32"};
const Case kGemma3{"gemma3_text_bf16", "tests/fixtures/models/gemma3_text_bf16"};
const Case kPhi3{"phi3_fused_f32", "tests/fixtures/models/phi3_fused_f32"};
// SmolLM2: a training step takes ~5 s on 2 CPU threads (the backward through frozen Q4_1
// weights runs the reference matmul), so the AdamW test runs 10 of the fixture's 50 steps.
const Case kSmolLm2{"smollm2", ".kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf", 10};
const Case kLlamaRecompute{"llama_gqa_f32", "tests/fixtures/models/llama_gqa_f32", 0, true};
const Case kSmolLm2Recompute{"smollm2", ".kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf", 0, true};
const Case kLlamaDropout{kLlama.name, kLlama.model_path, 0, false,
                         "lora_dropout_grads.safetensors"};
const Case kQwen2Dropout{kQwen2.name, kQwen2.model_path, 0, false,
                         "lora_dropout_grads.safetensors"};
const Case kLlamaDropoutRecompute{kLlama.name, kLlama.model_path, 0, true,
                                  "lora_dropout_grads.safetensors"};
auto CaseName = [](const auto& info) { return info.param.label(); };

class TrainerGradientTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerGradientTest, LossAndEveryLoraGradientEqualPyTorchPeft) {
  const Case& c = GetParam();
  auto fixture = OpenFixture(c.name, c.file);
  const SafetensorsFile& f = *fixture;
  const double want_loss = std::stod(f.metadata().at("loss"));
  auto parts = OpenModel(c.model_path);
  ASSERT_TRUE(parts.ok()) << parts.status();
  const LlmHParams hp = parts->hparams;
  const bool gguf_qk = GgufQkRows(*parts);
  TrainerOptions opts = LoraOptions(f);
  opts.recompute = c.recompute;
  if (f.metadata().contains("dropout")) {
    opts.lora.dropout = std::stod(f.metadata().at("dropout"));
    opts.seed = std::stoull(f.metadata().at("seed"));
  }
  const int64_t r = opts.lora.r;
  auto trainer = Trainer::Create(*std::move(parts), opts);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Trainer& t = **trainer;
  // On cpu attention trains through the fused op and its attention_backward kernel, so these
  // gradients check that path against PyTorch.
  EXPECT_TRUE(t.fused_attention());
  ASSERT_TRUE(t.ImportAdapter(FormulaAdapter(t, gguf_qk, /*zero_b=*/false)).ok());
  const TrainBatch batch = BatchOf(f);

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
      got = PermuteRows(got, suffix == "attn_q" ? hp.num_heads : hp.num_kv_heads, r,
                        /*to_gguf=*/false);
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

INSTANTIATE_TEST_SUITE_P(Models, TrainerGradientTest,
                         ::testing::Values(kLlama, kQwen2, kGpt2, kGemma2, kGemma3, kPhi3, kSmolLm2,
                                           kLlamaRecompute, kSmolLm2Recompute, kLlamaDropout,
                                           kQwen2Dropout, kLlamaDropoutRecompute),
                         CaseName);

// Dropout is training only: Evaluate and Logits run the adapter as PEFT's eval mode does (no
// mask), so they equal those of a trainer without dropout; Gradients and Step apply it.
TEST(TrainerDropoutTest, OnlyTrainingStepsDropOut) {
  auto fixture = OpenFixture(kLlama.name, "lora_dropout_grads.safetensors");
  const SafetensorsFile& f = *fixture;
  const TrainBatch batch = BatchOf(f);
  std::unique_ptr<Trainer> t[2];
  for (int i = 0; i < 2; ++i) {
    auto parts = OpenModel(kLlama.model_path);
    ASSERT_TRUE(parts.ok()) << parts.status();
    TrainerOptions opts = LoraOptions(f);
    opts.lora.dropout = i == 0 ? 0.0 : 0.25;
    auto trainer = Trainer::Create(*std::move(parts), opts);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    t[i] = *std::move(trainer);
    ASSERT_TRUE(t[i]->ImportAdapter(FormulaAdapter(*t[i], false, /*zero_b=*/false)).ok());
  }
  auto e0 = t[0]->Evaluate(batch), e1 = t[1]->Evaluate(batch);
  ASSERT_TRUE(e0.ok() && e1.ok());
  EXPECT_EQ(e1->loss, e0->loss);
  auto l0 = t[0]->Logits(batch), l1 = t[1]->Logits(batch);
  ASSERT_TRUE(l0.ok() && l1.ok());
  EXPECT_EQ(*l1, *l0);
  std::map<std::string, std::vector<float>> g0, g1;
  auto r0 = t[0]->Gradients(batch, &g0), r1 = t[1]->Gradients(batch, &g1);
  ASSERT_TRUE(r0.ok() && r1.ok());
  EXPECT_NE(r1->loss, r0->loss);
  EXPECT_NEAR(r1->loss, std::stod(f.metadata().at("loss")), 1e-4 * r1->loss);
  // Each step draws new masks: two steps on the same batch from the same adapter differ from
  // two steps of a run with another seed only through the masks.
  auto s1 = t[1]->Step(batch, 1e-3);
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_NEAR(s1->loss, r1->loss, 1e-6 * r1->loss);  // step 1's masks are Gradients' masks
  auto s2 = t[1]->Step(batch, 1e-3);
  ASSERT_TRUE(s2.ok()) << s2.status();
  auto e2 = t[1]->Evaluate(batch);
  ASSERT_TRUE(e2.ok());
  EXPECT_NE(s2->loss, e2->loss);
}

// Recomputation changes where activations come from, not what they are: the same loss,
// gradients and optimizer step from a smaller step arena. Bit for bit without fusion; with it,
// to float rounding: a forward value the backward no longer reads may fuse into its forward
// consumer (a GEMM epilogue, a longer map), which rounds differently.
TEST(TrainerRecomputeTest, SameStepFromASmallerArena) {
  auto fixture = OpenFixture(kLlama.name, "lora_grads.safetensors");
  const SafetensorsFile& f = *fixture;
  const char* saved = std::getenv("KILN_FUSE");
  const std::string saved_value = saved != nullptr ? saved : "";
  for (const bool fuse : {false, true}) {
    SCOPED_TRACE(fuse ? "fused" : "unfused");
    setenv("KILN_FUSE", fuse ? "1" : "0", 1);
    std::unique_ptr<Trainer> t[2];
    std::map<std::string, std::vector<float>> grads[2], params[2];
    double loss[2] = {0, 0};
    const TrainBatch batch = BatchOf(f);
    for (int i = 0; i < 2; ++i) {
      auto parts = OpenModel(kLlama.model_path);
      ASSERT_TRUE(parts.ok()) << parts.status();
      TrainerOptions opts = LoraOptions(f);
      opts.recompute = i == 1;
      auto trainer = Trainer::Create(*std::move(parts), opts);
      ASSERT_TRUE(trainer.ok()) << trainer.status();
      t[i] = *std::move(trainer);
      ASSERT_TRUE(t[i]->ImportAdapter(FormulaAdapter(*t[i], false, /*zero_b=*/false)).ok());
      auto g = t[i]->Gradients(batch, &grads[i]);
      ASSERT_TRUE(g.ok()) << g.status();
      auto s = t[i]->Step(batch, 1e-2);
      ASSERT_TRUE(s.ok()) << s.status();
      loss[i] = s->loss;
      for (const TrainableTensor& tt : t[i]->trainable()) params[i][tt.name] = *t[i]->Read(tt.name);
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

// Target modules resolve per architecture: GPT-2's "mlp.c_proj" is its MLP output alone,
// "c_proj" both projections of that name, and a llama module name is an error that lists
// GPT-2's.
TEST(TrainerLoraModulesTest, Gpt2TargetsByNameAndPath) {
  auto trainable = [](std::vector<std::string> targets) -> StatusOr<std::vector<std::string>> {
    KILN_ASSIGN_OR_RETURN(PagedLlmParts parts, OpenModel(kGpt2.model_path));
    TrainerOptions opts;
    opts.lora.target_modules = std::move(targets);
    opts.batch_size = 1;
    opts.seq_len = 8;
    KILN_ASSIGN_OR_RETURN(auto t, Trainer::Create(std::move(parts), opts));
    std::vector<std::string> names;
    for (const TrainableTensor& x : t->trainable()) {
      if (x.name.ends_with(".lora_A")) names.push_back(x.name);
    }
    return names;
  };
  EXPECT_EQ(*trainable({"mlp.c_proj"}),
            (std::vector<std::string>{"blk.0.ffn_down.lora_A", "blk.1.ffn_down.lora_A"}));
  EXPECT_EQ(trainable({"c_proj"})->size(), 4u);  // attn_output and ffn_down of 2 layers
  EXPECT_EQ(trainable({"all-linear"})->size(), 8u);
  auto bad = trainable({"q_proj"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(StatusMessage(bad.status())
                .find("unknown LoRA target module 'q_proj' for architecture gpt2; allowed: "
                      "c_attn attn.c_proj c_fc mlp.c_proj, or all-linear"),
            std::string::npos)
      << bad.status();
}

// Full fine-tuning: every weight (embedding, norms, projections, LM head) is an f32 master
// copy; its gradient by GGUF name equals PyTorch's of the Hugging Face parameter.
// The chunked classifier (3 chunks of rows, the last one partial) against one fused
// cross-entropy over all logits, differentiated by autograd: the same loss and d x, and for a
// trainable W (a State, as in full fine-tuning) the same d W (summed over the chunks).
TEST(ChunkedClassifierTest, EqualsTheWholeHeadDifferentiated) {
  std::unique_ptr<backend::Backend> cpu = backend::MakeCpuBackend(2);
  backend::Device& dev = *cpu->device(0);
  const int64_t rows = 600, C = 24, V = 97;
  std::vector<double> xv(rows * C), wv(V * C), tv(rows);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = std::sin(0.37 * static_cast<double>(i));
  for (size_t i = 0; i < wv.size(); ++i) wv[i] = std::cos(0.11 * static_cast<double>(i));
  for (int64_t i = 0; i < rows; ++i) tv[i] = i % 7 == 3 ? -100 : (i * 31) % V;
  for (bool trainable : {false, true}) {
    std::vector<std::vector<double>> got[2];
    for (int chunked = 0; chunked < 2; ++chunked) {
      Graph g;
      Builder b(&g);
      const Value x = b.Input("x", DType::kF32, {rows, C});
      const Value w =
          trainable ? b.State("w", DType::kF32, {V, C}) : b.Weight("w", DType::kF32, {V, C});
      const Value targets = b.Input("targets", DType::kI32, {rows});
      const Value dloss = b.Full(0.25, DType::kF32, {});
      const Value logits = b.Linear(x, w);
      std::vector<Value> outs;
      if (chunked) {
        const ClassifierOutputs h = ChunkedClassifier(b, logits, targets, dloss);
        ASSERT_EQ(h.input.id, x.id);
        ASSERT_EQ(h.dweight.valid(), trainable);
        outs = {h.loss, h.dinput};
        if (trainable) outs.push_back(h.dweight);
        int heads = 0;
        for (int32_t i = 0; i < g.size(); ++i) heads += g.node(i).op == OpKind::kFusedCrossEntropy;
        EXPECT_EQ(heads, 3);
      } else {
        const CrossEntropyOutputs ce = b.FusedCrossEntropy(logits, targets, dloss);
        const Value wrt[] = {x, w};
        const Value seeds[] = {ce.dlogits};
        const Value of[] = {logits};
        auto gr = Gradients(b, of, seeds, wrt);
        ASSERT_TRUE(gr.ok()) << gr.status();
        outs = {ce.loss, (*gr)[0]};
        if (trainable) outs.push_back((*gr)[1]);
      }
      ASSERT_TRUE(b.ok()) << b.status();
      auto p = Compile(g, outs, dev);
      ASSERT_TRUE(p.ok()) << p.status();
      auto stream = dev.CreateStream();
      ASSERT_TRUE(stream.ok());
      ASSERT_TRUE((*p)->Bind("x", *Tensor::FromDoubles(dev, DType::kF32, {rows, C}, xv)).ok());
      ASSERT_TRUE((*p)->Bind("w", *Tensor::FromDoubles(dev, DType::kF32, {V, C}, wv)).ok());
      ASSERT_TRUE((*p)->Bind("targets", *Tensor::FromDoubles(dev, DType::kI32, {rows}, tv)).ok());
      ASSERT_TRUE((*p)->Run(**stream).ok());
      for (size_t i = 0; i < outs.size(); ++i) {
        got[chunked].push_back(*(*p)->Output(static_cast<int>(i))->ToDoubles());
      }
    }
    const char* names[] = {"loss", "dx", "dw"};
    ASSERT_EQ(got[0].size(), got[1].size());
    for (size_t i = 0; i < got[0].size(); ++i) {
      ASSERT_EQ(got[0][i].size(), got[1][i].size()) << names[i];
      double scale = 0, diff = 0;
      for (size_t j = 0; j < got[0][i].size(); ++j) {
        scale = std::max(scale, std::fabs(got[0][i][j]));
        diff = std::max(diff, std::fabs(got[0][i][j] - got[1][i][j]));
      }
      EXPECT_GT(scale, 1e-3) << names[i];
      EXPECT_LE(diff, 1e-5 * scale) << names[i] << (trainable ? " (trainable W)" : " (frozen W)");
    }
  }
}

TEST(TrainerFullTest, EveryWeightGradientEqualsPyTorch) {
  auto fixture = OpenFixture(kLlama.name, "full_grads.safetensors");
  const SafetensorsFile& f = *fixture;
  const double want_loss = std::stod(f.metadata().at("loss"));
  auto parts = OpenModel(kLlama.model_path);
  ASSERT_TRUE(parts.ok()) << parts.status();
  TrainerOptions opts;
  opts.method = TrainerOptions::Method::kFull;
  opts.batch_size = std::stoll(f.metadata().at("rows"));
  opts.seq_len = std::stoll(f.metadata().at("seq"));
  auto trainer = Trainer::Create(*std::move(parts), opts);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  std::map<std::string, std::vector<float>> grads;
  auto res = (*trainer)->Gradients(BatchOf(f), &grads);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_NEAR(res->loss, want_loss, 1e-5 * std::fabs(want_loss));
  double worst = 0;
  std::string worst_name;
  for (const auto& [name, g] : grads) {
    const SafetensorsTensor* ref = f.Find(name + ".grad");
    ASSERT_NE(ref, nullptr) << name << " has no PyTorch gradient";
    ASSERT_EQ(g.size(), ref->n_elements) << name;
    const double err = RelativeError(g, FloatsOf(*ref));
    EXPECT_LE(err, 1e-4) << name;
    if (err > worst) worst = err, worst_name = name;
  }
  // Every parameter PyTorch has, and nothing else.
  EXPECT_EQ(grads.size(), f.tensors().size() - 4);
  std::printf(
      "full fine-tuning: loss %.6f (PyTorch %.6f), %zu gradients, worst relative error "
      "%.2e (%s)\n",
      res->loss, want_loss, grads.size(), worst, worst_name.c_str());
}

// 50 steps of AdamW (clipping at global norm 1.0) from A = formula, B = 0, on the fixture's
// batches: each step's loss (computed before its update) within 1% of PyTorch + PEFT's.
class TrainerAdamWTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerAdamWTest, FiftyStepsFollowPyTorch) {
  const Case& c = GetParam();
  auto fixture = OpenFixture(c.name, "adamw_steps.safetensors");
  const SafetensorsFile& f = *fixture;
  const std::vector<double> want = JsonDoubles(f, "losses");
  const std::vector<double> want_norm = JsonDoubles(f, "grad_norms");
  const std::vector<double> base = JsonDoubles(f, "base_losses");
  const double lr = std::stod(f.metadata().at("lr"));
  auto parts = OpenModel(c.model_path);
  ASSERT_TRUE(parts.ok()) << parts.status();
  const bool gguf_qk = GgufQkRows(*parts);
  TrainerOptions opts = LoraOptions(f);
  opts.optimizer = DefaultOptimizerParams(OptimizerKind::kAdamW);  // betas 0.9/0.999, eps 1e-8
  opts.optimizer.weight_decay = 0.01;
  opts.max_grad_norm = 1.0;
  auto trainer = Trainer::Create(*std::move(parts), opts);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Trainer& t = **trainer;
  ASSERT_TRUE(t.ImportAdapter(FormulaAdapter(t, gguf_qk, /*zero_b=*/true)).ok());
  const size_t steps = c.steps > 0 ? static_cast<size_t>(c.steps) : want.size();
  double worst = 0, worst_norm = 0, last = 0;
  for (size_t i = 0; i < steps; ++i) {
    auto r = t.Step(BatchOf(f, static_cast<int64_t>(i)), lr);
    ASSERT_TRUE(r.ok()) << r.status();
    const double err = std::fabs(r->loss - want[i]) / want[i];
    EXPECT_LE(err, 0.01) << "step " << i + 1 << ": loss " << r->loss << ", PyTorch " << want[i];
    worst = std::max(worst, err);
    if (i == 0 || (i + 1) % 5 == 0) std::printf("step %zu: relative loss error %.2e\n", i + 1, err);
    worst_norm = std::max(worst_norm, std::fabs(r->grad_norm - want_norm[i]) / want_norm[i]);
    last = r->loss;
  }
  // The steps must matter: training moved the last loss far more than the tolerance.
  EXPECT_LT(last, 0.9 * base[steps - 1]);
  std::printf(
      "%s: %zu AdamW steps, loss %.4f -> %.4f (PyTorch %.4f -> %.4f; untrained %.4f), "
      "worst relative loss error %.2e, grad norm %.2e\n",
      c.name.c_str(), steps, want.front(), last, want.front(), want[steps - 1], base[steps - 1],
      worst, worst_norm);
}

INSTANTIATE_TEST_SUITE_P(Models, TrainerAdamWTest, ::testing::Values(kLlama, kSmolLm2), CaseName);

// Steps 1-20, a checkpoint through the real files (adapter in PEFT layout, optimizer state,
// trainer state), then steps 21-50 on a fresh Trainer: the same losses and adapter as 50
// uninterrupted steps, bit for bit (same kernels, same order of operations).
TEST(TrainerResumeTest, CheckpointAfterStep20ResumesBitForBit) {
  auto fixture = OpenFixture(kLlama.name, "adamw_steps.safetensors");
  const SafetensorsFile& f = *fixture;
  const double lr = std::stod(f.metadata().at("lr"));
  const int64_t steps = std::stoll(f.metadata().at("steps")), split = 20;
  TrainerOptions opts = LoraOptions(f);
  auto make = [&](bool init) -> std::unique_ptr<Trainer> {
    auto parts = OpenModel(kLlama.model_path);
    KILN_CHECK(parts.ok(), "the fixture model opens");
    auto t = Trainer::Create(*std::move(parts), opts);
    KILN_CHECK(t.ok(), "the trainer builds");
    if (init) KILN_CHECK((*t)->ImportAdapter(FormulaAdapter(**t, false, true)).ok(), "import");
    return *std::move(t);
  };
  auto run = [&](Trainer& t, int64_t from, int64_t to, std::vector<double>* losses) {
    for (int64_t i = from; i < to; ++i) {
      auto r = t.Step(BatchOf(f, i), lr);
      ASSERT_TRUE(r.ok()) << r.status();
      losses->push_back(r->loss);
    }
  };
  std::vector<double> straight, resumed;
  auto a = make(true);
  run(*a, 0, steps, &straight);

  auto b = make(true);
  run(*b, 0, split, &resumed);
  Checkpoint ckpt;
  ckpt.state.step = b->step();
  for (int64_t i = 0; i < split; ++i) ckpt.state.losses.push_back({i + 1, resumed[i]});
  auto adapter = b->ExportAdapter();
  ASSERT_TRUE(adapter.ok()) << adapter.status();
  ckpt.adapter = *adapter;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const TrainableTensor& t : b->trainable()) shapes[t.name] = t.shape;
  for (auto& [name, v] : b->OptimizerState()) {
    ckpt.optimizer[name] = {shapes.at(name.substr(0, name.size() - 2)), std::move(v)};
  }
  ASSERT_EQ(ckpt.optimizer.size(), 2 * b->trainable().size());
  b.reset();
  const PeftBaseModel base = PeftBaseModel::FromHParams(a->parts().hparams, kLlama.name);
  const std::string out = TempDir("resume");
  auto dir = WriteCheckpoint(out, ckpt, base);
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto loaded = LoadCheckpoint(*dir, base);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->adapter.has_value());

  auto c = make(false);
  ASSERT_TRUE(c->ImportAdapter(*loaded->adapter).ok());
  std::map<std::string, std::vector<float>> state;
  for (auto& [name, t] : loaded->optimizer) state[name] = t.data;
  ASSERT_TRUE(c->SetOptimizerState(state, loaded->state.step).ok());
  run(*c, split, steps, &resumed);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_EQ(resumed[i], straight[i]) << "step " << i + 1;
  }
  for (const TrainableTensor& t : a->trainable()) {
    EXPECT_EQ(*c->Read(t.name), *a->Read(t.name)) << t.name;
  }
  EXPECT_EQ(c->step(), steps);
  std::filesystem::remove_all(out);
}

// Row `row` of `batch` as a batch of one row.
TrainBatch RowOf(const TrainBatch& batch, int64_t row) {
  TrainBatch one;
  one.rows = 1;
  one.seq_len = batch.seq_len;
  const auto at = static_cast<size_t>(row * batch.seq_len);
  auto slice = [&](const std::vector<int32_t>& v) {
    return std::vector<int32_t>(v.begin() + at, v.begin() + at + batch.seq_len);
  };
  one.tokens = slice(batch.tokens);
  one.targets = slice(batch.targets);
  one.positions = slice(batch.positions);
  one.doc_ids = slice(batch.doc_ids);
  one.target_count = std::count_if(one.targets.begin(), one.targets.end(),
                                   [](int32_t t) { return t != train::kIgnoreIndex; });
  return one;
}

// Gradient accumulation: 10 AdamW steps (clipping at 1.0), each over the fixture batch's rows
// as one-row micro-batches (plus one that counts no token), give the losses, gradient norms
// and parameters of the same steps on the whole batch (which TrainerAdamWTest checks against
// PyTorch + PEFT): the loss is normalised by the step's tokens, as transformers does. LoRA
// and full fine-tuning.
class TrainerAccumulationTest : public ::testing::TestWithParam<TrainerOptions::Method> {};

TEST_P(TrainerAccumulationTest, MicroBatchesGiveTheWholeBatchStep) {
  auto fixture = OpenFixture(kLlama.name, "adamw_steps.safetensors");
  const SafetensorsFile& f = *fixture;
  const double lr = std::stod(f.metadata().at("lr"));
  const bool full = GetParam() == TrainerOptions::Method::kFull;
  auto make = [&](int64_t rows) {
    TrainerOptions opts = LoraOptions(f);
    opts.method = GetParam();
    opts.batch_size = rows;
    opts.optimizer = DefaultOptimizerParams(OptimizerKind::kAdamW);
    opts.max_grad_norm = 1.0;
    auto parts = OpenModel(kLlama.model_path);
    KILN_CHECK(parts.ok(), "the fixture model opens");
    auto t = Trainer::Create(*std::move(parts), opts);
    KILN_CHECK(t.ok(), "the trainer builds");
    if (!full) {
      KILN_CHECK((*t)->ImportAdapter(FormulaAdapter(**t, false, true)).ok(), "import");
    }
    return *std::move(t);
  };
  auto whole = make(std::stoll(f.metadata().at("rows")));
  auto micro = make(1);
  double worst_loss = 0, worst_norm = 0;
  for (int64_t i = 0; i < 10; ++i) {
    const TrainBatch batch = BatchOf(f, i);
    std::vector<TrainBatch> parts;
    for (int64_t row = 0; row < batch.rows; ++row) parts.push_back(RowOf(batch, row));
    TrainBatch nothing = parts.back();
    std::fill(nothing.targets.begin(), nothing.targets.end(), train::kIgnoreIndex);
    nothing.target_count = 0;
    parts.push_back(nothing);
    auto a = whole->Step(batch, lr);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = micro->Step(parts, lr);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->tokens, a->tokens);
    worst_loss = std::max(worst_loss, std::fabs(b->loss - a->loss) / a->loss);
    worst_norm = std::max(worst_norm, std::fabs(b->grad_norm - a->grad_norm) / a->grad_norm);
  }
  EXPECT_LE(worst_loss, 1e-5);
  EXPECT_LE(worst_norm, 1e-4);
  EXPECT_EQ(micro->step(), 10);
  double worst_param = 0;
  for (const TrainableTensor& t : whole->trainable()) {
    worst_param = std::max(worst_param, RelativeError(*micro->Read(t.name), *whole->Read(t.name)));
  }
  // Adam's steps are about lr * sign(g): rounding differences in tiny gradients amplify.
  EXPECT_LE(worst_param, 1e-5);
  std::printf(
      "%s, 10 steps over 3 micro-batches vs the whole batch: worst relative difference "
      "%.2e (loss), %.2e (grad norm), %.2e (parameters)\n",
      full ? "full" : "lora", worst_loss, worst_norm, worst_param);

  // Bad micro-batches: the step is refused, nothing changes.
  const std::vector<float> before = *micro->Read(micro->trainable()[0].name);
  TrainBatch empty = RowOf(BatchOf(f, 0), 0);
  std::fill(empty.targets.begin(), empty.targets.end(), train::kIgnoreIndex);
  const TrainBatch empties[] = {empty, empty};
  auto r = micro->Step(empties, lr);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("no counted token"));
  const TrainBatch wrong[] = {RowOf(BatchOf(f, 0), 0), BatchOf(f, 0)};
  r = micro->Step(wrong, lr);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("micro-batch 2"));
  EXPECT_EQ(*micro->Read(micro->trainable()[0].name), before);
  EXPECT_EQ(micro->step(), 10);
}

INSTANTIATE_TEST_SUITE_P(Methods, TrainerAccumulationTest,
                         ::testing::Values(TrainerOptions::Method::kLora,
                                           TrainerOptions::Method::kFull),
                         [](const auto& info) {
                           return info.param == TrainerOptions::Method::kFull ? "full" : "lora";
                         });

// The fixture's adapter written as PEFT files (WritePeftAdapter: q/k rows to Hugging Face's
// order), read back (ReadPeftAdapter) and imported: Kiln's logits equal those of Python PEFT
// with the same adapter on the same base model, on every token of the batch (a sample of 256
// vocabulary columns, and the log-sum-exp over all of them).
class TrainerPeftLogitsTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerPeftLogitsTest, AdapterFilesGivePeftLogits) {
  const Case& c = GetParam();
  auto fixture = OpenFixture(c.name, "peft_logits.safetensors");
  const SafetensorsFile& f = *fixture;
  auto parts = OpenModel(c.model_path);
  ASSERT_TRUE(parts.ok()) << parts.status();
  const bool gguf_qk = GgufQkRows(*parts);
  const PeftBaseModel base = PeftBaseModel::FromHParams(parts->hparams, c.name);
  const int64_t V = parts->hparams.vocab_size;
  auto trainer = Trainer::Create(*std::move(parts), LoraOptions(f));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Trainer& t = **trainer;
  const LoraAdapter adapter = FormulaAdapter(t, gguf_qk, /*zero_b=*/false);
  const std::string dir = TempDir("peft_" + c.name);
  ASSERT_TRUE(WritePeftAdapter(dir, adapter, base).ok());
  auto back = ReadPeftAdapter(dir, base);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->layers.size(), adapter.layers.size());
  ASSERT_TRUE(t.ImportAdapter(*back).ok());
  std::filesystem::remove_all(dir);

  const TrainBatch batch = BatchOf(f);
  auto logits = t.Logits(batch);
  ASSERT_TRUE(logits.ok()) << logits.status();
  ASSERT_EQ(static_cast<int64_t>(logits->size()), batch.rows * batch.seq_len * V);
  const std::vector<int32_t> columns = IntsOf(*f.Find("columns"));
  const std::vector<float> want = FloatsOf(*f.Find("logits"));
  const std::vector<float> want_lse = FloatsOf(*f.Find("logsumexp"));
  std::vector<float> got, got_lse, ref, ref_lse;
  double max_diff = 0;
  for (int64_t i = 0; i < batch.rows * batch.seq_len; ++i) {
    if (batch.doc_ids[i] < 0) continue;  // padding: not a token of any example
    const float* row = logits->data() + i * V;
    for (size_t j = 0; j < columns.size(); ++j) {
      got.push_back(row[columns[j]]);
      ref.push_back(want[i * columns.size() + j]);
      max_diff = std::max(max_diff, std::fabs(double{got.back()} - ref.back()));
    }
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double{row[v]});
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
    got_lse.push_back(static_cast<float>(mx + std::log(sum)));
    ref_lse.push_back(want_lse[i]);
  }
  const double err = RelativeError(got, ref), lse_err = RelativeError(got_lse, ref_lse);
  EXPECT_LE(err, 1e-4);
  EXPECT_LE(lse_err, 1e-4);
  std::printf(
      "%s: logits of %zu tokens x %zu columns, relative error %.2e (max |diff| %.2e), "
      "log-sum-exp %.2e\n",
      c.name.c_str(), got_lse.size(), columns.size(), err, max_diff, lse_err);
}

INSTANTIATE_TEST_SUITE_P(Models, TrainerPeftLogitsTest, ::testing::Values(kLlama, kGpt2, kSmolLm2),
                         CaseName);

// Trains a step on the lora_grads batch from A = formula, B = 0, writes the adapter as PEFT
// files and Kiln's logits of that batch beside it, and checks
// that a fresh Trainer given the files computes the same logits. With KILN_PEFT_EXPORT_DIR set
// the files stay in $KILN_PEFT_EXPORT_DIR/<model>/ for the manual check with Python PEFT:
//   make_training_fixtures.py --check-kiln $KILN_PEFT_EXPORT_DIR/<model>
class TrainerExportTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrainerExportTest, ExportsAdapterThatReloads) {
  const Case& c = GetParam();
  auto fixture = OpenFixture(c.name, "lora_grads.safetensors");
  const SafetensorsFile& f = *fixture;
  const double lr = 1e-3;
  const char* keep = std::getenv("KILN_PEFT_EXPORT_DIR");
  const std::string dir =
      keep != nullptr && *keep != '\0' ? Cat(keep, "/", c.name) : TempDir("export_" + c.name);
  auto make = [&](bool init) -> std::unique_ptr<Trainer> {
    auto parts = OpenModel(c.model_path);
    KILN_CHECK(parts.ok(), "the fixture model opens");
    const bool gguf_qk = GgufQkRows(*parts);
    auto t = Trainer::Create(*std::move(parts), LoraOptions(f));
    KILN_CHECK(t.ok(), "the trainer builds");
    if (init) KILN_CHECK((*t)->ImportAdapter(FormulaAdapter(**t, gguf_qk, true)).ok(), "import");
    return *std::move(t);
  };
  auto trained = make(true);
  const TrainBatch batch = BatchOf(f);
  ASSERT_TRUE(trained->Step(batch, lr).ok());  // B moves off zero
  const PeftBaseModel base = PeftBaseModel::FromHParams(trained->parts().hparams, c.name);
  ASSERT_TRUE(WritePeftAdapter(dir, *trained->ExportAdapter(), base).ok());
  auto want = trained->Logits(batch);
  ASSERT_TRUE(want.ok()) << want.status();

  auto fresh = make(false);
  auto adapter = ReadPeftAdapter(dir, base);
  ASSERT_TRUE(adapter.ok()) << adapter.status();
  ASSERT_TRUE(fresh->ImportAdapter(*adapter).ok());
  auto got = fresh->Logits(batch);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, *want);

  SafetensorsWriter st;
  st.SetMetadata("model", c.name);
  st.SetMetadata("rows", std::to_string(batch.rows));
  st.SetMetadata("seq", std::to_string(batch.seq_len));
  const int64_t T = batch.rows * batch.seq_len;
  for (const auto& [name, v] : {std::pair{"tokens", &batch.tokens},
                                {"targets", &batch.targets},
                                {"positions", &batch.positions},
                                {"doc_ids", &batch.doc_ids}}) {
    ASSERT_TRUE(st.Add(name, SafetensorsDtype::kI32, {T}, v->data(), v->size() * 4).ok());
  }
  ASSERT_TRUE(st.AddFloats("logits", {T, static_cast<int64_t>(want->size()) / T}, want->data(),
                           want->size())
                  .ok());
  ASSERT_TRUE(st.WriteFile(dir + "/kiln_logits.safetensors").ok());
  if (keep == nullptr || *keep == '\0') {
    std::filesystem::remove_all(dir);
  } else {
    std::printf("%s: adapter and logits in %s\n", c.name.c_str(), dir.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Models, TrainerExportTest, ::testing::Values(kLlama, kGpt2, kSmolLm2),
                         CaseName);

}  // namespace
}  // namespace kiln::models
