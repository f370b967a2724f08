// KServe v2 wire formats <-> the scheduler's request types. Shared by the gRPC front end
// (protobuf) and the HTTP one (JSON + binary tensor data), so both enforce the same rules and
// say the same things about bad input.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "proto/kserve/grpc_service.pb.h"
#include "scheduler/inference_request.h"
#include "scheduler/model.h"
#include "server/shared_memory.h"

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

// ---- Triton's system shared memory extension (server/shared_memory.h), both wire formats ----

// The shared-memory parameters of one tensor as sent: `shared_memory_region` (string),
// `shared_memory_byte_size` and `shared_memory_offset` (non-negative integers; the offset
// defaults to 0).
struct ShmParams {
  std::optional<std::string> region;
  std::optional<uint64_t> byte_size;
  std::optional<uint64_t> offset;
  bool any() const { return region || byte_size || offset; }
};

// If `key` is one of the shared-memory parameters, records it in `p` and returns true;
// InvalidArgument naming `what` ("input 'INPUT0'") for a value of the wrong type.
StatusOr<bool> TakeShmParam(std::string_view what, std::string_view key, const ParamValue& value,
                            ShmParams& p);

// The block `p` names, or nullopt if `p` has no parameter. InvalidArgument naming `what` when
// the region or the byte size is missing, the region is unknown (`shm` null: none is) or the
// range is outside it.
StatusOr<std::optional<SharedMemoryBlock>> ResolveShm(const SharedMemoryManager* shm,
                                                      std::string_view what, const ShmParams& p);

// Copies an input's bytes out of `block` into t.data (one copy: HostTensor owns its bytes).
// For fixed-size datatypes the block must hold exactly the shape's bytes. `budget`: the bytes
// the request may still read from shared memory (start at SharedMemoryManager::
// max_input_bytes()); InvalidArgument when the block is larger, else it is reduced.
Status ReadShmInput(const SharedMemoryBlock& block, HostTensor& t, uint64_t* budget);

// The outputs a request asked for in shared memory, in the order requested.
struct ShmOutput {
  std::string name;
  SharedMemoryBlock block;
};
using ShmOutputs = std::vector<ShmOutput>;

// InvalidArgument if two of `outputs` overlap (server/shared_memory.h: CheckDisjoint).
Status CheckShmOutputsDisjoint(const ShmOutputs& outputs);

// The entry of `targets` for output `name`; nullptr if none (or `targets` is null).
const ShmOutput* FindShmOutput(const ShmOutputs* targets, std::string_view name);

// Writes every response output that has an entry in `targets` into its block.
// InvalidArgument naming the output and the region when an output does not fit; then nothing
// is written (every size is checked before the first write).
Status WriteShmOutputs(const ShmOutputs& targets, const std::vector<HostTensor>& outputs);

// InvalidArgument if `outputs` is not empty: LLMs (model `model`) answer with text built by
// the LLM front end, which does not write shared memory.
Status RefuseShmOutputs(const ShmOutputs& outputs, const std::string& model);

// Builds a request from a gRPC ModelInferRequest. Raw contents are moved out of `wire`
// (it is left partly emptied). Errors are InvalidArgument naming the input and the rule:
// unknown datatype, negative dims, raw and typed contents together, a raw entry count that
// differs from the input count, typed contents in the wrong field for the datatype or with
// the wrong element count, FP16/BF16 sent as typed contents, values out of range for INT8,
// INT16, UINT8, UINT16, unsupported parameters (classification), shared-memory parameters
// that ResolveShm refuses. Inputs in shared memory are read from their regions of `shm` (and
// have no raw_input_contents entry, as tritonclient sends them); outputs requested in shared
// memory are appended to `shm_outputs` (required when `shm` is given), checked not to overlap.
StatusOr<std::unique_ptr<InferenceRequest>> DecodeInferRequest(
    inference::ModelInferRequest& wire, const SharedMemoryManager* shm = nullptr,
    ShmOutputs* shm_outputs = nullptr);

// Fills a gRPC response (outputs as raw_output_contents) from a successful response. An
// output with an entry in `shm_outputs` (already written by WriteShmOutputs) carries the
// parameters shared_memory_region, shared_memory_byte_size (its size) and
// shared_memory_offset instead, and an empty raw_output_contents entry, so the entries stay
// one per output.
void EncodeInferResponse(const std::string& model_name, const std::string& id,
                         InferenceResponse&& response, inference::ModelInferResponse* wire,
                         const ShmOutputs* shm_outputs = nullptr);

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
