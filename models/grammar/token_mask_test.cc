#include "models/grammar/token_mask.h"

#include <gtest/gtest.h>

#include <random>

namespace kiln::grammar {
namespace {

std::shared_ptr<const Grammar> Parse(std::string_view text) {
  auto g = Grammar::ParseGbnf(text);
  EXPECT_TRUE(g.ok()) << g.status();
  return std::make_shared<const Grammar>(g.ok() ? *std::move(g) : Grammar());
}

bool Bit(std::span<const uint32_t> m, int32_t t) { return (m[t >> 5] >> (t & 31)) & 1u; }

// A small vocabulary: single characters, common pieces, multi-byte UTF-8 split mid-character,
// one special token, one empty token, and EOS.
std::shared_ptr<const TokenVocabulary> Vocab() {
  std::vector<std::string> bytes = {"<eos>", "<|special|>", ""};
  for (const char* s :
       {"{",    "}",   "\"",   ":",  ",",  " ",    "\n",   "a",        "b",  "ab",   "abc",
        "\"a",  "\":", "\": ", "1",  "12", "123",  "-",    ".",        "e",  "true", "false",
        "null", "[",   "]",    "[]", "{}", "\xC3", "\xA9", "\xC3\xA9", "},", "\"}",  "x"}) {
    bytes.push_back(s);
  }
  std::vector<bool> never(bytes.size(), false);
  never[1] = true;
  return std::make_shared<const TokenVocabulary>(bytes, never, std::vector<int32_t>{0});
}

// The reference: a token is allowed when its bytes continue the text so far under the grammar
// (checked by re-matching from the start), EOS when the text so far is complete.
bool ReferenceAllows(const Grammar& g, const std::string& so_far, const TokenVocabulary& v,
                     int32_t t) {
  if (v.is_end(t)) return g.Matches(so_far);
  if (v.bytes(t).empty() || t == 1) return false;
  ByteMatcher m(g);
  for (const char c : so_far + v.bytes(t)) {
    if (!m.Advance(static_cast<uint8_t>(c))) return false;
  }
  return true;
}

TEST(TokenMaskTest, MasksEqualTheReferenceAlongRandomWalks) {
  const auto vocab = Vocab();
  for (const char* text :
       {R"(root ::= "{" ( "\"" [a-c]+ "\": " [0-9]+ ("," " "? "\"" [a-c]+ "\": " [0-9]+)* )? "}")",
        R"(root ::= "[" ("true" | "false" | "null" | [^\x00-\x7F]+)* "]")",
        R"(root ::= [ab]+ | "x" root)"}) {
    const auto g = Parse(text);
    auto tg = std::make_shared<TokenGrammar>(g, vocab);
    std::mt19937 rng(7);
    for (int walk = 0; walk < 30; ++walk) {
      TokenMatcher m(tg);
      std::string so_far;
      for (int step = 0; step < 40; ++step) {
        std::vector<uint32_t> mask(vocab->words());
        ASSERT_TRUE(m.FillMask(mask).ok());
        std::vector<int32_t> allowed;
        for (int32_t t = 0; t < vocab->size(); ++t) {
          ASSERT_EQ(Bit(mask, t), ReferenceAllows(*g, so_far, *vocab, t))
              << text << "\nafter `" << so_far << "` token `" << vocab->bytes(t) << "`";
          if (Bit(mask, t)) allowed.push_back(t);
        }
        if (allowed.empty()) break;
        const int32_t t = allowed[rng() % allowed.size()];
        ASSERT_TRUE(m.Accept(t).ok());
        if (vocab->is_end(t)) {
          EXPECT_TRUE(g->Matches(so_far));
          EXPECT_TRUE(m.ended());
          break;
        }
        so_far += vocab->bytes(t);
        EXPECT_EQ(m.accepting(), g->Matches(so_far));
      }
    }
  }
}

TEST(TokenMaskTest, CompleteOutputAllowsOnlyEnd) {
  const auto vocab = Vocab();
  auto tg = std::make_shared<TokenGrammar>(Parse(R"(root ::= "{}")"), vocab);
  TokenMatcher m(tg);
  EXPECT_FALSE(m.accepting());
  ASSERT_TRUE(m.Accept(29).ok());  // "{}"
  EXPECT_TRUE(m.complete());
  std::vector<uint32_t> mask(vocab->words());
  ASSERT_TRUE(m.FillMask(mask).ok());
  for (int32_t t = 0; t < vocab->size(); ++t) EXPECT_EQ(Bit(mask, t), t == 0) << t;
  EXPECT_FALSE(m.Accept(3).ok());  // "{" after the end
  ASSERT_TRUE(m.Accept(0).ok());
  EXPECT_TRUE(m.ended());
  EXPECT_FALSE(m.Accept(0).ok());
}

TEST(TokenMaskTest, RejectedTokenIsAnError) {
  auto tg = std::make_shared<TokenGrammar>(Parse(R"(root ::= "a"+)"), Vocab());
  TokenMatcher m(tg);
  const Status s = m.Accept(4);  // "}"
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(m.Accept(0).ok());  // EOS before anything: "a"+ needs one
  EXPECT_TRUE(m.Accept(10).ok());  // "a"
}

TEST(TokenMaskTest, MasksAreCachedPerState) {
  auto tg = std::make_shared<TokenGrammar>(Parse(R"(root ::= "\"" [a-z]* "\"")"), Vocab());
  TokenMatcher m(tg);
  std::vector<uint32_t> mask(tg->vocab().words());
  ASSERT_TRUE(m.Accept(5).ok());  // "\""
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(m.FillMask(mask).ok());
    ASSERT_TRUE(m.Accept(i % 2 ? 12 : 13).ok());  // "ab", "abc"
  }
  EXPECT_EQ(tg->stats().masks, 1);  // inside the string: one state, one mask
  ASSERT_TRUE(tg->Precompute(4, 100).ok());
  EXPECT_GE(tg->stats().masks, 3);
}

}  // namespace
}  // namespace kiln::grammar
