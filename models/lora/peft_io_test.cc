#include "models/lora/peft_io.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/testing/source_dir.h"
#include "models/io/durable_file.h"
#include "models/safetensors/safetensors.h"

namespace kiln::models {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;
namespace fs = std::filesystem;

const std::string kFixtures = std::string(TestSourceDir()) + "/tests/fixtures/peft/";

// The tiny Llama of scripts/fixtures/make_peft_fixtures.py.
LlmHParams TinyLlama() {
  LlmHParams hp;
  hp.architecture = "llama";
  hp.hidden_size = 64;
  hp.num_layers = 2;
  hp.num_heads = 4;
  hp.num_kv_heads = 2;
  hp.head_dim = 16;
  hp.ffn_size = 96;
  return hp;
}

PeftBaseModel Base(bool permuted) {
  LlmHParams hp = TinyLlama();
  hp.rope.layout = permuted ? RopeParams::Layout::kInterleaved : RopeParams::Layout::kNeox;
  PeftBaseModel b = PeftBaseModel::FromHParams(hp, "kiln-fixtures/tiny-llama");
  EXPECT_EQ(b.qk_rows_permuted, permuted);
  return b;
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 0.5f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// A random adapter over every module of the tiny Llama.
LoraAdapter RandomAdapter(int64_t r, double alpha) {
  LoraAdapter ad;
  ad.config.r = r;
  ad.config.alpha = alpha;
  uint32_t seed = 1;
  for (int64_t l = 0; l < 2; ++l) {
    for (std::string_view m : PeftModuleNames()) {
      LoraLayerShape s = *PeftModuleShape(TinyLlama(), m);
      LoraLayer layer{s.in, s.out, Random(r * s.in, seed++), Random(s.out * r, seed++)};
      ad.layers[StrCat("blk.", l, ".", GgufSuffixForPeftModule(m), ".weight")] = layer;
    }
  }
  return ad;
}

// scale * B (A x): the LoRA module's output, rows in the order B's rows are in.
std::vector<float> Delta(const LoraLayer& l, int64_t r, double scale, const std::vector<float>& x) {
  std::vector<double> ax(r, 0);
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < l.in; ++j) ax[i] += double(l.a[i * l.in + j]) * x[j];
  }
  std::vector<float> y(l.out);
  for (int64_t o = 0; o < l.out; ++o) {
    double s = 0;
    for (int64_t i = 0; i < r; ++i) s += double(l.b[o * r + i]) * ax[i];
    y[o] = static_cast<float>(s * scale);
  }
  return y;
}

class PeftIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           StrCat("kiln_peft_", ::getpid(), "_",
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Dir() const { return dir_.string(); }
  json ReadJson(const std::string& path) { return json::parse(*ReadWholeFile(path)); }
  void WriteJson(const std::string& path, const json& j) {
    ASSERT_TRUE(WriteFileDurably(path, j.dump()).ok());
  }
  std::string ErrorOf(const PeftBaseModel& base) {
    auto r = ReadPeftAdapter(Dir(), base);
    EXPECT_FALSE(r.ok());
    return r.ok() ? "" : std::string(StatusMessage(r.status()));
  }
  fs::path dir_;
};

// ---- q/k row order ---------------------------------------------------------------------------

TEST(PeftQkRowsTest, KnownSmallExample) {
  // 2 heads of dim 4: within each head, HF rows (h0 first half: 0 1, second half: 2 3) are
  // interleaved as 0 2 1 3, as llama.cpp's permute does.
  std::vector<float> w;
  for (int row = 0; row < 8; ++row) w.insert(w.end(), {float(row), 10.0f + row});
  const std::vector<float> g = HfToGgufQkRows(w, 8, 2, 2);
  const std::vector<int> order = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int row = 0; row < 8; ++row) {
    EXPECT_EQ(g[2 * row], order[row]) << row;
    EXPECT_EQ(g[2 * row + 1], 10 + order[row]) << row;
  }
  EXPECT_EQ(GgufToHfQkRows(g, 8, 2, 2), w);
  // Head dim 6: 0 3 1 4 2 5.
  std::vector<float> v = {0, 1, 2, 3, 4, 5};
  EXPECT_EQ(HfToGgufQkRows(v, 6, 1, 1), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(PeftQkRowsTest, InverseIsIdentity) {
  for (auto [heads, dim, cols] : {std::tuple{4, 16, 3}, {2, 64, 1}, {1, 2, 5}, {8, 8, 2}}) {
    const std::vector<float> w = Random(heads * dim * cols, heads + dim);
    const std::vector<float> g = HfToGgufQkRows(w, heads * dim, cols, heads);
    if (dim > 2) {
      EXPECT_NE(g, w);  // a head of 2 rows is its own permutation
    }
    EXPECT_EQ(GgufToHfQkRows(g, heads * dim, cols, heads), w);
    EXPECT_EQ(HfToGgufQkRows(GgufToHfQkRows(w, heads * dim, cols, heads), heads * dim, cols, heads),
              w);
  }
}

TEST(PeftIoNamesTest, TensorNamesAndShapes) {
  EXPECT_EQ(PeftTensorName(3, "q_proj", 'A'),
            "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(PeftTensorName(0, "down_proj", 'B'),
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");
  const LlmHParams hp = TinyLlama();
  EXPECT_EQ(PeftModuleShape(hp, "q_proj")->out, 64);
  EXPECT_EQ(PeftModuleShape(hp, "k_proj")->out, 32);
  EXPECT_EQ(PeftModuleShape(hp, "o_proj")->in, 64);
  EXPECT_EQ(PeftModuleShape(hp, "down_proj")->in, 96);
  EXPECT_FALSE(PeftModuleShape(hp, "lm_head").ok());
  LlmHParams gpt2 = hp;
  gpt2.architecture = "gpt2";
  EXPECT_FALSE(PeftModuleShape(gpt2, "q_proj").ok());
}

// ---- Write / read ----------------------------------------------------------------------------

TEST_F(PeftIoTest, RoundTripAndFileLayout) {
  for (bool permuted : {false, true}) {
    const PeftBaseModel base = Base(permuted);
    LoraAdapter ad = RandomAdapter(4, 16);
    ad.config.dropout = 0.05;
    ASSERT_TRUE(WritePeftAdapter(Dir(), ad, base).ok());

    const json cfg = ReadJson(Dir() + "/adapter_config.json");
    EXPECT_EQ(cfg["peft_type"], "LORA");
    EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
    EXPECT_EQ(cfg["r"], 4);
    EXPECT_TRUE(cfg["lora_alpha"].is_number_integer());
    EXPECT_EQ(cfg["lora_alpha"], 16);
    EXPECT_EQ(cfg["lora_dropout"], 0.05);
    EXPECT_EQ(cfg["use_rslora"], false);
    EXPECT_EQ(cfg["bias"], "none");
    EXPECT_EQ(cfg["fan_in_fan_out"], false);
    EXPECT_EQ(cfg["inference_mode"], true);
    EXPECT_EQ(cfg["init_lora_weights"], true);
    EXPECT_TRUE(cfg["modules_to_save"].is_null());
    EXPECT_EQ(cfg["base_model_name_or_path"], "kiln-fixtures/tiny-llama");
    EXPECT_EQ(cfg["target_modules"],
              json({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));

    // The file holds Hugging Face row order: q/k lora_B un-permuted when the model's are.
    auto st = SafetensorsFile::Open(Dir() + "/adapter_model.safetensors");
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ((*st)->tensors().size(), 28u);
    EXPECT_EQ((*st)->metadata().at("format"), "pt");
    const SafetensorsTensor* qb =
        (*st)->Find("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight");
    ASSERT_NE(qb, nullptr);
    EXPECT_EQ(qb->shape, (std::vector<int64_t>{64, 4}));
    const LoraLayer& q = ad.layers.at("blk.1.attn_q.weight");
    const LoraLayer& k = ad.layers.at("blk.1.attn_k.weight");
    EXPECT_EQ(*SafetensorsToFloats(*qb), permuted ? GgufToHfQkRows(q.b, 64, 4, 4) : q.b);
    const SafetensorsTensor* kb =
        (*st)->Find("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight");
    EXPECT_EQ(*SafetensorsToFloats(*kb), permuted ? GgufToHfQkRows(k.b, 32, 4, 2) : k.b);
    const SafetensorsTensor* vb =
        (*st)->Find("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight");
    EXPECT_EQ(*SafetensorsToFloats(*vb), ad.layers.at("blk.1.attn_v.weight").b);
    const SafetensorsTensor* qa =
        (*st)->Find("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
    EXPECT_EQ(qa->shape, (std::vector<int64_t>{4, 64}));
    EXPECT_EQ(*SafetensorsToFloats(*qa), q.a);

    auto back = ReadPeftAdapter(Dir(), base);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->config.r, 4);
    EXPECT_EQ(back->config.alpha, 16);
    EXPECT_EQ(back->config.dropout, 0.05);
    EXPECT_EQ(back->layers.size(), ad.layers.size());
    for (const auto& [name, layer] : ad.layers) {
      const LoraLayer& b = back->layers.at(name);
      EXPECT_EQ(b.in, layer.in) << name;
      EXPECT_EQ(b.out, layer.out) << name;
      EXPECT_EQ(b.a, layer.a) << name;
      EXPECT_EQ(b.b, layer.b) << name;
    }
  }
}

// GPT-2: PEFT's names under transformer.h, Conv1D (fan_in_fan_out true), c_attn fused q/k/v,
// and c_proj naming two modules (attn.c_proj, mlp.c_proj) told apart by their paths.
TEST_F(PeftIoTest, Gpt2RoundTripAndModulePaths) {
  LlmHParams hp = TinyLlama();
  hp.architecture = "gpt2";
  hp.num_kv_heads = hp.num_heads;
  hp.ffn_size = 256;
  const PeftBaseModel base = PeftBaseModel::FromHParams(hp, "kiln-fixtures/tiny-gpt2");
  EXPECT_EQ(PeftModuleShape(hp, "c_attn")->out, 192);
  EXPECT_EQ(PeftModuleShape(hp, "mlp.c_proj")->in, 256);
  EXPECT_EQ(PeftModuleShape(hp, "attn.c_proj")->in, 64);
  EXPECT_THAT(PeftModuleShape(hp, "c_proj").status().message(), HasSubstr("names several"));
  LoraAdapter ad;
  ad.config.r = 2;
  ad.config.alpha = 4;
  ad.config.target_modules = {"c_attn", "mlp.c_proj"};
  uint32_t seed = 1;
  auto modules = ResolveLoraModules("gpt2", ad.config.target_modules);
  ASSERT_TRUE(modules.ok()) << modules.status();
  for (const LoraModule& m : *modules) {
    LoraLayerShape s = *PeftModuleShape(hp, LoraModuleLabel("gpt2", m));
    ad.layers[StrCat("blk.1.", m.gguf, ".weight")] = {s.in, s.out, Random(2 * s.in, seed++),
                                                      Random(s.out * 2, seed++)};
  }
  ASSERT_EQ(ad.layers.size(), 2u);
  ASSERT_TRUE(WritePeftAdapter(Dir(), ad, base).ok());
  const json cfg = ReadJson(Dir() + "/adapter_config.json");
  EXPECT_EQ(cfg["fan_in_fan_out"], true);
  EXPECT_EQ(cfg["target_modules"], json({"c_attn", "mlp.c_proj"}));
  auto st = SafetensorsFile::Open(Dir() + "/adapter_model.safetensors");
  ASSERT_TRUE(st.ok()) << st.status();
  const SafetensorsTensor* down =
      (*st)->Find("base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->shape, (std::vector<int64_t>{2, 256}));
  ASSERT_NE((*st)->Find("base_model.model.transformer.h.1.attn.c_attn.lora_B.weight"), nullptr);
  auto back = ReadPeftAdapter(Dir(), base);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->config.target_modules, (std::vector<std::string>{"c_attn", "mlp.c_proj"}));
  for (const auto& [name, layer] : ad.layers) {
    ASSERT_TRUE(back->layers.count(name)) << name;
    EXPECT_EQ(back->layers.at(name).a, layer.a);
    EXPECT_EQ(back->layers.at(name).b, layer.b);
  }
  // The llama reader of the same files finds no module of its own.
  EXPECT_FALSE(ReadPeftAdapter(Dir(), Base(false)).ok());
  // An adapter for attn.c_proj is not one for mlp.c_proj.
  ad.config.target_modules = {"attn.c_proj"};
  EXPECT_THAT(WritePeftAdapter(Dir(), ad, base).message(),
              HasSubstr("blk.1.attn_qkv: c_attn is not in target_modules (attn.c_proj)"));
}

TEST_F(PeftIoTest, WriteRejectsLayersThatDoNotFit) {
  const PeftBaseModel base = Base(false);
  LoraAdapter ad = RandomAdapter(4, 8);
  ad.layers["blk.2.attn_q.weight"] = ad.layers.at("blk.0.attn_q.weight");
  EXPECT_THAT(std::string(StatusMessage(WritePeftAdapter(Dir(), ad, base))),
              HasSubstr("adapter layer blk.2.attn_q: layer 2 is past the model's 2 layers"));
  ad = RandomAdapter(4, 8);
  ad.layers.at("blk.0.ffn_up.weight").in = 65;
  EXPECT_THAT(std::string(StatusMessage(WritePeftAdapter(Dir(), ad, base))),
              HasSubstr("adapter layer blk.0.ffn_up: lora_A is (4, 65) but the model's up_proj "
                        "takes 64 inputs"));
  ad = RandomAdapter(4, 8);
  ad.layers.at("blk.0.ffn_up.weight").b.pop_back();
  EXPECT_THAT(std::string(StatusMessage(WritePeftAdapter(Dir(), ad, base))),
              HasSubstr("blk.0.ffn_up: lora_A holds 256 values and lora_B 383"));
  ad = RandomAdapter(4, 8);
  ad.layers["output.weight"] = {};
  EXPECT_THAT(std::string(StatusMessage(WritePeftAdapter(Dir(), ad, base))),
              HasSubstr("'output.weight' is not a GGUF weight name of a LoRA module"));
  ad = RandomAdapter(4, 8);
  ad.config.target_modules = {"q_proj"};
  EXPECT_THAT(std::string(StatusMessage(WritePeftAdapter(Dir(), ad, base))),
              HasSubstr("k_proj is not in target_modules (q_proj)"));
  ad = RandomAdapter(4, 8);
  ad.config.r = 0;
  EXPECT_FALSE(WritePeftAdapter(Dir(), ad, base).ok());
}

// ---- Files written by Python PEFT
// ----------------------------------------------------------------

void CheckAgainstPeft(const std::string& name, const PeftBaseModel& base, float rel_tol) {
  const std::string dir = kFixtures + name;
  auto ad = ReadPeftAdapter(dir, base);
  ASSERT_TRUE(ad.ok()) << ad.status();
  const json expected = json::parse(*ReadWholeFile(dir + "/kiln_expected.json"));
  size_t n_tensors = 0;
  for (const auto& [layer_name, layer] : ad->layers) {
    int l = layer_name[4] - '0';
    std::string suffix = layer_name.substr(6, layer_name.size() - 6 - 7);
    std::string_view module = PeftModuleForGgufSuffix(suffix);
    const int64_t heads = !base.qk_rows_permuted ? 0
                          : module == "q_proj"   ? 4
                          : module == "k_proj"   ? 2
                                                 : 0;
    const std::vector<float> b_hf =
        heads ? GgufToHfQkRows(layer.b, layer.out, ad->config.r, heads) : layer.b;
    for (auto [ab, values] : {std::pair{'A', &layer.a}, std::pair{'B', &b_hf}}) {
      const json& e = expected["tensors"].at(PeftTensorName(l, module, ab));
      double sum = 0;
      for (float v : *values) sum += v;
      EXPECT_NEAR(sum, e["sum"].get<double>(), 1e-4 * (1 + std::abs(sum))) << layer_name << ab;
      for (int i = 0; i < 4; ++i) EXPECT_EQ((*values)[i], e["first"][i].get<float>()) << layer_name;
      ++n_tensors;
    }
    if (l == 0) {
      const json& d = expected["deltas"].at(std::string(module));
      const std::vector<float> x = d["x"].get<std::vector<float>>();
      std::vector<float> y = Delta(layer, ad->config.r, ad->config.scale(), x);
      if (heads) y = GgufToHfQkRows(y, layer.out, 1, heads);  // the model's order -> HF's
      const std::vector<float> want = d["delta"].get<std::vector<float>>();
      ASSERT_EQ(y.size(), want.size());
      double max_abs = 0;
      for (float w : want) max_abs = std::max(max_abs, double(std::abs(w)));
      for (size_t i = 0; i < y.size(); ++i) {
        EXPECT_NEAR(y[i], want[i], rel_tol * max_abs) << layer_name << " row " << i;
      }
    }
  }
  EXPECT_EQ(n_tensors, expected["tensors"].size());
}

TEST(PeftFixtureTest, ReadsAllLinearF32AdapterFromPeft) {
  for (bool permuted : {false, true}) {
    auto ad = ReadPeftAdapter(kFixtures + "tiny_llama_adapter", Base(permuted));
    ASSERT_TRUE(ad.ok()) << ad.status();
    EXPECT_EQ(ad->config.r, 4);
    EXPECT_EQ(ad->config.alpha, 8);
    EXPECT_FALSE(ad->config.use_rslora);
    // PEFT saved "all-linear" as module paths ("model.layers.1.mlp.gate_proj").
    EXPECT_EQ(ad->config.target_modules,
              (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"}));
    EXPECT_EQ(ad->layers.size(), 14u);
    EXPECT_EQ(ad->layers.at("blk.1.ffn_down.weight").in, 96);
    CheckAgainstPeft("tiny_llama_adapter", Base(permuted), 1e-5f);
  }
}

TEST(PeftFixtureTest, ReadsRsLoraBf16AdapterFromPeft) {
  auto ad = ReadPeftAdapter(kFixtures + "tiny_llama_adapter_bf16", Base(true));
  ASSERT_TRUE(ad.ok()) << ad.status();
  EXPECT_EQ(ad->config.r, 2);
  EXPECT_TRUE(ad->config.use_rslora);
  EXPECT_NEAR(ad->config.scale(), 6 / std::sqrt(2.0), 1e-12);
  EXPECT_EQ(ad->config.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(ad->layers.size(), 4u);
  // PEFT computed the deltas in bf16.
  CheckAgainstPeft("tiny_llama_adapter_bf16", Base(true), 2e-2f);
  CheckAgainstPeft("tiny_llama_adapter_bf16", Base(false), 2e-2f);
}

// ---- Errors ------------------------------------------------------------------------------------

class PeftIoErrorTest : public PeftIoTest {
 protected:
  void SetUp() override {
    PeftIoTest::SetUp();
    fs::create_directories(dir_);
    fs::copy(kFixtures + "tiny_llama_adapter", dir_, fs::copy_options::recursive);
    config_ = ReadJson(Dir() + "/adapter_config.json");
  }
  std::string ErrorWithConfig(const json& cfg) {
    WriteJson(Dir() + "/adapter_config.json", cfg);
    return ErrorOf(Base(false));
  }
  // Rewrites adapter_model.safetensors through `edit`.
  void EditTensors(const std::function<void(SafetensorsWriter&, const SafetensorsFile&)>& edit) {
    std::string bytes = *ReadWholeFile(Dir() + "/adapter_model.safetensors");
    auto st = SafetensorsFile::Parse(MappedFile::FromBytes(bytes, "x"));
    ASSERT_TRUE(st.ok());
    SafetensorsWriter w;
    edit(w, **st);
    ASSERT_TRUE(w.WriteFile(Dir() + "/adapter_model.safetensors").ok());
  }
  json config_;
};

TEST_F(PeftIoErrorTest, ShapesThatDoNotFitTheModel) {
  PeftBaseModel big = Base(false);
  big.hparams.hidden_size = 512;
  EXPECT_THAT(ErrorOf(big), HasSubstr("adapter_model.safetensors: adapter layer blk.0.attn_k: "
                                      "lora_A is (4, 64) but the model's k_proj takes 512 inputs"));
  PeftBaseModel heads = Base(false);
  heads.hparams.num_kv_heads = 4;
  EXPECT_THAT(ErrorOf(heads), HasSubstr("adapter layer blk.0.attn_k: lora_B is (32, 4) but the "
                                        "model's k_proj has 64 outputs"));
  PeftBaseModel one_layer = Base(false);
  one_layer.hparams.num_layers = 1;
  EXPECT_THAT(ErrorOf(one_layer), HasSubstr("layer 1 is past the model's 1 layers"));
}

TEST_F(PeftIoErrorTest, BadConfig) {
  json c = config_;
  c["r"] = 0;
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("adapter_config.json: LoRA rank r must be positive"));
  c = config_;
  c["r"] = 8;
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("blk.0.attn_k: lora_A is (4, 64) and lora_B is (32, 4) "
                                            "but the rank r is 8"));
  c = config_;
  c.erase("r");
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("\"r\" must be a positive integer, got nothing"));
  c = config_;
  c["peft_type"] = "IA3";
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("peft_type is \"IA3\"; Kiln reads LoRA adapters"));
  c = config_;
  c["lora_alpha"] = "sixteen";
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("\"lora_alpha\" is \"sixteen\"; expected a number"));
  c = config_;
  c["use_dora"] = true;
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("Kiln does not apply DoRA"));
  c = config_;
  c["modules_to_save"] = {"lm_head"};
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("\"modules_to_save\" is [\"lm_head\"]"));
  c = config_;
  c["target_modules"] = {"q_proj", "lm_head"};
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("target module \"lm_head\" is not one Kiln applies"));
  c = config_;
  c["target_modules"] = {"q_proj"};
  EXPECT_THAT(ErrorWithConfig(c), HasSubstr("blk.0.ffn_down: down_proj is not in "
                                            "adapter_config.json's target_modules (q_proj)"));
  ASSERT_TRUE(WriteFileDurably(Dir() + "/adapter_config.json", "{\"r\": 4,").ok());
  EXPECT_THAT(ErrorOf(Base(false)), HasSubstr("adapter_config.json: not valid JSON"));
  // A regex target_modules: the tensors present decide.
  c = config_;
  c["target_modules"] = ".*proj";
  WriteJson(Dir() + "/adapter_config.json", c);
  auto ad = ReadPeftAdapter(Dir(), Base(false));
  ASSERT_TRUE(ad.ok()) << ad.status();
  EXPECT_EQ(ad->config.target_modules.size(), 7u);
}

TEST_F(PeftIoErrorTest, UnknownAndMissingTensors) {
  EditTensors([](SafetensorsWriter& w, const SafetensorsFile& st) {
    for (const SafetensorsTensor& t : st.tensors()) {
      ASSERT_TRUE(w.Add(t.name, t.dtype, t.shape, t.data, t.n_bytes).ok());
    }
    const float x[4] = {};
    ASSERT_TRUE(w.AddFloats("base_model.model.lm_head.weight", {4}, x, 4).ok());
  });
  EXPECT_THAT(ErrorOf(Base(false)),
              HasSubstr("tensor \"base_model.model.lm_head.weight\" is not a LoRA weight"));
  EditTensors([](SafetensorsWriter& w, const SafetensorsFile& st) {
    for (const SafetensorsTensor& t : st.tensors()) {
      if (t.name == "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight") continue;
      if (t.name == "base_model.model.lm_head.weight") continue;
      ASSERT_TRUE(w.Add(t.name, t.dtype, t.shape, t.data, t.n_bytes).ok());
    }
  });
  EXPECT_THAT(ErrorOf(Base(false)),
              HasSubstr("adapter layer blk.1.ffn_up: has lora_A but no lora_B"));
  EditTensors([](SafetensorsWriter&, const SafetensorsFile&) {});
  EXPECT_THAT(ErrorOf(Base(false)), HasSubstr("holds no LoRA tensors"));
}

TEST_F(PeftIoErrorTest, MissingAndTruncatedFiles) {
  const std::string st = Dir() + "/adapter_model.safetensors";
  std::string bytes = *ReadWholeFile(st);
  ASSERT_TRUE(WriteFileDurably(st, bytes.substr(0, bytes.size() - 100)).ok());
  EXPECT_THAT(ErrorOf(Base(false)), HasSubstr("adapter_model.safetensors"));
  fs::remove(st);
  auto r = ReadPeftAdapter(Dir(), Base(false));
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(ErrorOf(Base(false)), HasSubstr("adapter_model.safetensors: no such file"));
  ASSERT_TRUE(WriteFileDurably(Dir() + "/adapter_model.bin", "pickle").ok());
  EXPECT_THAT(ErrorOf(Base(false)), HasSubstr("pickled adapter_model.bin"));
  fs::remove(Dir() + "/adapter_config.json");
  EXPECT_THAT(ErrorOf(Base(false)), HasSubstr("adapter_config.json: no such file"));
}

// Writes an adapter for the fixtures' tiny Llama, as a llama GGUF would hold it (q/k rows
// permuted), with the deltas PEFT must reproduce after loading it (Hugging Face row order):
//   KILN_PEFT_EXPORT_DIR=/tmp/kiln_peft build/models/peft_io_test --gtest_filter='*Export*'
//   .venv-ref/bin/python scripts/fixtures/make_peft_fixtures.py --check-kiln /tmp/kiln_peft
TEST(PeftExportTest, ExportForPythonPeft) {
  const char* out = std::getenv("KILN_PEFT_EXPORT_DIR");
  if (out == nullptr) GTEST_SKIP() << "KILN_PEFT_EXPORT_DIR not set";
  const PeftBaseModel base = Base(true);
  LoraAdapter ad = RandomAdapter(4, 12);
  ad.config.use_rslora = true;
  ASSERT_TRUE(WritePeftAdapter(out, ad, base).ok());
  json expected;
  std::vector<float> x(96);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.3f * i);
  for (const auto& [name, layer] : ad.layers) {
    const std::string_view module = PeftModuleForGgufSuffix(name.substr(6, name.size() - 6 - 7));
    std::vector<float> xi(x.begin(), x.begin() + layer.in);
    std::vector<float> y = Delta(layer, 4, ad.config.scale(), xi);
    if (module == "q_proj") y = GgufToHfQkRows(y, layer.out, 1, 4);
    if (module == "k_proj") y = GgufToHfQkRows(y, layer.out, 1, 2);
    expected[StrCat(name.substr(4, 1), ".", module)] = {{"x", xi}, {"delta", y}};
  }
  ASSERT_TRUE(WriteFileDurably(std::string(out) + "/kiln_expected.json", expected.dump()).ok());
}

}  // namespace
}  // namespace kiln::models
