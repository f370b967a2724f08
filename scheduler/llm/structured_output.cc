#include "scheduler/llm/structured_output.h"

#include <algorithm>

namespace kiln {

StructuredOutput::StructuredOutput(const models::Tokenizer& tokenizer, int32_t vocab_size,
                                   std::vector<int32_t> eos_ids)
    : tokenizer_(tokenizer), vocab_size_(vocab_size), eos_ids_(std::move(eos_ids)) {}

std::shared_ptr<grammar::TokenGrammar> StructuredOutput::Find(
    const std::shared_ptr<const grammar::Grammar>& g, bool* created) {
  absl::MutexLock lock(&mu_);
  *created = false;
  for (auto it = grammars_.begin(); it != grammars_.end(); ++it) {
    if (it->first == g) {
      grammars_.splice(grammars_.begin(), grammars_, it);
      return it->second;
    }
  }
  if (!vocab_) {
    // Token bytes as the detokenizer joins them; control tokens are never text, nor are the
    // model's ids past the tokenizer's vocabulary (padding rows of the embedding).
    std::vector<std::string> bytes(vocab_size_);
    std::vector<bool> never(vocab_size_, true);
    for (int32_t t = 0; t < std::min(vocab_size_, tokenizer_.vocab_size()); ++t) {
      bytes[t] = std::string(tokenizer_.TokenBytes(t));
      never[t] = tokenizer_.IsSpecial(t);
    }
    // No end ids in the shared masks: each sequence adds its own (ignore_eos, stop_token_ids).
    vocab_ = std::make_shared<const grammar::TokenVocabulary>(std::move(bytes), never,
                                                              std::vector<int32_t>{});
  }
  auto tg = std::make_shared<grammar::TokenGrammar>(g, vocab_);
  *created = true;
  grammars_.emplace_front(g, tg);
  if (grammars_.size() > kCachedGrammars) grammars_.pop_back();
  return tg;
}

void StructuredOutput::Evict(const std::shared_ptr<grammar::TokenGrammar>& tg) {
  absl::MutexLock lock(&mu_);
  grammars_.remove_if([&](const auto& e) { return e.second == tg; });
}

void StructuredOutput::Bind(Sequence* seq) {
  const auto& g = seq->req->sampling.grammar;
  if (!g) return;
  bool created = false;
  std::shared_ptr<grammar::TokenGrammar> tg = Find(g, &created);
  // The first steps' masks, here rather than on the batcher's thread (an error shows again
  // when the batcher asks for the mask, and is handled there).
  if (created) (void)tg->Precompute(kPrecomputeBytes, kPrecomputeStates);
  seq->matcher.emplace(std::move(tg));
}

void StructuredOutput::PrepareMask(Sequence* seq) {
  const size_t words = static_cast<size_t>((vocab_size_ + 31) / 32);
  seq->allowed.assign(words, 0u);
  auto allow = [&](int32_t t) {
    if (t >= 0 && static_cast<size_t>(t >> 5) < words) seq->allowed[t >> 5] |= 1u << (t & 31);
  };
  if (seq->grammar_status.ok()) {
    seq->grammar_status = seq->matcher->FillMask(seq->allowed);
    if (!seq->grammar_status.ok()) Evict(seq->matcher->grammar());
  }
  if (!seq->grammar_status.ok()) {
    std::fill(seq->allowed.begin(), seq->allowed.end(), 0u);
    for (const int32_t t : seq->end_ids) allow(t);
    for (const int32_t t : eos_ids_) allow(t);
    return;
  }
  if (seq->matcher->accepting()) {
    for (const int32_t t : seq->end_ids) allow(t);
  }
}

Status StructuredOutput::Accept(Sequence* seq, int32_t token, bool is_end) {
  KILN_RETURN_IF_ERROR(seq->grammar_status);
  if (is_end) return OkStatus();
  return seq->matcher->Accept(token);
}

}  // namespace kiln
