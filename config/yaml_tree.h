// Internal to config/: a YAML document as a plain tree of values with source positions.
//
// The config is decoded from this tree rather than from yaml-cpp's YAML::Node because good
// errors need what YAML::Node does not keep reliably: an empty value (`key:`) carries the
// position of the *next* token, aliases share nodes (a recursive alias loops forever), and
// `--set` overrides must be able to replace a value while remembering where the new one came
// from. The document is copied into this tree once, right after parsing.
//
// Thread-safety: plain values; the functions are pure and thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kiln::config::internal {

// Where a value was written. Lines and columns are 1-based; 0 means unknown (JSON parsed by
// nlohmann_json has no positions).
struct Mark {
  int origin = 0;  // 0: the text being parsed; k >= 1: the k-th --set override
  int line = 0;    // for an override: k, so that "<set>:k:col" names the override
  int column = 0;  // for an override: the column in the override's text
};

struct Entry;

struct Value {
  enum class Kind { kNull, kScalar, kSequence, kMapping };

  Kind kind = Kind::kNull;
  std::string scalar;          // kScalar: the text, unquoted and unescaped
  std::vector<Value> items;    // kSequence
  std::vector<Entry> entries;  // kMapping, in document order; duplicate keys are kept
  Mark mark;

  bool is_null() const { return kind == Kind::kNull; }
  bool is_scalar() const { return kind == Kind::kScalar; }
  bool is_sequence() const { return kind == Kind::kSequence; }
  bool is_mapping() const { return kind == Kind::kMapping; }
  // For messages: "null", "a sequence", "a mapping", "an empty string", or Quote(scalar).
  std::string Describe() const;
};

struct Entry {
  Value key;  // always a scalar (a complex key is a parse problem)
  Value value;
};

// `text` in backticks for a message: control characters escaped (\x0a), and only the first 200
// characters of a longer text, followed by its length.
std::string Quote(std::string_view text);

// Something wrong in the input, with where it is.
struct Problem {
  Mark mark;
  std::string message;
};

// Limits that keep hostile input (the model-load API takes a config) from exhausting memory:
// aliases can make a small document expand exponentially.
inline constexpr int kMaxDepth = 64;
inline constexpr int kMaxValues = 200000;

// Parses `text` as one YAML document into `*out`. An empty document (or only comments) is a
// null value at 1:1. Merge keys (`<<: *anchor`) are expanded. Returns false and fills
// `*problem` for malformed YAML ("invalid YAML: ..."), a second document, a non-scalar key,
// or input past the limits above. Marks get `origin`.
bool ParseYaml(std::string_view text, int origin, Value* out, Problem* problem);

// Parses strict JSON (RFC 8259) with nlohmann_json into `*out`; positions are unknown (0).
// Used for JSON that yaml-cpp cannot read (e.g. \uD83D\uDE00 surrogate pairs).
bool ParseJson(std::string_view text, Value* out, Problem* problem);

// Applies the `index`-th (1-based) `--set` override, `PATH=VALUE`, to `*root`. PATH is
// dotted keys with `[i]` list indices (`models[1].max_batch_size`); missing keys and mappings
// are created, and `[n]` on a list of n entries appends one. VALUE is parsed as YAML (a
// scalar or a flow collection; empty means null, i.e. "use the default") and replaces what
// was there. On a problem, `*root` is left unchanged and the problem is appended.
void ApplyOverride(std::string_view text, int index, Value* root, std::vector<Problem>* problems);

}  // namespace kiln::config::internal
