// Byte-level matching of a Grammar: a pushdown automaton whose states are interned.
//
// A parse position is a stack of element positions (the element to match next, then where each
// enclosing rule continues). Stacks are persistent linked nodes, interned, so equal stacks are
// one id; a state is the set of stacks whose top is a byte set (all alternatives expanded, as
// in llama.cpp's llama_grammar_advance_stack) plus whether the root may end here. States are
// interned too, and each (state, byte) transition is computed once: over a generation the
// automaton is built lazily as a DFA over the states actually reached, which is what makes
// the token masks (token_mask.h) cheap to cache.
//
// A rule call whose continuation is the end of the calling alternative does not push (tail
// call), so right recursion (`x*` becomes `star ::= x star | ε`) runs in constant stack depth
// and a long string or array revisits the same few states.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <cstdint>
#include <vector>

#include "models/grammar/grammar.h"

namespace kiln::grammar {

// The interned states of one grammar. Thread-safety: none; the owner serializes access
// (TokenGrammar holds a mutex). REQUIRES: the grammar outlives the StateSpace.
class StateSpace {
 public:
  static constexpr int32_t kDead = -1;      // no stack accepts the byte
  static constexpr int32_t kOverflow = -2;  // more than kMaxStates / kMaxNodes were needed

  explicit StateSpace(const Grammar& grammar);

  int32_t initial() const { return 0; }
  // The state after `byte`, or kDead / kOverflow. REQUIRES: state >= 0.
  int32_t Advance(int32_t state, uint8_t byte);
  // Whether the text so far is a complete sentence of the grammar.
  bool accepting(int32_t state) const { return states_[state].accepting; }
  // The bytes some stack accepts next (none: the text so far can only end here).
  const ByteSet& next_bytes(int32_t state) const { return states_[state].next; }
  size_t num_states() const { return states_.size(); }

  // Bounds on what one grammar's parse may hold (a generation that needs more fails with
  // kOverflow): states, stack nodes, and stack entries summed over the states.
  static constexpr int32_t kMaxStates = 1 << 18;
  static constexpr int32_t kMaxNodes = 1 << 20;
  static constexpr int64_t kMaxTotalTops = 1 << 23;

 private:
  struct Node {
    int32_t pos;     // an element that is not kEnd
    int32_t parent;  // the continuation after this rule returns; -1: the root's end
  };
  struct State {
    std::vector<int32_t> tops;  // sorted node ids whose element is kBytes
    bool accepting = false;
    ByteSet next;
  };
  struct Build {
    std::vector<int32_t> tops;
    bool accepting = false;
  };

  int32_t NodeId(int32_t pos, int32_t parent);
  // The node continuing at `pos` under `parent`, or `parent` when pos is an alternative's end.
  int32_t Resolve(int32_t pos, int32_t parent);
  void Expand(int32_t node, Build* b);
  int32_t Intern(Build b);

  const Grammar& g_;
  std::vector<Node> nodes_;
  absl::flat_hash_map<uint64_t, int32_t> node_index_;
  std::vector<State> states_;
  absl::flat_hash_map<std::vector<int32_t>, int32_t> state_index_;  // tops + accepting as -2
  absl::flat_hash_map<uint64_t, int32_t> transitions_;              // state << 8 | byte
  std::vector<int32_t> visited_;                                    // per Expand round, by node
  std::vector<int32_t> expand_stack_;
  int64_t total_tops_ = 0;
  int32_t round_ = 0;
  bool overflow_ = false;
};

// Matches bytes one at a time against a grammar, with a StateSpace of its own. For tests and
// validation (Grammar::Matches); generation uses TokenMatcher.
class ByteMatcher {
 public:
  explicit ByteMatcher(const Grammar& grammar) : space_(grammar) {}
  // False (and the matcher stays dead) when the byte cannot continue the text.
  bool Advance(uint8_t byte) {
    if (state_ >= 0) state_ = space_.Advance(state_, byte);
    return state_ >= 0;
  }
  bool accepting() const { return state_ >= 0 && space_.accepting(state_); }

 private:
  StateSpace space_;
  int32_t state_ = 0;
};

}  // namespace kiln::grammar
