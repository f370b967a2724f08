// The continuous batcher's side of structured output (models/grammar/): a model's vocabulary as
// the grammar engine sees it, the token grammars of the grammars its requests bring, and each
// step's allowed-token masks.
//
// A grammar (SamplingParams::grammar) is bound to the model's vocabulary once and kept in a
// small LRU keyed by the Grammar object, which CompileConstraint caches by the request's
// schema/grammar text: requests with the same schema share one TokenGrammar and its cached
// masks. Each sequence has its own TokenMatcher.
//
// Internal to scheduler/llm/. Thread-safety: Bind is called from Enqueue on any thread
// (mutex); the per-sequence calls only on the loop thread.
#pragma once

#include <absl/base/thread_annotations.h>
#include <absl/synchronization/mutex.h>

#include <list>
#include <memory>
#include <vector>

#include "engine/base/status.h"
#include "models/grammar/token_mask.h"
#include "models/tokenizer/tokenizer.h"
#include "scheduler/llm/sequence.h"

namespace kiln {

class StructuredOutput {
 public:
  // REQUIRES: `tokenizer` outlives this. `vocab_size`: the model's (its logits' width, which
  // may exceed the tokenizer's: those ids are never allowed). `eos_ids`: the model's
  // end-of-generation tokens, allowed where a grammar may end.
  StructuredOutput(const models::Tokenizer& tokenizer, int32_t vocab_size,
                   std::vector<int32_t> eos_ids);

  // Gives `seq` the matcher of its request's grammar (if it has one).
  void Bind(Sequence* seq);

  // Writes the tokens `seq` may sample next into seq->allowed (its end ids too — EOS unless
  // ignore_eos, and stop_token_ids — where the grammar may end). An error (the parse outgrew
  // its limits) is kept in seq->grammar_status, the mask then allows only the end ids, and the
  // grammar leaves the cache, so that later requests start with a fresh parse.
  void PrepareMask(Sequence* seq);

  // Moves `seq`'s matcher past its sampled token (end ids excepted). Not OK when the grammar
  // rejects it (a model that sampled without the mask) or the mask failed.
  Status Accept(Sequence* seq, int32_t token, bool is_end);

  static constexpr size_t kCachedGrammars = 16;
  // Masks computed ahead, on the request's thread, for a grammar new to this model: the states
  // within this many bytes of the start.
  static constexpr int32_t kPrecomputeBytes = 3;
  static constexpr int32_t kPrecomputeStates = 64;

 private:
  std::shared_ptr<grammar::TokenGrammar> Find(const std::shared_ptr<const grammar::Grammar>& g,
                                              bool* created);
  void Evict(const std::shared_ptr<grammar::TokenGrammar>& tg);

  const models::Tokenizer& tokenizer_;
  const int32_t vocab_size_;
  const std::vector<int32_t> eos_ids_;
  absl::Mutex mu_;
  std::shared_ptr<const grammar::TokenVocabulary> vocab_
      ABSL_GUARDED_BY(mu_);  // built at first use
  std::list<
      std::pair<std::shared_ptr<const grammar::Grammar>, std::shared_ptr<grammar::TokenGrammar>>>
      grammars_ ABSL_GUARDED_BY(mu_);  // most recently used first
};

}  // namespace kiln
