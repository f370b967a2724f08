// Chat templates rendered by Kiln vs transformers (tests/fixtures/chat/cases.jsonl, made by
// scripts/fixtures/make_chat_fixtures.py).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "models/chat/chat_template.h"
#include "models/gguf/gguf.h"
#include "models/io/mapped_file.h"
#include "models/io/test_paths.h"

namespace kiln::models {
namespace {

using json = nlohmann::ordered_json;

std::string Dir() { return testing::FixturePath("chat/"); }

TEST(ChatTemplateFixtureTest, MatchesTransformers) {
  std::map<std::string, std::unique_ptr<ChatTemplate>> templates;
  std::ifstream in(Dir() + "cases.jsonl");
  ASSERT_TRUE(in.good());
  std::string line;
  int cases = 0, errors = 0;
  while (std::getline(in, line)) {
    json c = json::parse(line);
    std::string name = c["template"];
    if (!templates.count(name)) {
      auto file = MappedFile::Open(Dir() + "templates/" + name + ".jinja");
      ASSERT_TRUE(file.ok()) << file.status();
      auto t = ChatTemplate::Parse((*file)->bytes(), name);
      ASSERT_TRUE(t.ok()) << t.status();
      templates[name] = std::move(*t);
    }
    ChatTemplate::Inputs inputs;
    inputs.messages = c["messages"];
    inputs.tools = c["tools"];
    inputs.add_generation_prompt = c["add_generation_prompt"];
    inputs.bos_token = c["bos_token"];
    inputs.eos_token = c["eos_token"];
    auto out = templates[name]->Apply(inputs);
    std::string what = name + " / " + c["conversation"].get<std::string>() +
                       (inputs.add_generation_prompt ? " +gen" : "");
    ++cases;
    if (c.contains("error")) {
      ++errors;
      ASSERT_FALSE(out.ok()) << what << " rendered:\n" << *out;
      EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(StatusMessage(out.status())),
                  ::testing::HasSubstr(c["error"].get<std::string>()))
          << what;
    } else {
      ASSERT_TRUE(out.ok()) << what << ": " << out.status();
      EXPECT_EQ(*out, c["rendered"].get<std::string>()) << what;
    }
  }
  EXPECT_GE(cases, 60);
  EXPECT_GE(errors, 4);
}

TEST(ChatTemplateFixtureTest, SmolLM2TemplateFromGguf) {
  auto gguf = GgufFile::Open(testing::DefaultModelPath());
  ASSERT_TRUE(gguf.ok()) << gguf.status() << " (run scripts/fetch-default-model.sh)";
  auto t = ChatTemplate::FromGguf(**gguf);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->default_bos(), "<|im_start|>");
  EXPECT_EQ((*t)->default_eos(), "<|im_end|>");
  ChatTemplate::Inputs in;
  in.messages = json::array({{{"role", "user"}, {"content", "Hi"}}});
  auto out = (*t)->Apply(in);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

// Issue 14: rendering SmolLM2's template with a null content answered the client with the
// GGUF file's path on the server.
TEST(ChatTemplateFixtureTest, ErrorsOfATemplateFromGgufDoNotNameTheFile) {
  auto gguf = GgufFile::Open(testing::DefaultModelPath());
  ASSERT_TRUE(gguf.ok()) << gguf.status() << " (run scripts/fetch-default-model.sh)";
  auto t = ChatTemplate::FromGguf(**gguf);
  ASSERT_TRUE(t.ok()) << t.status();
  ChatTemplate::Inputs in;
  in.messages = json::array(
      {{{"role", "user"}, {"content", "Hi"}}, {{"role", "assistant"}, {"content", nullptr}}});
  auto out = (*t)->Apply(in);
  ASSERT_FALSE(out.ok()) << "SmolLM2's template concatenates content: null is a type error";
  const std::string message(StatusMessage(out.status()));
  EXPECT_THAT(message, ::testing::StartsWith("tokenizer.chat_template:"));
  EXPECT_THAT(message, ::testing::Not(::testing::HasSubstr(".gguf")));
  EXPECT_THAT(message, ::testing::Not(::testing::HasSubstr("/")));
}

}  // namespace
}  // namespace kiln::models
