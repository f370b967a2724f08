#include "models/grammar/regex_gbnf.h"

#include <absl/strings/str_format.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/base/utf8.h"

namespace kiln::grammar {

namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr int kMaxGroupDepth = 200;  // bounds the recursion of the parser and the rewrites

// Decodes the code point at s[i] into *cp, *len; false if it is not valid UTF-8 (overlong
// forms and surrogates included).
bool DecodeOne(std::string_view s, size_t i, uint32_t* cp, int* len) {
  const uint8_t c = static_cast<uint8_t>(s[i]);
  const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return false;
  uint32_t v = n == 1 ? c : c & (0x7Fu >> n);
  for (int k = 1; k < n; ++k) {
    const uint8_t d = static_cast<uint8_t>(s[i + k]);
    if ((d & 0xC0) != 0x80) return false;
    v = (v << 6) | (d & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[n] || v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) return false;
  *cp = v;
  *len = n;
  return true;
}

bool DecodeUtf8(std::string_view s, std::u32string* out) {
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    int n = 0;
    if (!DecodeOne(s, i, &cp, &n)) return false;
    out->push_back(cp);
    i += n;
  }
  return true;
}

// A set of code points: sorted, disjoint, non-adjacent ranges.
class CharSet {
 public:
  using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

  static CharSet Of(uint32_t lo, uint32_t hi) {
    CharSet s;
    s.Add(lo, hi);
    return s;
  }
  static CharSet All() { return Of(0, kMaxCodePoint); }

  // The union of `ranges` (any order, overlaps allowed): sorted once, so linearithmic.
  static CharSet FromRanges(Ranges ranges) {
    CharSet s;
    s.r_ = std::move(ranges);
    s.Canonicalize();
    return s;
  }

  void Add(uint32_t lo, uint32_t hi) {
    r_.push_back({lo, hi});
    Canonicalize();
  }
  void Add(const CharSet& o) {
    r_.insert(r_.end(), o.r_.begin(), o.r_.end());
    Canonicalize();
  }
  CharSet Complement() const {
    CharSet out;
    uint32_t next = 0;
    for (const auto& [lo, hi] : r_) {
      if (lo > next) out.r_.push_back({next, lo - 1});
      next = hi + 1;
    }
    if (next <= kMaxCodePoint) out.r_.push_back({next, kMaxCodePoint});
    return out;
  }
  CharSet Intersect(const CharSet& o) const {
    CharSet u = Complement();
    u.Add(o.Complement());
    return u.Complement();
  }
  bool Contains(uint32_t c) const {
    for (const auto& [lo, hi] : r_) {
      if (lo <= c && c <= hi) return true;
    }
    return false;
  }
  bool empty() const { return r_.empty(); }
  bool single() const { return r_.size() == 1 && r_[0].first == r_[0].second; }
  const Ranges& ranges() const { return r_; }

 private:
  void Canonicalize() {
    std::sort(r_.begin(), r_.end());
    Ranges merged;
    for (const auto& [a, b] : r_) {
      if (!merged.empty() && a <= merged.back().second + 1) {
        merged.back().second = std::max(merged.back().second, b);
      } else {
        merged.push_back({a, b});
      }
    }
    r_ = std::move(merged);
  }

  Ranges r_;
};

CharSet Digits() { return CharSet::Of('0', '9'); }
CharSet WordChars() {
  CharSet s = Digits();
  s.Add('A', 'Z');
  s.Add('_', '_');
  s.Add('a', 'z');
  return s;
}
// ECMAScript's \s: WhiteSpace and LineTerminator.
CharSet Spaces() {
  CharSet s = CharSet::Of('\t', '\r');
  for (const uint32_t c :
       {0x20u, 0xA0u, 0x1680u, 0x2028u, 0x2029u, 0x202Fu, 0x205Fu, 0x3000u, 0xFEFFu}) {
    s.Add(c, c);
  }
  s.Add(0x2000, 0x200A);
  return s;
}
// What JSON writes as itself inside a string (the controls, as Kiln's `char` rule, include 0x7F).
CharSet JsonPlain() {
  CharSet s = CharSet::Of(0, 0x1F);
  s.Add('"', '"');
  s.Add('\\', '\\');
  s.Add(0x7F, 0x7F);
  return s.Complement();
}

// ---- Regex syntax tree ------------------------------------------------------------------------

// A node of the syntax tree. The rewrites below share subtrees, making it a DAG; the nodes are
// owned by one Nodes arena and point to their kids.
struct Node {
  enum Kind { kChars, kSeq, kAlt, kRepeat };
  Kind kind = kSeq;
  CharSet chars;                  // kChars: never empty
  std::vector<const Node*> kids;  // kSeq, kAlt; kRepeat: one
  int min = 0, max = 0;           // kRepeat; max < 0: unbounded
  bool nullable = false;          // matches the empty string
};

// The nodes of one translation, counted against kMaxRegexNodes.
class Nodes {
 public:
  const Node* Chars(CharSet s) { return Make({Node::kChars, std::move(s), {}, 0, 0, false}); }
  const Node* Seq(std::vector<const Node*> kids) {
    const bool nullable =
        std::all_of(kids.begin(), kids.end(), [](const Node* k) { return k->nullable; });
    return Make({Node::kSeq, {}, std::move(kids), 0, 0, nullable});
  }
  const Node* Alt(std::vector<const Node*> kids) {
    const bool nullable =
        std::any_of(kids.begin(), kids.end(), [](const Node* k) { return k->nullable; });
    return Make({Node::kAlt, {}, std::move(kids), 0, 0, nullable});
  }
  const Node* Repeat(const Node* kid, int min, int max) {
    const bool nullable = min == 0 || max == 0 || kid->nullable;
    return Make({Node::kRepeat, {}, {kid}, min, max, nullable});
  }
  // One alternative as itself. REQUIRES: !alts.empty().
  const Node* AltOf(std::vector<const Node*> alts) {
    return alts.size() == 1 ? alts[0] : Alt(std::move(alts));
  }
  bool over_budget() const { return nodes_.size() > static_cast<size_t>(kMaxRegexNodes); }

 private:
  const Node* Make(Node n) {
    nodes_.push_back(std::make_unique<const Node>(std::move(n)));
    return nodes_.back().get();
  }
  std::vector<std::unique_ptr<const Node>> nodes_;
};

bool IsHex(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}
uint32_t HexValue(char32_t c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

class RegexParser {
 public:
  RegexParser(std::u32string s, bool anchored, Nodes* nodes)
      : s_(std::move(s)), anchored_(anchored), nodes_(nodes) {}

  StatusOr<const Node*> Parse() {
    KILN_ASSIGN_OR_RETURN(const Node* n, ParseAlternatives(0));
    if (!AtEnd()) return Error(pos_, "unmatched `)`");
    return n;
  }

 private:
  // A class escape or class member: one code point, or a set (\d, \w, ...).
  struct ClassAtom {
    CharSet set;
    bool single = true;
  };

  static Status Error(size_t pos, std::string_view what) {
    return InvalidArgument("regex: ", what, " at position ", pos);
  }
  static Status Unsupported(size_t pos, std::string_view what) {
    return InvalidArgument("regex: ", what, " at position ", pos, " is not supported");
  }
  bool AtEnd() const { return pos_ >= s_.size(); }
  char32_t Peek(size_t ahead = 0) const {
    return pos_ + ahead < s_.size() ? s_[pos_ + ahead] : U'\0';
  }

  StatusOr<const Node*> ParseAlternatives(int depth) {
    std::vector<const Node*> alts;
    while (true) {
      KILN_ASSIGN_OR_RETURN(const Node* seq, ParseSequence(depth));
      alts.push_back(seq);
      if (Peek() != '|' || AtEnd()) break;
      ++pos_;
    }
    return alts.size() == 1 ? alts[0] : nodes_->Alt(std::move(alts));
  }

  StatusOr<const Node*> ParseSequence(int depth) {
    std::vector<const Node*> items;
    bool start_anchor = false, end_anchor = false;
    if (depth == 0 && !AtEnd() && Peek() == '^') {
      ++pos_;
      start_anchor = true;
    }
    while (!AtEnd()) {
      const char32_t c = Peek();
      if (c == '|') break;
      if (c == ')') {
        if (depth == 0) return Error(pos_, "unmatched `)`");
        break;
      }
      if (c == '^') return Unsupported(pos_, "`^` other than at the start of the pattern");
      if (c == '$') {
        if (depth == 0 && (pos_ + 1 == s_.size() || s_[pos_ + 1] == '|')) {
          ++pos_;
          end_anchor = true;
          break;
        }
        return Unsupported(pos_, "`$` other than at the end of the pattern");
      }
      KILN_ASSIGN_OR_RETURN(const Node* atom, ParseAtom(depth));
      KILN_ASSIGN_OR_RETURN(atom, ParseQuantifier(atom));
      items.push_back(atom);
    }
    if (depth == 0 && !anchored_) {
      // Search semantics: what is not anchored may have anything around it.
      auto any = [&] { return nodes_->Repeat(nodes_->Chars(CharSet::All()), 0, -1); };
      if (!start_anchor) items.insert(items.begin(), any());
      if (!end_anchor) items.push_back(any());
    }
    return items.size() == 1 ? items[0] : nodes_->Seq(std::move(items));
  }

  // {m}, {m,}, {m,n} at pos_: consumes it and sets min/max when it is one; else consumes nothing
  // (a literal `{`, as in ECMAScript).
  StatusOr<bool> ParseBraces(int* min, int* max) {
    const size_t start = pos_;
    size_t i = pos_ + 1;
    auto number = [&](int64_t* v) {
      const size_t from = i;
      *v = 0;
      while (i < s_.size() && s_[i] >= '0' && s_[i] <= '9') {
        *v = std::min<int64_t>(*v * 10 + (s_[i] - '0'), int64_t{1} << 40);
        ++i;
      }
      return i > from;
    };
    int64_t lo = 0, hi = 0;
    if (!number(&lo)) return false;
    hi = lo;
    if (i < s_.size() && s_[i] == ',') {
      ++i;
      if (!number(&hi)) hi = -1;
    }
    if (i >= s_.size() || s_[i] != '}') return false;
    if (lo > kMaxRegexRepeat || hi > kMaxRegexRepeat) {
      return Unsupported(start, absl::StrFormat("a repetition count above %d", kMaxRegexRepeat));
    }
    if (hi >= 0 && hi < lo) return Error(start, "repetition {m,n} with n < m");
    pos_ = i + 1;
    *min = static_cast<int>(lo);
    *max = static_cast<int>(hi);
    return true;
  }

  StatusOr<const Node*> ParseQuantifier(const Node* atom) {
    int min = 0, max = 0;
    const char32_t c = Peek();
    if (AtEnd()) return atom;
    if (c == '*' || c == '+' || c == '?') {
      ++pos_;
      min = c == '+' ? 1 : 0;
      max = c == '?' ? 1 : -1;
    } else if (c == '{') {
      KILN_ASSIGN_OR_RETURN(const bool is_quantifier, ParseBraces(&min, &max));
      if (!is_quantifier) return atom;
    } else {
      return atom;
    }
    if (!AtEnd() && Peek() == '?') {
      ++pos_;  // lazy: the same language
    } else if (!AtEnd() && Peek() == '+') {
      return Unsupported(pos_, "a possessive quantifier `+`");
    }
    if (!AtEnd() && (Peek() == '*' || Peek() == '+' || Peek() == '?')) {
      return Error(pos_, "a quantifier with nothing to repeat");
    }
    if (!AtEnd() && Peek() == '{') {
      const size_t save = pos_;
      int m = 0, n = 0;
      KILN_ASSIGN_OR_RETURN(const bool again, ParseBraces(&m, &n));
      if (again) return Error(save, "a quantifier with nothing to repeat");
    }
    return nodes_->Repeat(atom, min, max);
  }

  StatusOr<const Node*> ParseAtom(int depth) {
    const char32_t c = Peek();
    switch (c) {
      case '(':
        return ParseGroup(depth);
      case '[': {
        KILN_ASSIGN_OR_RETURN(CharSet set, ParseClass());
        return nodes_->Chars(std::move(set));
      }
      case '.': {
        ++pos_;
        CharSet any = CharSet::Of('\n', '\n').Complement();
        return nodes_->Chars(std::move(any));
      }
      case '\\': {
        KILN_ASSIGN_OR_RETURN(ClassAtom a, ParseEscape(false));
        return nodes_->Chars(std::move(a.set));
      }
      case '*':
      case '+':
      case '?':
        return Error(pos_, "a quantifier with nothing to repeat");
      case '{': {
        const size_t save = pos_;
        int m = 0, n = 0;
        KILN_ASSIGN_OR_RETURN(const bool is_quantifier, ParseBraces(&m, &n));
        if (is_quantifier) return Error(save, "a quantifier with nothing to repeat");
        break;
      }
      default:
        break;
    }
    ++pos_;
    return nodes_->Chars(CharSet::Of(c, c));
  }

  StatusOr<const Node*> ParseGroup(int depth) {
    const size_t start = pos_;
    if (depth >= kMaxGroupDepth) {
      return Unsupported(start, absl::StrFormat("groups nested deeper than %d", kMaxGroupDepth));
    }
    ++pos_;
    if (Peek() == '?') {
      const char32_t k = Peek(1), k2 = Peek(2);
      if (k == ':') {
        pos_ += 2;
      } else if (k == '=') {
        return Unsupported(start, "lookahead `(?=`");
      } else if (k == '!') {
        return Unsupported(start, "negative lookahead `(?!`");
      } else if (k == '<' && k2 == '=') {
        return Unsupported(start, "lookbehind `(?<=`");
      } else if (k == '<' && k2 == '!') {
        return Unsupported(start, "negative lookbehind `(?<!`");
      } else if (k == '<' || k == 'P' || k == '\'') {
        return Unsupported(start, "a named group");
      } else if (k == '>') {
        return Unsupported(start, "an atomic group `(?>`");
      } else {
        return Unsupported(start, "a group modifier `(?`");
      }
    }
    KILN_ASSIGN_OR_RETURN(const Node* inner, ParseAlternatives(depth + 1));
    if (AtEnd() || Peek() != ')') return Error(start, "unclosed `(`");
    ++pos_;
    return inner;
  }

  StatusOr<CharSet> ParseClass() {
    const size_t start = pos_;
    ++pos_;
    const bool negate = !AtEnd() && Peek() == '^';
    if (negate) ++pos_;
    if (!AtEnd() && Peek() == ']') {
      ++pos_;
      if (negate) return CharSet::All();  // [^]: ECMAScript's any character
      return Unsupported(start, "the empty class `[]` (it matches nothing)");
    }
    CharSet::Ranges ranges;  // united once at the end: linearithmic in the class's size
    while (true) {
      if (AtEnd()) return Error(start, "unclosed `[`");
      if (Peek() == ']') break;
      const size_t item = pos_;
      KILN_ASSIGN_OR_RETURN(ClassAtom lo, ParseClassAtom());
      if (!AtEnd() && Peek() == '-' && pos_ + 1 < s_.size() && s_[pos_ + 1] != ']') {
        ++pos_;
        KILN_ASSIGN_OR_RETURN(ClassAtom hi, ParseClassAtom());
        if (!lo.single || !hi.single) {
          return Unsupported(item, "a range with a class escape (like [\\d-z])");
        }
        const uint32_t a = lo.set.ranges()[0].first, b = hi.set.ranges()[0].first;
        if (b < a) return Error(item, "a class range out of order");
        ranges.push_back({a, b});
      } else {
        ranges.insert(ranges.end(), lo.set.ranges().begin(), lo.set.ranges().end());
      }
    }
    ++pos_;
    CharSet set = CharSet::FromRanges(std::move(ranges));
    if (negate) set = set.Complement();
    if (set.empty()) return Unsupported(start, "a class that matches no character");
    return set;
  }

  StatusOr<ClassAtom> ParseClassAtom() {
    if (Peek() == '\\') return ParseEscape(true);
    const uint32_t c = Peek();
    ++pos_;
    return ClassAtom{CharSet::Of(c, c), true};
  }

  // \x, \u: `digits` hex digits at pos_ (consumed), or nullopt.
  std::optional<uint32_t> Hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (!IsHex(Peek(i))) return std::nullopt;
      v = v * 16 + HexValue(Peek(i));
    }
    pos_ += digits;
    return v;
  }

  StatusOr<ClassAtom> ParseEscape(bool in_class) {
    const size_t start = pos_;
    ++pos_;
    if (AtEnd()) return Error(start, "`\\` at the end of the pattern");
    const char32_t c = Peek();
    ++pos_;
    auto one = [](uint32_t cp) { return ClassAtom{CharSet::Of(cp, cp), true}; };
    auto set = [](CharSet s) { return ClassAtom{std::move(s), false}; };
    switch (c) {
      case 'd':
        return set(Digits());
      case 'D':
        return set(Digits().Complement());
      case 'w':
        return set(WordChars());
      case 'W':
        return set(WordChars().Complement());
      case 's':
        return set(Spaces());
      case 'S':
        return set(Spaces().Complement());
      case 'n':
        return one('\n');
      case 't':
        return one('\t');
      case 'r':
        return one('\r');
      case 'f':
        return one('\f');
      case 'v':
        return one('\v');
      case '0':
        if (Peek() >= '0' && Peek() <= '9' && !AtEnd()) {
          return Unsupported(start, "an octal escape");
        }
        return one(0);
      case 'b':
        if (in_class) return one('\b');
        return Unsupported(start, "the word boundary `\\b`");
      case 'B':
        return Unsupported(start, "`\\B`");
      case 'k':
        return Unsupported(start, "a named backreference `\\k`");
      case 'p':
      case 'P':
        return Unsupported(start, "a Unicode property escape `\\p`");
      case 'c':
        return Unsupported(start, "a control escape `\\c`");
      case 'x': {
        const std::optional<uint32_t> v = Hex(2);
        if (!v) return Error(start, "`\\x` without two hex digits");
        return one(*v);
      }
      case 'u': {
        if (Peek() == '{') {
          ++pos_;
          uint32_t v = 0;
          int n = 0;
          while (!AtEnd() && IsHex(Peek()) && n < 7) {
            v = v * 16 + HexValue(Peek());
            ++pos_;
            ++n;
          }
          if (n == 0 || AtEnd() || Peek() != '}' || v > kMaxCodePoint) {
            return Error(start, "a malformed `\\u{...}` escape");
          }
          ++pos_;
          if (v >= 0xD800 && v <= 0xDFFF) return Unsupported(start, "a lone surrogate");
          return one(v);
        }
        std::optional<uint32_t> v = Hex(4);
        if (!v) return Error(start, "`\\u` without four hex digits");
        if (*v >= 0xD800 && *v <= 0xDBFF && Peek() == '\\' && Peek(1) == 'u') {
          const size_t save = pos_;
          pos_ += 2;
          const std::optional<uint32_t> low = Hex(4);
          if (low && *low >= 0xDC00 && *low <= 0xDFFF) {
            return one(0x10000 + ((*v - 0xD800) << 10) + (*low - 0xDC00));
          }
          pos_ = save;
        }
        if (*v >= 0xD800 && *v <= 0xDFFF) return Unsupported(start, "a lone surrogate");
        return one(*v);
      }
      default:
        break;
    }
    if (c >= '1' && c <= '9') return Unsupported(start, "a backreference");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      std::string e = "the escape `\\";
      AppendUtf8(c, &e);
      return Unsupported(start, e + "`");
    }
    return one(c);  // an escaped metacharacter or punctuation: itself
  }

  std::u32string s_;
  size_t pos_ = 0;
  bool anchored_;
  Nodes* nodes_;
};

// ---- Rewriting repetitions of what can be empty -------------------------------------------------
//
// Every repeated node is made non-nullable, since the grammar refuses rules that recurse without
// consuming input. The rewrites share subtrees instead of copying them, so the DAG they build is
// linear in the size of the tree; the emitter turns shared subtrees into helper rules.
// Each nullable node is descended into at most once: the results are non-nullable (NonEmpty) or
// repetitions (whose kids are not descended into again), so the work is linear too.

class Rewriter {
 public:
  explicit Rewriter(Nodes* nodes) : nodes_(nodes) {}

  // Makes every repeated node non-nullable: X{m,n} with X nullable is (X minus ε){0,n}, X{m,} is
  // (the parts of X)*, X{0,1} and X{1,1} are X.
  const Node* Normalize(const Node* n) {
    if (nodes_->over_budget()) return n;  // the caller reports it
    if (n->kind == Node::kChars) return n;
    std::vector<const Node*> kids;
    kids.reserve(n->kids.size());
    for (const Node* k : n->kids) kids.push_back(Normalize(k));
    if (n->kind == Node::kSeq) return kids == n->kids ? n : nodes_->Seq(std::move(kids));
    if (n->kind == Node::kAlt) return kids == n->kids ? n : nodes_->Alt(std::move(kids));
    const Node* kid = kids[0];
    if (n->max == 0) return Empty();
    if (!kid->nullable) return kid == n->kids[0] ? n : nodes_->Repeat(kid, n->min, n->max);
    if (n->max < 0) {
      // X nullable: X{m,} = X* = (P1 | P2 | ...)* for X's non-empty parts P (StarBasis).
      std::vector<const Node*> basis;
      StarBasis(kid, &basis);
      if (basis.empty()) return Empty();
      return nodes_->Repeat(nodes_->AltOf(std::move(basis)), 0, -1);
    }
    if (n->max == 1) return kid;  // X nullable: X? = X
    const Node* non_empty = NonEmpty(kid);
    if (non_empty == nullptr) return Empty();
    return nodes_->Repeat(non_empty, 0, n->max);
  }

 private:
  const Node* Empty() { return nodes_->Seq({}); }

  // The language of `n` (normalized) without the empty string; nullptr when nothing is left.
  const Node* NonEmpty(const Node* n) {
    if (!n->nullable || nodes_->over_budget()) return n;
    switch (n->kind) {
      case Node::kChars:
        return n;
      case Node::kSeq: {
        // All kids can be empty: a non-empty match has a first kid that matches non-empty, and
        // the kids after it as they are. Those suffixes are shared: suffix[i] = kid i, suffix[i+1].
        std::vector<const Node*> kids, firsts;
        for (const Node* k : n->kids) {
          if (const Node* first = NonEmpty(k)) {  // kids that only match "" are left out
            kids.push_back(k);
            firsts.push_back(first);
          }
        }
        if (kids.empty()) return nullptr;
        std::vector<const Node*> suffix(kids.size());
        suffix.back() = kids.back();
        for (size_t i = kids.size() - 1; i-- > 1;) {
          suffix[i] = nodes_->Seq({kids[i], suffix[i + 1]});
        }
        std::vector<const Node*> alts;
        for (size_t i = 0; i < kids.size(); ++i) {
          alts.push_back(i + 1 < kids.size() ? nodes_->Seq({firsts[i], suffix[i + 1]}) : firsts[i]);
        }
        return nodes_->AltOf(std::move(alts));
      }
      case Node::kAlt: {
        std::vector<const Node*> alts;
        for (const Node* k : n->kids) {
          if (const Node* x = NonEmpty(k)) alts.push_back(x);
        }
        if (alts.empty()) return nullptr;
        return nodes_->AltOf(std::move(alts));
      }
      case Node::kRepeat: {
        if (n->max == 0) return nullptr;
        const Node* kid = NonEmpty(n->kids[0]);
        if (kid == nullptr) return nullptr;
        return n->max == 1 ? kid : nodes_->Repeat(kid, 1, n->max);
      }
    }
    return nullptr;
  }

  // Non-nullable nodes P with (P1 | P2 | ...)* = n* for `n` (normalized, nullable): as each part
  // of n can be empty, (A B)* = (A | B)*, and (A{0,k})* = A*.
  void StarBasis(const Node* n, std::vector<const Node*>* out) {
    if (!n->nullable) {
      out->push_back(n);
      return;
    }
    switch (n->kind) {
      case Node::kChars:
        out->push_back(n);
        return;
      case Node::kSeq:
      case Node::kAlt:
        for (const Node* k : n->kids) StarBasis(k, out);
        return;
      case Node::kRepeat:
        if (n->max != 0) StarBasis(n->kids[0], out);
        return;
    }
  }

  Nodes* nodes_;
};

// ---- GBNF emission ------------------------------------------------------------------------------

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
}

// The end of the GBNF primary (literal, class, group, name, `.`) starting at s[i], or npos.
size_t PrimaryEnd(std::string_view s, size_t i) {
  if (i >= s.size()) return std::string_view::npos;
  const char c = s[i];
  if (c == '"' || c == '[') {
    const char close = c == '"' ? '"' : ']';
    for (++i; i < s.size(); ++i) {
      if (s[i] == '\\') {
        ++i;
      } else if (s[i] == close) {
        return i + 1;
      }
    }
    return std::string_view::npos;
  }
  if (c == '(') {
    int depth = 0;
    while (i < s.size()) {
      if (s[i] == '"' || s[i] == '[') {
        i = PrimaryEnd(s, i);
        if (i == std::string_view::npos) return i;
        continue;
      }
      if (s[i] == '(') ++depth;
      if (s[i] == ')' && --depth == 0) return i + 1;
      ++i;
    }
    return std::string_view::npos;
  }
  if (c == '.') return i + 1;
  const size_t start = i;
  while (i < s.size() && IsNameChar(s[i])) ++i;
  return i > start ? i : std::string_view::npos;
}

// `expr` as one primary, parenthesized unless it already is one.
std::string Primary(const std::string& expr) {
  return IsGbnfPrimary(expr) ? expr : "(" + expr + ")";
}

std::string QuantifierSuffix(int min, int max) {
  if (min == 0 && max == 1) return "?";
  if (min == 0 && max < 0) return "*";
  if (min == 1 && max < 0) return "+";
  if (min == max) return absl::StrFormat("{%d}", min);
  if (max < 0) return absl::StrFormat("{%d,}", min);
  return absl::StrFormat("{%d,%d}", min, max);
}

void AppendItem(const std::string& item, std::string* seq) {
  if (item.empty()) return;
  if (!seq->empty()) *seq += ' ';
  *seq += item;
}

std::string ClassText(const CharSet& set) {
  const CharSet complement = set.Complement();
  if (complement.empty()) return ".";
  const bool negate =
      complement.ranges().size() < set.ranges().size() ||
      (complement.ranges().size() == set.ranges().size() && set.Contains(kMaxCodePoint));
  std::string out = negate ? "[^" : "[";
  for (const auto& [lo, hi] : (negate ? complement : set).ranges()) {
    out += GbnfClassChar(lo);
    if (hi == lo + 1) out += GbnfClassChar(hi);
    if (hi > lo + 1) {
      out += '-';
      out += GbnfClassChar(hi);
    }
  }
  return out + "]";
}

// Writes the DAG as GBNF: the rule `rule`, then a helper rule per long subtree that is used more
// than once. Each node's text is built once, kids before parents, without recursion (the shared
// suffixes of NonEmpty chain as deep as the regex is long); the output is linear in the DAG.
class Emitter {
 public:
  Emitter(bool json, std::string_view rule,
          const std::function<std::string(std::string_view)>& new_rule)
      : json_(json), rule_(rule), new_rule_(new_rule) {}

  StatusOr<std::string> Run(const Node* root) {
    // How many times each node's text is used.
    texts_[root].uses = 1;
    std::vector<const Node*> todo = {root};
    while (!todo.empty()) {
      const Node* n = todo.back();
      todo.pop_back();
      for (const Node* k : n->kids) {
        if (texts_[k].uses++ == 0) todo.push_back(k);
      }
    }
    // Post-order: (node, its kids are done).
    std::vector<std::pair<const Node*, bool>> stack = {{root, false}};
    while (!stack.empty()) {
      const auto [n, kids_done] = stack.back();
      stack.pop_back();
      Text& t = texts_[n];
      if (t.done) continue;
      if (!kids_done) {
        stack.push_back({n, true});
        for (auto k = n->kids.rbegin(); k != n->kids.rend(); ++k) {
          if (!texts_[*k].done) stack.push_back({*k, false});
        }
        continue;
      }
      std::string text = EmitNode(*n);
      if (text.size() > kMaxRegexGbnfBytes) return TooComplex();
      if (t.uses > 1 && text.size() > kMaxInlineBytes) {
        std::string hint = StrCat(rule_, "-", ++helpers_);
        std::string name = new_rule_ ? new_rule_(hint) : std::move(hint);
        helper_rules_ += StrCat(name, " ::= ", text, "\n");
        if (helper_rules_.size() > kMaxRegexGbnfBytes) return TooComplex();
        text = std::move(name);
      }
      t.text = std::move(text);
      t.unread = t.uses;
      t.done = true;
    }
    const std::string body = Take(root);
    std::string out = StrCat(rule_, " ::= ", body.empty() ? "\"\"" : body, "\n", helper_rules_);
    if (out.size() > kMaxRegexGbnfBytes) return TooComplex();
    return out;
  }

 private:
  // Texts up to this long are repeated where used; longer ones used twice become helper rules.
  static constexpr size_t kMaxInlineBytes = 32;

  struct Text {
    int uses = 0;    // parents (and the rule, for the root)
    int unread = 0;  // uses not yet taken; the text is freed after the last
    bool done = false;
    std::string text;
  };

  static Status TooComplex() {
    return InvalidArgument("regex: the regex is too complex: its GBNF would exceed ",
                           kMaxRegexGbnfBytes, " bytes");
  }

  // The text of a node whose text is done, for one of its uses.
  std::string Take(const Node* n) {
    Text& t = texts_.at(n);
    if (--t.unread > 0) return t.text;
    return std::move(t.text);
  }

  // The text of `n`, from its kids' texts.
  std::string EmitNode(const Node& n) {
    switch (n.kind) {
      case Node::kChars:
        return EmitChars(n.chars);
      case Node::kSeq: {
        // Runs of characters with one spelling merge into one literal.
        std::string out, literal;
        for (const Node* k : n.kids) {
          std::string text = Take(k);
          if (k->kind == Node::kChars) {
            if (std::optional<std::string> l = Spelling(k->chars)) {
              literal += *l;
              continue;
            }
          }
          if (!literal.empty()) AppendItem(GbnfLiteral(literal), &out);
          literal.clear();
          AppendItem(text, &out);
        }
        if (!literal.empty()) AppendItem(GbnfLiteral(literal), &out);
        return out;
      }
      case Node::kAlt: {
        std::vector<std::string> alts;
        alts.reserve(n.kids.size());
        for (const Node* k : n.kids) alts.push_back(Take(k));
        return GbnfAlternatives(alts);
      }
      case Node::kRepeat: {
        const std::string kid = Take(n.kids[0]);
        return kid.empty() ? "" : GbnfRepeat(kid, n.min, n.max);
      }
    }
    return "";
  }

 private:
  // The one way the characters of `set` are written, when there is only one.
  std::optional<std::string> Spelling(const CharSet& set) const {
    if (!set.single()) return std::nullopt;
    const uint32_t c = set.ranges()[0].first;
    std::string out;
    if (!json_ || (JsonPlain().Contains(c) && c != '/')) {
      AppendUtf8(c, &out);
      return out;
    }
    if (c == '"') return "\\\"";
    if (c == '\\') return "\\\\";
    return std::nullopt;  // '/' and the controls have two spellings
  }

  std::string EmitChars(const CharSet& set) const {
    if (std::optional<std::string> l = Spelling(set)) return GbnfLiteral(*l);
    if (!json_) return ClassText(set);
    std::vector<std::string> alts;
    const CharSet plain = set.Intersect(JsonPlain());
    if (!plain.empty()) {
      std::string one;
      if (plain.single()) AppendUtf8(plain.ranges()[0].first, &one);
      alts.push_back(plain.single() ? GbnfLiteral(one) : ClassText(plain));
    }
    std::string escapes;  // the letters after `\`
    for (const auto& [c, e] : std::initializer_list<std::pair<uint32_t, char>>{{'"', '"'},
                                                                               {'\\', '\\'},
                                                                               {'/', '/'},
                                                                               {'\b', 'b'},
                                                                               {'\f', 'f'},
                                                                               {'\n', 'n'},
                                                                               {'\r', 'r'},
                                                                               {'\t', 't'}}) {
      if (set.Contains(c)) escapes += e;
    }
    if (escapes.size() == 1) alts.push_back(GbnfLiteral("\\" + escapes));
    if (escapes.size() > 1) {
      std::string cls = "[";
      for (const char e : escapes) cls += GbnfClassChar(static_cast<uint8_t>(e));
      alts.push_back(GbnfLiteral("\\") + " " + cls + "]");
    }
    // \u00XX for the controls: per high hex digit (0, 1, 7), the low digits in either case;
    // high digits with the same low digits share an alternative.
    std::vector<std::pair<std::string, std::string>> by_low;  // (low class, high digits)
    for (const uint32_t hi : {0u, 1u, 7u}) {
      // The low hex digits as class items: runs of 0-9, then a-f and A-F.
      std::string low;
      auto runs = [&](uint32_t from, uint32_t to, char first) {
        for (uint32_t d = from; d <= to;) {
          if (!set.Contains(hi * 16 + d) || (hi == 7 && d != 15)) {
            ++d;
            continue;
          }
          uint32_t e = d;
          while (e + 1 <= to && set.Contains(hi * 16 + e + 1)) ++e;
          low += static_cast<char>(first + d - from);
          if (e > d + 1) low += '-';
          if (e > d) low += static_cast<char>(first + e - from);
          d = e + 1;
        }
      };
      runs(0, 9, '0');
      const size_t digits = low.size();
      runs(10, 15, 'a');
      const std::string letters = low.substr(digits);
      for (const char c : letters) low += c == '-' ? '-' : static_cast<char>(c - 'a' + 'A');
      if (low.empty()) continue;
      auto it =
          std::find_if(by_low.begin(), by_low.end(), [&](const auto& p) { return p.first == low; });
      if (it == by_low.end()) {
        by_low.push_back({low, std::to_string(hi)});
      } else {
        it->second += std::to_string(hi);
      }
    }
    if (!by_low.empty()) {
      std::vector<std::string> hex;
      for (const auto& [low, high] : by_low) {
        hex.push_back((high.size() == 1 ? GbnfLiteral(high) : "[" + high + "]") + " [" + low + "]");
      }
      std::string u = GbnfLiteral("\\u00");
      AppendItem(hex.size() == 1 ? hex[0] : GbnfAlternatives(hex), &u);
      alts.push_back(u);
    }
    return GbnfAlternatives(alts);
  }

  const bool json_;
  const std::string rule_;
  const std::function<std::string(std::string_view)>& new_rule_;
  std::unordered_map<const Node*, Text> texts_;  // node-stable: references survive insertions
  std::string helper_rules_;
  int helpers_ = 0;
};

}  // namespace

std::string GbnfLiteral(std::string_view utf8) {
  std::u32string cps;
  for (size_t i = 0; i < utf8.size();) {
    uint32_t cp = 0xFFFD;
    int n = 1;
    DecodeOne(utf8, i, &cp, &n);
    cps.push_back(cp);
    i += n;
  }
  std::string out = "\"";
  for (const char32_t c : cps) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7F) {
          out += absl::StrFormat("\\x%02X", static_cast<uint32_t>(c));
        } else if (c < 0x80) {
          out += static_cast<char>(c);
        } else if (c <= 0xFFFF) {
          out += absl::StrFormat("\\u%04X", static_cast<uint32_t>(c));
        } else {
          out += absl::StrFormat("\\U%08X", static_cast<uint32_t>(c));
        }
    }
  }
  return out + "\"";
}

std::string GbnfClassChar(uint32_t cp) {
  if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9')) {
    return std::string(1, static_cast<char>(cp));
  }
  switch (cp) {
    case '\\':
      return "\\\\";
    case '"':
      return "\\\"";
    case ']':
      return "\\]";
    case '[':
      return "\\[";
    case '\n':
      return "\\n";
    case '\r':
      return "\\r";
    case '\t':
      return "\\t";
    default:
      break;
  }
  // `-` and `^` as \x: llama.cpp's GBNF has no \- or \^.
  if (cp >= 0x20 && cp < 0x7F && cp != '-' && cp != '^') {
    return std::string(1, static_cast<char>(cp));
  }
  if (cp < 0x80) return absl::StrFormat("\\x%02X", cp);
  if (cp <= 0xFFFF) return absl::StrFormat("\\u%04X", cp);
  return absl::StrFormat("\\U%08X", cp);
}

bool IsGbnfRuleName(std::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), IsNameChar);
}

bool IsGbnfPrimary(std::string_view expr) { return PrimaryEnd(expr, 0) == expr.size(); }

std::string GbnfAlternatives(const std::vector<std::string>& alts) {
  std::vector<std::string_view> nonempty;
  std::unordered_set<std::string_view> seen;  // linear in the alternatives, however many
  bool empty = false;
  for (const std::string& a : alts) {
    if (a.empty()) {
      empty = true;
    } else if (seen.insert(a).second) {
      nonempty.push_back(a);
    }
  }
  if (nonempty.empty()) return "";
  std::string text;
  if (nonempty.size() == 1) {
    text = nonempty[0];
  } else {
    text = "(";
    for (size_t i = 0; i < nonempty.size(); ++i) {
      if (i > 0) text += " | ";
      text += nonempty[i];
    }
    text += ")";
  }
  return empty ? Primary(text) + "?" : text;
}

std::string GbnfRepeat(const std::string& expr, int min, int max) {
  if (max == 0 || expr.empty()) return "";
  if (min == 1 && max == 1) return expr;
  return Primary(expr) + QuantifierSuffix(min, max);
}

StatusOr<std::string> RegexToGbnf(std::string_view pattern, std::string_view rule) {
  return RegexToGbnf(pattern, rule, RegexGbnfOptions{});
}

StatusOr<std::string> RegexToGbnf(std::string_view pattern, std::string_view rule,
                                  const RegexGbnfOptions& options) {
  return RegexToGbnf(pattern, rule, options, nullptr);
}

StatusOr<std::string> RegexToGbnf(std::string_view pattern, std::string_view rule,
                                  const RegexGbnfOptions& options,
                                  const std::function<std::string(std::string_view)>& new_rule) {
  if (!IsGbnfRuleName(rule)) {
    return InvalidArgument("regex: the rule name `", rule, "` is not [a-zA-Z0-9-]+");
  }
  if (pattern.size() > kMaxRegexPatternBytes) {
    return InvalidArgument("regex: the pattern is ", pattern.size(), " bytes long; at most ",
                           kMaxRegexPatternBytes, " are supported");
  }
  std::u32string cps;
  if (!DecodeUtf8(pattern, &cps)) return InvalidArgument("regex: the pattern is not valid UTF-8");
  Nodes nodes;
  RegexParser parser(std::move(cps), options.anchored, &nodes);
  KILN_ASSIGN_OR_RETURN(const Node* tree, parser.Parse());
  const Node* normalized = Rewriter(&nodes).Normalize(tree);
  if (nodes.over_budget()) {
    return InvalidArgument("regex: the regex is too complex: more than ", kMaxRegexNodes,
                           " nodes once rewritten");
  }
  return Emitter(options.json_string, rule, new_rule).Run(normalized);
}

}  // namespace kiln::grammar
