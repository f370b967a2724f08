// Chat templates: render a model's own Jinja chat template into a prompt.
//
//   KILN_ASSIGN_OR_RETURN(auto tmpl, ChatTemplate::FromGguf(*gguf));
//   ChatTemplate::Inputs in;
//   in.messages = {{{"role", "user"}, {"content", "Hi"}}};
//   KILN_ASSIGN_OR_RETURN(std::string prompt, tmpl->Apply(in));
//
// The template sees the variables transformers' apply_chat_template passes: messages,
// add_generation_prompt, bos_token, eos_token, tools (none unless given), documents (none),
// plus `extra` (e.g. date_string). See models/chat/jinja.h for the supported Jinja subset;
// `raise_exception("...")` in a template becomes InvalidArgument carrying that message.
//
// Thread-safety: immutable after construction; Apply may run concurrently.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/base/status.h"
#include "models/chat/jinja.h"

namespace kiln::models {

class GgufFile;
struct HfFolder;

class ChatTemplate {
 public:
  struct Inputs {
    // [{"role": "user", "content": "..."}, ...]; content may also be null or a list of parts
    // (passed to the template as is). Extra keys (tool_calls, name, ...) are kept.
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    bool add_generation_prompt = true;
    std::string bos_token;
    std::string eos_token;
    nlohmann::ordered_json tools = nullptr;  // list of tool schemas, or null
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // more variables
  };

  // Parses `source`; `name` prefixes error positions ("chat_template:12:5: ...").
  static StatusOr<std::unique_ptr<ChatTemplate>> Parse(std::string_view source,
                                                       std::string name = "chat_template");
  // From GGUF `tokenizer.chat_template`; NotFound when the file has none. bos/eos default to
  // the tokens named by tokenizer.ggml.bos/eos_token_id.
  static StatusOr<std::unique_ptr<ChatTemplate>> FromGguf(const GgufFile& gguf);
  // From tokenizer_config.json (or chat_template.jinja); NotFound when there is none.
  static StatusOr<std::unique_ptr<ChatTemplate>> FromHfFolder(const HfFolder& folder);

  // Validates `inputs.messages` (a list of objects with a string "role"), then renders.
  // Empty bos_token/eos_token in `inputs` fall back to the defaults from the model.
  // Errors reach API clients, so they never name a file on the server: the template's name
  // is its key (tokenizer.chat_template), and anything path-like in a message (from
  // raise_exception, say) reads `<path>` (WithoutPaths).
  StatusOr<std::string> Apply(const Inputs& inputs) const;

  const std::string& source() const { return source_; }
  const std::string& default_bos() const { return bos_; }
  const std::string& default_eos() const { return eos_; }

 private:
  ChatTemplate() = default;
  std::string source_;
  std::string bos_, eos_;
  std::unique_ptr<jinja::Template> template_;
};

// `message` with every file path in it ("/srv/models/x.gguf", "./m", "models/x/a.json")
// replaced by `<path>`; markup such as "</s>" and arithmetic such as "1/2.5" are kept.
std::string WithoutPaths(std::string_view message);

}  // namespace kiln::models
