// The OpenCL C prelude of every xpu program: element access for every Kiln dtype (GGML block
// layouts for the quantized ones), the conversions with Kiln's rounding rules (engine/dtype.h),
// and the launch metadata types. The host prepends `#define DT_<NAME> <code>` for each dtype,
// KILN_WG (the work-group size of every kernel) and, on devices with cl_khr_fp64, KILN_FP64.
//
// Tensors reach kernels as a `__global uchar*` buffer plus a byte offset (in the metadata);
// element i of a tensor is at byte offset i * element size (quantized: block i / 32 or 256).
// Integer arithmetic that may overflow goes through ulong (wraps, as the reference does).

#ifdef KILN_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

typedef __global uchar* gptr;
typedef const __global uchar* cgptr;

// Launch metadata: one struct of longs per kernel, passed by value (kernel arguments are
// captured with the launch, so a recorded command buffer keeps its own copy).
typedef struct { long v[8]; } meta8;
typedef struct { long v[16]; } meta16;
typedef struct { long v[24]; } meta24;
typedef struct { long v[32]; } meta32;
typedef struct { long v[48]; } meta48;
typedef struct { long v[64]; } meta64;
typedef struct { long v[96]; } meta96;
typedef struct { long v[120]; } meta120;

#define KILN_I64_MIN (-9223372036854775807L - 1L)

// ---- Wrapping integer arithmetic ----------------------------------------------------------------
inline long wadd(long a, long b) { return (long)((ulong)a + (ulong)b); }
inline long wsub(long a, long b) { return (long)((ulong)a - (ulong)b); }
inline long wmul(long a, long b) { return (long)((ulong)a * (ulong)b); }
inline long wneg(long a) { return (long)(0UL - (ulong)a); }
inline long idiv(long a, long b) {
  if (b == 0) return 0;
  if (a == KILN_I64_MIN && b == -1) return a;
  return a / b;
}
inline long imod(long a, long b) {  // the sign of the divisor (Python)
  if (b == 0 || b == -1) return 0;
  const long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// NaN-propagating max/min (fmax/fmin drop NaNs).
inline float nmaxf(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmax(a, b); }
inline float nminf(float a, float b) { return (isnan(a) || isnan(b)) ? NAN : fmin(a, b); }
inline float sigmoidf(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + exp(-x));
  const float e = exp(x);
  return e / (1.0f + e);
}
#ifdef KILN_FP64
inline double nmaxd(double a, double b) { return (isnan(a) || isnan(b)) ? (double)NAN : fmax(a, b); }
inline double nmind(double a, double b) { return (isnan(a) || isnan(b)) ? (double)NAN : fmin(a, b); }
inline double sigmoidd(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
  const double e = exp(x);
  return e / (1.0 + e);
}
#endif

// ---- Narrow floats ------------------------------------------------------------------------------
// Generic round-to-nearest-even encoder for small float formats (engine/dtype.cc's EncodeMini):
// `fn` selects the e4m3fn rules (no infinities; overflow and NaN give the all-ones NaN code).
#define KILN_DEFINE_ENC_MINI(NAME, T)                                                    \
  inline uint NAME(T x, int eb, int mb, int bias, int fn) {                             \
    const uint sign = signbit(x) ? (1u << (eb + mb)) : 0u;                              \
    const uint exp_all = (1u << eb) - 1u;                                               \
    const uint all_ones = (1u << (eb + mb)) - 1u;                                       \
    if (isnan(x)) return fn ? (sign | all_ones) : (sign | exp_all << mb | 1u << (mb - 1)); \
    const T man_max = (T)((1 << mb) - 1);                                               \
    const T max_finite = fn ? ldexp((T)1 + (man_max - (T)1) / (T)(1 << mb), (int)exp_all - bias) \
                            : ldexp((T)1 + man_max / (T)(1 << mb), (int)exp_all - 1 - bias);     \
    const uint overflow = fn ? (sign | all_ones) : (sign | exp_all << mb);              \
    const T a = fabs(x);                                                                \
    if (isinf(a)) return overflow;                                                      \
    if (a == (T)0) return sign;                                                         \
    const int emin = 1 - bias;                                                          \
    const int q_exp = max(ilogb(a), emin) - mb;                                         \
    const T rounded = ldexp(rint(ldexp(a, -q_exp)), q_exp);                             \
    if (rounded > max_finite) return overflow;                                          \
    if (rounded == (T)0) return sign;                                                   \
    const int e2 = ilogb(rounded);                                                      \
    if (e2 < emin) return sign | (uint)ldexp(rounded, mb - emin);                       \
    const uint man = (uint)ldexp(rounded, mb - e2) - (1u << mb);                        \
    return sign | (uint)(e2 + bias) << mb | man;                                        \
  }
KILN_DEFINE_ENC_MINI(enc_mini_f, float)
#ifdef KILN_FP64
KILN_DEFINE_ENC_MINI(enc_mini_d, double)
#endif

inline float dec_e4m3(uint v) {
  const uint e = (v >> 3) & 15u, m = v & 7u;
  float r;
  if (e == 15u && m == 7u) {
    r = NAN;
  } else if (e == 0u) {
    r = ldexp((float)m, -9);
  } else {
    r = ldexp(1.0f + (float)m / 8.0f, (int)e - 7);
  }
  return (v & 0x80u) ? -r : r;
}
inline float dec_e5m2(uint v) {
  const uint e = (v >> 2) & 31u, m = v & 3u;
  float r;
  if (e == 31u) {
    r = m ? NAN : INFINITY;
  } else if (e == 0u) {
    r = ldexp((float)m, -16);
  } else {
    r = ldexp(1.0f + (float)m / 4.0f, (int)e - 15);
  }
  return (v & 0x80u) ? -r : r;
}
inline ushort f32_to_bf16(float f) {
  uint x = as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (ushort)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (ushort)(x >> 16);
}

// ---- Block-quantized weights (GGML layouts) -----------------------------------------------------
inline float ld_half(cgptr p) { return vload_half(0, (const __global half*)p); }

inline float ldf_q4_0(cgptr p, long i) {
  cgptr b = p + (i >> 5) * 18;
  const int j = (int)(i & 31);
  const uint q = b[2 + (j & 15)];
  return (float)((int)(j < 16 ? (q & 15u) : (q >> 4)) - 8) * ld_half(b);
}
inline float ldf_q4_1(cgptr p, long i) {
  cgptr b = p + (i >> 5) * 20;
  const int j = (int)(i & 31);
  const uint q = b[4 + (j & 15)];
  return (float)(j < 16 ? (q & 15u) : (q >> 4)) * ld_half(b) + ld_half(b + 2);
}
inline float ldf_q8_0(cgptr p, long i) {
  cgptr b = p + (i >> 5) * 34;
  return (float)((char)b[2 + (i & 31)]) * ld_half(b);
}
__constant float kMxfp4Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_half(uint e) { return ldexp(1.0f, (int)e - 128); }
inline float ldf_mxfp4(cgptr p, long i) {
  cgptr b = p + (i >> 5) * 17;
  const int j = (int)(i & 31);
  const uint q = b[1 + (j & 15)];
  return kMxfp4Doubled[j < 16 ? (q & 15u) : (q >> 4)] * e8m0_half(b[0]);
}
// The 32 elements of the block that starts at element e (linear kernels: dequantize once,
// in registers, then dot).
inline void deq32_q4_0(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 18;
  const float d = ld_half(b);
  for (int j = 0; j < 16; ++j) {
    const uint q = b[2 + j];
    wv[j] = (float)((int)(q & 15u) - 8) * d;
    wv[j + 16] = (float)((int)(q >> 4) - 8) * d;
  }
}
inline void deq32_q4_1(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 20;
  const float d = ld_half(b), mn = ld_half(b + 2);
  for (int j = 0; j < 16; ++j) {
    const uint q = b[4 + j];
    wv[j] = (float)(q & 15u) * d + mn;
    wv[j + 16] = (float)(q >> 4) * d + mn;
  }
}
inline void deq32_q8_0(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 34;
  const float d = ld_half(b);
  for (int j = 0; j < 32; ++j) wv[j] = (float)((char)b[2 + j]) * d;
}
inline void deq32_mxfp4(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 17;
  const float d = e8m0_half(b[0]);
  for (int j = 0; j < 16; ++j) {
    const uint q = b[1 + j];
    wv[j] = kMxfp4Doubled[q & 15u] * d;
    wv[j + 16] = kMxfp4Doubled[q >> 4] * d;
  }
}
// Eight bytes from p as two little-endian words, in the widest loads p's alignment allows.
inline void ld_bytes8(cgptr p, uint* lo, uint* hi) {
  const ulong a = (ulong)p;
  if ((a & 3u) == 0) {
    *lo = ((const __global uint*)p)[0];
    *hi = ((const __global uint*)p)[1];
  } else if ((a & 1u) == 0) {
    const __global ushort* s = (const __global ushort*)p;
    *lo = (uint)s[0] | ((uint)s[1] << 16);
    *hi = (uint)s[2] | ((uint)s[3] << 16);
  } else {
    *lo = (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
    *hi = (uint)p[4] | ((uint)p[5] << 8) | ((uint)p[6] << 16) | ((uint)p[7] << 24);
  }
}
// The 8 elements from element e (a multiple of 8) of 4-bit nibble blocks (elements j and j + 16
// share byte j): quants in wv as integers 0..15.
inline void nib8(float* wv, cgptr qs, long e) {
  const int sub = (int)((e >> 3) & 3), sh = (sub >> 1) * 4;
  uint lo, hi;
  ld_bytes8(qs + (sub & 1) * 8, &lo, &hi);
  for (int j = 0; j < 4; ++j) {
    wv[j] = (float)((lo >> (8 * j + sh)) & 15u);
    wv[j + 4] = (float)((hi >> (8 * j + sh)) & 15u);
  }
}
// The 8 elements from element e (a multiple of 8): the sub-group Linear kernel gives each lane
// a quarter block, read in word loads.
inline void deq8_q4_0(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 18;
  const float d = ld_half(b);
  nib8(wv, b + 2, e);
  for (int j = 0; j < 8; ++j) wv[j] = (wv[j] - 8.0f) * d;
}
inline void deq8_q4_1(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 20;
  const float d = ld_half(b), mn = ld_half(b + 2);
  nib8(wv, b + 4, e);
  for (int j = 0; j < 8; ++j) wv[j] = wv[j] * d + mn;
}
inline void deq8_q8_0(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 34;
  const float d = ld_half(b);
  uint lo, hi;
  ld_bytes8(b + 2 + (e & 31), &lo, &hi);
  for (int j = 0; j < 4; ++j) {
    wv[j] = (float)((char)(lo >> (8 * j))) * d;
    wv[j + 4] = (float)((char)(hi >> (8 * j))) * d;
  }
}
inline void deq8_mxfp4(float* wv, cgptr p, long e) {
  cgptr b = p + (e >> 5) * 17;
  const float d = e8m0_half(b[0]);
  nib8(wv, b + 1, e);
  for (int j = 0; j < 8; ++j) wv[j] = kMxfp4Doubled[(int)wv[j]] * d;
}
// K-quants: 256-element super-blocks with 6-bit scales and mins.
inline void scale_min_k4(int j, cgptr q, float* d, float* m) {
  if (j < 4) {
    *d = (float)(q[j] & 63);
    *m = (float)(q[j + 4] & 63);
  } else {
    *d = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}
inline float ldf_q4_k(cgptr p, long i) {
  cgptr b = p + (i >> 8) * 144;
  const int j = (int)(i & 255), sub = j >> 6, l = j & 63;
  float sc, m;
  scale_min_k4(2 * sub + (l >> 5), b + 4, &sc, &m);
  const uint q = b[16 + sub * 32 + (l & 31)];
  const float d1 = ld_half(b) * sc, m1 = ld_half(b + 2) * m;
  return d1 * (float)(l < 32 ? (q & 15u) : (q >> 4)) - m1;
}
inline float ldf_q5_k(cgptr p, long i) {
  cgptr b = p + (i >> 8) * 176;
  const int j = (int)(i & 255), sub = j >> 6, l = j & 63;
  float sc, m;
  scale_min_k4(2 * sub + (l >> 5), b + 4, &sc, &m);
  const uint ql = b[48 + sub * 32 + (l & 31)], qh = b[16 + (l & 31)];
  const uint bit = (l < 32 ? 1u : 2u) << (2 * sub);
  const uint q = (l < 32 ? (ql & 15u) : (ql >> 4)) + ((qh & bit) ? 16u : 0u);
  const float d1 = ld_half(b) * sc, m1 = ld_half(b + 2) * m;
  return d1 * (float)q - m1;
}
inline float ldf_q6_k(cgptr p, long i) {
  cgptr b = p + (i >> 8) * 210;
  const int j = (int)(i & 255), n = j >> 7, r = j & 127, quarter = r >> 5, l = r & 31;
  cgptr ql = b + n * 64, qh = b + 128 + n * 32;
  const __global char* sc = (const __global char*)(b + 192 + n * 8);
  const uint h = qh[l];
  int q;
  switch (quarter) {
    case 0: q = (int)((ql[l] & 0xFu) | ((h & 3u) << 4)); break;
    case 1: q = (int)((ql[l + 32] & 0xFu) | (((h >> 2) & 3u) << 4)); break;
    case 2: q = (int)((ql[l] >> 4) | (((h >> 4) & 3u) << 4)); break;
    default: q = (int)((ql[l + 32] >> 4) | (((h >> 6) & 3u) << 4)); break;
  }
  return ld_half(b + 208) * (float)sc[(l >> 4) + 2 * quarter] * (float)(q - 32);
}

// ---- Scalar element access, one function per dtype ----------------------------------------------
// ldf_T: load as float (integers convert, quantized dequantize); ldi_T: integers and bool,
// exact; ldd_T: load as double. stf_T/sti_T/std_T store a float / long / double with Kiln's
// rules: float -> integer truncates and saturates (NaN -> 0), integer -> integer wraps,
// anything -> bool is x != 0, narrow floats round to nearest even.
inline float ldf_f32(cgptr p, long i) { return ((const __global float*)p)[i]; }
inline float ldf_f16(cgptr p, long i) { return vload_half(i, (const __global half*)p); }
inline float ldf_bf16(cgptr p, long i) {
  return as_float((uint)((const __global ushort*)p)[i] << 16);
}
inline float ldf_f8e4m3(cgptr p, long i) { return dec_e4m3(p[i]); }
inline float ldf_f8e5m2(cgptr p, long i) { return dec_e5m2(p[i]); }
inline long ldi_i8(cgptr p, long i) { return ((const __global char*)p)[i]; }
inline long ldi_u8(cgptr p, long i) { return p[i]; }
inline long ldi_i16(cgptr p, long i) { return ((const __global short*)p)[i]; }
inline long ldi_i32(cgptr p, long i) { return ((const __global int*)p)[i]; }
inline long ldi_i64(cgptr p, long i) { return ((const __global long*)p)[i]; }
inline long ldi_bool(cgptr p, long i) { return p[i] != 0; }
inline float ldf_i8(cgptr p, long i) { return (float)ldi_i8(p, i); }
inline float ldf_u8(cgptr p, long i) { return (float)ldi_u8(p, i); }
inline float ldf_i16(cgptr p, long i) { return (float)ldi_i16(p, i); }
inline float ldf_i32(cgptr p, long i) { return (float)ldi_i32(p, i); }
inline float ldf_i64(cgptr p, long i) { return (float)ldi_i64(p, i); }
inline float ldf_bool(cgptr p, long i) { return (float)ldi_bool(p, i); }

inline void stf_f32(gptr p, long i, float v) { ((__global float*)p)[i] = v; }
inline void stf_f16(gptr p, long i, float v) { vstore_half_rte(v, i, (__global half*)p); }
inline void stf_bf16(gptr p, long i, float v) { ((__global ushort*)p)[i] = f32_to_bf16(v); }
inline void stf_f8e4m3(gptr p, long i, float v) { p[i] = (uchar)enc_mini_f(v, 4, 3, 7, 1); }
inline void stf_f8e5m2(gptr p, long i, float v) { p[i] = (uchar)enc_mini_f(v, 5, 2, 15, 0); }
inline void stf_i8(gptr p, long i, float v) { ((__global char*)p)[i] = convert_char_sat_rtz(v); }
inline void stf_u8(gptr p, long i, float v) { p[i] = convert_uchar_sat_rtz(v); }
inline void stf_i16(gptr p, long i, float v) { ((__global short*)p)[i] = convert_short_sat_rtz(v); }
inline void stf_i32(gptr p, long i, float v) { ((__global int*)p)[i] = convert_int_sat_rtz(v); }
inline void stf_i64(gptr p, long i, float v) { ((__global long*)p)[i] = convert_long_sat_rtz(v); }
inline void stf_bool(gptr p, long i, float v) { p[i] = v != 0.0f ? 1 : 0; }

inline void sti_i8(gptr p, long i, long v) { ((__global char*)p)[i] = (char)v; }
inline void sti_u8(gptr p, long i, long v) { p[i] = (uchar)v; }
inline void sti_i16(gptr p, long i, long v) { ((__global short*)p)[i] = (short)v; }
inline void sti_i32(gptr p, long i, long v) { ((__global int*)p)[i] = (int)v; }
inline void sti_i64(gptr p, long i, long v) { ((__global long*)p)[i] = v; }
inline void sti_bool(gptr p, long i, long v) { p[i] = v != 0 ? 1 : 0; }
inline void sti_f32(gptr p, long i, long v) { stf_f32(p, i, (float)v); }
inline void sti_f16(gptr p, long i, long v) { stf_f16(p, i, (float)v); }
inline void sti_bf16(gptr p, long i, long v) { stf_bf16(p, i, (float)v); }
inline void sti_f8e4m3(gptr p, long i, long v) { stf_f8e4m3(p, i, (float)v); }
inline void sti_f8e5m2(gptr p, long i, long v) { stf_f8e5m2(p, i, (float)v); }

#ifdef KILN_FP64
inline double ldd_f64(cgptr p, long i) { return ((const __global double*)p)[i]; }
inline float ldf_f64(cgptr p, long i) { return (float)ldd_f64(p, i); }
inline void std_f64(gptr p, long i, double v) { ((__global double*)p)[i] = v; }
inline void stf_f64(gptr p, long i, float v) { std_f64(p, i, (double)v); }
inline void sti_f64(gptr p, long i, long v) { std_f64(p, i, (double)v); }
inline void std_f32(gptr p, long i, double v) { stf_f32(p, i, (float)v); }
inline void std_f16(gptr p, long i, double v) {
  ((__global ushort*)p)[i] = (ushort)enc_mini_d(v, 5, 10, 15, 0);
}
inline void std_bf16(gptr p, long i, double v) {
  ((__global ushort*)p)[i] = (ushort)enc_mini_d(v, 8, 7, 127, 0);
}
inline void std_f8e4m3(gptr p, long i, double v) { p[i] = (uchar)enc_mini_d(v, 4, 3, 7, 1); }
inline void std_f8e5m2(gptr p, long i, double v) { p[i] = (uchar)enc_mini_d(v, 5, 2, 15, 0); }
inline void std_i8(gptr p, long i, double v) { ((__global char*)p)[i] = convert_char_sat_rtz(v); }
inline void std_u8(gptr p, long i, double v) { p[i] = convert_uchar_sat_rtz(v); }
inline void std_i16(gptr p, long i, double v) { ((__global short*)p)[i] = convert_short_sat_rtz(v); }
inline void std_i32(gptr p, long i, double v) { ((__global int*)p)[i] = convert_int_sat_rtz(v); }
inline void std_i64(gptr p, long i, double v) { ((__global long*)p)[i] = convert_long_sat_rtz(v); }
inline void std_bool(gptr p, long i, double v) { p[i] = v != 0.0 ? 1 : 0; }
#endif

// ---- Run-time dtype dispatch (library kernels that serve every dtype) ---------------------------
inline float ldf_any(int t, cgptr p, long i) {
  switch (t) {
    case DT_F32: return ldf_f32(p, i);
#ifdef KILN_FP64
    case DT_F64: return ldf_f64(p, i);
#endif
    case DT_F16: return ldf_f16(p, i);
    case DT_BF16: return ldf_bf16(p, i);
    case DT_F8E4M3: return ldf_f8e4m3(p, i);
    case DT_F8E5M2: return ldf_f8e5m2(p, i);
    case DT_I8: return ldf_i8(p, i);
    case DT_U8: return ldf_u8(p, i);
    case DT_I16: return ldf_i16(p, i);
    case DT_I32: return ldf_i32(p, i);
    case DT_I64: return ldf_i64(p, i);
    case DT_BOOL: return ldf_bool(p, i);
    case DT_Q4_0: return ldf_q4_0(p, i);
    case DT_Q4_1: return ldf_q4_1(p, i);
    case DT_Q8_0: return ldf_q8_0(p, i);
    case DT_MXFP4: return ldf_mxfp4(p, i);
    case DT_Q4_K: return ldf_q4_k(p, i);
    case DT_Q5_K: return ldf_q5_k(p, i);
    case DT_Q6_K: return ldf_q6_k(p, i);
    default: return 0.0f;
  }
}
inline bool is_int_like(int t) {
  return t == DT_I8 || t == DT_U8 || t == DT_I16 || t == DT_I32 || t == DT_I64 || t == DT_BOOL;
}
inline long ldi_any(int t, cgptr p, long i) {
  switch (t) {
    case DT_I8: return ldi_i8(p, i);
    case DT_U8: return ldi_u8(p, i);
    case DT_I16: return ldi_i16(p, i);
    case DT_I32: return ldi_i32(p, i);
    case DT_I64: return ldi_i64(p, i);
    case DT_BOOL: return ldi_bool(p, i);
    default: return convert_long_sat_rtz(ldf_any(t, p, i));
  }
}
inline void stf_any(int t, gptr p, long i, float v) {
  switch (t) {
    case DT_F32: stf_f32(p, i, v); break;
#ifdef KILN_FP64
    case DT_F64: stf_f64(p, i, v); break;
#endif
    case DT_F16: stf_f16(p, i, v); break;
    case DT_BF16: stf_bf16(p, i, v); break;
    case DT_F8E4M3: stf_f8e4m3(p, i, v); break;
    case DT_F8E5M2: stf_f8e5m2(p, i, v); break;
    case DT_I8: stf_i8(p, i, v); break;
    case DT_U8: stf_u8(p, i, v); break;
    case DT_I16: stf_i16(p, i, v); break;
    case DT_I32: stf_i32(p, i, v); break;
    case DT_I64: stf_i64(p, i, v); break;
    case DT_BOOL: stf_bool(p, i, v); break;
    default: break;
  }
}
inline void sti_any(int t, gptr p, long i, long v) {
  switch (t) {
    case DT_I8: sti_i8(p, i, v); break;
    case DT_U8: sti_u8(p, i, v); break;
    case DT_I16: sti_i16(p, i, v); break;
    case DT_I32: sti_i32(p, i, v); break;
    case DT_I64: sti_i64(p, i, v); break;
    case DT_BOOL: sti_bool(p, i, v); break;
    default: stf_any(t, p, i, (float)v); break;
  }
}
inline int dtype_bytes(int t) {
  switch (t) {
    case DT_F64: case DT_I64: return 8;
    case DT_F32: case DT_I32: return 4;
    case DT_F16: case DT_BF16: case DT_I16: return 2;
    default: return 1;
  }
}

// `real`: the widest float the device has (library kernels that convert between arbitrary
// dtypes go through it, so f64 data keeps its precision).
#ifdef KILN_FP64
typedef double real;
inline double ldr_any(int t, cgptr p, long i) {
  return t == DT_F64 ? ldd_f64(p, i) : (is_int_like(t) ? (double)ldi_any(t, p, i)
                                                        : (double)ldf_any(t, p, i));
}
inline void str_any(int t, gptr p, long i, double v) {
  switch (t) {
    case DT_F64: std_f64(p, i, v); break;
    case DT_F32: std_f32(p, i, v); break;
    case DT_F16: std_f16(p, i, v); break;
    case DT_BF16: std_bf16(p, i, v); break;
    case DT_F8E4M3: std_f8e4m3(p, i, v); break;
    case DT_F8E5M2: std_f8e5m2(p, i, v); break;
    case DT_I8: std_i8(p, i, v); break;
    case DT_U8: std_u8(p, i, v); break;
    case DT_I16: std_i16(p, i, v); break;
    case DT_I32: std_i32(p, i, v); break;
    case DT_I64: std_i64(p, i, v); break;
    case DT_BOOL: std_bool(p, i, v); break;
    default: break;
  }
}
#else
typedef float real;
inline float ldr_any(int t, cgptr p, long i) {
  return is_int_like(t) ? (float)ldi_any(t, p, i) : ldf_any(t, p, i);
}
inline void str_any(int t, gptr p, long i, float v) { stf_any(t, p, i, v); }
#endif

// Copies element `si` of (st, sp) to element `di` of (dt, dp): raw bytes when the dtypes
// agree, exact integers between integer types, through `real` otherwise.
inline void copy_elem(int st, cgptr sp, long si, int dt, gptr dp, long di) {
  if (st == dt) {
    switch (dtype_bytes(st)) {
      case 8: ((__global ulong*)dp)[di] = ((const __global ulong*)sp)[si]; break;
      case 4: ((__global uint*)dp)[di] = ((const __global uint*)sp)[si]; break;
      case 2: ((__global ushort*)dp)[di] = ((const __global ushort*)sp)[si]; break;
      default: dp[di] = sp[si]; break;
    }
  } else if (is_int_like(st) && is_int_like(dt)) {
    sti_any(dt, dp, di, ldi_any(st, sp, si));
  } else {
    str_any(dt, dp, di, ldr_any(st, sp, si));
  }
}

// ---- Strided addressing -------------------------------------------------------------------------
// A tensor descriptor inside a metadata block: m[at] = byte offset, m[at+1] = rank,
// m[at+2 .. at+2+rank) = shape, m[at+10 .. at+10+rank) = strides (elements). 18 longs.
#define TD_SIZE 18
#define TD_OFF(m, at) ((m)[(at)])
#define TD_RANK(m, at) ((int)(m)[(at) + 1])
#define TD_SHAPE(m, at, d) ((m)[(at) + 2 + (d)])
#define TD_STRIDE(m, at, d) ((m)[(at) + 10 + (d)])

// Element offset of row-major position `pos` of the descriptor's own shape.
inline long td_offset(const long* m, int at, long pos) {
  long off = 0;
  for (int d = TD_RANK(m, at) - 1; d >= 0; --d) {
    const long s = TD_SHAPE(m, at, d);
    if (s > 0) {
      off += (pos % s) * TD_STRIDE(m, at, d);
      pos /= s;
    }
  }
  return off;
}
inline long td_numel(const long* m, int at) {
  long n = 1;
  for (int d = 0; d < TD_RANK(m, at); ++d) n *= TD_SHAPE(m, at, d);
  return n;
}
