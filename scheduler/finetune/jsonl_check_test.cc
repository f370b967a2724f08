#include "scheduler/finetune/jsonl_check.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace kiln::finetune {
namespace {

constexpr char kChat[] =
    R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})";

// The message of checking `text` as "train.jsonl", which must fail with param "file".
std::string Error(const std::string& text) {
  const Status s = CheckFineTuneJsonl(text, "train.jsonl");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << text;
  EXPECT_EQ(ParamOf(s), "file") << text;
  return std::string(StatusMessage(s));
}

TEST(CheckFineTuneJsonlTest, ValidChatAndPromptCompletionFiles) {
  const std::string chat =
      std::string(kChat) + "\n" +
      R"({"messages": [{"role": "system", "content": "Be terse."}, )"
      R"({"role": "developer", "content": "Really."}, {"role": "user", "content": "Weather?"}, )"
      R"({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", )"
      R"("function": {"name": "weather", "arguments": "{}"}}]}, )"
      R"({"role": "tool", "tool_call_id": "c1", "content": "sunny"}, )"
      R"({"role": "assistant", "content": "Sunny.", "weight": 1}], "tools": []})"
      "\n";
  EXPECT_TRUE(CheckFineTuneJsonl(chat, "chat.jsonl").ok())
      << CheckFineTuneJsonl(chat, "chat.jsonl");
  const std::string legacy =
      "\xEF\xBB\xBF{\"prompt\": \"2+2=\", \"completion\": \"4\"}\r\n\n  \n"
      "{\"prompt\": \"caf\xC3\xA9\", \"completion\": \"\"}";
  EXPECT_TRUE(CheckFineTuneJsonl(legacy, "legacy.jsonl").ok())
      << CheckFineTuneJsonl(legacy, "legacy.jsonl");
}

// Each kind of bad input on line 3 (lines 1 and 2 are fine, one of them blank): the message
// names the file, the line and the key.
TEST(CheckFineTuneJsonlTest, EachErrorNamesLineAndKey) {
  const std::string ok = std::string(kChat) + "\n\n";
  struct Case {
    std::string line, expected;
  };
  const Case cases[] = {
      {R"({"messages": [)", "train.jsonl: line 3: not valid JSON: `messages[0]`: parse error"},
      {"[1, 2]", "train.jsonl: line 3: expected a JSON object, got a list"},
      // Issue 14: a number beyond a double's range threw out of the parser and ended kilnd.
      {R"({"messages": [], "seed": 2e308})",
       "train.jsonl: line 3: `seed`: number out of range: 2e308 is beyond a double's ±1.8e308"},
      {R"({"text": "x"})",
       "train.jsonl: line 3: expected field `messages` (chat) or `prompt` and `completion` "
       "(legacy)"},
      {R"({"messages": "hi"})",
       "train.jsonl: line 3: `messages` is string; expected a list of messages"},
      {R"({"messages": []})", "train.jsonl: line 3: `messages` is empty"},
      {R"({"messages": [1]})", "train.jsonl: line 3: messages[0] is number; expected an object"},
      {R"({"messages": [{"content": "x"}]})",
       "train.jsonl: line 3: messages[0]: missing field `role`"},
      {R"({"messages": [{"role": 1, "content": "x"}]})",
       "train.jsonl: line 3: messages[0].role is number; expected a string"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}, )"
       R"({"role": "bot", "content": "z"}]})",
       "train.jsonl: line 3: messages[2].role is \"bot\"; allowed: system, user, assistant, "
       "tool, developer"},
      {R"({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]})",
       "train.jsonl: line 3: messages[0]: missing field `content`"},
      {R"({"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "x"}]})",
       "train.jsonl: line 3: messages[0].content is null; expected a string"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [1]}]})",
       "train.jsonl: line 3: messages[1].content is array; expected a string"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}]})",
       "train.jsonl: line 3: messages[1].tool_calls must be a non-empty list (got array)"},
      {R"({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})",
       "train.jsonl: line 3: no assistant message; nothing to train on"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 2}]})",
       "train.jsonl: line 3: messages[1].weight is 2; allowed: 0 or 1"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0.5}]})",
       "train.jsonl: line 3: messages[1].weight is 0.5; allowed: 0 or 1"},
      {R"({"messages": [{"role": "user", "content": "x", "weight": 1}, {"role": "assistant", "content": "y"}]})",
       "train.jsonl: line 3: messages[0].weight is only allowed on assistant messages (role is "
       "\"user\")"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": {}})",
       "train.jsonl: line 3: `tools` is object; expected a list of tool schemas"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, "
       "{\"role\": \"assistant\", \"content\": \"caf\xff\"}]}",
       "train.jsonl: line 3: messages[1].content is not valid UTF-8 (byte 0xFF at column 86)"},
      {"{\"prompt\": \"\xc3\", \"completion\": \"y\"}",
       "train.jsonl: line 3: prompt is not valid UTF-8 (byte 0xC3 at column 13)"},
      {R"({"prompt": "x"})", "train.jsonl: line 3: missing field `completion` (next to `prompt`)"},
      {R"({"completion": "x"})",
       "train.jsonl: line 3: missing field `prompt` (next to `completion`)"},
      {R"({"prompt": 1, "completion": "x"})",
       "train.jsonl: line 3: prompt is number; expected a string"},
      {R"({"prompt": "x", "completion": null})",
       "train.jsonl: line 3: completion is null; expected a string"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(Error(ok + c.line + "\n" + kChat), ::testing::StartsWith(c.expected)) << c.line;
  }
}

TEST(CheckFineTuneJsonlTest, EmptyFileIsRefused) {
  EXPECT_EQ(Error(""), "train.jsonl: no examples (the file is empty or has only blank lines)");
  EXPECT_THAT(Error("\n \t\r\n\n"), ::testing::StartsWith("train.jsonl: no examples"));
  EXPECT_THAT(Error("\xEF\xBB\xBF"), ::testing::StartsWith("train.jsonl: no examples"));
}

}  // namespace
}  // namespace kiln::finetune
