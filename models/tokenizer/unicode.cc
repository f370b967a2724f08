#include "models/tokenizer/unicode.h"

#include "engine/base/utf8.h"

namespace kiln::models::utf8 {

size_t ValidSeqLen(std::string_view s, size_t i, bool* incomplete) {
  if (incomplete) *incomplete = false;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  uint8_t c = p[i];
  if (c < 0x80) return 1;
  size_t len;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlongs
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= n) {
      if (incomplete) *incomplete = true;
      return 0;
    }
    uint8_t b = p[i + k];
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
  }
  return len;
}

size_t FindInvalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t len = ValidSeqLen(s, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

void AppendLossy(std::string_view s, std::string* out) {
  size_t i = 0;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  while (i < s.size()) {
    if (p[i] < 0x80) {
      out->push_back(s[i++]);
      continue;
    }
    size_t len = ValidSeqLen(s, i);
    if (len > 0) {
      out->append(s.substr(i, len));
      i += len;
      continue;
    }
    // Maximal subpart: the lead byte plus the continuation bytes that were still valid.
    size_t j = i + 1;
    uint8_t c = p[i];
    size_t want = (c >= 0xC2 && c <= 0xDF)   ? 2
                  : (c >= 0xE0 && c <= 0xEF) ? 3
                  : (c >= 0xF0 && c <= 0xF4) ? 4
                                             : 1;
    for (size_t k = 1; k < want && j < s.size(); ++k, ++j) {
      uint8_t b = p[j];
      uint8_t lo = 0x80, hi = 0xBF;
      if (k == 1) {
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
      }
      if (b < lo || b > hi) break;
    }
    out->append(kReplacement);
    i = j;
  }
}

void AppendCodepoint(uint32_t cp, std::string* out) { AppendUtf8(cp, out); }

uint32_t DecodeAt(std::string_view s, size_t i, size_t* len) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + i;
  size_t n = SeqLen(p[0]);
  *len = n;
  switch (n) {
    case 1:
      return p[0];
    case 2:
      return ((p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    case 3:
      return ((p[0] & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    default:
      return ((p[0] & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
  }
}

}  // namespace kiln::models::utf8
