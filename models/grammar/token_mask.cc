#include "models/grammar/token_mask.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <numeric>

namespace kiln::grammar {

// ---- TokenVocabulary --------------------------------------------------------------------------

TokenVocabulary::TokenVocabulary(std::vector<std::string> bytes, const std::vector<bool>& never,
                                 std::vector<int32_t> end_ids)
    : bytes_(std::move(bytes)), end_ids_(std::move(end_ids)) {
  std::sort(end_ids_.begin(), end_ids_.end());
  end_ids_.erase(std::unique(end_ids_.begin(), end_ids_.end()), end_ids_.end());
  std::vector<int32_t> order;
  for (int32_t t = 0; t < size(); ++t) {
    const bool excluded = (t < static_cast<int32_t>(never.size()) && never[t]) || is_end(t);
    if (!excluded && !bytes_[t].empty()) order.push_back(t);
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[a] < bytes_[b] || (bytes_[a] == bytes_[b] && a < b);
  });
  // Breadth-first, so that each node's children are contiguous: a node covers a range of the
  // sorted tokens that share its prefix (of length `depth`).
  struct Pending {
    int32_t node, lo, hi, depth;
  };
  nodes_.push_back({});
  std::deque<Pending> queue = {{0, 0, static_cast<int32_t>(order.size()), 0}};
  while (!queue.empty()) {
    const Pending p = queue.front();
    queue.pop_front();
    int32_t i = p.lo;
    nodes_[p.node].first_token = static_cast<int32_t>(node_tokens_.size());
    while (i < p.hi && static_cast<int32_t>(bytes_[order[i]].size()) == p.depth) {
      node_tokens_.push_back(order[i++]);
    }
    nodes_[p.node].num_tokens =
        static_cast<int32_t>(node_tokens_.size()) - nodes_[p.node].first_token;
    nodes_[p.node].first_child = static_cast<int32_t>(child_node_.size());
    while (i < p.hi) {
      const uint8_t b = static_cast<uint8_t>(bytes_[order[i]][p.depth]);
      int32_t j = i;
      while (j < p.hi && static_cast<uint8_t>(bytes_[order[j]][p.depth]) == b) ++j;
      const int32_t child = static_cast<int32_t>(nodes_.size());
      nodes_.push_back({});
      child_byte_.push_back(b);
      child_node_.push_back(child);
      queue.push_back({child, i, j, p.depth + 1});
      i = j;
    }
    nodes_[p.node].num_children =
        static_cast<int32_t>(child_node_.size()) - nodes_[p.node].first_child;
  }
}

bool TokenVocabulary::is_end(int32_t token) const {
  return std::binary_search(end_ids_.begin(), end_ids_.end(), token);
}

// ---- TokenGrammar -----------------------------------------------------------------------------

TokenGrammar::TokenGrammar(std::shared_ptr<const Grammar> grammar,
                           std::shared_ptr<const TokenVocabulary> vocab)
    : grammar_(std::move(grammar)), vocab_(std::move(vocab)), space_(*grammar_) {}

namespace {
Status OverflowError() {
  return ResourceExhausted("the grammar's parse grew past ", StateSpace::kMaxStates,
                           " states; simplify the grammar or schema");
}
}  // namespace

StatusOr<std::shared_ptr<const std::vector<uint32_t>>> TokenGrammar::MaskLocked(int32_t state) {
  if (const auto it = masks_.find(state); it != masks_.end()) return it->second;
  const auto start = std::chrono::steady_clock::now();
  const TokenVocabulary& v = *vocab_;
  auto mask = std::make_shared<std::vector<uint32_t>>(v.words(), 0u);
  auto allow = [&](int32_t t) { (*mask)[t >> 5] |= 1u << (t & 31); };
  if (space_.accepting(state)) {
    for (const int32_t t : v.end_ids_) allow(t);
  }
  // Depth-first over the trie, in step with the automaton.
  std::vector<std::pair<int32_t, int32_t>> stack = {{0, state}};  // (trie node, grammar state)
  while (!stack.empty()) {
    const auto [node, s] = stack.back();
    stack.pop_back();
    const TokenVocabulary::Node& n = v.nodes_[node];
    const ByteSet next = space_.next_bytes(s);  // a copy: Advance may grow the state table
    for (int32_t c = n.first_child; c < n.first_child + n.num_children; ++c) {
      const uint8_t b = v.child_byte_[c];
      if (!next.test(b)) continue;
      const int32_t s2 = space_.Advance(s, b);
      if (s2 == StateSpace::kOverflow) return OverflowError();
      if (s2 < 0) continue;
      const TokenVocabulary::Node& child = v.nodes_[v.child_node_[c]];
      for (int32_t k = child.first_token; k < child.first_token + child.num_tokens; ++k) {
        allow(v.node_tokens_[k]);
      }
      if (child.num_children > 0) stack.push_back({v.child_node_[c], s2});
    }
  }
  if (masks_.size() >= kMaxCachedMasks) masks_.clear();
  masks_.emplace(state, mask);
  ++stats_.masks;
  stats_.mask_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return mask;
}

StatusOr<std::shared_ptr<const std::vector<uint32_t>>> TokenGrammar::Mask(int32_t state) {
  absl::MutexLock lock(&mu_);
  return MaskLocked(state);
}

StatusOr<int32_t> TokenGrammar::Advance(int32_t state, int32_t token) {
  if (state < 0 || token < 0 || token >= vocab_->size()) return StateSpace::kDead;
  absl::MutexLock lock(&mu_);
  if (vocab_->is_end(token)) return space_.accepting(state) ? kEnded : StateSpace::kDead;
  const std::string& bytes = vocab_->bytes(token);
  if (bytes.empty()) return StateSpace::kDead;
  int32_t s = state;
  for (const char c : bytes) {
    s = space_.Advance(s, static_cast<uint8_t>(c));
    if (s == StateSpace::kOverflow) return OverflowError();
    if (s < 0) return StateSpace::kDead;
  }
  return s;
}

bool TokenGrammar::accepting(int32_t state) {
  if (state == kEnded) return true;
  if (state < 0) return false;
  absl::MutexLock lock(&mu_);
  return space_.accepting(state);
}

bool TokenGrammar::complete(int32_t state) {
  if (state == kEnded) return true;
  if (state < 0) return false;
  absl::MutexLock lock(&mu_);
  return space_.accepting(state) && space_.next_bytes(state).none();
}

Status TokenGrammar::Precompute(int32_t bytes, int32_t max_states) {
  absl::MutexLock lock(&mu_);
  std::vector<int32_t> frontier = {0}, seen = {0};
  for (int32_t depth = 0; depth <= bytes && !frontier.empty(); ++depth) {
    std::vector<int32_t> next;
    for (const int32_t s : frontier) {
      if (static_cast<int32_t>(seen.size()) > max_states) return OkStatus();
      KILN_RETURN_IF_ERROR(MaskLocked(s).status());
      if (depth == bytes) continue;
      const ByteSet nb = space_.next_bytes(s);
      for (int b = 0; b < 256; ++b) {
        if (!nb.test(b)) continue;
        const int32_t s2 = space_.Advance(s, static_cast<uint8_t>(b));
        if (s2 == StateSpace::kOverflow) return OverflowError();
        if (s2 >= 0 && std::find(seen.begin(), seen.end(), s2) == seen.end()) {
          seen.push_back(s2);
          next.push_back(s2);
        }
      }
    }
    frontier = std::move(next);
  }
  return OkStatus();
}

TokenGrammar::Stats TokenGrammar::stats() {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.states = static_cast<int64_t>(space_.num_states());
  return s;
}

// ---- TokenMatcher -----------------------------------------------------------------------------

TokenMatcher::TokenMatcher(std::shared_ptr<TokenGrammar> grammar)
    : grammar_(std::move(grammar)), state_(grammar_->initial_state()) {}

Status TokenMatcher::FillMask(std::span<uint32_t> words) {
  if (state_ < 0) {
    std::fill(words.begin(), words.end(), 0u);
    return OkStatus();
  }
  KILN_ASSIGN_OR_RETURN(const auto mask, grammar_->Mask(state_));
  std::copy(mask->begin(), mask->begin() + std::min(mask->size(), words.size()), words.begin());
  return OkStatus();
}

Status TokenMatcher::Accept(int32_t token) {
  if (state_ == TokenGrammar::kEnded) {
    return InvalidArgument("token ", token, " after the grammar's output ended");
  }
  KILN_ASSIGN_OR_RETURN(const int32_t next, grammar_->Advance(state_, token));
  if (next == StateSpace::kDead) {
    return InvalidArgument("token ", token, " is not allowed by the grammar here");
  }
  state_ = next;
  return OkStatus();
}

bool TokenMatcher::accepting() { return grammar_->accepting(state_); }
bool TokenMatcher::complete() { return grammar_->complete(state_); }

}  // namespace kiln::grammar
