// Element types of engine tensors, their storage layout, and bit-exact conversions.
//
// Scalar types (f32, f64, f16, bf16, fp8 e4m3/e5m2, integers, bool) store one element per
// `DTypeBlockBytes` bytes. Block-quantized weight types store `DTypeBlockElems` elements in
// `DTypeBlockBytes` bytes, in GGML's exact byte layouts (so GGUF tensors are used in place):
//
//   q4_0   32 elems, 18 bytes: f16 d; u8 qs[16]   x[j] = ((qs[j] & 15) - 8) * d,
//                                                 x[j+16] = ((qs[j] >> 4) - 8) * d
//   q4_1   32 elems, 20 bytes: f16 d, m; u8 qs[16] x = q * d + m (same nibble order)
//   q8_0   32 elems, 34 bytes: f16 d; i8 qs[32]   x[j] = qs[j] * d
//   mxfp4  32 elems, 17 bytes: e8m0 e; u8 qs[16] x = e2m1(nibble) * 2^(e-127) (OCP MX;
//                                                 ggml's nibble order, as q4_0)
//   q4_k, q5_k, q6_k  256-element super-blocks of GGUF's K-quants (dequantize only: they
//                     are converted on load; QuantizeRow returns Unimplemented).
//
// Conversions round to nearest, ties to even, unless stated. Float -> fp8 follows PyTorch:
// e4m3 (the "fn" variant: no infinities, 0x7f/0xff are NaN, max 448) turns values that round
// past 448 and +-Inf into NaN; e5m2 is IEEE-like (overflow -> +-Inf). Float -> e2m1 (fp4)
// saturates to +-6 and maps NaN to +0. Float -> integer truncates toward zero, saturates at
// the type's range and maps NaN to 0. Anything -> bool is `x != 0`.
//
// Thread-safety: every function here is pure and thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/base/status.h"

namespace kiln {

enum class DType : uint8_t {
  kInvalid = 0,
  kF32,
  kF64,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI8,
  kU8,
  kI16,
  kI32,
  kI64,
  kBool,
  kQ4_0,
  kQ4_1,
  kQ8_0,
  kMXFP4,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  kQ5_0,  // dequantize-only, like the K-quants (models load them as Q8_0)
  kQ5_1,
};
inline constexpr int kNumDTypes = static_cast<int>(DType::kQ5_1) + 1;

// "f32", "bf16", "q4_0", ... ("invalid" for kInvalid). A C string so it drops into StrCat/fmt.
const char* DTypeName(DType t);
// Inverse of DTypeName (also accepts "float32", "float16", "bfloat16", "int32", ...).
StatusOr<DType> ParseDType(std::string_view name);

// Elements per storage block (1 for scalar types, 32 or 256 for quantized types).
int64_t DTypeBlockElems(DType t);
// Bytes per storage block (the element size for scalar types).
int64_t DTypeBlockBytes(DType t);

bool IsFloat(DType t);      // f32, f64, f16, bf16, fp8 (not the quantized block types)
bool IsInteger(DType t);    // i8, u8, i16, i32, i64 (not bool)
bool IsQuantized(DType t);  // block types: q4_0 ... q6_k
bool IsSigned(DType t);     // floats and signed integers

// The type reference kernels compute in: f64 for f64, f32 for every other float and quantized
// type, i64 for integers and bool.
DType ComputeDType(DType t);

// Bytes needed for `num_elems` elements. REQUIRES: num_elems % DTypeBlockElems(t) == 0
// (checked: a partial block is a programmer error; validate user shapes before calling).
int64_t DTypeBytes(DType t, int64_t num_elems);

// ---- Scalar conversions (bit-exact) ---------------------------------------------------------
uint16_t FloatToF16(float x);
float F16ToFloat(uint16_t h);
uint16_t FloatToBF16(float x);
float BF16ToFloat(uint16_t h);
uint8_t FloatToF8E4M3(float x);
float F8E4M3ToFloat(uint8_t v);
uint8_t FloatToF8E5M2(float x);
float F8E5M2ToFloat(uint8_t v);
// fp4 e2m1 codes are the low 4 bits: sign << 3 | exponent << 1 | mantissa.
uint8_t FloatToE2M1(float x);
float E2M1ToFloat(uint8_t code);
// e8m0 scale: 2^(v - 127); 0xff is NaN.
float E8M0ToFloat(uint8_t v);

// ---- Rows of elements -------------------------------------------------------------------------
// Quantizes `n` floats into blocks of `t` (q4_0, q4_1, q8_0, mxfp4), reproducing ggml's
// reference quantizers bit for bit. REQUIRES: n % DTypeBlockElems(t) == 0.
Status QuantizeRow(DType t, const float* src, void* dst, int64_t n);
// Dequantizes `n` elements of any quantized type. REQUIRES: n % DTypeBlockElems(t) == 0.
Status DequantizeRow(DType t, const void* src, float* dst, int64_t n);

// Converts `n` contiguous elements between any two dtypes (quantized ones through f32).
// REQUIRES: for quantized src/dst, n is a multiple of the block size.
Status ConvertElements(DType src_type, const void* src, DType dst_type, void* dst, int64_t n);

// Element access for reference kernels. `base` points at the start of a row whose element 0
// begins a block; `i` is an element index. Quantized types are readable (dequantized in
// place), not writable. Integers load exactly into double up to 2^53; use LoadInt for i64.
double LoadElement(const void* base, DType t, int64_t i);
int64_t LoadInt(const void* base, DType t, int64_t i);
// REQUIRES: !IsQuantized(t).
void StoreElement(void* base, DType t, int64_t i, double v);
void StoreInt(void* base, DType t, int64_t i, int64_t v);

}  // namespace kiln
