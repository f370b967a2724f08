#include "models/tokenizer/wordpiece.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include "models/tokenizer/unicode.h"

namespace kiln::models {
namespace {

bool AssignedByUnicode8(UChar32 c) {
  UVersionInfo age;
  u_charAge(c, age);  // 0.0 for unassigned code points
  return age[0] < 8 || (age[0] == 8 && age[1] == 0 && age[2] == 0);
}

// The general category as the `unicode_categories` crate (Unicode 8.0) has it.
int8_t CategoryInUnicode8(UChar32 c) {
  switch (c) {    // changed since 8.0
    case 0x1734:  // HANUNOO SIGN PAMUDPOD, now Mc
      return U_NON_SPACING_MARK;
    case 0x1885:  // MONGOLIAN LETTER ALI GALI BALUDA, now Mn
    case 0x1886:
      return U_OTHER_LETTER;
    case 0xA9BD:  // JAVANESE CONSONANT SIGN KERET, now Mn
      return U_COMBINING_SPACING_MARK;
    case 0x111C9:  // SHARADA SANDHI MARK, now Mn
    case 0x166D:   // CANADIAN SYLLABICS CHI SIGN, now So
      return U_OTHER_PUNCTUATION;
    default:
      break;
  }
  return AssignedByUnicode8(c) ? u_charType(c) : static_cast<int8_t>(U_UNASSIGNED);
}

void AppendCodepoints(const icu::UnicodeString& s, std::u32string* out) {
  for (int32_t i = 0; i < s.length();) {
    UChar32 c = s.char32At(i);
    i += U16_LENGTH(c);
    out->push_back(static_cast<char32_t>(c));
  }
}

// NFD. HF's normalization tables predate Unicode 13, so characters assigned after 8.0 (in
// practice only U+11938) are left as they are.
std::u32string Nfd(const std::u32string& in) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(err);
  if (U_FAILURE(err)) return in;
  std::u32string out;
  icu::UnicodeString run, decomposition;
  auto flush = [&] {
    if (run.isEmpty()) return;
    UErrorCode e = U_ZERO_ERROR;
    icu::UnicodeString n = nfd->normalize(run, e);
    AppendCodepoints(U_SUCCESS(e) ? n : run, &out);
    run.remove();
  };
  for (char32_t c : in) {
    if (!AssignedByUnicode8(static_cast<UChar32>(c)) &&
        nfd->getDecomposition(static_cast<UChar32>(c), decomposition)) {
      flush();
      out.push_back(c);
    } else {
      run.append(static_cast<UChar32>(c));
    }
  }
  flush();
  return out;
}

bool IsCleanedOut(char32_t c) { return c == 0 || c == 0xFFFD || IsBertControl(c); }

}  // namespace

bool IsBertWhitespace(uint32_t cp) {
  return cp == '\t' || cp == '\n' || cp == '\r' || u_isUWhiteSpace(static_cast<UChar32>(cp));
}

bool IsBertControl(uint32_t cp) {
  if (cp == '\t' || cp == '\n' || cp == '\r') return false;
  int8_t cat = CategoryInUnicode8(static_cast<UChar32>(cp));
  return cat == U_CONTROL_CHAR || cat == U_FORMAT_CHAR || cat == U_PRIVATE_USE_CHAR;
}

bool IsBertPunctuation(uint32_t cp) {
  if ((cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) ||
      (cp >= 123 && cp <= 126)) {
    return true;
  }
  return (U_MASK(CategoryInUnicode8(static_cast<UChar32>(cp))) & U_GC_P_MASK) != 0;
}

bool IsBertChineseChar(uint32_t cp) {
  return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) ||
         (cp >= 0x20000 && cp <= 0x2A6DF) || (cp >= 0x2A700 && cp <= 0x2B73F) ||
         (cp >= 0x2B740 && cp <= 0x2B81F) || (cp >= 0x2B920 && cp <= 0x2CEAF) ||
         (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
}

std::string BertNormalize(std::string_view text, const BertNormalizerOptions& options) {
  std::u32string cps;
  cps.reserve(text.size());
  bool ascii = true;
  for (size_t i = 0; i < text.size();) {
    size_t len;
    char32_t c = utf8::DecodeAt(text, i, &len);
    i += len;
    if (options.clean_text) {
      if (IsCleanedOut(c)) continue;
      if (IsBertWhitespace(c)) c = ' ';
    }
    ascii &= c < 0x80;
    if (options.handle_chinese_chars && IsBertChineseChar(c)) {
      cps.append({U' ', c, U' '});
    } else {
      cps.push_back(c);
    }
  }
  // ASCII has no decompositions, no marks and simple lowercasing.
  if (options.strip_accents && !ascii) {
    std::u32string kept;
    for (char32_t c : Nfd(cps)) {
      if (CategoryInUnicode8(static_cast<UChar32>(c)) != U_NON_SPACING_MARK) kept.push_back(c);
    }
    cps = std::move(kept);
  }
  std::string out;
  out.reserve(text.size() + 8);
  for (char32_t c : cps) {
    if (options.lowercase) {
      if (c == 0x130) {  // the one character whose full lowercase mapping is two: i + U+0307
        out.append("i\xCC\x87");
        continue;
      }
      c = c < 0x80 ? (c >= 'A' && c <= 'Z' ? c + 32 : c) : u_tolower(static_cast<UChar32>(c));
    }
    utf8::AppendCodepoint(c, &out);
  }
  return out;
}

void BertPreTokenize(std::string_view text, size_t offset,
                     std::vector<std::pair<size_t, size_t>>* words) {
  size_t start = std::string_view::npos;  // start of the word being read
  auto flush = [&](size_t end) {
    if (start != std::string_view::npos) words->push_back({offset + start, offset + end});
    start = std::string_view::npos;
  };
  for (size_t i = 0; i < text.size();) {
    size_t len;
    uint32_t c = utf8::DecodeAt(text, i, &len);
    if (IsBertWhitespace(c)) {
      flush(i);
    } else if (IsBertPunctuation(c)) {
      flush(i);
      words->push_back({offset + i, offset + i + len});
    } else if (start == std::string_view::npos) {
      start = i;
    }
    i += len;
  }
  flush(text.size());
}

void WordPieceEncodeWord(std::string_view word, const WordPieceParams& params,
                         absl::FunctionRef<std::optional<int32_t>(std::string_view)> lookup,
                         std::vector<int32_t>* out) {
  size_t chars = 0;
  for (char c : word) chars += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  if (chars > params.max_input_chars_per_word) {
    out->push_back(params.unk_id);
    return;
  }
  const size_t before = out->size();
  std::string key;
  for (size_t start = 0; start < word.size();) {
    std::optional<int32_t> id;
    size_t end = word.size();
    for (; end > start; --end) {
      // Only try ends on character boundaries (HF steps back a whole character).
      if (end < word.size() && (static_cast<uint8_t>(word[end]) & 0xC0) == 0x80) continue;
      std::string_view sub = word.substr(start, end - start);
      if (start > 0) {
        key.assign(params.continuing_subword_prefix).append(sub);
        sub = key;
      }
      if ((id = lookup(sub))) break;
    }
    if (!id) {  // one unmatched position makes the whole word unknown
      out->resize(before);
      out->push_back(params.unk_id);
      return;
    }
    out->push_back(*id);
    start = end;
  }
}

namespace {

// decoders/wordpiece.rs `cleanup`, in its order.
void Cleanup(std::string* s) {
  static constexpr std::pair<std::string_view, std::string_view> kRules[] = {
      {" .", "."},   {" ?", "?"},     {" !", "!"},    {" ,", ","},
      {" ' ", "'"},  {" n't", "n't"}, {" 'm", "'m"},  {" do not", " don't"},
      {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (auto [from, to] : kRules) {
    size_t pos = s->find(from);
    if (pos == std::string::npos) continue;
    std::string r;
    size_t done = 0;
    for (; pos != std::string::npos; pos = s->find(from, done)) {
      r.append(*s, done, pos - done).append(to);
      done = pos + from.size();
    }
    r.append(*s, done);
    *s = std::move(r);
  }
}

}  // namespace

std::string WordPieceDecode(std::span<const std::string_view> tokens, std::string_view prefix,
                            bool cleanup) {
  std::string out, token;
  for (size_t i = 0; i < tokens.size(); ++i) {
    std::string_view t = tokens[i];
    token.clear();
    if (i > 0) {
      if (t.starts_with(prefix)) {  // an empty prefix glues every token, as in HF
        t.remove_prefix(prefix.size());
      } else {
        token.push_back(' ');
      }
    }
    token.append(t);
    if (cleanup) Cleanup(&token);
    out += token;
  }
  return out;
}

}  // namespace kiln::models
