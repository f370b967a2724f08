#include "models/grammar/grammar.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/base/utf8.h"

namespace kiln::grammar {
namespace {

using ::testing::HasSubstr;

Grammar Parse(std::string_view text) {
  auto g = Grammar::ParseGbnf(text);
  EXPECT_TRUE(g.ok()) << g.status() << "\n" << text;
  return g.ok() ? *std::move(g) : Grammar();
}

std::string ParseError(std::string_view text) {
  auto g = Grammar::ParseGbnf(text);
  EXPECT_FALSE(g.ok()) << text;
  return g.ok() ? "" : std::string(StatusMessage(g.status()));
}

struct Case {
  const char* grammar;
  std::vector<std::string> match, no_match;
};

TEST(GrammarTest, GbnfLanguages) {
  const Case cases[] = {
      {R"(root ::= "yes" | "no")", {"yes", "no"}, {"", "y", "yesno", "maybe"}},
      {R"(root ::= [a-c]+ "!")", {"a!", "abcabc!"}, {"!", "abd!", "a"}},
      {R"(root ::= [^"\\]*)", {"", "abc", "é ü", "日本"}, {"\"", "a\\b"}},
      {R"(root ::= "a"? "b"* "c"{2} "d"{1,3} "e"{2,})",
       {"ccdee", "abbbccdddeee", "bccdeee"},
       {"cdee", "ccdddde", "ccdde", "aaccdee"}},
      {"root ::=\n  ( \"x\" | \"y\" ) ( # a comment\n  \"1\"\n   | \"2\" )\n\n# another\n",
       {"x1", "y2"},
       {"x", "xy"}},
      {R"(root ::= item ("," item)*
item ::= [0-9]+)",
       {"1", "12,3,456"},
       {"", "1,", ",1", "1,,2"}},
      {R"(root ::= "\x41\u00e9\n\t\"\\")", {"A\xC3\xA9\n\t\"\\"}, {"A"}},
      {R"(root ::= .)", {"a", "\xC3\xA9", "\xF0\x9F\x98\x80", "\n"}, {"", "ab", "\xC3", "\xFF"}},
      {R"(root ::= [\u0100-\uFFFF])",
       {"\xC4\x80", "\xEF\xBF\xBF", "\xE4\xB8\x80"},
       {"\xC3\xBF", "\xED\xA0\x80", "\xF0\x90\x80\x80"}},
      {R"g(root ::= "(" root ")" | "")g", {"", "()", "((()))"}, {"(", "())", ")("}},
      {"root ::= \"\"", {""}, {"a"}},
      {R"(root ::= [a-z]{0,3})", {"", "a", "abc"}, {"abcd"}},
  };
  for (const Case& c : cases) {
    const Grammar g = Parse(c.grammar);
    for (const std::string& s : c.match) EXPECT_TRUE(g.Matches(s)) << c.grammar << " on " << s;
    for (const std::string& s : c.no_match) {
      EXPECT_FALSE(g.Matches(s)) << c.grammar << " on " << s;
    }
  }
}

// Every code point encodes to bytes that [^x] accepts exactly when it is not x: the UTF-8
// range splitting is exact at every boundary.
TEST(GrammarTest, NegatedClassCoversEveryCodePoint) {
  const Grammar g = Parse(R"(root ::= [^a\u07FF\uFFFF])");
  auto utf8 = [](uint32_t cp) {
    std::string s;
    AppendUtf8(cp, &s);
    return s;
  };
  int wrong = 0;
  for (uint32_t cp = 0; cp <= 0x10FFFF; cp += (cp < 0x20000 ? 1 : 97)) {
    const bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
    const bool want = !surrogate && cp != 'a' && cp != 0x7FF && cp != 0xFFFF;
    wrong += g.Matches(utf8(cp)) != want;
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_FALSE(g.Matches("\xC0\x80"));  // overlong
}

TEST(GrammarTest, ParseErrorsSayWhere) {
  EXPECT_THAT(ParseError("root ::= \"a\"\nvalue = \"b\""),
              HasSubstr("grammar:2:7: expected `::=` after the rule name `value`"));
  EXPECT_THAT(ParseError("root ::= \"abc"), HasSubstr("unterminated string literal"));
  EXPECT_THAT(ParseError("root ::= [a-"), HasSubstr("unterminated character class"));
  EXPECT_THAT(ParseError("root ::= (\"a\""), HasSubstr("expected `)`"));
  EXPECT_THAT(ParseError("root ::= value"), HasSubstr("rule `value` is used but never defined"));
  EXPECT_THAT(ParseError("value ::= \"a\""), HasSubstr("the start rule `root` is not defined"));
  EXPECT_THAT(ParseError("root ::= \"a\"\nroot ::= \"b\""), HasSubstr("defined twice"));
  EXPECT_THAT(ParseError("root ::= * \"a\""), HasSubstr("nothing before it to repeat"));
  EXPECT_THAT(ParseError("root ::= \"a\"{3,2}"), HasSubstr("n < m"));
  EXPECT_THAT(ParseError("root ::= \"a\"{99999}"), HasSubstr("above 10000"));
  EXPECT_THAT(ParseError("root ::= \"\\q\""), HasSubstr("unknown escape `\\q`"));
  EXPECT_THAT(ParseError("root ::= [z-a]"), HasSubstr("out of order"));
  EXPECT_THAT(ParseError("root ::= \"a\" ]"), HasSubstr("unexpected `]`"));
}

TEST(GrammarTest, LeftRecursionIsRefusedByName) {
  EXPECT_THAT(ParseError("root ::= expr\nexpr ::= expr \"+\" term | term\nterm ::= [0-9]"),
              HasSubstr("left recursion: `expr` -> `expr`"));
  EXPECT_THAT(ParseError("root ::= a\na ::= b? \"x\" | \"y\"\nb ::= a"),
              HasSubstr("left recursion"));
  EXPECT_THAT(ParseError("root ::= (\"a\"?)*"), HasSubstr("cannot be empty"));
  // Right recursion is fine.
  EXPECT_TRUE(Grammar::ParseGbnf("root ::= \"a\" root | \"\"").ok());
}

// Review of issue 17: grammars a client sends must fail fast, not take the server down.
TEST(GrammarTest, AStartRuleThatMatchesNothingIsRefused) {
  EXPECT_THAT(ParseError(R"(root ::= [\uD800-\uDFFF])"), HasSubstr("matches nothing"));
  EXPECT_THAT(ParseError(R"(root ::= [^\x00-\U0010FFFF])"), HasSubstr("matches nothing"));
  EXPECT_THAT(ParseError("root ::= a\na ::= \"x\" a"), HasSubstr("matches nothing"));
}

TEST(GrammarTest, DeepNestingIsRefusedWithoutRecursingPerLevel) {
  std::string deep = "root ::= ";
  deep.append(200000, '(');
  deep += "\"a\"";
  deep.append(200000, ')');
  EXPECT_THAT(ParseError(deep), HasSubstr("nested more than 100 deep"));
  // A long chain of rules (each the first element of the next) is checked without recursion.
  std::string chain = "root ::= r0\n";
  for (int i = 0; i < 50000; ++i) absl::StrAppend(&chain, "r", i, " ::= r", i + 1, "\n");
  chain += "r50000 ::= \"z\"\n";
  auto g = Grammar::ParseGbnf(chain);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->Matches("z"));
}

TEST(GrammarTest, HugeRepetitionsAreRefusedWhileParsing) {
  std::string big = "root ::=";
  for (int i = 0; i < 10000; ++i) big += " \"a\"{0,10000}";
  EXPECT_THAT(ParseError(big), HasSubstr("the grammar is too large"));
}

TEST(GrammarTest, OtherStartRuleAndToString) {
  auto g = Grammar::ParseGbnf("a ::= \"x\" b\nb ::= [0-9]", "a");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->Matches("x5"));
  EXPECT_THAT(g->ToString(), HasSubstr("a ::= [x] b"));
  EXPECT_THAT(g->ToString(), HasSubstr("b ::= [0-9]"));
}

}  // namespace
}  // namespace kiln::grammar
