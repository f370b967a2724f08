#include "models/chat/tool_calls.h"

#include <absl/strings/str_cat.h>

#include <algorithm>
#include <set>

#include "models/grammar/grammar.h"
#include "models/grammar/json_schema.h"

namespace kiln::models {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// A call object {"name": ..., "<args_key>": {...}} (arguments may also arrive as a JSON string
// holding the object, as some models write them).
bool CallFromJson(const ojson& j, ToolCall* out) {
  if (!j.is_object()) return false;
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string()) return false;
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");
  ojson value = args == j.end() ? ojson::object() : *args;
  if (value.is_string()) value = ojson::parse(value.get<std::string>(), nullptr, false);
  if (!value.is_object()) return false;
  out->name = name->get<std::string>();
  out->arguments = value.dump();
  return true;
}

// The calls of a Llama 3 or Mistral reply held whole: one object, or a list of objects.
bool CallsFromJsonText(std::string_view text, std::vector<ToolCall>* out) {
  const ojson j = ojson::parse(Trim(text), nullptr, false);
  std::vector<ToolCall> calls;
  if (j.is_array() && !j.empty()) {
    for (const ojson& e : j) {
      ToolCall c;
      if (!CallFromJson(e, &c)) return false;
      calls.push_back(std::move(c));
    }
  } else {
    ToolCall c;
    if (!CallFromJson(j, &c)) return false;
    calls.push_back(std::move(c));
  }
  *out = std::move(calls);
  return true;
}

// `gbnf` with its rule `from` renamed `to` (definitions and references; literals, classes and
// comments untouched).
std::string RenameRule(std::string_view gbnf, std::string_view from, std::string_view to) {
  std::string out;
  auto name_char = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
  };
  for (size_t i = 0; i < gbnf.size();) {
    const char c = gbnf[i];
    if (c == '"' || c == '[') {
      const char close = c == '"' ? '"' : ']';
      size_t j = i + 1;
      while (j < gbnf.size() && gbnf[j] != close) j += gbnf[j] == '\\' ? 2 : 1;
      j = std::min(j + 1, gbnf.size());
      out.append(gbnf.substr(i, j - i));
      i = j;
    } else if (c == '#') {
      const size_t j = std::min(gbnf.find('\n', i), gbnf.size());
      out.append(gbnf.substr(i, j - i));
      i = j;
    } else if (name_char(c)) {
      size_t j = i;
      while (j < gbnf.size() && name_char(gbnf[j])) ++j;
      const std::string_view word = gbnf.substr(i, j - i);
      out.append(word == from ? to : word);
      i = j;
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

std::string JsonString(std::string_view s) { return ojson(std::string(s)).dump(); }

}  // namespace

bool IsOpenAiName(std::string_view name) {
  return !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
}

std::string_view ToolCallFormatName(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kLlama3:
      return "llama3_json";
    case ToolCallFormat::kMistral:
      return "mistral";
  }
  return "hermes";
}

ToolSupport DetectToolSupport(std::string_view src) {
  ToolSupport s;
  s.renders_tools = src.find("tools") != std::string_view::npos;
  s.renders_tool_calls = src.find("tool_calls") != std::string_view::npos;
  if (src.find("<tool_call>") != std::string_view::npos) {
    s.format = ToolCallFormat::kHermes;
  } else if (src.find("[TOOL_CALLS]") != std::string_view::npos) {
    s.format = ToolCallFormat::kMistral;
  } else if (src.find("<|python_tag|>") != std::string_view::npos ||
             src.find("ipython") != std::string_view::npos) {
    s.format = ToolCallFormat::kLlama3;
  } else {
    // A template without a call format of its own: Hermes' words, which Kiln writes itself
    // where the template takes neither tools nor calls (SmolLM2).
    s.format = ToolCallFormat::kHermes;
  }
  return s;
}

StatusOr<std::vector<ToolFunction>> ReadTools(const ojson& tools) {
  if (!tools.is_array()) return InvalidArgument("`tools` must be a list of tools");
  if (tools.size() > 128) {
    return InvalidArgument("`tools` has ", tools.size(), " tools; at most 128 are allowed");
  }
  std::vector<ToolFunction> out;
  std::set<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string at = absl::StrCat("tools[", i, "]");
    const ojson& t = tools[i];
    if (!t.is_object() || !t.contains("type") || t["type"] != "function") {
      return InvalidArgument("`", at, "` must be {\"type\": \"function\", \"function\": {...}}");
    }
    if (!t.contains("function") || !t["function"].is_object()) {
      return InvalidArgument("`", at, ".function` must be an object with the function's `name`");
    }
    const ojson& f = t["function"];
    ToolFunction fn;
    if (!f.contains("name") || !f["name"].is_string() ||
        !IsOpenAiName(f["name"].get_ref<const std::string&>())) {
      return InvalidArgument("`", at,
                             ".function.name` must be 1 to 64 characters of a-z, A-Z, 0-9, _ "
                             "and -");
    }
    fn.name = f["name"].get<std::string>();
    if (f.contains("description") && !f["description"].is_null() && !f["description"].is_string()) {
      return InvalidArgument("`", at, ".function.description` must be a string");
    }
    if (!names.insert(fn.name).second) {
      return InvalidArgument("`", at, ".function.name`: two tools are named '", fn.name, "'");
    }
    if (f.contains("strict") && !f["strict"].is_null()) {
      if (!f["strict"].is_boolean()) {
        return InvalidArgument("`", at, ".function.strict` must be true or false");
      }
      fn.strict = f["strict"].get<bool>();
    }
    fn.parameters = ojson{{"type", "object"}};
    if (f.contains("parameters") && !f["parameters"].is_null()) {
      if (!f["parameters"].is_object()) {
        return InvalidArgument("`", at, ".function.parameters` must be a JSON Schema (an object)");
      }
      fn.parameters = f["parameters"];
    }
    // The schema must compile: it is what a forced call's arguments are held to.
    auto g = grammar::JsonSchemaToGbnf(fn.parameters, {.strict = fn.strict});
    if (!g.ok()) {
      return Status(g.status().code(),
                    absl::StrCat("`", at, ".function.parameters`: ", g.status().message()));
    }
    out.push_back(std::move(fn));
  }
  return out;
}

std::string ToolSystemPrompt(const ojson& tools) {
  std::string s =
      "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
      "provided with function signatures within <tools></tools> XML tags:\n<tools>";
  for (const ojson& t : tools) absl::StrAppend(&s, "\n", t.dump());
  absl::StrAppend(&s,
                  "\n</tools>\n\nFor each function call, return a json object with function name "
                  "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                  "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
  return s;
}

std::string RenderToolCalls(ToolCallFormat format, const ojson& tool_calls) {
  std::vector<std::string> calls;
  const char* args_key = format == ToolCallFormat::kLlama3 ? "parameters" : "arguments";
  for (const ojson& c : tool_calls) {
    const ojson* f = c.is_object() && c.contains("function") ? &c["function"] : &c;
    if (!f->is_object()) continue;
    ojson args = f->contains("arguments") ? (*f)["arguments"] : ojson::object();
    if (args.is_string()) {
      ojson parsed = ojson::parse(args.get<std::string>(), nullptr, false);
      if (!parsed.is_discarded()) args = std::move(parsed);
    }
    const std::string name = f->contains("name") && (*f)["name"].is_string()
                                 ? (*f)["name"].get<std::string>()
                                 : std::string();
    calls.push_back(
        absl::StrCat("{\"name\": ", JsonString(name), ", \"", args_key, "\": ", args.dump(), "}"));
  }
  std::string out;
  switch (format) {
    case ToolCallFormat::kHermes:
      for (const auto& c : calls) {
        absl::StrAppend(&out, out.empty() ? "" : "\n", ToAbsl(kOpen), "\n", c, "\n",
                        ToAbsl(kClose));
      }
      return out;
    case ToolCallFormat::kLlama3:
      // One call is an object; several, a list of them (what ParseToolCalls reads back).
      if (calls.size() == 1) return calls[0];
      out = "[";
      for (size_t i = 0; i < calls.size(); ++i) absl::StrAppend(&out, i ? ", " : "", calls[i]);
      return out + "]";
    case ToolCallFormat::kMistral:
      out = "[TOOL_CALLS] [";
      for (size_t i = 0; i < calls.size(); ++i) absl::StrAppend(&out, i ? ", " : "", calls[i]);
      return out + "]";
  }
  return out;
}

ToolReply ToolCallStream::Add(std::string_view text) {
  buf_.append(text);
  return Drain(false);
}

ToolReply ToolCallStream::Finish() { return Drain(true); }

ToolReply ToolCallStream::Drain(bool final) {
  ToolReply out;
  if (format_ != ToolCallFormat::kHermes) {
    // The reply is a call when its first character opens JSON: held whole, parsed at the end.
    if (!started_) {
      const size_t first = buf_.find_first_not_of(" \t\r\n");
      if (first == std::string::npos && !final) return out;
      started_ = true;
      whole_ = first != std::string::npos &&
               (buf_[first] == '[' || (format_ == ToolCallFormat::kLlama3 && buf_[first] == '{'));
    }
    if (whole_ && !final) return out;
    if (whole_ && CallsFromJsonText(buf_, &out.calls)) {
      saw_calls_ = true;
    } else {
      out.content = std::move(buf_);
    }
    buf_.clear();
    return out;
  }
  // Hermes: <tool_call> ... </tool_call> blocks anywhere in the text.
  while (true) {
    if (!in_call_) {
      const size_t at = buf_.find(kOpen);
      if (at == std::string::npos) {
        // Hold back what may be the start of "<tool_call>".
        size_t keep = 0;
        if (!final) {
          for (size_t k = std::min(buf_.size(), kOpen.size() - 1); k > 0; --k) {
            if (buf_.compare(buf_.size() - k, k, kOpen.substr(0, k)) == 0) {
              keep = k;
              break;
            }
          }
        }
        out.content += buf_.substr(0, buf_.size() - keep);
        buf_.erase(0, buf_.size() - keep);
        break;
      }
      out.content += buf_.substr(0, at);
      buf_.erase(0, at + kOpen.size());
      in_call_ = true;
    } else {
      const size_t end = buf_.find(kClose);
      if (end == std::string::npos && !final) break;
      const std::string body = buf_.substr(0, end == std::string::npos ? buf_.size() : end);
      ToolCall call;
      if (CallFromJson(ojson::parse(Trim(body), nullptr, false), &call)) {
        out.calls.push_back(std::move(call));
        saw_calls_ = true;
      } else {
        // Not a call after all: the text as the model wrote it.
        absl::StrAppend(&out.content, ToAbsl(kOpen), body,
                        end == std::string::npos ? "" : ToAbsl(kClose));
      }
      buf_.erase(0, end == std::string::npos ? buf_.size() : end + kClose.size());
      in_call_ = false;
    }
  }
  // Between and around calls, whitespace is layout, not content.
  if (saw_calls_ && Trim(out.content).empty()) out.content.clear();
  return out;
}

ToolReply ParseToolCalls(ToolCallFormat format, std::string_view text) {
  ToolCallStream stream(format);
  ToolReply a = stream.Add(text), b = stream.Finish();
  a.content += b.content;
  for (auto& c : b.calls) a.calls.push_back(std::move(c));
  if (!a.calls.empty()) a.content = std::string(Trim(a.content));
  return a;
}

StatusOr<std::string> ToolCallGbnf(ToolCallFormat format,
                                   const std::vector<ToolFunction>& functions,
                                   std::string_view only, bool parallel) {
  const char* args_key = format == ToolCallFormat::kLlama3 ? "parameters" : "arguments";
  ojson alternatives = ojson::array();
  for (const ToolFunction& f : functions) {
    if (!only.empty() && f.name != only) continue;
    alternatives.push_back(
        ojson{{"type", "object"},
              {"properties", {{"name", {{"const", f.name}}}, {args_key, f.parameters}}},
              {"required", {"name", args_key}},
              {"additionalProperties", false}});
  }
  if (alternatives.empty()) {
    return InvalidArgument("no tool is named '", only, "'");
  }
  const ojson schema =
      alternatives.size() == 1 ? alternatives[0] : ojson{{"anyOf", std::move(alternatives)}};
  KILN_ASSIGN_OR_RETURN(grammar::JsonSchemaGrammar g, grammar::JsonSchemaToGbnf(schema, {}));
  std::string gbnf = RenameRule(g.gbnf, "root", "tool-call-object");
  switch (format) {
    case ToolCallFormat::kHermes:
      absl::StrAppend(
          &gbnf, "\nroot ::= \"<tool_call>\\n\" tool-call-object \"\\n</tool_call>\"",
          parallel ? " (\"\\n<tool_call>\\n\" tool-call-object \"\\n</tool_call>\")*" : "", "\n");
      break;
    case ToolCallFormat::kLlama3:
      absl::StrAppend(&gbnf, "\nroot ::= tool-call-object\n");
      break;
    case ToolCallFormat::kMistral:
      absl::StrAppend(&gbnf, "\nroot ::= \"[\" tool-call-object",
                      parallel ? " (\", \" tool-call-object)*" : "", " \"]\"\n");
      break;
  }
  return gbnf;
}

}  // namespace kiln::models
