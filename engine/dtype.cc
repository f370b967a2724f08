#include "engine/dtype.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/ascii.h"

namespace kiln {
namespace {

struct DTypeInfo {
  DType type;
  const char* name;
  int64_t block_elems;
  int64_t block_bytes;
};

// Indexed by the enum value.
constexpr DTypeInfo kInfo[kNumDTypes] = {
    {DType::kInvalid, "invalid", 1, 0}, {DType::kF32, "f32", 1, 4},
    {DType::kF64, "f64", 1, 8},         {DType::kF16, "f16", 1, 2},
    {DType::kBF16, "bf16", 1, 2},       {DType::kF8E4M3, "f8e4m3", 1, 1},
    {DType::kF8E5M2, "f8e5m2", 1, 1},   {DType::kI8, "i8", 1, 1},
    {DType::kU8, "u8", 1, 1},           {DType::kI16, "i16", 1, 2},
    {DType::kI32, "i32", 1, 4},         {DType::kI64, "i64", 1, 8},
    {DType::kBool, "bool", 1, 1},       {DType::kQ4_0, "q4_0", 32, 18},
    {DType::kQ4_1, "q4_1", 32, 20},     {DType::kQ8_0, "q8_0", 32, 34},
    {DType::kMXFP4, "mxfp4", 32, 17},   {DType::kQ4_K, "q4_k", 256, 144},
    {DType::kQ5_K, "q5_k", 256, 176},   {DType::kQ6_K, "q6_k", 256, 210},
    {DType::kQ5_0, "q5_0", 32, 22},     {DType::kQ5_1, "q5_1", 32, 24},
};

const DTypeInfo& Info(DType t) {
  const int i = static_cast<int>(t);
  KILN_CHECK(i >= 0 && i < kNumDTypes, "dtype value out of range");
  return kInfo[i];
}

// ---- Generic small-float codec ----------------------------------------------------------------
// One routine for every narrow float format, working on the exact double value: the rounding
// (nearbyint, ties to even in the default rounding mode) is then obviously correct. The fast
// f16/bf16 paths below are checked against it in dtype_test.cc.
enum class Special { kIeee, kFiniteNan, kFinite };
struct MiniFormat {
  int exp_bits;
  int man_bits;
  int bias;
  Special special;
};
constexpr MiniFormat kF16Format{5, 10, 15, Special::kIeee};
constexpr MiniFormat kBF16Format{8, 7, 127, Special::kIeee};
constexpr MiniFormat kE4M3Format{4, 3, 7, Special::kFiniteNan};
constexpr MiniFormat kE5M2Format{5, 2, 15, Special::kIeee};
constexpr MiniFormat kE2M1Format{2, 1, 1, Special::kFinite};

double MaxFinite(const MiniFormat& f) {
  const int exp_all = (1 << f.exp_bits) - 1;
  const double man_max = (1 << f.man_bits) - 1;
  switch (f.special) {
    case Special::kIeee:
      return std::ldexp(1.0 + man_max / (1 << f.man_bits), exp_all - 1 - f.bias);
    case Special::kFiniteNan:  // all-ones exponent and mantissa is NaN
      return std::ldexp(1.0 + (man_max - 1) / (1 << f.man_bits), exp_all - f.bias);
    case Special::kFinite:
      return std::ldexp(1.0 + man_max / (1 << f.man_bits), exp_all - f.bias);
  }
  return 0;
}

uint32_t EncodeMini(double x, const MiniFormat& f) {
  const uint32_t sign = std::signbit(x) ? 1u << (f.exp_bits + f.man_bits) : 0;
  const uint32_t exp_all = (1u << f.exp_bits) - 1;
  const uint32_t all_ones = (1u << (f.exp_bits + f.man_bits)) - 1;
  if (std::isnan(x)) {
    switch (f.special) {
      case Special::kIeee:
        return sign | exp_all << f.man_bits | 1u << (f.man_bits - 1);
      case Special::kFiniteNan:
        return sign | all_ones;
      case Special::kFinite:
        return 0;
    }
  }
  const double max_finite = MaxFinite(f);
  auto overflow = [&]() -> uint32_t {
    switch (f.special) {
      case Special::kIeee:
        return sign | exp_all << f.man_bits;
      case Special::kFiniteNan:
        return sign | all_ones;
      case Special::kFinite:
        return sign | all_ones;  // saturate to the largest magnitude
    }
    return 0;
  };
  const double a = std::fabs(x);
  if (std::isinf(a)) return overflow();
  if (a == 0) return sign;
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
  const int emin = 1 - f.bias;
  const int q_exp = std::max(e - 1, emin) - f.man_bits;
  const double r = std::nearbyint(std::ldexp(a, -q_exp));  // exact scaling, then RNE
  const double rounded = std::ldexp(r, q_exp);
  if (rounded > max_finite) return overflow();
  if (rounded == 0) return sign;
  std::frexp(rounded, &e);
  const int e2 = e - 1;
  if (e2 < emin) {  // subnormal: exponent field 0
    return sign | static_cast<uint32_t>(std::ldexp(rounded, f.man_bits - emin));
  }
  const uint32_t man =
      static_cast<uint32_t>(std::ldexp(rounded, f.man_bits - e2)) - (1u << f.man_bits);
  return sign | static_cast<uint32_t>(e2 + f.bias) << f.man_bits | man;
}

double DecodeMini(uint32_t v, const MiniFormat& f) {
  const bool neg = (v >> (f.exp_bits + f.man_bits)) & 1;
  const uint32_t exp_all = (1u << f.exp_bits) - 1;
  const uint32_t exp = (v >> f.man_bits) & exp_all;
  const uint32_t man = v & ((1u << f.man_bits) - 1);
  double r;
  if (f.special == Special::kIeee && exp == exp_all) {
    r = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (f.special == Special::kFiniteNan && exp == exp_all && man == (1u << f.man_bits) - 1) {
    r = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    r = std::ldexp(static_cast<double>(man), 1 - f.bias - f.man_bits);
  } else {
    r = std::ldexp(1.0 + std::ldexp(static_cast<double>(man), -f.man_bits),
                   static_cast<int>(exp) - f.bias);
  }
  return neg ? -r : r;
}

uint32_t FloatBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
float BitsFloat(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// ---- Block layouts (GGML) ---------------------------------------------------------------------
constexpr int kQK = 32;
constexpr int kQKK = 256;

uint16_t ReadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
void WriteU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// ggml_e8m0_to_fp32_half: 2^(e - 128), the e2m1 table below being doubled.
float E8M0Half(uint8_t e) { return std::ldexp(1.0f, static_cast<int>(e) - 128); }
constexpr int8_t kMxfp4Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

void QuantizeQ4_0(const float* x, uint8_t* y) {
  float amax = 0, max = 0;
  for (int j = 0; j < kQK; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  WriteU16(y, FloatToF16(d));
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t lo = std::min<int>(15, static_cast<int8_t>(x[j] * id + 8.5f));
    const uint8_t hi = std::min<int>(15, static_cast<int8_t>(x[j + kQK / 2] * id + 8.5f));
    y[2 + j] = lo | hi << 4;
  }
}

void QuantizeQ4_1(const float* x, uint8_t* y) {
  float min = FLT_MAX, max = -FLT_MAX;
  for (int j = 0; j < kQK; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
  const float d = (max - min) / 15;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  WriteU16(y, FloatToF16(d));
  WriteU16(y + 2, FloatToF16(min));
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t lo = std::min<int>(15, static_cast<int8_t>((x[j] - min) * id + 0.5f));
    const uint8_t hi = std::min<int>(15, static_cast<int8_t>((x[j + kQK / 2] - min) * id + 0.5f));
    y[4 + j] = lo | hi << 4;
  }
}

void QuantizeQ8_0(const float* x, uint8_t* y) {
  float amax = 0;
  for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  WriteU16(y, FloatToF16(d));
  for (int j = 0; j < kQK; ++j)
    y[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id)));
}

int BestMxfp4Index(float x, float d) {
  int best = 0;
  float best_err = std::fabs(kMxfp4Doubled[0] * d - x);
  for (int i = 1; i < 16; ++i) {  // strict '<': ties keep the lower index, as ggml does
    const float err = std::fabs(kMxfp4Doubled[i] * d - x);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return best;
}

void QuantizeMxfp4(const float* x, uint8_t* y) {
  float amax = 0;
  for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
  int e = 0;
  if (amax > 0) e = std::clamp(static_cast<int>(std::floor(std::log2(amax))) - 2 + 127, 0, 254);
  const float d = E8M0Half(static_cast<uint8_t>(e));
  y[0] = static_cast<uint8_t>(e);
  for (int j = 0; j < kQK / 2; ++j) {
    y[1 + j] = BestMxfp4Index(x[j], d) | BestMxfp4Index(x[j + kQK / 2], d) << 4;
  }
}

void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Dequantizes one block of `t` into `y` (DTypeBlockElems(t) floats).
void DequantizeBlock(DType t, const uint8_t* x, float* y) {
  switch (t) {
    case DType::kQ4_0: {
      const float d = F16ToFloat(ReadU16(x));
      for (int j = 0; j < kQK / 2; ++j) {
        y[j] = ((x[2 + j] & 0x0F) - 8) * d;
        y[j + kQK / 2] = ((x[2 + j] >> 4) - 8) * d;
      }
      return;
    }
    case DType::kQ4_1: {
      const float d = F16ToFloat(ReadU16(x)), m = F16ToFloat(ReadU16(x + 2));
      for (int j = 0; j < kQK / 2; ++j) {
        y[j] = (x[4 + j] & 0x0F) * d + m;
        y[j + kQK / 2] = (x[4 + j] >> 4) * d + m;
      }
      return;
    }
    case DType::kQ8_0: {
      const float d = F16ToFloat(ReadU16(x));
      for (int j = 0; j < kQK; ++j) y[j] = static_cast<int8_t>(x[2 + j]) * d;
      return;
    }
    case DType::kMXFP4: {
      const float d = E8M0Half(x[0]);
      for (int j = 0; j < kQK / 2; ++j) {
        y[j] = kMxfp4Doubled[x[1 + j] & 0x0F] * d;
        y[j + kQK / 2] = kMxfp4Doubled[x[1 + j] >> 4] * d;
      }
      return;
    }
    case DType::kQ5_0:    // f16 d; u8 qh[4] (bit j: element j's 5th bit); u8 qs[16]
    case DType::kQ5_1: {  // f16 d, m; u8 qh[4]; u8 qs[16]
      const bool q5_1 = t == DType::kQ5_1;
      const float d = F16ToFloat(ReadU16(x)), m = q5_1 ? F16ToFloat(ReadU16(x + 2)) : 0.0f;
      const uint8_t* qh = x + (q5_1 ? 4 : 2);
      const uint8_t* qs = qh + 4;
      const uint32_t h =
          qh[0] | uint32_t{qh[1]} << 8 | uint32_t{qh[2]} << 16 | uint32_t{qh[3]} << 24;
      for (int j = 0; j < kQK / 2; ++j) {
        const int lo = (qs[j] & 0x0F) | ((h >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | ((h >> (j + kQK / 2)) & 1) << 4;
        if (q5_1) {
          y[j] = lo * d + m;
          y[j + kQK / 2] = hi * d + m;
        } else {
          y[j] = (lo - 16) * d;
          y[j + kQK / 2] = (hi - 16) * d;
        }
      }
      return;
    }
    case DType::kQ4_K: {  // f16 d, dmin; u8 scales[12]; u8 qs[128]
      const float d = F16ToFloat(ReadU16(x)), min = F16ToFloat(ReadU16(x + 2));
      const uint8_t* scales = x + 4;
      const uint8_t* q = x + 16;
      int is = 0;
      for (int j = 0; j < kQKK; j += 64) {
        uint8_t sc, m;
        ScaleMinK4(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        ScaleMinK4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
        for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
        q += 32;
        is += 2;
      }
      return;
    }
    case DType::kQ5_K: {  // f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
      const float d = F16ToFloat(ReadU16(x)), min = F16ToFloat(ReadU16(x + 2));
      const uint8_t* scales = x + 4;
      const uint8_t* qh = x + 16;
      const uint8_t* ql = x + 48;
      int is = 0;
      uint8_t u1 = 1, u2 = 2;
      for (int j = 0; j < kQKK; j += 64) {
        uint8_t sc, m;
        ScaleMinK4(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        ScaleMinK4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
        for (int l = 0; l < 32; ++l) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; ++l) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        ql += 32;
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
      }
      return;
    }
    case DType::kQ6_K: {  // u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d
      const float d = F16ToFloat(ReadU16(x + 208));
      const uint8_t* ql = x;
      const uint8_t* qh = x + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
      for (int n = 0; n < kQKK; n += 128) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int8_t q1 = static_cast<int8_t>((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
          const int8_t q2 =
              static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int8_t q3 = static_cast<int8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int8_t q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l] = d * sc[is] * q1;
          y[l + 32] = d * sc[is + 2] * q2;
          y[l + 64] = d * sc[is + 4] * q3;
          y[l + 96] = d * sc[is + 6] * q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
      }
      return;
    }
    default:
      KILN_CHECK(false, "DequantizeBlock: not a quantized dtype");
  }
}

template <typename T>
T SaturatingFromDouble(double v) {
  if (std::isnan(v)) return 0;
  const double t = std::trunc(v);
  // Compare in double: the limits of 64-bit types are not exact doubles, so use >= on the
  // first double above max (2^63 for i64).
  constexpr double kMaxPlusOne = static_cast<double>(std::numeric_limits<T>::max()) + 1.0;
  if (t >= kMaxPlusOne) return std::numeric_limits<T>::max();
  if (t <= static_cast<double>(std::numeric_limits<T>::min())) return std::numeric_limits<T>::min();
  return static_cast<T>(t);
}

template <typename T>
T Read(const void* base, int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(base) + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}
template <typename T>
void Write(void* base, int64_t i, T v) {
  std::memcpy(static_cast<char*>(base) + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

}  // namespace

const char* DTypeName(DType t) { return Info(t).name; }

StatusOr<DType> ParseDType(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(ToAbsl(name));
  for (const DTypeInfo& i : kInfo) {
    if (i.type != DType::kInvalid && n == i.name) return i.type;
  }
  struct Alias {
    const char* name;
    DType type;
  };
  static constexpr Alias kAliases[] = {
      {"float32", DType::kF32},
      {"float", DType::kF32},
      {"float64", DType::kF64},
      {"double", DType::kF64},
      {"float16", DType::kF16},
      {"half", DType::kF16},
      {"bfloat16", DType::kBF16},
      {"int8", DType::kI8},
      {"uint8", DType::kU8},
      {"int16", DType::kI16},
      {"int32", DType::kI32},
      {"int64", DType::kI64},
      {"float8_e4m3fn", DType::kF8E4M3},
      {"float8_e5m2", DType::kF8E5M2},
  };
  for (const Alias& a : kAliases) {
    if (n == a.name) return a.type;
  }
  return InvalidArgument("unknown dtype `", ToAbsl(name),
                         "`; allowed: f32, f64, f16, bf16, f8e4m3, f8e5m2, i8, u8, i16, i32, "
                         "i64, bool, q4_0, q4_1, q8_0, mxfp4, q4_k, q5_k, q6_k");
}

int64_t DTypeBlockElems(DType t) { return Info(t).block_elems; }
int64_t DTypeBlockBytes(DType t) { return Info(t).block_bytes; }

bool IsFloat(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF64:
    case DType::kF16:
    case DType::kBF16:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return true;
    default:
      return false;
  }
}
bool IsInteger(DType t) {
  switch (t) {
    case DType::kI8:
    case DType::kU8:
    case DType::kI16:
    case DType::kI32:
    case DType::kI64:
      return true;
    default:
      return false;
  }
}
bool IsQuantized(DType t) { return t >= DType::kQ4_0 && t <= DType::kQ5_1; }
bool IsSigned(DType t) {
  return IsFloat(t) || t == DType::kI8 || t == DType::kI16 || t == DType::kI32 || t == DType::kI64;
}

DType ComputeDType(DType t) {
  if (t == DType::kF64) return DType::kF64;
  if (IsFloat(t) || IsQuantized(t)) return DType::kF32;
  return DType::kI64;
}

int64_t DTypeBytes(DType t, int64_t num_elems) {
  const DTypeInfo& i = Info(t);
  KILN_CHECK(num_elems % i.block_elems == 0, "element count is not a multiple of the block size");
  return num_elems / i.block_elems * i.block_bytes;
}

// ---- Scalars ------------------------------------------------------------------------------------

uint16_t FloatToF16(float f) {
  uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffff;
  if (x > 0x7f800000) return sign | 0x7e00;   // NaN -> quiet NaN, sign kept
  if (x >= 0x477ff000) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (x < 0x38800000) {                       // below 2^-14: subnormal (or zero)
    // |f| * 2^24 is exact; rounding it to an integer gives the subnormal mantissa, and 1024
    // is the smallest normal (exponent 1, mantissa 0), which is the same bit pattern.
    return sign | static_cast<uint16_t>(std::nearbyint(BitsFloat(x) * 16777216.0f));
  }
  const uint32_t odd = (x >> 13) & 1;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff + odd;
  return sign | static_cast<uint16_t>(x >> 13);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000 | man << 13);
  if (exp == 0) {
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24
    return sign ? -v : v;
  }
  return BitsFloat(sign | (exp + 112) << 23 | man << 13);
}

uint16_t FloatToBF16(float f) {
  uint32_t x = FloatBits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

float BF16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

uint8_t FloatToF8E4M3(float x) { return static_cast<uint8_t>(EncodeMini(x, kE4M3Format)); }
float F8E4M3ToFloat(uint8_t v) { return static_cast<float>(DecodeMini(v, kE4M3Format)); }
uint8_t FloatToF8E5M2(float x) { return static_cast<uint8_t>(EncodeMini(x, kE5M2Format)); }
float F8E5M2ToFloat(uint8_t v) { return static_cast<float>(DecodeMini(v, kE5M2Format)); }
uint8_t FloatToE2M1(float x) { return static_cast<uint8_t>(EncodeMini(x, kE2M1Format)); }
float E2M1ToFloat(uint8_t code) { return static_cast<float>(DecodeMini(code & 0xF, kE2M1Format)); }
float E8M0ToFloat(uint8_t v) {
  if (v == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(v) - 127);
}

// ---- Rows ---------------------------------------------------------------------------------------

Status QuantizeRow(DType t, const float* src, void* dst, int64_t n) {
  if (!IsQuantized(t)) return InvalidArgument("QuantizeRow: ", DTypeName(t), " is not quantized");
  const int64_t be = DTypeBlockElems(t), bb = DTypeBlockBytes(t);
  if (n % be != 0) {
    return InvalidArgument("QuantizeRow: ", n, " elements is not a multiple of the ", DTypeName(t),
                           " block size ", be);
  }
  void (*fn)(const float*, uint8_t*) = nullptr;
  switch (t) {
    case DType::kQ4_0:
      fn = QuantizeQ4_0;
      break;
    case DType::kQ4_1:
      fn = QuantizeQ4_1;
      break;
    case DType::kQ8_0:
      fn = QuantizeQ8_0;
      break;
    case DType::kMXFP4:
      fn = QuantizeMxfp4;
      break;
    default:
      return Unimplemented("quantizing to ", DTypeName(t),
                           " is not supported (K-quants, Q5_0 and Q5_1 are dequantize-only)");
  }
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (int64_t b = 0; b < n / be; ++b) fn(src + b * be, out + b * bb);
  return OkStatus();
}

Status DequantizeRow(DType t, const void* src, float* dst, int64_t n) {
  if (!IsQuantized(t)) return InvalidArgument("DequantizeRow: ", DTypeName(t), " is not quantized");
  const int64_t be = DTypeBlockElems(t), bb = DTypeBlockBytes(t);
  if (n % be != 0) {
    return InvalidArgument("DequantizeRow: ", n, " elements is not a multiple of the ",
                           DTypeName(t), " block size ", be);
  }
  const uint8_t* in = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / be; ++b) DequantizeBlock(t, in + b * bb, dst + b * be);
  return OkStatus();
}

double LoadElement(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF32:
      return Read<float>(base, i);
    case DType::kF64:
      return Read<double>(base, i);
    case DType::kF16:
      return F16ToFloat(Read<uint16_t>(base, i));
    case DType::kBF16:
      return BF16ToFloat(Read<uint16_t>(base, i));
    case DType::kF8E4M3:
      return DecodeMini(Read<uint8_t>(base, i), kE4M3Format);
    case DType::kF8E5M2:
      return DecodeMini(Read<uint8_t>(base, i), kE5M2Format);
    case DType::kI8:
      return Read<int8_t>(base, i);
    case DType::kU8:
      return Read<uint8_t>(base, i);
    case DType::kI16:
      return Read<int16_t>(base, i);
    case DType::kI32:
      return Read<int32_t>(base, i);
    case DType::kI64:
      return static_cast<double>(Read<int64_t>(base, i));
    case DType::kBool:
      return Read<uint8_t>(base, i) != 0 ? 1.0 : 0.0;
    default: {
      KILN_CHECK(IsQuantized(t), "LoadElement: invalid dtype");
      const int64_t be = DTypeBlockElems(t);
      float block[kQKK];
      DequantizeBlock(t, static_cast<const uint8_t*>(base) + (i / be) * DTypeBlockBytes(t), block);
      return block[i % be];
    }
  }
}

int64_t LoadInt(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kI8:
      return Read<int8_t>(base, i);
    case DType::kU8:
      return Read<uint8_t>(base, i);
    case DType::kI16:
      return Read<int16_t>(base, i);
    case DType::kI32:
      return Read<int32_t>(base, i);
    case DType::kI64:
      return Read<int64_t>(base, i);
    case DType::kBool:
      return Read<uint8_t>(base, i) != 0;
    default:
      return SaturatingFromDouble<int64_t>(LoadElement(base, t, i));
  }
}

void StoreElement(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::kF32:
      return Write<float>(base, i, static_cast<float>(v));
    case DType::kF64:
      return Write<double>(base, i, v);
    case DType::kF16:
      return Write<uint16_t>(base, i, static_cast<uint16_t>(EncodeMini(v, kF16Format)));
    case DType::kBF16:
      return Write<uint16_t>(base, i, static_cast<uint16_t>(EncodeMini(v, kBF16Format)));
    case DType::kF8E4M3:
      return Write<uint8_t>(base, i, static_cast<uint8_t>(EncodeMini(v, kE4M3Format)));
    case DType::kF8E5M2:
      return Write<uint8_t>(base, i, static_cast<uint8_t>(EncodeMini(v, kE5M2Format)));
    case DType::kI8:
      return Write<int8_t>(base, i, SaturatingFromDouble<int8_t>(v));
    case DType::kU8:
      return Write<uint8_t>(base, i, SaturatingFromDouble<uint8_t>(v));
    case DType::kI16:
      return Write<int16_t>(base, i, SaturatingFromDouble<int16_t>(v));
    case DType::kI32:
      return Write<int32_t>(base, i, SaturatingFromDouble<int32_t>(v));
    case DType::kI64:
      return Write<int64_t>(base, i, SaturatingFromDouble<int64_t>(v));
    case DType::kBool:
      return Write<uint8_t>(base, i, v != 0 ? 1 : 0);
    default:
      KILN_CHECK(false, "StoreElement: quantized or invalid dtype is not element-writable");
  }
}

void StoreInt(void* base, DType t, int64_t i, int64_t v) {
  // Integer to integer wraps (two's complement), as C and PyTorch casts do.
  switch (t) {
    case DType::kI8:
      return Write<int8_t>(base, i, static_cast<int8_t>(v));
    case DType::kU8:
      return Write<uint8_t>(base, i, static_cast<uint8_t>(v));
    case DType::kI16:
      return Write<int16_t>(base, i, static_cast<int16_t>(v));
    case DType::kI32:
      return Write<int32_t>(base, i, static_cast<int32_t>(v));
    case DType::kI64:
      return Write<int64_t>(base, i, v);
    case DType::kBool:
      return Write<uint8_t>(base, i, v != 0 ? 1 : 0);
    default:
      return StoreElement(base, t, i, static_cast<double>(v));
  }
}

Status ConvertElements(DType src_type, const void* src, DType dst_type, void* dst, int64_t n) {
  if (src_type == DType::kInvalid || dst_type == DType::kInvalid) {
    return InvalidArgument("ConvertElements: invalid dtype");
  }
  if (src_type == dst_type) {
    std::memcpy(dst, src, DTypeBytes(src_type, n));
    return OkStatus();
  }
  const bool integral = (IsInteger(src_type) || src_type == DType::kBool) &&
                        (IsInteger(dst_type) || dst_type == DType::kBool);
  if (!IsQuantized(src_type) && !IsQuantized(dst_type)) {
    for (int64_t i = 0; i < n; ++i) {
      if (integral) {
        StoreInt(dst, dst_type, i, LoadInt(src, src_type, i));
      } else {
        StoreElement(dst, dst_type, i, LoadElement(src, src_type, i));
      }
    }
    return OkStatus();
  }
  // Through f32 in chunks that are whole blocks of either side (256 covers every block size).
  constexpr int64_t kChunk = 4096;
  std::vector<float> tmp(kChunk);
  for (int64_t done = 0; done < n; done += kChunk) {
    const int64_t m = std::min(kChunk, n - done);
    if (IsQuantized(src_type)) {
      const int64_t be = DTypeBlockElems(src_type);
      if (m % be != 0)
        return InvalidArgument("ConvertElements: partial ", DTypeName(src_type), " block");
      KILN_RETURN_IF_ERROR(DequantizeRow(
          src_type, static_cast<const char*>(src) + DTypeBytes(src_type, done), tmp.data(), m));
    } else {
      for (int64_t i = 0; i < m; ++i)
        tmp[i] = static_cast<float>(LoadElement(src, src_type, done + i));
    }
    if (IsQuantized(dst_type)) {
      const int64_t be = DTypeBlockElems(dst_type);
      if (m % be != 0)
        return InvalidArgument("ConvertElements: partial ", DTypeName(dst_type), " block");
      KILN_RETURN_IF_ERROR(QuantizeRow(dst_type, tmp.data(),
                                       static_cast<char*>(dst) + DTypeBytes(dst_type, done), m));
    } else {
      for (int64_t i = 0; i < m; ++i) StoreElement(dst, dst_type, done + i, tmp[i]);
    }
  }
  return OkStatus();
}

namespace internal {
// Exposed for dtype_test.cc: the generic codec the fast paths are checked against.
uint32_t EncodeF16Generic(double x) { return EncodeMini(x, kF16Format); }
uint32_t EncodeBF16Generic(double x) { return EncodeMini(x, kBF16Format); }
double DecodeF16Generic(uint32_t v) { return DecodeMini(v, kF16Format); }
}  // namespace internal

}  // namespace kiln
