// KServe v2 REST inference bodies: JSON, and Triton's binary tensor data extension (a JSON
// header of `Inference-Header-Content-Length` bytes followed by raw tensor bytes).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scheduler/inference_request.h"
#include "server/kserve_codec.h"

namespace kiln {

struct JsonInferRequest {
  std::unique_ptr<InferenceRequest> request;
  // Outputs to return as binary data; `all_binary` when the request-level parameter
  // binary_data_output is true.
  std::vector<std::string> binary_outputs;
  bool all_binary = false;
  // Outputs to write into shared memory (parameters shared_memory_region etc.).
  ShmOutputs shm_outputs;
};

// Parses an infer request body. `header_length` is the Inference-Header-Content-Length value
// (nullopt: the body is all JSON). `model_name`/`version` come from the URL. Errors are
// InvalidArgument naming what is wrong: malformed JSON (with its byte offset), a header
// length past the body, missing or mistyped fields, `data` whose element count or value types
// do not match shape and datatype, FP16/BF16 sent as JSON, binary_data_size entries that
// overrun the body or leave bytes unused, shared-memory parameters that ResolveShm refuses
// (server/kserve_codec.h) or given together with `data` / binary_data_size. Inputs in shared
// memory are read from their regions of `shm` (null: none registered); outputs requested in
// shared memory are listed in shm_outputs, checked not to overlap.
StatusOr<JsonInferRequest> DecodeJsonInferRequest(std::string body,
                                                  std::optional<size_t> header_length,
                                                  std::string model_name, std::string version,
                                                  const SharedMemoryManager* shm = nullptr);

struct JsonInferResponse {
  std::string body;
  std::optional<size_t> header_length;  // set when binary data follows the JSON
};

// Encodes a successful response; outputs named in `binary_outputs` (or all, if `all_binary`)
// are sent as binary data, the rest as JSON `data` (FP16/BF16 as numbers, BYTES as strings
// with invalid UTF-8 replaced). Outputs with an entry in `shm_outputs` (already written by
// WriteShmOutputs) carry parameters shared_memory_region, shared_memory_byte_size and
// shared_memory_offset instead of data, whether or not binary output was asked for.
JsonInferResponse EncodeJsonInferResponse(const std::string& model_name, const std::string& id,
                                          InferenceResponse&& response,
                                          const std::vector<std::string>& binary_outputs,
                                          bool all_binary, const ShmOutputs* shm_outputs = nullptr);

}  // namespace kiln
