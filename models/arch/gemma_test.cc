// The Gemma readers' hyper-parameters (GGUF metadata as llama.cpp writes it, config.json as
// transformers writes it), their errors, and a config's `attention:` section applied to a
// model. The graphs are checked against transformers by hf_golden_test (gemma2_softcap_f32,
// gemma3_text_bf16).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "models/arch/arch.h"
#include "models/gguf/gguf_test_util.h"
#include "models/io/mapped_file.h"

namespace kiln::models {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A metadata-only GGUF of `arch` with `layers` blocks (hidden 64, 4 heads of 16, 2 KV heads).
testing::GgufBuilder GemmaGguf(const std::string& arch, uint32_t layers) {
  testing::GgufBuilder g;
  g.Str("general.architecture", arch)
      .U32(arch + ".block_count", layers)
      .U32(arch + ".embedding_length", 64)
      .U32(arch + ".feed_forward_length", 128)
      .U32(arch + ".attention.head_count", 4)
      .U32(arch + ".attention.head_count_kv", 2)
      .U32(arch + ".attention.key_length", 16)
      .U32(arch + ".context_length", 8192)
      .U32(arch + ".vocab_size", 256)
      .F32(arch + ".attention.layer_norm_rms_epsilon", 1e-6f)
      .U32(arch + ".attention.sliding_window", 4096);
  return g;
}

StatusOr<LlmHParams> FromGguf(const testing::GgufBuilder& g, std::string_view variant) {
  KILN_ASSIGN_OR_RETURN(auto file, GgufFile::Parse(MappedFile::FromBytes(g.Build(), "g.gguf")));
  return GemmaArchitecture().from_gguf(*file, variant);
}

HfModelConfig Config(nlohmann::json raw) {
  HfModelConfig c;
  c.model_type = raw.value("model_type", "");
  c.raw = std::move(raw);
  c.path = "config.json";
  return c;
}

nlohmann::json Gemma2Json() {
  return {{"model_type", "gemma2"},
          {"vocab_size", 256},
          {"hidden_size", 64},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"intermediate_size", 128},
          {"query_pre_attn_scalar", 24},
          {"attn_logit_softcapping", 50.0},
          {"final_logit_softcapping", 30.0},
          {"sliding_window", 4096},
          {"layer_types",
           {"sliding_attention", "full_attention", "sliding_attention", "full_attention"}}};
}

TEST(GemmaGgufTest, Gemma2AlternatesWindowsAndSoftCaps) {
  testing::GgufBuilder g = GemmaGguf("gemma2", 4);
  g.F32("gemma2.attn_logit_softcapping", 50).F32("gemma2.final_logit_softcapping", 30);
  auto hp = FromGguf(g, "gemma2");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->sliding_window, (std::vector<int64_t>{4096, 0, 4096, 0}));
  EXPECT_EQ(hp->attn_softcap, 50);
  EXPECT_EQ(hp->final_softcap, 30);
  EXPECT_DOUBLE_EQ(hp->attn_scale, 1 / std::sqrt(16.0));  // head_dim (not a 27B model)
  EXPECT_DOUBLE_EQ(hp->embed_scale, 8);                   // sqrt(64)
  EXPECT_EQ(hp->norm_weight_offset, 0);                   // GGUF stores 1 + w
  EXPECT_EQ(hp->activation, LlmActivation::kGeluTanh);
  EXPECT_TRUE(hp->tied_embeddings);
  EXPECT_FALSE(hp->qk_norm);
  EXPECT_FALSE(hp->rope_sliding.has_value());
  EXPECT_EQ(hp->rope.layout, RopeParams::Layout::kNeox);
}

TEST(GemmaGgufTest, Gemma3HasQkNormsAndALocalRope) {
  testing::GgufBuilder g = GemmaGguf("gemma3", 62);
  g.F32("gemma3.rope.freq_base", 1e6f)
      .Str("gemma3.rope.scaling.type", "linear")
      .F32("gemma3.rope.scaling.factor", 8);
  auto hp = FromGguf(g, "gemma3");
  ASSERT_TRUE(hp.ok()) << hp.status();
  ASSERT_EQ(hp->sliding_window.size(), 62u);
  for (int64_t l = 0; l < 62; ++l) EXPECT_EQ(hp->window(l), (l + 1) % 6 == 0 ? 0 : 4096) << l;
  EXPECT_TRUE(hp->qk_norm);
  EXPECT_EQ(hp->rope.theta, 1e6);
  EXPECT_EQ(hp->rope.scaling, RopeParams::Scaling::kLinear);
  EXPECT_EQ(hp->rope.factor, 8);
  ASSERT_TRUE(hp->rope_sliding.has_value());
  EXPECT_EQ(hp->rope_sliding->theta, 10000);
  EXPECT_EQ(hp->rope_sliding->scaling, RopeParams::Scaling::kNone);
  EXPECT_EQ(&hp->rope_for(0), &*hp->rope_sliding);
  EXPECT_EQ(&hp->rope_for(5), &hp->rope);
  // llama.cpp's rule for the 27B model (62 layers): (hidden / heads)^-1/2.
  EXPECT_DOUBLE_EQ(hp->attn_scale, 1 / std::sqrt(64.0 / 4));
  EXPECT_EQ(hp->attn_softcap, 0);
  EXPECT_EQ(hp->final_softcap, 0);
}

TEST(GemmaGgufTest, SlidingWindowPatternFromTheFile) {
  testing::GgufBuilder g = GemmaGguf("gemma3", 4);
  g.RawKv("gemma3.attention.sliding_window_pattern", 9,
          std::string("\x07\x00\x00\x00", 4) + std::string("\x04\x00\x00\x00\x00\x00\x00\x00", 8) +
              std::string("\x01\x00\x00\x01", 4));
  auto hp = FromGguf(g, "gemma3");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->sliding_window, (std::vector<int64_t>{4096, 0, 0, 4096}));

  testing::GgufBuilder period = GemmaGguf("gemma3", 4);
  period.U32("gemma3.attention.sliding_window_pattern", 2);
  hp = FromGguf(period, "gemma3");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->sliding_window, (std::vector<int64_t>{4096, 0, 4096, 0}));
}

TEST(GemmaGgufTest, APatternThatDoesNotMatchTheLayerCountIsRefused) {
  testing::GgufBuilder g = GemmaGguf("gemma3", 4);
  g.RawKv("gemma3.attention.sliding_window_pattern", 9,
          std::string("\x07\x00\x00\x00", 4) + std::string("\x03\x00\x00\x00\x00\x00\x00\x00", 8) +
              std::string("\x01\x00\x01", 3));
  auto hp = FromGguf(g, "gemma3");
  ASSERT_FALSE(hp.ok());
  EXPECT_THAT(std::string(StatusMessage(hp.status())),
              AllOf(HasSubstr("g.gguf"), HasSubstr("gemma3.attention.sliding_window_pattern"),
                    HasSubstr("3 entries for 4 layers")));
  testing::GgufBuilder zero = GemmaGguf("gemma3", 4);
  zero.I32("gemma3.attention.sliding_window_pattern", 0);
  hp = FromGguf(zero, "gemma3");
  ASSERT_FALSE(hp.ok());
  EXPECT_THAT(std::string(StatusMessage(hp.status())),
              AllOf(HasSubstr("sliding_window_pattern"), HasSubstr("positive")));
}

TEST(GemmaHfTest, Gemma2ConfigJson) {
  auto hp = GemmaArchitecture().from_hf(Config(Gemma2Json()), "gemma2");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->architecture, "gemma2");
  EXPECT_EQ(hp->sliding_window, (std::vector<int64_t>{4096, 0, 4096, 0}));
  EXPECT_DOUBLE_EQ(hp->attn_scale, 1 / std::sqrt(24.0));
  EXPECT_EQ(hp->attn_softcap, 50);
  EXPECT_EQ(hp->final_softcap, 30);
  EXPECT_EQ(hp->norm_weight_offset, 1);  // Hugging Face stores w
  EXPECT_TRUE(hp->tied_embeddings);      // Gemma's default
  // Without layer_types (older configs): the period.
  nlohmann::json old = Gemma2Json();
  old.erase("layer_types");
  hp = GemmaArchitecture().from_hf(Config(old), "gemma2");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->sliding_window, (std::vector<int64_t>{4096, 0, 4096, 0}));
  // Null caps are off.
  nlohmann::json off = Gemma2Json();
  off["attn_logit_softcapping"] = nullptr;
  hp = GemmaArchitecture().from_hf(Config(off), "gemma2");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->attn_softcap, 0);
}

TEST(GemmaHfTest, Gemma3TwoRopesFromEitherTransformersVersion) {
  nlohmann::json v5 = Gemma2Json();
  v5["model_type"] = "gemma3_text";
  v5.erase("attn_logit_softcapping");
  v5.erase("final_logit_softcapping");
  v5["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  auto hp = GemmaArchitecture().from_hf(Config(v5), "gemma3_text");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->architecture, "gemma3");
  EXPECT_TRUE(hp->qk_norm);
  EXPECT_EQ(hp->rope.theta, 1e6);
  EXPECT_EQ(hp->rope.scaling, RopeParams::Scaling::kLinear);
  ASSERT_TRUE(hp->rope_sliding.has_value());
  EXPECT_EQ(hp->rope_sliding->theta, 10000);
  EXPECT_EQ(hp->rope_sliding->scaling, RopeParams::Scaling::kNone);
  // transformers 4: rope_theta + rope_scaling for the global layers, rope_local_base_freq.
  nlohmann::json v4 = v5;
  v4.erase("rope_parameters");
  v4["rope_theta"] = 500000.0;
  v4["rope_local_base_freq"] = 20000.0;
  v4["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  hp = GemmaArchitecture().from_hf(Config(v4), "gemma3_text");
  ASSERT_TRUE(hp.ok()) << hp.status();
  EXPECT_EQ(hp->rope.theta, 500000);
  EXPECT_EQ(hp->rope.factor, 4);
  EXPECT_EQ(hp->rope_sliding->theta, 20000);
  EXPECT_EQ(hp->rope_sliding->factor, 1);
}

TEST(GemmaHfTest, BadValuesNameTheKey) {
  auto error = [](nlohmann::json raw, std::string_view variant = "gemma2") {
    auto hp = GemmaArchitecture().from_hf(Config(std::move(raw)), variant);
    EXPECT_FALSE(hp.ok());
    return hp.ok() ? std::string() : std::string(StatusMessage(hp.status()));
  };
  nlohmann::json j = Gemma2Json();
  j["attn_logit_softcapping"] = 0;
  EXPECT_THAT(error(j), AllOf(HasSubstr("config.json"), HasSubstr("\"attn_logit_softcapping\""),
                              HasSubstr("positive")));
  j = Gemma2Json();
  j["final_logit_softcapping"] = -30;
  EXPECT_THAT(error(j), HasSubstr("\"final_logit_softcapping\" is -30"));
  j = Gemma2Json();
  j["query_pre_attn_scalar"] = 0;
  EXPECT_THAT(error(j), HasSubstr("\"query_pre_attn_scalar\""));
  j = Gemma2Json();
  j["layer_types"] = {"sliding_attention", "full_attention"};
  EXPECT_THAT(error(j), HasSubstr("\"layer_types\" has 2 entries for 4 layers"));
  j = Gemma2Json();
  j["hidden_activation"] = "relu";
  EXPECT_THAT(error(j),
              AllOf(HasSubstr("hidden_activation 'relu'"), HasSubstr("gelu_pytorch_tanh")));
  j = Gemma2Json();
  j["model_type"] = "gemma3_text";
  j["use_bidirectional_attention"] = true;
  EXPECT_THAT(error(j, "gemma3_text"), HasSubstr("use_bidirectional_attention"));
}

TEST(AttentionConfigTest, ReplacesTheModelsModifiersOnEveryLayer) {
  auto hp = GemmaArchitecture().from_hf(Config(Gemma2Json()), "gemma2");
  ASSERT_TRUE(hp.ok()) << hp.status();
  config::AttentionConfig a;
  a.mask = "causal";
  a.score = "none";
  LlmHParams causal = *hp;
  ApplyAttentionConfig(a, causal);
  EXPECT_TRUE(causal.sliding_window.empty());
  EXPECT_EQ(causal.attn_softcap, 0);
  EXPECT_EQ(causal.final_softcap, 30);  // not an attention modifier

  a = {};
  a.mask = "sliding_window";
  a.window = 128;
  a.score = "alibi";
  LlmHParams window = *hp;
  ApplyAttentionConfig(a, window);
  EXPECT_EQ(window.sliding_window, (std::vector<int64_t>(4, 128)));
  EXPECT_TRUE(window.alibi);
  EXPECT_EQ(window.attn_softcap, 0);

  a = {};
  a.mask = "chunked";  // score: the model's own
  a.chunk = 64;
  LlmHParams chunked = *hp;
  ApplyAttentionConfig(a, chunked);
  EXPECT_TRUE(chunked.sliding_window.empty());
  EXPECT_EQ(chunked.attention_chunk, 64);
  EXPECT_EQ(chunked.attn_softcap, 50);

  a = {};
  a.score = "softcap";  // mask: the model's own
  a.softcap = 20;
  LlmHParams capped = *hp;
  ApplyAttentionConfig(a, capped);
  EXPECT_EQ(capped.sliding_window, hp->sliding_window);
  EXPECT_EQ(capped.attn_softcap, 20);
  EXPECT_TRUE(ValidateHParams(capped, "x").ok());
}

}  // namespace
}  // namespace kiln::models
