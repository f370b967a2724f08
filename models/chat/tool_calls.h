// Tool calling (OpenAI's `tools`): how a model's chat template takes tool definitions and how the
// model writes its calls, reading those calls back out of the generated text (whole or as it
// streams), and the grammar that forces a call whose arguments match the function's schema.
//
// Call formats, detected from the chat template's source (DetectToolSupport):
//   kHermes     <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (Hermes, Qwen
//   2/2.5/3,
//               SmolLM3; the template mentions <tool_call>). Also Kiln's fallback for templates
//               that know nothing of tools (SmolLM2): the tools then go into the system prompt
//               in Qwen's words (ToolSystemPrompt), and past calls into the assistant's text.
//   kLlama3     {"name": "f", "parameters": {...}}, or a list of them (Llama 3.1/3.2 JSON tool
//               calling; a forced call is always exactly one: the
//               template mentions "parameters" and <|python_tag|> or ipython)
//   kMistral    [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]   (the template mentions
//               [TOOL_CALLS]; [TOOL_CALLS] is a control token, absent from the decoded text)
//
// Thread-safety: pure functions; a ToolCallStream belongs to one response.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"
#include "nlohmann/json.hpp"

namespace kiln::models {

// OpenAI's rule for function and response-format schema names: 1 to 64 characters of a-z,
// A-Z, 0-9, _ and -.
bool IsOpenAiName(std::string_view name);

enum class ToolCallFormat { kHermes, kLlama3, kMistral };
std::string_view ToolCallFormatName(ToolCallFormat f);  // "hermes", "llama3_json", "mistral"

struct ToolSupport {
  ToolCallFormat format = ToolCallFormat::kHermes;
  bool renders_tools = false;       // the template uses its `tools` variable
  bool renders_tool_calls = false;  // it writes an assistant message's tool_calls itself
};
ToolSupport DetectToolSupport(std::string_view template_source);

// One function of a request's `tools`.
struct ToolFunction {
  std::string name;
  nlohmann::ordered_json parameters;  // a JSON Schema ({"type": "object"} when absent)
  bool strict = false;
};

// Checks OpenAI's `tools` ([{"type": "function", "function": {"name", "description",
// "parameters", "strict"}}]): names of 1..64 characters of a-z A-Z 0-9 _ -, distinct; parameters
// an object whose JSON Schema compiles (strict: unsupported keywords are errors). InvalidArgument
// naming the place: "`tools[1].function.parameters`: json_schema /properties/x: ...".
StatusOr<std::vector<ToolFunction>> ReadTools(const nlohmann::ordered_json& tools);

// The system-prompt text describing `tools` for a template that does not render them (Qwen 2.5's
// wording: the functions as JSON inside <tools></tools>, calls inside <tool_call></tool_call>).
std::string ToolSystemPrompt(const nlohmann::ordered_json& tools);

// An assistant message's `tool_calls` (OpenAI's shape) written as a `format` model writes them,
// for templates that drop them.
std::string RenderToolCalls(ToolCallFormat format, const nlohmann::ordered_json& tool_calls);

struct ToolCall {
  std::string name;
  std::string arguments;  // JSON text (an object), as OpenAI's function.arguments
};
struct ToolReply {
  std::string content;  // the text outside the calls (trimmed when there are calls)
  std::vector<ToolCall> calls;
};

// The calls in a whole reply. Text that does not parse as calls stays content.
ToolReply ParseToolCalls(ToolCallFormat format, std::string_view text);

// The same, incrementally: Add each streamed piece of text; content comes out as soon as it
// cannot be the start of a call, each call once it is complete.
class ToolCallStream {
 public:
  explicit ToolCallStream(ToolCallFormat format) : format_(format) {}
  ToolReply Add(std::string_view text);
  ToolReply Finish();  // the end of the reply: whatever was held back
  bool saw_calls() const { return saw_calls_; }

 private:
  ToolReply Drain(bool final);
  ToolCallFormat format_;
  std::string buf_;
  bool in_call_ = false;  // Hermes: inside <tool_call> ... </tool_call>
  bool started_ = false;  // Llama 3 / Mistral: the reply's first character was seen
  bool whole_ = false;    // Llama 3 / Mistral: the reply is a call, held until the end
  bool saw_calls_ = false;
};

// GBNF (start rule `root`) that makes the reply one call of `functions` — of the one named
// `only` when not empty (tool_choice naming a function), else of any (tool_choice "required") —
// or, with `parallel`, one or more calls; the arguments match each function's schema.
StatusOr<std::string> ToolCallGbnf(ToolCallFormat format,
                                   const std::vector<ToolFunction>& functions,
                                   std::string_view only, bool parallel);

}  // namespace kiln::models
