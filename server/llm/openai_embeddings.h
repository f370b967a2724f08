// POST /v1/embeddings (OpenAI's embeddings API) over `kind: embedding` models:
//
//   {"model": "all-MiniLM-L6-v2", "input": "text" | ["text", ...],
//    "encoding_format": "float" | "base64", "dimensions": 128, "user": "...",
//    "truncate": false}
//   -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}],
//       "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}
//
// Each text becomes one row of the model's tensor path (models/encoder/
// embedding_tensor_model.h), so texts from concurrent requests share the dynamic batcher's
// steps. Up to 2,048 texts per request (OpenAI's limit). A text longer than the model's length
// is refused (400, param `input`) unless `truncate: true` (Kiln's extension, as Hugging Face
// TEI's) asks to cut it. `dimensions` keeps the first N values and re-normalises them
// (meaningful for Matryoshka-trained models). `base64` is the float32 little-endian bytes.
// Errors in OpenAI's shape (openai_http.h). Traced like every route (W3C traceparent in and
// out; each batch's queue and execute spans under the request's).
//
// Thread-safety: as OpenAiApi::Handle; never blocks an I/O thread.
#pragma once

#include <memory>

#include "server/core.h"
#include "server/http/http_server.h"

namespace kiln::llm {

void HandleEmbeddings(ServerCore& core, const http::Request& request,
                      const std::shared_ptr<http::Responder>& responder);

}  // namespace kiln::llm
