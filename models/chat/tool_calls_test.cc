#include "models/chat/tool_calls.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "engine/testing/source_dir.h"
#include "models/chat/chat_template.h"
#include "models/grammar/grammar.h"

namespace kiln::models {
namespace {

using ojson = nlohmann::ordered_json;
using ::testing::HasSubstr;

std::string Template(const std::string& name) {
  std::ifstream in(std::string(TestSourceDir()) + "/tests/fixtures/chat/templates/" + name);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ToolCallsTest, FormatIsDetectedFromTheTemplate) {
  const ToolSupport qwen = DetectToolSupport(Template("qwen2_5.jinja"));
  EXPECT_EQ(qwen.format, ToolCallFormat::kHermes);
  EXPECT_TRUE(qwen.renders_tools);
  EXPECT_TRUE(qwen.renders_tool_calls);
  const ToolSupport llama = DetectToolSupport(Template("llama3_1.jinja"));
  EXPECT_EQ(llama.format, ToolCallFormat::kLlama3);
  EXPECT_TRUE(llama.renders_tools);
  EXPECT_EQ(DetectToolSupport(Template("mistral_v03.jinja")).format, ToolCallFormat::kMistral);
  // SmolLM2 knows nothing of tools: Kiln writes them in Hermes' words.
  const ToolSupport smol = DetectToolSupport(Template("smollm2.jinja"));
  EXPECT_EQ(smol.format, ToolCallFormat::kHermes);
  EXPECT_FALSE(smol.renders_tools);
  EXPECT_FALSE(smol.renders_tool_calls);
}

const ojson kTools = ojson::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                  "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}},
  {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
   "additionalProperties": false}, "strict": true}}
])");

TEST(ToolCallsTest, ReadToolsChecksEveryField) {
  auto fns = ReadTools(kTools);
  ASSERT_TRUE(fns.ok()) << fns.status();
  ASSERT_EQ(fns->size(), 2u);
  EXPECT_EQ((*fns)[0].name, "get_weather");
  EXPECT_TRUE((*fns)[1].strict);
  auto err = [](const char* tools) {
    auto r = ReadTools(ojson::parse(tools));
    EXPECT_FALSE(r.ok()) << tools;
    return std::string(StatusMessage(r.status()));
  };
  EXPECT_THAT(err(R"({"a": 1})"), HasSubstr("`tools` must be a list"));
  EXPECT_THAT(err(R"([{"type": "retrieval"}])"), HasSubstr("`tools[0]` must be"));
  EXPECT_THAT(err(R"([{"type": "function", "function": {"name": "a b"}}])"),
              HasSubstr("`tools[0].function.name` must be 1 to 64"));
  EXPECT_THAT(err(R"([{"type": "function", "function": {"name": "f"}},
                      {"type": "function", "function": {"name": "f"}}])"),
              HasSubstr("two tools are named 'f'"));
  EXPECT_THAT(err(R"([{"type": "function", "function": {"name": "f", "parameters": [1]}}])"),
              HasSubstr("`tools[0].function.parameters` must be a JSON Schema"));
  EXPECT_THAT(err(R"([{"type": "function", "function": {"name": "f",
                      "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}])"),
              HasSubstr("`tools[0].function.parameters`: "));
  EXPECT_THAT(err(R"([{"type": "function", "function": {"name": "f", "strict": true,
                      "parameters": {"type": "object", "not": {}}}}])"),
              HasSubstr("not"));
}

TEST(ToolCallsTest, HermesRepliesParse) {
  ToolReply r =
      ParseToolCalls(ToolCallFormat::kHermes,
                     "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", "
                     "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>"
                     "{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1, \\\"b\\\": 2}\"}"
                     "</tool_call>");
  EXPECT_EQ(r.content, "Let me check.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"city":"Paris"})");
  EXPECT_EQ(r.calls[1].arguments, R"({"a":1,"b":2})");
  // Not JSON inside the tags: the text as written.
  r = ParseToolCalls(ToolCallFormat::kHermes, "a <tool_call>oops</tool_call> b");
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "a <tool_call>oops</tool_call> b");
  r = ParseToolCalls(ToolCallFormat::kHermes, "Just text, no calls.");
  EXPECT_EQ(r.content, "Just text, no calls.");
}

TEST(ToolCallsTest, Llama3AndMistralRepliesParse) {
  ToolReply r = ParseToolCalls(ToolCallFormat::kLlama3,
                               " {\"name\": \"add\", \"parameters\": {\"a\": 2, \"b\": 3}}");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, R"({"a":2,"b":3})");
  EXPECT_EQ(r.content, "");
  r = ParseToolCalls(ToolCallFormat::kLlama3, "The answer is {1}.");
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, "The answer is {1}.");
  r = ParseToolCalls(
      ToolCallFormat::kMistral,
      R"([{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}])");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[1].name, "get_weather");
  r = ParseToolCalls(ToolCallFormat::kMistral, "[not json");
  EXPECT_EQ(r.content, "[not json");
}

// Streaming gives the same content and calls whichever way the text is cut, and never shows
// the start of a call as content.
TEST(ToolCallsTest, StreamingEqualsWholeAtEveryCut) {
  const std::string text =
      "Sure <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"
      "\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}</tool_call>";
  const ToolReply whole = ParseToolCalls(ToolCallFormat::kHermes, text);
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    for (size_t cut2 = cut; cut2 <= text.size(); cut2 += 7) {
      ToolCallStream s(ToolCallFormat::kHermes);
      std::string content;
      std::vector<ToolCall> calls;
      for (auto piece : {text.substr(0, cut), text.substr(cut, cut2 - cut), text.substr(cut2)}) {
        ToolReply r = s.Add(piece);
        EXPECT_EQ(r.content.find('<'), std::string::npos) << cut << " " << cut2;
        content += r.content;
        calls.insert(calls.end(), r.calls.begin(), r.calls.end());
      }
      ToolReply r = s.Finish();
      content += r.content;
      calls.insert(calls.end(), r.calls.begin(), r.calls.end());
      ASSERT_EQ(calls.size(), whole.calls.size());
      for (size_t i = 0; i < calls.size(); ++i)
        EXPECT_EQ(calls[i].arguments, whole.calls[i].arguments);
      EXPECT_EQ(content.substr(0, 4), "Sure");
    }
  }
}

TEST(ToolCallsTest, ForcedCallGrammarsMatchOnlyValidCalls) {
  auto fns = ReadTools(kTools);
  ASSERT_TRUE(fns.ok());
  auto g = [&](ToolCallFormat f, std::string_view only, bool parallel) {
    auto text = ToolCallGbnf(f, *fns, only, parallel);
    EXPECT_TRUE(text.ok()) << text.status();
    auto gr = grammar::Grammar::ParseGbnf(*text);
    EXPECT_TRUE(gr.ok()) << gr.status() << "\n" << *text;
    return *std::move(gr);
  };
  const auto named = g(ToolCallFormat::kHermes, "add", false);
  EXPECT_TRUE(named.Matches(
      "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": -2}}\n</tool_call>"));
  EXPECT_FALSE(
      named.Matches("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>"));
  EXPECT_FALSE(named.Matches(
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}\n</tool_call>"));
  const auto any = g(ToolCallFormat::kHermes, "", true);
  EXPECT_TRUE(
      any.Matches("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                  "\"x\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": "
                  "1, \"b\": 2}}\n</tool_call>"));
  EXPECT_FALSE(any.Matches("hello"));
  const auto llama = g(ToolCallFormat::kLlama3, "", false);
  EXPECT_TRUE(llama.Matches("{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}"));
  const auto mistral = g(ToolCallFormat::kMistral, "get_weather", true);
  EXPECT_TRUE(mistral.Matches(
      "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\", \"unit\": \"c\"}}]"));
  EXPECT_FALSE(ToolCallGbnf(ToolCallFormat::kHermes, *fns, "nope", false).ok());
}

TEST(ToolCallsTest, QwenTemplateRendersToolsAndPastCalls) {
  auto tmpl = ChatTemplate::Parse(Template("qwen2_5.jinja"));
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  ChatTemplate::Inputs in;
  in.messages = ojson::parse(R"([{"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])");
  in.tools = kTools;
  auto out = (*tmpl)->Apply(in);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(*out, HasSubstr("<tools>"));
  EXPECT_THAT(*out, HasSubstr("\"name\": \"get_weather\""));
  EXPECT_THAT(*out, HasSubstr("<tool_response>\n18 C\n</tool_response>"));
  // Kiln's own rendering of the fallback agrees with Qwen's wording.
  EXPECT_THAT(*out, HasSubstr(ToolSystemPrompt(ojson::array()).substr(0, 60)));
  EXPECT_EQ(RenderToolCalls(ToolCallFormat::kHermes, in.messages[1]["tool_calls"]),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\":\"Paris\"}}\n</tool_call>");
}

}  // namespace
}  // namespace kiln::models
