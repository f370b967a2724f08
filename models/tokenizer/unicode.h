// Small UTF-8 helpers shared by the tokenizers, the detokenizer and the chat templates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::models::utf8 {

// Length of the UTF-8 sequence a lead byte announces (1 for ASCII and for invalid leads).
inline size_t SeqLen(uint8_t lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if the bytes there are not a
// complete, valid sequence. `*incomplete` is set when the bytes are a valid prefix cut short by
// the end of `s`. Rejects overlongs, surrogates and code points above U+10FFFF.
size_t ValidSeqLen(std::string_view s, size_t i, bool* incomplete = nullptr);

// Offset of the first invalid byte, or npos if `s` is valid UTF-8.
size_t FindInvalid(std::string_view s);

// Appends `s` to `out`, replacing each maximal invalid subpart with U+FFFD (the Unicode /
// WHATWG "replacement of maximal subparts" rule, as Rust's from_utf8_lossy and Python's
// errors="replace" do).
void AppendLossy(std::string_view s, std::string* out);

void AppendCodepoint(uint32_t cp, std::string* out);
// Decodes the valid sequence at s[i] (REQUIRES: ValidSeqLen(s, i) > 0).
uint32_t DecodeAt(std::string_view s, size_t i, size_t* len);

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

}  // namespace kiln::models::utf8
