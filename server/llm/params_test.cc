#include "server/llm/params.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kiln::llm {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

TEST(JsonFieldsTest, IntegersAcceptWholeNumbersOnly) {
  json j = {{"a", 5}, {"b", 2.0}, {"c", 2.5}, {"d", "7"}, {"e", nullptr}, {"f", -3}};
  JsonFields f(j);
  EXPECT_EQ(**f.Int("a"), 5);
  EXPECT_EQ(**f.Int("b"), 2);
  EXPECT_EQ(**f.Int("f"), -3);
  EXPECT_FALSE(f.Int("e")->has_value()) << "null reads as not given";
  EXPECT_FALSE(f.Int("missing")->has_value());
  auto c = f.Int("c");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(StatusMessage(c.status()), HasSubstr("`c` must be an integer, got a number 2.5"));
  EXPECT_EQ(ParamOf(c.status()), "c");
  EXPECT_FALSE(f.Int("d").ok()) << "strings only in lenient mode";
  EXPECT_EQ(**JsonFields(j, "", /*lenient=*/true).Int("d"), 7);
}

TEST(JsonFieldsTest, HugeIntegersAreReportedNotWrapped) {
  json j = json::parse(R"({"a": 99999999999999999999, "b": 1e300, "c": 18446744073709551615})");
  JsonFields f(j);
  for (const char* key : {"a", "b", "c"}) {
    auto v = f.Int(key);
    ASSERT_FALSE(v.ok()) << key;
    EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_THAT(StatusMessage(f.Int("c").status()), HasSubstr("too large"));
}

TEST(JsonFieldsTest, PrefixNamesNestedFields) {
  json j = {{"include_usage", "yes"}};
  auto v = JsonFields(j, "stream_options.").Bool("include_usage");
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(StatusMessage(v.status()), HasSubstr("`stream_options.include_usage`"));
  EXPECT_EQ(ParamOf(v.status()), "stream_options.include_usage");
}

TEST(JsonFieldsTest, StringsTakeAStringOrAList) {
  json j = {{"one", "x"}, {"many", {"a", "b"}}, {"bad", {"a", 1}}, {"num", 3}};
  JsonFields f(j);
  EXPECT_EQ(**f.Strings("one"), std::vector<std::string>{"x"});
  EXPECT_EQ(**f.Strings("many"), (std::vector<std::string>{"a", "b"}));
  EXPECT_THAT(StatusMessage(f.Strings("bad").status()), HasSubstr("`bad[1]` must be a string"));
  EXPECT_FALSE(f.Strings("num").ok());
}

TEST(ReadSamplingFieldsTest, ReadsEveryKey) {
  json j = json::parse(R"({"temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1,
      "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
      "seed": -1, "stop": "###", "stop_token_ids": [5, 6], "ignore_eos": true,
      "min_tokens": 3, "unknown_key": 1})");
  models::SamplingParams p;
  ASSERT_TRUE(ReadSamplingFields(JsonFields(j), &p).ok());
  EXPECT_FLOAT_EQ(p.temperature, 0.5f);
  EXPECT_FLOAT_EQ(p.top_p, 0.9f);
  EXPECT_EQ(p.top_k, 0) << "vLLM's -1 means off";
  EXPECT_FLOAT_EQ(p.min_p, 0.1f);
  EXPECT_FLOAT_EQ(p.repetition_penalty, 1.2f);
  EXPECT_FLOAT_EQ(p.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(p.frequency_penalty, -0.5f);
  EXPECT_EQ(p.seed, std::numeric_limits<uint64_t>::max()) << "negative seeds keep their bits";
  EXPECT_EQ(p.stop, std::vector<std::string>{"###"});
  EXPECT_EQ(p.stop_token_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_EQ(p.min_tokens, 3);
}

TEST(ReadSamplingFieldsTest, LenientStringsAsTritonClientsSendThem) {
  json j = {{"temperature", "0"}, {"top_k", "5"}, {"ignore_eos", "true"}};
  models::SamplingParams p;
  ASSERT_TRUE(ReadSamplingFields(JsonFields(j, "", true), &p).ok());
  EXPECT_EQ(p.temperature, 0.0f);
  EXPECT_EQ(p.top_k, 5);
  EXPECT_TRUE(p.ignore_eos);
  json bad = {{"temperature", "warm"}};
  Status s = ReadSamplingFields(JsonFields(bad, "", true), &p);
  EXPECT_EQ(ParamOf(s), "temperature");
}

TEST(ReadSamplingFieldsTest, TypeErrorsNameTheField) {
  json j = {{"temperature", "hot"}};
  models::SamplingParams p;
  Status s = ReadSamplingFields(JsonFields(j), &p);
  EXPECT_THAT(StatusMessage(s), HasSubstr("`temperature` must be a number, got a string"));
  json k = {{"top_k", -2}};
  EXPECT_EQ(ParamOf(ReadSamplingFields(JsonFields(k), &p)), "top_k");
}

TEST(ParamOfTest, PayloadWinsOverTheMessage) {
  EXPECT_EQ(ParamOf(InvalidArgument("`top_p` is 1.5; it must be in (0, 1]")), "top_p");
  EXPECT_EQ(ParamOf(WithParam(InvalidArgument("`x` is bad"), "messages[0].role")),
            "messages[0].role");
  EXPECT_EQ(ParamOf(InvalidArgument("no field here")), "");
  EXPECT_EQ(ParamOf(OkStatus()), "");
}

TEST(ValidUtf8Test, ReplacesInvalidSequencesOnly) {
  EXPECT_EQ(ValidUtf8("héllo €𝄞"), "héllo €𝄞");
  EXPECT_EQ(ValidUtf8("a\xffz"), "a\xEF\xBF\xBDz");
  EXPECT_EQ(ValidUtf8("\xE2\x82"), "\xEF\xBF\xBD\xEF\xBF\xBD") << "a cut character";
  EXPECT_EQ(ValidUtf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD") << "overlong";
  EXPECT_EQ(ValidUtf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD") << "surrogate";
}

}  // namespace
}  // namespace kiln::llm
