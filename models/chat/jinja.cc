#include "models/chat/jinja.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>
#include <optional>
#include <vector>

#include "models/io/errors.h"
#include "models/tokenizer/unicode.h"

namespace kiln::models::jinja {

// ============================================================================================
// Values: Python-like, reference semantics for lists, dicts and namespaces.
// ============================================================================================
struct Error {
  Status status;
};

struct Value;
using List = std::vector<Value>;
struct Dict;

struct Value {
  enum Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict };
  Kind kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // string value, or the name of an undefined value
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  bool is_namespace = false;

  static Value Undefined(std::string name) {
    Value v;
    v.s = std::move(name);
    return v;
  }
  static Value None() {
    Value v;
    v.kind = kNone;
    return v;
  }
  static Value Bool(bool x) {
    Value v;
    v.kind = kBool;
    v.b = x;
    return v;
  }
  static Value Int(int64_t x) {
    Value v;
    v.kind = kInt;
    v.i = x;
    return v;
  }
  static Value Float(double x) {
    Value v;
    v.kind = kFloat;
    v.f = x;
    return v;
  }
  static Value Str(std::string x) {
    Value v;
    v.kind = kString;
    v.s = std::move(x);
    return v;
  }
  static Value MakeList(List items = {});
  static Value MakeDict();

  bool undefined() const { return kind == kUndefined; }
  bool is_number() const { return kind == kInt || kind == kFloat || kind == kBool; }
  double num() const {
    return kind == kFloat ? f : kind == kBool ? (b ? 1 : 0) : static_cast<double>(i);
  }
};

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* Find(std::string_view k) const {
    for (const auto& [key, v] : items) {
      if (key == k) return &v;
    }
    return nullptr;
  }
  void Set(const std::string& k, Value v) {
    for (auto& [key, old] : items) {
      if (key == k) {
        old = std::move(v);
        return;
      }
    }
    items.emplace_back(k, std::move(v));
  }
};

// Lists, dicts and namespaces have reference semantics, so a template can make a cycle
// (`{% set ns.me = ns %}`, or two namespaces holding each other) that shared ownership alone
// never frees.
// While a Render runs, every container it makes is noted here; at its end the ones still alive
// are emptied, which breaks any cycle (no value outlives a render: it returns a string).
struct RenderContainers {
  std::vector<std::weak_ptr<List>> lists;
  std::vector<std::weak_ptr<Dict>> dicts;
};
thread_local RenderContainers* tl_containers = nullptr;

Value Value::MakeList(List items) {
  Value v;
  v.kind = kList;
  v.list = std::make_shared<List>(std::move(items));
  if (tl_containers != nullptr) tl_containers->lists.push_back(v.list);
  return v;
}

Value Value::MakeDict() {
  Value v;
  v.kind = kDict;
  v.dict = std::make_shared<Dict>();
  if (tl_containers != nullptr) tl_containers->dicts.push_back(v.dict);
  return v;
}

// Notes the containers of one Render and empties the survivors when it ends.
class ContainerScope {
 public:
  ContainerScope() : saved_(tl_containers) { tl_containers = &mine_; }
  ~ContainerScope() {
    tl_containers = saved_;
    // Move the contents out before they are destroyed: destroying an element may release
    // another container of the list being walked.
    std::vector<List> lists;
    std::vector<Dict> dicts;
    for (auto& w : mine_.lists) {
      if (std::shared_ptr<List> l = w.lock()) {
        lists.push_back(std::move(*l));
        l->clear();
      }
    }
    for (auto& w : mine_.dicts) {
      if (std::shared_ptr<Dict> d = w.lock()) {
        dicts.push_back(std::move(*d));
        d->items.clear();
      }
    }
  }
  ContainerScope(const ContainerScope&) = delete;
  ContainerScope& operator=(const ContainerScope&) = delete;

 private:
  RenderContainers mine_;
  RenderContainers* saved_;
};

std::string_view TypeName(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
      return "undefined";
    case Value::kNone:
      return "NoneType";
    case Value::kBool:
      return "bool";
    case Value::kInt:
      return "int";
    case Value::kFloat:
      return "float";
    case Value::kString:
      return "str";
    case Value::kList:
      return "list";
    case Value::kDict:
      return v.is_namespace ? "Namespace" : "dict";
  }
  return "?";
}

Value FromJson(const nlohmann::ordered_json& j, int depth = 0) {
  if (depth > 64) throw Error{InvalidArgument("template input nested deeper than 64 levels")};
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::Int(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return Value::Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::Str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Value v = Value::MakeList();
      for (const auto& e : j) v.list->push_back(FromJson(e, depth + 1));
      return v;
    }
    case nlohmann::ordered_json::value_t::object: {
      Value v = Value::MakeDict();
      for (auto it = j.begin(); it != j.end(); ++it)
        v.dict->items.emplace_back(it.key(), FromJson(it.value(), depth + 1));
      return v;
    }
    default:
      return Value::None();
  }
}

// Python's repr() of a float: shortest round-trip digits, fixed notation for 1e-4 <= |x| < 1e16.
std::string FloatRepr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::stoi(sci.substr(e + 1));
  bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits.push_back(c);
  }
  std::string out;
  if (exp >= -5 + 1 && exp < 16) {  // Python: -4 <= exp < 16
    if (exp >= 0) {
      if (static_cast<int>(digits.size()) <= exp + 1) {
        out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
      }
    } else {
      out = "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

std::string Repr(const Value& v);

std::string PyStrRepr(const std::string& s) {
  // Python picks single quotes unless the string contains ' and no ".
  char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == static_cast<unsigned char>(q) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  out.push_back(q);
  return out;
}

// Python str().
std::string ToStr(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
      return "";
    case Value::kNone:
      return "None";
    case Value::kBool:
      return v.b ? "True" : "False";
    case Value::kInt:
      return std::to_string(v.i);
    case Value::kFloat:
      return FloatRepr(v.f);
    case Value::kString:
      return v.s;
    default:
      return Repr(v);
  }
}

std::string Repr(const Value& v) {
  switch (v.kind) {
    case Value::kString:
      return PyStrRepr(v.s);
    case Value::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += ", ";
        out += Repr((*v.list)[k]);
      }
      return out + "]";
    }
    case Value::kDict: {
      if (v.is_namespace) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out += PyStrRepr(k) + ": " + Repr(x);
      }
      return out + "}";
    }
    default:
      return ToStr(v);
  }
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return false;
    case Value::kBool:
      return v.b;
    case Value::kInt:
      return v.i != 0;
    case Value::kFloat:
      return v.f != 0;
    case Value::kString:
      return !v.s.empty();
    case Value::kList:
      return !v.list->empty();
    case Value::kDict:
      return v.is_namespace || !v.dict->items.empty();
  }
  return false;
}

bool Equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.num() == b.num();
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return true;
    case Value::kString:
      return a.s == b.s;
    case Value::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!Equal((*a.list)[k], (*b.list)[k])) return false;
      }
      return true;
    case Value::kDict:
      if (a.dict == b.dict) return true;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, x] : a.dict->items) {
        const Value* y = b.dict->Find(k);
        if (y == nullptr || !Equal(x, *y)) return false;
      }
      return true;
    default:
      return false;
  }
}

// json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys).
void ToJson(const Value& v, int indent, bool sort_keys, int depth, std::string* out) {
  auto newline = [&](int d) {
    if (indent < 0) return;
    out->push_back('\n');
    out->append(static_cast<size_t>(indent * d), ' ');
  };
  const char* item_sep = indent < 0 ? ", " : ",";
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
      *out += "null";
      return;
    case Value::kBool:
      *out += v.b ? "true" : "false";
      return;
    case Value::kInt:
      *out += std::to_string(v.i);
      return;
    case Value::kFloat:
      *out += std::isnan(v.f)   ? "NaN"
              : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                                : FloatRepr(v.f);
      return;
    case Value::kString: {
      out->push_back('"');
      for (unsigned char c : v.s) {
        switch (c) {
          case '"':
            *out += "\\\"";
            break;
          case '\\':
            *out += "\\\\";
            break;
          case '\n':
            *out += "\\n";
            break;
          case '\r':
            *out += "\\r";
            break;
          case '\t':
            *out += "\\t";
            break;
          case '\b':
            *out += "\\b";
            break;
          case '\f':
            *out += "\\f";
            break;
          default:
            if (c < 0x20) {
              char b[8];
              std::snprintf(b, sizeof(b), "\\u%04x", c);
              *out += b;
            } else {
              out->push_back(static_cast<char>(c));
            }
        }
      }
      out->push_back('"');
      return;
    }
    case Value::kList: {
      if (v.list->empty()) {
        *out += "[]";
        return;
      }
      out->push_back('[');
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) *out += item_sep;
        newline(depth + 1);
        ToJson((*v.list)[k], indent, sort_keys, depth + 1, out);
      }
      newline(depth);
      out->push_back(']');
      return;
    }
    case Value::kDict: {
      if (v.dict->items.empty()) {
        *out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out->push_back('{');
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) *out += item_sep;
        newline(depth + 1);
        ToJson(Value::Str(items[k]->first), indent, sort_keys, depth + 1, out);
        *out += ": ";
        ToJson(items[k]->second, indent, sort_keys, depth + 1, out);
      }
      newline(depth);
      out->push_back('}');
      return;
    }
  }
}

// ============================================================================================
// AST
// ============================================================================================
struct Node {
  enum Type {
    kBody,
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kBreak,
    kContinue,
    kLiteral,
    kName,
    kListLit,
    kTupleLit,
    kDictLit,
    kAttr,
    kIndex,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kUnary,
    kBinary,
    kCompare,
    kAnd,
    kOr,
    kNot,
    kCond,
  };
  Type type;
  int line = 0, col = 0;
  std::string str;  // name, operator, attribute, filter/test name, text
  Value literal;
  bool negated = false;  // `is not`
  std::vector<std::unique_ptr<Node>> kids;
  std::vector<std::string> ops;                                       // kCompare
  std::vector<std::pair<std::string, std::unique_ptr<Node>>> kwargs;  // calls
  std::vector<std::string> names;                                     // for / set targets
  std::unique_ptr<Node> a, b, c;
  std::vector<std::unique_ptr<Node>> body, else_body;
  std::vector<std::pair<std::unique_ptr<Node>, std::vector<std::unique_ptr<Node>>>>
      branches;  // kIf
};

[[noreturn]] void Fail(const std::string& where, int line, int col, const std::string& msg) {
  throw Error{InvalidArgument(where, ":", line, ":", col, ": ", msg)};
}

// ============================================================================================
// Lexer: template text -> segments (text / {{ }} / {% %}), whitespace control applied.
// ============================================================================================
struct Segment {
  enum Kind { kText, kOutput, kStmt } kind;
  std::string text;
  int line, col;  // of the tag content (or text) start
};

void LineCol(std::string_view src, size_t pos, int* line, int* col) {
  *line = 1 + static_cast<int>(std::count(src.begin(), src.begin() + pos, '\n'));
  size_t nl = src.rfind('\n', pos == 0 ? 0 : pos - 1);
  *col = static_cast<int>(pos - (nl == std::string_view::npos || pos == 0 ? 0 : nl + 1)) + 1;
  if (pos > 0 && nl == std::string_view::npos) *col = static_cast<int>(pos) + 1;
}

std::vector<Segment> Lex(std::string_view src, const std::string& name) {
  std::vector<Segment> segs;
  size_t pos = 0;
  bool strip_next = false;  // previous tag ended with -
  bool trim_next = false;   // previous block tag: drop one newline (trim_blocks)
  auto add_text = [&](size_t b, size_t e, bool lstrip_all_right, bool lstrip_block) {
    std::string t(src.substr(b, e - b));
    if (strip_next) {
      size_t k = t.find_first_not_of(" \t\r\n\f\v");
      t.erase(0, k == std::string::npos ? t.size() : k);
    } else if (trim_next) {
      if (t.compare(0, 2, "\r\n") == 0) {
        t.erase(0, 2);
      } else if (!t.empty() && t[0] == '\n') {
        t.erase(0, 1);
      }
    }
    if (lstrip_all_right) {
      size_t k = t.find_last_not_of(" \t\r\n\f\v");
      t.erase(k == std::string::npos ? 0 : k + 1);
    } else if (lstrip_block) {
      size_t nl = t.rfind('\n');
      size_t start = nl == std::string::npos ? 0 : nl + 1;
      bool at_line_start = nl != std::string::npos || b == 0 || (b > 0 && src[b - 1] == '\n');
      // Text that began right after a tag on the same line is not at the start of a line.
      if (nl == std::string::npos && b > 0 && src[b - 1] != '\n') at_line_start = false;
      if (at_line_start && t.find_first_not_of(" \t", start) == std::string::npos) t.erase(start);
    }
    strip_next = trim_next = false;
    int line, col;
    LineCol(src, b, &line, &col);
    if (!t.empty()) segs.push_back({Segment::kText, std::move(t), line, col});
  };
  while (pos < src.size()) {
    size_t open = src.find('{', pos);
    while (open != std::string_view::npos && open + 1 < src.size() && src[open + 1] != '{' &&
           src[open + 1] != '%' && src[open + 1] != '#') {
      open = src.find('{', open + 1);
    }
    if (open == std::string_view::npos || open + 1 >= src.size()) {
      add_text(pos, src.size(), false, false);
      break;
    }
    char kind = src[open + 1];
    size_t inner = open + 2;
    bool left_minus = inner < src.size() && src[inner] == '-';
    bool left_plus = inner < src.size() && src[inner] == '+';
    if (left_minus || left_plus) ++inner;
    add_text(pos, open, left_minus, (kind == '%' || kind == '#') && !left_plus);
    int line, col;
    LineCol(src, open, &line, &col);
    if (kind == '#') {
      size_t close = src.find("#}", inner);
      if (close == std::string_view::npos) Fail(name, line, col, "unterminated comment {# ... #}");
      strip_next = close > inner && src[close - 1] == '-';
      trim_next = !strip_next;
      pos = close + 2;
      continue;
    }
    const char* closer = kind == '{' ? "}}" : "%}";
    // Find the closer outside string literals.
    size_t k = inner;
    char quote = 0;
    int depth = 0;
    for (; k + 1 < src.size(); ++k) {
      char c = src[k];
      if (quote) {
        if (c == '\\') {
          ++k;
        } else if (c == quote) {
          quote = 0;
        }
        continue;
      }
      if (c == '\'' || c == '"') {
        quote = c;
        continue;
      }
      // Braces of dict literals nest, as in Jinja's lexer: `{{ {'a': {'b': 1}} }}`.
      if (depth > 0 && c == '}') {
        --depth;
        continue;
      }
      if (c == closer[0] && src[k + 1] == closer[1]) break;
      if (c == '{') ++depth;
    }
    if (k + 1 >= src.size()) {
      Fail(name, line, col, Cat("unterminated ", kind == '{' ? "{{ ... }}" : "{% ... %}"));
    }
    size_t content_end = k;
    bool right_minus = content_end > inner && src[content_end - 1] == '-';
    bool right_plus = content_end > inner && src[content_end - 1] == '+';
    if (right_minus || right_plus) --content_end;
    std::string content(src.substr(inner, content_end - inner));
    int cline, ccol;
    LineCol(src, inner, &cline, &ccol);
    pos = k + 2;
    strip_next = right_minus;
    trim_next = kind == '%' && !right_minus && !right_plus;
    // {% raw %} ... {% endraw %}: verbatim.
    std::string trimmed = content;
    trimmed.erase(0, trimmed.find_first_not_of(" \t\r\n"));
    trimmed.erase(trimmed.find_last_not_of(" \t\r\n") + 1);
    if (kind == '%' && trimmed == "raw") {
      size_t search = pos;
      while (true) {
        size_t o = src.find("{%", search);
        if (o == std::string_view::npos) Fail(name, line, col, "{% raw %} without {% endraw %}");
        size_t q = o + 2;
        bool lm = q < src.size() && src[q] == '-';
        if (lm || (q < src.size() && src[q] == '+')) ++q;
        while (q < src.size() && std::isspace(static_cast<unsigned char>(src[q]))) ++q;
        if (src.compare(q, 6, "endraw") == 0) {
          size_t c2 = src.find("%}", q);
          if (c2 == std::string_view::npos) Fail(name, line, col, "unterminated {% endraw %}");
          add_text(pos, o, lm, !lm);
          strip_next = src[c2 - 1] == '-';
          trim_next = !strip_next;
          pos = c2 + 2;
          break;
        }
        search = o + 2;
      }
      continue;
    }
    segs.push_back(
        {kind == '{' ? Segment::kOutput : Segment::kStmt, std::move(content), cline, ccol});
  }
  return segs;
}

// ============================================================================================
// Expression tokens and parser
// ============================================================================================
struct Tok {
  enum Kind { kName, kInt, kFloat, kString, kOp, kEnd } kind;
  std::string text;
  int64_t i = 0;
  double f = 0;
  int line, col;
};

std::vector<Tok> Tokenize(const std::string& s, int line, int col, const std::string& name) {
  std::vector<Tok> out;
  size_t k = 0;
  auto advance = [&](size_t n) {
    for (size_t q = 0; q < n && k < s.size(); ++q, ++k) {
      if (s[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
  };
  static const char* kOps[] = {"==", "!=", "<=", ">=", "//", "**", "<", ">", "+",
                               "-",  "*",  "/",  "%",  "~",  "|",  ".", ",", ":",
                               "(",  ")",  "[",  "]",  "{",  "}",  "="};
  while (k < s.size()) {
    char c = s[k];
    if (std::isspace(static_cast<unsigned char>(c))) {
      advance(1);
      continue;
    }
    Tok t{Tok::kOp, "", 0, 0, line, col};
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = k;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      t.kind = Tok::kName;
      t.text = s.substr(k, e - k);
      advance(e - k);
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = k;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      bool is_float = false;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        is_float = true;
        ++e;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      }
      if (e < s.size() && (s[e] == 'e' || s[e] == 'E')) {
        size_t q = e + 1;
        if (q < s.size() && (s[q] == '+' || s[q] == '-')) ++q;
        if (q < s.size() && std::isdigit(static_cast<unsigned char>(s[q]))) {
          is_float = true;
          e = q;
          while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
        }
      }
      std::string num = s.substr(k, e - k);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      if (is_float) {
        t.kind = Tok::kFloat;
        t.f = std::strtod(num.c_str(), nullptr);
      } else {
        t.kind = Tok::kInt;
        auto r = std::from_chars(num.data(), num.data() + num.size(), t.i);
        if (r.ec != std::errc()) Fail(name, line, col, "integer literal out of range");
      }
      advance(e - k);
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t e = k + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] == '\\' && e + 1 < s.size()) {
          char n = s[++e];
          switch (n) {
            case 'n':
              v.push_back('\n');
              break;
            case 't':
              v.push_back('\t');
              break;
            case 'r':
              v.push_back('\r');
              break;
            case '0':
              v.push_back('\0');
              break;
            case '\\':
              v.push_back('\\');
              break;
            case '\'':
              v.push_back('\'');
              break;
            case '"':
              v.push_back('"');
              break;
            case 'x':
            case 'u': {
              // \xNN and \uNNNN, as in Python string literals.
              size_t digits = n == 'x' ? 2 : 4;
              uint32_t cp = 0;
              bool ok = e + digits < s.size();
              for (size_t d = 1; ok && d <= digits; ++d) {
                char h = s[e + d];
                int x = std::isdigit(static_cast<unsigned char>(h)) ? h - '0'
                        : (h >= 'a' && h <= 'f')                    ? h - 'a' + 10
                        : (h >= 'A' && h <= 'F')                    ? h - 'A' + 10
                                                                    : -1;
                ok = x >= 0;
                cp = cp * 16 + static_cast<uint32_t>(x);
              }
              if (!ok)
                Fail(name, line, col,
                     Cat("invalid \\", std::string(1, n), " escape in string literal"));
              if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xFFFD;  // lone surrogates are not UTF-8
              utf8::AppendCodepoint(cp, &v);
              e += digits;
              break;
            }
            default:
              v.push_back('\\');
              v.push_back(n);
          }
        } else {
          v.push_back(s[e]);
        }
      }
      if (e >= s.size()) Fail(name, line, col, "unterminated string literal");
      t.kind = Tok::kString;
      t.text = std::move(v);
      advance(e + 1 - k);
    } else {
      bool found = false;
      for (const char* op : kOps) {
        size_t n = std::strlen(op);
        if (s.compare(k, n, op) == 0) {
          t.text = op;
          advance(n);
          found = true;
          break;
        }
      }
      if (!found) Fail(name, line, col, Cat("unexpected character '", std::string(1, c), "'"));
    }
    out.push_back(std::move(t));
  }
  out.push_back({Tok::kEnd, "", 0, 0, line, col});
  return out;
}

class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, const std::string& name) : t_(std::move(toks)), name_(name) {}

  const Tok& Peek(size_t ahead = 0) const { return t_[std::min(p_ + ahead, t_.size() - 1)]; }
  bool AtEnd() const { return Peek().kind == Tok::kEnd; }
  bool IsOp(const char* op, size_t ahead = 0) const {
    return Peek(ahead).kind == Tok::kOp && Peek(ahead).text == op;
  }
  bool IsName(const char* n, size_t ahead = 0) const {
    return Peek(ahead).kind == Tok::kName && Peek(ahead).text == n;
  }
  const Tok& Next() { return t_[std::min(p_++, t_.size() - 1)]; }
  void Expect(const char* op) {
    if (!IsOp(op)) Err(Cat("expected '", op, "'"));
    ++p_;
  }
  std::string ExpectName() {
    if (Peek().kind != Tok::kName) Err("expected a name");
    return Next().text;
  }
  [[noreturn]] void Err(const std::string& msg) const {
    const Tok& t = Peek();
    std::string got =
        t.kind == Tok::kEnd ? "end of tag" : Cat("'", t.text.empty() ? "literal" : t.text, "'");
    Fail(name_, t.line, t.col, Cat(msg, ", got ", got));
  }
  void ExpectEnd() {
    if (!AtEnd()) Err("unexpected token");
  }

  std::unique_ptr<Node> NewNode(Node::Type type, const Tok& at) {
    auto n = std::make_unique<Node>();
    n->type = type;
    n->line = at.line;
    n->col = at.col;
    return n;
  }

  // expression := or ['if' or ['else' expression]]
  std::unique_ptr<Node> Expression() {
    DepthGuard guard(this);
    auto node = Or();
    if (IsName("if")) {
      const Tok& at = Next();
      auto n = NewNode(Node::kCond, at);
      n->b = Or();  // condition
      n->a = std::move(node);
      if (IsName("else")) {
        Next();
        n->c = Expression();
      }
      return n;
    }
    return node;
  }
  std::unique_ptr<Node> Or() {
    auto l = And();
    while (IsName("or")) {
      auto n = NewNode(Node::kOr, Next());
      n->a = std::move(l);
      n->b = And();
      l = std::move(n);
    }
    return l;
  }
  std::unique_ptr<Node> And() {
    auto l = Not();
    while (IsName("and")) {
      auto n = NewNode(Node::kAnd, Next());
      n->a = std::move(l);
      n->b = Not();
      l = std::move(n);
    }
    return l;
  }
  std::unique_ptr<Node> Not() {
    DepthGuard guard(this);
    if (IsName("not")) {
      auto n = NewNode(Node::kNot, Next());
      n->a = Not();
      return n;
    }
    return Compare();
  }
  std::unique_ptr<Node> Compare() {
    auto first = Math1();
    std::unique_ptr<Node> cmp;
    while (true) {
      std::string op;
      if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp("<=") || IsOp(">") || IsOp(">=")) {
        op = Peek().text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && IsName("in", 1)) {
        op = "not in";
        Next();
        Next();
      } else {
        break;
      }
      if (!cmp) {
        cmp = NewNode(Node::kCompare, Peek());
        cmp->line = first->line;
        cmp->col = first->col;
        cmp->kids.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(Math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  std::unique_ptr<Node> Binary(std::unique_ptr<Node> l, const Tok& at, std::unique_ptr<Node> r) {
    auto n = NewNode(Node::kBinary, at);
    n->str = at.text;
    n->a = std::move(l);
    n->b = std::move(r);
    return n;
  }
  std::unique_ptr<Node> Math1() {
    auto l = Concat();
    while (IsOp("+") || IsOp("-")) {
      Tok at = Next();
      l = Binary(std::move(l), at, Concat());
    }
    return l;
  }
  std::unique_ptr<Node> Concat() {
    auto l = Math2();
    while (IsOp("~")) {
      Tok at = Next();
      l = Binary(std::move(l), at, Math2());
    }
    return l;
  }
  std::unique_ptr<Node> Math2() {
    auto l = Pow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      Tok at = Next();
      l = Binary(std::move(l), at, Pow());
    }
    return l;
  }
  std::unique_ptr<Node> Pow() {
    auto l = Unary(true);
    while (IsOp("**")) {
      Tok at = Next();
      l = Binary(std::move(l), at, Unary(true));
    }
    return l;
  }
  std::unique_ptr<Node> Unary(bool with_filter) {
    DepthGuard guard(this);
    std::unique_ptr<Node> node;
    if (IsOp("-") || IsOp("+")) {
      Tok at = Next();
      node = NewNode(Node::kUnary, at);
      node->str = at.text;
      node->a = Unary(false);
    } else {
      node = Postfix(Primary());
    }
    if (with_filter) node = FilterExpr(std::move(node));
    return node;
  }
  void Args(Node* n) {
    Expect("(");
    while (!IsOp(")")) {
      if (Peek().kind == Tok::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        Next();
        n->kwargs.emplace_back(key, Expression());
      } else {
        if (!n->kwargs.empty()) Err("positional argument after keyword argument");
        n->kids.push_back(Expression());
      }
      if (!IsOp(",")) break;
      Next();
    }
    Expect(")");
  }
  std::unique_ptr<Node> Postfix(std::unique_ptr<Node> node) {
    while (true) {
      if (IsOp(".")) {
        Tok at = Next();
        auto n = NewNode(Node::kAttr, at);
        if (Peek().kind == Tok::kInt) {
          n->type = Node::kIndex;
          n->b = NewNode(Node::kLiteral, Peek());
          n->b->literal = Value::Int(Next().i);
        } else {
          n->str = ExpectName();
        }
        n->a = std::move(node);
        node = std::move(n);
      } else if (IsOp("[")) {
        Tok at = Next();
        std::unique_ptr<Node> parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!IsOp(":") && !IsOp("]")) parts[k] = Expression();
          if (k < 2 && IsOp(":")) {
            slice = true;
            Next();
          } else {
            break;
          }
        }
        Expect("]");
        auto n = NewNode(slice ? Node::kSlice : Node::kIndex, at);
        n->a = std::move(node);
        if (slice) {
          for (auto& p : parts) n->kids.push_back(std::move(p));
        } else {
          if (!parts[0]) Fail(name_, at.line, at.col, "empty subscript []");
          n->b = std::move(parts[0]);
        }
        node = std::move(n);
      } else if (IsOp("(")) {
        auto n = NewNode(Node::kCall, Peek());
        n->a = std::move(node);
        Args(n.get());
        node = std::move(n);
      } else {
        return node;
      }
    }
  }
  std::unique_ptr<Node> FilterExpr(std::unique_ptr<Node> node) {
    while (true) {
      if (IsOp("|")) {
        Next();
        auto n = NewNode(Node::kFilter, Peek());
        n->str = ExpectName();
        while (IsOp(".")) {  // dotted filter names are not used; keep the error clear
          Err("unsupported dotted filter name");
        }
        n->a = std::move(node);
        if (IsOp("(")) Args(n.get());
        node = std::move(n);
      } else if (IsName("is")) {
        Next();
        auto n = NewNode(Node::kTest, Peek());
        if (IsName("not")) {
          Next();
          n->negated = true;
        }
        if (Peek().kind == Tok::kName) {
          n->str = Next().text;
        } else if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp(">") || IsOp("<=") || IsOp(">=")) {
          n->str = Next().text;
        } else {
          Err("expected a test name after 'is'");
        }
        n->a = std::move(node);
        if (IsOp("(")) {
          Args(n.get());
        } else if ((Peek().kind == Tok::kString || Peek().kind == Tok::kInt ||
                    Peek().kind == Tok::kFloat ||
                    (Peek().kind == Tok::kName && !IsName("else") && !IsName("and") &&
                     !IsName("or") && !IsName("if") && !IsName("not") && !IsName("in") &&
                     !IsName("is"))) ||
                   IsOp("[") || IsOp("{")) {
          n->kids.push_back(Postfix(Primary()));
        }
        node = std::move(n);
      } else if (IsOp("(")) {
        auto n = NewNode(Node::kCall, Peek());
        n->a = std::move(node);
        Args(n.get());
        node = std::move(n);
      } else {
        return node;
      }
    }
  }
  std::unique_ptr<Node> Primary() {
    const Tok& t = Peek();
    if (t.kind == Tok::kString) {
      auto n = NewNode(Node::kLiteral, t);
      std::string s;
      while (Peek().kind == Tok::kString) s += Next().text;  // adjacent literals concatenate
      n->literal = Value::Str(std::move(s));
      return n;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      auto n = NewNode(Node::kLiteral, t);
      n->literal = t.kind == Tok::kInt ? Value::Int(t.i) : Value::Float(t.f);
      Next();
      return n;
    }
    if (t.kind == Tok::kName) {
      auto n = NewNode(Node::kLiteral, t);
      if (t.text == "true" || t.text == "True") {
        n->literal = Value::Bool(true);
      } else if (t.text == "false" || t.text == "False") {
        n->literal = Value::Bool(false);
      } else if (t.text == "none" || t.text == "None") {
        n->literal = Value::None();
      } else {
        n->type = Node::kName;
        n->str = t.text;
      }
      Next();
      return n;
    }
    if (IsOp("(")) {
      Tok at = Next();
      if (IsOp(")")) {
        Next();
        return NewNode(Node::kTupleLit, at);
      }
      auto first = Expression();
      if (!IsOp(",")) {
        Expect(")");
        return first;
      }
      auto n = NewNode(Node::kTupleLit, at);
      n->kids.push_back(std::move(first));
      while (IsOp(",")) {
        Next();
        if (IsOp(")")) break;
        n->kids.push_back(Expression());
      }
      Expect(")");
      return n;
    }
    if (IsOp("[")) {
      auto n = NewNode(Node::kListLit, Next());
      while (!IsOp("]")) {
        n->kids.push_back(Expression());
        if (!IsOp(",")) break;
        Next();
      }
      Expect("]");
      return n;
    }
    if (IsOp("{")) {
      auto n = NewNode(Node::kDictLit, Next());
      while (!IsOp("}")) {
        n->kids.push_back(Expression());
        Expect(":");
        n->kids.push_back(Expression());
        if (!IsOp(",")) break;
        Next();
      }
      Expect("}");
      return n;
    }
    Err("expected an expression");
  }

  // Bounds recursion so that hostile templates cannot exhaust the stack.
  struct DepthGuard {
    explicit DepthGuard(ExprParser* p) : p(p) {
      if (++p->depth_ > kMaxDepth) p->Err("expression nested too deeply");
    }
    ~DepthGuard() { --p->depth_; }
    ExprParser* p;
  };
  static constexpr int kMaxDepth = 200;

 private:
  std::vector<Tok> t_;
  size_t p_ = 0;
  const std::string& name_;
  int depth_ = 0;
};

// ============================================================================================
// Statement parser
// ============================================================================================
class StmtParser {
 public:
  StmtParser(std::vector<Segment> segs, const std::string& name)
      : segs_(std::move(segs)), name_(name) {}

  std::unique_ptr<Node> Parse() {
    auto root = std::make_unique<Node>();
    root->type = Node::kBody;
    std::string end = Body(&root->kids, {});
    if (!end.empty()) Fail(name_, end_line_, end_col_, Cat("unexpected {% ", end, " %}"));
    return root;
  }

 private:
  ExprParser Expr(const Segment& s) {
    return ExprParser(Tokenize(s.text, s.line, s.col, name_), name_);
  }

  // Parses statements until one of `ends` (returned) or the end of input ("").
  std::string Body(std::vector<std::unique_ptr<Node>>* out, const std::vector<std::string>& ends) {
    struct Nest {
      explicit Nest(StmtParser* p) : p(p) {
        if (++p->nesting_ > 100) {
          const Segment& s = p->segs_[std::min(p->i_, p->segs_.size() - 1)];
          Fail(p->name_, s.line, s.col, "blocks nested too deeply (limit 100)");
        }
      }
      ~Nest() { --p->nesting_; }
      StmtParser* p;
    } nest(this);
    while (i_ < segs_.size()) {
      const Segment& s = segs_[i_++];
      if (s.kind == Segment::kText) {
        auto n = std::make_unique<Node>();
        n->type = Node::kText;
        n->str = s.text;
        out->push_back(std::move(n));
        continue;
      }
      ExprParser p = Expr(s);
      if (s.kind == Segment::kOutput) {
        auto n = p.NewNode(Node::kOutput, p.Peek());
        n->a = p.Expression();
        p.ExpectEnd();
        out->push_back(std::move(n));
        continue;
      }
      if (p.Peek().kind != Tok::kName) p.Err("expected a tag name");
      const Tok& tag = p.Peek();
      std::string kw = tag.text;
      if (std::find(ends.begin(), ends.end(), kw) != ends.end()) {
        cur_ = std::make_unique<ExprParser>(std::move(p));
        end_line_ = tag.line;
        end_col_ = tag.col;
        return kw;
      }
      p.Next();
      if (kw == "if") {
        out->push_back(If(std::move(p), tag));
      } else if (kw == "for") {
        out->push_back(For(std::move(p), tag));
      } else if (kw == "set") {
        out->push_back(Set(std::move(p), tag));
      } else if (kw == "break" || kw == "continue") {
        p.ExpectEnd();
        auto n = p.NewNode(kw == "break" ? Node::kBreak : Node::kContinue, tag);
        out->push_back(std::move(n));
      } else if (kw == "generation") {
        // transformers' assistant-mask marker: renders its body.
        p.ExpectEnd();
        std::string end = Body(out, {"endgeneration"});
        if (end.empty())
          Fail(name_, tag.line, tag.col, "{% generation %} without {% endgeneration %}");
        cur_->Next();
        cur_->ExpectEnd();
      } else if (kw == "elif" || kw == "else" || kw == "endif" || kw == "endfor" ||
                 kw == "endset" || kw == "endgeneration") {
        Fail(name_, tag.line, tag.col, Cat("unexpected {% ", kw, " %}"));
      } else {
        Fail(name_, tag.line, tag.col,
             Cat("unsupported tag '", kw,
                 "' (supported: if, elif, else, for, set, break, continue, raw, generation)"));
      }
    }
    return "";
  }

  std::unique_ptr<Node> If(ExprParser p, const Tok& tag) {
    auto n = p.NewNode(Node::kIf, tag);
    auto cond = p.Expression();
    p.ExpectEnd();
    while (true) {
      std::vector<std::unique_ptr<Node>> body;
      std::string end = Body(&body, {"elif", "else", "endif"});
      if (end.empty()) Fail(name_, tag.line, tag.col, "{% if %} without {% endif %}");
      n->branches.emplace_back(std::move(cond), std::move(body));
      cur_->Next();
      if (end == "elif") {
        cond = cur_->Expression();
        cur_->ExpectEnd();
      } else if (end == "else") {
        cur_->ExpectEnd();
        cond = nullptr;
        std::vector<std::unique_ptr<Node>> else_body;
        std::string e2 = Body(&else_body, {"endif"});
        if (e2.empty()) Fail(name_, tag.line, tag.col, "{% if %} without {% endif %}");
        cur_->Next();
        cur_->ExpectEnd();
        n->branches.emplace_back(nullptr, std::move(else_body));
        return n;
      } else {
        cur_->ExpectEnd();
        return n;
      }
    }
  }

  std::unique_ptr<Node> For(ExprParser p, const Tok& tag) {
    auto n = p.NewNode(Node::kFor, tag);
    n->names.push_back(p.ExpectName());
    while (p.IsOp(",")) {
      p.Next();
      n->names.push_back(p.ExpectName());
    }
    if (!p.IsName("in")) p.Err("expected 'in'");
    p.Next();
    n->a = p.Or();  // not a full expression: a trailing `if` filters items
    if (p.IsName("if")) {
      p.Next();
      n->b = p.Expression();
    }
    if (p.IsName("recursive")) p.Err("recursive loops are not supported");
    p.ExpectEnd();
    std::string end = Body(&n->body, {"else", "endfor"});
    if (end.empty()) Fail(name_, tag.line, tag.col, "{% for %} without {% endfor %}");
    cur_->Next();
    cur_->ExpectEnd();
    if (end == "else") {
      std::string e2 = Body(&n->else_body, {"endfor"});
      if (e2.empty()) Fail(name_, tag.line, tag.col, "{% for %} without {% endfor %}");
      cur_->Next();
      cur_->ExpectEnd();
    }
    return n;
  }

  std::unique_ptr<Node> Set(ExprParser p, const Tok& tag) {
    auto n = p.NewNode(Node::kSet, tag);
    n->names.push_back(p.ExpectName());
    if (p.IsOp(".")) {
      p.Next();
      n->str = p.ExpectName();  // namespace attribute
    } else {
      while (p.IsOp(",")) {
        p.Next();
        n->names.push_back(p.ExpectName());
      }
    }
    if (p.AtEnd()) {
      if (n->names.size() != 1 || !n->str.empty()) p.Err("block set needs a single name");
      std::string end = Body(&n->body, {"endset"});
      if (end.empty()) Fail(name_, tag.line, tag.col, "{% set %} without {% endset %}");
      cur_->Next();
      cur_->ExpectEnd();
      return n;
    }
    p.Expect("=");
    auto value = p.Expression();
    if (p.IsOp(",")) {  // `set a, b = 1, 2`
      auto tuple = p.NewNode(Node::kTupleLit, tag);
      tuple->kids.push_back(std::move(value));
      while (p.IsOp(",")) {
        p.Next();
        tuple->kids.push_back(p.Expression());
      }
      value = std::move(tuple);
    }
    p.ExpectEnd();
    n->a = std::move(value);
    return n;
  }

  std::vector<Segment> segs_;
  size_t i_ = 0;
  const std::string& name_;
  std::unique_ptr<ExprParser> cur_;  // the parser positioned at the end tag just found
  int end_line_ = 0, end_col_ = 0;
  int nesting_ = 0;
};

// ============================================================================================
// Evaluator
// ============================================================================================
struct BreakSignal {};
struct ContinueSignal {};

class Evaluator {
 public:
  Evaluator(const std::string& name, std::string* out) : name_(name), out_(out) {}

  std::vector<std::vector<std::pair<std::string, Value>>> scopes;

  [[noreturn]] void Err(const Node& n, const std::string& msg) const {
    Fail(name_, n.line, n.col, msg);
  }

  Value Lookup(const std::string& k) const {
    for (auto s = scopes.rbegin(); s != scopes.rend(); ++s) {
      for (const auto& [key, v] : *s) {
        if (key == k) return v;
      }
    }
    return Value::Undefined(k);
  }
  void Assign(const std::string& k, Value v) {
    auto& s = scopes.back();
    for (auto& [key, old] : s) {
      if (key == k) {
        old = std::move(v);
        return;
      }
    }
    s.emplace_back(k, std::move(v));
  }

  void Exec(const std::vector<std::unique_ptr<Node>>& body) {
    for (const auto& n : body) Exec(*n);
  }

  void Exec(const Node& n) {
    switch (n.type) {
      case Node::kBody:
        Exec(n.kids);
        return;
      case Node::kText:
        *out_ += n.str;
        return;
      case Node::kOutput: {
        Value v = Eval(*n.a);
        *out_ += ToStr(v);
        return;
      }
      case Node::kIf:
        for (const auto& [cond, body] : n.branches) {
          if (!cond || Truthy(Eval(*cond))) {
            Exec(body);
            return;
          }
        }
        return;
      case Node::kFor:
        ExecFor(n);
        return;
      case Node::kSet: {
        Value v;
        if (n.a) {
          v = Eval(*n.a);
        } else {
          std::string captured;
          std::string* saved = out_;
          out_ = &captured;
          Exec(n.body);
          out_ = saved;
          v = Value::Str(std::move(captured));
        }
        if (!n.str.empty()) {
          Value ns = Lookup(n.names[0]);
          if (ns.kind != Value::kDict || !ns.is_namespace) {
            Err(n, Cat("cannot set attribute '", n.str, "' on ", TypeName(ns), " '", n.names[0],
                       "' (only namespace() objects can be assigned to)"));
          }
          ns.dict->Set(n.str, std::move(v));
          return;
        }
        if (n.names.size() == 1) {
          Assign(n.names[0], std::move(v));
          return;
        }
        List items = Iterate(n, v);
        if (items.size() != n.names.size()) {
          Err(n, Cat("cannot unpack ", items.size(), " values into ", n.names.size(), " names"));
        }
        for (size_t k = 0; k < items.size(); ++k) Assign(n.names[k], items[k]);
        return;
      }
      case Node::kBreak:
        throw BreakSignal{};
      case Node::kContinue:
        throw ContinueSignal{};
      default:
        Err(n, "internal: expression in statement position");
    }
  }

  List Iterate(const Node& at, const Value& v) {
    switch (v.kind) {
      case Value::kUndefined:
        return {};
      case Value::kList:
        return *v.list;
      case Value::kDict: {
        List keys;
        for (const auto& [k, x] : v.dict->items) keys.push_back(Value::Str(k));
        return keys;
      }
      case Value::kString: {
        List chars;
        for (size_t k = 0; k < v.s.size();) {
          size_t len = std::min(utf8::SeqLen(static_cast<uint8_t>(v.s[k])), v.s.size() - k);
          chars.push_back(Value::Str(v.s.substr(k, len)));
          k += len;
        }
        return chars;
      }
      default:
        Err(at, Cat("'", TypeName(v), "' object is not iterable"));
    }
  }

  void Bind(const Node& n, const Value& item) {
    if (n.names.size() == 1) {
      Assign(n.names[0], item);
      return;
    }
    List parts = Iterate(n, item);
    if (parts.size() != n.names.size()) {
      Err(n,
          Cat("cannot unpack ", parts.size(), " values into ", n.names.size(), " loop variables"));
    }
    for (size_t k = 0; k < parts.size(); ++k) Assign(n.names[k], parts[k]);
  }

  void ExecFor(const Node& n) {
    List all = Iterate(*n.a, Eval(*n.a));
    List items;
    if (n.b) {
      for (const Value& item : all) {
        scopes.emplace_back();
        Bind(n, item);
        bool keep = Truthy(Eval(*n.b));
        scopes.pop_back();
        if (keep) items.push_back(item);
      }
    } else {
      items = std::move(all);
    }
    if (items.empty()) {
      Exec(n.else_body);
      return;
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      scopes.emplace_back();
      Value loop = Value::MakeDict();
      Dict& d = *loop.dict;
      d.Set("index0", Value::Int(k));
      d.Set("index", Value::Int(k + 1));
      d.Set("revindex0", Value::Int(len - k - 1));
      d.Set("revindex", Value::Int(len - k));
      d.Set("first", Value::Bool(k == 0));
      d.Set("last", Value::Bool(k == len - 1));
      d.Set("length", Value::Int(len));
      d.Set("previtem", k > 0 ? items[k - 1] : Value::Undefined("loop.previtem"));
      d.Set("nextitem", k + 1 < len ? items[k + 1] : Value::Undefined("loop.nextitem"));
      Assign("loop", loop);
      Bind(n, items[k]);
      bool stop = false;
      try {
        Exec(n.body);
      } catch (const BreakSignal&) {
        stop = true;
      } catch (const ContinueSignal&) {
      }
      scopes.pop_back();
      if (stop) break;
    }
  }

  static int64_t PyMod(int64_t a, int64_t b) {
    int64_t m = a % b;
    return (m != 0 && ((m < 0) != (b < 0))) ? m + b : m;
  }
  static int64_t PyFloorDiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
  }

  // Integers are 64-bit (Python's are unbounded): a result out of range is a template error,
  // not a wrapped value.
  // Callers compute the overflow flag in a statement of its own before reading the result
  // (function arguments are unsequenced).
  int64_t Checked(const Node& n, bool overflowed, int64_t v) {
    if (overflowed) Err(n, Cat("integer overflow in '", n.str, "' (template integers are 64-bit)"));
    return v;
  }

  Value Binary(const Node& n, const Value& a, const Value& b) {
    const std::string& op = n.str;
    if (op == "~") return Value::Str(ToStr(a) + ToStr(b));
    if (a.undefined() || b.undefined()) {
      Err(n, Cat("'", a.undefined() ? a.s : b.s, "' is undefined (in '", op, "')"));
    }
    if (op == "+") {
      if (a.kind == Value::kString && b.kind == Value::kString) return Value::Str(a.s + b.s);
      if (a.kind == Value::kList && b.kind == Value::kList) {
        List r = *a.list;
        r.insert(r.end(), b.list->begin(), b.list->end());
        return Value::MakeList(std::move(r));
      }
    }
    if (op == "*" && ((a.kind == Value::kString && b.kind == Value::kInt) ||
                      (a.kind == Value::kInt && b.kind == Value::kString))) {
      const Value& s = a.kind == Value::kString ? a : b;
      int64_t times = a.kind == Value::kInt ? a.i : b.i;
      std::string r;
      for (int64_t k = 0; k < times && r.size() < (1u << 24); ++k) r += s.s;
      return Value::Str(std::move(r));
    }
    if (a.is_number() && b.is_number()) {
      bool ints = a.kind != Value::kFloat && b.kind != Value::kFloat;
      int64_t x = a.kind == Value::kBool ? a.b : a.i, y = b.kind == Value::kBool ? b.b : b.i;
      if (op == "+" || op == "-" || op == "*") {
        if (!ints) {
          return Value::Float(op == "+"   ? a.num() + b.num()
                              : op == "-" ? a.num() - b.num()
                                          : a.num() * b.num());
        }
        int64_t r = 0;
        const bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &r)
                              : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                          : __builtin_mul_overflow(x, y, &r);
        return Value::Int(Checked(n, overflow, r));
      }
      if (op == "/") {
        if (b.num() == 0) Err(n, "division by zero");
        return Value::Float(a.num() / b.num());
      }
      if (op == "//") {
        if (b.num() == 0) Err(n, "division by zero");
        if (ints) Checked(n, x == INT64_MIN && y == -1, 0);
        return ints ? Value::Int(PyFloorDiv(x, y)) : Value::Float(std::floor(a.num() / b.num()));
      }
      if (op == "%") {
        if (b.num() == 0) Err(n, "modulo by zero");
        if (ints) return Value::Int(y == -1 ? 0 : PyMod(x, y));
        double m = std::fmod(a.num(), b.num());
        if (m != 0 && ((m < 0) != (b.num() < 0))) m += b.num();
        return Value::Float(m);
      }
      if (op == "**") {
        if (ints && y >= 0) {
          // |x| >= 2 overflows within 63 multiplications; 0, 1 and -1 need none.
          if (x == 0) return Value::Int(y == 0 ? 1 : 0);
          if (x == 1 || x == -1) return Value::Int(x == -1 && y % 2 == 1 ? -1 : 1);
          int64_t p = 1;
          for (int64_t k = 0; k < y; ++k) Checked(n, __builtin_mul_overflow(p, x, &p), 0);
          return Value::Int(p);
        }
        return Value::Float(std::pow(a.num(), b.num()));
      }
    }
    Err(n,
        Cat("unsupported operand types for ", op, ": '", TypeName(a), "' and '", TypeName(b), "'"));
  }

  bool Contains(const Node& n, const Value& container, const Value& item) {
    switch (container.kind) {
      case Value::kString:
        if (item.kind != Value::kString)
          Err(n, Cat("'in <string>' requires a string, got ", TypeName(item)));
        return container.s.find(item.s) != std::string::npos;
      case Value::kList:
        for (const Value& v : *container.list) {
          if (Equal(v, item)) return true;
        }
        return false;
      case Value::kDict:
        return item.kind == Value::kString && container.dict->Find(item.s) != nullptr;
      case Value::kUndefined:
        return false;
      default:
        Err(n, Cat("argument of type '", TypeName(container), "' is not iterable"));
    }
  }

  bool CompareOp(const Node& n, const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return Equal(a, b);
    if (op == "!=") return !Equal(a, b);
    if (op == "in") return Contains(n, b, a);
    if (op == "not in") return !Contains(n, b, a);
    int c;
    if (a.is_number() && b.is_number()) {
      c = a.num() < b.num() ? -1 : a.num() > b.num() ? 1 : 0;
    } else if (a.kind == Value::kString && b.kind == Value::kString) {
      c = a.s.compare(b.s);
    } else {
      Err(n, Cat("'", op, "' not supported between '", TypeName(a), "' and '", TypeName(b), "'"));
    }
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  Value GetAttr(const Node& n, const Value& obj, const std::string& key) {
    if (obj.undefined()) Err(n, Cat("'", obj.s, "' is undefined (reading '", key, "')"));
    if (obj.kind == Value::kDict) {
      if (const Value* v = obj.dict->Find(key)) return *v;
    }
    return Value::Undefined(key);
  }

  static int64_t NormIndex(int64_t idx, int64_t size) { return idx < 0 ? idx + size : idx; }

  Value GetItem(const Node& n, const Value& obj, const Value& key) {
    if (obj.undefined()) Err(n, Cat("'", obj.s, "' is undefined (subscripted)"));
    if (obj.kind == Value::kDict) {
      if (key.kind == Value::kString) {
        if (const Value* v = obj.dict->Find(key.s)) return *v;
        return Value::Undefined(key.s);
      }
      return Value::Undefined(ToStr(key));
    }
    if (obj.kind == Value::kList || obj.kind == Value::kString) {
      if (key.kind != Value::kInt) {
        if (key.kind == Value::kString) return Value::Undefined(key.s);  // attribute-style
        Err(n, Cat("indices must be integers, not ", TypeName(key)));
      }
      if (obj.kind == Value::kList) {
        int64_t sz = static_cast<int64_t>(obj.list->size());
        int64_t k = NormIndex(key.i, sz);
        if (k < 0 || k >= sz) return Value::Undefined(Cat("[", key.i, "]"));
        return (*obj.list)[k];
      }
      List chars = Iterate(n, obj);
      int64_t sz = static_cast<int64_t>(chars.size());
      int64_t k = NormIndex(key.i, sz);
      if (k < 0 || k >= sz) return Value::Undefined(Cat("[", key.i, "]"));
      return chars[k];
    }
    Err(n, Cat("'", TypeName(obj), "' object is not subscriptable"));
  }

  Value Slice(const Node& n, const Value& obj) {
    auto bound = [&](const std::unique_ptr<Node>& p) -> std::optional<int64_t> {
      if (!p) return std::nullopt;
      Value v = Eval(*p);
      if (v.kind == Value::kNone) return std::nullopt;
      if (v.kind != Value::kInt) Err(*p, "slice indices must be integers");
      return v.i;
    };
    std::optional<int64_t> start = bound(n.kids[0]), stop = bound(n.kids[1]),
                           step_o = bound(n.kids[2]);
    int64_t step = step_o.value_or(1);
    if (step == 0) Err(n, "slice step cannot be zero");
    List items;
    if (obj.kind == Value::kList) {
      items = *obj.list;
    } else if (obj.kind == Value::kString) {
      items = Iterate(n, obj);
    } else {
      Err(n, Cat("'", TypeName(obj), "' object cannot be sliced"));
    }
    int64_t len = static_cast<int64_t>(items.size());
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt, bool is_start) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? *v + len : *v;
      if (step > 0) return std::clamp<int64_t>(x, 0, len);
      (void)is_start;
      return std::clamp<int64_t>(x, -1, len - 1);
    };
    int64_t b = clamp(start, step > 0 ? 0 : len - 1, true);
    int64_t e = clamp(stop, step > 0 ? len : -1, false);
    List out;
    for (int64_t k = b; step > 0 ? k < e : k > e; k += step) out.push_back(items[k]);
    if (obj.kind == Value::kString) {
      std::string s;
      for (const Value& c : out) s += c.s;
      return Value::Str(std::move(s));
    }
    return Value::MakeList(std::move(out));
  }

  Value Eval(const Node& n) {
    switch (n.type) {
      case Node::kLiteral:
        return n.literal;
      case Node::kName:
        return Lookup(n.str);
      case Node::kListLit:
      case Node::kTupleLit: {
        List items;
        for (const auto& k : n.kids) items.push_back(Eval(*k));
        return Value::MakeList(std::move(items));
      }
      case Node::kDictLit: {
        Value d = Value::MakeDict();
        for (size_t k = 0; k + 1 < n.kids.size(); k += 2) {
          Value key = Eval(*n.kids[k]);
          if (key.kind != Value::kString) Err(*n.kids[k], "dict keys must be strings");
          d.dict->Set(key.s, Eval(*n.kids[k + 1]));
        }
        return d;
      }
      case Node::kAttr:
        return GetAttr(n, Eval(*n.a), n.str);
      case Node::kIndex:
        return GetItem(n, Eval(*n.a), Eval(*n.b));
      case Node::kSlice:
        return Slice(n, Eval(*n.a));
      case Node::kUnary: {
        Value v = Eval(*n.a);
        if (!v.is_number())
          Err(n, Cat("bad operand type for unary ", n.str, ": '", TypeName(v), "'"));
        if (n.str == "+") return v;
        if (v.kind == Value::kFloat) return Value::Float(-v.f);
        const int64_t i = v.kind == Value::kBool ? v.b : v.i;
        Checked(n, i == INT64_MIN, 0);  // before negating: -INT64_MIN is undefined behaviour
        return Value::Int(-i);
      }
      case Node::kBinary:
        return Binary(n, Eval(*n.a), Eval(*n.b));
      case Node::kCompare: {
        Value left = Eval(*n.kids[0]);
        for (size_t k = 0; k < n.ops.size(); ++k) {
          Value right = Eval(*n.kids[k + 1]);
          if (!CompareOp(n, n.ops[k], left, right)) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Node::kAnd: {
        Value a = Eval(*n.a);
        return Truthy(a) ? Eval(*n.b) : a;
      }
      case Node::kOr: {
        Value a = Eval(*n.a);
        return Truthy(a) ? a : Eval(*n.b);
      }
      case Node::kNot:
        return Value::Bool(!Truthy(Eval(*n.a)));
      case Node::kCond:
        if (Truthy(Eval(*n.b))) return Eval(*n.a);
        return n.c ? Eval(*n.c) : Value::Undefined("conditional expression");
      case Node::kFilter:
        return Filter(n);
      case Node::kTest:
        return Value::Bool(Test(n) != n.negated);
      case Node::kCall:
        return Call(n);
      default:
        Err(n, "internal: statement in expression position");
    }
  }

  // Positional and keyword arguments, evaluated.
  struct Args {
    List pos;
    std::vector<std::pair<std::string, Value>> kw;
    const Value* Kw(std::string_view k) const {
      for (const auto& [key, v] : kw) {
        if (key == k) return &v;
      }
      return nullptr;
    }
    // Argument `k` given by position `i` or keyword `name`.
    const Value* Get(size_t i, std::string_view name) const {
      if (i < pos.size()) return &pos[i];
      return Kw(name);
    }
  };
  Args EvalArgs(const Node& n, size_t skip = 0) {
    Args a;
    for (size_t k = skip; k < n.kids.size(); ++k) a.pos.push_back(Eval(*n.kids[k]));
    for (const auto& [k, v] : n.kwargs) a.kw.emplace_back(k, Eval(*v));
    return a;
  }

  std::string RequireString(const Node& n, const Value& v, std::string_view what) {
    if (v.kind != Value::kString) Err(n, Cat(what, " expects a string, got ", TypeName(v)));
    return v.s;
  }

  static std::string Strip(const std::string& s, const std::string* chars, bool left, bool right) {
    auto is_strip = [&](unsigned char c) {
      return chars ? chars->find(static_cast<char>(c)) != std::string::npos
                   : (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f');
    };
    size_t b = 0, e = s.size();
    if (left) {
      while (b < e && is_strip(s[b])) ++b;
    }
    if (right) {
      while (e > b && is_strip(s[e - 1])) --e;
    }
    return s.substr(b, e - b);
  }

  static std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                             int64_t count) {
    if (from.empty()) return s;
    std::string r;
    size_t pos = 0;
    int64_t done = 0;
    while (count < 0 || done < count) {
      size_t f = s.find(from, pos);
      if (f == std::string::npos) break;
      r.append(s, pos, f - pos);
      r += to;
      pos = f + from.size();
      ++done;
    }
    r.append(s, pos, std::string::npos);
    return r;
  }

  static std::string Lower(std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  }
  static std::string Upper(std::string s) {
    for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return s;
  }
  static std::string Title(std::string s) {
    bool start = true;
    for (char& c : s) {
      auto u = static_cast<unsigned char>(c);
      if (std::isalpha(u)) {
        c = static_cast<char>(start ? std::toupper(u) : std::tolower(u));
        start = false;
      } else {
        start = true;
      }
    }
    return s;
  }

  int64_t Length(const Node& n, const Value& v) {
    switch (v.kind) {
      case Value::kString: {
        int64_t count = 0;  // code points, as Python's len()
        for (unsigned char c : v.s) count += (c & 0xC0) != 0x80;
        return count;
      }
      case Value::kList:
        return static_cast<int64_t>(v.list->size());
      case Value::kDict:
        return static_cast<int64_t>(v.dict->items.size());
      case Value::kUndefined:
        return 0;
      default:
        Err(n, Cat("object of type '", TypeName(v), "' has no len()"));
    }
  }

  // Applies test `name` (with `args`) to `v`; shared by `is` and select/reject filters.
  bool ApplyTest(const Node& n, const std::string& name, const Value& v, const List& args) {
    auto arg = [&](size_t i) -> const Value& {
      if (i >= args.size()) Err(n, Cat("test '", name, "' needs an argument"));
      return args[i];
    };
    if (name == "defined") return !v.undefined();
    if (name == "undefined") return v.undefined();
    if (name == "none") return v.kind == Value::kNone;
    if (name == "string") return v.kind == Value::kString;
    if (name == "number") return v.kind == Value::kInt || v.kind == Value::kFloat;
    if (name == "integer") return v.kind == Value::kInt;
    if (name == "float") return v.kind == Value::kFloat;
    if (name == "boolean") return v.kind == Value::kBool;
    if (name == "true") return v.kind == Value::kBool && v.b;
    if (name == "false") return v.kind == Value::kBool && !v.b;
    if (name == "mapping") return v.kind == Value::kDict && !v.is_namespace;
    if (name == "sequence")
      return v.kind == Value::kList || v.kind == Value::kString || v.kind == Value::kDict;
    if (name == "iterable")
      return v.kind == Value::kList || v.kind == Value::kString || v.kind == Value::kDict;
    if (name == "callable") return false;
    if (name == "lower") return v.kind == Value::kString && Lower(v.s) == v.s;
    if (name == "upper") return v.kind == Value::kString && Upper(v.s) == v.s;
    if (name == "even" || name == "odd") {
      if (v.kind != Value::kInt) Err(n, Cat("test '", name, "' needs an integer"));
      return (PyMod(v.i, 2) == 0) == (name == "even");
    }
    if (name == "divisibleby") {
      const Value& d = arg(0);
      if (v.kind != Value::kInt || d.kind != Value::kInt || d.i == 0)
        Err(n, "divisibleby needs non-zero integers");
      return PyMod(v.i, d.i) == 0;
    }
    if (name == "equalto" || name == "eq" || name == "==" || name == "sameas")
      return Equal(v, arg(0));
    if (name == "ne" || name == "!=") return !Equal(v, arg(0));
    if (name == "lt" || name == "<") return CompareOp(n, "<", v, arg(0));
    if (name == "le" || name == "<=") return CompareOp(n, "<=", v, arg(0));
    if (name == "gt" || name == ">") return CompareOp(n, ">", v, arg(0));
    if (name == "ge" || name == ">=") return CompareOp(n, ">=", v, arg(0));
    if (name == "in") return Contains(n, arg(0), v);
    Err(n, Cat("unsupported test '", name,
               "' (supported: defined, undefined, none, string, number, integer, float, boolean, "
               "true, false, mapping, sequence, iterable, lower, upper, even, odd, divisibleby, "
               "equalto, eq, ne, lt, le, gt, ge, in, sameas)"));
  }

  bool Test(const Node& n) {
    Value v = Eval(*n.a);
    Args a = EvalArgs(n);
    return ApplyTest(n, n.str, v, a.pos);
  }

  Value Filter(const Node& n) {
    Value v = Eval(*n.a);
    Args a = EvalArgs(n);
    return ApplyFilter(n, n.str, v, a);
  }

  Value ApplyFilter(const Node& n, const std::string& f, const Value& v, const Args& a) {
    if (f == "default" || f == "d") {
      const Value* dflt = a.Get(0, "default_value");
      const Value* boolean = a.Get(1, "boolean");
      bool use = v.undefined() || (boolean && Truthy(*boolean) && !Truthy(v));
      return use ? (dflt ? *dflt : Value::Str("")) : v;
    }
    if (v.undefined() && f != "string" && f != "length" && f != "count" && f != "list") {
      Err(n, Cat("'", v.s, "' is undefined (filter '", f, "')"));
    }
    if (f == "trim" || f == "strip") {
      const Value* chars = a.Get(0, "chars");
      std::string cs = chars && chars->kind == Value::kString ? chars->s : "";
      return Value::Str(
          Strip(RequireString(n, v, "filter 'trim'"), chars ? &cs : nullptr, true, true));
    }
    if (f == "length" || f == "count") return Value::Int(Length(n, v));
    if (f == "upper") return Value::Str(Upper(RequireString(n, v, "filter 'upper'")));
    if (f == "lower") return Value::Str(Lower(RequireString(n, v, "filter 'lower'")));
    if (f == "title") return Value::Str(Title(RequireString(n, v, "filter 'title'")));
    if (f == "capitalize") {
      std::string s = Lower(RequireString(n, v, "filter 'capitalize'"));
      if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
      return Value::Str(s);
    }
    if (f == "string") return Value::Str(ToStr(v));
    if (f == "safe" || f == "e" || f == "escape") {
      if (f != "safe")
        Err(n, "filter 'escape' is not supported (chat templates render plain text)");
      return v;
    }
    if (f == "tojson") {
      const Value* indent = a.Get(0, "indent");
      const Value* sort = a.Kw("sort_keys");
      std::string out;
      ToJson(v, indent && indent->kind == Value::kInt ? static_cast<int>(indent->i) : -1,
             sort && Truthy(*sort), 0, &out);
      return Value::Str(std::move(out));
    }
    if (f == "first" || f == "last") {
      List items = Iterate(n, v);
      if (items.empty()) return Value::Undefined(Cat(f, " of an empty sequence"));
      return f == "first" ? items.front() : items.back();
    }
    if (f == "join") {
      const Value* sep = a.Get(0, "d");
      const Value* attr = a.Get(1, "attribute");
      std::string out;
      bool first = true;
      for (const Value& item : Iterate(n, v)) {
        if (!first) out += sep ? ToStr(*sep) : "";
        first = false;
        out += ToStr(attr ? GetAttr(n, item, ToStr(*attr)) : item);
      }
      return Value::Str(std::move(out));
    }
    if (f == "replace") {
      if (a.pos.size() < 2) Err(n, "filter 'replace' needs (old, new)");
      const Value* count = a.Get(2, "count");
      return Value::Str(Replace(RequireString(n, v, "filter 'replace'"), ToStr(a.pos[0]),
                                ToStr(a.pos[1]),
                                count && count->kind == Value::kInt ? count->i : -1));
    }
    if (f == "list") return Value::MakeList(Iterate(n, v));
    if (f == "items") {
      if (v.kind != Value::kDict)
        Err(n, Cat("filter 'items' expects a mapping, got ", TypeName(v)));
      List out;
      for (const auto& [k, x] : v.dict->items) out.push_back(Value::MakeList({Value::Str(k), x}));
      return Value::MakeList(std::move(out));
    }
    if (f == "reverse") {
      if (v.kind == Value::kString) {
        List chars = Iterate(n, v);
        std::string s;
        for (auto it = chars.rbegin(); it != chars.rend(); ++it) s += it->s;
        return Value::Str(s);
      }
      List items = Iterate(n, v);
      std::reverse(items.begin(), items.end());
      return Value::MakeList(std::move(items));
    }
    if (f == "unique") {
      List out;
      for (const Value& item : Iterate(n, v)) {
        bool seen = false;
        for (const Value& o : out) seen = seen || Equal(o, item);
        if (!seen) out.push_back(item);
      }
      return Value::MakeList(std::move(out));
    }
    if (f == "int") {
      if (v.kind == Value::kInt) return v;
      if (v.kind == Value::kFloat) return Value::Int(static_cast<int64_t>(v.f));
      if (v.kind == Value::kBool) return Value::Int(v.b);
      if (v.kind == Value::kString) {
        int64_t x = 0;
        auto r = std::from_chars(v.s.data(), v.s.data() + v.s.size(), x);
        return Value::Int(r.ec == std::errc() ? x : 0);
      }
      return Value::Int(0);
    }
    if (f == "float") {
      if (v.is_number()) return Value::Float(v.num());
      if (v.kind == Value::kString) return Value::Float(std::strtod(v.s.c_str(), nullptr));
      return Value::Float(0);
    }
    if (f == "abs") {
      if (v.kind == Value::kInt) return Value::Int(v.i < 0 ? -v.i : v.i);
      if (v.kind == Value::kFloat) return Value::Float(std::fabs(v.f));
      Err(n, Cat("filter 'abs' expects a number, got ", TypeName(v)));
    }
    if (f == "selectattr" || f == "rejectattr" || f == "select" || f == "reject") {
      bool attr_mode = f == "selectattr" || f == "rejectattr";
      bool keep_if = f == "selectattr" || f == "select";
      size_t k = 0;
      std::string attr;
      if (attr_mode) {
        if (a.pos.empty()) Err(n, Cat("filter '", f, "' needs an attribute name"));
        attr = ToStr(a.pos[k++]);
      }
      std::string test = k < a.pos.size() ? ToStr(a.pos[k++]) : "";
      List targs(a.pos.begin() + static_cast<std::ptrdiff_t>(std::min(k, a.pos.size())),
                 a.pos.end());
      List out;
      for (const Value& item : Iterate(n, v)) {
        Value subject = attr_mode ? GetAttrLenient(item, attr) : item;
        bool pass = test.empty() ? Truthy(subject) : ApplyTest(n, test, subject, targs);
        if (pass == keep_if) out.push_back(item);
      }
      return Value::MakeList(std::move(out));
    }
    if (f == "map") {
      const Value* attr = a.Kw("attribute");
      List out;
      for (const Value& item : Iterate(n, v)) {
        if (attr) {
          Value x = GetAttrLenient(item, ToStr(*attr));
          const Value* dflt = a.Kw("default");
          out.push_back(x.undefined() && dflt ? *dflt : x);
        } else {
          if (a.pos.empty()) Err(n, "filter 'map' needs a filter name or attribute=");
          Args rest;
          rest.pos.assign(a.pos.begin() + 1, a.pos.end());
          rest.kw = a.kw;
          out.push_back(ApplyFilter(n, ToStr(a.pos[0]), item, rest));
        }
      }
      return Value::MakeList(std::move(out));
    }
    if (f == "indent") {
      const Value* width = a.Get(0, "width");
      const Value* first = a.Get(1, "first");
      std::string pad = width && width->kind == Value::kString
                            ? width->s
                            : std::string(width ? static_cast<size_t>(width->i) : 4, ' ');
      std::string s = RequireString(n, v, "filter 'indent'"), out;
      bool line_start = first && Truthy(*first);
      for (size_t k = 0; k < s.size(); ++k) {
        if (line_start && s[k] != '\n') out += pad;
        line_start = false;
        out.push_back(s[k]);
        if (s[k] == '\n') line_start = true;
      }
      return Value::Str(out);
    }
    if (f == "sum") {
      int64_t si = 0;
      double sf = 0;
      bool fl = false;
      for (const Value& x : Iterate(n, v)) {
        if (!x.is_number()) Err(n, "filter 'sum' expects numbers");
        if (x.kind == Value::kFloat) fl = true;
        si += x.kind == Value::kBool ? x.b : x.i;
        sf += x.num();
      }
      return fl ? Value::Float(sf) : Value::Int(si);
    }
    Err(n, Cat("unsupported filter '", f,
               "' (supported: trim, length, count, upper, lower, title, capitalize, string, "
               "tojson, default, first, last, join, replace, list, items, reverse, unique, int, "
               "float, abs, select, reject, selectattr, rejectattr, map, indent, sum, safe)"));
  }

  Value GetAttrLenient(const Value& obj, const std::string& key) {
    if (obj.kind == Value::kDict) {
      if (const Value* v = obj.dict->Find(key)) return *v;
    }
    return Value::Undefined(key);
  }

  Value Call(const Node& n) {
    // Methods: obj.name(args).
    if (n.a->type == Node::kAttr) {
      Value obj = Eval(*n.a->a);
      const std::string& m = n.a->str;
      if (obj.kind == Value::kDict && !obj.is_namespace) {
        if (const Value* member = obj.dict->Find(m); member != nullptr) {
          Err(n, Cat("'", m, "' is a dict entry, not a callable method"));
        }
      }
      Args a = EvalArgs(n);
      return Method(n, obj, m, a);
    }
    if (n.a->type != Node::kName) Err(n, "only named functions and methods can be called");
    const std::string& f = n.a->str;
    Args a = EvalArgs(n);
    if (f == "raise_exception") {
      std::string msg = a.pos.empty() ? "" : ToStr(a.pos[0]);
      throw Error{InvalidArgument(name_, ": template error: ", msg)};
    }
    if (f == "namespace") {
      Value ns = Value::MakeDict();
      ns.is_namespace = true;
      for (const Value& p : a.pos) {
        if (p.kind != Value::kDict) Err(n, "namespace() positional arguments must be mappings");
        for (const auto& [k, x] : p.dict->items) ns.dict->Set(k, x);
      }
      for (const auto& [k, x] : a.kw) ns.dict->Set(k, x);
      return ns;
    }
    if (f == "dict") {
      Value d = Value::MakeDict();
      for (const auto& [k, x] : a.kw) d.dict->Set(k, x);
      return d;
    }
    if (f == "range") {
      if (a.pos.empty() || a.pos.size() > 3) Err(n, "range() takes 1 to 3 integers");
      for (const Value& x : a.pos) {
        if (x.kind != Value::kInt) Err(n, "range() arguments must be integers");
      }
      int64_t start = a.pos.size() > 1 ? a.pos[0].i : 0;
      int64_t stop = a.pos.size() > 1 ? a.pos[1].i : a.pos[0].i;
      int64_t step = a.pos.size() > 2 ? a.pos[2].i : 1;
      if (step == 0) Err(n, "range() step must not be zero");
      List out;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        if (out.size() > 1000000) Err(n, "range() too large");
        out.push_back(Value::Int(k));
      }
      return Value::MakeList(std::move(out));
    }
    if (f == "strftime_now") {
      std::string fmt = a.pos.empty() ? "%Y-%m-%d" : ToStr(a.pos[0]);
      std::time_t t = std::time(nullptr);
      std::tm tm;
      localtime_r(&t, &tm);
      char buf[256];
      size_t len = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
      return Value::Str(std::string(buf, len));
    }
    Value callee = Lookup(f);
    if (callee.undefined()) Err(n, Cat("'", f, "' is undefined (called as a function)"));
    Err(n, Cat("'", f, "' (", TypeName(callee), ") is not callable"));
  }

  Value Method(const Node& n, const Value& obj, const std::string& m, const Args& a) {
    if (obj.kind == Value::kString) {
      const std::string& s = obj.s;
      auto str_arg = [&](size_t i) -> std::string {
        if (i >= a.pos.size() || a.pos[i].kind != Value::kString) {
          Err(n, Cat("str.", m, "() needs a string argument"));
        }
        return a.pos[i].s;
      };
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        std::string chars;
        const std::string* cp = nullptr;
        if (!a.pos.empty() && a.pos[0].kind == Value::kString) {
          chars = a.pos[0].s;
          cp = &chars;
        }
        return Value::Str(Strip(s, cp, m != "rstrip", m != "lstrip"));
      }
      if (m == "startswith") return Value::Bool(s.rfind(str_arg(0), 0) == 0);
      if (m == "endswith") {
        std::string x = str_arg(0);
        return Value::Bool(s.size() >= x.size() &&
                           s.compare(s.size() - x.size(), x.size(), x) == 0);
      }
      if (m == "upper") return Value::Str(Upper(s));
      if (m == "lower") return Value::Str(Lower(s));
      if (m == "title") return Value::Str(Title(s));
      if (m == "capitalize") {
        std::string r = Lower(s);
        if (!r.empty()) r[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(r[0])));
        return Value::Str(r);
      }
      if (m == "replace") {
        int64_t count = a.pos.size() > 2 && a.pos[2].kind == Value::kInt ? a.pos[2].i : -1;
        return Value::Str(Replace(s, str_arg(0), str_arg(1), count));
      }
      if (m == "find") {
        size_t p = s.find(str_arg(0));
        return Value::Int(p == std::string::npos ? -1 : static_cast<int64_t>(p));
      }
      if (m == "count") {
        std::string x = str_arg(0);
        int64_t c = 0;
        if (!x.empty()) {
          for (size_t p = s.find(x); p != std::string::npos; p = s.find(x, p + x.size())) ++c;
        }
        return Value::Int(c);
      }
      if (m == "join") {
        std::string out;
        bool first = true;
        for (const Value& item : Iterate(n, a.pos.empty() ? Value::MakeList() : a.pos[0])) {
          if (!first) out += s;
          first = false;
          out += ToStr(item);
        }
        return Value::Str(out);
      }
      if (m == "split" || m == "rsplit") {
        const Value* sep = a.Get(0, "sep");
        const Value* maxsplit = a.Get(1, "maxsplit");
        int64_t maxs = maxsplit && maxsplit->kind == Value::kInt ? maxsplit->i : -1;
        List out;
        if (!sep || sep->kind == Value::kNone) {
          // Whitespace split, dropping empty parts.
          size_t k = 0;
          while (k < s.size()) {
            while (k < s.size() && std::isspace(static_cast<unsigned char>(s[k]))) ++k;
            if (k >= s.size()) break;
            if (maxs >= 0 && static_cast<int64_t>(out.size()) == maxs) {
              out.push_back(Value::Str(Strip(s.substr(k), nullptr, false, true)));
              break;
            }
            size_t e = k;
            while (e < s.size() && !std::isspace(static_cast<unsigned char>(s[e]))) ++e;
            out.push_back(Value::Str(s.substr(k, e - k)));
            k = e;
          }
          return Value::MakeList(std::move(out));
        }
        std::string d = RequireString(n, *sep, "str.split");
        if (d.empty()) Err(n, "empty separator");
        if (m == "rsplit" && maxs >= 0) {
          std::vector<std::string> parts;
          size_t end = s.size();
          while (static_cast<int64_t>(parts.size()) < maxs) {
            size_t p = end >= d.size() ? s.rfind(d, end - d.size()) : std::string::npos;
            if (p == std::string::npos) break;
            parts.push_back(s.substr(p + d.size(), end - p - d.size()));
            end = p;
          }
          parts.push_back(s.substr(0, end));
          for (auto it = parts.rbegin(); it != parts.rend(); ++it) out.push_back(Value::Str(*it));
          return Value::MakeList(std::move(out));
        }
        size_t pos = 0;
        while (true) {
          size_t p = s.find(d, pos);
          if (p == std::string::npos || (maxs >= 0 && static_cast<int64_t>(out.size()) == maxs)) {
            out.push_back(Value::Str(s.substr(pos)));
            break;
          }
          out.push_back(Value::Str(s.substr(pos, p - pos)));
          pos = p + d.size();
        }
        return Value::MakeList(std::move(out));
      }
    }
    if (obj.kind == Value::kDict && !obj.is_namespace) {
      if (m == "items") return ApplyFilter(n, "items", obj, Args());
      if (m == "keys" || m == "values") {
        List out;
        for (const auto& [k, x] : obj.dict->items) out.push_back(m == "keys" ? Value::Str(k) : x);
        return Value::MakeList(std::move(out));
      }
      if (m == "get") {
        if (a.pos.empty()) Err(n, "dict.get() needs a key");
        if (a.pos[0].kind == Value::kString) {
          if (const Value* v = obj.dict->Find(a.pos[0].s)) return *v;
        }
        return a.pos.size() > 1 ? a.pos[1] : Value::None();
      }
    }
    if (obj.undefined()) Err(n, Cat("'", obj.s, "' is undefined (calling .", m, "())"));
    Err(n, Cat("unsupported method '", TypeName(obj), ".", m, "()'"));
  }

 private:
  const std::string& name_;
  std::string* out_;
};

Template::~Template() = default;

StatusOr<std::unique_ptr<Template>> Template::Parse(std::string_view source, std::string name) {
  std::unique_ptr<Template> t(new Template());
  t->name_ = std::move(name);
  try {
    StmtParser parser(Lex(source, t->name_), t->name_);
    t->root_ = parser.Parse();
  } catch (const Error& e) {
    return e.status;
  }
  return t;
}

StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) return InvalidArgument(name_, ": render context must be an object");
  std::string out;
  const ContainerScope containers;  // declared first: runs after the evaluator is gone
  Evaluator ev(name_, &out);
  ev.scopes.emplace_back();
  try {
    for (auto it = context.begin(); it != context.end(); ++it) {
      ev.Assign(it.key(), FromJson(it.value()));
    }
    ev.scopes.emplace_back();  // template-level assignments shadow the context
    ev.Exec(*root_);
  } catch (const Error& e) {
    return e.status;
  } catch (const BreakSignal&) {
    return InvalidArgument(name_, ": {% break %} outside a loop");
  } catch (const ContinueSignal&) {
    return InvalidArgument(name_, ": {% continue %} outside a loop");
  }
  return out;
}

}  // namespace kiln::models::jinja
