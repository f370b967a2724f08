// The OpenAI-compatible HTTP API, served on server.http next to KServe's /v2 routes:
//
//   GET  /v1/models, /v1/models/{model}     the ready LLMs and embedding models
//   POST /v1/completions                    one prompt (text or token ids) -> text
//   POST /v1/chat/completions               messages, rendered with the model's template
//   POST /v1/embeddings                     texts -> vectors (openai_embeddings.h)
//   POST /v1/load_lora_adapter              {"lora_name", "lora_path"[, "base_model"]} (vLLM's)
//   POST /v1/unload_lora_adapter            {"lora_name"}
//
// Both POST routes answer in OpenAI's exact JSON shapes, or as Server-Sent Events with
// `"stream": true` (`data: {chunk}\n\n` ..., `data: [DONE]\n\n`; `stream_options.
// include_usage` adds the usage chunk). Parameters and their limits are in docs/api.md; the
// extensions vLLM users expect (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
// stop_token_ids, priority) are accepted. Errors use OpenAI's shape,
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
// with 400 (bad input, naming the field in `param`), 401 (no or wrong API key, code
// `invalid_api_key`), 403 (the key lacks the route's scope), 404 (unknown model, code
// `model_not_found`; unknown route, code `not_found`), 429 (queue full or
// server.max_inflight_requests reached), 503 (not ready, shutting down).
//
// A client that disconnects (mid-stream or while waiting) cancels its request: it leaves the
// batch within one step and its KV blocks return to the pool.
//
// Thread-safety: Handle may be called concurrently from the HTTP I/O threads; it never
// blocks on generation (responses are written from the batcher's thread).
#pragma once

#include <memory>

#include "nlohmann/json.hpp"
#include "server/core.h"
#include "server/http/http_server.h"

namespace kiln::llm {

class OpenAiApi {
 public:
  explicit OpenAiApi(ServerCore* core);

  // Answers `request` if its path is /v1 or below it (unknown /v1 routes get an OpenAI-shaped
  // 404) and returns true; returns false, touching nothing, for every other path.
  bool Handle(http::Request& request, const std::shared_ptr<http::Responder>& responder) const;

 private:
  // POST /v1/load_lora_adapter (load) and /v1/unload_lora_adapter, vLLM's shapes.
  void LoraAdapterRoute(const http::Request& req, const std::shared_ptr<http::Responder>& r,
                        bool load) const;

  ServerCore* core_;
  int64_t created_;  // start-up time, reported as each model's `created`
};

// {"error": {"message", "type", "param", "code"}} for a failed Status (param from ParamOf).
nlohmann::json OpenAiError(const Status& status);

}  // namespace kiln::llm
