#include "models/gguf/dequant.h"

#include <cstring>

#include "models/io/errors.h"

namespace kiln::models {
namespace {

constexpr int kQK = 32;    // elements per block in the 32-element formats
constexpr int kQKK = 256;  // elements per K-quant super-block

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Q4_0: { f16 d; u8 qs[16]; }  x = (nibble - 8) * d
void DequantQ4_0(const uint8_t* b, size_t nb, float* y) {
  for (size_t i = 0; i < nb; ++i, b += 18, y += kQK) {
    const float d = HalfToFloat(LoadU16(b));
    const uint8_t* qs = b + 2;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
      y[j + kQK / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  }
}

// Q4_1: { f16 d; f16 m; u8 qs[16]; }  x = nibble * d + m
void DequantQ4_1(const uint8_t* b, size_t nb, float* y) {
  for (size_t i = 0; i < nb; ++i, b += 20, y += kQK) {
    const float d = HalfToFloat(LoadU16(b));
    const float m = HalfToFloat(LoadU16(b + 2));
    const uint8_t* qs = b + 4;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
      y[j + kQK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  }
}

// Q8_0: { f16 d; i8 qs[32]; }  x = q * d
void DequantQ8_0(const uint8_t* b, size_t nb, float* y) {
  for (size_t i = 0; i < nb; ++i, b += 34, y += kQK) {
    const float d = HalfToFloat(LoadU16(b));
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  }
}

// MXFP4: { e8m0 e; u8 qs[16]; }  x = kvalues[nibble] * 2^(e-128)  (kvalues hold 2x the E2M1
// values, hence the halved scale)
void DequantMxfp4(const uint8_t* b, size_t nb, float* y) {
  static constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  for (size_t i = 0; i < nb; ++i, b += 17, y += kQK) {
    const uint8_t e = b[0];
    uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
    float d;
    std::memcpy(&d, &bits, 4);
    const uint8_t* qs = b + 1;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(kValues[qs[j] & 0x0F]) * d;
      y[j + kQK / 2] = static_cast<float>(kValues[qs[j] >> 4]) * d;
    }
  }
}

// The 6-bit scale and min of sub-block j from the packed 12-byte K-quant scales.
void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

// Q4_K: { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }  x = d*sc*q - dmin*m per 32 values
void DequantQ4_K(const uint8_t* b, size_t nb, float* y) {
  for (size_t i = 0; i < nb; ++i, b += 144) {
    const float d = HalfToFloat(LoadU16(b));
    const float min = HalfToFloat(LoadU16(b + 2));
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    int is = 0;
    for (int j = 0; j < kQKK; j += 64) {
      uint8_t sc, m;
      ScaleMinK4(is + 0, scales, &sc, &m);
      const float d1 = d * sc;
      const float m1 = min * m;
      ScaleMinK4(is + 1, scales, &sc, &m);
      const float d2 = d * sc;
      const float m2 = min * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
      q += 32;
      is += 2;
    }
  }
}

// Q5_K: { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }
void DequantQ5_K(const uint8_t* b, size_t nb, float* y) {
  for (size_t i = 0; i < nb; ++i, b += 176) {
    const float d = HalfToFloat(LoadU16(b));
    const float min = HalfToFloat(LoadU16(b + 2));
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* ql = b + 48;
    int is = 0;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < kQKK; j += 64) {
      uint8_t sc, m;
      ScaleMinK4(is + 0, scales, &sc, &m);
      const float d1 = d * sc;
      const float m1 = min * m;
      ScaleMinK4(is + 1, scales, &sc, &m);
      const float d2 = d * sc;
      const float m2 = min * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
      ql += 32;
      is += 2;
      u1 <<= 2;
      u2 <<= 2;
    }
  }
}

// Q6_K: { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }  x = d*sc*(q6 - 32)
void DequantQ6_K(const uint8_t* b, size_t nb, float* y) {
  for (size_t i = 0; i < nb; ++i, b += 210) {
    const float d = HalfToFloat(LoadU16(b + 208));
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int n = 0; n < kQKK; n += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l + 0] = d * sc[is + 0] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      // Subnormal: normalize.
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      mant &= 0x3FF;
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
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
  const auto* b = static_cast<const uint8_t*>(src);
  const size_t nb = n_elements / traits->block_size;
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, n_elements * 4);
      return OkStatus();
    case GgmlType::kF16:
      for (size_t i = 0; i < n_elements; ++i) dst[i] = HalfToFloat(LoadU16(b + 2 * i));
      return OkStatus();
    case GgmlType::kBF16:
      for (size_t i = 0; i < n_elements; ++i) dst[i] = Bf16ToFloat(LoadU16(b + 2 * i));
      return OkStatus();
    case GgmlType::kQ4_0:
      DequantQ4_0(b, nb, dst);
      return OkStatus();
    case GgmlType::kQ4_1:
      DequantQ4_1(b, nb, dst);
      return OkStatus();
    case GgmlType::kQ8_0:
      DequantQ8_0(b, nb, dst);
      return OkStatus();
    case GgmlType::kMXFP4:
      DequantMxfp4(b, nb, dst);
      return OkStatus();
    case GgmlType::kQ4_K:
      DequantQ4_K(b, nb, dst);
      return OkStatus();
    case GgmlType::kQ5_K:
      DequantQ5_K(b, nb, dst);
      return OkStatus();
    case GgmlType::kQ6_K:
      DequantQ6_K(b, nb, dst);
      return OkStatus();
    default:
      return Unimplemented("Dequantize: no reference routine for ", traits->name,
                           " (available: F32, F16, BF16, Q4_0, Q4_1, Q8_0, MXFP4, Q4_K, Q5_K, "
                           "Q6_K)");
  }
}

StatusOr<std::vector<float>> Dequantize(GgmlType type, const void* src, size_t n_elements) {
  std::vector<float> out(n_elements);
  KILN_RETURN_IF_ERROR(Dequantize(type, src, n_elements, out.data()));
  return out;
}

}  // namespace kiln::models
