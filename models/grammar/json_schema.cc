#include "models/grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "models/grammar/regex_gbnf.h"
#include "nlohmann/json.hpp"

namespace kiln::grammar {

namespace {

using Json = nlohmann::ordered_json;

constexpr int kMaxIntegerDigits = 19;   // an unbounded integer part
constexpr int kMaxFractionDigits = 16;  // an unbounded fraction
constexpr int kMaxBoundDigits = 40;     // minimum/maximum beyond this: unsupported
constexpr int kMaxDepth = 200;          // nested schemas

// ---- Small GBNF builders ------------------------------------------------------------------------

std::string Lit(std::string_view s) { return GbnfLiteral(s); }

// The non-empty parts, space-separated.
std::string Seq(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (const std::string_view p : parts) {
    if (p.empty()) continue;
    if (!out.empty()) out += ' ';
    out += p;
  }
  return out;
}

std::string Digits(int min, int max) { return GbnfRepeat("[0-9]", min, max); }

std::string DigitClass(char lo, char hi) {
  if (lo == hi) return Lit(std::string(1, lo));
  return std::string("[") + lo + "-" + hi + "]";
}

std::string Dump(const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); }

// ---- Integer ranges, digit by digit ------------------------------------------------------------

// Compares canonical (no leading zeros) non-negative integers.
int CompareDigits(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;
  const int c = a.compare(b);
  return c < 0 ? -1 : c > 0 ? 1 : 0;
}

std::string IncDigits(std::string s) {
  int i = static_cast<int>(s.size()) - 1;
  while (i >= 0 && s[i] == '9') s[i--] = '0';
  if (i < 0) {
    s.insert(s.begin(), '1');
  } else {
    ++s[i];
  }
  return s;
}

// REQUIRES: s > 0.
std::string DecDigits(std::string s) {
  int i = static_cast<int>(s.size()) - 1;
  while (s[i] == '0') s[i--] = '9';
  --s[i];
  const size_t nz = s.find_first_not_of('0');
  return nz == std::string::npos ? "0" : s.substr(nz);
}

// Digit strings of a's length from a to b (a <= b, same length).
std::string SameLength(std::string_view a, std::string_view b) {
  size_t i = 0;
  while (i < a.size() && a[i] == b[i]) ++i;
  if (i == a.size()) return Lit(a);
  const int rest = static_cast<int>(a.size() - i - 1);
  const std::string_view a_rest = a.substr(i + 1), b_rest = b.substr(i + 1);
  std::vector<std::string> alts;
  char lo = a[i], hi = b[i];
  if (a_rest.find_first_not_of('0') != std::string_view::npos) {
    alts.push_back(Seq({Lit(a.substr(i, 1)), SameLength(a_rest, std::string(rest, '9'))}));
    ++lo;
  }
  std::string upper;
  if (b_rest.find_first_not_of('9') != std::string_view::npos) {
    upper = Seq({Lit(b.substr(i, 1)), SameLength(std::string(rest, '0'), b_rest)});
    --hi;
  }
  if (lo <= hi) alts.push_back(Seq({DigitClass(lo, hi), Digits(rest, rest)}));
  if (!upper.empty()) alts.push_back(upper);
  return Seq({i > 0 ? Lit(a.substr(0, i)) : "", GbnfAlternatives(alts)});
}

// Canonical non-negative integers from lo to hi (absent: up to max(kMaxIntegerDigits, |lo|)
// digits); nullopt when lo > hi.
std::optional<std::string> UnsignedRange(const std::string& lo,
                                         const std::optional<std::string>& hi) {
  if (hi && CompareDigits(lo, *hi) > 0) return std::nullopt;
  const size_t max_len = hi ? hi->size() : std::max<size_t>(kMaxIntegerDigits, lo.size());
  std::vector<std::string> alts;
  size_t full_from = 0;  // a run of lengths whose every number is in the range
  for (size_t d = lo.size(); d <= max_len; ++d) {
    std::string first(d, '0');  // the smallest number with d digits
    if (d > 1) first[0] = '1';
    const std::string last(d, '9');
    const std::string low = d == lo.size() ? lo : first;
    const std::string high = hi && d == hi->size() ? *hi : last;
    if (d > 1 && low == first && high == last) {
      if (full_from == 0) full_from = d;
      continue;
    }
    if (full_from != 0) {
      alts.push_back(
          Seq({"[1-9]", Digits(static_cast<int>(full_from - 1), static_cast<int>(d - 2))}));
      full_from = 0;
    }
    alts.push_back(SameLength(low, high));
  }
  if (full_from != 0) {
    alts.push_back(
        Seq({"[1-9]", Digits(static_cast<int>(full_from - 1), static_cast<int>(max_len - 1))}));
  }
  return GbnfAlternatives(alts);
}

// ---- Decimal bounds ----------------------------------------------------------------------------

struct Decimal {
  bool negative = false;
  std::string integer = "0";  // no leading zeros
  std::string fraction;       // no trailing zeros
};

bool IsZero(const Decimal& d) { return d.integer == "0" && d.fraction.empty(); }

std::string ToString(const Decimal& d) {
  return StrCat(d.negative ? "-" : "", d.integer, d.fraction.empty() ? "" : ".", d.fraction);
}

// A JSON number's text as a Decimal; nullopt beyond kMaxBoundDigits digits either side.
std::optional<Decimal> ParseDecimal(std::string_view s) {
  Decimal d;
  size_t i = 0;
  if (i < s.size() && s[i] == '-') {
    d.negative = true;
    ++i;
  }
  std::string digits;
  int64_t point = -1;
  for (; i < s.size() && s[i] != 'e' && s[i] != 'E'; ++i) {
    if (s[i] == '.') {
      point = static_cast<int64_t>(digits.size());
    } else {
      digits += s[i];
    }
  }
  if (point < 0) point = static_cast<int64_t>(digits.size());
  if (i < s.size()) {
    ++i;
    bool neg = false;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    int64_t e = 0;
    for (; i < s.size(); ++i) e = std::min<int64_t>(e * 10 + (s[i] - '0'), 100000);
    point += neg ? -e : e;
  }
  const int64_t n = static_cast<int64_t>(digits.size());
  if (point > n + kMaxBoundDigits || point < -kMaxBoundDigits) return std::nullopt;
  if (point < 0) {
    d.integer = "0";
    d.fraction = std::string(-point, '0') + digits;
  } else if (point > n) {
    d.integer = digits + std::string(point - n, '0');
  } else {
    d.integer = digits.substr(0, point);
    d.fraction = digits.substr(point);
  }
  const size_t nz = d.integer.find_first_not_of('0');
  d.integer = nz == std::string::npos ? "0" : d.integer.substr(nz);
  d.fraction.erase(d.fraction.find_last_not_of('0') + 1);
  if (d.integer.size() > kMaxBoundDigits || d.fraction.size() > kMaxBoundDigits) {
    return std::nullopt;
  }
  if (IsZero(d)) d.negative = false;
  return d;
}

int Compare(const Decimal& a, const Decimal& b) {
  if (a.negative != b.negative) return a.negative ? -1 : 1;
  int c = CompareDigits(a.integer, b.integer);
  if (c == 0) c = a.fraction.compare(b.fraction) < 0 ? -1 : a.fraction == b.fraction ? 0 : 1;
  return a.negative ? -c : c;
}

Decimal Negate(Decimal d) {
  if (!IsZero(d)) d.negative = !d.negative;
  return d;
}

// Integer (no fraction) plus or minus one.
Decimal AddOne(Decimal d) {
  d.integer = d.negative ? DecDigits(d.integer) : IncDigits(d.integer);
  if (IsZero(d)) d.negative = false;
  return d;
}
Decimal SubOne(Decimal d) {
  if (IsZero(d)) return Decimal{true, "1", ""};
  d.integer = d.negative ? IncDigits(d.integer) : DecDigits(d.integer);
  return d;
}
Decimal Truncate(Decimal d) {
  d.fraction.clear();
  if (IsZero(d)) d.negative = false;
  return d;
}
Decimal Ceil(const Decimal& d) {
  if (d.fraction.empty()) return d;
  return d.negative ? Truncate(d) : AddOne(Truncate(d));
}
Decimal Floor(const Decimal& d) {
  if (d.fraction.empty()) return d;
  return d.negative ? SubOne(Truncate(d)) : Truncate(d);
}

struct Bound {
  Decimal value;
  bool inclusive = true;
  std::string keyword;  // for messages
};

// Canonical integers in [lo, hi] (inclusive bounds without fractions; absent: unbounded).
std::string IntegerRange(const std::optional<Decimal>& lo, const std::optional<Decimal>& hi) {
  std::vector<std::string> alts;
  if (!lo || lo->negative) {
    const std::string mlo = hi && hi->negative ? hi->integer : "1";
    std::optional<std::string> mhi;
    if (lo) mhi = lo->integer;
    if (std::optional<std::string> r = UnsignedRange(mlo, mhi)) alts.push_back(Seq({Lit("-"), *r}));
  }
  if (!hi || !hi->negative) {
    const std::string plo = lo && !lo->negative ? lo->integer : "0";
    std::optional<std::string> phi;
    if (hi) phi = hi->integer;
    if (std::optional<std::string> r = UnsignedRange(plo, phi)) alts.push_back(*r);
  }
  return GbnfAlternatives(alts);
}

// Fraction digit strings D (read as 0.D; empty: no fraction) between two bounds given by their
// digits (no trailing zeros): lo <= 0.D (lo < 0.D when !lo_inclusive), 0.D <= hi likewise; hi
// absent: no upper bound below 1. Split on the first digit as the integer ranges are.
struct Fraction {
  bool empty_ok = false;          // D may be empty (the number has no fraction)
  std::vector<std::string> alts;  // non-empty D
};

std::optional<std::string> FractionTail(const Fraction& f) {
  if (!f.empty_ok && f.alts.empty()) return std::nullopt;
  std::vector<std::string> alts = f.alts;
  if (f.empty_ok) alts.push_back("");
  return GbnfAlternatives(alts);
}

Fraction FractionRange(std::string_view lo, bool lo_inclusive, std::optional<std::string_view> hi,
                       bool hi_inclusive) {
  Fraction f;
  f.empty_ok = lo.empty() && lo_inclusive && (!hi || !hi->empty() || hi_inclusive);
  if (!hi && lo.empty()) {
    f.alts.push_back(lo_inclusive ? Digits(1, kMaxFractionDigits)
                                  : Seq({GbnfRepeat("[0]", 0, kMaxFractionDigits), "[1-9]",
                                         Digits(0, kMaxFractionDigits)}));
    return f;
  }
  if (hi && hi->empty()) {  // up to 0: zeros only, when the lower bound is 0 too
    if (lo.empty() && lo_inclusive && hi_inclusive) {
      f.alts.push_back(GbnfRepeat("[0]", 1, kMaxFractionDigits));
    }
    return f;
  }
  auto digit_then = [&](char d, const Fraction& rest) {
    if (std::optional<std::string> tail = FractionTail(rest)) {
      f.alts.push_back(Seq({Lit(std::string(1, d)), *tail}));
    }
  };
  const char a0 = lo.empty() ? '0' : lo[0];
  const char b0 = hi ? hi->front() : '9';
  const std::string_view lo_rest = lo.empty() ? lo : lo.substr(1);
  const bool lo_digit = !(lo.empty() && lo_inclusive);  // the digit a0 constrains the rest
  if (lo_digit && hi && a0 == b0) {
    digit_then(a0, FractionRange(lo_rest, lo_inclusive, hi->substr(1), hi_inclusive));
    return f;
  }
  char from = a0, to = b0;
  if (lo_digit) {
    digit_then(a0, FractionRange(lo_rest, lo_inclusive, std::nullopt, false));
    ++from;
  }
  if (hi) --to;
  if (from <= to) f.alts.push_back(Seq({DigitClass(from, to), Digits(0, kMaxFractionDigits)}));
  if (hi) digit_then(b0, FractionRange("", true, hi->substr(1), hi_inclusive));
  return f;
}

// "." and the fraction digits, or nothing, as `f` allows; nullopt when it allows nothing.
std::optional<std::string> FractionPart(const Fraction& f) {
  if (!f.empty_ok && f.alts.empty()) return std::nullopt;
  if (f.alts.empty()) return "";
  const std::string dot = Seq({Lit("."), GbnfAlternatives(f.alts)});
  return f.empty_ok ? GbnfAlternatives({dot, ""}) : dot;
}

// Non-negative numbers without exponent between lo and hi (absent: unbounded), each preceded
// by `sign`, added to `alts`. REQUIRES: lo <= hi.
void NonNegativeRange(const Decimal& lo, bool lo_inclusive, const std::optional<Decimal>& hi,
                      bool hi_inclusive, const std::string& sign, std::vector<std::string>* alts) {
  auto integer_then = [&](const std::string& integer, const Fraction& f) {
    if (std::optional<std::string> part = FractionPart(f)) {
      alts->push_back(Seq({sign, Lit(integer), *part}));
    }
  };
  if (hi && lo.integer == hi->integer) {
    integer_then(lo.integer, FractionRange(lo.fraction, lo_inclusive, hi->fraction, hi_inclusive));
    return;
  }
  integer_then(lo.integer, FractionRange(lo.fraction, lo_inclusive, std::nullopt, false));
  std::optional<std::string> mid_hi;
  if (hi) mid_hi = DecDigits(hi->integer);
  if (std::optional<std::string> mid = UnsignedRange(IncDigits(lo.integer), mid_hi)) {
    const std::string any_fraction =
        GbnfAlternatives({Seq({Lit("."), Digits(1, kMaxFractionDigits)}), ""});
    alts->push_back(Seq({sign, *mid, any_fraction}));
  }
  if (hi) integer_then(hi->integer, FractionRange("", true, hi->fraction, hi_inclusive));
}

// Numbers without exponent within the bounds. REQUIRES: the bounds allow some number.
std::string NumberRange(const std::optional<Bound>& lo, const std::optional<Bound>& hi) {
  std::vector<std::string> alts;
  if (!lo || lo->value.negative) {
    // -m with m in (0 or -hi, -lo]
    Decimal mlo;
    bool mlo_inclusive = false;
    if (hi && hi->value.negative) {
      mlo = Negate(hi->value);
      mlo_inclusive = hi->inclusive;
    }
    std::optional<Decimal> mhi;
    if (lo) mhi = Negate(lo->value);
    NonNegativeRange(mlo, mlo_inclusive, mhi, lo ? lo->inclusive : true, Lit("-"), &alts);
  }
  if (!hi || !hi->value.negative) {
    Decimal plo;
    bool plo_inclusive = true;
    if (lo && !lo->value.negative) {
      plo = lo->value;
      plo_inclusive = lo->inclusive;
    }
    std::optional<Decimal> phi;
    if (hi) phi = hi->value;
    NonNegativeRange(plo, plo_inclusive, phi, hi ? hi->inclusive : true, "", &alts);
  }
  return GbnfAlternatives(alts);
}

// ---- Keywords ----------------------------------------------------------------------------------

const std::set<std::string, std::less<>>& Annotations() {
  static const auto* s = new std::set<std::string, std::less<>>{
      "title",    "description", "$schema",  "$id",       "id",    "$comment",    "default",
      "examples", "deprecated",  "readOnly", "writeOnly", "$defs", "definitions", "$anchor"};
  return *s;
}

const std::set<std::string, std::less<>>& Supported() {
  static const auto* s = new std::set<std::string, std::less<>>{"type",
                                                                "properties",
                                                                "required",
                                                                "additionalProperties",
                                                                "items",
                                                                "prefixItems",
                                                                "additionalItems",
                                                                "minItems",
                                                                "maxItems",
                                                                "enum",
                                                                "const",
                                                                "anyOf",
                                                                "oneOf",
                                                                "allOf",
                                                                "minimum",
                                                                "maximum",
                                                                "exclusiveMinimum",
                                                                "exclusiveMaximum",
                                                                "minLength",
                                                                "maxLength",
                                                                "pattern",
                                                                "format",
                                                                "$ref"};
  return *s;
}

const char* const kTypes[] = {"string", "number", "integer", "boolean", "null", "object", "array"};

// Keywords that imply a type when `type` is absent.
const std::pair<const char*, const char*> kTypeKeywords[] = {
    {"properties", "object"},       {"additionalProperties", "object"},
    {"required", "object"},         {"items", "array"},
    {"prefixItems", "array"},       {"additionalItems", "array"},
    {"minItems", "array"},          {"maxItems", "array"},
    {"minLength", "string"},        {"maxLength", "string"},
    {"pattern", "string"},          {"format", "string"},
    {"minimum", "number"},          {"maximum", "number"},
    {"exclusiveMinimum", "number"}, {"exclusiveMaximum", "number"}};

const char* const kFormats[] = {"date", "time", "date-time", "uuid"};

std::string Child(const std::string& ptr, std::string_view key) {
  std::string out = ptr + "/";
  for (const char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}
std::string Child(const std::string& ptr, size_t index) { return StrCat(ptr, "/", index); }

bool IsHexDigit(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

std::string Where(const std::string& ptr) { return ptr.empty() ? "(root)" : ptr; }

// A rule name from a hint: runs of other characters become one `-`.
std::string RuleName(std::string_view hint) {
  std::string out;
  for (const char c : hint) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (ok) {
      out += c;
    } else if (!out.empty() && out.back() != '-') {
      out += '-';
    }
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "x" : out;
}

// Primitive rules, defined on first use under these names (which schema-derived rules avoid).
struct Primitive {
  const char* name;
  const char* body;
  std::vector<const char*> deps;
};
const Primitive kPrimitives[] = {
    {"space", R"(| " " | "\n" [ \t]{0,20})", {}},
    {"value",
     "object | array | string | number | boolean | null",
     {"object", "array", "string", "number", "boolean", "null"}},
    {"object",
     R"("{" space ( member ( space "," space member )* space )? "}")",
     {"space", "member"}},
    {"member", R"(string space ":" space value)", {"string", "space", "value"}},
    {"array", R"("[" space ( value ( space "," space value )* space )? "]")", {"space", "value"}},
    {"string", R"("\"" char* "\"")", {"char"}},
    {"char", R"([^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))", {}},
    {"number", R"(integer ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?)", {"integer"}},
    {"integer", R"("-"? ("0" | [1-9] [0-9]{0,18}))", {}},
    {"boolean", R"("true" | "false")", {}},
    {"null", R"("null")", {}},
    {"date", R"([0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01]))", {}},
    {"time",
     R"(([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" ([0-5] [0-9] | "60") ("." [0-9]{1,9})? ([Zz] | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9]))",
     {}},
    {"date-time", R"(date [Tt] time)", {"date", "time"}},
    {"uuid",
     R"([0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12})",
     {}},
};

// The rules of one grammar, in order of creation ("root" first).
class RuleSet {
 public:
  RuleSet() {
    for (const Primitive& p : kPrimitives) reserved_.insert(p.name);
  }

  // A fresh name from `hint`: the hint, else the hint + "-2", "-3", ... (a counter per hint, so
  // that many rules from one hint take linear time).
  std::string Reserve(std::string_view hint) {
    const std::string base = RuleName(hint);
    std::string name = base;
    if (Taken(name)) {
      int& next = next_suffix_[base];
      next = std::max(next, 2);
      do {
        name = StrCat(base, "-", next++);
      } while (Taken(name));
    }
    rules_[name] = "";
    order_.push_back(name);
    bytes_ += name.size() + 6;  // " ::= ", "\n"
    return name;
  }
  void Define(const std::string& name, const std::string& body) {
    std::string& old = rules_[name];
    bytes_ += body.size() - old.size();
    old = body;
    by_body_.emplace(body, name);
  }
  // A rule with `body`: an existing one with the same body, or a new one named from `hint`.
  std::string Add(std::string_view hint, const std::string& body) {
    if (auto it = by_body_.find(body); it != by_body_.end()) return it->second;
    const std::string name = Reserve(hint);
    Define(name, body);
    return name;
  }
  // The primitive rule `name`, defined with what it uses.
  std::string Prim(const char* name) {
    if (rules_.count(name) != 0) return name;
    for (const Primitive& p : kPrimitives) {
      if (std::string_view(p.name) != name) continue;
      rules_[name] = p.body;
      order_.push_back(name);
      bytes_ += std::string_view(name).size() + std::string_view(p.body).size() + 6;
      for (const char* dep : p.deps) Prim(dep);
    }
    return name;
  }

  std::string Text() const {
    std::string out;
    out.reserve(bytes_);
    for (const std::string& name : order_) out += StrCat(name, " ::= ", rules_.at(name), "\n");
    return out;
  }
  // The size of Text().
  size_t bytes() const { return bytes_; }

 private:
  bool Taken(const std::string& name) const {
    return reserved_.count(name) != 0 || rules_.count(name) != 0;
  }

  std::set<std::string, std::less<>> reserved_;
  std::map<std::string, int> next_suffix_;  // base name -> the next number to try
  size_t bytes_ = 0;
  std::map<std::string, std::string, std::less<>> rules_;  // name -> body
  std::map<std::string, std::string> by_body_;             // body -> name
  std::vector<std::string> order_;
};

const Json& TrueSchema() {
  static const Json* t = new Json(true);
  return *t;
}

// A node of a trie of property names, for keys that are none of them. The nodes are in a vector,
// a node's kids after it: a name may be long, and neither building, walking nor freeing the trie
// recurses.
struct NameTrieNode {
  std::map<std::string, size_t> kids;  // by the next character (UTF-8): the kid's index
  bool end = false;
};

class Converter {
 public:
  Converter(const Json& root, const JsonSchemaOptions& options)
      : root_(root), strict_(options.strict) {}

  StatusOr<JsonSchemaGrammar> Run() {
    rules_.Reserve("root");
    KILN_ASSIGN_OR_RETURN(const std::string body, Visit(root_, "", "root"));
    rules_.Define("root", body);
    if (rules_.bytes() > kMaxSchemaGbnfBytes) return TooLarge("");
    return JsonSchemaGrammar{rules_.Text(), ignored_};
  }

 private:
  template <typename... A>
  static Status Error(const std::string& ptr, const A&... a) {
    return InvalidArgument("json_schema ", Where(ptr), ": ", a...);
  }

  // An unsupported keyword: an error when strict, else noted in `ignored`.
  Status Unsupported(const std::string& ptr, std::string_view keyword, std::string_view why = "") {
    if (strict_) {
      return Error(ptr, "`", keyword, "` is not supported", why,
                   " (strict mode; otherwise it would be ignored)");
    }
    std::string entry = StrCat(Where(ptr), ": ", keyword);
    if (ignored_set_.insert(entry).second) ignored_.push_back(std::move(entry));
    return OkStatus();
  }

  // A rule for the schema, or its body when that is one primary already.
  StatusOr<std::string> VisitRule(const Json& s, const std::string& ptr, const std::string& name) {
    KILN_ASSIGN_OR_RETURN(const std::string body, Visit(s, ptr, name));
    if (IsGbnfPrimary(body)) return body;
    return rules_.Add(name, body);
  }

  StatusOr<std::string> Visit(const Json& s, const std::string& ptr, const std::string& name) {
    if (++visits_ > kMaxSchemaVisits) {
      return Error(ptr, "the schema is too complex: more than ", kMaxSchemaVisits,
                   " subschemas to translate (each use of a merged allOf, and each alternative "
                   "merged with its siblings, counts anew)");
    }
    if (++depth_ > kMaxDepth) return Error(ptr, "schemas nested deeper than ", kMaxDepth);
    StatusOr<std::string> body = VisitSchema(s, ptr, name);
    --depth_;
    if (body.ok() && (body->size() > kMaxSchemaGbnfBytes || rules_.bytes() > kMaxSchemaGbnfBytes)) {
      return TooLarge(ptr);
    }
    return body;
  }

  static Status TooLarge(const std::string& ptr) {
    return Error(ptr, "the schema is too complex: its GBNF would exceed ", kMaxSchemaGbnfBytes,
                 " bytes");
  }

  StatusOr<std::string> VisitSchema(const Json& s, const std::string& ptr,
                                    const std::string& name) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return rules_.Prim("value");
      return Error(ptr, "the schema `false` allows no value");
    }
    if (!s.is_object()) {
      return Error(ptr, "a schema must be an object or a boolean, not ", s.type_name());
    }
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (Annotations().count(it.key()) == 0 && Supported().count(it.key()) == 0) {
        KILN_RETURN_IF_ERROR(Unsupported(ptr, it.key()));
      }
    }
    if (s.contains("$ref")) return VisitRef(s, ptr);
    if (s.contains("allOf")) {
      // An allOf of one $ref (and annotations) is that reference: one rule, however many times
      // it is used. Merged inline, each use would translate it again.
      if (const std::optional<size_t> i = LoneRefInAllOf(s)) {
        const Json& part = s["allOf"][*i];
        return RefRule(part["$ref"].get<std::string>(),
                       Child(Child(Child(ptr, "allOf"), *i), "$ref"));
      }
      KILN_ASSIGN_OR_RETURN(const Json merged, MergeAllOf(s, ptr));
      return Visit(merged, ptr, name);
    }
    if (s.contains("anyOf") || s.contains("oneOf")) return VisitUnion(s, ptr, name);
    KILN_ASSIGN_OR_RETURN(const std::vector<std::string> types, Types(s, ptr));
    if (s.contains("const")) return Lit(Dump(s["const"]));
    if (s.contains("enum")) return VisitEnum(s, ptr, types);
    if (types.empty()) return rules_.Prim("value");
    if (types.size() == 1) return VisitTyped(s, ptr, name, types[0]);
    std::vector<std::string> alts;
    for (const std::string& t : types) {
      KILN_ASSIGN_OR_RETURN(const std::string body, VisitTyped(s, ptr, name + "-" + t, t));
      alts.push_back(IsGbnfPrimary(body) ? body : rules_.Add(name + "-" + t, body));
    }
    return GbnfAlternatives(alts);
  }

  // The schema's types: `type`, or those its keywords imply; empty: any value.
  StatusOr<std::vector<std::string>> Types(const Json& s, const std::string& ptr) {
    std::vector<std::string> types;
    auto add = [&](const std::string& t) {
      if (std::find(types.begin(), types.end(), t) == types.end()) types.push_back(t);
    };
    const auto it = s.find("type");
    if (it == s.end()) {
      for (const auto& [keyword, type] : kTypeKeywords) {
        if (s.contains(keyword)) add(type);
      }
      return types;
    }
    const std::string tptr = Child(ptr, "type");
    const Json& t = *it;
    if (!t.is_string() && !(t.is_array() && !t.empty())) {
      return Error(tptr, "must be a type name or a non-empty array of them, not ", Dump(t));
    }
    for (const Json& one : t.is_array() ? t : Json::array({t})) {
      if (!one.is_string() || std::find(std::begin(kTypes), std::end(kTypes),
                                        one.get<std::string>()) == std::end(kTypes)) {
        return Error(tptr, "unknown type ", Dump(one),
                     " (allowed: string, number, integer, boolean, null, object, array)");
      }
      add(one.get<std::string>());
    }
    return types;
  }

  StatusOr<std::string> VisitTyped(const Json& s, const std::string& ptr, const std::string& name,
                                   const std::string& type) {
    if (type == "null") return rules_.Prim("null");
    if (type == "boolean") return rules_.Prim("boolean");
    if (type == "string") return VisitString(s, ptr, name);
    if (type == "number" || type == "integer") return VisitNumber(s, ptr, type == "integer");
    if (type == "object") return VisitObject(s, ptr, name);
    return VisitArray(s, ptr, name);
  }

  StatusOr<std::string> VisitEnum(const Json& s, const std::string& ptr,
                                  const std::vector<std::string>& types) {
    const Json& values = s["enum"];
    if (!values.is_array() || values.empty()) {
      return Error(Child(ptr, "enum"), "must be a non-empty array");
    }
    auto of_type = [&](const Json& v) {
      if (types.empty() || !s.contains("type")) return true;
      for (const std::string& t : types) {
        if ((t == "string" && v.is_string()) || (t == "number" && v.is_number()) ||
            (t == "integer" && v.is_number() && std::floor(v.get<double>()) == v.get<double>()) ||
            (t == "boolean" && v.is_boolean()) || (t == "null" && v.is_null()) ||
            (t == "object" && v.is_object()) || (t == "array" && v.is_array())) {
          return true;
        }
      }
      return false;
    };
    std::vector<std::string> alts;
    for (const Json& v : values) {
      if (of_type(v)) alts.push_back(Lit(Dump(v)));
    }
    if (alts.empty()) return Error(ptr, "no `enum` value is of the schema's `type`");
    return GbnfAlternatives(alts);
  }

  // ---- $ref ----

  StatusOr<std::string> VisitRef(const Json& s, const std::string& ptr) {
    const Json& ref = s["$ref"];
    const std::string rptr = Child(ptr, "$ref");
    if (!ref.is_string()) return Error(rptr, "must be a string, not ", ref.type_name());
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (it.key() != "$ref" && Supported().count(it.key()) != 0) {
        KILN_RETURN_IF_ERROR(Unsupported(ptr, it.key(), " beside `$ref`"));
      }
    }
    return RefRule(ref.get<std::string>(), rptr);
  }

  // The schema `ref` points to; `rptr` is where the reference is, for messages.
  StatusOr<std::pair<const Json*, std::string>> Resolve(const std::string& ref,
                                                        const std::string& rptr) {
    if (ref.empty() || ref[0] != '#') {
      return Error(rptr, "`", ref,
                   "` points outside this document; only local references (`#`, "
                   "`#/$defs/name`, ...) are supported");
    }
    std::string pointer;  // the fragment, percent-decoded
    for (size_t i = 1; i < ref.size(); ++i) {
      if (ref[i] == '%' && i + 2 < ref.size() && IsHexDigit(ref[i + 1]) && IsHexDigit(ref[i + 2])) {
        pointer += static_cast<char>(std::stoi(ref.substr(i + 1, 2), nullptr, 16));
        i += 2;
      } else {
        pointer += ref[i];
      }
    }
    if (!pointer.empty() && pointer[0] != '/') {
      return Error(rptr, "`", ref, "` is not a JSON pointer (`#/...`); anchors are not supported");
    }
    const Json* target = &root_;
    std::string at;
    for (size_t start = 1; start <= pointer.size() && !pointer.empty();) {
      size_t end = pointer.find('/', start);
      if (end == std::string::npos) end = pointer.size();
      std::string token;
      for (size_t i = start; i < end; ++i) {
        if (pointer[i] == '~' && i + 1 < end && (pointer[i + 1] == '0' || pointer[i + 1] == '1')) {
          token += pointer[++i] == '0' ? '~' : '/';
        } else {
          token += pointer[i];
        }
      }
      const Json* next = nullptr;
      if (target->is_object() && target->contains(token)) {
        next = &(*target)[token];
      } else if (target->is_array() && !token.empty() &&
                 token.find_first_not_of("0123456789") == std::string::npos && token.size() < 10 &&
                 std::stoul(token) < target->size()) {
        next = &(*target)[std::stoul(token)];
      }
      if (next == nullptr) {
        return Error(rptr, "`", ref, "` does not resolve: no `", token, "` in ", Where(at));
      }
      target = next;
      at = Child(at, token);
      start = end + 1;
    }
    return std::make_pair(target, pointer);
  }

  StatusOr<std::string> RefRule(const std::string& ref, const std::string& rptr) {
    KILN_ASSIGN_OR_RETURN(const auto resolved, Resolve(ref, rptr));
    const auto& [target, pointer] = resolved;
    if (pointer.empty()) return std::string("root");
    if (auto it = ref_rules_.find(pointer); it != ref_rules_.end()) return it->second;
    const std::string name = rules_.Reserve(pointer);
    ref_rules_[pointer] = name;
    KILN_ASSIGN_OR_RETURN(const std::string body, Visit(*target, pointer, name));
    rules_.Define(name, body);
    return name;
  }

  // ---- Combinations ----

  // Adds `from`'s keywords (not its annotations) to `into`, as both must hold: the same keyword
  // twice must agree, except `type` (the common types), `required` (united) and `properties`
  // (different names). False when the two cannot both hold (no common type).
  StatusOr<bool> Merge(const Json& from, const std::string& ptr, Json* into) {
    for (auto it = from.begin(); it != from.end(); ++it) {
      const std::string& k = it.key();
      const Json& v = it.value();
      if (Annotations().count(k) != 0) continue;
      if (!into->contains(k)) {
        (*into)[k] = v;
        continue;
      }
      Json& old = (*into)[k];
      if (old == v) continue;
      // (An ordered_json object finds keys one by one: a set keeps this linear.)
      auto has_common_property = [&] {
        std::set<std::string_view> keys;
        for (auto p = old.begin(); p != old.end(); ++p) keys.insert(p.key());
        for (auto p = v.begin(); p != v.end(); ++p) {
          if (keys.count(p.key()) != 0) return true;
        }
        return false;
      };
      if (k == "type") {
        KILN_ASSIGN_OR_RETURN(const std::vector<std::string> a, Types(*into, ptr));
        KILN_ASSIGN_OR_RETURN(const std::vector<std::string> b, Types(from, ptr));
        Json common = Json::array();
        for (const std::string& t : a) {
          for (const std::string& u : b) {
            if (t == u || (t == "integer" && u == "number")) common.push_back(t);
            if (t == "number" && u == "integer") common.push_back(u);
          }
        }
        if (common.empty()) return false;
        old = common;
      } else if (k == "required" && v.is_array() && old.is_array()) {
        for (const Json& r : v) {
          if (std::find(old.begin(), old.end(), r) == old.end()) old.push_back(r);
        }
      } else if (k == "properties" && v.is_object() && old.is_object() && !has_common_property()) {
        // No key in common: appended without the linear search of old[key].
        Json::object_t& props = old.get_ref<Json::object_t&>();
        for (auto p = v.begin(); p != v.end(); ++p) props.emplace_back(p.key(), p.value());
      } else {
        KILN_RETURN_IF_ERROR(Unsupported(ptr, k, " in two schemas that are merged"));
      }
    }
    return true;
  }

  // Whether `s`'s allOf holds one {"$ref": "..."} and otherwise only annotations (and `true`),
  // with no sibling keyword that constrains: then the index of that part.
  static std::optional<size_t> LoneRefInAllOf(const Json& s) {
    auto annotations_only = [](const Json& v, const char* except) {
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (it.key() != except && Annotations().count(it.key()) == 0) return false;
      }
      return true;
    };
    // Siblings that are neither annotations nor supported were reported already.
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (it.key() != "allOf" && Supported().count(it.key()) != 0) return std::nullopt;
    }
    const Json& parts = s["allOf"];
    if (!parts.is_array()) return std::nullopt;
    std::optional<size_t> ref;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Json& part = parts[i];
      if (part.is_boolean() && part.get<bool>()) continue;
      if (!part.is_object()) return std::nullopt;
      if (annotations_only(part, "")) continue;
      if (ref || !part.contains("$ref") || !part["$ref"].is_string() ||
          !annotations_only(part, "$ref")) {
        return std::nullopt;
      }
      ref = i;
    }
    return ref;
  }

  StatusOr<Json> MergeAllOf(const Json& s, const std::string& ptr) {
    const std::string aptr = Child(ptr, "allOf");
    const Json& parts = s["allOf"];
    if (!parts.is_array() || parts.empty())
      return Error(aptr, "must be a non-empty array of schemas");
    Json merged = Json::object();
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (it.key() != "allOf") merged[it.key()] = it.value();
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::string pptr = Child(aptr, i);
      const Json* part = &parts[i];
      // A lone $ref is merged as what it points to (unless that has an allOf of its own).
      if (part->is_object() && part->contains("$ref") && (*part)["$ref"].is_string()) {
        bool lone = true;
        for (auto it = part->begin(); it != part->end(); ++it) {
          if (it.key() != "$ref" && Supported().count(it.key()) != 0) lone = false;
        }
        if (lone) {
          KILN_ASSIGN_OR_RETURN(const auto resolved,
                                Resolve((*part)["$ref"].get<std::string>(), Child(pptr, "$ref")));
          if (!resolved.first->is_object() || !resolved.first->contains("allOf")) {
            part = resolved.first;
          }
        }
      }
      if (part->is_boolean()) {
        if (part->get<bool>()) continue;
        return Error(pptr, "the schema `false` allows no value");
      }
      if (!part->is_object()) {
        return Error(pptr, "a schema must be an object or a boolean, not ", part->type_name());
      }
      KILN_ASSIGN_OR_RETURN(const bool possible, Merge(*part, pptr, &merged));
      if (!possible) return Error(pptr, "no type is allowed by every schema of allOf");
    }
    return merged;
  }

  StatusOr<std::string> VisitUnion(const Json& s, const std::string& ptr, const std::string& name) {
    const char* key = s.contains("anyOf") ? "anyOf" : "oneOf";
    if (s.contains("anyOf") && s.contains("oneOf")) {
      KILN_RETURN_IF_ERROR(Unsupported(ptr, "oneOf", " together with `anyOf`"));
    }
    const std::string uptr = Child(ptr, key);
    const Json& list = s[key];
    if (!list.is_array() || list.empty())
      return Error(uptr, "must be a non-empty array of schemas");
    // Sibling keywords apply to every alternative.
    Json siblings = Json::object();
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (it.key() != "anyOf" && it.key() != "oneOf" && Supported().count(it.key()) != 0) {
        siblings[it.key()] = it.value();
      }
    }
    std::vector<std::string> alts;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string aptr = Child(uptr, i);
      const Json& alt = list[i];
      if (alt.is_boolean() && !alt.get<bool>()) continue;
      const std::string alt_name = StrCat(name, "-", i);
      if (siblings.empty()) {
        KILN_ASSIGN_OR_RETURN(const std::string rule, VisitRule(alt, aptr, alt_name));
        alts.push_back(rule);
        continue;
      }
      Json merged = siblings;
      if (alt.is_object()) {
        KILN_ASSIGN_OR_RETURN(const bool possible, Merge(alt, aptr, &merged));
        if (!possible) continue;  // no type in common with the siblings
      } else if (!alt.is_boolean()) {
        return Error(aptr, "a schema must be an object or a boolean, not ", alt.type_name());
      }
      KILN_ASSIGN_OR_RETURN(const std::string rule, VisitRule(merged, aptr, alt_name));
      alts.push_back(rule);
    }
    if (alts.empty()) return Error(uptr, "every alternative is `false`");
    return GbnfAlternatives(alts);
  }

  // ---- Strings ----

  // A non-negative integer keyword; absent (or above kMaxSchemaRepeat: unsupported): nullopt.
  StatusOr<std::optional<int64_t>> Count(const Json& s, const std::string& ptr, const char* key) {
    const auto it = s.find(key);
    if (it == s.end()) return std::optional<int64_t>();
    const Json& v = *it;
    int64_t n = -1;
    if (v.is_number_unsigned()) {
      n = static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), uint64_t{1} << 62));
    } else if (v.is_number_integer()) {
      n = v.get<int64_t>();
    } else if (v.is_number_float() && v.get<double>() >= 0 && v.get<double>() < 1e15 &&
               std::floor(v.get<double>()) == v.get<double>()) {
      n = static_cast<int64_t>(v.get<double>());
    }
    if (n < 0) return Error(Child(ptr, key), "must be a non-negative integer, not ", Dump(v));
    if (n > kMaxSchemaRepeat) {
      KILN_RETURN_IF_ERROR(Unsupported(ptr, key, StrCat(" above ", kMaxSchemaRepeat)));
      return std::optional<int64_t>();
    }
    return std::optional<int64_t>(n);
  }

  StatusOr<std::string> VisitString(const Json& s, const std::string& ptr,
                                    const std::string& name) {
    const std::string quote = Lit("\"");
    KILN_ASSIGN_OR_RETURN(const std::optional<int64_t> min_length, Count(s, ptr, "minLength"));
    KILN_ASSIGN_OR_RETURN(const std::optional<int64_t> max_length, Count(s, ptr, "maxLength"));
    if (min_length && max_length && *min_length > *max_length) {
      return Error(ptr, "minLength ", *min_length, " is above maxLength ", *max_length);
    }
    if (const auto it = s.find("pattern"); it != s.end() && !it->is_string()) {
      return Error(Child(ptr, "pattern"), "must be a string, not ", it->type_name());
    }
    auto drop_lengths = [&](std::string_view why) -> Status {
      if (min_length) KILN_RETURN_IF_ERROR(Unsupported(ptr, "minLength", why));
      if (max_length) KILN_RETURN_IF_ERROR(Unsupported(ptr, "maxLength", why));
      return OkStatus();
    };
    if (const auto it = s.find("format"); it != s.end()) {
      if (!it->is_string()) return Error(Child(ptr, "format"), "must be a string");
      const std::string format = it->get<std::string>();
      if (std::find(std::begin(kFormats), std::end(kFormats), format) != std::end(kFormats)) {
        if (s.contains("pattern")) {
          KILN_RETURN_IF_ERROR(Unsupported(ptr, "pattern", " beside `format`"));
        }
        KILN_RETURN_IF_ERROR(drop_lengths(" beside `format`"));
        return Seq({quote,
                    rules_.Prim(format == "date"        ? "date"
                                : format == "time"      ? "time"
                                : format == "date-time" ? "date-time"
                                                        : "uuid"),
                    quote});
      }
      KILN_RETURN_IF_ERROR(Unsupported(
          ptr, "format", StrCat(": `", format, "` is none of date, time, date-time, uuid")));
    }
    if (const auto it = s.find("pattern"); it != s.end()) {
      KILN_RETURN_IF_ERROR(drop_lengths(" beside `pattern`"));
      const std::string& pattern = it->get_ref<const std::string&>();
      // The same pattern again (merged schemas copy theirs): the same rule.
      if (auto done = pattern_rules_.find(pattern); done != pattern_rules_.end()) {
        return Seq({quote, done->second, quote});
      }
      const std::string rule = rules_.Reserve(name + "-pattern");
      StatusOr<std::string> gbnf =
          RegexToGbnf(pattern, rule, {.json_string = true, .anchored = false},
                      [&](std::string_view hint) { return rules_.Reserve(hint); });
      if (!gbnf.ok()) return Error(Child(ptr, "pattern"), StatusMessage(gbnf.status()));
      pattern_rules_.emplace(pattern, rule);
      // One rule per line: `name ::= body`.
      for (size_t start = 0; start < gbnf->size();) {
        size_t end = gbnf->find('\n', start);
        if (end == std::string::npos) end = gbnf->size();
        const std::string line = gbnf->substr(start, end - start);
        const size_t sep = line.find(" ::= ");
        if (sep != std::string::npos) rules_.Define(line.substr(0, sep), line.substr(sep + 5));
        start = end + 1;
      }
      return Seq({quote, rule, quote});
    }
    if (!min_length && !max_length) return rules_.Prim("string");
    const std::string chars =
        GbnfRepeat(rules_.Prim("char"), static_cast<int>(min_length.value_or(0)),
                   max_length ? static_cast<int>(*max_length) : -1);
    return Seq({quote, chars, quote});
  }

  // ---- Numbers ----

  // minimum/maximum or exclusiveMinimum/exclusiveMaximum; nullopt if absent or unsupported.
  StatusOr<std::optional<Bound>> GetBound(const Json& s, const std::string& ptr, const char* key,
                                          bool inclusive) {
    const auto it = s.find(key);
    if (it == s.end() || it->is_boolean()) return std::optional<Bound>();
    if (!it->is_number()) return Error(Child(ptr, key), "must be a number, not ", Dump(*it));
    std::optional<Decimal> d = ParseDecimal(Dump(*it));
    if (!d) {
      KILN_RETURN_IF_ERROR(
          Unsupported(ptr, key, StrCat(" with more than ", kMaxBoundDigits, " digits")));
      return std::optional<Bound>();
    }
    return std::optional<Bound>(Bound{*d, inclusive, key});
  }

  // The tighter of two bounds (lower: the larger; upper: the smaller; a tie: the exclusive one).
  static std::optional<Bound> Tighter(std::optional<Bound> a, std::optional<Bound> b, bool lower) {
    if (!a) return b;
    if (!b) return a;
    const int c = Compare(a->value, b->value);
    if (c == 0) return a->inclusive ? b : a;
    return (c > 0) == lower ? a : b;
  }

  StatusOr<std::string> VisitNumber(const Json& s, const std::string& ptr, bool integer) {
    KILN_ASSIGN_OR_RETURN(std::optional<Bound> min, GetBound(s, ptr, "minimum", true));
    KILN_ASSIGN_OR_RETURN(std::optional<Bound> max, GetBound(s, ptr, "maximum", true));
    KILN_ASSIGN_OR_RETURN(std::optional<Bound> xmin, GetBound(s, ptr, "exclusiveMinimum", false));
    KILN_ASSIGN_OR_RETURN(std::optional<Bound> xmax, GetBound(s, ptr, "exclusiveMaximum", false));
    // Draft 4: exclusiveMinimum / exclusiveMaximum as booleans modify minimum / maximum.
    if (s.value("exclusiveMinimum", Json()).is_boolean() && s["exclusiveMinimum"].get<bool>() &&
        min) {
      min->inclusive = false;
    }
    if (s.value("exclusiveMaximum", Json()).is_boolean() && s["exclusiveMaximum"].get<bool>() &&
        max) {
      max->inclusive = false;
    }
    const std::optional<Bound> lo = Tighter(min, xmin, true), hi = Tighter(max, xmax, false);
    if (!lo && !hi) return rules_.Prim(integer ? "integer" : "number");
    auto describe = [](const Bound& b, bool lower) {
      return StrCat(b.keyword, " ", ToString(b.value), " (x ", lower ? ">" : "<",
                    b.inclusive ? "=" : "", " ", ToString(b.value), ")");
    };
    if (lo && hi) {
      const int c = Compare(lo->value, hi->value);
      if (c > 0 || (c == 0 && (!lo->inclusive || !hi->inclusive))) {
        return Error(ptr, "no number satisfies ", describe(*lo, true), " and ",
                     describe(*hi, false));
      }
    }
    if (!integer) return NumberRange(lo, hi);
    std::optional<Decimal> ilo, ihi;
    if (lo)
      ilo = lo->inclusive || !lo->value.fraction.empty() ? Ceil(lo->value) : AddOne(lo->value);
    if (hi)
      ihi = hi->inclusive || !hi->value.fraction.empty() ? Floor(hi->value) : SubOne(hi->value);
    if (ilo && ihi && Compare(*ilo, *ihi) > 0) {
      return Error(ptr, "no integer satisfies ", describe(*lo, true), " and ",
                   describe(*hi, false));
    }
    return IntegerRange(ilo, ihi);
  }

  // ---- Objects ----

  // Keys spelled differently from every name in `names` (names that JSON must escape are not
  // excluded).
  StatusOr<std::string> OtherKey(const std::vector<std::string>& names, const std::string& hint,
                                 const std::string& ptr) {
    std::vector<NameTrieNode> trie(1);
    for (const std::string& n : names) {
      if (std::any_of(n.begin(), n.end(), [](char c) {
            return c == '"' || c == '\\' || (static_cast<uint8_t>(c) < 0x20) || c == 0x7F;
          })) {
        continue;
      }
      size_t t = 0;
      for (size_t i = 0; i < n.size();) {
        size_t len = 1;
        const uint8_t c = static_cast<uint8_t>(n[i]);
        if (c >= 0xF0) {
          len = 4;
        } else if (c >= 0xE0) {
          len = 3;
        } else if (c >= 0xC0) {
          len = 2;
        }
        const auto [kid, added] = trie[t].kids.emplace(n.substr(i, len), trie.size());
        t = kid->second;
        if (added) trie.emplace_back();
        i += len;
      }
      trie[t].end = true;
    }
    const std::string char_rule = rules_.Prim("char");
    // The rest of a key from each node, kids (later in `trie`) first. A long rest becomes a rule,
    // so that no text is copied into more than a few enclosing ones.
    constexpr size_t kMaxInline = 1024;
    std::vector<std::string> rest(trie.size());
    size_t written = 0;  // the bytes of the texts in `rest`, each counted once
    for (size_t i = trie.size(); i-- > 0;) {
      std::vector<std::string> alts;
      std::string others = R"([^"\\\x7F\x00-\x1F)";
      for (const auto& [c, kid] : trie[i].kids) {
        std::string kid_rest = std::move(rest[kid]);
        written -= kid_rest.size();  // now in this node's text, or a rule's
        if (kid_rest.size() > kMaxInline) kid_rest = rules_.Add(hint, kid_rest);
        alts.push_back(Seq({Lit(c), kid_rest}));
        // The class excludes the next characters of the names.
        uint32_t v = static_cast<uint8_t>(c[0]);
        if (c.size() > 1) v &= 0x3F >> (c.size() - 1);
        for (size_t b = 1; b < c.size(); ++b) v = (v << 6) | (static_cast<uint8_t>(c[b]) & 0x3F);
        others += GbnfClassChar(v);
      }
      alts.push_back(
          Seq({"(" + others + R"(] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})))", char_rule + "*"}));
      if (!trie[i].end) alts.push_back("");
      rest[i] = GbnfAlternatives(alts);
      written += rest[i].size();
      if (written + rules_.bytes() > kMaxSchemaGbnfBytes) return TooLarge(ptr);
    }
    return Seq({Lit("\""), rest[0], Lit("\"")});
  }

  StatusOr<std::string> VisitObject(const Json& s, const std::string& ptr,
                                    const std::string& name) {
    struct Property {
      std::string key;
      const Json* schema;
      std::string ptr;
      bool required = false;
    };
    std::vector<Property> props;
    std::map<std::string, size_t, std::less<>> index;  // key -> its place in props
    const std::string pptr = Child(ptr, "properties");
    if (const auto it = s.find("properties"); it != s.end()) {
      if (!it->is_object()) return Error(pptr, "must be an object, not ", it->type_name());
      for (auto p = it->begin(); p != it->end(); ++p) {
        index.emplace(p.key(), props.size());
        props.push_back({p.key(), &p.value(), Child(pptr, p.key())});
      }
    }
    if (const auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) return Error(Child(ptr, "required"), "must be an array of names");
      for (const Json& r : *it) {
        if (!r.is_string()) {
          return Error(Child(ptr, "required"), "must be an array of names, not contain ", Dump(r));
        }
        const std::string& key = r.get_ref<const std::string&>();
        auto [p, added] = index.emplace(key, props.size());
        if (added) {
          // Required but not described: any value.
          props.push_back({key, &TrueSchema(), Child(pptr, key)});
        }
        props[p->second].required = true;
      }
    }
    const Json* additional = nullptr;  // the schema of other properties, if they are allowed
    if (const auto it = s.find("additionalProperties"); it != s.end()) {
      if (!it->is_boolean() && !it->is_object()) {
        return Error(Child(ptr, "additionalProperties"), "must be a boolean or a schema, not ",
                     it->type_name());
      }
      if (!(it->is_boolean() && !it->get<bool>())) additional = &*it;
    } else if (!strict_ && !s.contains("properties")) {
      additional = &TrueSchema();
    }

    const std::string space = rules_.Prim("space");
    const std::string sep = Seq({space, Lit(","), space});
    std::vector<std::string> kvs;  // per property (empty: never present)
    std::vector<std::string> names;
    for (const Property& p : props) {
      names.push_back(p.key);
      if (p.schema->is_boolean() && !p.schema->get<bool>()) {
        if (p.required) return Error(p.ptr, "the property is required but its schema is `false`");
        kvs.push_back("");
        continue;
      }
      const std::string prop_name = name + "-" + RuleName(p.key);
      KILN_ASSIGN_OR_RETURN(const std::string value, VisitRule(*p.schema, p.ptr, prop_name));
      kvs.push_back(rules_.Add(prop_name + "-kv",
                               Seq({Lit(Dump(Json(p.key))), space, Lit(":"), space, value})));
    }
    std::string extra_kv;
    if (additional != nullptr) {
      std::string key = rules_.Prim("string");
      if (!names.empty()) {
        KILN_ASSIGN_OR_RETURN(const std::string other, OtherKey(names, name + "-key-rest", ptr));
        key = rules_.Add(name + "-additional-key", other);
      }
      KILN_ASSIGN_OR_RETURN(
          const std::string value,
          VisitRule(*additional, Child(ptr, "additionalProperties"), name + "-additional"));
      extra_kv = rules_.Add(name + "-additional-kv", Seq({key, space, Lit(":"), space, value}));
    }

    // Members in order, each after a separator: required ones always, optional ones maybe, then
    // any number of additional ones. The first member present has no separator: one alternative
    // per possible first member (the optional ones up to the first required one).
    const size_t n = props.size();
    std::vector<size_t> firsts;  // i: property i first; n: an additional one
    size_t first_required = 0;
    for (; first_required < n; ++first_required) {
      if (!kvs[first_required].empty()) firsts.push_back(first_required);
      if (props[first_required].required) break;
    }
    const bool all_optional = first_required == n;
    if (all_optional && !extra_kv.empty()) firsts.push_back(n);
    // tails[i]: the members after property i - 1. Shared by several alternatives, they are a
    // chain of rules (linear in size); else the one needed is written inline, front to back
    // (building each tail from the next would copy the text once per property).
    auto item = [&](size_t i) -> std::string {
      if (kvs[i].empty()) return "";
      return props[i].required ? Seq({sep, kvs[i]}) : GbnfRepeat(Seq({sep, kvs[i]}), 0, 1);
    };
    std::vector<std::string> tails(n + 1);
    tails[n] = extra_kv.empty() ? "" : GbnfRepeat(Seq({sep, extra_kv}), 0, -1);
    if (firsts.size() > 1) {
      for (size_t i = n; i-- > 1;) {
        tails[i] = Seq({item(i), tails[i + 1]});
        if (!tails[i].empty() && !IsGbnfPrimary(tails[i])) {
          tails[i] = rules_.Add(name + "-tail", tails[i]);
        }
      }
    } else if (firsts.size() == 1 && firsts[0] + 1 < n) {
      std::string& tail = tails[firsts[0] + 1];
      for (size_t i = firsts[0] + 1; i < n; ++i) {
        const std::string it = item(i);
        if (it.empty()) continue;
        if (!tail.empty()) tail += ' ';
        tail += it;
      }
      if (!tails[n].empty()) tail = Seq({tail, tails[n]});
    }
    std::vector<std::string> alts;
    for (const size_t first : firsts) {
      alts.push_back(first == n ? Seq({extra_kv, tails[n]}) : Seq({kvs[first], tails[first + 1]}));
    }
    if (alts.empty()) return Seq({Lit("{"), space, Lit("}")});
    const std::string members = GbnfAlternatives(alts);
    if (!all_optional) return Seq({Lit("{"), space, members, space, Lit("}")});
    return Seq({Lit("{"), space, GbnfAlternatives({Seq({members, space}), ""}), Lit("}")});
  }

  // ---- Arrays ----

  StatusOr<std::string> VisitArray(const Json& s, const std::string& ptr, const std::string& name) {
    std::vector<const Json*> prefix;
    std::string prefix_ptr;
    const Json* rest = &TrueSchema();  // the schema of the items after the prefix; null: none
    std::string rest_ptr = Child(ptr, "items");
    const auto items = s.find("items");
    auto rest_from = [&](const Json& v, const std::string& vptr) -> Status {
      if (!v.is_boolean() && !v.is_object()) {
        return Error(vptr, "must be a schema, not ", v.type_name());
      }
      rest = v.is_boolean() && !v.get<bool>() ? nullptr : &v;
      rest_ptr = vptr;
      return OkStatus();
    };
    if (const auto it = s.find("prefixItems"); it != s.end()) {
      prefix_ptr = Child(ptr, "prefixItems");
      if (!it->is_array()) return Error(prefix_ptr, "must be an array of schemas");
      for (const Json& p : *it) prefix.push_back(&p);
      rest = nullptr;  // a tuple, unless `items` says more
      if (items != s.end()) KILN_RETURN_IF_ERROR(rest_from(*items, Child(ptr, "items")));
    } else if (items != s.end() && items->is_array()) {
      prefix_ptr = Child(ptr, "items");
      for (const Json& p : *items) prefix.push_back(&p);
      rest = nullptr;
      if (const auto it = s.find("additionalItems"); it != s.end()) {
        KILN_RETURN_IF_ERROR(rest_from(*it, Child(ptr, "additionalItems")));
      }
    } else if (items != s.end()) {
      KILN_RETURN_IF_ERROR(rest_from(*items, Child(ptr, "items")));
    }
    KILN_ASSIGN_OR_RETURN(const std::optional<int64_t> min_items, Count(s, ptr, "minItems"));
    KILN_ASSIGN_OR_RETURN(const std::optional<int64_t> max_items, Count(s, ptr, "maxItems"));
    if (min_items && max_items && *min_items > *max_items) {
      return Error(ptr, "minItems ", *min_items, " is above maxItems ", *max_items);
    }
    int64_t hi = max_items.value_or(-1);
    if (rest == nullptr && (hi < 0 || hi > static_cast<int64_t>(prefix.size()))) {
      hi = static_cast<int64_t>(prefix.size());
    }
    // A `false` item ends the array before it.
    for (size_t i = 0; i < prefix.size(); ++i) {
      if (prefix[i]->is_boolean() && !prefix[i]->get<bool>() &&
          (hi < 0 || static_cast<int64_t>(i) < hi)) {
        hi = static_cast<int64_t>(i);
      }
    }
    // A tuple is complete unless minItems (or the most items there can be) says less.
    int64_t lo = static_cast<int64_t>(prefix.size());
    if (hi >= 0) lo = std::min(lo, hi);
    if (min_items) lo = *min_items;
    if (hi >= 0 && lo > hi) {
      return Error(ptr, "minItems ", lo, " but the array can have at most ", hi, " items");
    }
    if (hi == 0) return Seq({Lit("["), rules_.Prim("space"), Lit("]")});

    std::vector<std::string> item_rules;
    for (size_t i = 0; i < prefix.size() && (hi < 0 || static_cast<int64_t>(i) < hi); ++i) {
      KILN_ASSIGN_OR_RETURN(const std::string r,
                            VisitRule(*prefix[i], Child(prefix_ptr, i), StrCat(name, "-", i)));
      item_rules.push_back(r);
    }
    std::string rest_rule;
    if (rest != nullptr && (hi < 0 || hi > static_cast<int64_t>(prefix.size()))) {
      KILN_ASSIGN_OR_RETURN(rest_rule, VisitRule(*rest, rest_ptr, name + "-item"));
    }
    const std::string space = rules_.Prim("space");
    const std::string sep = Seq({space, Lit(","), space});
    // The items after the first: each prefix item j after a separator, wrapping the items after
    // it in `( ... )?` when it is optional (j >= lo); then the rest items. Written front to back
    // (nesting each item's text in the one before copied it once per item).
    std::string after;
    int64_t opened = 0;
    const int64_t prefix_end = static_cast<int64_t>(item_rules.size());
    for (int64_t j = 1; j < prefix_end; ++j) {
      if (!after.empty()) after += ' ';
      if (j >= lo) {
        after += '(';
        ++opened;
      }
      after += Seq({sep, item_rules[j]});
    }
    const int64_t j = std::max<int64_t>(prefix_end, 1);
    if (hi < 0 || j < hi) {
      const std::string rest_items =
          GbnfRepeat(Seq({sep, rest_rule}), static_cast<int>(std::max<int64_t>(lo - j, 0)),
                     hi < 0 ? -1 : static_cast<int>(hi - j));
      if (!after.empty() && !rest_items.empty()) after += ' ';
      after += rest_items;
    }
    for (int64_t i = 0; i < opened; ++i) after += ")?";
    const std::string first = item_rules.empty() ? rest_rule : item_rules[0];
    const std::string elements = Seq({first, after});
    if (lo > 0) return Seq({Lit("["), space, elements, space, Lit("]")});
    return Seq({Lit("["), space, GbnfAlternatives({Seq({elements, space}), ""}), Lit("]")});
  }

  const Json& root_;
  const bool strict_;
  RuleSet rules_;
  std::map<std::string, std::string> ref_rules_;      // JSON pointer -> rule
  std::map<std::string, std::string> pattern_rules_;  // `pattern` -> rule
  std::vector<std::string> ignored_;
  std::set<std::string> ignored_set_;  // the entries of ignored_, to find them fast
  int depth_ = 0;
  int visits_ = 0;  // Visit calls, at most kMaxSchemaVisits
};

}  // namespace

StatusOr<JsonSchemaGrammar> JsonSchemaToGbnf(const nlohmann::ordered_json& schema,
                                             const JsonSchemaOptions& options) {
  return Converter(schema, options).Run();
}

StatusOr<JsonSchemaGrammar> JsonSchemaToGbnf(const nlohmann::json& schema,
                                             const JsonSchemaOptions& options) {
  return JsonSchemaToGbnf(nlohmann::ordered_json(schema), options);
}

std::string JsonObjectGbnf() {
  RuleSet rules;
  rules.Reserve("root");
  rules.Define("root", rules.Prim("object"));
  return rules.Text();
}

}  // namespace kiln::grammar
