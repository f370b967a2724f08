#include "models/gguf/dequant.h"

#include <cstring>

#include "models/io/errors.h"

namespace kiln::models {

float HalfToFloat(uint16_t h) { return F16ToFloat(h); }
float Bf16ToFloat(uint16_t h) { return BF16ToFloat(h); }

std::optional<DType> ToDType(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
      return DType::kF32;
    case GgmlType::kF16:
      return DType::kF16;
    case GgmlType::kBF16:
      return DType::kBF16;
    case GgmlType::kF64:
      return DType::kF64;
    case GgmlType::kI8:
      return DType::kI8;
    case GgmlType::kI16:
      return DType::kI16;
    case GgmlType::kI32:
      return DType::kI32;
    case GgmlType::kI64:
      return DType::kI64;
    case GgmlType::kQ4_0:
      return DType::kQ4_0;
    case GgmlType::kQ4_1:
      return DType::kQ4_1;
    case GgmlType::kQ8_0:
      return DType::kQ8_0;
    case GgmlType::kMXFP4:
      return DType::kMXFP4;
    case GgmlType::kQ4_K:
      return DType::kQ4_K;
    case GgmlType::kQ5_K:
      return DType::kQ5_K;
    case GgmlType::kQ6_K:
      return DType::kQ6_K;
    case GgmlType::kQ5_0:
      return DType::kQ5_0;
    case GgmlType::kQ5_1:
      return DType::kQ5_1;
    default:
      return std::nullopt;
  }
}

Status Dequantize(GgmlType type, const void* src, size_t n_elements, float* dst) {
  auto traits = GetGgmlTypeTraits(type);
  if (!traits)
    return InvalidArgument("Dequantize: unknown ggml type ", static_cast<uint32_t>(type));
  if (n_elements % traits->block_size != 0) {
    return InvalidArgument("Dequantize: ", n_elements, " elements of ", traits->name,
                           " is not a multiple of the block size ", traits->block_size);
  }
  if (n_elements == 0) return OkStatus();  // dst/src may be null (memcpy must not see that)
  const auto dtype = ToDType(type);
  const auto* b = static_cast<const uint8_t*>(src);
  const auto n = static_cast<int64_t>(n_elements);
  if (dtype && IsQuantized(*dtype)) return DequantizeRow(*dtype, src, dst, n);
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, n_elements * 4);
      return OkStatus();
    case GgmlType::kF16:
    case GgmlType::kBF16:
      for (size_t i = 0; i < n_elements; ++i) {
        uint16_t h;
        std::memcpy(&h, b + 2 * i, 2);
        dst[i] = type == GgmlType::kF16 ? F16ToFloat(h) : BF16ToFloat(h);
      }
      return OkStatus();
    default:
      return Unimplemented("Dequantize: no reference routine for ", traits->name,
                           " (available: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, "
                           "Q4_K, Q5_K, Q6_K)");
  }
}

StatusOr<std::vector<float>> Dequantize(GgmlType type, const void* src, size_t n_elements) {
  std::vector<float> out(n_elements);
  KILN_RETURN_IF_ERROR(Dequantize(type, src, n_elements, out.data()));
  return out;
}

}  // namespace kiln::models
