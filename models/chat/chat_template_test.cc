// ChatTemplate without fixtures: what its errors may show to API clients.
#include "models/chat/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kiln::models {
namespace {

using json = nlohmann::ordered_json;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(WithoutPathsTest, ReplacesFilePathsOnly) {
  EXPECT_EQ(WithoutPaths("/work/wt/.kiln/models/SmolLM2.Q4_1.gguf: tokenizer.chat_template:4:3: "
                         "unsupported operand types for +: 'str' and 'NoneType'"),
            "<path>: tokenizer.chat_template:4:3: unsupported operand types for +: 'str' and "
            "'NoneType'");
  EXPECT_EQ(WithoutPaths("cannot read '/srv/m/tokenizer_config.json'."), "cannot read '<path>'.");
  EXPECT_EQ(WithoutPaths("in models/llama/tokenizer_config.json, ~/x and ./y"),
            "in <path>, <path> and <path>");
  for (const char* kept :
       {"roles must alternate user/assistant/user/...", "</s> and <|im_end|>", "1/2.5 is 0.4",
        "a // b", "tokenizer_config.json: chat_template:1:2", "/", "and/or"}) {
    EXPECT_EQ(WithoutPaths(kept), kept);
  }
}

// Issue 14: a template error showed the model file's path on the server to the client.
TEST(ChatTemplateTest, RenderingErrorsNeverNameServerPaths) {
  auto t = ChatTemplate::Parse(
      "{% if messages[0]['role'] == 'system' %}{{ raise_exception('see /srv/models/x.gguf') }}"
      "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['content'] }}{% endfor %}",
      "/srv/models/x.gguf: tokenizer.chat_template");
  ASSERT_TRUE(t.ok()) << t.status();
  ChatTemplate::Inputs in;
  in.messages = json::array({{{"role", "assistant"}, {"content", nullptr}}});
  auto type_error = (*t)->Apply(in);
  ASSERT_FALSE(type_error.ok());
  EXPECT_EQ(type_error.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(type_error.status()), Not(HasSubstr("/srv")));
  EXPECT_THAT(StatusMessage(type_error.status()), HasSubstr("<path>: tokenizer.chat_template:1:"));
  in.messages = json::array({{{"role", "system"}, {"content", "x"}}});
  auto raised = (*t)->Apply(in);
  ASSERT_FALSE(raised.ok());
  EXPECT_THAT(StatusMessage(raised.status()), HasSubstr("see <path>"));
}

}  // namespace
}  // namespace kiln::models
