#include "config/yaml_tree.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>

namespace kiln::config::internal {

std::string Quote(std::string_view text) {
  // Messages may go back to API clients and into logs: quote a long value only in part, and
  // control characters as escapes.
  constexpr size_t kMaxQuoted = 200;
  std::string out = "`";
  for (char c : text.substr(0, kMaxQuoted)) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[(c >> 4) & 0xf];
      out += kHex[c & 0xf];
    } else {
      out += c;
    }
  }
  out += "`";
  if (text.size() > kMaxQuoted) {
    out.insert(out.size() - 1, "...");
    out += " (" + std::to_string(text.size()) + " characters)";
  }
  return out;
}

std::string Value::Describe() const {
  switch (kind) {
    case Kind::kNull:
      return "null";
    case Kind::kScalar:
      return scalar.empty() ? "an empty string" : Quote(scalar);
    case Kind::kSequence:
      return "a sequence";
    case Kind::kMapping:
      return "a mapping";
  }
  return "?";
}

namespace {

// Copies a YAML::Node tree into a Value tree, expanding merge keys and aliases under the
// limits in yaml_tree.h.
class Converter {
 public:
  Converter(std::string_view text, int origin) : text_(text), origin_(origin) {}

  bool Convert(const YAML::Node& node, const Mark& fallback, int depth, Value* out) {
    out->mark = MarkOf(node, fallback);
    if (++values_ > kMaxValues) {
      return Fail(out->mark, "the document is too large: more than " + std::to_string(kMaxValues) +
                                 " values (aliases included)");
    }
    if (depth > kMaxDepth) {
      return Fail(out->mark, "values are nested more than " + std::to_string(kMaxDepth) +
                                 " levels deep (a recursive alias?)");
    }
    switch (node.Type()) {
      case YAML::NodeType::Undefined:
      case YAML::NodeType::Null:
        out->kind = Value::Kind::kNull;
        return true;
      case YAML::NodeType::Scalar:
        out->kind = Value::Kind::kScalar;
        out->scalar = node.Scalar();
        return true;
      case YAML::NodeType::Sequence:
        out->kind = Value::Kind::kSequence;
        for (const YAML::Node& item : node) {
          if (!Convert(item, DashBefore(item, out->mark), depth + 1, &out->items.emplace_back())) {
            return false;
          }
        }
        return true;
      case YAML::NodeType::Map:
        out->kind = Value::Kind::kMapping;
        return ConvertMapping(node, depth, out);
    }
    return Fail(out->mark, "unsupported YAML node");
  }

  const Problem& problem() const { return problem_; }

 private:
  bool ConvertMapping(const YAML::Node& node, int depth, Value* out) {
    std::vector<Entry> merged;  // from `<<` keys; explicit keys win, earlier sources win
    // Not `it->first`: yaml-cpp's iterator returns its pair by value through a proxy, and a
    // reference into it dangles at the end of the statement.
    for (const auto& pair : node) {
      const YAML::Node& key = pair.first;
      Mark key_mark = MarkOf(key, out->mark);
      if (!key.IsScalar()) {
        return Fail(key_mark, std::string("a key must be a string, got ") + (key.IsNull() ? "null"
                                                                             : key.IsSequence()
                                                                                 ? "a sequence"
                                                                                 : "a mapping"));
      }
      Entry entry;
      if (!Convert(key, out->mark, depth + 1, &entry.key)) return false;
      if (!Convert(pair.second, key_mark, depth + 1, &entry.value)) return false;
      // `<<` is a merge key only when plain (a quoted "<<" is an ordinary key).
      if (key.Tag() == "?" && key.Scalar() == "<<") {
        if (!CollectMerge(entry.value, &merged)) return false;
        continue;
      }
      out->entries.push_back(std::move(entry));
    }
    for (Entry& entry : merged) {
      if (!HasKey(*out, entry.key.scalar)) out->entries.push_back(std::move(entry));
    }
    return true;
  }

  bool CollectMerge(const Value& source, std::vector<Entry>* merged) {
    auto add = [&](const Value& mapping) {
      for (const Entry& e : mapping.entries) {
        bool seen = false;
        for (const Entry& m : *merged) seen = seen || m.key.scalar == e.key.scalar;
        if (!seen) merged->push_back(e);
      }
    };
    if (source.is_mapping()) {
      add(source);
      return true;
    }
    if (source.is_sequence()) {
      for (const Value& item : source.items) {
        if (!item.is_mapping()) {
          return Fail(item.mark, "a merge key `<<` takes a mapping or a list of mappings, got " +
                                     item.Describe());
        }
        add(item);
      }
      return true;
    }
    return Fail(source.mark,
                "a merge key `<<` takes a mapping or a list of mappings, got " + source.Describe());
  }

  static bool HasKey(const Value& mapping, const std::string& key) {
    for (const Entry& e : mapping.entries) {
      if (e.key.scalar == key) return true;
    }
    return false;
  }

  Mark MarkOf(const YAML::Node& node, const Mark& fallback) const {
    YAML::Mark m = node.Mark();
    if (m.is_null()) return fallback;
    // yaml-cpp gives an empty value (`key:` with nothing after it) the position of the next
    // token, which is misleading; only an explicit `~` / `null` has a position of its own.
    if (node.IsNull() && !IsExplicitNull(m.pos)) return fallback;
    return Mark{origin_, m.line + 1, m.column + 1};
  }

  // An empty block item (`-` alone) has no position of its own: yaml-cpp gives it the next
  // token's. The item is at the `-` before that, if there is one; else at `fallback`.
  Mark DashBefore(const YAML::Node& item, const Mark& fallback) const {
    YAML::Mark m = item.Mark();
    if (!item.IsNull() || m.is_null() || m.pos < 0) return fallback;
    size_t pos = std::min(static_cast<size_t>(m.pos), text_.size());
    while (pos > 0 && std::string_view(" \t\r\n").find(text_[pos - 1]) != std::string_view::npos) {
      --pos;
    }
    if (pos == 0 || text_[pos - 1] != '-') return fallback;
    --pos;
    size_t line_start = text_.rfind('\n', pos);
    line_start = line_start == std::string_view::npos ? 0 : line_start + 1;
    int line = 1 + static_cast<int>(std::count(text_.begin(), text_.begin() + pos, '\n'));
    return Mark{origin_, line, static_cast<int>(pos - line_start) + 1};
  }

  bool IsExplicitNull(int pos) const {
    if (pos < 0 || static_cast<size_t>(pos) >= text_.size()) return false;
    std::string_view rest = text_.substr(static_cast<size_t>(pos));
    size_t len = 0;
    if (rest.substr(0, 1) == "~") {
      len = 1;
    } else if (rest.substr(0, 4) == "null" || rest.substr(0, 4) == "Null" ||
               rest.substr(0, 4) == "NULL") {
      len = 4;
    } else {
      return false;
    }
    return len == rest.size() ||
           std::string_view(" \t\r\n,]}#").find(rest[len]) != std::string_view::npos;
  }

  bool Fail(const Mark& mark, std::string message) {
    problem_ = Problem{mark, std::move(message)};
    return false;
  }

  std::string_view text_;
  int origin_;
  int values_ = 0;
  Problem problem_;
};

// yaml-cpp 0.7's LoadAll never returns on some malformed input: a `,` where a document should
// start makes the parser yield empty documents forever, allocating as it goes (yaml-cpp issue
// #1040, fixed upstream by PR #1319). So the documents are first walked with the event parser,
// under a cap, and LoadAll runs only on text that ends.
class DocumentScan : public YAML::EventHandler {
 public:
  static constexpr int kMaxDocuments = 64;

  int documents() const { return documents_; }
  const YAML::Mark& last_top_level_mark() const { return mark_; }

  void OnDocumentStart(const YAML::Mark& mark) override {
    ++documents_;
    mark_ = mark;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& mark, YAML::anchor_t) override { Top(mark); }
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t) override { Top(mark); }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                const std::string&) override {
    Top(mark);
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    Top(mark);
    ++depth_;
  }
  void OnSequenceEnd() override { --depth_; }
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    Top(mark);
    ++depth_;
  }
  void OnMapEnd() override { --depth_; }

 private:
  void Top(const YAML::Mark& mark) {
    if (depth_ == 0) mark_ = mark;
  }
  int documents_ = 0;
  int depth_ = 0;
  YAML::Mark mark_;
};

// Throws YAML::ParserException where DocumentScan finds yaml-cpp would loop.
void CheckDocumentsEnd(std::string_view text) {
  std::istringstream in{std::string(text)};
  YAML::Parser parser(in);
  DocumentScan scan;
  while (parser.HandleNextDocument(scan)) {
    if (scan.documents() > DocumentScan::kMaxDocuments) {
      const YAML::Mark& mark = scan.last_top_level_mark();
      std::string what = "more than " + std::to_string(DocumentScan::kMaxDocuments) +
                         " documents, or text where a document should start";
      if (mark.pos >= 0 && static_cast<size_t>(mark.pos) < text.size()) {
        what = std::string("unexpected `") + text[static_cast<size_t>(mark.pos)] + "`";
      }
      throw YAML::ParserException(mark, what);
    }
  }
}

bool FromJson(const nlohmann::json& j, int depth, int* count, Value* out, Problem* problem) {
  if (++*count > kMaxValues || depth > kMaxDepth) {
    *problem = Problem{Mark{}, "the JSON document is too large or too deeply nested"};
    return false;
  }
  switch (j.type()) {
    case nlohmann::json::value_t::object:
      out->kind = Value::Kind::kMapping;
      for (const auto& [key, value] : j.items()) {
        Entry& e = out->entries.emplace_back();
        e.key.kind = Value::Kind::kScalar;
        e.key.scalar = key;
        if (!FromJson(value, depth + 1, count, &e.value, problem)) return false;
      }
      return true;
    case nlohmann::json::value_t::array:
      out->kind = Value::Kind::kSequence;
      for (const auto& item : j) {
        if (!FromJson(item, depth + 1, count, &out->items.emplace_back(), problem)) return false;
      }
      return true;
    case nlohmann::json::value_t::string:
      out->kind = Value::Kind::kScalar;
      out->scalar = j.get<std::string>();
      return true;
    case nlohmann::json::value_t::null:
      out->kind = Value::Kind::kNull;
      return true;
    default:  // numbers and booleans: their JSON text is also their YAML text
      out->kind = Value::Kind::kScalar;
      out->scalar = j.dump();
      return true;
  }
}

// Moves marks parsed from an override's VALUE (line 1 = the value text) to the override.
void Relocate(int index, int column_offset, Value* v) {
  if (v->mark.line == 1) v->mark.column += column_offset;
  v->mark.origin = index;
  v->mark.line = index;
  for (Value& item : v->items) Relocate(index, column_offset, &item);
  for (Entry& e : v->entries) {
    Relocate(index, column_offset, &e.key);
    Relocate(index, column_offset, &e.value);
  }
}

struct PathSegment {
  bool is_index = false;
  std::string key;    // !is_index
  size_t index = 0;   // is_index
  size_t offset = 0;  // in the override text, for marks
};

// Parses `a.b[1].c` into segments; on error returns false with `*problem` at the offset.
bool ParsePath(std::string_view path, std::vector<PathSegment>* out, size_t* error_offset,
               std::string* error) {
  size_t i = 0;
  auto fail = [&](size_t at, std::string message) {
    *error_offset = at;
    *error = std::move(message);
    return false;
  };
  while (true) {
    size_t start = i;
    while (i < path.size() && path[i] != '.' && path[i] != '[' && path[i] != ']') ++i;
    if (i == start) {
      return fail(start, start == 0 ? "the path must start with a key, e.g. `server.grpc.address`"
                                    : "expected a key");
    }
    out->push_back(PathSegment{false, std::string(path.substr(start, i - start)), 0, start});
    while (i < path.size() && path[i] == '[') {
      size_t open = i++;
      size_t digits = i;
      while (i < path.size() && path[i] >= '0' && path[i] <= '9') ++i;
      if (i == digits || i - digits > 9 || i >= path.size() || path[i] != ']') {
        return fail(open, "expected a list index such as `[0]`");
      }
      out->push_back(
          PathSegment{true, "", std::stoul(std::string(path.substr(digits, i - digits))), open});
      ++i;
    }
    if (i == path.size()) return true;
    if (path[i] != '.') return fail(i, std::string("unexpected `") + path[i] + "`");
    ++i;
  }
}

// The first `count` segments as a path in backticks. (Built by appending: `"[" + ... + "]"`
// trips GCC 12's -Wrestrict false positive, GCC PR 105329.)
std::string Display(const std::vector<PathSegment>& segments, size_t count) {
  std::string s;
  for (size_t i = 0; i < count; ++i) {
    if (segments[i].is_index) {
      s += '[';
      s += std::to_string(segments[i].index);
      s += ']';
    } else {
      if (!s.empty()) s += ".";
      s += segments[i].key;
    }
  }
  if (s.empty()) return "the top level";
  std::string quoted = "`";
  quoted += s;
  quoted += "`";
  return quoted;
}

}  // namespace

bool ParseYaml(std::string_view text, int origin, Value* out, Problem* problem) {
  std::vector<YAML::Node> docs;
  try {
    CheckDocumentsEnd(text);
    docs = YAML::LoadAll(std::string(text));
  } catch (const YAML::Exception& e) {
    problem->mark =
        e.mark.is_null() ? Mark{origin, 0, 0} : Mark{origin, e.mark.line + 1, e.mark.column + 1};
    problem->message = "invalid YAML: " + e.msg;
    return false;
  }
  // Empty documents (a stray `---` at the end) are ignored; two real ones are an error.
  const YAML::Node* doc = nullptr;
  for (const YAML::Node& d : docs) {
    if (d.IsNull()) continue;
    if (doc != nullptr) {
      YAML::Mark m = d.Mark();
      problem->mark = Mark{origin, m.line + 1, m.column + 1};
      problem->message = "expected one YAML document, found a second one (after a `---` line)";
      return false;
    }
    doc = &d;
  }
  *out = Value{};
  out->mark = Mark{origin, 1, 1};
  if (doc == nullptr) return true;
  Converter converter(text, origin);
  try {
    if (!converter.Convert(*doc, out->mark, 0, out)) {
      *problem = converter.problem();
      return false;
    }
  } catch (const YAML::Exception& e) {
    *problem = Problem{Mark{origin, 0, 0}, "invalid YAML: " + e.msg};
    return false;
  }
  return true;
}

bool ParseJson(std::string_view text, Value* out, Problem* problem) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    // what() is "[json.exception.parse_error.101] parse error at line 1, column 9: <why>".
    std::string what = e.what();
    Mark mark;
    size_t at = what.find(" at line ");
    size_t colon = what.find(": ", at == std::string::npos ? 0 : at);
    if (at != std::string::npos && colon != std::string::npos &&
        std::sscanf(what.c_str() + at, " at line %d, column %d", &mark.line, &mark.column) == 2) {
      what = what.substr(colon + 2);
    } else {
      mark = Mark{};
      size_t bracket = what.find("] ");
      if (bracket != std::string::npos) what = what.substr(bracket + 2);
    }
    *problem = Problem{mark, "invalid JSON: " + what};
    return false;
  }
  *out = Value{};
  int count = 0;
  return FromJson(j, 0, &count, out, problem);
}

void ApplyOverride(std::string_view text, int index, Value* root, std::vector<Problem>* problems) {
  auto fail = [&](size_t offset, const std::string& message) {
    problems->push_back(Problem{Mark{index, index, static_cast<int>(offset) + 1}, message});
  };
  size_t eq = text.find('=');
  if (eq == std::string_view::npos) {
    fail(0, "expected PATH=VALUE, e.g. `server.grpc.address=127.0.0.1:0`");
    return;
  }
  // Spaces around the path are forgiven (`--set "a.b = 1"`); VALUE is YAML, which trims.
  size_t path_begin = text.find_first_not_of(" \t");
  size_t path_end = text.find_last_not_of(" \t", eq == 0 ? 0 : eq - 1);
  std::string_view path;
  if (path_begin < eq && path_end != std::string_view::npos && path_end >= path_begin) {
    path = text.substr(path_begin, path_end + 1 - path_begin);
  } else {
    path_begin = 0;
  }
  std::vector<PathSegment> segments;
  size_t error_offset = 0;
  std::string error;
  if (!ParsePath(path, &segments, &error_offset, &error)) {
    fail(path_begin + error_offset, "invalid PATH in PATH=VALUE: " + error);
    return;
  }

  Value value;
  Problem problem;
  if (!ParseYaml(text.substr(eq + 1), index, &value, &problem)) {
    problem.mark.line = index;
    problem.mark.column = problem.mark.column == 0 ? static_cast<int>(eq) + 2
                                                   : problem.mark.column + static_cast<int>(eq) + 1;
    problems->push_back(std::move(problem));
    return;
  }
  Relocate(index, static_cast<int>(eq) + 1, &value);

  // Check the whole path first, so that a failed override leaves the tree untouched.
  const Value* probe = root;  // nullptr: this level does not exist yet and will be created
  for (size_t i = 0; i < segments.size(); ++i) {
    const PathSegment& s = segments[i];
    if (probe != nullptr && probe->is_null()) probe = nullptr;
    if (s.is_index) {
      if (probe != nullptr && !probe->is_sequence()) {
        fail(path_begin + s.offset, Display(segments, i) + " is " + probe->Describe() +
                                        ", not a sequence; it cannot be indexed");
        return;
      }
      size_t size = probe == nullptr ? 0 : probe->items.size();
      if (s.index > size) {
        fail(path_begin + s.offset, "index [" + std::to_string(s.index) +
                                        "] is out of range: " + Display(segments, i) + " has " +
                                        std::to_string(size) + " entries (use [" +
                                        std::to_string(size) + "] to append one)");
        return;
      }
      probe = s.index < size ? &probe->items[s.index] : nullptr;
    } else {
      if (probe != nullptr && !probe->is_mapping()) {
        fail(path_begin + s.offset, Display(segments, i) + " is " + probe->Describe() +
                                        ", not a mapping; it has no key `" + s.key + "`");
        return;
      }
      const Value* next = nullptr;
      if (probe != nullptr) {
        for (const Entry& e : probe->entries) {
          if (e.key.scalar == s.key) next = &e.value;  // the last one, as for the build below
        }
      }
      probe = next;
    }
  }

  Value* node = root;
  for (const PathSegment& s : segments) {
    Mark mark{index, index, static_cast<int>(path_begin + s.offset) + 1};
    if (s.is_index) {
      if (node->is_null()) {
        node->kind = Value::Kind::kSequence;
        if (node->mark.line == 0) node->mark = mark;
      }
      if (s.index == node->items.size()) node->items.emplace_back().mark = mark;
      node = &node->items[s.index];
    } else {
      if (node->is_null()) {  // keeps its position: a new list entry is at its `[i]`
        node->kind = Value::Kind::kMapping;
        if (node->mark.line == 0) node->mark = mark;
      }
      Value* next = nullptr;
      for (Entry& e : node->entries) {
        if (e.key.scalar == s.key) next = &e.value;
      }
      if (next == nullptr) {
        Entry& e = node->entries.emplace_back();
        e.key.kind = Value::Kind::kScalar;
        e.key.scalar = s.key;
        e.key.mark = mark;
        e.value.mark = mark;
        next = &e.value;
      }
      node = next;
    }
  }
  *node = std::move(value);
}

}  // namespace kiln::config::internal
