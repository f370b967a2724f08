// A Hugging Face model folder: config.json, tokenizer.json, tokenizer_config.json (with the
// chat template), generation_config.json and the safetensors weights.
//
//   KILN_ASSIGN_OR_RETURN(HfFolder hf, HfFolder::Open("/models/SmolLM2-135M-Instruct"));
//   hf.config.model_type            // "llama"
//   hf.tokenizer_config->chat_template
//
// Only config.json is required. Each JSON file is parsed into a plain struct with the fields
// Kiln uses, plus the raw JSON for architecture-specific keys. Errors name the file and the
// key and say what is allowed.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/base/status.h"

namespace kiln::models {

// config.json.
struct HfModelConfig {
  std::string model_type;                  // "llama", "qwen2", "gpt2", ... (required)
  std::vector<std::string> architectures;  // "LlamaForCausalLM", ...
  std::string torch_dtype;                 // "bfloat16", ... ("" if absent)
  nlohmann::json raw;                      // the whole object

  // Typed access to architecture keys; NotFound / InvalidArgument naming config.json and key.
  StatusOr<int64_t> GetInt(const std::string& key) const;
  StatusOr<double> GetFloat(const std::string& key) const;  // ints accepted
  StatusOr<bool> GetBool(const std::string& key) const;
  StatusOr<std::string> GetString(const std::string& key) const;
  std::string path;  // for messages
};

// One entry of tokenizer_config.json's "added_tokens_decoder" (or tokenizer.json's
// "added_tokens").
struct HfAddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool single_word = false;
};

// tokenizer_config.json.
struct HfTokenizerConfig {
  // Special tokens: written as strings or as {"content": ...} objects.
  std::optional<std::string> bos_token, eos_token, unk_token, pad_token;
  std::optional<bool> add_bos_token, add_eos_token;
  // The default chat template ("" if none) and named ones ("tool_use", ...) when
  // "chat_template" is a list of {"name", "template"}; a "default" entry becomes
  // `chat_template`. A chat_template.jinja file beside it is used when the JSON has none.
  std::string chat_template;
  std::map<std::string, std::string> named_chat_templates;
  std::vector<HfAddedToken> added_tokens;  // from added_tokens_decoder, sorted by id
  std::optional<int64_t> model_max_length;
  bool clean_up_tokenization_spaces = false;
  std::string tokenizer_class;
  nlohmann::json raw;

  static StatusOr<HfTokenizerConfig> FromJson(const nlohmann::json& j, const std::string& path);
};

// generation_config.json.
struct HfGenerationConfig {
  std::vector<int32_t> eos_token_ids;  // "eos_token_id": int or list
  std::optional<int32_t> bos_token_id, pad_token_id;
  std::optional<bool> do_sample;
  std::optional<double> temperature, top_p, min_p, repetition_penalty;
  std::optional<int64_t> top_k, max_length, max_new_tokens;
  nlohmann::json raw;

  static StatusOr<HfGenerationConfig> FromJson(const nlohmann::json& j, const std::string& path);
};

struct HfFolder {
  std::string dir;
  HfModelConfig config;
  std::optional<HfTokenizerConfig> tokenizer_config;
  std::optional<HfGenerationConfig> generation_config;
  std::string tokenizer_json_path;  // "" when absent
  // model.safetensors.index.json if present, else model.safetensors, else "".
  std::string weights_path;

  // REQUIRES: `dir` is a folder containing config.json.
  static StatusOr<HfFolder> Open(const std::string& dir);
};

// Reads and parses a JSON file; InvalidArgument with the byte position on a syntax error.
StatusOr<nlohmann::json> ReadJsonFile(const std::string& path);

}  // namespace kiln::models
