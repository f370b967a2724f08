// Fine-tuning files tokenized with the default model (SmolLM2-135M-Instruct: ChatML template,
// byte-level BPE): assistant masks against hand-written renderings, the legacy format, and one
// test per kind of bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/chat/chat_template.h"
#include "models/gguf/gguf.h"
#include "models/io/test_paths.h"
#include "models/tokenizer/tokenizer.h"
#include "models/train/dataset.h"

namespace kiln::models::train {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

class SmolLM2DataTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto gguf = GgufFile::Open(testing::DefaultModelPath());
    ASSERT_TRUE(gguf.ok()) << gguf.status() << " (run scripts/fetch-default-model.sh)";
    auto tok = Tokenizer::FromGguf(**gguf);
    ASSERT_TRUE(tok.ok()) << tok.status();
    auto tmpl = ChatTemplate::FromGguf(**gguf);
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    tok_ = std::move(*tok).release();
    tmpl_ = std::move(*tmpl).release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete tmpl_;
  }

  // Writes `text` to a fresh file in the test's temp dir; returns its path.
  static std::string WriteFile(const std::string& name, const std::string& text) {
    std::string dir = ::testing::TempDir() + "/kiln_train_data";
    std::filesystem::create_directories(dir);
    std::string path = dir + "/" + name;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
    return path;
  }

  StatusOr<std::vector<Example>> Tokenize(const std::string& jsonl, int64_t max_seq_len = 512) {
    warnings_.clear();
    return TokenizeFile(WriteFile("train.jsonl", jsonl), *tok_, tmpl_, {.max_seq_len = max_seq_len},
                        &warnings_);
  }

  // The error message of tokenizing `jsonl`, which must fail.
  std::string Error(const std::string& jsonl, int64_t max_seq_len = 512) {
    auto r = Tokenize(jsonl, max_seq_len);
    EXPECT_FALSE(r.ok()) << jsonl;
    return r.ok() ? "" : std::string(StatusMessage(r.status()));
  }

  std::vector<int32_t> Encode(const std::string& text, bool parse_special = true) {
    auto ids = tok_->Encode(text, {.add_special_tokens = false, .parse_special = parse_special});
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }

  // The tokens of `ex` that are loss tokens, in order.
  static std::vector<int32_t> LossTokens(const Example& ex) {
    std::vector<int32_t> out;
    for (size_t t = 0; t < ex.tokens.size(); ++t) {
      if (ex.loss[t]) out.push_back(ex.tokens[t]);
    }
    return out;
  }

  static Tokenizer* tok_;
  static ChatTemplate* tmpl_;
  std::vector<std::string> warnings_;
};

Tokenizer* SmolLM2DataTest::tok_ = nullptr;
ChatTemplate* SmolLM2DataTest::tmpl_ = nullptr;

constexpr char kGood[] =
    R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})";

TEST_F(SmolLM2DataTest, AssistantMaskIsTheReplyThroughImEnd) {
  auto r = Tokenize(R"({"messages": [{"role": "system", "content": "You are terse."}, )"
                    R"({"role": "user", "content": "Capital of France?"}, )"
                    R"({"role": "assistant", "content": "Paris, of course."}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 1u);
  const Example& ex = (*r)[0];
  EXPECT_THAT(ex.source, HasSubstr("/train.jsonl:1"));
  // SmolLM2's ChatML, written out by hand.
  const std::string header =
      "<|im_start|>system\nYou are terse.<|im_end|>\n"
      "<|im_start|>user\nCapital of France?<|im_end|>\n"
      "<|im_start|>assistant\n";
  std::vector<int32_t> expected = Encode(header + "Paris, of course.<|im_end|>\n");
  EXPECT_THAT(ex.tokens, ElementsAreArray(expected));
  const int32_t im_end = *tok_->PieceToId("<|im_end|>");
  std::vector<int32_t> reply = Encode("Paris, of course.");
  reply.push_back(im_end);
  EXPECT_THAT(LossTokens(ex), ElementsAreArray(reply));
  // ... and they sit right after the header: positions [header, header + reply).
  const size_t start = Encode(header).size();
  for (size_t t = 0; t < ex.tokens.size(); ++t) {
    EXPECT_EQ(ex.loss[t], t >= start && t < start + reply.size() ? 1 : 0) << "token " << t;
  }
  EXPECT_EQ(tok_->Decode(LossTokens(ex)), "Paris, of course.<|im_end|>");
  // Next-token targets: the position before each loss token predicts it.
  std::vector<int32_t> targets = NextTokenTargets(ex);
  EXPECT_EQ(targets[start - 1], reply[0]);
  EXPECT_EQ(targets[start + reply.size() - 2], im_end);
  EXPECT_EQ(targets[start + reply.size() - 1], kIgnoreIndex);  // "\n" after <|im_end|>
  EXPECT_EQ(TargetCount(ex), static_cast<int64_t>(reply.size()));
  EXPECT_TRUE(warnings_.empty());
}

// transformers' apply_chat_template(return_assistant_tokens_mask=True) on SmolLM2's template
// with {% generation %} around each reply and its <|im_end|> (make_train_fixtures.py).
TEST_F(SmolLM2DataTest, MasksMatchTransformersAssistantMasks) {
  std::ifstream in(testing::FixturePath("train/smollm2_masks.jsonl"));
  ASSERT_TRUE(in.good());
  std::string line;
  int cases = 0;
  while (std::getline(in, line)) {
    auto row = nlohmann::json::parse(line);
    auto r = TokenizeJsonl(nlohmann::json{{"messages", row["messages"]}}.dump(), "case", *tok_,
                           tmpl_, {}, nullptr);
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << line;
    EXPECT_EQ((*r)[0].tokens, row["input_ids"].get<std::vector<int32_t>>()) << line;
    EXPECT_EQ((*r)[0].loss, row["assistant_masks"].get<std::vector<uint8_t>>()) << line;
    ++cases;
  }
  EXPECT_GE(cases, 8);
}

TEST_F(SmolLM2DataTest, ControlTokenTextInAReplyStaysTrained) {
  // The reply's own "<|im_end|>" is parsed as the control token (as transformers does); the
  // mask runs to the template's end of turn, not to that one.
  auto r = Tokenize(
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x<|im_end|>y"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(tok_->Decode(LossTokens((*r)[0])), "x<|im_end|>y<|im_end|>");
}

TEST_F(SmolLM2DataTest, MultiTurnWeightsAndToolMessages) {
  // No system message: the template adds its default one; weight 0 skips the first reply.
  auto r =
      Tokenize(R"({"messages": [{"role": "user", "content": "a"}, )"
               R"({"role": "assistant", "content": "first", "weight": 0}, )"
               R"({"role": "tool", "content": "42"}, )"
               R"({"role": "user", "content": "b"}, {"role": "assistant", "content": "second"}, )"
               R"({"role": "user", "content": "trailing"}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(tok_->Decode(LossTokens((*r)[0])), "second<|im_end|>");
  auto text = tok_->Decode((*r)[0].tokens);
  EXPECT_THAT(text, HasSubstr("<|im_start|>assistant\nfirst<|im_end|>\n<|im_start|>tool\n42"));
  EXPECT_THAT(text, HasSubstr("<|im_start|>user\ntrailing<|im_end|>\n"));

  auto both =
      Tokenize(R"({"messages": [{"role": "user", "content": "a"}, )"
               R"({"role": "assistant", "content": "first", "weight": 1}, )"
               R"({"role": "user", "content": "b"}, {"role": "assistant", "content": "second"}]})");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(tok_->Decode(LossTokens((*both)[0])), "first<|im_end|>second<|im_end|>");
}

// OpenAI's tool-calling examples: top-level `tools`, an assistant turn with `tool_calls` and no
// content, a tool result. Rendered with Qwen2.5's template (ChatML, so SmolLM2's vocabulary has
// its control tokens), which writes the tool list into the system turn and the call as
// <tool_call> JSON.
TEST_F(SmolLM2DataTest, ToolCallsAndToolsReachTheTemplate) {
  std::ifstream in(testing::FixturePath("chat/templates/qwen2_5.jinja"));
  std::stringstream source;
  source << in.rdbuf();
  auto qwen = ChatTemplate::Parse(source.str(), "qwen2_5");
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  const std::string line =
      R"({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}], )"
      R"("messages": [{"role": "user", "content": "Weather in Paris?"}, )"
      R"({"role": "assistant", "tool_calls": [{"type": "function", "function": )"
      R"({"name": "get_weather", "arguments": {"city": "Paris"}}}]}, )"
      R"({"role": "tool", "content": "18"}, {"role": "assistant", "content": "18 degrees."}]})";
  auto r = TokenizeJsonl(line, "tools.jsonl", *tok_, qwen->get(), {}, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(tok_->Decode((*r)[0].tokens), HasSubstr("get_weather"));
  EXPECT_EQ(tok_->Decode(LossTokens((*r)[0])),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call><|im_end|>18 degrees.<|im_end|>");

  std::string no_calls = line;
  no_calls.replace(no_calls.find("tool_calls"), 10, "tool_callz");
  auto bad = TokenizeJsonl(no_calls, "tools.jsonl", *tok_, qwen->get(), {}, nullptr);
  EXPECT_THAT(std::string(StatusMessage(bad.status())),
              HasSubstr("tools.jsonl:1: messages[1]: missing field `content`"));
  const std::string empty_calls =
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}]})";
  auto empty = TokenizeJsonl(empty_calls, "tools.jsonl", *tok_, qwen->get(), {}, nullptr);
  EXPECT_THAT(std::string(StatusMessage(empty.status())),
              HasSubstr("messages[1].tool_calls must be a non-empty list"));
}

TEST_F(SmolLM2DataTest, LegacyPromptCompletionTrainsCompletionAndEos) {
  auto r = Tokenize(
      "\n"
      R"({"prompt": "The capital of France is", "completion": " Paris."})"
      "\n\n"
      R"({"prompt": "Say <|im_end|>", "completion": "ok"})"
      "\n");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  const Example& ex = (*r)[0];
  EXPECT_THAT(ex.source, HasSubstr("train.jsonl:2"));  // blank lines are skipped, yet counted
  std::vector<int32_t> prompt = Encode("The capital of France is");
  std::vector<int32_t> completion = Encode(" Paris.");
  std::vector<int32_t> expected = prompt;
  expected.insert(expected.end(), completion.begin(), completion.end());
  expected.push_back(tok_->eos_id());
  EXPECT_THAT(ex.tokens, ElementsAreArray(expected));
  for (size_t t = 0; t < ex.tokens.size(); ++t) EXPECT_EQ(ex.loss[t], t >= prompt.size() ? 1 : 0);
  // Legacy text is plain: "<|im_end|>" in a prompt is not the control token.
  const Example& plain = (*r)[1];
  EXPECT_THAT((*r)[1].source, HasSubstr("train.jsonl:4"));
  EXPECT_EQ(std::count(plain.tokens.begin(), plain.tokens.end(), tok_->eos_id()), 1);
  EXPECT_EQ(plain.tokens.back(), tok_->eos_id());
}

TEST_F(SmolLM2DataTest, LongExampleIsTruncatedWithAWarning) {
  std::string reply;
  for (int i = 0; i < 200; ++i) reply += "word ";
  auto r =
      Tokenize(std::string(kGood) + "\n" + R"({"messages": [{"role": "user", "content": "Hi"}, )" +
                   R"({"role": "assistant", "content": ")" + reply + R"("}]})",
               64);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[1].tokens.size(), 64u);
  EXPECT_EQ((*r)[1].loss.size(), 64u);
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_THAT(warnings_[0], HasSubstr("train.jsonl:2: example has "));
  EXPECT_THAT(warnings_[0], HasSubstr("tokens; truncated to max_seq_len 64"));
}

TEST_F(SmolLM2DataTest, TruncationThatCutsEveryTargetIsAnError) {
  std::string user;
  for (int i = 0; i < 100; ++i) user += "word ";
  EXPECT_THAT(Error(R"({"messages": [{"role": "user", "content": ")" + user +
                        R"("}, {"role": "assistant", "content": "ok"}]})",
                    64),
              HasSubstr("train.jsonl:1: no token to train on: every loss token is past "
                        "max_seq_len 64"));
  EXPECT_TRUE(warnings_.empty());  // nothing partial: not even the truncation warning
}

TEST_F(SmolLM2DataTest, NothingPartialOnError) {
  std::vector<std::string> warnings = {"earlier"};
  std::string long_line = R"({"prompt": ")" + std::string(2000, 'a') + R"(", "completion": "b"})";
  auto r =
      TokenizeJsonl(long_line + "\n{", "t.jsonl", *tok_, tmpl_, {.max_seq_len = 32}, &warnings);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(warnings, ElementsAreArray({"earlier"}));
}

// Each kind of bad input on line 2 (line 1 is fine): the message names file, line and field.
TEST_F(SmolLM2DataTest, BadInputNamesFileLineAndField) {
  const std::string ok = std::string(kGood) + "\n";
  struct Case {
    std::string line, expected;
  };
  const Case cases[] = {
      {R"({"messages": [)",
       "train.jsonl:2: not valid JSON: `messages[0]`: parse error at line 1, "
       "column 15"},
      {"[1, 2]", "train.jsonl:2: expected a JSON object, got a list"},
      // Issue 14: a number beyond a double's range threw out of the parser and ended kilnd.
      {R"({"messages": [{"role": "user", "content": "x", "n": 1e400}]})",
       "train.jsonl:2: `messages[0].n`: number out of range: 1e400"},
      {R"({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]})",
       "train.jsonl:2: messages[0]: missing field `content`"},
      {R"({"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "x"}]})",
       "train.jsonl:2: messages[0].content is null; expected a string"},
      {R"({"messages": [{"content": "x"}]})", "train.jsonl:2: messages[0]: missing field `role`"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]})",
       "train.jsonl:2: messages[1].role is \"bot\"; allowed: system, user, assistant, tool"},
      {R"({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})",
       "train.jsonl:2: no assistant message"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0}]})",
       "train.jsonl:2: no token to train on: every assistant message has weight 0"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 2}]})",
       "train.jsonl:2: messages[1].weight is 2; allowed: 0 or 1"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": "1"}]})",
       "train.jsonl:2: messages[1].weight is \"1\"; allowed: 0 or 1"},
      {R"({"messages": [{"role": "user", "content": "x", "weight": 1}, {"role": "assistant", "content": "y"}]})",
       "train.jsonl:2: messages[0].weight is only allowed on assistant messages"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, "
       "{\"role\": \"assistant\", \"content\": \"caf\xff\"}]}",
       "train.jsonl:2: messages[1].content is not valid UTF-8 (byte 0xFF at column"},
      {"{\"prompt\": \"\xc3\", \"completion\": \"y\"}",
       "train.jsonl:2: prompt is not valid UTF-8 (byte 0xC3 at column 13)"},
      {R"({"messages": []})", "train.jsonl:2: `messages` is empty"},
      {R"({"messages": "hi"})", "train.jsonl:2: `messages` is string; expected a list"},
      {R"({"prompt": "x"})", "train.jsonl:2: missing field `completion`"},
      {R"({"prompt": "x", "completion": 3})", "train.jsonl:2: completion is number"},
      {R"({"text": "x"})", "train.jsonl:2: expected field `messages` (chat) or `prompt` and"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(Error(ok + c.line + "\n"), HasSubstr(c.expected)) << c.line;
  }
}

TEST_F(SmolLM2DataTest, ByteOrderMarkAndCrlfAreAccepted) {
  auto r = Tokenize("\xEF\xBB\xBF" + std::string(kGood) + "\r\n" + kGood + "\r\n");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].tokens, (*r)[1].tokens);
}

TEST_F(SmolLM2DataTest, EmptyFileIsAnError) {
  EXPECT_THAT(Error(""), HasSubstr("train.jsonl: no examples (the file is empty"));
  EXPECT_THAT(Error("\n  \n\n"), HasSubstr("train.jsonl: no examples"));
  auto missing = TokenizeFile("/nonexistent/train.jsonl", *tok_, tmpl_, {}, nullptr);
  EXPECT_THAT(std::string(StatusMessage(missing.status())),
              HasSubstr("/nonexistent/train.jsonl: cannot open"));
}

TEST_F(SmolLM2DataTest, TemplateThatIsNotPrefixStableIsAnError) {
  // Renders the last message differently, so messages[:i+1] is not a prefix of the whole.
  auto tmpl = ChatTemplate::Parse(
      "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: "
      "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}");
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  auto r = TokenizeJsonl(
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},)"
      R"( {"role": "user", "content": "c"}]})",
      "odd.jsonl", *tok_, tmpl->get(), {}, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(StatusMessage(r.status())),
              HasSubstr("odd.jsonl:1: the chat template renders messages[0..1)"));
  EXPECT_THAT(std::string(StatusMessage(r.status())), HasSubstr("cannot be located"));

  auto none = TokenizeJsonl(kGood, "x.jsonl", *tok_, nullptr, {}, nullptr);
  EXPECT_THAT(std::string(StatusMessage(none.status())),
              HasSubstr("x.jsonl:1: chat example, but this model has no chat template"));
}

TEST_F(SmolLM2DataTest, LoaderFromFilesGivesConsistentBatches) {
  std::string train, val;
  for (int i = 0; i < 10; ++i) {
    train += R"({"messages": [{"role": "user", "content": "Question )" + std::to_string(i) +
             R"("}, {"role": "assistant", "content": "Answer )" + std::to_string(i) + R"("}]})" +
             "\n";
  }
  val = R"({"prompt": "1 + 1 =", "completion": " 2"})"
        "\n" +
        std::string(kGood) + "\n";
  const std::vector<std::string> train_files = {WriteFile("a.jsonl", train)};
  const std::vector<std::string> val_files = {WriteFile("val.jsonl", val)};
  std::vector<std::string> warnings;
  auto loader =
      DataLoader::FromFiles(train_files, *tok_, tmpl_, {.max_seq_len = 128, .seed = 5}, &warnings);
  ASSERT_TRUE(loader.ok()) << loader.status();
  EXPECT_TRUE(warnings.empty());
  EXPECT_EQ((*loader)->example_count(), 10);
  EXPECT_EQ((*loader)->options().pad_token_id,
            tok_->pad_id() >= 0 ? tok_->pad_id() : tok_->eos_id());
  TrainBatch b = (*loader)->NextBatch(2);
  ASSERT_EQ(b.tokens.size(), 2u * 128u);
  EXPECT_GE(b.example_count, 4);  // ~35 tokens each: several per row
  int64_t counted = 0;
  for (int64_t i = 0; i < b.rows * b.seq_len; ++i) {
    if (b.targets[i] == kIgnoreIndex) continue;
    ++counted;
    // A target is the next token of the same document.
    ASSERT_LT(i % b.seq_len, b.seq_len - 1);
    EXPECT_EQ(b.targets[i], b.tokens[i + 1]);
    EXPECT_EQ(b.doc_ids[i], b.doc_ids[i + 1]);
    EXPECT_NE(b.doc_ids[i], kPadDocId);
  }
  EXPECT_EQ(counted, b.target_count);
  EXPECT_GT(counted, 0);

  auto validation = DataLoader::FromFiles(val_files, *tok_, tmpl_,
                                          {.max_seq_len = 128, .shuffle = false}, nullptr);
  ASSERT_TRUE(validation.ok()) << validation.status();
  std::vector<TrainBatch> all = (*validation)->OnePass(4);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].rows, 1);  // both examples packed into one row
  EXPECT_EQ(all[0].example_count, 2);

  const std::vector<std::string> bad_files = {train_files[0], WriteFile("bad.jsonl", "{}\n")};
  auto bad = DataLoader::FromFiles(bad_files, *tok_, tmpl_, {}, nullptr);
  EXPECT_THAT(std::string(StatusMessage(bad.status())), HasSubstr("bad.jsonl:1: expected field"));
}

// Other models' templates (tests/fixtures/chat/templates/) with SmolLM2's vocabulary: the
// ChatML ones locate both replies; the others fail with the reason, never a wrong mask.
TEST_F(SmolLM2DataTest, FixtureTemplatesLocateRepliesOrSayWhyNot) {
  const std::string line =
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, )"
      R"({"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, )"
      R"({"role": "assistant", "content": "d"}]})";
  const std::pair<const char*, const char*> cases[] = {
      {"smollm2", ""},
      {"qwen2", ""},
      {"qwen2_5", ""},
      // Mistral moves the system message into the last user turn.
      {"mistral_v03", "renders earlier messages differently once more follow"},
      // Llama 3's header tokens are plain text in SmolLM2's vocabulary, so "\n\n" at the end of
      // the generation prompt merges with what follows it.
      {"llama3", "the tokenizer merges differently across the end of it"},
      {"llama3_1", "the tokenizer merges differently across the end of it"},
  };
  for (const auto& [name, error] : cases) {
    std::ifstream in(testing::FixturePath(std::string("chat/templates/") + name + ".jinja"));
    std::stringstream source;
    source << in.rdbuf();
    auto tmpl = ChatTemplate::Parse(source.str(), name);
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    auto r = TokenizeJsonl(line, name, *tok_, tmpl->get(), {}, nullptr);
    if (*error == '\0') {
      ASSERT_TRUE(r.ok()) << name << ": " << r.status();
      EXPECT_EQ(tok_->Decode(LossTokens((*r)[0])), "b<|im_end|>d<|im_end|>") << name;
    } else {
      ASSERT_FALSE(r.ok()) << name;
      EXPECT_THAT(std::string(StatusMessage(r.status())), HasSubstr(error)) << name;
    }
  }
}

}  // namespace
}  // namespace kiln::models::train
