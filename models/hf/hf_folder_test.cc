#include "models/hf/hf_folder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace kiln::models {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class HfFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("kiln_hf_folder_" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  std::string Error() {
    auto f = HfFolder::Open(dir_.string());
    EXPECT_FALSE(f.ok());
    return f.ok() ? "" : std::string(StatusMessage(f.status()));
  }
  std::filesystem::path dir_;
};

TEST_F(HfFolderTest, ParsesEverything) {
  Write("config.json", R"({"model_type":"llama","architectures":["LlamaForCausalLM"],
    "hidden_size":576,"rope_theta":100000.0,"tie_word_embeddings":true,"torch_dtype":"bfloat16"})");
  Write("tokenizer_config.json", R"({
    "add_bos_token": false, "bos_token": "<|im_start|>",
    "eos_token": {"content": "<|im_end|>", "lstrip": false},
    "pad_token": null, "model_max_length": 1000000000000000019884624838656,
    "chat_template": "{{ messages }}",
    "added_tokens_decoder": {
      "2": {"content": "<|im_end|>", "special": true, "lstrip": false, "rstrip": false, "normalized": false},
      "0": {"content": "<|endoftext|>", "special": true}
    }})");
  Write("generation_config.json",
        R"({"eos_token_id":[2, 0],"bos_token_id":1,"temperature":0.2,"top_k":50})");
  Write("tokenizer.json", "{}");
  Write("model.safetensors", "");
  auto f = HfFolder::Open(dir_.string());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->config.model_type, "llama");
  EXPECT_THAT(f->config.architectures, ElementsAre("LlamaForCausalLM"));
  EXPECT_EQ(f->config.torch_dtype, "bfloat16");
  EXPECT_EQ(*f->config.GetInt("hidden_size"), 576);
  EXPECT_DOUBLE_EQ(*f->config.GetFloat("rope_theta"), 100000.0);
  EXPECT_DOUBLE_EQ(*f->config.GetFloat("hidden_size"), 576.0);
  EXPECT_TRUE(*f->config.GetBool("tie_word_embeddings"));
  EXPECT_EQ(f->config.GetInt("num_layers").status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(StatusMessage(f->config.GetInt("rope_theta").status())),
              HasSubstr("config.json: \"rope_theta\" must be an integer"));

  ASSERT_TRUE(f->tokenizer_config.has_value());
  const HfTokenizerConfig& tc = *f->tokenizer_config;
  EXPECT_EQ(tc.bos_token, "<|im_start|>");
  EXPECT_EQ(tc.eos_token, "<|im_end|>");
  EXPECT_FALSE(tc.pad_token.has_value());
  EXPECT_EQ(tc.add_bos_token, false);
  EXPECT_FALSE(tc.model_max_length.has_value());  // 1e30 means unbounded
  EXPECT_EQ(tc.chat_template, "{{ messages }}");
  ASSERT_EQ(tc.added_tokens.size(), 2u);
  EXPECT_EQ(tc.added_tokens[0].id, 0);
  EXPECT_EQ(tc.added_tokens[1].content, "<|im_end|>");
  EXPECT_TRUE(tc.added_tokens[1].special);
  EXPECT_FALSE(tc.added_tokens[1].normalized);

  ASSERT_TRUE(f->generation_config.has_value());
  EXPECT_THAT(f->generation_config->eos_token_ids, ElementsAre(2, 0));
  EXPECT_EQ(f->generation_config->bos_token_id, 1);
  EXPECT_DOUBLE_EQ(*f->generation_config->temperature, 0.2);
  EXPECT_EQ(f->generation_config->top_k, 50);
  EXPECT_EQ(f->tokenizer_json_path, (dir_ / "tokenizer.json").string());
  EXPECT_EQ(f->weights_path, (dir_ / "model.safetensors").string());
}

TEST_F(HfFolderTest, NamedTemplatesAndJinjaFile) {
  Write("config.json", R"({"model_type":"qwen2"})");
  Write("tokenizer_config.json", R"({"chat_template":[{"name":"default","template":"A"},
    {"name":"tool_use","template":"B"}]})");
  Write("generation_config.json", R"({"eos_token_id": 7})");
  auto f = HfFolder::Open(dir_.string());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tokenizer_config->chat_template, "A");
  EXPECT_EQ(f->tokenizer_config->named_chat_templates.at("tool_use"), "B");
  EXPECT_THAT(f->generation_config->eos_token_ids, ElementsAre(7));
  EXPECT_TRUE(f->tokenizer_json_path.empty());
  EXPECT_TRUE(f->weights_path.empty());

  Write("tokenizer_config.json", R"({"eos_token":"</s>"})");
  Write("chat_template.jinja", "{{ bos_token }}");
  auto g = HfFolder::Open(dir_.string());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->tokenizer_config->chat_template, "{{ bos_token }}");
}

TEST_F(HfFolderTest, ClearErrors) {
  EXPECT_THAT(Error(), HasSubstr("no config.json"));
  Write("config.json", R"({"model_type": )");
  EXPECT_THAT(Error(), HasSubstr("config.json: not valid JSON"));
  Write("config.json", R"({"hidden_size": 1})");
  EXPECT_THAT(Error(), HasSubstr("key \"model_type\" is missing"));
  Write("config.json", R"({"model_type":"llama"})");
  Write("tokenizer_config.json", R"({"chat_template": 5})");
  EXPECT_THAT(Error(), HasSubstr("\"chat_template\" must be a string or a list"));
  Write("tokenizer_config.json", R"({"eos_token": 5})");
  EXPECT_THAT(Error(), HasSubstr("\"eos_token\" must be a string or an object"));
  Write("tokenizer_config.json", R"({"added_tokens_decoder": {"x": {"content": "a"}}})");
  EXPECT_THAT(Error(), HasSubstr("key \"x\" is not a token id"));
  Write("tokenizer_config.json",
        R"({"added_tokens_decoder": {"1": {"content": "a", "special": "yes"}}})");
  EXPECT_THAT(Error(), HasSubstr("tokenizer_config.json: unexpected value"));
  Write("tokenizer_config.json", "{}");
  Write("generation_config.json", R"({"eos_token_id": "2"})");
  EXPECT_THAT(Error(), HasSubstr("\"eos_token_id\" must be a token id or a list"));
  Write("generation_config.json", R"({"temperature": "hot"})");
  EXPECT_THAT(Error(), HasSubstr("\"temperature\" must be a number"));
}

}  // namespace
}  // namespace kiln::models
