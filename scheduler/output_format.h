// What front ends use to constrain and read a reply's format: structured output (a JSON Schema,
// any JSON object, a GBNF grammar or a regex, compiled to the grammar the batcher masks tokens
// with: models/grammar/constraint.h) and tool calling (checking `tools`, the grammar of a forced
// call, reading calls out of the reply: models/chat/tool_calls.h). The request path's public
// face for both, as generation.h is for generation; the front ends include only this.
#pragma once

#include "models/chat/tool_calls.h"     // IWYU pragma: export
#include "models/grammar/constraint.h"  // IWYU pragma: export
