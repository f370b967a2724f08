// ggml tensor types as stored in GGUF files, with their block layout.
//
// Numeric values are the on-disk ids from ggml.h and must never change. ToDType maps the types
// the engine stores natively to engine dtypes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "engine/dtype.h"

namespace kiln::models {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};

struct GgmlTypeTraits {
  std::string_view name;  // "Q4_K", as ggml and the gguf Python package spell it
  uint32_t block_size;    // elements per block (1 for plain types)
  uint32_t type_size;     // bytes per block
  bool supported;         // Kiln can load (and dequantize) tensors of this type
};

// Traits of a known type id, or nullopt for an id ggml never defined.
std::optional<GgmlTypeTraits> GetGgmlTypeTraits(uint32_t type_id);
inline std::optional<GgmlTypeTraits> GetGgmlTypeTraits(GgmlType t) {
  return GetGgmlTypeTraits(static_cast<uint32_t>(t));
}

// "Q4_K", or "type#77" for an unknown id.
std::string GgmlTypeName(uint32_t type_id);
inline std::string GgmlTypeName(GgmlType t) { return GgmlTypeName(static_cast<uint32_t>(t)); }

// Comma-separated names of the supported types, for error messages.
std::string_view SupportedGgmlTypeList();

// The engine dtype with the same byte layout (F32, F16, BF16, F64, I8..I64, Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K), or nullopt for types the engine does not store.
std::optional<DType> ToDType(GgmlType t);

}  // namespace kiln::models
