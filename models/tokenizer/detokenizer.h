// Streaming detokenization: token ids in, UTF-8 text out, never half a character.
//
//   Detokenizer detok(*tokenizer);
//   for (int32_t id : generated) send(detok.Add(id));   // "" while a character is incomplete
//   send(detok.Finish());                               // flush; broken tail -> U+FFFD
//
// Bytes of an incomplete UTF-8 sequence (a byte-fallback token <0xE2>, or a byte-level token
// that ends mid-character) are held back until the sequence completes. Bytes that can never
// form a valid sequence are emitted at once as U+FFFD (one per maximal invalid subpart), and
// an incomplete sequence still held at Finish() becomes U+FFFD too, so nothing is dropped
// silently. The concatenation of everything returned equals
// Tokenizer::Decode(ids, {.strip_leading_space = options.strip_leading_space}).
//
// A stop-string matcher sits on top: it consumes the returned chunks (always whole
// characters), and can hold back a suffix that is a prefix of a stop string; `emitted_bytes()`
// gives the text offset of the next chunk.
//
// Thread-safety: one Detokenizer per sequence; not safe for concurrent use. The Tokenizer
// must outlive it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "models/tokenizer/tokenizer.h"

namespace kiln::models {

class Detokenizer {
 public:
  struct Options {
    bool skip_special_tokens = false;
    // SentencePiece vocabularies: drop the leading space of the first token. Leave off when
    // the tokens continue a prompt (generation); turn on to decode a sequence from its start.
    bool strip_leading_space = false;
  };

  explicit Detokenizer(const Tokenizer& tokenizer) : Detokenizer(tokenizer, Options()) {}
  Detokenizer(const Tokenizer& tokenizer, Options options)
      : tokenizer_(tokenizer), options_(options) {}

  // Appends token `id` and returns the text that became complete (possibly empty). Ids
  // outside the vocabulary are ignored.
  std::string Add(int32_t id);
  // Returns the held-back bytes (incomplete sequence -> U+FFFD) and resets for a new sequence.
  std::string Finish();

  // Bytes held back waiting for the rest of a character (0 to 3).
  size_t pending_bytes() const { return pending_.size(); }
  // Total bytes of text returned so far.
  size_t emitted_bytes() const { return emitted_; }

 private:
  const Tokenizer& tokenizer_;
  Options options_;
  std::string pending_;
  bool started_ = false;
  size_t emitted_ = 0;
};

}  // namespace kiln::models
