// Tokenizers: byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen2), SentencePiece-style BPE
// (Llama 2), built from GGUF metadata or a Hugging Face tokenizer.json, and WordPiece (BERT,
// sentence-transformers embedding models such as all-MiniLM-L6-v2) from a tokenizer.json.
//
//   KILN_ASSIGN_OR_RETURN(auto tok, Tokenizer::FromGguf(*gguf));
//   KILN_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok->Encode(prompt));
//   std::string text = tok->Decode(ids);
//
// Encoding follows Hugging Face `tokenizers` (the reference the models were trained with):
//   1. added tokens are cut out of the raw text first (leftmost-longest match; special ones
//      only when `parse_special`; lstrip/rstrip/single_word honoured);
//   2. each remaining segment is normalized (Prepend "▁", Replace " " -> "▁", Metaspace, NFC,
//      BertNormalizer);
//   3. pre-tokenized (Split regexes with PCRE2 in UTF+UCP mode and JIT, Digits, ByteLevel,
//      BertPreTokenizer);
//   4. each word goes through BPE: merge ranks from the merges list with a priority queue,
//      O(n log n) per word, with a per-word cache; `ignore_merges` and `byte_fallback`;
//      or through WordPiece: greedy longest match first, "##" continuations, [UNK] for a word
//      with an unmatched position or over max_input_chars_per_word (models/tokenizer/wordpiece.h).
// The "truncation" and "padding" sections of tokenizer.json are ignored (callers truncate and
// pad; padding.pad_id only sets pad_id()).
// GGUF `llama` vocabularies (SentencePiece scores, no merges) use llama.cpp's score-driven
// bigram merge with byte fallback, which is what those files were converted for.
//
// Thread-safety: all methods are const and safe to call concurrently (the word cache is
// internally synchronized).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::models {

class GgufFile;
struct HfFolder;
struct HfTokenizerConfig;

enum class TokenizerKind {
  kByteLevelBpe,      // GPT-2 style: bytes mapped to printable characters, merges by rank
  kSentencePieceBpe,  // "▁" for spaces, byte-fallback tokens <0xNN>
  kWordPiece,         // BERT: normalized (lowercased, accents stripped) text, "##" pieces
};

// What kind of vocabulary entry a token is (GGUF token_type values).
enum class TokenAttr : uint8_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // special: BOS, EOS, <|im_start|>, ... (matched in text only if parse_special)
  kUserDefined = 4,  // added, not special: always matched in text
  kUnused = 5,
  kByte = 6,  // <0xNN> byte-fallback token
};

struct EncodeOptions {
  // Add the BOS/EOS tokens that the model's configuration asks for.
  bool add_special_tokens = true;
  // Recognize special-token text ("<|im_start|>") in the input. Turn off for untrusted text
  // that must not inject control tokens; it is then tokenized as plain text.
  bool parse_special = true;
};

struct DecodeOptions {
  bool skip_special_tokens = false;
  // SentencePiece vocabularies: drop the space that the leading "▁" of the first token stands
  // for, as Hugging Face's decoders do for a whole sequence. Turn off when decoding a
  // continuation of earlier text.
  bool strip_leading_space = true;
};

class Tokenizer {
 public:
  // From GGUF metadata: tokenizer.ggml.model ("gpt2" or "llama"), .tokens, .scores,
  // .token_type, .merges, .bos/eos/unknown/padding_token_id, .add_bos_token,
  // .add_eos_token, .add_space_prefix, .pre (pre-tokenizer name, e.g. "smollm", "llama-bpe",
  // "qwen2"). Errors name the key and what is allowed.
  static StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& gguf);
  // From the text of a tokenizer.json (`name` is used in messages). `config` (optional) supplies
  // bos/eos/unk/pad names and add_bos_token/add_eos_token overrides.
  // WordPiece: the post-processor's template (TemplateProcessing, or BertProcessing) gives the
  // ids add_special_tokens adds, [CLS] before and [SEP] after, so bos_id() is [CLS], eos_id()
  // [SEP]; without a post-processor, the config's cls_token/sep_token (default [CLS]/[SEP])
  // when the vocabulary has them. unk_id() is model.unk_token; pad_id() padding.pad_id or
  // [PAD]. A malformed file (no vocab, unk_token not in it, unknown normalizer or
  // pre-tokenizer type) is InvalidArgument naming the field; a known but unsupported one is
  // Unimplemented.
  static StatusOr<std::unique_ptr<Tokenizer>> FromHfJson(std::string_view tokenizer_json,
                                                         const HfTokenizerConfig* config,
                                                         std::string_view name);
  static StatusOr<std::unique_ptr<Tokenizer>> FromHfFolder(const HfFolder& folder);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // InvalidArgument if `text` is not valid UTF-8 (the message gives the byte offset).
  StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                        const EncodeOptions& options = {}) const;

  // Concatenates the tokens' bytes; invalid UTF-8 (e.g. a sequence cut by max_tokens) becomes
  // U+FFFD. Ids outside the vocabulary are skipped.
  // WordPiece: HF's WordPiece decoder (tokens joined by spaces, "##" pieces glued to the one
  // before, then its per-token cleanup: " ." -> ".", " ," -> ",", ...); the text is the
  // normalized one (lowercase, no accents), not the input.
  std::string Decode(std::span<const int32_t> ids, const DecodeOptions& options = {}) const;

  TokenizerKind kind() const;
  int32_t vocab_size() const;
  // The vocabulary entry as stored ("Ġworld", "▁world", "<0x0A>", "<|im_end|>").
  // REQUIRES: 0 <= id < vocab_size().
  std::string_view Piece(int32_t id) const;
  // The raw bytes the token stands for (" world", "\n"); may be part of a UTF-8 character.
  // WordPiece is not byte-exact (its pieces are normalized text, without spaces): this is the
  // piece's text without the "##" prefix ("##ing" -> "ing"), so concatenating TokenBytes does
  // not reproduce Decode.
  std::string_view TokenBytes(int32_t id) const;
  std::optional<int32_t> PieceToId(std::string_view piece) const;
  TokenAttr Attr(int32_t id) const;
  // Control tokens and added tokens marked special.
  bool IsSpecial(int32_t id) const;

  // -1 when the model has none.
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t unk_id() const;
  int32_t pad_id() const;
  // Tokens that end generation: EOS plus end-of-turn tokens the vocabulary declares.
  const std::vector<int32_t>& eog_ids() const;
  bool add_bos() const;
  bool add_eos() const;
  // Whether decoders strip the leading space of a sequence (SentencePiece-style).
  bool strips_leading_space() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::models
