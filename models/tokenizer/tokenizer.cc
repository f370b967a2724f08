#include "models/tokenizer/tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "models/gguf/gguf.h"
#include "models/hf/hf_folder.h"
#include "models/io/errors.h"
#include "models/io/mapped_file.h"
#include "models/tokenizer/regex.h"
#include "models/tokenizer/unicode.h"
#include "models/tokenizer/wordpiece.h"

namespace kiln::models {
namespace {

using json = nlohmann::json;

constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";  // U+2581 "▁"

// Pre-tokenizer patterns (as in the models' tokenizer.json files).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's reversible byte -> printable character map.
struct ByteLevelMap {
  std::array<std::string, 256> byte_to_utf8;
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteLevelMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      uint32_t cp = printable ? b : 256 + n++;
      utf8::AppendCodepoint(cp, &byte_to_utf8[b]);
      cp_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteLevelMap& ByteLevel() {
  static const ByteLevelMap* m = new ByteLevelMap();
  return *m;
}

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct NormStep {
  enum Kind { kPrepend, kReplace, kNfc, kBert } kind;
  std::string a, b;  // prepend: a; replace: a -> b
  BertNormalizerOptions bert = {};
};

struct PreStep {
  enum Kind { kRegex, kDigits, kMetaspace, kWhitespaceSplit, kBert } kind;
  std::shared_ptr<const Pcre2Regex> regex;  // kRegex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool individual_digits = false;
  // kMetaspace
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;
  bool split = true;
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool special;
  bool lstrip = false, rstrip = false, single_word = false;
};

struct MergeInfo {
  int32_t rank;
  int32_t merged;
};

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

bool IsAsciiSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// Word characters for single_word matching (ASCII letters, digits, '_' and any non-ASCII).
bool IsWordByte(char c) {
  auto u = static_cast<unsigned char>(c);
  return u >= 0x80 || std::isalnum(u) || c == '_';
}

}  // namespace

struct Tokenizer::Impl {
  std::string name;
  TokenizerKind kind = TokenizerKind::kByteLevelBpe;
  bool scored_spm = false;  // GGUF "llama": score-driven bigram merging

  std::vector<std::string> pieces;
  std::vector<std::string> token_bytes;
  std::vector<TokenAttr> attrs;
  std::vector<float> scores;
  std::unordered_map<std::string_view, int32_t> piece_to_id;  // views into `pieces`
  absl::flat_hash_map<uint64_t, MergeInfo> merges;
  std::array<int32_t, 256> byte_level_ids;     // byte -> token of its byte-level character
  std::array<int32_t, 256> byte_fallback_ids;  // byte -> <0xNN> token
  bool byte_fallback = false;
  bool ignore_merges = false;
  bool fuse_unk = false;
  // WordPiece: the model's own vocabulary (added tokens outside it are not pieces), its
  // parameters and the decoder's.
  std::vector<bool> in_model_vocab;
  WordPieceParams wordpiece;
  std::string wordpiece_unk_token;
  bool wordpiece_decoder = false;  // false: HF's default decoding, tokens joined with " "
  std::string wordpiece_decoder_prefix = "##";
  bool wordpiece_cleanup = true;

  std::vector<NormStep> normalizers;
  std::vector<PreStep> pre_steps;
  bool byte_level_prefix_space = false;  // ByteLevel add_prefix_space
  bool spm_add_space_prefix = false;     // scored SPM: prefix segments with a space
  bool strip_leading_space = false;
  bool strip_first_token_only = false;  // Metaspace decoder: only the first token's space

  std::vector<AddedToken> added;  // sorted by content length, longest first
  std::array<bool, 256> added_first_byte{};

  int32_t bos = -1, eos = -1, unk = -1, pad = -1;
  std::vector<int32_t> eog;
  std::vector<int32_t> prefix_ids, suffix_ids;  // added by add_special_tokens

  mutable absl::Mutex cache_mu;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache ABSL_GUARDED_BY(cache_mu);
  static constexpr size_t kCacheMax = 1 << 16;
  static constexpr size_t kCacheWordMax = 64;

  int32_t size() const { return static_cast<int32_t>(pieces.size()); }

  std::optional<int32_t> Lookup(std::string_view s) const {
    auto it = piece_to_id.find(s);
    if (it == piece_to_id.end()) return std::nullopt;
    return it->second;
  }

  // ---- Construction helpers ----
  void SetVocabSize(size_t n) {
    pieces.resize(n);
    attrs.resize(n, TokenAttr::kNormal);
  }

  void BuildIndexes() {
    piece_to_id.clear();
    piece_to_id.reserve(pieces.size());
    for (int32_t i = 0; i < size(); ++i) piece_to_id.emplace(pieces[i], i);
    const ByteLevelMap& bl = ByteLevel();
    for (int b = 0; b < 256; ++b) {
      byte_level_ids[b] = Lookup(bl.byte_to_utf8[b]).value_or(-1);
      char hex[8];
      std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
      byte_fallback_ids[b] = Lookup(hex).value_or(-1);
    }
    std::sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) {
      return a.content.size() != b.content.size() ? a.content.size() > b.content.size()
                                                  : a.id < b.id;
    });
    added_first_byte.fill(false);
    for (const AddedToken& t : added) {
      if (!t.content.empty()) added_first_byte[static_cast<uint8_t>(t.content[0])] = true;
    }
    // Bytes each token decodes to.
    token_bytes.assign(pieces.size(), std::string());
    for (int32_t i = 0; i < size(); ++i) {
      const std::string& p = pieces[i];
      if (attrs[i] == TokenAttr::kByte && p.size() == 6 && p[0] == '<' && p[5] == '>') {
        // Vocabulary text is untrusted: parse the hex digits without exceptions.
        auto hex = [](char c) {
          return std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                 : (c >= 'A' && c <= 'F')                    ? c - 'A' + 10
                 : (c >= 'a' && c <= 'f')                    ? c - 'a' + 10
                                                             : -1;
        };
        int hi = hex(p[3]), lo = hex(p[4]);
        if (p[1] == '0' && p[2] == 'x' && hi >= 0 && lo >= 0) {
          token_bytes[i] = std::string(1, static_cast<char>(hi * 16 + lo));
          continue;
        }
        token_bytes[i] = p;
        continue;
      }
      if (kind == TokenizerKind::kWordPiece) {
        // Not byte-exact: the piece's text, without the continuation prefix.
        std::string_view piece = p;
        if (attrs[i] == TokenAttr::kNormal &&
            piece.starts_with(wordpiece.continuing_subword_prefix)) {
          piece.remove_prefix(wordpiece.continuing_subword_prefix.size());
        }
        token_bytes[i] = std::string(piece);
      } else if (kind == TokenizerKind::kByteLevelBpe) {
        // Every character must be in the byte map, else the piece is used as is (as the
        // reference ByteLevel decoder does per token).
        std::string bytes;
        bool all = true;
        for (size_t k = 0; k < p.size();) {
          size_t len = utf8::ValidSeqLen(p, k);
          if (len == 0) {
            all = false;
            break;
          }
          size_t l2;
          uint32_t cp = utf8::DecodeAt(p, k, &l2);
          auto it = bl.cp_to_byte.find(cp);
          if (it == bl.cp_to_byte.end()) {
            all = false;
            break;
          }
          bytes.push_back(static_cast<char>(it->second));
          k += len;
        }
        token_bytes[i] = all ? bytes : p;
      } else {
        std::string out;
        for (size_t k = 0; k < p.size();) {
          if (p.compare(k, kSpaceMarker.size(), kSpaceMarker) == 0) {
            out.push_back(' ');
            k += kSpaceMarker.size();
          } else {
            out.push_back(p[k++]);
          }
        }
        token_bytes[i] = std::move(out);
      }
    }
  }

  Status AddMerge(std::string_view left, std::string_view right, int32_t rank) {
    auto a = Lookup(left), b = Lookup(right);
    std::string joined = Cat(left, right);
    auto m = Lookup(joined);
    if (!a || !b || !m) {
      return InvalidArgument(name, ": merge ", rank, " (\"", left, "\" + \"", right,
                             "\") uses a token that is not in the vocabulary");
    }
    merges.emplace(PairKey(*a, *b), MergeInfo{rank, *m});  // first (lowest rank) wins
    return OkStatus();
  }

  // ---- Encoding ----
  struct Segment {
    std::string_view text;
    int32_t token = -1;  // >= 0: an added token
  };

  void SplitAdded(std::string_view text, bool parse_special, std::vector<Segment>* out) const {
    size_t start = 0;  // start of pending plain text
    size_t i = 0;
    while (i < text.size()) {
      if (!added_first_byte[static_cast<uint8_t>(text[i])]) {
        ++i;
        continue;
      }
      const AddedToken* hit = nullptr;
      for (const AddedToken& t : added) {  // longest first
        if (t.special && !parse_special) continue;
        if (text.compare(i, t.content.size(), t.content) != 0) continue;
        if (t.single_word) {
          if (i > 0 && IsWordByte(text[i - 1])) continue;
          size_t e = i + t.content.size();
          if (e < text.size() && IsWordByte(text[e])) continue;
        }
        hit = &t;
        break;
      }
      if (hit == nullptr) {
        ++i;
        continue;
      }
      size_t b = i, e = i + hit->content.size();
      if (hit->lstrip) {
        while (b > start && IsAsciiSpace(text[b - 1])) --b;
      }
      if (hit->rstrip) {
        while (e < text.size() && IsAsciiSpace(text[e])) ++e;
      }
      if (b > start) out->push_back({text.substr(start, b - start), -1});
      out->push_back({text.substr(i, hit->content.size()), hit->id});
      start = i = e;
    }
    if (start < text.size()) out->push_back({text.substr(start), -1});
  }

  std::string Normalize(std::string_view s) const {
    std::string out(s);
    for (const NormStep& n : normalizers) {
      if (n.kind == NormStep::kNfc) {
        out = Nfc(out);
      } else if (n.kind == NormStep::kBert) {
        out = BertNormalize(out, n.bert);
      } else if (n.kind == NormStep::kPrepend) {
        if (!out.empty()) out = n.a + out;
      } else {
        if (n.a.empty()) continue;
        std::string r;
        size_t pos = 0;
        while (true) {
          size_t f = out.find(n.a, pos);
          if (f == std::string::npos) break;
          r.append(out, pos, f - pos);
          r += n.b;
          pos = f + n.a.size();
        }
        r.append(out, pos, std::string::npos);
        out = std::move(r);
      }
    }
    return out;
  }

  // Unicode NFC (Qwen2's normalizer), via ICU. REQUIRES: valid UTF-8.
  static std::string Nfc(const std::string& s) {
    bool ascii = std::all_of(s.begin(), s.end(),
                             [](char c) { return static_cast<unsigned char>(c) < 0x80; });
    if (ascii) return s;  // ASCII is always in NFC
    UErrorCode err = U_ZERO_ERROR;
    const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(err);
    if (U_FAILURE(err)) return s;
    icu::UnicodeString u =
        icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
    icu::UnicodeString n = nfc->normalize(u, err);
    if (U_FAILURE(err)) return s;
    std::string out;
    n.toUTF8String(out);
    return out;
  }

  // Splits each [b, e) range of `s` with one pre-tokenizer step.
  static void ApplySplit(std::string_view s, const std::vector<std::pair<size_t, size_t>>& matches,
                         size_t b, size_t e, SplitBehavior behavior,
                         std::vector<std::pair<size_t, size_t>>* out) {
    // `matches` are absolute ranges inside [b, e).
    std::vector<std::pair<std::pair<size_t, size_t>, bool>> parts;  // (range, is_match)
    size_t pos = b;
    for (auto [mb, me] : matches) {
      if (mb > pos) parts.push_back({{pos, mb}, false});
      parts.push_back({{mb, me}, true});
      pos = me;
    }
    if (pos < e) parts.push_back({{pos, e}, false});
    (void)s;
    switch (behavior) {
      case SplitBehavior::kIsolated:
        for (auto& p : parts) out->push_back(p.first);
        break;
      case SplitBehavior::kRemoved:
        for (auto& p : parts) {
          if (!p.second) out->push_back(p.first);
        }
        break;
      case SplitBehavior::kMergedWithPrevious: {
        size_t start = out->size();
        for (auto& p : parts) {
          if (p.second && out->size() > start) {
            out->back().second = p.first.second;
          } else {
            out->push_back(p.first);
          }
        }
        break;
      }
      case SplitBehavior::kMergedWithNext: {
        bool pending = false;
        size_t pend_b = 0;
        for (auto& p : parts) {
          if (p.second) {
            if (!pending) pend_b = p.first.first;
            pending = true;
          } else {
            out->push_back({pending ? pend_b : p.first.first, p.first.second});
            pending = false;
          }
        }
        if (pending) out->push_back({pend_b, e});
        break;
      }
      case SplitBehavior::kContiguous: {
        bool last_match = false;
        size_t start = out->size();
        for (auto& p : parts) {
          if (p.second && last_match && out->size() > start &&
              out->back().second == p.first.first) {
            out->back().second = p.first.second;
          } else {
            out->push_back(p.first);
          }
          last_match = p.second;
        }
        break;
      }
    }
  }

  void PreTokenize(std::string* s, bool first_segment,
                   std::vector<std::pair<size_t, size_t>>* words) const {
    words->clear();
    if (s->empty()) return;
    words->push_back({0, s->size()});
    std::vector<std::pair<size_t, size_t>> next, matches;
    for (const PreStep& step : pre_steps) {
      next.clear();
      if (step.kind == PreStep::kMetaspace) {
        // Replace spaces and prepend "▁"; only valid as the first step (checked at load).
        std::string r;
        bool prepend =
            step.prepend == PreStep::kAlways || (step.prepend == PreStep::kFirst && first_segment);
        if (prepend && s->compare(0, kSpaceMarker.size(), kSpaceMarker) != 0 && (*s)[0] != ' ') {
          r += kSpaceMarker;
        }
        for (char c : *s) {
          if (c == ' ') {
            r += kSpaceMarker;
          } else {
            r.push_back(c);
          }
        }
        *s = std::move(r);
        if (!step.split) {
          words->assign(1, {0, s->size()});
          continue;
        }
        // Split before each "▁" (MergedWithNext).
        size_t start = 0;
        for (size_t i = 0; i + kSpaceMarker.size() <= s->size(); ++i) {
          if (i > start && s->compare(i, kSpaceMarker.size(), kSpaceMarker) == 0) {
            next.push_back({start, i});
            start = i;
          }
        }
        next.push_back({start, s->size()});
        words->swap(next);
        continue;
      }
      for (auto [b, e] : *words) {
        if (step.kind == PreStep::kBert) {
          BertPreTokenize(std::string_view(*s).substr(b, e - b), b, &next);
          continue;
        }
        matches.clear();
        std::string_view piece(s->data() + b, e - b);
        if (step.kind == PreStep::kRegex) {
          step.regex->FindAll(piece, &matches);
          for (auto& m : matches) {
            m.first += b;
            m.second += b;
          }
        } else if (step.kind == PreStep::kDigits) {
          // Rust's char::is_numeric: Unicode Nd, Nl and No.
          static const Pcre2Regex* const kOne = Pcre2Regex::Compile("\\p{N}")->release();
          static const Pcre2Regex* const kRun = Pcre2Regex::Compile("\\p{N}+")->release();
          (step.individual_digits ? kOne : kRun)->FindAll(piece, &matches);
          for (auto& m : matches) {
            m.first += b;
            m.second += b;
          }
        } else if (step.kind == PreStep::kWhitespaceSplit) {
          for (size_t i = b; i < e; ++i) {
            if (IsAsciiSpace((*s)[i])) matches.push_back({i, i + 1});
          }
        }
        if (step.invert) {
          std::vector<std::pair<size_t, size_t>> inv;
          size_t pos = b;
          for (auto [mb, me] : matches) {
            if (mb > pos) inv.push_back({pos, mb});
            pos = me;
          }
          if (pos < e) inv.push_back({pos, e});
          matches.swap(inv);
        }
        ApplySplit(*s, matches, b, e, step.behavior, &next);
      }
      words->swap(next);
    }
  }

  // Rank-driven BPE on one word (Hugging Face semantics).
  void BpeWord(std::string_view word, std::vector<int32_t>* out) const {
    struct Sym {
      int32_t id;
      int32_t prev, next;
      bool alive;
    };
    std::vector<Sym> syms;
    syms.reserve(word.size());
    auto push = [&](int32_t id) {
      int32_t idx = static_cast<int32_t>(syms.size());
      syms.push_back({id, idx - 1, -1, true});
      if (idx > 0) syms[idx - 1].next = idx;
    };
    if (kind == TokenizerKind::kByteLevelBpe) {
      for (char c : word) {
        int32_t id = byte_level_ids[static_cast<uint8_t>(c)];
        push(id >= 0 ? id : unk);
      }
    } else {
      for (size_t i = 0; i < word.size();) {
        size_t len = utf8::SeqLen(static_cast<uint8_t>(word[i]));
        len = std::min(len, word.size() - i);
        auto id = Lookup(word.substr(i, len));
        if (id) {
          push(*id);
        } else if (byte_fallback) {
          bool all = true;
          for (size_t k = 0; k < len; ++k) {
            all &= byte_fallback_ids[static_cast<uint8_t>(word[i + k])] >= 0;
          }
          if (all) {
            for (size_t k = 0; k < len; ++k)
              push(byte_fallback_ids[static_cast<uint8_t>(word[i + k])]);
          } else {
            push(unk);
          }
        } else if (!(fuse_unk && !syms.empty() && syms.back().id == unk && unk >= 0)) {
          push(unk);
        }
        i += len;
      }
    }
    struct Cand {
      int32_t rank;
      int32_t pos;
      int32_t left_id, right_id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto consider = [&](int32_t l) {
      if (l < 0) return;
      int32_t r = syms[l].next;
      if (r < 0) return;
      auto it = merges.find(PairKey(syms[l].id, syms[r].id));
      if (it != merges.end()) heap.push({it->second.rank, l, syms[l].id, syms[r].id});
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) consider(i);
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      Sym& l = syms[c.pos];
      if (!l.alive || l.id != c.left_id || l.next < 0) continue;
      Sym& r = syms[l.next];
      if (r.id != c.right_id) continue;
      auto it = merges.find(PairKey(l.id, r.id));
      if (it == merges.end() || it->second.rank != c.rank) continue;
      l.id = it->second.merged;
      r.alive = false;
      l.next = r.next;
      if (r.next >= 0) syms[r.next].prev = c.pos;
      consider(l.prev);
      consider(c.pos);
    }
    for (const Sym& s : syms) {
      if (s.alive && s.id >= 0) out->push_back(s.id);
    }
  }

  // llama.cpp's SentencePiece algorithm: repeatedly merge the adjacent pair whose
  // concatenation is the highest-scoring vocabulary entry; unknown pieces fall back to bytes.
  void SpmScored(std::string_view text, std::vector<int32_t>* out) const {
    struct Sym {
      int32_t prev, next;
      size_t start, n;
    };
    std::vector<Sym> syms;
    for (size_t i = 0; i < text.size();) {
      size_t len = std::min(utf8::SeqLen(static_cast<uint8_t>(text[i])), text.size() - i);
      int32_t idx = static_cast<int32_t>(syms.size());
      syms.push_back({idx - 1, -1, i, len});
      if (idx > 0) syms[idx - 1].next = idx;
      i += len;
    }
    struct Bigram {
      float score;
      int32_t left, right;
      size_t size;
    };
    auto cmp = [](const Bigram& a, const Bigram& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<Bigram, std::vector<Bigram>, decltype(cmp)> queue(cmp);
    std::unordered_map<std::string_view, std::pair<int32_t, int32_t>> rev_merge;
    auto try_add = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      std::string_view s = text.substr(syms[l].start, syms[l].n + syms[r].n);
      auto id = Lookup(s);
      if (!id) return;
      queue.push({scores[*id], l, r, s.size()});
      rev_merge[s] = {l, r};
    };
    for (int32_t i = 1; i < static_cast<int32_t>(syms.size()); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
      Bigram b = queue.top();
      queue.pop();
      Sym& l = syms[b.left];
      Sym& r = syms[b.right];
      if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) syms[r.next].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }
    std::function<void(std::string_view)> resegment = [&](std::string_view s) {
      if (auto id = Lookup(s)) {
        out->push_back(*id);
        return;
      }
      auto it = rev_merge.find(s);
      if (it == rev_merge.end()) {
        for (char c : s) {
          int32_t id = byte_fallback_ids[static_cast<uint8_t>(c)];
          out->push_back(id >= 0 ? id : unk);
        }
        return;
      }
      const Sym& l = syms[it->second.first];
      const Sym& r = syms[it->second.second];
      // The pair's original extents: left starts at l.start, right at r.start.
      resegment(text.substr(l.start, r.start - l.start));
      resegment(s.substr(r.start - l.start));
    };
    for (int32_t i = 0; i != -1 && i < static_cast<int32_t>(syms.size()); i = syms[i].next) {
      if (syms[i].n > 0) resegment(text.substr(syms[i].start, syms[i].n));
    }
  }

  void EncodeWord(std::string_view word, std::vector<int32_t>* out) const {
    if (ignore_merges) {
      std::string key;
      if (kind == TokenizerKind::kByteLevelBpe) {
        const ByteLevelMap& bl = ByteLevel();
        for (char c : word) key += bl.byte_to_utf8[static_cast<uint8_t>(c)];
      } else {
        key = std::string(word);
      }
      if (auto id = Lookup(key)) {
        out->push_back(*id);
        return;
      }
    }
    const bool cacheable = word.size() <= kCacheWordMax;
    if (cacheable) {
      absl::ReaderMutexLock lock(&cache_mu);
      auto it = cache.find(std::string(word));  // absl::string_view keys differ from std's
      if (it != cache.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    size_t before = out->size();
    if (kind == TokenizerKind::kWordPiece) {
      WordPieceEncodeWord(
          word, wordpiece,
          [this](std::string_view piece) -> std::optional<int32_t> {
            auto id = Lookup(piece);
            return id && in_model_vocab[*id] ? id : std::nullopt;
          },
          out);
    } else {
      BpeWord(word, out);
    }
    if (cacheable) {
      absl::MutexLock lock(&cache_mu);
      if (cache.size() >= kCacheMax) cache.clear();
      cache.emplace(std::string(word), std::vector<int32_t>(out->begin() + before, out->end()));
    }
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                 const EncodeOptions& options) const {
  const Impl& m = *impl_;
  size_t bad = utf8::FindInvalid(text);
  if (bad != std::string_view::npos) {
    return InvalidArgument("text is not valid UTF-8: invalid byte 0x",
                           absl::Hex(static_cast<uint8_t>(text[bad]), absl::kZeroPad2),
                           " at offset ", bad);
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (options.add_special_tokens) ids.insert(ids.end(), m.prefix_ids.begin(), m.prefix_ids.end());
  std::vector<Impl::Segment> segments;
  m.SplitAdded(text, options.parse_special, &segments);
  std::vector<std::pair<size_t, size_t>> words;
  bool prev_special = true;  // the start of the text counts as after a special token
  bool first = true;
  for (const Impl::Segment& seg : segments) {
    if (seg.token >= 0) {
      ids.push_back(seg.token);
      prev_special = true;
      first = false;
      continue;
    }
    if (m.scored_spm) {
      std::string s;
      if (m.spm_add_space_prefix && prev_special) s = " ";
      s.append(seg.text);
      std::string escaped = m.Normalize(s);
      m.SpmScored(escaped, &ids);
    } else {
      std::string s = m.Normalize(seg.text);
      if (m.byte_level_prefix_space && !s.empty() && s[0] != ' ') s.insert(s.begin(), ' ');
      m.PreTokenize(&s, first, &words);
      for (auto [b, e] : words) m.EncodeWord(std::string_view(s).substr(b, e - b), &ids);
    }
    prev_special = false;
    first = false;
  }
  if (options.add_special_tokens) ids.insert(ids.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return ids;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, const DecodeOptions& options) const {
  const Impl& m = *impl_;
  if (m.kind == TokenizerKind::kWordPiece) {
    std::vector<std::string_view> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      if (id < 0 || id >= m.size()) continue;
      if (options.skip_special_tokens && IsSpecial(id)) continue;
      tokens.push_back(m.pieces[id]);
    }
    if (m.wordpiece_decoder) {
      return WordPieceDecode(tokens, m.wordpiece_decoder_prefix, m.wordpiece_cleanup);
    }
    std::string out;  // no decoder: HF joins the tokens with spaces
    for (std::string_view t : tokens) out.append(out.empty() ? "" : " ").append(t);
    return out;
  }
  std::string bytes;
  bool first_token = true;
  for (int32_t id : ids) {
    if (id < 0 || id >= m.size()) continue;
    if (options.skip_special_tokens && IsSpecial(id)) continue;
    std::string_view tb = m.token_bytes[id];
    if (first_token && m.strip_first_token_only && options.strip_leading_space && !tb.empty() &&
        tb[0] == ' ') {
      tb.remove_prefix(1);
    }
    first_token = false;
    bytes.append(tb);
  }
  if (m.strip_leading_space && !m.strip_first_token_only && options.strip_leading_space &&
      !bytes.empty() && bytes[0] == ' ') {
    bytes.erase(0, 1);
  }
  std::string out;
  out.reserve(bytes.size());
  utf8::AppendLossy(bytes, &out);
  return out;
}

TokenizerKind Tokenizer::kind() const { return impl_->kind; }
int32_t Tokenizer::vocab_size() const { return impl_->size(); }
std::string_view Tokenizer::Piece(int32_t id) const {
  KILN_CHECK(id >= 0 && id < impl_->size(), "token id out of range");
  return impl_->pieces[id];
}
std::string_view Tokenizer::TokenBytes(int32_t id) const {
  KILN_CHECK(id >= 0 && id < impl_->size(), "token id out of range");
  return impl_->token_bytes[id];
}
std::optional<int32_t> Tokenizer::PieceToId(std::string_view piece) const {
  return impl_->Lookup(piece);
}
TokenAttr Tokenizer::Attr(int32_t id) const {
  KILN_CHECK(id >= 0 && id < impl_->size(), "token id out of range");
  return impl_->attrs[id];
}
bool Tokenizer::IsSpecial(int32_t id) const {
  if (id < 0 || id >= impl_->size()) return false;
  TokenAttr a = impl_->attrs[id];
  return a == TokenAttr::kControl || a == TokenAttr::kUnknown;
}
int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::unk_id() const { return impl_->unk; }
int32_t Tokenizer::pad_id() const { return impl_->pad; }
const std::vector<int32_t>& Tokenizer::eog_ids() const { return impl_->eog; }
bool Tokenizer::add_bos() const {
  return !impl_->prefix_ids.empty() && impl_->prefix_ids[0] == impl_->bos;
}
bool Tokenizer::add_eos() const {
  return !impl_->suffix_ids.empty() && impl_->suffix_ids.back() == impl_->eos;
}
bool Tokenizer::strips_leading_space() const { return impl_->strip_leading_space; }

namespace {

// End-of-generation tokens beyond EOS, by their conventional text.
void CollectEog(Tokenizer::Impl* m, std::vector<int32_t> extra) {
  m->eog.clear();
  if (m->eos >= 0) m->eog.push_back(m->eos);
  for (int32_t id : extra) {
    if (id >= 0) m->eog.push_back(id);
  }
  static constexpr std::string_view kEnd[] = {"<|eot_id|>",    "<|im_end|>",    "<|end|>",
                                              "<end_of_turn>", "<|endoftext|>", "<|eom_id|>"};
  for (std::string_view t : kEnd) {
    auto id = m->Lookup(t);
    if (id && m->attrs[*id] == TokenAttr::kControl) m->eog.push_back(*id);
  }
  std::sort(m->eog.begin(), m->eog.end());
  m->eog.erase(std::unique(m->eog.begin(), m->eog.end()), m->eog.end());
}

StatusOr<std::vector<PreStep>> PreStepsForGgufPre(std::string_view pre, std::string_view path,
                                                  bool* ignore_merges) {
  auto regex = [](std::string_view p) -> StatusOr<PreStep> {
    KILN_ASSIGN_OR_RETURN(auto re, Pcre2Regex::Compile(p));
    PreStep s;
    s.kind = PreStep::kRegex;
    s.regex = std::move(re);
    return s;
  };
  std::vector<PreStep> steps;
  if (pre == "default" || pre == "gpt2" || pre == "gpt-2" || pre == "olmo" || pre == "mpt") {
    KILN_ASSIGN_OR_RETURN(auto s, regex(kGpt2Pattern));
    steps.push_back(std::move(s));
  } else if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3" || pre == "smaug-bpe") {
    KILN_ASSIGN_OR_RETURN(auto s, regex(kLlama3Pattern));
    steps.push_back(std::move(s));
    *ignore_merges = true;
  } else if (pre == "qwen2" || pre == "deepseek-r1-qwen") {
    KILN_ASSIGN_OR_RETURN(auto s, regex(kQwen2Pattern));
    steps.push_back(std::move(s));
  } else if (pre == "smollm" || pre == "starcoder" || pre == "refact") {
    // Hugging Face: Digits(individual_digits) then ByteLevel.
    PreStep d;
    d.kind = PreStep::kDigits;
    d.individual_digits = true;
    steps.push_back(d);
    KILN_ASSIGN_OR_RETURN(auto s, regex(kGpt2Pattern));
    steps.push_back(std::move(s));
  } else {
    return InvalidArgument(path, ": unsupported tokenizer.ggml.pre \"", pre,
                           "\" (supported: default, gpt2, llama-bpe, qwen2, smollm, starcoder, "
                           "refact, olmo, mpt)");
  }
  return steps;
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& g) {
  auto m = std::make_unique<Impl>();
  m->name = g.path();
  KILN_ASSIGN_OR_RETURN(std::string_view model, g.GetString("tokenizer.ggml.model"));
  KILN_ASSIGN_OR_RETURN(auto tokens, g.GetStringArray("tokenizer.ggml.tokens"));
  if (tokens.empty()) return InvalidArgument(g.path(), ": tokenizer.ggml.tokens is empty");
  m->SetVocabSize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) m->pieces[i] = std::string(tokens[i]);
  if (g.Has("tokenizer.ggml.token_type")) {
    KILN_ASSIGN_OR_RETURN(auto types, g.GetI32Array("tokenizer.ggml.token_type"));
    if (types.size() != tokens.size()) {
      return InvalidArgument(g.path(), ": tokenizer.ggml.token_type has ", types.size(),
                             " entries but there are ", tokens.size(), " tokens");
    }
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] < 1 || types[i] > 6) {
        return InvalidArgument(g.path(), ": tokenizer.ggml.token_type[", i, "] is ", types[i],
                               " (allowed: 1 normal, 2 unknown, 3 control, 4 user-defined, "
                               "5 unused, 6 byte)");
      }
      m->attrs[i] = static_cast<TokenAttr>(types[i]);
    }
  }
  auto id_key = [&](const char* key, int32_t* out) -> Status {
    if (!g.Has(key)) return OkStatus();
    KILN_ASSIGN_OR_RETURN(uint32_t id, g.GetU32(key));
    if (id >= tokens.size()) {
      return InvalidArgument(g.path(), ": ", key, " is ", id, " but the vocabulary has ",
                             tokens.size(), " tokens");
    }
    *out = static_cast<int32_t>(id);
    return OkStatus();
  };
  KILN_RETURN_IF_ERROR(id_key("tokenizer.ggml.bos_token_id", &m->bos));
  KILN_RETURN_IF_ERROR(id_key("tokenizer.ggml.eos_token_id", &m->eos));
  KILN_RETURN_IF_ERROR(id_key("tokenizer.ggml.unknown_token_id", &m->unk));
  KILN_RETURN_IF_ERROR(id_key("tokenizer.ggml.padding_token_id", &m->pad));
  int32_t eot = -1, eom = -1;
  KILN_RETURN_IF_ERROR(id_key("tokenizer.ggml.eot_token_id", &eot));
  KILN_RETURN_IF_ERROR(id_key("tokenizer.ggml.eom_token_id", &eom));

  bool add_bos_default;
  if (model == "gpt2") {
    m->kind = TokenizerKind::kByteLevelBpe;
    add_bos_default = false;
    KILN_ASSIGN_OR_RETURN(auto merges, g.GetStringArray("tokenizer.ggml.merges"));
    KILN_ASSIGN_OR_RETURN(std::string_view pre, g.GetStringOr("tokenizer.ggml.pre", "default"));
    KILN_ASSIGN_OR_RETURN(m->pre_steps, PreStepsForGgufPre(pre, g.path(), &m->ignore_merges));
    m->BuildIndexes();
    m->merges.reserve(merges.size());
    for (size_t r = 0; r < merges.size(); ++r) {
      size_t sp = merges[r].find(' ', 1);
      if (sp == std::string_view::npos) {
        return InvalidArgument(g.path(), ": tokenizer.ggml.merges[", r, "] = \"", merges[r],
                               "\" is not \"left right\"");
      }
      KILN_RETURN_IF_ERROR(
          m->AddMerge(merges[r].substr(0, sp), merges[r].substr(sp + 1), static_cast<int32_t>(r)));
    }
  } else if (model == "llama") {
    m->kind = TokenizerKind::kSentencePieceBpe;
    m->scored_spm = true;
    add_bos_default = true;
    KILN_ASSIGN_OR_RETURN(m->scores, g.GetF32Array("tokenizer.ggml.scores"));
    if (m->scores.size() != tokens.size()) {
      return InvalidArgument(g.path(), ": tokenizer.ggml.scores has ", m->scores.size(),
                             " entries but there are ", tokens.size(), " tokens");
    }
    KILN_ASSIGN_OR_RETURN(m->spm_add_space_prefix,
                          g.GetBoolOr("tokenizer.ggml.add_space_prefix", true));
    m->normalizers.push_back({NormStep::kReplace, " ", std::string(kSpaceMarker)});
    m->strip_leading_space = m->spm_add_space_prefix;
    m->byte_fallback = true;
    m->BuildIndexes();
  } else {
    return InvalidArgument(g.path(), ": unsupported tokenizer.ggml.model \"", model,
                           "\" (supported: gpt2 = byte-level BPE, llama = SentencePiece BPE)");
  }
  // llama.cpp treats these texts as control tokens whatever the file says (end-of-turn and
  // fill-in-the-middle markers); GGUF files are written for it, so do the same.
  static constexpr std::string_view kForcedControl[] = {
      "<|eot_id|>",     "<|im_end|>",   "<|end|>",         "<end_of_turn>",
      "<|endoftext|>",  "<EOT>",        "_<EOT>",          "<|eom_id|>",
      "<|return|>",     "<|call|>",     "<|end_of_text|>", "<end_of_utterance>",
      "<|fim_prefix|>", "<fim-prefix>", "<PRE>",           "<|fim_suffix|>",
      "<fim-suffix>",   "<SUF>",        "<|fim_middle|>",  "<fim-middle>",
      "<MID>",          "<|fim_pad|>",  "<fim-pad>",       "<|fim_repo|>",
      "<|repo_name|>",  "<fim-repo>",   "<REPO>",          "<|file_sep|>",
      "<|fim_sep|>",    "<fim-sep>"};
  for (std::string_view t : kForcedControl) {
    if (auto id = m->Lookup(t)) m->attrs[*id] = TokenAttr::kControl;
  }
  for (int32_t i = 0; i < m->size(); ++i) {
    TokenAttr a = m->attrs[i];
    if (a == TokenAttr::kControl || a == TokenAttr::kUserDefined || a == TokenAttr::kUnknown) {
      if (m->pieces[i].empty()) continue;
      m->added.push_back({i, m->pieces[i], a != TokenAttr::kUserDefined});
    }
  }
  // Added tokens keep their text as is when decoded.
  m->BuildIndexes();
  for (const AddedToken& t : m->added) m->token_bytes[t.id] = t.content;
  KILN_ASSIGN_OR_RETURN(bool add_bos, g.GetBoolOr("tokenizer.ggml.add_bos_token", add_bos_default));
  KILN_ASSIGN_OR_RETURN(bool add_eos, g.GetBoolOr("tokenizer.ggml.add_eos_token", false));
  if (add_bos && m->bos >= 0) m->prefix_ids.push_back(m->bos);
  if (add_eos && m->eos >= 0) m->suffix_ids.push_back(m->eos);
  CollectEog(m.get(), {eot, eom});
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(m)));
}

namespace {

StatusOr<SplitBehavior> ParseBehavior(const json& j, std::string_view where) {
  std::string b = j.is_string() ? j.get<std::string>() : "";
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  return InvalidArgument(where, ": unknown split behavior ", j.dump(),
                         " (allowed: Isolated, Removed, MergedWithPrevious, MergedWithNext, "
                         "Contiguous)");
}

std::string EscapeRegexLiteral(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

Status ParseNormalizer(const json& j, Tokenizer::Impl* m, std::string_view where) {
  if (j.is_null()) return OkStatus();
  std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& n : j.value("normalizers", json::array())) {
      KILN_RETURN_IF_ERROR(ParseNormalizer(n, m, where));
    }
    return OkStatus();
  }
  if (type == "Prepend") {
    m->normalizers.push_back({NormStep::kPrepend, j.value("prepend", ""), ""});
    return OkStatus();
  }
  if (type == "Replace") {
    const json& p = j["pattern"];
    if (!p.contains("String")) {
      return Unimplemented(where, ": Replace normalizer with a regex pattern is not supported");
    }
    m->normalizers.push_back(
        {NormStep::kReplace, p["String"].get<std::string>(), j.value("content", "")});
    return OkStatus();
  }
  if (type == "NFC") {
    m->normalizers.push_back({NormStep::kNfc, "", ""});
    return OkStatus();
  }
  if (type == "BertNormalizer") {
    NormStep n{NormStep::kBert, "", ""};
    n.bert.clean_text = j.value("clean_text", true);
    n.bert.handle_chinese_chars = j.value("handle_chinese_chars", true);
    n.bert.lowercase = j.value("lowercase", true);
    const json& strip = j.value("strip_accents", json());
    if (!strip.is_null() && !strip.is_boolean()) {
      return InvalidArgument(where, ": normalizer.strip_accents is ", strip.dump(),
                             " (allowed: true, false, null = same as lowercase)");
    }
    n.bert.strip_accents = strip.is_null() ? n.bert.lowercase : strip.get<bool>();
    m->normalizers.push_back(std::move(n));
    return OkStatus();
  }
  if (type == "NFKC" || type == "NFD" || type == "NFKD" || type == "Lowercase" || type == "Strip" ||
      type == "StripAccents" || type == "Precompiled" || type == "Nmt" || type == "ByteLevel") {
    return Unimplemented(where, ": normalizer \"", type,
                         "\" is not supported (supported: Sequence, Prepend, Replace, NFC, "
                         "BertNormalizer)");
  }
  return InvalidArgument(where, ": unknown normalizer.type \"", type, "\"");
}

Status ParsePreTokenizer(const json& j, Tokenizer::Impl* m, std::string_view where,
                         bool* byte_level) {
  if (j.is_null()) return OkStatus();
  std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& p : j.value("pretokenizers", json::array())) {
      KILN_RETURN_IF_ERROR(ParsePreTokenizer(p, m, where, byte_level));
    }
    return OkStatus();
  }
  if (type == "ByteLevel") {
    *byte_level = true;
    if (j.value("add_prefix_space", false)) m->byte_level_prefix_space = true;
    if (j.value("use_regex", true)) {
      KILN_ASSIGN_OR_RETURN(auto re, Pcre2Regex::Compile(kGpt2Pattern));
      PreStep s;
      s.kind = PreStep::kRegex;
      s.regex = std::move(re);
      m->pre_steps.push_back(std::move(s));
    }
    return OkStatus();
  }
  if (type == "Split") {
    PreStep s;
    s.kind = PreStep::kRegex;
    const json& p = j["pattern"];
    std::string pattern;
    if (p.contains("Regex")) {
      pattern = p["Regex"].get<std::string>();
    } else if (p.contains("String")) {
      pattern = EscapeRegexLiteral(p["String"].get<std::string>());
    } else {
      return InvalidArgument(where, ": Split pre-tokenizer needs a Regex or String pattern");
    }
    auto re = Pcre2Regex::Compile(pattern);
    if (!re.ok()) return Annotate(re.status(), where);
    s.regex = std::move(*re);
    KILN_ASSIGN_OR_RETURN(s.behavior, ParseBehavior(j["behavior"], where));
    s.invert = j.value("invert", false);
    m->pre_steps.push_back(std::move(s));
    return OkStatus();
  }
  if (type == "Digits") {
    PreStep s;
    s.kind = PreStep::kDigits;
    s.individual_digits = j.value("individual_digits", false);
    m->pre_steps.push_back(std::move(s));
    return OkStatus();
  }
  if (type == "Metaspace") {
    if (!m->pre_steps.empty()) {
      return Unimplemented(where, ": Metaspace must be the first pre-tokenizer");
    }
    PreStep s;
    s.kind = PreStep::kMetaspace;
    if (j.value("replacement", std::string(kSpaceMarker)) != kSpaceMarker) {
      return Unimplemented(where, ": Metaspace replacement other than \"▁\" is not supported");
    }
    std::string scheme =
        j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
    s.prepend = scheme == "first"   ? PreStep::kFirst
                : scheme == "never" ? PreStep::kNever
                                    : PreStep::kAlways;
    s.split = j.value("split", true);
    m->pre_steps.push_back(std::move(s));
    return OkStatus();
  }
  if (type == "WhitespaceSplit") {
    PreStep s;
    s.kind = PreStep::kWhitespaceSplit;
    s.behavior = SplitBehavior::kRemoved;
    m->pre_steps.push_back(std::move(s));
    return OkStatus();
  }
  if (type == "BertPreTokenizer") {
    PreStep s;
    s.kind = PreStep::kBert;
    m->pre_steps.push_back(std::move(s));
    return OkStatus();
  }
  if (type == "Whitespace") {
    KILN_ASSIGN_OR_RETURN(auto re, Pcre2Regex::Compile(R"(\w+|[^\w\s]+)"));
    PreStep s;
    s.kind = PreStep::kRegex;
    s.regex = std::move(re);
    s.invert = true;
    s.behavior = SplitBehavior::kRemoved;
    m->pre_steps.push_back(std::move(s));
    return OkStatus();
  }
  if (type == "CharDelimiterSplit" || type == "Punctuation" || type == "UnicodeScripts" ||
      type == "FixedLength") {
    return Unimplemented(where, ": pre-tokenizer \"", type,
                         "\" is not supported (supported: Sequence, ByteLevel, Split, Digits, "
                         "Metaspace, Whitespace, WhitespaceSplit, BertPreTokenizer)");
  }
  return InvalidArgument(where, ": unknown pre_tokenizer.type \"", type, "\"");
}

// The decoder decides how leading spaces are treated.
void ParseDecoder(const json& j, Tokenizer::Impl* m) {
  if (j.is_null()) return;
  std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& d : j.value("decoders", json::array())) ParseDecoder(d, m);
  } else if (type == "Strip") {
    if (j.value("content", "") == " " && j.value("start", 0) > 0) m->strip_leading_space = true;
  } else if (type == "Metaspace") {
    std::string scheme =
        j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
    if (scheme != "never") {
      m->strip_leading_space = true;
      m->strip_first_token_only = true;
    }
  }
}

// TemplateProcessing "single": special tokens before and after $A.
Status ParsePostProcessor(const json& j, Tokenizer::Impl* m, std::string_view where) {
  if (j.is_null()) return OkStatus();
  std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& p : j.value("processors", json::array())) {
      KILN_RETURN_IF_ERROR(ParsePostProcessor(p, m, where));
    }
    return OkStatus();
  }
  if (type == "BertProcessing") {  // older BERT files: {"cls": ["[CLS]", 101], "sep": [...]}
    for (const char* key : {"cls", "sep"}) {
      const json& t = j.value(key, json());
      if (!t.is_array() || t.size() != 2 || !t[1].is_number_integer()) {
        return InvalidArgument(where, ": post_processor.", key, " must be [token, id]");
      }
      (key[0] == 'c' ? m->prefix_ids : m->suffix_ids).push_back(t[1].get<int32_t>());
    }
    return OkStatus();
  }
  if (type != "TemplateProcessing") return OkStatus();  // ByteLevel etc.: no ids added
  const json& specials = j.value("special_tokens", json::object());
  bool after = false;
  for (const json& piece : j.value("single", json::array())) {
    if (piece.contains("Sequence")) {
      after = true;
      continue;
    }
    if (!piece.contains("SpecialToken")) continue;
    std::string name = piece["SpecialToken"].value("id", "");
    if (!specials.contains(name)) {
      return InvalidArgument(where, ": post_processor uses special token \"", name,
                             "\" that is not in special_tokens");
    }
    for (const json& id : specials[name].value("ids", json::array())) {
      (after ? m->suffix_ids : m->prefix_ids).push_back(id.get<int32_t>());
    }
  }
  return OkStatus();
}

// model.type "WordPiece": unk_token, continuing_subword_prefix, max_input_chars_per_word.
Status ParseWordPieceModel(const json& model, Tokenizer::Impl* m, std::string_view where) {
  const json& unk = model.value("unk_token", json("[UNK]"));
  const json& prefix = model.value("continuing_subword_prefix", json("##"));
  const json& max_chars = model.value("max_input_chars_per_word", json(100));
  if (!unk.is_string()) return InvalidArgument(where, ": model.unk_token must be a string");
  if (!prefix.is_string()) {
    return InvalidArgument(where, ": model.continuing_subword_prefix must be a string");
  }
  if (!max_chars.is_number_integer() || max_chars.get<int64_t>() < 0) {
    return InvalidArgument(where, ": model.max_input_chars_per_word is ", max_chars.dump(),
                           " (allowed: an integer >= 0)");
  }
  m->wordpiece.continuing_subword_prefix = prefix.get<std::string>();
  m->wordpiece.max_input_chars_per_word = max_chars.get<size_t>();
  m->wordpiece_unk_token = unk.get<std::string>();  // resolved by FinishWordPiece
  return OkStatus();
}

// A WordPiece model's decoder: WordPiece, or none (HF then joins the tokens with spaces).
Status ParseWordPieceDecoder(const json& j, Tokenizer::Impl* m, std::string_view where) {
  if (j.is_null()) return OkStatus();
  std::string type = j.value("type", "");
  if (type != "WordPiece") {
    return Unimplemented(where, ": decoder \"", type,
                         "\" is not supported with a WordPiece model (supported: WordPiece)");
  }
  m->wordpiece_decoder = true;
  m->wordpiece_decoder_prefix = j.value("prefix", "##");
  m->wordpiece_cleanup = j.value("cleanup", true);
  return OkStatus();
}

// Checks the unk token, and fills in what BERT files leave implicit: [CLS] ... [SEP] when
// there is no post-processor, and [PAD].
Status FinishWordPiece(bool no_post_processor, const HfTokenizerConfig* config, Tokenizer::Impl* m,
                       std::string_view where) {
  auto unk = m->Lookup(m->wordpiece_unk_token);
  if (!unk || !m->in_model_vocab[*unk]) {
    return InvalidArgument(where, ": model.unk_token \"", m->wordpiece_unk_token,
                           "\" is not in model.vocab");
  }
  m->unk = m->wordpiece.unk_id = *unk;
  if (m->pad < 0) m->pad = m->Lookup("[PAD]").value_or(-1);
  if (no_post_processor) {
    // tokenizer_config.json's cls_token / sep_token, written as strings or {"content": ...}.
    auto special = [&](const char* key, std::string_view fallback) -> std::optional<int32_t> {
      std::string text(fallback);
      if (config != nullptr && config->raw.is_object() && config->raw.contains(key)) {
        const json& v = config->raw[key];
        if (v.is_string()) text = v.get<std::string>();
        if (v.is_object() && v.value("content", json()).is_string()) {
          text = v["content"].get<std::string>();
        }
      }
      return m->Lookup(text);
    };
    auto cls = special("cls_token", "[CLS]"), sep = special("sep_token", "[SEP]");
    if (cls && sep) {
      m->prefix_ids = {*cls};
      m->suffix_ids = {*sep};
    }
  }
  return OkStatus();
}

}  // namespace

namespace {
StatusOr<std::unique_ptr<Tokenizer::Impl>> ParseHfJson(std::string_view text,
                                                       const HfTokenizerConfig* config,
                                                       std::string_view name);
}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromHfJson(std::string_view text,
                                                           const HfTokenizerConfig* config,
                                                           std::string_view name) {
  // Field accessors throw on unexpected JSON types; turn that into a clear error.
  try {
    KILN_ASSIGN_OR_RETURN(auto impl, ParseHfJson(text, config, name));
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument(name, ": unexpected tokenizer.json structure: ", e.what());
  }
}

namespace {
StatusOr<std::unique_ptr<Tokenizer::Impl>> ParseHfJson(std::string_view text,
                                                       const HfTokenizerConfig* config,
                                                       std::string_view name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    return InvalidArgument(name, ": not valid JSON (byte ", e.byte, "): ", e.what());
  } catch (const json::exception& e) {
    return InvalidArgument(name, ": not valid JSON: ", e.what());
  }
  auto m = std::make_unique<Tokenizer::Impl>();
  m->name = std::string(name);
  const json& model = j.value("model", json::object());
  std::string mtype = model.value("type", "BPE");
  const bool wordpiece = mtype == "WordPiece";
  if (mtype != "BPE" && !wordpiece) {
    return Unimplemented(name, ": tokenizer model \"", mtype,
                         "\" is not supported (supported: BPE, WordPiece)");
  }
  if (wordpiece) {
    m->kind = TokenizerKind::kWordPiece;
    KILN_RETURN_IF_ERROR(ParseWordPieceModel(model, m.get(), name));
  } else {
    if (!model.value("dropout", json()).is_null()) {
      return Unimplemented(name, ": BPE dropout is not supported for inference");
    }
    if (!model.value("continuing_subword_prefix", json()).is_null() ||
        !model.value("end_of_word_suffix", json()).is_null()) {
      return Unimplemented(
          name, ": BPE continuing_subword_prefix / end_of_word_suffix are not supported");
    }
  }
  const json& vocab = model.value("vocab", json::object());
  if (!vocab.is_object() || vocab.empty())
    return InvalidArgument(name, ": model.vocab is missing or empty");
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0) {
      return InvalidArgument(name, ": model.vocab[\"", it.key(), "\"] is not a token id");
    }
    max_id = std::max<int64_t>(max_id, it.value().get<int64_t>());
  }
  const json& added = j.value("added_tokens", json::array());
  for (const json& a : added) max_id = std::max<int64_t>(max_id, a.value("id", -1));
  if (max_id >= INT32_MAX) return InvalidArgument(name, ": token id ", max_id, " is too large");
  m->SetVocabSize(static_cast<size_t>(max_id + 1));
  m->in_model_vocab.assign(m->pieces.size(), false);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    m->pieces[it.value().get<int64_t>()] = it.key();
    m->in_model_vocab[it.value().get<int64_t>()] = true;
  }
  for (const json& a : added) {
    if (!a.contains("id") || !a.contains("content") || !a["content"].is_string()) {
      return InvalidArgument(name, ": added_tokens entries need an id and a content string");
    }
    AddedToken t;
    t.id = a["id"].get<int32_t>();
    t.content = a["content"].get<std::string>();
    t.special = a.value("special", false);
    t.lstrip = a.value("lstrip", false);
    t.rstrip = a.value("rstrip", false);
    t.single_word = a.value("single_word", false);
    m->pieces[t.id] = t.content;
    m->attrs[t.id] = t.special ? TokenAttr::kControl : TokenAttr::kUserDefined;
    if (!t.content.empty()) m->added.push_back(std::move(t));
  }
  m->byte_fallback = model.value("byte_fallback", false);
  m->ignore_merges = model.value("ignore_merges", false);
  m->fuse_unk = model.value("fuse_unk", false);

  KILN_RETURN_IF_ERROR(ParseNormalizer(j.value("normalizer", json()), m.get(), name));
  bool byte_level = false;
  KILN_RETURN_IF_ERROR(
      ParsePreTokenizer(j.value("pre_tokenizer", json()), m.get(), name, &byte_level));
  const json& decoder = j.value("decoder", json());
  if (wordpiece) {
    KILN_RETURN_IF_ERROR(ParseWordPieceDecoder(decoder, m.get(), name));
  } else {
    if (decoder.is_object() && decoder.value("type", "") == "ByteLevel") byte_level = true;
    m->kind = byte_level ? TokenizerKind::kByteLevelBpe : TokenizerKind::kSentencePieceBpe;
    if (!byte_level) ParseDecoder(decoder, m.get());
  }
  if (m->byte_fallback) {
    for (int32_t i = 0; i < m->size(); ++i) {
      const std::string& p = m->pieces[i];
      if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' &&
          m->attrs[i] == TokenAttr::kNormal) {
        m->attrs[i] = TokenAttr::kByte;
      }
    }
  }
  m->BuildIndexes();
  const json& merges = model.value("merges", json::array());
  m->merges.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const json& e = merges[r];
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) {
        return InvalidArgument(name, ": model.merges[", r, "] = \"", s, "\" is not \"left right\"");
      }
      KILN_RETURN_IF_ERROR(m->AddMerge(std::string_view(s).substr(0, sp),
                                       std::string_view(s).substr(sp + 1),
                                       static_cast<int32_t>(r)));
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      KILN_RETURN_IF_ERROR(
          m->AddMerge(e[0].get<std::string>(), e[1].get<std::string>(), static_cast<int32_t>(r)));
    } else {
      return InvalidArgument(name, ": model.merges[", r,
                             "] must be \"left right\" or [left, right]");
    }
  }
  if (std::string unk =
          model.value("unk_token", json()).is_string() ? model["unk_token"].get<std::string>() : "";
      !unk.empty()) {
    m->unk = m->Lookup(unk).value_or(-1);
  }
  const json& post_processor = j.value("post_processor", json());
  KILN_RETURN_IF_ERROR(ParsePostProcessor(post_processor, m.get(), name));
  // The pad id of the padding section (which Encode otherwise ignores).
  if (const json& padding = j.value("padding", json());
      padding.is_object() && padding.value("pad_id", json()).is_number_integer()) {
    int64_t pad = padding["pad_id"].get<int64_t>();
    if (pad >= 0 && pad < m->size()) m->pad = static_cast<int32_t>(pad);
  }
  if (wordpiece) {
    KILN_RETURN_IF_ERROR(FinishWordPiece(post_processor.is_null(), config, m.get(), name));
  }

  if (config != nullptr) {
    auto id_of = [&](const std::optional<std::string>& s) -> int32_t {
      return s ? m->Lookup(*s).value_or(-1) : -1;
    };
    if (config->bos_token) m->bos = id_of(config->bos_token);
    if (config->eos_token) m->eos = id_of(config->eos_token);
    if (config->unk_token) m->unk = id_of(config->unk_token);
    if (config->pad_token) m->pad = id_of(config->pad_token);
    // transformers rebuilds the post-processor from these flags when they are given.
    if (config->add_bos_token.has_value()) {
      m->prefix_ids.clear();
      if (*config->add_bos_token && m->bos >= 0) m->prefix_ids.push_back(m->bos);
    }
    if (config->add_eos_token.has_value()) {
      m->suffix_ids.clear();
      if (*config->add_eos_token && m->eos >= 0) m->suffix_ids.push_back(m->eos);
    }
  }
  if (m->bos < 0 && !m->prefix_ids.empty()) m->bos = m->prefix_ids[0];
  if (m->eos < 0 && !m->suffix_ids.empty()) m->eos = m->suffix_ids.back();
  CollectEog(m.get(), {});
  return m;
}
}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromHfFolder(const HfFolder& folder) {
  if (folder.tokenizer_json_path.empty()) {
    return NotFound(folder.dir, ": no tokenizer.json (only fast-tokenizer folders are supported)");
  }
  KILN_ASSIGN_OR_RETURN(auto file, MappedFile::Open(folder.tokenizer_json_path));
  return FromHfJson(file->bytes(), folder.tokenizer_config ? &*folder.tokenizer_config : nullptr,
                    folder.tokenizer_json_path);
}

}  // namespace kiln::models
