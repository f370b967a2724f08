#include "models/grammar/matcher.h"

#include <gtest/gtest.h>

namespace kiln::grammar {
namespace {

Grammar Parse(std::string_view text) {
  auto g = Grammar::ParseGbnf(text);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *std::move(g) : Grammar();
}

int32_t Walk(StateSpace& space, std::string_view text) {
  int32_t s = space.initial();
  for (const char c : text) {
    s = space.Advance(s, static_cast<uint8_t>(c));
    if (s < 0) return s;
  }
  return s;
}

// Right recursion runs as a tail call: a long repetition revisits one state instead of
// growing a stack, so the state table stays small however long the text.
TEST(MatcherTest, RepetitionRevisitsTheSameState) {
  const Grammar g = Parse(R"(root ::= "\"" [a-z]* "\"")");
  StateSpace space(g);
  const int32_t a = Walk(space, "\"ab");
  const int32_t b = Walk(space, "\"abcdefghijklmnopqrstuvwxyz");
  ASSERT_GE(a, 0);
  EXPECT_EQ(a, b);
  EXPECT_LE(space.num_states(), 4u);
  const int32_t end = Walk(space, "\"abc\"");
  ASSERT_GE(end, 0);
  EXPECT_TRUE(space.accepting(end));
  EXPECT_TRUE(space.next_bytes(end).none());
  EXPECT_EQ(space.Advance(end, 'x'), StateSpace::kDead);
}

TEST(MatcherTest, NestingDepthIsTheStackDepth) {
  const Grammar g = Parse(R"(root ::= "[" (root ("," root)*)? "]")");
  StateSpace space(g);
  EXPECT_TRUE(space.accepting(Walk(space, "[[],[[]]]")));
  EXPECT_EQ(Walk(space, "[[],[[]]]]"), StateSpace::kDead);
  // A later element of the same list at the same depth is the same state.
  EXPECT_EQ(Walk(space, "[[],[],[],["), Walk(space, "[[],["));
  EXPECT_NE(Walk(space, "[[["), Walk(space, "[["));
}

TEST(MatcherTest, AcceptingStateThatMayContinue) {
  const Grammar g = Parse(R"(root ::= [0-9]+)");
  StateSpace space(g);
  const int32_t s = Walk(space, "12");
  ASSERT_GE(s, 0);
  EXPECT_TRUE(space.accepting(s));
  EXPECT_TRUE(space.next_bytes(s).test('3'));
  EXPECT_FALSE(space.accepting(space.initial()));
}

TEST(MatcherTest, AmbiguousAlternativesShareOneState) {
  // Both alternatives consume "ab"; the state keeps both stacks until they diverge.
  const Grammar g = Parse(R"(root ::= "ab" "c" | "a" [b-z] "d")");
  StateSpace space(g);
  const int32_t s = Walk(space, "ab");
  ASSERT_GE(s, 0);
  EXPECT_TRUE(space.next_bytes(s).test('c'));
  EXPECT_TRUE(space.next_bytes(s).test('d'));
  EXPECT_TRUE(space.accepting(Walk(space, "abc")));
  EXPECT_TRUE(space.accepting(Walk(space, "abd")));
  EXPECT_EQ(Walk(space, "acc"), StateSpace::kDead);
}

// Review of issue 17: nesting whose closers may be left out keeps every level on the stack;
// a deep enough text ends in kOverflow (bounded memory), not a crash.
TEST(MatcherTest, UnboundedNestingOverflowsInsteadOfCrashing) {
  const Grammar g = Parse("root ::= \"(\" root c | \"\"\nc ::= \")\" | \"\"");
  StateSpace space(g);
  int32_t s = space.initial();
  int depth = 0;
  while (s >= 0 && depth < 200000) {
    s = space.Advance(s, '(');
    ++depth;
  }
  EXPECT_EQ(s, StateSpace::kOverflow);
  EXPECT_LT(depth, 200000);
}

}  // namespace
}  // namespace kiln::grammar
