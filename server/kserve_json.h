// KServe v2 REST inference bodies: JSON, and Triton's binary tensor data extension (a JSON
// header of `Inference-Header-Content-Length` bytes followed by raw tensor bytes).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scheduler/inference_request.h"

namespace kiln {

struct JsonInferRequest {
  std::unique_ptr<InferenceRequest> request;
  // Outputs to return as binary data; `all_binary` when the request-level parameter
  // binary_data_output is true.
  std::vector<std::string> binary_outputs;
  bool all_binary = false;
};

// Parses an infer request body. `header_length` is the Inference-Header-Content-Length value
// (nullopt: the body is all JSON). `model_name`/`version` come from the URL. Errors are
// InvalidArgument naming what is wrong: malformed JSON (with its byte offset), a header
// length past the body, missing or mistyped fields, `data` whose element count or value types
// do not match shape and datatype, FP16/BF16 sent as JSON, binary_data_size entries that
// overrun the body or leave bytes unused.
StatusOr<JsonInferRequest> DecodeJsonInferRequest(std::string body,
                                                  std::optional<size_t> header_length,
                                                  std::string model_name, std::string version);

struct JsonInferResponse {
  std::string body;
  std::optional<size_t> header_length;  // set when binary data follows the JSON
};

// Encodes a successful response; outputs named in `binary_outputs` (or all, if `all_binary`)
// are sent as binary data, the rest as JSON `data` (FP16/BF16 as numbers, BYTES as strings
// with invalid UTF-8 replaced).
JsonInferResponse EncodeJsonInferResponse(const std::string& model_name, const std::string& id,
                                          InferenceResponse&& response,
                                          const std::vector<std::string>& binary_outputs,
                                          bool all_binary);

}  // namespace kiln
