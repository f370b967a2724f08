// Dequantization of ggml tensors to f32, for loading and testing (not for hot loops: the
// engine runs Q4_0/Q4_1/Q8_0/MXFP4 natively).
//
// The block formats are the engine's (engine/dtype.h, one implementation); these functions
// map ggml type ids onto them. Bit-exact with ggml's dequantize_row_* and the gguf Python
// package's gguf.quants.dequantize (checked against fixtures in gguf_fixture_test).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/base/status.h"
#include "models/gguf/ggml_type.h"

namespace kiln::models {

// Converts one IEEE half / bfloat16 to float.
float HalfToFloat(uint16_t h);
float Bf16ToFloat(uint16_t h);

// Dequantizes `n_elements` values of `type` from `src` into `dst`.
// REQUIRES: n_elements is a multiple of the type's block size; `src` holds
// n_elements / block_size * type_size bytes; `dst` holds n_elements floats.
// Errors: Unimplemented for types without a reference routine (I8..I64, F64 and the
// unsupported quantizations), InvalidArgument for a bad element count.
Status Dequantize(GgmlType type, const void* src, size_t n_elements, float* dst);

// Convenience: a new vector.
StatusOr<std::vector<float>> Dequantize(GgmlType type, const void* src, size_t n_elements);

}  // namespace kiln::models
