// KServe v2 wire formats <-> the scheduler's request types. Shared by the gRPC front end
// (protobuf) and the HTTP one (JSON + binary tensor data), so both enforce the same rules and
// say the same things about bad input.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <variant>

#include "proto/kserve/grpc_service.pb.h"
#include "scheduler/inference_request.h"
#include "scheduler/model.h"

namespace kiln {

// The largest queue timeout a request may ask for (one hour).
inline constexpr uint64_t kMaxRequestTimeoutUs = 3'600'000'000ull;

// A request parameter's value, as either wire format carries it.
using ParamValue = std::variant<bool, int64_t, uint64_t, double, std::string>;

// Applies one request-level parameter: `priority` (a non-negative integer), `timeout`
// (microseconds, 0 to kMaxRequestTimeoutUs), and sequence batching's `sequence_id` (a
// non-negative integer or a string), `sequence_start`, `sequence_end` (booleans). Other keys
// are ignored, as Triton passes unknown parameters through to backends that may not read them.
Status ApplyRequestParameter(std::string_view key, const ParamValue& value,
                             InferenceRequest& request);

// Builds a request from a gRPC ModelInferRequest. Raw contents are moved out of `wire`
// (it is left partly emptied). Errors are InvalidArgument naming the input and the rule:
// unknown datatype, negative dims, raw and typed contents together, a raw entry count that
// differs from the input count, typed contents in the wrong field for the datatype or with
// the wrong element count, FP16/BF16 sent as typed contents, values out of range for INT8,
// INT16, UINT8, UINT16, unsupported parameters (shared memory, classification).
StatusOr<std::unique_ptr<InferenceRequest>> DecodeInferRequest(inference::ModelInferRequest& wire);

// Fills a gRPC response (outputs as raw_output_contents) from a successful response.
void EncodeInferResponse(const std::string& model_name, const std::string& id,
                         InferenceResponse&& response, inference::ModelInferResponse* wire);

// Shape as reported in metadata: -1 for the batch dimension when the model batches.
std::vector<int64_t> MetadataShape(const ModelSignature& signature, const TensorSpec& spec);

// Parses RepositoryModelLoad's `config` parameter (JSON) for model `name`. For a model the
// repository has (`current`, its configuration), the keys given change that entry and the rest
// is kept (config::MergeModelConfig: `{"max_batch_size": 16}` changes only that); for a new
// model (`current` null) it is a whole entry of `models:`. It may omit `name`; if it gives
// one, it must be `name`.
StatusOr<config::ModelConfig> ParseLoadConfig(const std::string& name, const std::string& text,
                                              const config::ModelConfig* current);

void FillModelMetadata(const Model& model, inference::ModelMetadataResponse* wire);
void FillModelConfig(const Model& model, inference::ModelConfig* wire);
void FillModelStatistics(const Model& model, inference::ModelStatistics* wire);

}  // namespace kiln
