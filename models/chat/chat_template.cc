#include "models/chat/chat_template.h"

#include <cctype>
#include <cstring>

#include "models/gguf/gguf.h"
#include "models/hf/hf_folder.h"
#include "models/io/errors.h"

namespace kiln::models {
namespace {

bool PathDelimiter(char c) {
  // Not '<' and '>': "</s>" is one token (markup), not "<", "/s", ">".
  return std::isspace(static_cast<unsigned char>(c)) ||
         (c != '\0' && std::strchr("'\"`()[]{},;=", c) != nullptr);
}

bool PathChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
         c == '~';
}

// "/srv/models/x.gguf", "~/m", "./m", "models/x/tokenizer_config.json"; not "</s>", "//",
// "1/2.5" or "a/b".
bool LooksLikePath(std::string_view t) {
  if (t.size() >= 2 && t[0] == '/') return PathChar(t[1]);
  if (t.starts_with("~/") || t.starts_with("./") || t.starts_with("../")) return true;
  const size_t slash = t.rfind('/');
  if (slash == std::string_view::npos) return false;
  const std::string_view last = t.substr(slash + 1);
  const size_t dot = last.rfind('.');
  if (dot == std::string_view::npos || dot == 0 || last.size() - dot > 13) return false;
  if (!std::isalpha(static_cast<unsigned char>(last[dot + 1]))) return false;
  for (char c : last.substr(dot + 1)) {
    if (!std::isalnum(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::Parse(std::string_view source,
                                                            std::string name) {
  std::unique_ptr<ChatTemplate> t(new ChatTemplate());
  t->source_ = std::string(source);
  KILN_ASSIGN_OR_RETURN(t->template_, jinja::Template::Parse(source, std::move(name)));
  return t;
}

StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromGguf(const GgufFile& gguf) {
  if (!gguf.Has("tokenizer.chat_template")) {
    return NotFound(gguf.path(), ": no tokenizer.chat_template in the GGUF metadata");
  }
  KILN_ASSIGN_OR_RETURN(std::string_view src, gguf.GetString("tokenizer.chat_template"));
  // Named by its key, not the file: rendering errors reach API clients, who must not learn
  // where the server keeps its models (the loader logs parse errors with the path).
  KILN_ASSIGN_OR_RETURN(auto t, Parse(src, "tokenizer.chat_template"));
  if (gguf.Has("tokenizer.ggml.tokens")) {
    KILN_ASSIGN_OR_RETURN(auto tokens, gguf.GetStringArray("tokenizer.ggml.tokens"));
    auto token = [&](const char* key, std::string* out) -> Status {
      if (!gguf.Has(key)) return OkStatus();
      KILN_ASSIGN_OR_RETURN(uint32_t id, gguf.GetU32(key));
      if (id < tokens.size()) *out = std::string(tokens[id]);
      return OkStatus();
    };
    KILN_RETURN_IF_ERROR(token("tokenizer.ggml.bos_token_id", &t->bos_));
    KILN_RETURN_IF_ERROR(token("tokenizer.ggml.eos_token_id", &t->eos_));
  }
  return t;
}

StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromHfFolder(const HfFolder& folder) {
  if (!folder.tokenizer_config || folder.tokenizer_config->chat_template.empty()) {
    return NotFound(folder.dir,
                    ": no chat_template in tokenizer_config.json or chat_template.jinja");
  }
  const HfTokenizerConfig& tc = *folder.tokenizer_config;
  KILN_ASSIGN_OR_RETURN(auto t, Parse(tc.chat_template, "tokenizer_config.json: chat_template"));
  t->bos_ = tc.bos_token.value_or("");
  t->eos_ = tc.eos_token.value_or("");
  return t;
}

StatusOr<std::string> ChatTemplate::Apply(const Inputs& in) const {
  if (!in.messages.is_array()) return InvalidArgument("messages must be a list");
  for (size_t i = 0; i < in.messages.size(); ++i) {
    const auto& m = in.messages[i];
    if (!m.is_object()) return InvalidArgument("messages[", i, "] must be an object");
    if (!m.contains("role") || !m["role"].is_string()) {
      return InvalidArgument("messages[", i, "].role must be a string");
    }
    if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null() &&
        !m["content"].is_array()) {
      return InvalidArgument("messages[", i, "].content must be a string, a list of parts or null");
    }
  }
  if (!in.tools.is_null() && !in.tools.is_array())
    return InvalidArgument("tools must be a list or null");
  if (!in.extra.is_object()) return InvalidArgument("extra template variables must be an object");
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = in.messages;
  ctx["tools"] = in.tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = in.add_generation_prompt;
  ctx["bos_token"] = in.bos_token.empty() ? bos_ : in.bos_token;
  ctx["eos_token"] = in.eos_token.empty() ? eos_ : in.eos_token;
  for (auto it = in.extra.begin(); it != in.extra.end(); ++it) ctx[it.key()] = it.value();
  StatusOr<std::string> out = template_->Render(ctx);
  if (!out.ok()) return Status(out.status().code(), WithoutPaths(StatusMessage(out.status())));
  return out;
}

std::string WithoutPaths(std::string_view message) {
  std::string out;
  out.reserve(message.size());
  size_t i = 0;
  while (i < message.size()) {
    if (PathDelimiter(message[i])) {
      out += message[i++];
      continue;
    }
    size_t end = i;
    while (end < message.size() && !PathDelimiter(message[end])) ++end;
    std::string_view token = message.substr(i, end - i);
    // Punctuation that ends a sentence or introduces a position is not part of the path.
    size_t keep = token.size();
    while (keep > 0 && std::strchr(":.", token[keep - 1])) --keep;
    if (LooksLikePath(token.substr(0, keep))) {
      out += "<path>";
      out += token.substr(keep);
    } else {
      out += token;
    }
    i = end;
  }
  return out;
}

}  // namespace kiln::models
