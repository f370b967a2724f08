// Triton's QA and example models as Kiln built-ins, under the names, shapes, datatypes and
// semantics of Triton's docs/examples/model_repository and qa/ models, so that Triton's client
// examples (triton-inference-server/client src/python/examples) run against kilnd unchanged:
//
//   simple_string          BYTES INPUT0[16], INPUT1[16], each element a decimal 32-bit integer
//                          -> BYTES OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 as
//                          decimal strings (wrapping, as TF's int32 ops)
//   simple_int8            INT8 INPUT0[16], INPUT1[16] -> OUTPUT0 = sum, OUTPUT1 = difference
//                          (wrapping)
//   simple_identity        BYTES INPUT0[-1] -> OUTPUT0 = INPUT0
//   custom_identity_int32  INT32 INPUT0[-1] -> OUTPUT0 = INPUT0
//   repeat_int32           decoupled: INT32 IN[-1], UINT32 DELAY[-1] (as many as IN), UINT32
//                          WAIT[1] -> for each i, after DELAY[i] ms, one response with INT32
//                          OUT[1] = IN[i], UINT32 IDX[1] = i; then WAIT ms before the request
//                          ends. Each delay is at most kMaxRepeatDelayMs.
//
// Batching is the configuration's choice (Triton's configs use max_batch_size 8 for
// simple_string, simple_int8 and simple_identity, 1024 for custom_identity_int32, 0 for
// repeat_int32; config/examples/triton_qa.yaml serves them that way).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "engine/base/status.h"
#include "models/tensor/tensor_model.h"

namespace kiln {

// The longest DELAY or WAIT element repeat_int32 accepts, in milliseconds.
inline constexpr uint32_t kMaxRepeatDelayMs = 10'000;

// The names above, in a stable order.
std::span<const std::string_view> TritonQaModelNames();

// Creates one of the models above; NotFound for other names.
StatusOr<std::unique_ptr<TensorModel>> CreateTritonQaModel(std::string_view name);

}  // namespace kiln
