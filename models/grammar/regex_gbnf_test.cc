#include "models/grammar/regex_gbnf.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/base/utf8.h"
#include "models/grammar/grammar.h"

namespace kiln::grammar {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

struct Case {
  std::string pattern;
  std::vector<std::string> match, no_match;
};

// Translates, parses, and checks the strings; the generated grammar must parse.
void Check(const Case& c, const RegexGbnfOptions& options = {}) {
  StatusOr<std::string> gbnf = RegexToGbnf(c.pattern, "root", options);
  ASSERT_TRUE(gbnf.ok()) << c.pattern << ": " << gbnf.status();
  StatusOr<Grammar> g = Grammar::ParseGbnf(*gbnf);
  ASSERT_TRUE(g.ok()) << c.pattern << "\n" << *gbnf << g.status();
  for (const std::string& s : c.match) {
    EXPECT_TRUE(g->Matches(s)) << "/" << c.pattern << "/ should match `" << s << "`\n" << *gbnf;
  }
  for (const std::string& s : c.no_match) {
    EXPECT_FALSE(g->Matches(s)) << "/" << c.pattern << "/ should not match `" << s << "`\n"
                                << *gbnf;
  }
}

TEST(RegexGbnfTest, Languages) {
  const Case cases[] = {
      {"abc", {"abc"}, {"", "ab", "abcd", "xabc"}},
      {"^abc$", {"abc"}, {"ab", "abcc"}},
      {"", {""}, {"a"}},
      {"a|b|cd", {"a", "b", "cd"}, {"", "c", "ab"}},
      {"^a$|^b$", {"a", "b"}, {"ab", ""}},
      {"a*", {"", "a", "aaaa"}, {"b", "ab"}},
      {"a+b?", {"a", "ab", "aaab"}, {"", "b", "abb"}},
      {"ab*c", {"ac", "abc", "abbbc"}, {"abcc", "bc"}},
      {"(ab)+", {"ab", "abab"}, {"", "aba", "ba"}},
      {"(?:ab|c){2}", {"abab", "abc", "cc", "cab"}, {"ab", "c", "ccc"}},
      {"a{3}", {"aaa"}, {"aa", "aaaa"}},
      {"a{2,}", {"aa", "aaaaa"}, {"a", ""}},
      {"a{1,3}", {"a", "aa", "aaa"}, {"", "aaaa"}},
      {"a{0,2}b", {"b", "ab", "aab"}, {"aaab"}},
      {"a*?b+?c??", {"b", "aabbc"}, {"c", "abcc"}},
      {"x{", {"x{"}, {"x"}},
      {"x{a}", {"x{a}"}, {"x"}},
      {"{}", {"{}"}, {""}},
      {"[abc]", {"a", "b", "c"}, {"d", "", "ab"}},
      {"[a-z0-9_]+", {"abc_09", "z"}, {"A", "a-b", ""}},
      {"[^a-z]", {"A", "0", "\n", "\xC3\xA9"}, {"a", "z", ""}},
      {"[-a]", {"-", "a"}, {"b"}},
      {"[a-]", {"-", "a"}, {"b"}},
      {"[\\]\\\\\\-]", {"]", "\\", "-"}, {"a"}},
      {"[\\d\\s]", {"5", " ", "\t"}, {"a"}},
      {"[^\\d]", {"a", " "}, {"5"}},
      {"[\\w.-]+@[\\w-]+\\.[a-z]{2,3}", {"john.doe@mail.com", "a-b@c-d.org"}, {"a@b.c", "@x.com"}},
      {"\\d{3}-\\d{4}", {"555-1234"}, {"5551234", "55-1234", "abc-defg"}},
      {"\\D\\W\\S", {"a!b"}, {"1!b", "aab", "a! "}},
      {"\\w+", {"Hello_42"}, {"hi there", "é"}},
      {"a\\sb",
       {"a b", "a\tb", "a\nb",
        "a\xC2\xA0"
        "b",
        "a\xE3\x80\x80"
        "b"},
       {"ab", "a_b"}},
      {".", {"a", " ", "\xC3\xA9", "\xF0\x9F\x98\x80"}, {"\n", "", "ab"}},
      {".*", {"", "anything at all", "\xE6\x97\xA5\xE6\x9C\xAC"}, {"two\nlines"}},
      {"[^]", {"a", "\n"}, {"", "ab"}},
      {"\\.\\*\\+\\?\\(\\)\\[\\]\\{\\}\\|\\^\\$\\\\\\/", {".*+?()[]{}|^$\\/"}, {""}},
      {"\\n\\t\\r\\f\\v\\0", {std::string("\n\t\r\f\v\0", 6)}, {"ntr"}},
      {"\\x41\\u00e9\\u{1F600}", {"A\xC3\xA9\xF0\x9F\x98\x80"}, {"A"}},
      {"\\uD83D\\uDE00", {"\xF0\x9F\x98\x80"}, {""}},
      {"[\\u0100-\\uFFFF]", {"\xC4\x80", "\xE4\xB8\x80"}, {"a", "\xC3\xBF"}},
      {"[\\b]", {"\b"}, {"b"}},
      {"\"quoted\"", {"\"quoted\""}, {"quoted"}},
      {"caf\xC3\xA9|\xE6\x97\xA5+", {"caf\xC3\xA9", "\xE6\x97\xA5\xE6\x97\xA5"}, {"cafe"}},
      // Repetitions of what can be empty: rewritten so the grammar has no empty loops.
      {"(a*)*", {"", "a", "aaa"}, {"b"}},
      {"(a?b?)+", {"", "a", "b", "ab", "ba", "abba"}, {"c"}},
      {"(a|)*b", {"b", "aab"}, {"ba"}},
      {"(a*b*){2,3}c", {"c", "abc", "bac", "ababac"}, {"abcc"}},
      {"((a?){3})*", {"", "aaaaa"}, {"b"}},
      {"(|a)+", {"", "a", "aa"}, {"b"}},
      {"(?:)", {""}, {"a"}},
      {"()*x", {"x"}, {"xx"}},
      {"a{0}b", {"b"}, {"ab"}},
      {"(a{0})*", {""}, {"a"}},
      {"[0-9]{4}-[0-9]{2}-[0-9]{2}", {"2024-01-31"}, {"2024-1-31", "20240131"}},
      {"(\\+|-)?\\d+(\\.\\d+)?", {"1", "-2.5", "+10.25"}, {"1.", ".5", "+-1"}},
  };
  for (const Case& c : cases) Check(c);
}

TEST(RegexGbnfTest, RuleNameAndOutputShape) {
  StatusOr<std::string> gbnf = RegexToGbnf("ab|c", "my-rule");
  ASSERT_TRUE(gbnf.ok()) << gbnf.status();
  EXPECT_EQ(*gbnf, "my-rule ::= (\"ab\" | \"c\")\n");
  StatusOr<Grammar> g = Grammar::ParseGbnf(*gbnf, "my-rule");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->Matches("ab"));
  EXPECT_THAT(std::string(StatusMessage(RegexToGbnf("a", "bad name").status())),
              HasSubstr("rule name"));
  EXPECT_THAT(std::string(StatusMessage(RegexToGbnf("a", "").status())), HasSubstr("rule name"));
}

TEST(RegexGbnfTest, Errors) {
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {"(a)\\1", {"backreference", "position 3"}},
      {"(?<y>a)\\k<y>", {"named group", "position 0"}},
      {"a\\k<y>", {"named backreference", "position 1"}},
      {"a(?=b)", {"lookahead", "position 1"}},
      {"a(?!b)", {"negative lookahead", "position 1"}},
      {"(?<=a)b", {"lookbehind", "position 0"}},
      {"(?<!a)b", {"negative lookbehind", "position 0"}},
      {"(?P<x>a)", {"named group", "position 0"}},
      {"(?>a)", {"atomic group", "position 0"}},
      {"(?i)a", {"group modifier", "position 0"}},
      {"\\bword", {"word boundary", "position 0"}},
      {"a\\B", {"\\B", "position 1"}},
      {"a^b", {"`^`", "position 1"}},
      {"a$b", {"`$`", "position 1"}},
      {"(a$)", {"`$`", "position 2"}},
      {"a*+", {"possessive", "position 2"}},
      {"a++", {"possessive", "position 2"}},
      {"a**", {"nothing to repeat", "position 2"}},
      {"*a", {"nothing to repeat", "position 0"}},
      {"a|?", {"nothing to repeat", "position 2"}},
      {"{2}", {"nothing to repeat", "position 0"}},
      {"a{2}{3}", {"nothing to repeat", "position 4"}},
      {"a{0,100000}", {"above 1000", "position 1"}},
      {"a{1001}", {"above 1000", "position 1"}},
      {"a{3,2}", {"n < m", "position 1"}},
      {"(ab", {"unclosed `(`", "position 0"}},
      {"ab)", {"unmatched `)`", "position 2"}},
      {"[ab", {"unclosed `[`", "position 0"}},
      {"[]", {"empty class", "position 0"}},
      {"[]a]", {"empty class", "position 0"}},
      {"[z-a]", {"out of order", "position 1"}},
      {"[\\d-z]", {"range with a class escape", "position 1"}},
      {"[^\\s\\S]", {"matches no character", "position 0"}},
      {"ab\\", {"`\\` at the end", "position 2"}},
      {"\\p{L}", {"Unicode property", "position 0"}},
      {"\\cJ", {"control escape", "position 0"}},
      {"\\q", {"escape `\\q`", "position 0"}},
      {"\\x4", {"two hex digits", "position 0"}},
      {"\\u12", {"four hex digits", "position 0"}},
      {"\\uD800", {"lone surrogate", "position 0"}},
      {"\\u{110000}", {"malformed", "position 0"}},
      {"\\01", {"octal", "position 0"}},
      {"\xC3(", {"not valid UTF-8"}},
      {std::string(300, '(') + std::string(300, ')'), {"nested deeper than 200", "position 200"}},
  };
  for (const auto& [pattern, parts] : cases) {
    StatusOr<std::string> gbnf = RegexToGbnf(pattern);
    ASSERT_FALSE(gbnf.ok()) << pattern << " gave " << *gbnf;
    EXPECT_EQ(gbnf.status().code(), StatusCode::kInvalidArgument) << pattern;
    for (const std::string& part : parts) {
      EXPECT_THAT(std::string(StatusMessage(gbnf.status())), HasSubstr(part)) << pattern;
    }
  }
}

// JSON Schema's `pattern`: the content of a JSON string as JSON writes it, searched for.
TEST(RegexGbnfTest, JsonStringSearch) {
  const RegexGbnfOptions json{.json_string = true, .anchored = false};
  const Case cases[] = {
      {"^abc$", {"abc"}, {"xabc", "abcx"}},
      {"abc", {"abc", "xxabc", "abcxx", "1abc2"}, {"ab", "acb"}},
      {"^ab", {"ab", "abc"}, {"xab"}},
      {"ab$", {"ab", "xab"}, {"abx"}},
      {"^a$|b", {"a", "b", "xbx"}, {"xa", "ax"}},
      {"^a\"b$", {"a\\\"b"}, {"a\"b"}},
      {"^a\\\\b$", {"a\\\\b"}, {"a\\b"}},
      {"^a/b$", {"a/b", "a\\/b"}, {"a\\\\b"}},
      {"^a\\nb$", {"a\\nb", "a\\u000ab", "a\\u000Ab"}, {"a\nb", "anb", "a\\u000bb"}},
      {"^a\\tb$", {"a\\tb", "a\\u0009b"}, {"a\tb"}},
      {"^.$",
       {"x", "\\\"", "\\\\", "\\/", "\\t", "\\u001f", "\\u007F", "\xC3\xA9"},
       {"\\n", "\\u000a", "\"", "\\", "\n", "\x7F", "\\x"}},
      {"^[^a]$", {"b", "\\n", "\\\"", "\\u0000"}, {"a", "\""}},
      {"^[\"\\\\]$", {"\\\"", "\\\\"}, {"\"", "\\"}},
      {"^\\x7f$", {"\\u007f", "\\u007F"}, {"\x7F"}},
      {"^[\\x00-\\x1f]$", {"\\u0000", "\\u001F", "\\n", "\\b", "\\f"}, {"\\u0020", " "}},
      {"^\\d+$", {"123"}, {"12a", ""}},
      {"", {"", "anything", "\\\"", "\\n"}, {"\"", "\n"}},
  };
  for (const Case& c : cases) Check(c, json);
}

TEST(RegexGbnfTest, Helpers) {
  EXPECT_EQ(GbnfLiteral("a\"b\\c\n\r\t\x01\x7F"), R"("a\"b\\c\n\r\t\x01\x7F")");
  EXPECT_EQ(GbnfLiteral("\xC3\xA9\xF0\x9F\x98\x80"), R"("\u00E9\U0001F600")");
  EXPECT_EQ(GbnfLiteral("\xFF"), R"("\uFFFD")");
  EXPECT_EQ(GbnfClassChar('a'), "a");
  EXPECT_EQ(GbnfClassChar('-'), "\\x2D");
  EXPECT_EQ(GbnfClassChar('^'), "\\x5E");
  EXPECT_EQ(GbnfClassChar(']'), "\\]");
  EXPECT_EQ(GbnfClassChar(0xE9), "\\u00E9");
  EXPECT_TRUE(IsGbnfRuleName("root-a-1"));
  EXPECT_FALSE(IsGbnfRuleName("root_a"));
  EXPECT_TRUE(IsGbnfPrimary("\"a b\""));
  EXPECT_TRUE(IsGbnfPrimary("(\"a\" | [)])"));
  EXPECT_TRUE(IsGbnfPrimary("[\\]a]"));
  EXPECT_FALSE(IsGbnfPrimary("\"a\" \"b\""));
  EXPECT_FALSE(IsGbnfPrimary("\"a\"*"));
  EXPECT_FALSE(IsGbnfPrimary("(a) (b)"));
  EXPECT_EQ(GbnfAlternatives({"a", "b", "a"}), "(a | b)");
  EXPECT_EQ(GbnfAlternatives({"a b", ""}), "(a b)?");
  EXPECT_EQ(GbnfAlternatives({"", ""}), "");
  EXPECT_EQ(GbnfRepeat("a", 0, -1), "a*");
  EXPECT_EQ(GbnfRepeat("a b", 2, 5), "(a b){2,5}");
  EXPECT_EQ(GbnfRepeat("a", 3, 3), "a{3}");
  EXPECT_EQ(GbnfRepeat("a", 2, -1), "a{2,}");
  EXPECT_EQ(GbnfRepeat("a", 1, 1), "a");
  EXPECT_EQ(GbnfRepeat("a", 0, 0), "");
}

std::string Repeated(std::string_view s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// `(a?a?...a?)*`: the rewrite of a sequence whose items can all be empty copied the rest of the
// sequence once per item, so 10,000 `a?` (20 KB) made ~250 MB of GBNF. The suffixes are now
// shared (helper rules): the output is linear in the pattern.
TEST(RegexGbnfTest, NullableSequenceRewriteIsLinear) {
  const std::string items = Repeated("a?", 8000);  // 16 KB, just under the pattern limit
  for (const std::string& pattern :
       {StrCat("(", items, ")*"), StrCat("(", items, "){0,2}"), StrCat("x(", items, "b?){2,3}y")}) {
    StatusOr<std::string> gbnf = RegexToGbnf(pattern);
    ASSERT_TRUE(gbnf.ok()) << gbnf.status();
    EXPECT_LT(gbnf->size(), 40 * pattern.size()) << pattern.substr(0, 20);
  }
  // The review's pattern (20 KB) is over the pattern limit.
  EXPECT_THAT(
      std::string(StatusMessage(RegexToGbnf(StrCat("(", Repeated("a?", 10000), ")*")).status())),
      HasSubstr("at most 16384"));
  // The rewrite keeps the language, helper rules included.
  const std::string a200 = Repeated("a?", 200);
  Check({StrCat("(", a200, ")*"), {"", "a", std::string(1000, 'a')}, {"b", "ab"}});
  Check({StrCat("(", a200, "){0,2}"),
         {"", "a", std::string(400, 'a')},
         {std::string(401, 'a'), "b"}});
  Check({StrCat("x(", Repeated("a?b?", 50), "){2,3}y"),
         {"xy", "xaby", "xbay", StrCat("x", Repeated("ab", 150), "y")},
         {StrCat("x", Repeated("ab", 150), "ay"), "xcy"}});
  StatusOr<std::string> gbnf = RegexToGbnf(StrCat("(", a200, "){0,2}"), "r");
  ASSERT_TRUE(gbnf.ok()) << gbnf.status();
  EXPECT_THAT(*gbnf, AllOf(testing::StartsWith("r ::= "), HasSubstr("\nr-1 ::= ")));
}

// `(a?(a?(...b){0,2}){0,2}){0,2}`: both the sequence and what repeated it held the rewritten
// inner part, so the GBNF doubled with each level (163 bytes of pattern, 18 levels: 3.8 MB).
TEST(RegexGbnfTest, NestedNullableRepetitionsStayLinear) {
  std::string nested = "b";
  for (int i = 0; i < 40; ++i) nested = StrCat("(a?", nested, "){0,2}");
  StatusOr<std::string> gbnf = RegexToGbnf(nested);
  ASSERT_TRUE(gbnf.ok()) << gbnf.status();
  EXPECT_LT(gbnf->size(), 20 * nested.size());
  Check({"(a?(a?(a?b){0,2}){0,2}){0,2}",
         {"", "a", "b", "ab", "ba", "aab", std::string(8, 'b'), "abababab"},
         {std::string(9, 'b'), "c"}});
}

TEST(RegexGbnfTest, Limits) {
  // The pattern: at most kMaxRegexPatternBytes.
  EXPECT_TRUE(RegexToGbnf(std::string(kMaxRegexPatternBytes, 'a')).ok());
  StatusOr<std::string> long_pattern = RegexToGbnf(std::string(kMaxRegexPatternBytes + 1, 'a'));
  ASSERT_FALSE(long_pattern.ok());
  EXPECT_EQ(long_pattern.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(StatusMessage(long_pattern.status())),
              AllOf(HasSubstr("16385 bytes"), HasSubstr("at most 16384")));
  // The GBNF: at most kMaxRegexGbnfBytes (a JSON string's `.` is ~90 bytes of GBNF).
  StatusOr<std::string> large =
      RegexToGbnf(std::string(16000, '.'), "root", {.json_string = true, .anchored = false});
  ASSERT_FALSE(large.ok());
  EXPECT_EQ(large.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(StatusMessage(large.status())),
              AllOf(HasSubstr("too complex"), HasSubstr("1048576 bytes")));
  // Large classes and many alternatives take linearithmic time.
  std::string cls = "[";
  for (uint32_t c = 0x4E00; c < 0x4E00 + 2 * 2500; c += 2) AppendUtf8(c, &cls);
  cls += "]";
  EXPECT_TRUE(RegexToGbnf(cls).ok());
  std::string alts = "x";
  for (int i = 0; i < 2000; ++i) alts += StrCat("|", i);
  EXPECT_TRUE(RegexToGbnf(alts).ok());
}

}  // namespace
}  // namespace kiln::grammar
