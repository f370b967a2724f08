// LoadLlm's errors on bad model files and configurations, and PagedLlm's contract: step
// validation, compiled bounds, and captured (replayed) decode steps equal to direct runs.
// Models: the random-weight fixtures (tests/fixtures/models/), copied and damaged per test.
#include "models/llm/loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "backends/builtin.h"
#include "backends/cpu/kernels/isa.h"
#include "backends/cpu/kernels/kernels.h"
#include "models/gguf/gguf_test_util.h"
#include "models/io/test_paths.h"
#include "models/llm/model_files.h"
#include "models/llm/paged_llm.h"
#include "models/llm/testing/greedy_driver.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

config::ModelConfig ConfigFor(const std::string& path) {
  config::ModelConfig c;
  c.name = "m";
  c.kind = "llm";
  c.path = path;
  c.threads = 1;
  c.scheduler.max_num_seqs = 4;
  c.scheduler.max_num_batched_tokens = 32;
  c.scheduler.capture_batch_sizes = {1, 2, 4};
  return c;
}

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("kiln_loader_test_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::copy(testing::FixturePath("models/llama_gqa_f32"), dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void EditConfig(const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j;
    std::ifstream(dir_ / "config.json") >> j;
    edit(j);
    std::ofstream(dir_ / "config.json") << j.dump(1);
  }
  std::string LoadError(config::ModelConfig c) {
    auto m = LoadLlm(c);
    EXPECT_FALSE(m.ok());
    return m.ok() ? "" : std::string(StatusMessage(m.status()));
  }
  std::string LoadError() { return LoadError(ConfigFor(dir_.string())); }

  fs::path dir_;
};

TEST_F(LoaderTest, LoadsTheFixture) {
  auto m = LoadPagedLlm(ConfigFor(dir_.string()));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->info().architecture, "llama");
  EXPECT_EQ((*m)->hparams().num_kv_heads * 2, (*m)->hparams().num_heads);  // GQA
  EXPECT_GT((*m)->mapped_weight_bytes(), 0);  // f32 safetensors: zero-copy
}

// A config's `attention:` section replaces the model's modifiers, and the cpu kernels run them
// as the reference backend does: chunks of 4 with a soft-cap of 2, and a window of 3 with ALiBi,
// on the Llama fixture; greedy continuations and every logit compared over chunked prefill and
// decode.
TEST_F(LoaderTest, AttentionFromTheConfigRunsOnCpuAsOnTheReference) {
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 300, 42, 7, 9, 81, 1000, 3, 12},
                                                     {64, 2, 19}};
  // The first logits of prompt 0 with the model's own attention (plain causal).
  std::vector<float> plain;
  {
    auto m = LoadPagedLlm(ConfigFor(dir_.string()));
    ASSERT_TRUE(m.ok()) << m.status();
    testing::GreedyOptions opt;
    opt.max_new_tokens = 1;
    opt.on_logits = [&](size_t seq, int32_t, std::span<const float> l) {
      if (seq == 0) plain.assign(l.begin(), l.end());
    };
    ASSERT_TRUE(testing::RunGreedy(**m, prompts, opt).ok());
  }
  config::AttentionConfig settings[2];
  settings[0].mask = "chunked";
  settings[0].chunk = 4;
  settings[0].score = "softcap";
  settings[0].softcap = 2;
  settings[1].mask = "sliding_window";
  settings[1].window = 3;
  settings[1].score = "alibi";
  for (const config::AttentionConfig& a : settings) {
    SCOPED_TRACE(a.mask + " " + a.score);
    std::vector<std::vector<float>> logits[2];
    std::vector<std::vector<int32_t>> generated[2];
    for (int i = 0; i < 2; ++i) {
      config::ModelConfig c = ConfigFor(dir_.string());
      c.backend = i == 0 ? "ref" : "cpu";
      c.attention = a;
      auto m = LoadPagedLlm(c);
      ASSERT_TRUE(m.ok()) << m.status();
      testing::GreedyOptions opt;
      opt.max_new_tokens = 8;
      opt.max_step_tokens = 5;  // prefill chunks that straddle the attention chunks
      opt.on_logits = [&](size_t, int32_t, std::span<const float> l) {
        logits[i].emplace_back(l.begin(), l.end());
      };
      auto r = testing::RunGreedy(**m, prompts, opt);
      ASSERT_TRUE(r.ok()) << r.status();
      generated[i] = r->generated;
    }
    EXPECT_EQ(generated[1], generated[0]);
    ASSERT_EQ(logits[1].size(), logits[0].size());
    double worst = 0;
    for (size_t s = 0; s < logits[0].size(); ++s) {
      for (size_t v = 0; v < logits[0][s].size(); ++v) {
        worst = std::max(worst, std::abs(double(logits[1][s][v]) - logits[0][s][v]));
      }
    }
    EXPECT_LT(worst, 1e-3);
    double moved = 0;  // the section did change the model
    for (size_t v = 0; v < plain.size(); ++v) {
      moved = std::max(moved, std::abs(double(plain[v]) - logits[1][0][v]));
    }
    EXPECT_GT(moved, 1e-2);
  }
}

TEST_F(LoaderTest, UnknownArchitectureListsTheSupportedOnes) {
  EditConfig([](nlohmann::json& j) { j["model_type"] = "bert"; });
  EXPECT_THAT(LoadError(), AllOf(HasSubstr("model 'm'"), HasSubstr("architecture 'bert'"),
                                 HasSubstr("not supported"), HasSubstr("llama")));
}

TEST_F(LoaderTest, NotACausalLm) {
  EditConfig([](nlohmann::json& j) { j["architectures"] = {"LlamaForSequenceClassification"}; });
  EXPECT_THAT(LoadError(), HasSubstr("not a causal language model"));
}

TEST_F(LoaderTest, ShapeMismatchNamesTheTensorAndBothShapes) {
  EditConfig(
      [](nlohmann::json& j) { j["intermediate_size"] = j["intermediate_size"].get<int>() * 2; });
  EXPECT_THAT(LoadError(), AllOf(HasSubstr("has shape"), HasSubstr("hyper-parameters need")));
}

TEST_F(LoaderTest, MissingTensorIsNamed) {
  EditConfig(
      [](nlohmann::json& j) { j["num_hidden_layers"] = j["num_hidden_layers"].get<int>() + 1; });
  EXPECT_THAT(LoadError(), HasSubstr("missing tensor"));
}

TEST_F(LoaderTest, TruncatedWeightsAreRefused) {
  const fs::path st = dir_ / "model.safetensors";
  fs::resize_file(st, fs::file_size(st) / 2);
  EXPECT_THAT(LoadError(), HasSubstr("model.safetensors"));
}

TEST_F(LoaderTest, MissingTokenizerIsRefused) {
  fs::remove(dir_ / "tokenizer.json");
  EXPECT_THAT(LoadError(), HasSubstr("tokenizer.json"));
}

TEST_F(LoaderTest, MissingPathAndUnknownBackend) {
  EXPECT_THAT(LoadError(ConfigFor((dir_ / "nope").string())), HasSubstr("nope"));
  config::ModelConfig c = ConfigFor(dir_.string());
  c.path.clear();
  EXPECT_THAT(LoadError(c), HasSubstr("`path` is required"));
  c = ConfigFor(dir_.string());
  c.backend = "tpu";
  EXPECT_THAT(LoadError(c), HasSubstr("no backend 'tpu'"));
}

TEST_F(LoaderTest, NumericsSettingsAreChecked) {
  config::ModelConfig c = ConfigFor(dir_.string());
  c.activations = "int4";
  EXPECT_THAT(LoadError(c), HasSubstr("activations: int4 is not one of f32, q8, bf16"));
  c.activations = "q8";
  c.backend = "ref";
  EXPECT_THAT(LoadError(c), HasSubstr("activations: q8 is implemented by the cpu backend only"));
  c.activations = "bf16";
  EXPECT_THAT(LoadError(c), HasSubstr("activations: bf16 is implemented by the cpu backend only"));
  c = ConfigFor(dir_.string());
  c.kv_cache_dtype = "f8";
  EXPECT_THAT(LoadError(c), HasSubstr("kv_cache_dtype: f8 is not one of f32, f16, bf16"));
  c.kv_cache_dtype = "bf16";
  c.activations = "q8";
  auto bf16 = LoadPagedLlm(c);  // f32 weights: q8 changes nothing for them, bf16 KV loads
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  c.kv_cache_dtype = "f32";
  auto f32 = LoadPagedLlm(c);
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ((*bf16)->KvBytesPerBlock(16) * 2, (*f32)->KvBytesPerBlock(16));
}

// Q5_0 and Q5_1 (llama-quantize's fallback for rows that are not a multiple of 256 in K-quant
// files, e.g. SmolLM2's Q4_K_M) load as Q8_0: Q5_0 exactly, Q5_1 within Q8_0's rounding.
// A device with no kernels at all (for the sampling-stage probe): counts what it is asked.
class NoKernelsDevice final : public backend::Device {
 public:
  std::string_view name() const override { return "nokernels:0"; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t) override {
    return Unimplemented("no memory");
  }
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
    return Unimplemented("no streams");
  }
  bool SupportsDType(DType) const override { return true; }
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& request) override {
    asked.push_back(request.op);
    return Unimplemented("nokernels:0 has no kernel for ", OpName(request.op));
  }
  std::vector<OpKind> asked;
};

// Whether a model samples in its step program is decided by asking the device for the sample
// kernel alone, before the program compiles (a device that declines it compiles once).
TEST(SamplingStageProbe, AsksTheDeviceForTheSampleKernelOnly) {
  auto cpu = backend::MakeCpuBackend(1);
  EXPECT_TRUE(HasSamplingKernel(*cpu->device(0), 1000).ok());
  NoKernelsDevice none;
  const Status s = HasSamplingKernel(none, 1000);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
  EXPECT_THAT(std::string(StatusMessage(s)), HasSubstr("no kernel for sample"));
  EXPECT_EQ(none.asked, std::vector<OpKind>{OpKind::kSample});
}

TEST(LoaderGgufTest, Q5WeightsLoadAsQ8_0) {
  constexpr int64_t kRows = 3, kCols = 64;
  std::mt19937 rng(5);
  auto blocks = [&](DType t) {
    std::string raw(static_cast<size_t>(DTypeBytes(t, kRows * kCols)), '\0');
    for (char& c : raw) c = static_cast<char>(rng() & 0xFF);
    for (size_t b = 0; b < raw.size(); b += DTypeBlockBytes(t)) {
      const uint16_t d = FloatToF16(0.01f * static_cast<float>(1 + rng() % 100));
      const uint16_t m = FloatToF16(-0.2f);
      std::memcpy(&raw[b], &d, 2);
      if (t == DType::kQ5_1) std::memcpy(&raw[b + 2], &m, 2);
    }
    return raw;
  };
  const std::string q5_0 = blocks(DType::kQ5_0), q5_1 = blocks(DType::kQ5_1);
  testing::GgufBuilder g;
  g.Str("general.architecture", "llama");
  g.Tensor("a", /*Q5_0=*/6, {kCols, kRows}, q5_0).Tensor("b", /*Q5_1=*/7, {kCols, kRows}, q5_1);
  const fs::path path =
      fs::path(::testing::TempDir()) / ("kiln_q5_" + std::to_string(getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary) << g.Build();
  auto files = ModelFiles::Open(path.string());
  ASSERT_TRUE(files.ok()) << files.status();
  auto cpu = backend::MakeCpuBackend(1);
  for (const auto& [name, stored, raw] :
       {std::tuple{"a", DType::kQ5_0, &q5_0}, std::tuple{"b", DType::kQ5_1, &q5_1}}) {
    SCOPED_TRACE(name);
    const WeightInfo* w = (*files)->Find(name);
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->dtype, stored);
    auto t = (*files)->Load(*w, *cpu->device(0), nullptr);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->dtype(), DType::kQ8_0);
    std::vector<float> want(kRows * kCols), got(kRows * kCols);
    ASSERT_TRUE(DequantizeRow(stored, raw->data(), want.data(), kRows * kCols).ok());
    ASSERT_TRUE(DequantizeRow(DType::kQ8_0, t->data(), got.data(), kRows * kCols).ok());
    for (int64_t i = 0; i < kRows * kCols; ++i) {
      if (stored == DType::kQ5_0) {
        ASSERT_EQ(got[i], want[i]) << i;
      } else {
        float amax = 0;  // Q8_0 rounding: half a step of the block's scale
        for (int64_t j = i / 32 * 32; j < i / 32 * 32 + 32; ++j)
          amax = std::max(amax, std::fabs(want[j]));
        ASSERT_NEAR(got[i], want[i], 0.5f * amax / 127 * 1.01f + 1e-6f) << i;
      }
    }
  }
  fs::remove(path);
}

// Projections join into one weight: a view of the file where the parts follow one another
// (llama.cpp writes ffn_gate then ffn_up), otherwise a copy; parts of different types or row
// lengths, or missing ones, do not join.
TEST(LoaderGgufTest, ProjectionsJoinAsAViewWhereAdjacentAndACopyOtherwise) {
  std::mt19937 rng(7);
  auto q8 = [&](int64_t rows, int64_t cols) {
    std::string raw(static_cast<size_t>(DTypeBytes(DType::kQ8_0, rows * cols)), '\0');
    for (char& c : raw) c = static_cast<char>(rng() & 0xFF);
    for (size_t b = 0; b < raw.size(); b += DTypeBlockBytes(DType::kQ8_0)) {
      const uint16_t d = FloatToF16(0.01f);
      std::memcpy(&raw[b], &d, 2);
    }
    return raw;
  };
  // 8 rows of 64 Q8_0 elements: 544 bytes, a multiple of the 32-byte alignment (no padding).
  const std::string gate = q8(8, 64), up = q8(8, 64), k = q8(8, 64), wide = q8(8, 128);
  const std::string between(64, '\1');
  testing::GgufBuilder g;
  g.Str("general.architecture", "llama");
  g.Tensor("gate", /*Q8_0=*/8, {64, 8}, gate)
      .Tensor("up", 8, {64, 8}, up)
      .Tensor("between", /*F32=*/0, {16}, between)
      .Tensor("k", 8, {64, 8}, k)
      .Tensor("wide", 8, {128, 8}, wide)
      .Tensor("f32", 0, {64, 1}, std::string(256, '\0'));
  const fs::path path =
      fs::path(::testing::TempDir()) / ("kiln_join_" + std::to_string(getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary) << g.Build();
  auto opened = ModelFiles::Open(path.string());
  ASSERT_TRUE(opened.ok()) << opened.status();
  ModelFiles& files = **opened;
  const std::vector<std::string> gate_up = {"gate", "up"}, up_k = {"up", "k"};
  ASSERT_TRUE(files.CanConcatenateRows(gate_up));
  ASSERT_TRUE(files.AddConcatenatedRows("gate_up", gate_up).ok());
  const WeightInfo* gu = files.Find("gate_up");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->data, files.Find("gate")->data);  // a view: no copy
  EXPECT_FALSE(gu->copied);
  EXPECT_EQ(gu->shape, (std::vector<int64_t>{16, 64}));
  EXPECT_EQ(gu->dtype, DType::kQ8_0);

  ASSERT_TRUE(files.CanConcatenateRows(up_k));  // "between" separates them: a copy
  ASSERT_TRUE(files.AddConcatenatedRows("up_k", up_k).ok());
  const WeightInfo* uk = files.Find("up_k");
  ASSERT_NE(uk, nullptr);
  EXPECT_TRUE(uk->copied);
  EXPECT_EQ(uk->shape, (std::vector<int64_t>{16, 64}));
  auto cpu = backend::MakeCpuBackend(1);
  auto t = files.Load(*uk, *cpu->device(0), nullptr);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->nbytes(), static_cast<int64_t>(up.size() + k.size()));
  EXPECT_EQ(std::string(static_cast<const char*>(t->data()), up.size()), up);
  EXPECT_EQ(std::string(static_cast<const char*>(t->data()) + up.size(), k.size()), k);

  EXPECT_FALSE(files.CanConcatenateRows(std::vector<std::string>{"gate", "wide"}));  // row lengths
  EXPECT_FALSE(files.CanConcatenateRows(std::vector<std::string>{"gate", "f32"}));   // types
  EXPECT_FALSE(files.CanConcatenateRows(std::vector<std::string>{"gate", "nope"}));  // missing
  EXPECT_FALSE(files.CanConcatenateRows(std::vector<std::string>{}));
  fs::remove(path);
}

// A model whose q|k|v and gate|up are joined computes the same logits, bit for bit, as with
// them apart (each output row is the same dot product), over chunked prefill and decode.
TEST_F(LoaderTest, JoinedProjectionsGiveTheSeparateProjectionsLogitsBitForBit) {
  auto joined = LoadPagedLlm(ConfigFor(dir_.string()));
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_TRUE((*joined)->fused_projections());
  ASSERT_EQ(setenv("KILN_FUSE_PROJECTIONS", "0", 1), 0);
  auto apart = LoadPagedLlm(ConfigFor(dir_.string()));
  unsetenv("KILN_FUSE_PROJECTIONS");
  ASSERT_TRUE(apart.ok()) << apart.status();
  EXPECT_FALSE((*apart)->fused_projections());
  const std::vector<std::vector<int32_t>> prompts = {{1, 5, 9, 14, 3, 7, 22, 8, 2}, {4, 11, 6}};
  auto run = [&](PagedLlm& m, std::vector<std::vector<float>>* logits) {
    testing::GreedyOptions opt;
    opt.max_new_tokens = 6;
    opt.max_step_tokens = 5;  // prefill in chunks, then decode steps
    opt.on_logits = [&](size_t, int32_t, std::span<const float> l) {
      logits->emplace_back(l.begin(), l.end());
    };
    return testing::RunGreedy(m, prompts, opt);
  };
  std::vector<std::vector<float>> want, got;
  auto a = run(**apart, &want);
  auto j = run(**joined, &got);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->generated, a->generated);
  EXPECT_GT(j->replayed_steps, 0);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "logits " << i;
}

// Only projections without biases, not fused by the model itself, in llama-family models join;
// the others load as before. (bf16 safetensors load as bf16: they join too.)
TEST(LoaderFixturesTest, WhichModelsJoinTheirProjections) {
  for (const auto& [fixture, joins] : {std::pair{"llama_gqa_f32", true},
                                       {"llama3_rope_bf16", true},
                                       {"qwen3_qknorm_bf16", true},
                                       {"qwen2_bias_f32", false},
                                       {"phi3_fused_f32", false},
                                       {"gemma2_softcap_f32", false},
                                       {"gpt2_f32", false}}) {
    SCOPED_TRACE(fixture);
    auto m = LoadPagedLlm(ConfigFor(testing::FixturePath(std::string("models/") + fixture)));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ((*m)->fused_projections(), joins);
  }
}

// `activations: bf16` on a bf16 model: where the CPU has AVX-512 BF16, logits near the exact
// ones (x rounded to bf16 before each projection) and the same bits for a sequence whether it
// is prefilled whole and decoded alone or cut into chunks beside another; elsewhere the exact
// path runs, and the logits equal the exact ones.
TEST(LoaderFixturesTest, Bf16ActivationsStayNearExactAndDoNotDependOnTheBatch) {
  const std::vector<int32_t> p0 = {1, 5, 9, 14, 3, 7, 22, 8, 2, 17, 4}, p1 = {4, 11, 6};
  auto run = [](const std::string& activations, const std::vector<std::vector<int32_t>>& prompts,
                int32_t step_tokens) -> std::vector<float> {
    config::ModelConfig c = ConfigFor(testing::FixturePath("models/llama3_rope_bf16"));
    c.threads = 2;
    c.activations = activations;
    auto m = LoadPagedLlm(c);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return {};
    std::vector<float> first;  // the first sequence's logits, step after step
    testing::GreedyOptions opt;
    opt.max_new_tokens = 5;
    opt.max_step_tokens = step_tokens;
    opt.on_logits = [&](size_t seq, int32_t, std::span<const float> l) {
      if (seq == 0) first.insert(first.end(), l.begin(), l.end());
    };
    auto r = testing::RunGreedy(**m, prompts, opt);
    EXPECT_TRUE(r.ok()) << r.status();
    return first;
  };
  const std::vector<float> exact = run("f32", {p0}, 64);
  const std::vector<float> alone = run("bf16", {p0}, 64);
  const std::vector<float> beside = run("bf16", {p0, p1}, 5);
  ASSERT_FALSE(exact.empty());
  ASSERT_EQ(alone.size(), exact.size());
  ASSERT_EQ(beside.size(), exact.size());
  float scale = 0, diff = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    scale = std::max(scale, std::abs(exact[i]));
    diff = std::max(diff, std::abs(alone[i] - exact[i]));
  }
  if (cpu::Bf16KernelsFor(cpu::ActiveIsa()) == nullptr) {
    // The exact kernels (whose rows may differ by an ulp with their batch: not checked here).
    EXPECT_EQ(diff, 0) << "no fast AVX-512 BF16 here: the exact path should have run";
    GTEST_SKIP() << "checked the exact fallback only: this CPU has no AVX-512 BF16 that "
                    "outruns its FMAs";
  }
  for (size_t i = 0; i < alone.size(); ++i) {
    ASSERT_EQ(std::memcmp(&alone[i], &beside[i], 4), 0)
        << "logit " << i << ": " << alone[i] << " alone, " << beside[i] << " beside another";
  }
  EXPECT_GT(diff, 0) << "bit-identical to exact: were activations rounded?";
  EXPECT_LE(diff, 0.02f * scale) << "largest |logit| " << scale;
}

TEST(LoaderGgufTest, TruncatedAndWrongMagicGgufAreRefused) {
  const std::string src = testing::DefaultModelPath();
  ASSERT_TRUE(fs::exists(src)) << src;
  const fs::path bad =
      fs::path(::testing::TempDir()) / ("kiln_bad_" + std::to_string(getpid()) + ".gguf");
  {
    std::ifstream in(src, std::ios::binary);
    std::vector<char> head(1 << 20);
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    std::ofstream(bad, std::ios::binary)
        .write(head.data(), static_cast<std::streamsize>(head.size()));
  }
  auto m = LoadLlm(ConfigFor(bad.string()));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(StatusMessage(m.status())), HasSubstr(bad.string()));
  {
    std::fstream f(bad, std::ios::binary | std::ios::in | std::ios::out);
    f.write("NOPE", 4);
  }
  m = LoadLlm(ConfigFor(bad.string()));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(StatusMessage(m.status())), HasSubstr("magic"));
  fs::remove(bad);
}

// ---- PagedLlm ----

// On the cpu backend and, where an OpenCL device exists (PoCL in CI), on xpu, where a
// captured step is an OpenCL command buffer (cl_khr_command_buffer) or a recorded enqueue list.
class PagedLlmTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    config::ModelConfig c = ConfigFor(testing::FixturePath("models/llama_gqa_f32"));
    c.backend = GetParam();
    auto m = LoadPagedLlm(c);
    if (GetParam() == "xpu" && absl::IsNotFound(m.status())) {
      GTEST_SKIP() << "no OpenCL device: " << m.status();
    }
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *std::move(m);
    V_ = model_->info().vocab_size;
  }
  std::unique_ptr<PagedLlm> model_;
  int32_t V_ = 0;
};

TEST_P(PagedLlmTest, StepValidatesItsBatch) {
  std::vector<float> logits(V_);
  std::vector<int32_t> tok = {1}, pos = {0}, qs = {0, 1}, lens = {1}, table = {0};
  StepBatch b{tok, pos, qs, lens, table, 1, pos, false};
  EXPECT_EQ(model_->Step(b, logits, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(model_->AllocateKvCache(8, 16).ok());
  EXPECT_TRUE(model_->Step(b, logits, nullptr).ok());
  std::vector<int32_t> lens2 = {1, 1};
  StepBatch bad{tok, pos, qs, lens2, table, 1, pos, false};
  EXPECT_THAT(std::string(StatusMessage(model_->Step(bad, logits, nullptr))),
              HasSubstr("inconsistent step batch"));
  std::vector<int32_t> many(33, 1), many_pos(33), many_qs = {0, 33}, many_lens = {33},
                                                  many_table = {0, 1, 2};
  for (int i = 0; i < 33; ++i) many_pos[i] = i;
  StepBatch big{many, many_pos, many_qs, many_lens, many_table, 3, many_pos, false};
  std::vector<float> more(V_);
  EXPECT_THAT(std::string(StatusMessage(model_->Step(big, more, nullptr))),
              HasSubstr("exceeds what the model was compiled for"));
  std::vector<int32_t> lora = {4};  // the default max_loaded_adapters is 4: slots 0..3
  StepBatch adapted{tok, pos, qs, lens, table, 1, pos, false, lora};
  EXPECT_THAT(std::string(StatusMessage(model_->Step(adapted, logits, nullptr))),
              HasSubstr("asks for adapter slot 4 but model"));
  std::vector<int32_t> empty_slot = {0};  // no adapter loaded: the base model's result
  EXPECT_TRUE(
      model_->Step({tok, pos, qs, lens, table, 1, pos, false, empty_slot}, logits, nullptr).ok());
  std::vector<int32_t> base = {-1};
  EXPECT_TRUE(model_->Step({tok, pos, qs, lens, table, 1, pos, false, base}, logits, nullptr).ok());
  std::vector<float> small(V_ - 1);
  EXPECT_THAT(std::string(StatusMessage(model_->Step(b, small, nullptr))),
              HasSubstr("logits span"));
}

TEST_P(PagedLlmTest, ReplayedDecodeStepEqualsDirectRun) {
  ASSERT_TRUE(model_->AllocateKvCache(8, 16).ok());
  // Two sequences (blocks 0 and 1), prompts of 3 and 2 tokens in one prefill step.
  std::vector<int32_t> tok = {5, 6, 7, 8, 9}, pos = {0, 1, 2, 0, 1}, slots = {0, 1, 2, 16, 17},
                       qs = {0, 3, 5}, lens = {3, 2}, table = {0, 1};
  std::vector<float> logits(2 * V_);
  StepStats stats;
  ASSERT_TRUE(model_->Step({tok, pos, qs, lens, table, 1, slots, false}, logits, &stats).ok());
  EXPECT_FALSE(stats.replayed);
  // The same decode step twice: direct, then replayed (padded to the capture size 2). The
  // KV write of the second run rewrites the same slots with the same values.
  std::vector<int32_t> dtok = {10, 11}, dpos = {3, 2}, dslots = {3, 18}, dqs = {0, 1, 2},
                       dlens = {4, 3};
  std::vector<float> direct(2 * V_), replayed(2 * V_);
  ASSERT_TRUE(model_->Step({dtok, dpos, dqs, dlens, table, 1, dslots, false}, direct, &stats).ok());
  EXPECT_FALSE(stats.replayed);
  ASSERT_TRUE(
      model_->Step({dtok, dpos, dqs, dlens, table, 1, dslots, true}, replayed, &stats).ok());
  EXPECT_TRUE(stats.replayed);
  EXPECT_EQ(stats.padded_seqs, 2);
  EXPECT_EQ(model_->num_captured(), 1);
  for (size_t i = 0; i < direct.size(); ++i) ASSERT_NEAR(direct[i], replayed[i], 1e-4) << i;
  // One sequence pads up to... itself (capture size 1); three pad to 4.
  std::vector<int32_t> one_tok = {12}, one_pos = {4}, one_slot = {4}, one_qs = {0, 1},
                       one_len = {5}, one_table = {0};
  std::vector<float> one(V_);
  ASSERT_TRUE(
      model_->Step({one_tok, one_pos, one_qs, one_len, one_table, 1, one_slot, true}, one, &stats)
          .ok());
  EXPECT_EQ(stats.padded_seqs, 1);
  EXPECT_EQ(model_->num_captured(), 2);
  // Three sequences (the first two as above, a third one token long): the next capture size is
  // 4. On the host a padded row costs as much as a real one, so the step runs direct there; an
  // accelerator (xpu) replays the capture of 4. The first two rows agree with the direct run.
  std::vector<int32_t> tok3 = {10, 11, 13}, pos3 = {3, 2, 0}, slots3 = {3, 18, 32},
                       qs3 = {0, 1, 2, 3}, lens3 = {4, 3, 1}, table3 = {0, 1, 2};
  std::vector<float> three(3 * V_);
  ASSERT_TRUE(model_->Step({tok3, pos3, qs3, lens3, table3, 1, slots3, true}, three, &stats).ok());
  const bool host = GetParam() == "cpu";
  EXPECT_EQ(stats.replayed, !host);
  EXPECT_EQ(stats.padded_seqs, host ? 3 : 4);
  EXPECT_EQ(model_->num_captured(), host ? 2 : 3);
  for (size_t i = 0; i < direct.size(); ++i) ASSERT_NEAR(direct[i], three[i], 1e-4) << i;
}

// The sampling stage: StepAndSample picks what the host sampler picks from Step's logits for
// the same parameters, penalties, bans and random stream — directly (penalties, bans) and
// replayed (a captured decode step).
TEST_P(PagedLlmTest, SamplingInTheStepProgramEqualsTheHostSampler) {
  ASSERT_TRUE(model_->samples_on_device()) << "the default is sampling: device";
  ASSERT_TRUE(model_->AllocateKvCache(8, 16).ok());
  // Two sequences: greedy with top-5 logprobs, and a seeded draw with top-p and penalties
  // whose EOS-like token 3 is banned (min_tokens not reached).
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.logprobs = 5;
  SamplingParams drawn;
  drawn.temperature = 1.3f;
  drawn.top_p = 0.9f;
  drawn.repetition_penalty = 1.2f;
  drawn.frequency_penalty = 0.5f;
  drawn.min_tokens = 4;
  drawn.seed = 99;
  drawn.logprobs = 0;
  const std::vector<int32_t> end_ids = {3};
  std::vector<int32_t> tok = {5, 6, 7, 8, 9}, pos = {0, 1, 2, 0, 1}, slots = {0, 1, 2, 16, 17},
                       qs = {0, 3, 5}, lens = {3, 2}, table = {0, 1};
  std::vector<SequenceSampler> host = {SequenceSampler(greedy, std::span(tok).first(3), 1),
                                       SequenceSampler(drawn, std::span(tok).subspan(3), 1)};
  std::vector<SequenceSampler> dev = host;
  StepSamplingTable rows;
  auto table_for = [&](std::vector<SequenceSampler>& ss) -> const StepSampling& {
    rows.Clear();
    for (SequenceSampler& s : ss) rows.AddSampled(s, end_ids);
    return rows.table();
  };
  std::vector<float> logits(2 * V_);
  std::vector<SampledToken> got(2);
  StepStats stats;
  StepBatch prefill{tok, pos, qs, lens, table, 1, slots, false};
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE(step);
    // Host: logits, then each sampler.
    ASSERT_TRUE(model_->Step(prefill, logits, nullptr).ok());
    std::vector<SampledToken> want(2);
    for (int s = 0; s < 2; ++s) {
      want[s] = host[s].Sample(std::span(logits).subspan(static_cast<size_t>(s) * V_, V_), end_ids);
    }
    // Device: the same step again (it rewrites the same KV slots), sampling in the program.
    const StepSampling& t = table_for(dev);
    ASSERT_TRUE(model_->StepAndSample(prefill, t, got, &stats).ok());
    // With penalties or bans the step runs directly; a plain decode step replays.
    EXPECT_EQ(stats.replayed, prefill.decode_only && t.penalties.empty() && t.banned.empty());
    for (int s = 0; s < 2; ++s) {
      EXPECT_EQ(got[s].token, want[s].token) << "sequence " << s;
      EXPECT_NEAR(got[s].logprob, want[s].logprob, 1e-5) << "sequence " << s;
      ASSERT_EQ(got[s].top.size(), want[s].top.size()) << "sequence " << s;
      for (size_t i = 0; i < want[s].top.size(); ++i) {
        EXPECT_EQ(got[s].top[i].token, want[s].top[i].token);
        EXPECT_NEAR(got[s].top[i].logprob, want[s].top[i].logprob, 1e-5);
      }
      host[s].Accept(want[s].token);
      dev[s].Accept(got[s].token);
    }
    // The next step decodes the two tokens.
    tok = {want[0].token, want[1].token};
    pos = {3 + step, 2 + step};
    slots = {3 + step, 18 + step};
    qs = {0, 1, 2};
    lens = {4 + step, 3 + step};
    prefill = {tok, pos, qs, lens, table, 1, slots, true};
  }
  // Without penalties or bans a decode step replays its capture and still agrees.
  SamplingParams plain = greedy;
  host = {SequenceSampler(plain, {}, 1), SequenceSampler(plain, {}, 1)};
  dev = host;
  ASSERT_TRUE(model_->Step(prefill, logits, nullptr).ok());
  const StepSampling& t = table_for(dev);
  ASSERT_TRUE(model_->StepAndSample(prefill, t, got, &stats).ok());
  EXPECT_TRUE(stats.replayed);
  for (int s = 0; s < 2; ++s) {
    const SampledToken want =
        host[s].Sample(std::span(logits).subspan(static_cast<size_t>(s) * V_, V_), end_ids);
    EXPECT_EQ(got[s].token, want.token);
    EXPECT_NEAR(got[s].logprob, want.logprob, 1e-5);
  }
  // A table that does not fit the batch is refused.
  const std::vector<int32_t> short_start = {0};
  StepSampling bad = t;
  bad.penalty_start = short_start;
  EXPECT_THAT(std::string(StatusMessage(model_->StepAndSample(prefill, bad, got, nullptr))),
              HasSubstr("inconsistent step sampling"));
}

TEST(PagedLlmSamplingTest, HostSamplingCompilesNoSamplingStage) {
  config::ModelConfig c = ConfigFor(testing::FixturePath("models/llama_gqa_f32"));
  c.sampling = "host";
  auto m = LoadPagedLlm(c);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE((*m)->samples_on_device());
  std::vector<SampledToken> out(1);
  EXPECT_EQ((*m)->StepAndSample({}, {}, out, nullptr).code(), StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(Backends, PagedLlmTest, ::testing::Values("cpu", "xpu"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kiln::models
