// JSON Schema to GBNF (grammar.h): OpenAI's response_format {type: "json_schema"} and
// {type: "json_object"}.
//
// The grammar generates JSON text of one value that the schema accepts. Between tokens it allows
// at most one space, or one newline and up to 20 spaces or tabs (bounded, so that a small model
// cannot pad forever); nothing before or after the top-level value. Numbers have at most 19
// integer digits (more only when a bound needs them), 16 fraction digits and 3 exponent digits.
//
// Keyword                        Support
// -----------------------------  ---------------------------------------------------------------
// type                           string, number, integer, boolean, null, object, array, or a list
//                                of those (alternatives). Absent: the types whose keywords the
//                                schema uses (properties -> object, items -> array, ...); none:
//                                any JSON value.
// properties, required           Properties in the schema's key order (keep it with
//                                nlohmann::ordered_json; nlohmann::json sorts keys). Required ones
//                                always present, optional ones may each be left out. A required
//                                name without a property schema is a property of any value.
// additionalProperties           false: none. true or a schema: after the declared properties,
//                                any number of other keys with values of that schema; keys are
//                                compared as spelled ("\u0061" is not "a"; names JSON must escape
//                                are not excluded). Absent: none when the schema has `properties`
//                                or in strict mode (as OpenAI's strict mode); otherwise (a bare
//                                {"type": "object"}) any object.
// items, prefixItems             items: every element (or, as an array, a tuple, with
//                                additionalItems for the rest); prefixItems: the first elements,
//                                then `items` for the rest. With prefixItems and no `items` (or
//                                items: false) the array is the tuple.
// minItems, maxItems             Exact; a tuple is complete unless minItems says less. At most
//                                kMaxSchemaRepeat.
// enum, const                    Any JSON values, written compactly (as nlohmann dumps them; object
//                                keys in the order the json type keeps). enum values not of the
//                                schema's `type` are dropped.
// anyOf, oneOf                   Alternatives (oneOf's exclusivity is not enforced). Sibling
//                                keywords are merged into each alternative (`type`: the common
//                                types; an alternative with none drops out).
// allOf                          Merged when its schemas (a lone $ref is resolved first) and the
//                                siblings use different keywords (or the same values); otherwise
//                                unsupported. An allOf of one $ref and annotations is that $ref.
// minimum, maximum,              Exact for integers (digit-wise ranges) and numbers (integer part
// exclusiveMinimum,              and fraction digit-wise: x >= 1.5 is 1.[5-9]... or 2 and above);
// exclusiveMaximum               no exponent when a bound is set, "-0" not generated. Draft 4's
//                                boolean exclusiveMinimum/Maximum too. Bounds with more than 40
//                                digits: unsupported.
// minLength, maxLength           Characters (a plain character or one escape), at most
//                                kMaxSchemaRepeat.
// pattern                        regex_gbnf.h, with JSON Schema's unanchored search semantics;
//                                the characters are matched as JSON writes them (\uXXXX only for
//                                controls). Together with minLength/maxLength: lengths unsupported.
// format                         date, time, date-time (RFC 3339), uuid; other formats unsupported.
//                                With pattern or lengths: those unsupported.
// $ref                           "#", "#/$defs/...", "#/definitions/...", any JSON pointer into
//                                this document ("#/properties/a"); recursion allowed (a rule per
//                                referenced schema). Other keywords beside $ref: unsupported.
// $defs, definitions, $anchor,   Accepted (no effect).
// title, description, $schema,
// $id (id), $comment, default, examples,
// deprecated, readOnly,
// writeOnly
// anything else (multipleOf,     Unsupported.
// uniqueItems, contains,
// patternProperties, not,
// if/then/else, minProperties,..)
//
// Unsupported keywords: with `strict`, an InvalidArgument error naming them; otherwise ignored
// (the output then matches the supported part of the schema) and listed in `ignored`.
// Invalid schemas (a schema that is not an object or boolean, an unknown type, minItems above
// maxItems, a $ref that does not resolve or points outside the document, a keyword of the wrong
// JSON type, a schema no value satisfies) are InvalidArgument errors that name the place as a
// JSON pointer: "json_schema /properties/age/minimum: ...".
//
// Limits, as one request can send any schema (InvalidArgument "the schema is too complex: ..."
// beyond them): at most kMaxSchemaVisits subschemas translated (a $ref, or an allOf of one $ref,
// is translated once however often it is used; merged allOf parts and alternatives merged with
// their siblings are translated per use) and kMaxSchemaGbnfBytes of GBNF.
//
// A schema whose references recurse without consuming input ({"$ref": "#"}) produces a grammar
// that Grammar::ParseGbnf refuses as left-recursive.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "engine/base/status.h"
#include "nlohmann/json_fwd.hpp"

namespace kiln::grammar {

inline constexpr int kMaxSchemaRepeat = 10000;
inline constexpr int kMaxSchemaVisits = 100'000;
inline constexpr size_t kMaxSchemaGbnfBytes = 4 << 20;

struct JsonSchemaOptions {
  // Unsupported keywords are an error naming them (else they are ignored, and listed in
  // `ignored`); an absent additionalProperties is false.
  bool strict = false;
};

struct JsonSchemaGrammar {
  std::string gbnf;                  // GBNF, start rule "root"
  std::vector<std::string> ignored;  // what was ignored: JSON pointer + keyword ("/properties/a:
                                     // format"; the root is "(root): format")
};

StatusOr<JsonSchemaGrammar> JsonSchemaToGbnf(const nlohmann::ordered_json& schema,
                                             const JsonSchemaOptions& options = {});
// The same, for a schema whose object keys are sorted (nlohmann::json): properties are generated
// in that order.
StatusOr<JsonSchemaGrammar> JsonSchemaToGbnf(const nlohmann::json& schema,
                                             const JsonSchemaOptions& options = {});

// Any JSON object (response_format {type: "json_object"}), start rule "root".
std::string JsonObjectGbnf();

}  // namespace kiln::grammar
