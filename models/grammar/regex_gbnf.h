// Regular expressions to GBNF (grammar.h), for Kiln's `regex` constraint and JSON Schema's
// `pattern` (json_schema.h).
//
// The regex matches the WHOLE text, as if anchored: a leading `^` and a trailing `$` (at the
// start / end of any top-level alternative) are accepted and change nothing.
//
// Supported (ECMAScript syntax, which JSON Schema's `pattern` uses):
//   literals; escaped metacharacters (\. \* \( \\ \/ ...); \n \t \r \f \v \0 \xHH \uHHHH
//   (a \uD8xx\uDCxx surrogate pair is one code point) \u{H...};
//   classes \d \w \s and their negations \D \W \S (\s is ECMAScript's: ASCII and Unicode spaces);
//   [...] and [^...] with ranges and the escapes above inside ([\b] is backspace; [^] is any
//   character); `.` (any character but \n);
//   groups (...) and (?:...); alternation |;
//   quantifiers * + ? {m} {m,} {m,n}, each with an optional lazy `?` (same language).
//   A `{` that does not start a valid quantifier is a literal, as in ECMAScript.
// Refused with InvalidArgument naming the construct and its position (in code points, from 0):
//   backreferences (\1, \k<name>), lookaround ((?=, (?!, (?<=, (?<!), named groups ((?<name>,
//   (?P<name>), atomic groups, inline flags, \b \B, \p{..}, \cX, other letter escapes, `^` / `$`
//   anywhere else, possessive quantifiers (a*+), a quantifier with nothing to repeat, counts above
//   kMaxRegexRepeat, an empty class [], unbalanced parentheses or brackets, invalid UTF-8.
//
// The output is one GBNF rule per line. Repetitions of something that can be empty are rewritten
// (`(a*)*` as `(a+)*`, `(a?b?){0,3}` as `(a b? | b){0,3}`), since the grammar refuses rules that
// recurse without consuming input; long parts the rewrite needs twice become helper rules, so the
// output stays linear in the pattern.
//
// Limits (a single request may send a pattern; InvalidArgument beyond them): patterns of at most
// kMaxRegexPatternBytes, kMaxRegexNodes syntax nodes once rewritten, and kMaxRegexGbnfBytes of
// GBNF ("the regex is too complex: ...").
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::grammar {

inline constexpr int kMaxRegexRepeat = 1000;
inline constexpr size_t kMaxRegexPatternBytes = 16 * 1024;
inline constexpr int kMaxRegexNodes = 1 << 18;
inline constexpr size_t kMaxRegexGbnfBytes = 1 << 20;

struct RegexGbnfOptions {
  // The regex describes the content of a JSON string (JSON Schema's `pattern`); the rule matches
  // that content as JSON writes it, between the quotes: characters other than `"`, `\` and the
  // controls U+0000..U+001F, U+007F are written as they are (`/` also as `\/`), `"` and `\` as
  // `\"` and `\\`, controls as their short escape (\b \f \n \r \t) or \u00XX (either case). A
  // \uXXXX spelling of any other character is not matched.
  bool json_string = false;
  // false: JSON Schema's search semantics — a top-level alternative without a leading `^` may be
  // preceded by any text, one without a trailing `$` followed by any text.
  bool anchored = true;
};

// Translates `pattern` (UTF-8) into GBNF that defines the rule `rule`; helper rules, where
// needed, are named `rule` + "-" + a suffix. `rule` must be a GBNF rule name ([a-zA-Z0-9-]+).
StatusOr<std::string> RegexToGbnf(std::string_view pattern, std::string_view rule = "root");
StatusOr<std::string> RegexToGbnf(std::string_view pattern, std::string_view rule,
                                  const RegexGbnfOptions& options);
// The same, with helper rules named by `new_rule`: given the name a helper would have (`rule` +
// "-" + a number), it returns a fresh rule name to use instead (json_schema.cc reserves them
// among its rules). An empty function: those names.
StatusOr<std::string> RegexToGbnf(std::string_view pattern, std::string_view rule,
                                  const RegexGbnfOptions& options,
                                  const std::function<std::string(std::string_view)>& new_rule);

// ---- GBNF text helpers, shared with json_schema.cc ------------------------------------------

// `utf8` as a GBNF literal, quotes included: printable ASCII as is, `"` `\` and \n \r \t escaped,
// other controls as \xHH, non-ASCII as \uHHHH / \UHHHHHHHH (invalid UTF-8 as U+FFFD).
std::string GbnfLiteral(std::string_view utf8);
// One code point as written inside a GBNF character class [...].
std::string GbnfClassChar(uint32_t cp);
// Whether `name` is a valid rule name for the generated grammars: [a-zA-Z0-9-]+.
bool IsGbnfRuleName(std::string_view name);
// Whether `expr` is one GBNF primary (a literal, a class, a rule name, a group, `.`), to which a
// quantifier can be appended.
bool IsGbnfPrimary(std::string_view expr);
// The alternatives as one GBNF sequence: `(a | b)` (duplicates dropped), `a` alone; an empty
// alternative makes the rest optional (`(a | b)?`); "" when there are only empty ones.
// REQUIRES: at least one alternative.
std::string GbnfAlternatives(const std::vector<std::string>& alternatives);
// `expr` repeated min..max times (max < 0: unbounded): `x?`, `x*`, `x+`, `x{m,n}`, `(a b){m}`,
// `expr` itself for {1,1}, "" for max 0.
std::string GbnfRepeat(const std::string& expr, int min, int max);

}  // namespace kiln::grammar
