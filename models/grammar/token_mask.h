// Token-level constrained decoding: which tokens of a vocabulary may come next under a grammar.
//
// The vocabulary is a trie of its tokens' bytes. The allowed tokens of a parse state are found
// by walking the trie alongside the grammar's automaton (matcher.h), pruning every subtree whose
// prefix the grammar rejects, and are cached per state as a bitmask: a generation revisits the
// same states again and again (the inside of a string, the space after a comma), so after the
// first visit a step's mask is a lookup and a copy. This is the XGrammar / llguidance idea of
// masks precomputed per parser state, computed lazily over the states a generation reaches
// rather than eagerly over every state, since schema grammars have many states that no output
// ever visits. `TokenGrammar::Precompute` walks the states reachable in a few bytes ahead of
// time, for a request's first steps.
//
// Thread-safety: TokenVocabulary is immutable. TokenGrammar is shared by every sequence that
// decodes with the same grammar on the same vocabulary, and is thread-safe (one mutex). A
// TokenMatcher belongs to one sequence.
#pragma once

#include <absl/base/thread_annotations.h>
#include <absl/container/flat_hash_map.h>
#include <absl/synchronization/mutex.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/base/status.h"
#include "models/grammar/grammar.h"
#include "models/grammar/matcher.h"

namespace kiln::grammar {

class TokenVocabulary {
 public:
  // `bytes[t]` is the text token t adds (TokenBytes); tokens with `never[t]` set (special and
  // control tokens, whose text is not text) or empty bytes are never allowed by a grammar.
  // `end_ids` end generation (EOS, stop tokens): allowed exactly where the grammar may end.
  TokenVocabulary(std::vector<std::string> bytes, const std::vector<bool>& never,
                  std::vector<int32_t> end_ids);

  int32_t size() const { return static_cast<int32_t>(bytes_.size()); }
  // Bitmask words per row: ceil(size / 32).
  int32_t words() const { return (size() + 31) / 32; }
  const std::string& bytes(int32_t token) const { return bytes_[token]; }
  std::span<const int32_t> end_ids() const { return end_ids_; }
  bool is_end(int32_t token) const;

 private:
  friend class TokenGrammar;
  struct Node {
    int32_t first_child = 0, num_children = 0;  // into child_byte_ / child_node_
    int32_t first_token = 0, num_tokens = 0;    // into node_tokens_: tokens whose bytes end here
  };
  std::vector<std::string> bytes_;
  std::vector<int32_t> end_ids_;
  std::vector<Node> nodes_;  // nodes_[0] is the root (the empty prefix)
  std::vector<uint8_t> child_byte_;
  std::vector<int32_t> child_node_;
  std::vector<int32_t> node_tokens_;
};

// A grammar bound to a vocabulary, with its parse states and their cached masks.
class TokenGrammar {
 public:
  TokenGrammar(std::shared_ptr<const Grammar> grammar,
               std::shared_ptr<const TokenVocabulary> vocab);

  const TokenVocabulary& vocab() const { return *vocab_; }
  int32_t initial_state() const { return 0; }

  // The tokens allowed in `state` as vocab().words() words (bit t % 32 of word t / 32): tokens
  // whose bytes the grammar accepts from `state`, plus the end ids when the grammar may end
  // there. Computed on first use and cached. Errors only when the parse outgrows its limits.
  StatusOr<std::shared_ptr<const std::vector<uint32_t>>> Mask(int32_t state);
  // The state after `token`: StateSpace::kDead when the grammar rejects it (end ids: only from
  // an accepting state, and they lead to kEnded).
  StatusOr<int32_t> Advance(int32_t state, int32_t token);
  bool accepting(int32_t state);
  // Whether no further byte is possible from `state` (the output is complete).
  bool complete(int32_t state);

  // Computes the masks of the states reached from the start within `bytes` bytes (bounded by
  // `max_states`): the work a request's first tokens would otherwise wait for.
  Status Precompute(int32_t bytes, int32_t max_states);

  struct Stats {
    int64_t states = 0, masks = 0;
    double mask_seconds = 0;  // total time spent computing masks
  };
  Stats stats();

  static constexpr int32_t kEnded = -3;  // after an end id
  static constexpr size_t kMaxCachedMasks = 2048;

 private:
  StatusOr<std::shared_ptr<const std::vector<uint32_t>>> MaskLocked(int32_t state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  absl::Mutex mu_;
  StateSpace space_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int32_t, std::shared_ptr<const std::vector<uint32_t>>> masks_
      ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

// One sequence's position in its grammar.
class TokenMatcher {
 public:
  explicit TokenMatcher(std::shared_ptr<TokenGrammar> grammar);

  // The tokens allowed next into `words` (vocab().words() words).
  Status FillMask(std::span<uint32_t> words);
  // Moves past `token`. InvalidArgument when the grammar does not allow it (the sampler was
  // not given the mask, or the sequence had ended).
  Status Accept(int32_t token);
  // The output so far is a complete sentence of the grammar.
  bool accepting();
  // Complete, and the grammar allows nothing more (only an end token could follow), or an end
  // token was accepted.
  bool complete();
  bool ended() const { return state_ == TokenGrammar::kEnded; }
  const std::shared_ptr<TokenGrammar>& grammar() const { return grammar_; }

 private:
  std::shared_ptr<TokenGrammar> grammar_;
  int32_t state_;
};

}  // namespace kiln::grammar
