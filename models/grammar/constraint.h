// What a request asks its output to match (structured output), compiled to a Grammar: the one
// entry point the front ends use for OpenAI's response_format, Kiln's `grammar` and `regex`
// fields, and their kiln.v1 and KServe equivalents.
//
// Compiled grammars are cached by (kind, strict, text), so a client that sends the same schema
// with every request compiles it once, and the batcher's per-model token-mask caches
// (token_mask.h), keyed by the Grammar object, are reused across its requests too.
//
// Thread-safety: CompileConstraint is thread-safe.
#pragma once

#include <memory>
#include <string>

#include "engine/base/status.h"
#include "models/grammar/grammar.h"

namespace kiln::grammar {

struct Constraint {
  enum class Kind {
    kJsonObject,  // any JSON object (response_format {type: "json_object"}); `text` unused
    kJsonSchema,  // `text` is a JSON Schema as JSON text
    kGbnf,        // `text` is llama.cpp's GBNF, start rule `root`
    kRegex,       // `text` is a regular expression the whole output must match
  };
  Kind kind = Kind::kJsonObject;
  std::string text;
  // JSON Schema only: unsupported keywords are errors (else ignored: the output then matches
  // the supported part of the schema).
  bool strict = false;
};

// The constraint's grammar. InvalidArgument for a schema, grammar or regex that does not
// compile (or is past the size limits), with what was wrong and where (the caller names its
// field with WithParam).
StatusOr<std::shared_ptr<const Grammar>> CompileConstraint(const Constraint& constraint);

// Grammars in CompileConstraint's cache (least recently used dropped first); only constraints
// of at most kMaxCachedConstraintBytes are cached. Longer texts than kMaxConstraintBytes are
// refused.
inline constexpr size_t kConstraintCacheSize = 64;
inline constexpr size_t kMaxCachedConstraintBytes = 64 << 10;
inline constexpr size_t kMaxConstraintBytes = 1 << 20;

}  // namespace kiln::grammar
