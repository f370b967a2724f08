// The OpenAPI 3.1 document of kilnd's HTTP API: docs/openapi.json itself, compiled into kilnd
// at build time (kiln_embed_text in server/CMakeLists.txt) and served at GET /openapi.json.
// server/openapi_test.cc checks that its routes are exactly server/http_routes.cc's.
//
// Thread-safety: constant.
#pragma once

#include <string_view>

namespace kiln {

// The document's JSON text, as checked in.
std::string_view OpenApiJson();

}  // namespace kiln
