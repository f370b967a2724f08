#include "models/grammar/grammar.h"

#include <absl/strings/str_cat.h>
#include <absl/strings/str_format.h>

#include <algorithm>
#include <map>

#include "engine/base/utf8.h"
#include "models/grammar/matcher.h"

namespace kiln::grammar {

namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;
constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// [lo, hi] minus the surrogates, which UTF-8 cannot encode.
void AddRangeNoSurrogates(uint32_t lo, uint32_t hi, Ranges* out) {
  if (lo <= 0xD7FF) out->push_back({lo, std::min<uint32_t>(hi, 0xD7FF)});
  if (hi >= 0xE000) out->push_back({std::max<uint32_t>(lo, 0xE000), hi});
}

// Splits the code points [lo, hi] (no surrogates) into byte-range sequences: each sequence is
// one range per byte, and together they match exactly the UTF-8 encodings of [lo, hi] (the
// construction of Russ Cox's utf8 range compiler and Rust's regex-syntax utf8 module).
void Utf8Sequences(uint32_t lo, uint32_t hi,
                   std::vector<std::vector<std::pair<uint8_t, uint8_t>>>* out) {
  for (const uint32_t max : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= max && max < hi) {
      Utf8Sequences(lo, max, out);
      Utf8Sequences(max + 1, hi, out);
      return;
    }
  }
  for (int i = 1; i < 4; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Utf8Sequences(lo, lo | m, out);
        Utf8Sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Utf8Sequences(lo, (hi & ~m) - 1, out);
        Utf8Sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  AppendUtf8(lo, &a);
  AppendUtf8(hi, &b);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (size_t i = 0; i < a.size(); ++i) {
    seq.push_back({static_cast<uint8_t>(a[i]), static_cast<uint8_t>(b[i])});
  }
  out->push_back(std::move(seq));
}

std::string ByteSetText(const ByteSet& s) {
  std::string out = "[";
  for (int b = 0; b < 256;) {
    if (!s.test(b)) {
      ++b;
      continue;
    }
    int e = b;
    while (e + 1 < 256 && s.test(e + 1)) ++e;
    auto one = [](int c) {
      return (c >= 0x20 && c < 0x7F && c != ']' && c != '\\' && c != '-')
                 ? std::string(1, static_cast<char>(c))
                 : absl::StrFormat("\\x%02x", c);
    };
    out += one(b);
    if (e > b) {
      out += '-';
      out += one(e);
    }
    b = e + 1;
  }
  return out + "]";
}

}  // namespace

// ---- GrammarBuilder ---------------------------------------------------------------------------

int32_t GrammarBuilder::Rule(std::string_view name) {
  const auto [it, inserted] =
      rule_index_.try_emplace(std::string(name), static_cast<int32_t>(rules_.size()));
  if (!inserted) return it->second;
  g_.rule_names_.emplace_back(name);
  rules_.emplace_back();
  defined_.push_back(0);
  return it->second;
}

int32_t GrammarBuilder::NewRule(std::string_view base) {
  const int32_t r = static_cast<int32_t>(rules_.size());
  g_.rule_names_.push_back(absl::StrCat(ToAbsl(base), "_", ++fresh_));
  rules_.emplace_back();
  defined_.push_back(1);  // defined by its caller, right after
  return r;
}

bool GrammarBuilder::defined(int32_t rule) const { return defined_[rule] != 0; }

bool GrammarBuilder::too_large() const {
  return elements_ > Grammar::kMaxElements ||
         static_cast<int64_t>(rules_.size()) > Grammar::kMaxRules;
}

void GrammarBuilder::AddAlternative(int32_t rule, std::vector<Element> sequence) {
  defined_[rule] = 1;
  elements_ += static_cast<int64_t>(sequence.size()) + 1;
  rules_[rule].push_back(std::move(sequence));
}

Element GrammarBuilder::Bytes(const ByteSet& set) {
  for (const auto& [s, i] : byte_set_index_) {
    if (s == set) return {Element::kBytes, i};
  }
  const int32_t i = static_cast<int32_t>(g_.byte_sets_.size());
  g_.byte_sets_.push_back(set);
  byte_set_index_.push_back({set, i});
  return {Element::kBytes, i};
}

Element GrammarBuilder::CodePoints(std::span<const std::pair<uint32_t, uint32_t>> ranges,
                                   std::string_view base) {
  Ranges clean;
  for (const auto& [lo, hi] : ranges) AddRangeNoSurrogates(lo, std::min(hi, kMaxCodePoint), &clean);
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
  for (const auto& [lo, hi] : clean) {
    if (lo <= hi) Utf8Sequences(lo, hi, &seqs);
  }
  // Single-byte sequences merge into one byte set; longer ones share leading byte sets where
  // they can't (the matcher handles alternatives; the sets stay small).
  ByteSet ascii;
  std::vector<std::vector<Element>> alts;
  for (const auto& seq : seqs) {
    if (seq.size() == 1) {
      for (int b = seq[0].first; b <= seq[0].second; ++b) ascii.set(b);
      continue;
    }
    std::vector<Element> alt;
    for (const auto& [a, b] : seq) {
      ByteSet s;
      for (int c = a; c <= b; ++c) s.set(c);
      alt.push_back(Bytes(s));
    }
    alts.push_back(std::move(alt));
  }
  if (alts.empty() && ascii.any()) return Bytes(ascii);
  const int32_t r = NewRule(base);
  if (ascii.any()) AddAlternative(r, {Bytes(ascii)});
  for (auto& alt : alts) AddAlternative(r, std::move(alt));
  if (!ascii.any() && alts.empty()) defined_[r] = 1;  // an empty class: a rule with no way through
  return {Element::kRule, r};
}

void GrammarBuilder::Literal(std::string_view bytes, std::vector<Element>* out) {
  for (const char c : bytes) {
    ByteSet s;
    s.set(static_cast<uint8_t>(c));
    out->push_back(Bytes(s));
  }
}

StatusOr<Grammar> GrammarBuilder::Build(std::string_view root) {
  const int32_t n = static_cast<int32_t>(rules_.size());
  int32_t root_id = -1;
  for (int32_t r = 0; r < n; ++r) {
    if (g_.rule_names_[r] == root) root_id = r;
  }
  if (root_id < 0 || !defined_[root_id]) {
    return InvalidArgument("grammar: the start rule `", root, "` is not defined");
  }
  for (int32_t r = 0; r < n; ++r) {
    if (!defined_[r]) {
      return InvalidArgument("grammar: rule `", g_.rule_names_[r], "` is used but never defined");
    }
  }
  if (too_large()) {
    return InvalidArgument("grammar: ", rules_.size(), " rules and ", elements_,
                           " elements after compilation; at most ", Grammar::kMaxRules, " and ",
                           Grammar::kMaxElements, " are allowed");
  }
  // Rules that derive some string (productive) and rules that derive the empty one (nullable),
  // each to its fixpoint with a worklist: an alternative counts down the rules it still waits for.
  auto fixpoint = [&](bool bytes_block) {
    std::vector<uint8_t> done(n, 0);
    std::vector<std::pair<int32_t, int32_t>> alts;  // (rule, rules still waited for)
    std::vector<std::vector<int32_t>> users(n);     // rule -> alternatives that mention it
    std::vector<int32_t> work;
    for (int32_t r = 0; r < n; ++r) {
      for (const auto& alt : rules_[r]) {
        const bool blocked =
            bytes_block && std::any_of(alt.begin(), alt.end(),
                                       [](const Element& e) { return e.kind == Element::kBytes; });
        if (blocked) continue;
        const int32_t a = static_cast<int32_t>(alts.size());
        int32_t waits = 0;
        for (const Element& e : alt) {
          if (e.kind != Element::kRule) continue;
          users[e.arg].push_back(a);
          ++waits;
        }
        alts.push_back({r, waits});
        if (waits == 0 && !done[r]) {
          done[r] = 1;
          work.push_back(r);
        }
      }
    }
    while (!work.empty()) {
      const int32_t r = work.back();
      work.pop_back();
      for (const int32_t a : users[r]) {
        if (--alts[a].second == 0 && !done[alts[a].first]) {
          done[alts[a].first] = 1;
          work.push_back(alts[a].first);
        }
      }
    }
    return done;
  };
  if (!fixpoint(/*bytes_block=*/false)[root_id]) {
    return InvalidArgument("grammar: the start rule `", root,
                           "` matches nothing (every way through it needs a rule that never ends, "
                           "or a character class with no characters)");
  }
  std::vector<uint8_t> nullable = fixpoint(/*bytes_block=*/true);
  // Left recursion: rule r can begin with rule s when s appears after only nullable rules.
  std::vector<std::vector<int32_t>> starts(n);
  for (int32_t r = 0; r < n; ++r) {
    for (const auto& alt : rules_[r]) {
      for (const Element& e : alt) {
        if (e.kind != Element::kRule) break;
        starts[r].push_back(e.arg);
        if (!nullable[e.arg]) break;
      }
    }
  }
  // A cycle in `starts`, found depth-first without recursion (grammars may chain many rules).
  std::vector<uint8_t> color(n, 0);              // 0 new, 1 on the path, 2 done
  std::vector<std::pair<int32_t, size_t>> path;  // (rule, next edge to follow)
  for (int32_t r0 = 0; r0 < n; ++r0) {
    if (color[r0] != 0) continue;
    path.push_back({r0, 0});
    color[r0] = 1;
    while (!path.empty()) {
      auto& [r, next] = path.back();
      if (next == starts[r].size()) {
        color[r] = 2;
        path.pop_back();
        continue;
      }
      const int32_t s2 = starts[r][next++];
      if (color[s2] == 0) {
        color[s2] = 1;
        path.push_back({s2, 0});
      } else if (color[s2] == 1) {
        std::string cycle;
        bool on = false;
        for (const auto& [q, unused] : path) {
          on = on || q == s2;
          if (on) absl::StrAppend(&cycle, "`", g_.rule_names_[q], "` -> ");
        }
        return InvalidArgument("grammar: left recursion: ", cycle, "`", g_.rule_names_[s2],
                               "` without consuming input (rewrite it right-recursively, or, for "
                               "a repetition, make sure what repeats cannot be empty)");
      }
    }
  }
  // Flatten.
  g_.elements_.clear();
  g_.rule_alternatives_.assign(n, {});
  for (int32_t r = 0; r < n; ++r) {
    for (const auto& alt : rules_[r]) {
      g_.rule_alternatives_[r].push_back(static_cast<int32_t>(g_.elements_.size()));
      g_.elements_.insert(g_.elements_.end(), alt.begin(), alt.end());
      g_.elements_.push_back({Element::kEnd, r});
    }
  }
  g_.nullable_ = std::move(nullable);
  g_.root_ = root_id;
  return g_;
}

// ---- GBNF -------------------------------------------------------------------------------------

namespace {

class GbnfParser {
 public:
  explicit GbnfParser(std::string_view text) : text_(text) {}

  StatusOr<Grammar> Parse(std::string_view root) {
    SkipSpace(true);
    while (pos_ < text_.size()) {
      KILN_RETURN_IF_ERROR(ParseRule());
      SkipSpace(true);
    }
    return b_.Build(root);
  }

 private:
  Status Error(std::string_view what) const {
    int line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return InvalidArgument("grammar:", line, ":", col, ": ", what);
  }
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }

  // Spaces, tabs and comments; newlines too when `newlines` (inside groups, between rules).
  void SkipSpace(bool newlines) {
    while (!AtEnd()) {
      const char c = text_[pos_];
      if (c == ' ' || c == '\t' || ((c == '\r' || c == '\n') && newlines)) {
        ++pos_;
      } else if (c == '#') {
        while (!AtEnd() && text_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }
  static bool IsNameChar(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
  }
  std::string_view ParseName() {
    const size_t start = pos_;
    while (!AtEnd() && IsNameChar(text_[pos_])) ++pos_;
    return text_.substr(start, pos_ - start);
  }

  Status ParseRule() {
    const std::string_view name = ParseName();
    if (name.empty()) return Error("expected a rule name");
    SkipSpace(false);
    if (text_.substr(pos_, 3) != "::=") {
      return Error(absl::StrCat("expected `::=` after the rule name `", ToAbsl(name), "`"));
    }
    pos_ += 3;
    SkipSpace(true);
    const int32_t r = b_.Rule(name);
    if (b_.defined(r)) return Error(absl::StrCat("rule `", ToAbsl(name), "` is defined twice"));
    base_ = std::string(name);
    KILN_RETURN_IF_ERROR(ParseAlternatives(r, false));
    if (!AtEnd() && Peek() != '\n' && Peek() != '\r') {
      return Error(
          absl::StrCat("unexpected `", std::string(1, Peek()), "` in rule `", ToAbsl(name), "`"));
    }
    return OkStatus();
  }

  Status ParseAlternatives(int32_t rule, bool nested) {
    while (true) {
      std::vector<Element> seq;
      KILN_RETURN_IF_ERROR(ParseSequence(nested, &seq));
      b_.AddAlternative(rule, std::move(seq));
      if (Peek() != '|') return OkStatus();
      ++pos_;
      SkipSpace(true);
    }
  }

  Status ParseSequence(bool nested, std::vector<Element>* seq) {
    while (!AtEnd()) {
      const char c = Peek();
      const size_t last_start = seq->size();
      if (c == '"') {
        ++pos_;
        while (Peek() != '"') {
          if (AtEnd() || Peek() == '\n') return Error("unterminated string literal");
          KILN_ASSIGN_OR_RETURN(const uint32_t cp, ParseChar());
          std::string utf8;
          AppendUtf8(cp, &utf8);
          b_.Literal(utf8, seq);
        }
        ++pos_;
      } else if (c == '[') {
        ++pos_;
        const bool negate = Peek() == '^';
        if (negate) ++pos_;
        Ranges ranges;
        while (Peek() != ']') {
          if (AtEnd()) return Error("unterminated character class");
          KILN_ASSIGN_OR_RETURN(const uint32_t lo, ParseChar());
          uint32_t hi = lo;
          if (Peek() == '-' && pos_ + 1 < text_.size() && text_[pos_ + 1] != ']') {
            ++pos_;
            KILN_ASSIGN_OR_RETURN(hi, ParseChar());
            if (hi < lo) return Error("character range out of order");
          }
          ranges.push_back({lo, hi});
        }
        ++pos_;
        if (negate) ranges = Complement(ranges);
        seq->push_back(b_.CodePoints(ranges, base_));
      } else if (c == '.') {
        ++pos_;
        const Ranges all = {{0, kMaxCodePoint}};
        seq->push_back(b_.CodePoints(all, base_));
      } else if (IsNameChar(c)) {
        const std::string_view name = ParseName();
        seq->push_back({Element::kRule, b_.Rule(name)});
      } else if (c == '(') {
        if (++depth_ > Grammar::kMaxNesting) {
          return Error(absl::StrCat("groups nested more than ", Grammar::kMaxNesting, " deep"));
        }
        ++pos_;
        SkipSpace(true);
        const int32_t sub = b_.NewRule(base_);
        KILN_RETURN_IF_ERROR(ParseAlternatives(sub, true));
        if (Peek() != ')') return Error("expected `)`");
        ++pos_;
        --depth_;
        seq->push_back({Element::kRule, sub});
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        return Error(absl::StrCat("`", std::string(1, c), "` with nothing before it to repeat"));
      } else {
        break;
      }
      SkipSpace(nested);
      // Postfix operators apply to the last symbol (a whole literal, class, name or group).
      while (Peek() == '*' || Peek() == '+' || Peek() == '?' || Peek() == '{') {
        KILN_RETURN_IF_ERROR(ParseRepetition(last_start, seq));
        SkipSpace(nested);
      }
      if (b_.too_large() || seq->size() > static_cast<size_t>(Grammar::kMaxElements)) {
        return Error(absl::StrCat("the grammar is too large: at most ", Grammar::kMaxElements,
                                  " elements and ", Grammar::kMaxRules,
                                  " rules once repetitions are expanded"));
      }
    }
    return OkStatus();
  }

  // Rewrites seq[last_start..] as a repetition (x*, x+, x?, x{m}, x{m,}, x{m,n}).
  Status ParseRepetition(size_t last_start, std::vector<Element>* seq) {
    int64_t min = 0, max = -1;  // -1: unbounded
    const char c = Peek();
    ++pos_;
    if (c == '+') {
      min = 1;
    } else if (c == '?') {
      max = 1;
    } else if (c == '{') {
      SkipSpace(true);
      KILN_ASSIGN_OR_RETURN(min, ParseInt());
      SkipSpace(true);
      if (Peek() == ',') {
        ++pos_;
        SkipSpace(true);
        if (Peek() != '}') {
          KILN_ASSIGN_OR_RETURN(max, ParseInt());
          SkipSpace(true);
        }
      } else {
        max = min;
      }
      if (Peek() != '}') return Error("expected `}` to close the repetition");
      ++pos_;
      if (max >= 0 && max < min) return Error("repetition {m,n} with n < m");
      if (min > kMaxRepeat || max > kMaxRepeat) {
        return Error(absl::StrCat("repetition counts above ", kMaxRepeat, " are not supported"));
      }
    }
    std::vector<Element> x(seq->begin() + static_cast<ptrdiff_t>(last_start), seq->end());
    seq->resize(last_start);
    if (x.empty()) return OkStatus();  // "" repeated is still
    // The repeated symbol as one element.
    Element item = x.size() == 1 ? x[0] : Element{};
    if (x.size() != 1) {
      const int32_t w = b_.NewRule(base_);
      b_.AddAlternative(w, x);
      item = {Element::kRule, w};
    }
    for (int64_t i = 0; i < min; ++i) seq->push_back(item);
    if (max < 0) {
      // star ::= item star | ε   (right recursion: the matcher's tail call keeps it flat)
      const int32_t star = b_.NewRule(base_);
      b_.AddAlternative(star, {item, {Element::kRule, star}});
      b_.AddAlternative(star, {});
      seq->push_back({Element::kRule, star});
    } else if (max > min) {
      // opt_k ::= item opt_{k-1} | ε, nested so that at most max - min more are taken.
      int32_t inner = -1;
      for (int64_t k = 0; k < max - min; ++k) {
        const int32_t opt = b_.NewRule(base_);
        std::vector<Element> alt = {item};
        if (inner >= 0) alt.push_back({Element::kRule, inner});
        b_.AddAlternative(opt, std::move(alt));
        b_.AddAlternative(opt, {});
        inner = opt;
      }
      seq->push_back({Element::kRule, inner});
    }
    return OkStatus();
  }

  StatusOr<int64_t> ParseInt() {
    const size_t start = pos_;
    int64_t v = 0;
    while (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
      v = v * 10 + (Peek() - '0');
      if (v > 1'000'000) return Error("repetition count too large");
      ++pos_;
    }
    if (pos_ == start) return Error("expected a number in the repetition");
    return v;
  }

  // One character of a literal or class: an escape or one UTF-8 encoded code point.
  StatusOr<uint32_t> ParseChar() {
    const uint8_t c = static_cast<uint8_t>(text_[pos_]);
    if (c == '\\') {
      ++pos_;
      if (AtEnd()) return Error("escape at the end of the grammar");
      const char e = text_[pos_++];
      switch (e) {
        case 'n':
          return '\n';
        case 'r':
          return '\r';
        case 't':
          return '\t';
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^':
        case '/':
          return static_cast<uint32_t>(e);
        case 'x':
          return ParseHex(2);
        case 'u':
          return ParseHex(4);
        case 'U':
          return ParseHex(8);
        default:
          --pos_;
          return Error(absl::StrCat("unknown escape `\\", std::string(1, e), "`"));
      }
    }
    // UTF-8 decode.
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || pos_ + n > text_.size()) return Error("invalid UTF-8 in the grammar");
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (int i = 1; i < n; ++i) {
      const uint8_t d = static_cast<uint8_t>(text_[pos_ + i]);
      if ((d & 0xC0) != 0x80) return Error("invalid UTF-8 in the grammar");
      cp = (cp << 6) | (d & 0x3F);
    }
    pos_ += n;
    return cp;
  }

  StatusOr<uint32_t> ParseHex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char h = Peek();
      int d = h >= '0' && h <= '9'   ? h - '0'
              : h >= 'a' && h <= 'f' ? h - 'a' + 10
              : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                     : -1;
      if (d < 0) return Error(absl::StrCat("expected ", digits, " hex digits in the escape"));
      v = v * 16 + static_cast<uint32_t>(d);
      ++pos_;
    }
    if (v > kMaxCodePoint) return Error("code point above U+10FFFF");
    return v;
  }

  static Ranges Complement(Ranges r) {
    std::sort(r.begin(), r.end());
    Ranges out;
    uint32_t next = 0;
    for (const auto& [lo, hi] : r) {
      if (lo > next) out.push_back({next, lo - 1});
      next = std::max(next, hi + 1);
    }
    if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
    return out;
  }

  static constexpr int64_t kMaxRepeat = 10'000;
  std::string_view text_;
  size_t pos_ = 0;
  int depth_ = 0;  // groups open
  std::string base_;
  GrammarBuilder b_;
};

}  // namespace

StatusOr<Grammar> Grammar::ParseGbnf(std::string_view text, std::string_view root) {
  return GbnfParser(text).Parse(root);
}

bool Grammar::Matches(std::string_view text) const {
  ByteMatcher m(*this);
  for (const char c : text) {
    if (!m.Advance(static_cast<uint8_t>(c))) return false;
  }
  return m.accepting();
}

std::string Grammar::ToString() const {
  std::string out;
  for (int32_t r = 0; r < num_rules(); ++r) {
    absl::StrAppend(&out, rule_names_[r], " ::=");
    bool first = true;
    for (const int32_t start : rule_alternatives_[r]) {
      absl::StrAppend(&out, first ? "" : " |");
      first = false;
      for (int32_t p = start; elements_[p].kind != Element::kEnd; ++p) {
        const Element& e = elements_[p];
        absl::StrAppend(
            &out, " ",
            e.kind == Element::kRule ? rule_names_[e.arg] : ByteSetText(byte_sets_[e.arg]));
      }
    }
    out += "\n";
  }
  return out;
}

}  // namespace kiln::grammar
