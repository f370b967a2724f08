// A context-free grammar over bytes: the one form that GBNF (llama.cpp's grammar format), JSON
// Schema (json_schema.h) and regular expressions (regex_gbnf.h) compile to, and that the matcher
// (matcher.h) walks to constrain generation.
//
// GBNF, as llama.cpp's grammars/README.md defines it:
//   rule-name ::= alternative | alternative ...      (rule names: [a-zA-Z0-9-_]+)
//   "literal" with \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH escapes; [a-z0-9_] [^"\\] classes;
//   `.` (any character); ( groups ); x* x+ x? x{m} x{m,} x{m,n}; # comments to end of line.
// Literals and classes are Unicode code points. They are compiled to bytes here: a class over
// code points becomes alternatives of UTF-8 byte-range sequences, so the matcher, like the
// tokens it tests, sees only bytes (a token may end in the middle of a character). Repetitions
// become right-recursive helper rules, which the matcher runs without growing its stack.
//
// Left recursion (`expr ::= expr "+" term`) is refused with the rule named: the matcher is a
// top-down pushdown automaton, as llama.cpp's is. So is a start rule that matches nothing, and a
// grammar past the size limits below (checked as it is parsed).
//
// Thread-safety: a Grammar is immutable after parsing; share it freely.
#pragma once

#include <absl/container/flat_hash_map.h>

#include <bitset>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::grammar {

using ByteSet = std::bitset<256>;

// One element of a rule's alternative. Alternatives are stored one after another in one array,
// each ended by a kEnd element.
struct Element {
  enum Kind : uint8_t {
    kBytes,  // one byte in byte_set(arg)
    kRule,   // the rule `arg`
    kEnd,    // end of an alternative of rule `arg`
  };
  Kind kind = kEnd;
  int32_t arg = 0;
};

class Grammar {
 public:
  // Parses GBNF text; the start rule is `root`. Errors give the line and column and say what
  // was expected ("grammar:3:14: expected `::=` after the rule name `value`"); a rule used but
  // never defined, an undefined root, left recursion and grammars over kMaxElements are refused
  // by name.
  static StatusOr<Grammar> ParseGbnf(std::string_view text, std::string_view root = "root");

  // Whether `text` as a whole is in the grammar's language. For tests and validation; the
  // serving path uses the matcher.
  bool Matches(std::string_view text) const;

  int32_t root() const { return root_; }
  int32_t num_rules() const { return static_cast<int32_t>(rule_names_.size()); }
  const std::string& rule_name(int32_t rule) const { return rule_names_[rule]; }
  // The positions in elements() where each alternative of `rule` starts.
  std::span<const int32_t> alternatives(int32_t rule) const { return rule_alternatives_[rule]; }
  const Element& element(int32_t pos) const { return elements_[pos]; }
  int32_t num_elements() const { return static_cast<int32_t>(elements_.size()); }
  const ByteSet& byte_set(int32_t i) const { return byte_sets_[i]; }
  // Whether `rule` can match the empty string.
  bool nullable(int32_t rule) const { return nullable_[rule] != 0; }

  // The compiled grammar as text, one rule per line (byte sets as [\x00-\x7f]), for dumps.
  std::string ToString() const;

  // Limits on the compiled grammar (repetitions count as their expansion): a request's grammar
  // past them is refused while it is being parsed, before it takes memory.
  static constexpr int64_t kMaxElements = 1 << 19;
  static constexpr int64_t kMaxRules = 1 << 17;
  static constexpr int kMaxNesting = 100;  // groups within groups

 private:
  friend class GrammarBuilder;
  std::vector<Element> elements_;
  std::vector<ByteSet> byte_sets_;
  std::vector<std::string> rule_names_;
  std::vector<std::vector<int32_t>> rule_alternatives_;
  std::vector<uint8_t> nullable_;
  int32_t root_ = 0;
};

// Builds a grammar element by element; the GBNF parser and tests use it.
class GrammarBuilder {
 public:
  // The id of the rule `name`, created (undefined) if new.
  int32_t Rule(std::string_view name);
  // A fresh rule named `base` + a unique suffix.
  int32_t NewRule(std::string_view base);
  bool defined(int32_t rule) const;
  // Adds one alternative to `rule` (may be empty: the rule matches nothing-long).
  void AddAlternative(int32_t rule, std::vector<Element> sequence);
  Element Bytes(const ByteSet& set);
  // One element matching exactly the UTF-8 encodings of the code points in `ranges` (inclusive
  // [lo, hi] pairs; surrogates and values above U+10FFFF are dropped): a byte set when they are
  // all ASCII, else a new rule (named after `base`) of byte-set sequences.
  Element CodePoints(std::span<const std::pair<uint32_t, uint32_t>> ranges, std::string_view base);
  // Elements matching `bytes` literally.
  void Literal(std::string_view bytes, std::vector<Element>* out);

  // Whether the grammar so far is past Grammar::kMaxElements or kMaxRules.
  bool too_large() const;

  // Checks (size, undefined rules, a start rule that matches nothing, left recursion) and
  // finishes the grammar.
  StatusOr<Grammar> Build(std::string_view root);

 private:
  Grammar g_;
  std::vector<std::vector<std::vector<Element>>> rules_;  // rule -> alternatives
  std::vector<uint8_t> defined_;
  absl::flat_hash_map<std::string, int32_t> rule_index_;
  std::vector<std::pair<ByteSet, int32_t>> byte_set_index_;
  int64_t elements_ = 0;
  int32_t fresh_ = 0;
};

}  // namespace kiln::grammar
