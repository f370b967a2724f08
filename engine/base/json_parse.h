// JSON from clients: the one parser for request bodies (the OpenAI routes, KServe REST
// infer/generate, the repository, LoRA and fine-tuning routes), JSON carried inside a request
// (`sampling_parameters`, a load's `config`) and the lines of uploaded training files.
//
// It never throws, and every way a document can be refused is an InvalidArgument that says
// where: a number beyond a double's range ("temperature": 1e400) names its field,
//   "`temperature`: number out of range: 1e400 is beyond a double's ±1.8e308"
// with the field attached by WithParam (the OpenAI front end's `param`); a syntax error or
// invalid UTF-8 gives the parser's line and column, and the field when it sits in a value:
//   "the request body is not valid JSON: `messages[0].content`: parse error at line 1, ..."
//
// Nesting is bounded (kMaxJsonDepth): code that walks a document recursively — dump(), copies,
// the chat template's conversion of messages — must not overflow the stack on a request
// such as 100,000 nested arrays; deeper documents are refused, naming the field.
//
// Thread-safety: pure functions.
#pragma once

#include <string_view>

#include "engine/base/status.h"
#include "nlohmann/json.hpp"

namespace kiln {

// The deepest nesting of arrays and objects ParseJsonObject accepts (the root object is
// level 1). JSON schemas and tool definitions rarely pass 20.
inline constexpr int kMaxJsonDepth = 256;

// Parses `text`, which must hold one JSON object. `what` names the document in errors ("the
// request body", "input 'sampling_parameters'"); empty, the messages start with what is wrong
// ("not valid JSON: ...", "expected a JSON object, got a list"), for a caller that puts its
// own location first. `field_prefix` goes before field names found inside the document
// ("sampling_parameters." for a document nested in that field).
StatusOr<nlohmann::json> ParseJsonObject(std::string_view text, std::string_view what,
                                         std::string_view field_prefix = "");
// The same, keeping the members in document order (as Python's json does: training examples).
StatusOr<nlohmann::ordered_json> ParseOrderedJsonObject(std::string_view text,
                                                        std::string_view what,
                                                        std::string_view field_prefix = "");

// "a string", "a list", "an integer", ... for messages such as "must be an object, got a list".
std::string_view JsonTypeName(const nlohmann::json& value);

}  // namespace kiln
