#include "scheduler/llm/prompt.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "models/chat/chat_template.h"
#include "models/chat/tool_calls.h"
#include "models/llm/llm_model.h"
#include "scheduler/llm/generate_request.h"

namespace kiln {
namespace {

using ojson = nlohmann::ordered_json;

bool KnownRole(std::string_view role) {
  return role == "system" || role == "user" || role == "assistant" || role == "tool" ||
         role == "developer";
}

Status Bad(std::string_view param, Status status) { return WithParam(std::move(status), param); }

// The first control token that `text` would produce if special tokens were parsed in it.
std::optional<int32_t> ControlTokenIn(const models::Tokenizer& tok, std::string_view text) {
  auto ids = tok.Encode(text, {.add_special_tokens = false, .parse_special = true});
  if (!ids.ok()) return std::nullopt;
  for (int32_t id : *ids) {
    if (tok.IsSpecial(id)) return id;
  }
  return std::nullopt;
}

StatusOr<std::vector<int32_t>> Encode(const models::Tokenizer& tok, std::string_view text,
                                      models::EncodeOptions options, std::string_view field) {
  auto ids = tok.Encode(text, options);
  if (!ids.ok()) return Bad(field, Annotate(ids.status(), StrCat("`", field, "`")));
  return std::move(*ids);
}

StatusOr<Prompt> BuildChat(const models::LlmModel& model, std::string_view model_name,
                           const PromptInput& req) {
  const models::ChatTemplate* tmpl = model.chat_template();
  if (tmpl == nullptr) {
    return Bad(req.field, InvalidArgument("model '", model_name,
                                          "' has no chat template; send a plain-text prompt "
                                          "(/v1/completions) instead of chat messages"));
  }
  KILN_ASSIGN_OR_RETURN(ojson messages, NormalizeMessages(req.messages, req.field));
  models::ChatTemplate::Inputs in;
  // Tools: to the template where it renders them, else into the system prompt in Hermes'
  // words; past calls into the assistant's text where the template drops them.
  const models::ToolSupport tools = models::DetectToolSupport(tmpl->source());
  if (!req.tools.is_null() && tools.renders_tools) in.tools = req.tools;
  if (!req.tools.is_null() && !tools.renders_tools) {
    const std::string prompt = models::ToolSystemPrompt(req.tools);
    if (!messages.empty() && messages[0]["role"] == "system") {
      messages[0]["content"] = StrCat(messages[0]["content"].get<std::string>(), "\n\n", prompt);
    } else {
      messages.insert(messages.begin(), ojson{{"role", "system"}, {"content", prompt}});
    }
  }
  if (!tools.renders_tool_calls) {
    for (ojson& m : messages) {
      if (m["role"] != "assistant" || !m.contains("tool_calls") || !m["tool_calls"].is_array()) {
        continue;
      }
      const std::string& text = m["content"].get_ref<const std::string&>();
      m["content"] = StrCat(text, text.empty() ? "" : "\n",
                            models::RenderToolCalls(tools.format, m["tool_calls"]));
    }
  }
  in.messages = messages;
  in.add_generation_prompt = req.add_generation_prompt;
  auto rendered = tmpl->Apply(in);
  if (!rendered.ok()) {
    return Bad(req.field, Annotate(rendered.status(), StrCat("`", req.field, "`")));
  }
  const models::Tokenizer& tok = model.tokenizer();
  Prompt out;
  out.text = std::move(*rendered);

  // Where no message carries control-token text, the whole rendering tokenizes exactly as
  // transformers would (template markup parsed as control tokens).
  std::optional<size_t> tainted;
  std::optional<int32_t> token;
  for (size_t i = 0; i < messages.size() && !tainted; ++i) {
    const ojson& c = messages[i]["content"];
    if (!c.is_string()) continue;
    if ((token = ControlTokenIn(tok, c.get_ref<const std::string&>()))) tainted = i;
  }
  if (!tainted) {
    KILN_ASSIGN_OR_RETURN(
        out.ids,
        Encode(tok, out.text, {.add_special_tokens = false, .parse_special = true}, req.field));
    return out;
  }

  // Otherwise render again with each content replaced by a unique marker, tokenize the
  // markup between markers with control tokens and the contents without. This is exact only
  // if the template copies contents verbatim (no trim, no filters): check that putting the
  // contents back gives the same text.
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  const std::string nonce = absl::StrCat(rng());
  auto marker = [&](size_t i) { return absl::StrCat("\x1e", nonce, ":", i, "\x1e"); };
  ojson marked = messages;
  std::vector<std::pair<std::string, std::string>> contents;  // marker, content
  for (size_t i = 0; i < marked.size(); ++i) {
    if (!marked[i]["content"].is_string()) continue;
    contents.emplace_back(marker(i), marked[i]["content"].get<std::string>());
    marked[i]["content"] = contents.back().first;
  }
  in.messages = marked;
  auto skeleton = tmpl->Apply(in);
  std::vector<int32_t> ids;
  std::string rebuilt;
  bool verbatim = skeleton.ok();
  if (verbatim) {
    std::string_view rest = *skeleton;
    while (verbatim && !rest.empty()) {
      // The next marker in the rest of the skeleton.
      size_t at = std::string_view::npos;
      const std::pair<std::string, std::string>* which = nullptr;
      for (const auto& c : contents) {
        size_t p = rest.find(c.first);
        if (p < at) {
          at = p;
          which = &c;
        }
      }
      const std::string_view markup = rest.substr(0, at);
      KILN_ASSIGN_OR_RETURN(
          auto part,
          Encode(tok, markup, {.add_special_tokens = false, .parse_special = true}, req.field));
      ids.insert(ids.end(), part.begin(), part.end());
      rebuilt.append(markup);
      if (which == nullptr) break;
      KILN_ASSIGN_OR_RETURN(
          part, Encode(tok, which->second, {.add_special_tokens = false, .parse_special = false},
                       req.field));
      ids.insert(ids.end(), part.begin(), part.end());
      rebuilt.append(which->second);
      rest.remove_prefix(at + which->first.size());
    }
    verbatim = rebuilt == out.text;
  }
  if (!verbatim) {
    return Bad(StrCat(req.field, "[", *tainted, "].content"),
               InvalidArgument("`", req.field, "[", *tainted,
                               "].content` contains the control token text `", tok.Piece(*token),
                               "`, which the chat template of model '", model_name,
                               "' cannot keep apart from its own markup; remove "
                               "it from the message"));
  }
  out.ids = std::move(ids);
  return out;
}

}  // namespace

StatusOr<ojson> NormalizeMessages(const ojson& messages, std::string_view field) {
  if (!messages.is_array()) {
    return Bad(field, InvalidArgument("`", field, "` must be a list of messages"));
  }
  if (messages.empty()) {
    return Bad(field, InvalidArgument("`", field, "` is empty; send at least one message"));
  }
  ojson out = ojson::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = StrCat(field, "[", i, "]");
    if (!m.is_object()) {
      return Bad(at, InvalidArgument("`", at, "` must be an object with `role` and `content`"));
    }
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return Bad(StrCat(at, ".role"),
                 InvalidArgument("`", at,
                                 ".role` is missing or not a string; allowed roles: ", kChatRoles));
    }
    const std::string& r = role->get_ref<const std::string&>();
    if (!KnownRole(r)) {
      return Bad(StrCat(at, ".role"), InvalidArgument("`", at, ".role` is `", ValidUtf8(r),
                                                      "`; allowed roles: ", kChatRoles));
    }
    ojson norm = m;
    norm["role"] = r == "developer" ? "system" : r;
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      // Only an assistant turn may come without content: agent frameworks send
      // {"role": "assistant", "content": null, "tool_calls": [...]} after a tool call. OpenAI
      // reads it as empty; so does Kiln (templates that concatenate content would otherwise
      // fail on null). Its other keys (tool_calls) stay for the template.
      if (r != "assistant") {
        return Bad(StrCat(at, ".content"), InvalidArgument("`", at, ".content` is missing; a ", r,
                                                           " message needs content"));
      }
      norm["content"] = "";
    } else if (content->is_string()) {
      // as is
    } else if (content->is_array()) {
      std::string text;
      for (size_t k = 0; k < content->size(); ++k) {
        const ojson& part = (*content)[k];
        const std::string pat = StrCat(at, ".content[", k, "]");
        auto type = part.is_object() ? part.find("type") : part.end();
        if (!part.is_object() || type == part.end() || !type->is_string()) {
          return Bad(pat, InvalidArgument("`", pat, "` must be an object with a `type`"));
        }
        if (*type != "text") {
          return Bad(pat,
                     InvalidArgument("`", pat, "` has type `", ValidUtf8(type->get<std::string>()),
                                     "`; this model takes text only (type `text`)"));
        }
        auto t = part.find("text");
        if (t == part.end() || !t->is_string()) {
          return Bad(pat, InvalidArgument("`", pat, ".text` is missing or not a string"));
        }
        if (k > 0) text += "\n";
        text += t->get_ref<const std::string&>();
      }
      norm["content"] = text;
    } else {
      return Bad(
          StrCat(at, ".content"),
          InvalidArgument("`", at, ".content` must be a string or a list of text parts, got ",
                          content->type_name()));
    }
    out.push_back(std::move(norm));
  }
  return out;
}

StatusOr<Prompt> BuildPrompt(const models::LlmModel& model, std::string_view model_name,
                             const PromptInput& req) {
  const models::Tokenizer& tok = model.tokenizer();
  // Text far longer than the context could ever hold is refused before tokenizing it (which
  // costs ~0.2 s per MB on the caller's thread, an HTTP I/O thread included).
  size_t bytes = req.text.size();
  if (req.kind == PromptInput::Kind::kChat && req.messages.is_array()) {
    for (const auto& m : req.messages) {
      if (m.is_object() && m.contains("content")) bytes += m["content"].dump().size();
    }
  }
  const int64_t context = model.info().context_length;
  if (static_cast<int64_t>(bytes) > kMaxPromptBytesPerToken * context) {
    return Bad(
        req.field,
        InvalidArgument("the prompt is ", bytes, " bytes, far more than the context of model '",
                        model_name, "' (", context, " tokens) can hold; shorten it"));
  }
  Prompt out;
  switch (req.kind) {
    case PromptInput::Kind::kChat: {
      KILN_ASSIGN_OR_RETURN(out, BuildChat(model, model_name, req));
      break;
    }
    case PromptInput::Kind::kText: {
      KILN_ASSIGN_OR_RETURN(
          out.ids, Encode(tok, req.text,
                          {.add_special_tokens = req.add_special_tokens, .parse_special = false},
                          req.field));
      out.text = req.text;
      break;
    }
    case PromptInput::Kind::kTokenIds: {
      const int32_t vocab = model.info().vocab_size;
      out.ids.reserve(req.token_ids.size());
      for (size_t i = 0; i < req.token_ids.size(); ++i) {
        const int64_t id = req.token_ids[i];
        if (id < 0 || id >= vocab) return NotAToken(req.field, i, id, model_name, vocab);
        out.ids.push_back(static_cast<int32_t>(id));
      }
      out.text = tok.Decode(out.ids, {.skip_special_tokens = false});
      break;
    }
  }
  return out;
}

}  // namespace kiln
