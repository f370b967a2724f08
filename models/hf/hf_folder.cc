#include "models/hf/hf_folder.h"

#include <sys/stat.h>

#include <algorithm>

#include "models/io/errors.h"
#include "models/io/mapped_file.h"

namespace kiln::models {
namespace {

using json = nlohmann::json;

bool IsFile(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string TypeName(const json& v) { return v.type_name(); }

// A special token written as "<s>" or {"content": "<s>", ...}; null means absent.
StatusOr<std::optional<std::string>> TokenString(const json& j, const char* key,
                                                 const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return std::optional<std::string>((*it)["content"].get<std::string>());
  }
  return InvalidArgument(path, ": \"", key,
                         "\" must be a string or an object with \"content\", got ", TypeName(*it));
}

template <typename T>
StatusOr<std::optional<T>> Optional(const json& j, const char* key, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<T>();
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean())
      return InvalidArgument(path, ": \"", key, "\" must be a boolean, got ", it->dump());
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer())
      return InvalidArgument(path, ": \"", key, "\" must be an integer, got ", it->dump());
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number())
      return InvalidArgument(path, ": \"", key, "\" must be a number, got ", it->dump());
  }
  return std::optional<T>(it->get<T>());
}

}  // namespace

StatusOr<json> ReadJsonFile(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  try {
    return json::parse(file->bytes());
  } catch (const json::parse_error& e) {
    return InvalidArgument(path, ": not valid JSON (byte ", e.byte, "): ", e.what());
  } catch (const json::exception& e) {
    return InvalidArgument(path, ": not valid JSON: ", e.what());
  }
}

StatusOr<int64_t> HfModelConfig::GetInt(const std::string& key) const {
  auto it = raw.find(key);
  if (it == raw.end() || it->is_null()) return NotFound(path, ": key \"", key, "\" is missing");
  if (!it->is_number_integer())
    return InvalidArgument(path, ": \"", key, "\" must be an integer, got ", it->dump());
  return it->get<int64_t>();
}
StatusOr<double> HfModelConfig::GetFloat(const std::string& key) const {
  auto it = raw.find(key);
  if (it == raw.end() || it->is_null()) return NotFound(path, ": key \"", key, "\" is missing");
  if (!it->is_number())
    return InvalidArgument(path, ": \"", key, "\" must be a number, got ", it->dump());
  return it->get<double>();
}
StatusOr<bool> HfModelConfig::GetBool(const std::string& key) const {
  auto it = raw.find(key);
  if (it == raw.end() || it->is_null()) return NotFound(path, ": key \"", key, "\" is missing");
  if (!it->is_boolean())
    return InvalidArgument(path, ": \"", key, "\" must be a boolean, got ", it->dump());
  return it->get<bool>();
}
StatusOr<std::string> HfModelConfig::GetString(const std::string& key) const {
  auto it = raw.find(key);
  if (it == raw.end() || it->is_null()) return NotFound(path, ": key \"", key, "\" is missing");
  if (!it->is_string())
    return InvalidArgument(path, ": \"", key, "\" must be a string, got ", it->dump());
  return it->get<std::string>();
}

namespace {
StatusOr<HfTokenizerConfig> ParseHfTokenizerConfig(const json& j, const std::string& path);
}  // namespace

StatusOr<HfTokenizerConfig> HfTokenizerConfig::FromJson(const json& j, const std::string& path) {
  try {
    return ParseHfTokenizerConfig(j, path);
  } catch (const json::exception& e) {
    return InvalidArgument(path, ": unexpected value: ", e.what());
  }
}

namespace {
StatusOr<HfTokenizerConfig> ParseHfTokenizerConfig(const json& j, const std::string& path) {
  if (!j.is_object()) return InvalidArgument(path, ": must be a JSON object");
  HfTokenizerConfig c;
  c.raw = j;
  KILN_ASSIGN_OR_RETURN(c.bos_token, TokenString(j, "bos_token", path));
  KILN_ASSIGN_OR_RETURN(c.eos_token, TokenString(j, "eos_token", path));
  KILN_ASSIGN_OR_RETURN(c.unk_token, TokenString(j, "unk_token", path));
  KILN_ASSIGN_OR_RETURN(c.pad_token, TokenString(j, "pad_token", path));
  KILN_ASSIGN_OR_RETURN(c.add_bos_token, Optional<bool>(j, "add_bos_token", path));
  KILN_ASSIGN_OR_RETURN(c.add_eos_token, Optional<bool>(j, "add_eos_token", path));
  KILN_ASSIGN_OR_RETURN(auto clean, Optional<bool>(j, "clean_up_tokenization_spaces", path));
  c.clean_up_tokenization_spaces = clean.value_or(false);
  if (auto it = j.find("tokenizer_class"); it != j.end() && it->is_string()) {
    c.tokenizer_class = it->get<std::string>();
  }
  if (auto it = j.find("model_max_length"); it != j.end() && it->is_number()) {
    // Often 1e30 ("unbounded"), written as a float.
    double v = it->get<double>();
    if (v >= 0 && v < 9.0e18) c.model_max_length = static_cast<int64_t>(v);
  }
  if (auto it = j.find("chat_template"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      c.chat_template = it->get<std::string>();
    } else if (it->is_array()) {
      for (const json& e : *it) {
        if (!e.is_object() || !e.contains("name") || !e.contains("template") ||
            !e["name"].is_string() || !e["template"].is_string()) {
          return InvalidArgument(path,
                                 ": \"chat_template\" list entries must be "
                                 "{\"name\": string, \"template\": string}");
        }
        std::string name = e["name"].get<std::string>();
        if (name == "default") c.chat_template = e["template"].get<std::string>();
        c.named_chat_templates[name] = e["template"].get<std::string>();
      }
    } else {
      return InvalidArgument(path,
                             ": \"chat_template\" must be a string or a list of named "
                             "templates, got ",
                             TypeName(*it));
    }
  }
  if (auto it = j.find("added_tokens_decoder"); it != j.end() && !it->is_null()) {
    if (!it->is_object())
      return InvalidArgument(path, ": \"added_tokens_decoder\" must be an object");
    for (auto e = it->begin(); e != it->end(); ++e) {
      HfAddedToken t;
      try {
        size_t used = 0;
        long id = std::stol(e.key(), &used);
        if (used != e.key().size() || id < 0 || id > INT32_MAX) throw std::invalid_argument("id");
        t.id = static_cast<int32_t>(id);
      } catch (const std::exception&) {
        return InvalidArgument(path, ": added_tokens_decoder key \"", e.key(),
                               "\" is not a token id");
      }
      const json& v = e.value();
      if (!v.is_object() || !v.contains("content") || !v["content"].is_string()) {
        return InvalidArgument(path, ": added_tokens_decoder[\"", e.key(),
                               "\"] needs a string \"content\"");
      }
      t.content = v["content"].get<std::string>();
      t.special = v.value("special", false);
      t.lstrip = v.value("lstrip", false);
      t.rstrip = v.value("rstrip", false);
      t.normalized = v.value("normalized", !t.special);
      t.single_word = v.value("single_word", false);
      c.added_tokens.push_back(std::move(t));
    }
    std::sort(c.added_tokens.begin(), c.added_tokens.end(),
              [](const HfAddedToken& a, const HfAddedToken& b) { return a.id < b.id; });
  }
  return c;
}
}  // namespace

namespace {
StatusOr<HfGenerationConfig> ParseHfGenerationConfig(const json& j, const std::string& path);
}  // namespace

StatusOr<HfGenerationConfig> HfGenerationConfig::FromJson(const json& j, const std::string& path) {
  try {
    return ParseHfGenerationConfig(j, path);
  } catch (const json::exception& e) {
    return InvalidArgument(path, ": unexpected value: ", e.what());
  }
}

namespace {
StatusOr<HfGenerationConfig> ParseHfGenerationConfig(const json& j, const std::string& path) {
  if (!j.is_object()) return InvalidArgument(path, ": must be a JSON object");
  HfGenerationConfig g;
  g.raw = j;
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    auto add = [&](const json& v) -> Status {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
        return InvalidArgument(path, ": \"eos_token_id\" must be a token id or a list of ids, got ",
                               it->dump());
      }
      g.eos_token_ids.push_back(v.get<int32_t>());
      return OkStatus();
    };
    if (it->is_array()) {
      for (const json& v : *it) KILN_RETURN_IF_ERROR(add(v));
    } else {
      KILN_RETURN_IF_ERROR(add(*it));
    }
  }
  KILN_ASSIGN_OR_RETURN(g.bos_token_id, Optional<int32_t>(j, "bos_token_id", path));
  KILN_ASSIGN_OR_RETURN(g.pad_token_id, Optional<int32_t>(j, "pad_token_id", path));
  KILN_ASSIGN_OR_RETURN(g.do_sample, Optional<bool>(j, "do_sample", path));
  KILN_ASSIGN_OR_RETURN(g.temperature, Optional<double>(j, "temperature", path));
  KILN_ASSIGN_OR_RETURN(g.top_p, Optional<double>(j, "top_p", path));
  KILN_ASSIGN_OR_RETURN(g.min_p, Optional<double>(j, "min_p", path));
  KILN_ASSIGN_OR_RETURN(g.repetition_penalty, Optional<double>(j, "repetition_penalty", path));
  KILN_ASSIGN_OR_RETURN(g.top_k, Optional<int64_t>(j, "top_k", path));
  KILN_ASSIGN_OR_RETURN(g.max_length, Optional<int64_t>(j, "max_length", path));
  KILN_ASSIGN_OR_RETURN(g.max_new_tokens, Optional<int64_t>(j, "max_new_tokens", path));
  return g;
}
}  // namespace

StatusOr<HfFolder> HfFolder::Open(const std::string& dir) {
  HfFolder f;
  f.dir = dir;
  const std::string config_path = dir + "/config.json";
  if (!IsFile(config_path)) {
    return NotFound(dir, ": not a Hugging Face model folder (no config.json)");
  }
  KILN_ASSIGN_OR_RETURN(json config, ReadJsonFile(config_path));
  if (!config.is_object()) return InvalidArgument(config_path, ": must be a JSON object");
  f.config.raw = config;
  f.config.path = config_path;
  KILN_ASSIGN_OR_RETURN(f.config.model_type, f.config.GetString("model_type"));
  if (auto it = config.find("architectures"); it != config.end() && it->is_array()) {
    for (const json& a : *it) {
      if (a.is_string()) f.config.architectures.push_back(a.get<std::string>());
    }
  }
  if (auto it = config.find("torch_dtype"); it != config.end() && it->is_string()) {
    f.config.torch_dtype = it->get<std::string>();
  } else if (auto d = config.find("dtype"); d != config.end() && d->is_string()) {
    f.config.torch_dtype = d->get<std::string>();
  }

  const std::string tc_path = dir + "/tokenizer_config.json";
  if (IsFile(tc_path)) {
    KILN_ASSIGN_OR_RETURN(json tc, ReadJsonFile(tc_path));
    KILN_ASSIGN_OR_RETURN(f.tokenizer_config, HfTokenizerConfig::FromJson(tc, tc_path));
  }
  // Newer exports keep the template in its own file.
  const std::string jinja_path = dir + "/chat_template.jinja";
  if (IsFile(jinja_path) && (!f.tokenizer_config || f.tokenizer_config->chat_template.empty())) {
    KILN_ASSIGN_OR_RETURN(auto file, MappedFile::Open(jinja_path));
    if (!f.tokenizer_config) f.tokenizer_config = HfTokenizerConfig();
    f.tokenizer_config->chat_template = std::string(file->bytes());
  }
  const std::string gc_path = dir + "/generation_config.json";
  if (IsFile(gc_path)) {
    KILN_ASSIGN_OR_RETURN(json gc, ReadJsonFile(gc_path));
    KILN_ASSIGN_OR_RETURN(f.generation_config, HfGenerationConfig::FromJson(gc, gc_path));
  }
  if (IsFile(dir + "/tokenizer.json")) f.tokenizer_json_path = dir + "/tokenizer.json";
  if (IsFile(dir + "/model.safetensors.index.json")) {
    f.weights_path = dir + "/model.safetensors.index.json";
  } else if (IsFile(dir + "/model.safetensors")) {
    f.weights_path = dir + "/model.safetensors";
  }
  return f;
}

}  // namespace kiln::models
