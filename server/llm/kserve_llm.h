// LLMs on the KServe paths, as Triton's LLM backends (vLLM's in particular) serve them:
//
//   inputs   BYTES text_input [1]            the prompt (plain text; see prompt.h)
//            BOOL  stream [1]                optional: one response per new piece of text
//            BYTES sampling_parameters [1]   optional JSON: temperature, top_p, top_k, min_p,
//                                            max_tokens, stop, seed, presence_penalty,
//                                            frequency_penalty, repetition_penalty, ignore_eos,
//                                            min_tokens, stop_token_ids (values may be strings)
//            BOOL  exclude_input_in_output [1]  optional: false puts the prompt before the
//                                            output; default: false unless streaming
//   output   BYTES text_output [1]
//
// Without a sampling_parameters input, request-level parameters carry the same keys. The
// request parameters `priority` and `timeout` (µs; for an LLM the whole request) apply.
// Streaming needs ModelStreamInfer (Triton's decoupled models): each response carries
// `triton_final_response` (true on the last), and with the request parameter
// `triton_enable_empty_final_response` the last response is an empty one. ModelInfer (and
// REST /infer) answer once with the whole text. Triton's generate extension is served too:
//   POST /v2/models/{m}/generate          {"text_input": ..., "parameters": {...}}
//   POST /v2/models/{m}/generate_stream   the same, answered as Server-Sent Events
//
// Thread-safety: the functions may be called from any thread; sinks are called from the
// model's batcher thread.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "nlohmann/json.hpp"
#include "proto/kserve/grpc_service.pb.h"
#include "server/core.h"
#include "server/http/http_server.h"

namespace kiln::llm {

// One request in Triton's LLM convention, whichever wire it came on.
struct TextRequest {
  std::string model_name;  // as requested: the model, or a LoRA adapter of it
  std::string id;
  std::string text_input;
  std::optional<bool> stream;
  std::optional<bool> exclude_input_in_output;
  nlohmann::json sampling = nlohmann::json::object();  // sampling keys (lenient values)
  std::string sampling_field = "sampling_parameters";  // named in errors
  uint64_t priority = 0;
  std::optional<uint64_t> timeout_us;
  std::shared_ptr<CancelFlag> cancel = std::make_shared<CancelFlag>();
  SteadyClock::time_point received_at = SteadyClock::now();
  std::shared_ptr<RequestTrace> trace;  // null: not traced (the batcher adds its spans)
};

// Receives the responses of one TextRequest: `text` is new text when streaming (the prompt
// first, if asked for), else the whole output; `final` marks the last call. A failed request
// gets one final call with its status (and empty text).
using TextSink = std::function<void(std::string text, bool final, const Status& status)>;

// Validates `request` (InvalidArgument naming the input or key), queues it on `model` and
// holds `ticket` until the final response. `may_stream`: whether the caller's wire can carry
// several responses (else `stream` = true is refused). On error the sink is never called.
Status SubmitText(const std::shared_ptr<Model>& model, TextRequest request,
                  InflightLimiter::Ticket ticket, bool may_stream, TextSink sink);

// Reads a KServe request to an LLM (already decoded from gRPC or JSON) into a TextRequest:
// checks the inputs against LlmSignature, takes text_input, stream, exclude_input_in_output
// and sampling_parameters; `parameters` (the request-level parameters, as JSON) supply the
// sampling keys when there is no sampling_parameters input.
StatusOr<TextRequest> ReadKServeRequest(const Model& model, InferenceRequest& request,
                                        const nlohmann::json& parameters);

// The request-level parameters of a gRPC request as a JSON object, without Triton's own keys
// (priority, timeout, triton_*, sequence_*, binary_data_output).
nlohmann::json ParametersJson(const inference::ModelInferRequest& wire);
bool EmptyFinalResponseRequested(const inference::ModelInferRequest& wire);

// A KServe response holding `text` as BYTES text_output [1] (no outputs when `empty`).
InferenceResponse TextResponse(const std::string& text, bool empty = false);

// Sets `triton_final_response` on a gRPC response.
void MarkFinal(inference::ModelInferResponse* wire, bool final);

// Triton's generate extension on an LLM: `stream_route` for generate_stream. Answers `r`.
// `name` is what the route named: the model, or a LoRA adapter of it.
void HandleGenerate(const ServerCore& core, const std::shared_ptr<Model>& model,
                    const std::string& name, const http::Request& request,
                    const std::shared_ptr<http::Responder>& r, bool stream_route);

// REST /v2/models/{m}/infer on an LLM: answers `r` with the KServe JSON response (text_output
// as binary data when the request asked for it).
void HandleJsonInfer(const std::shared_ptr<Model>& model, std::unique_ptr<InferenceRequest> request,
                     InflightLimiter::Ticket ticket, const std::shared_ptr<http::Responder>& r,
                     std::vector<std::string> binary_outputs, bool all_binary);

}  // namespace kiln::llm
