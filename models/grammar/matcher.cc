#include "models/grammar/matcher.h"

#include <algorithm>

namespace kiln::grammar {

StateSpace::StateSpace(const Grammar& grammar) : g_(grammar) {
  // The initial state: every alternative of the root, expanded. It is state 0 even when it
  // is dead (a grammar that matches nothing: Grammar::Build refuses those, but be safe).
  Build b;
  ++round_;
  for (const int32_t start : g_.alternatives(g_.root())) {
    const int32_t n = Resolve(start, -1);
    if (n < 0) {
      b.accepting = true;
    } else {
      Expand(n, &b);
    }
  }
  if (Intern(std::move(b)) == kDead) states_.emplace_back();
}

int32_t StateSpace::NodeId(int32_t pos, int32_t parent) {
  const uint64_t key =
      (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) | static_cast<uint32_t>(parent);
  const auto [it, inserted] = node_index_.try_emplace(key, static_cast<int32_t>(nodes_.size()));
  if (inserted) {
    if (nodes_.size() >= static_cast<size_t>(kMaxNodes)) overflow_ = true;
    nodes_.push_back({pos, parent});
    visited_.push_back(0);
  }
  return it->second;
}

int32_t StateSpace::Resolve(int32_t pos, int32_t parent) {
  return g_.element(pos).kind == Element::kEnd ? parent : NodeId(pos, parent);
}

void StateSpace::Expand(int32_t node, Build* b) {
  // Depth-first with an explicit stack: rule calls may nest as deep as the text does.
  std::vector<int32_t>& work = expand_stack_;
  work.assign(1, node);
  while (!work.empty()) {
    const int32_t id = work.back();
    work.pop_back();
    if (visited_[id] == round_) continue;
    visited_[id] = round_;
    const Node n = nodes_[id];
    const Element& e = g_.element(n.pos);
    if (e.kind == Element::kBytes) {
      b->tops.push_back(id);
      continue;
    }
    // A rule call: push the continuation (or, in tail position, reuse the caller's) and expand
    // each alternative on top of it.
    const int32_t cont = Resolve(n.pos + 1, n.parent);
    for (const int32_t start : g_.alternatives(e.arg)) {
      if (g_.element(start).kind == Element::kEnd) {  // an empty alternative: return at once
        if (cont < 0) {
          b->accepting = true;
        } else {
          work.push_back(cont);
        }
      } else {
        work.push_back(NodeId(start, cont));
      }
    }
  }
}

int32_t StateSpace::Intern(Build b) {
  std::sort(b.tops.begin(), b.tops.end());
  b.tops.erase(std::unique(b.tops.begin(), b.tops.end()), b.tops.end());
  if (b.tops.empty() && !b.accepting) return kDead;
  std::vector<int32_t> key = b.tops;
  if (b.accepting) key.push_back(-2);
  const auto [it, inserted] = state_index_.try_emplace(key, static_cast<int32_t>(states_.size()));
  if (!inserted) return it->second;
  if (states_.size() >= static_cast<size_t>(kMaxStates)) overflow_ = true;
  // Every state holds one entry per open stack: deep nesting makes states large.
  total_tops_ += static_cast<int64_t>(b.tops.size());
  if (total_tops_ > kMaxTotalTops) overflow_ = true;
  State s;
  for (const int32_t t : b.tops) s.next |= g_.byte_set(g_.element(nodes_[t].pos).arg);
  s.tops = std::move(b.tops);
  s.accepting = b.accepting;
  states_.push_back(std::move(s));
  return it->second;
}

int32_t StateSpace::Advance(int32_t state, uint8_t byte) {
  if (!states_[state].next.test(byte)) return kDead;
  const uint64_t key = (static_cast<uint64_t>(state) << 8) | byte;
  if (const auto it = transitions_.find(key); it != transitions_.end()) return it->second;
  if (overflow_) return kOverflow;
  Build b;
  ++round_;
  // Copy: Expand may grow states_ indirectly (no, but nodes_) — tops are ids, stable.
  const std::vector<int32_t> tops = states_[state].tops;
  for (const int32_t t : tops) {
    const Node n = nodes_[t];
    if (!g_.byte_set(g_.element(n.pos).arg).test(byte)) continue;
    const int32_t next = Resolve(n.pos + 1, n.parent);
    if (next < 0) {
      b.accepting = true;
    } else {
      Expand(next, &b);
    }
  }
  const int32_t to = Intern(std::move(b));
  if (overflow_) return kOverflow;
  transitions_.emplace(key, to);
  return to;
}

}  // namespace kiln::grammar
