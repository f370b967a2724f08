#include "engine/base/json_parse.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

std::string Message(const StatusOr<json>& r) {
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return std::string(StatusMessage(r.status()));
}

TEST(ParseJsonObjectTest, ReadsObjectsAsNlohmannDoes) {
  const std::string text =
      R"({"a": 1, "b": [true, null, {"c": "x"}, []], "d": {}, "e": -2.5e10, "f": 18446744073709551615,
          "a": 2, "\u00e9": "\ud83d\ude00"})";
  auto r = ParseJsonObject(text, "the body");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, json::parse(text)) << "a repeated key: the last wins, as in json::parse";
  EXPECT_EQ((*r)["a"], 2);
  EXPECT_EQ((*r)["b"][2]["c"], "x");
  EXPECT_TRUE((*r)["f"].is_number_unsigned());
}

// Issue 14: {"temperature": 1e400} threw json::out_of_range out of the handler (HTTP 500).
TEST(ParseJsonObjectTest, NumberBeyondDoubleRangeNamesItsField) {
  for (const char* number : {"1e400", "2e308", "-1e400", "1E+999"}) {
    auto r = ParseJsonObject(StrCat(R"({"model": "m", "temperature": )", number, "}"), "the body");
    EXPECT_EQ(Message(r), StrCat("`temperature`: number out of range: ", number,
                                 " is beyond a double's ±1.8e308"));
    EXPECT_EQ(ParamOf(r.status()), "temperature");
  }
  // Underflow is not an error: it reads as 0, as strtod gives it.
  auto tiny = ParseJsonObject(R"({"temperature": 1e-400})", "the body");
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ((*tiny)["temperature"], 0.0);
}

TEST(ParseJsonObjectTest, NestedFieldsArePathsWithThePrefix) {
  auto r = ParseJsonObject(R"({"messages": [{"role": "user"}, {"x": [1, 2, 1e999]}]})", "body");
  EXPECT_THAT(Message(r), HasSubstr("`messages[1].x[2]`: number out of range"));
  EXPECT_EQ(ParamOf(r.status()), "messages[1].x[2]");

  auto in_tensor = ParseJsonObject(R"({"top_p": 0.5, "temperature": 1e400})",
                                   "input 'sampling_parameters'", "sampling_parameters.");
  EXPECT_THAT(Message(in_tensor), HasSubstr("`sampling_parameters.temperature`"));
  EXPECT_EQ(ParamOf(in_tensor.status()), "sampling_parameters.temperature");
}

TEST(ParseJsonObjectTest, OutOfRangeOutsideAnObjectSaysWhichDocument) {
  auto top = ParseJsonObject("1e400", "the request body");
  EXPECT_EQ(Message(top),
            "the request body: number out of range: 1e400 is beyond a double's ±1.8e308");
  EXPECT_EQ(ParamOf(top.status()), "");
  auto in_list = ParseJsonObject("[1, 1e400]", "the request body");
  EXPECT_THAT(Message(in_list), HasSubstr("the request body: number out of range"));
}

TEST(ParseJsonObjectTest, SyntaxErrorsGiveThePositionAndTheField) {
  auto nan = ParseJsonObject(R"({"temperature": NaN})", "the request body");
  EXPECT_THAT(Message(nan), HasSubstr("the request body is not valid JSON: `temperature`: parse "
                                      "error at line 1, column 17"));
  EXPECT_EQ(ParamOf(nan.status()), "temperature");

  auto bad_utf8 = ParseJsonObject("{\"a\": \"\xff\xfe\"}", "the body");
  EXPECT_THAT(Message(bad_utf8), HasSubstr("the body is not valid JSON: `a`:"));
  EXPECT_THAT(Message(bad_utf8), HasSubstr("UTF-8"));
  EXPECT_FALSE(ParseJsonObject(R"({"a": "\ud800"})", "body").ok()) << "a lone surrogate";

  // Between members no field is being read: only the position.
  auto comma = ParseJsonObject(R"({"a": 1 "b": 2})", "the body");
  EXPECT_THAT(Message(comma), HasSubstr("the body is not valid JSON: parse error at line 1"));
  EXPECT_EQ(ParamOf(comma.status()), "");
  auto cut = ParseJsonObject("{\"inputs\": [", "the body");
  EXPECT_THAT(Message(cut), HasSubstr("`inputs[0]`: parse error"));
  EXPECT_THAT(Message(ParseJsonObject("not json", "the body")),
              HasSubstr("the body is not valid JSON: parse error at line 1, column 2"));
  EXPECT_THAT(Message(ParseJsonObject("", "the body")), HasSubstr("unexpected end of input"));
  EXPECT_THAT(Message(ParseJsonObject("{} {}", "the body")), HasSubstr("expected end of input"));
}

TEST(ParseJsonObjectTest, LongTokensAreClippedInMessages) {
  const std::string digits(5000, '9');
  auto big = ParseJsonObject(StrCat(R"({"n": )", digits, "e9}"), "the body");
  EXPECT_LT(Message(big).size(), 200u);
  EXPECT_THAT(Message(big), HasSubstr("`n`: number out of range: 9999"));
  const std::string text(100000, 'a');
  auto bad = ParseJsonObject(StrCat(R"({"s": ")", text, "\xff\"}"), "the body");
  EXPECT_LT(Message(bad).size(), 300u);
  EXPECT_THAT(Message(bad), Not(HasSubstr(std::string(100, 'a'))));
}

TEST(ParseJsonObjectTest, AnythingButAnObjectIsRefused) {
  EXPECT_THAT(Message(ParseJsonObject("[1, 2]", "body")),
              HasSubstr("body must be a JSON object, got a list"));
  EXPECT_THAT(Message(ParseJsonObject("null", "body")), HasSubstr("got null"));
  EXPECT_THAT(Message(ParseJsonObject(R"("x")", "body")), HasSubstr("got a string"));
}

TEST(ParseJsonObjectTest, WithoutWhatMessagesStartWithTheProblem) {
  EXPECT_THAT(Message(ParseJsonObject(R"({"a": [)", "")),
              ::testing::StartsWith("not valid JSON: `a[0]`: parse error at line 1"));
  EXPECT_EQ(Message(ParseJsonObject("[1]", "")), "expected a JSON object, got a list");
  EXPECT_EQ(Message(ParseJsonObject("1e400", "")),
            "number out of range: 1e400 is beyond a double's ±1.8e308");
}

TEST(ParseOrderedJsonObjectTest, KeepsDocumentOrderAndFindsTheSameErrors) {
  auto r = ParseOrderedJsonObject(R"({"z": 1, "a": {"y": [1, 2], "b": null}, "m": "x"})", "doc");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dump(), R"({"z":1,"a":{"y":[1,2],"b":null},"m":"x"})");
  auto bad = ParseOrderedJsonObject(R"({"z": 1, "a": {"y": [1, 2e308]}})", "doc");
  EXPECT_THAT(Message(bad), HasSubstr("`a.y[1]`: number out of range: 2e308"));
}

// Nesting up to kMaxJsonDepth parses; deeper is refused naming the field, without recursion
// (no stack overflow) — and so nothing downstream walks a deeper document.
TEST(ParseJsonObjectTest, NestingIsBounded) {
  auto nested = [](int depth, std::string_view inner = "") {
    return StrCat(R"({"a": )", std::string(depth, '['), inner, std::string(depth, ']'), "}");
  };
  EXPECT_TRUE(ParseJsonObject(nested(kMaxJsonDepth - 1), "body").ok());
  auto r = ParseJsonObject(nested(kMaxJsonDepth), "body");
  EXPECT_THAT(Message(r), HasSubstr("`a[0][0]"));
  EXPECT_THAT(Message(r), HasSubstr("nests arrays and objects deeper than 256 levels"));
  EXPECT_EQ(ParamOf(r.status()), Message(r).substr(1, Message(r).find('`', 1) - 1));
  for (const int depth : {100000, 1000000}) {
    EXPECT_THAT(Message(ParseJsonObject(nested(depth), "body")), HasSubstr("deeper than 256"));
    EXPECT_THAT(Message(ParseJsonObject(nested(depth, "1e400"), "body")),
                HasSubstr("deeper than 256"));
    const std::string top = std::string(depth, '[') + std::string(depth, ']');
    EXPECT_THAT(Message(ParseJsonObject(top, "the request body")),
                HasSubstr("the request body nests arrays and objects deeper than 256 levels"));
    EXPECT_THAT(Message(ParseOrderedJsonObject(nested(depth), "line 3")),
                HasSubstr("deeper than 256"));
  }
}

}  // namespace
}  // namespace kiln
