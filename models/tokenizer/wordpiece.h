// BERT's text pipeline as Hugging Face `tokenizers` runs it (normalizers/bert.rs,
// pre_tokenizers/bert.rs, models/wordpiece, decoders/wordpiece.rs): the pieces Tokenizer uses
// for tokenizer.json files with a WordPiece model, a BertNormalizer or a BertPreTokenizer.
//
// Unicode data: general categories (control, non-spacing mark, punctuation) are those of
// Unicode 8.0, because HF takes them from the `unicode_categories` crate, whose tables are that
// old: characters assigned later have no category there, and six characters have changed
// category since (kept here as exceptions). Whitespace and lowercasing come from Rust's std
// (current Unicode); ICU supplies all of it. tokenizer_fixture_test checks every code point
// against HF. Characters newer than the linked ICU (72: Unicode 15.0) are not lowercased.
//
// All functions are pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"

namespace kiln::models {

// BertNormalizer's settings (tokenizer.json "normalizer": {"type": "BertNormalizer", ...}).
// `strip_accents` null there means "same as lowercase"; the parser resolves it.
struct BertNormalizerOptions {
  // Drop U+0000, U+FFFD and control characters (category C* but \t \n \r); whitespace -> " ".
  bool clean_text = true;
  // Put spaces around CJK ideographs (the ranges BERT lists).
  bool handle_chinese_chars = true;
  // NFD, then drop non-spacing marks (Mn).
  bool strip_accents = true;
  // Per-character full lowercase mapping (no final-sigma rule: "Σ" -> "σ" always).
  bool lowercase = true;
};

// The four steps in HF's order (clean, CJK, accents, lowercase). REQUIRES: valid UTF-8.
std::string BertNormalize(std::string_view text, const BertNormalizerOptions& options);

// BertPreTokenizer: splits `text` on whitespace (dropped) and around every punctuation
// character (each its own word); appends the words' byte ranges, shifted by `offset`, to
// `words`. REQUIRES: valid UTF-8.
void BertPreTokenize(std::string_view text, size_t offset,
                     std::vector<std::pair<size_t, size_t>>* words);

// The character classes above, as HF sees them (see the note on Unicode data).
bool IsBertWhitespace(uint32_t cp);   // \t \n \r, or Unicode White_Space
bool IsBertControl(uint32_t cp);      // Cc, Cf, Co but \t \n \r
bool IsBertPunctuation(uint32_t cp);  // ASCII 33-47, 58-64, 91-96, 123-126, or P*
bool IsBertChineseChar(uint32_t cp);

struct WordPieceParams {
  std::string continuing_subword_prefix = "##";
  size_t max_input_chars_per_word = 100;
  int32_t unk_id = -1;
};

// WordPiece on one pre-tokenized word: greedy longest match from the start, pieces after the
// first looked up with the prefix. A word longer than max_input_chars_per_word characters, or
// one with a position where nothing matches, becomes a single unk_id. `lookup` maps a
// vocabulary string to its id. Appends to `out`.
void WordPieceEncodeWord(std::string_view word, const WordPieceParams& params,
                         absl::FunctionRef<std::optional<int32_t>(std::string_view)> lookup,
                         std::vector<int32_t>* out);

// The WordPiece decoder: tokens after the first get a leading space unless they start with
// `prefix` (which is then removed); with `cleanup`, each token then goes through HF's
// cleanup replacements (" ." -> ".", " n't" -> "n't", ...), applied per token as HF does.
std::string WordPieceDecode(std::span<const std::string_view> tokens, std::string_view prefix,
                            bool cleanup);

}  // namespace kiln::models
