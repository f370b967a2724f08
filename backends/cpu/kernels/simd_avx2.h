// The AVX2 + FMA + F16C vector layer of the CPU kernels (8 float lanes). Included by
// kernels_avx2.cc, compiled with -mavx2 -mfma -mf16c, inside namespace kiln::cpu::avx2 (see
// kernels_impl.h for the interface every vector layer provides), and by
// kernels_q8_vnni.cc, compiled with AVX-512 VL and VNNI added, inside the namespace it names
// in KILN_SIMD_AVX2_NS: there the q8 dots use vpdpbusd and the q8 tiles the 32 vector
// registers (q8_impl.h).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "backends/cpu/kernels/kernels.h"
#include "engine/dtype.h"

#ifndef KILN_SIMD_AVX2_NS
#define KILN_SIMD_AVX2_NS avx2
#endif

namespace kiln::cpu::KILN_SIMD_AVX2_NS {

inline constexpr int kLanes = 8;
inline constexpr int kGemmMR = 6;  // micro-kernel rows: 6 x 2 accumulators + 2 + 1 = 15 ymm

struct F {
  __m256 v;
};
inline F Zero() { return {_mm256_setzero_ps()}; }
inline F Set1(float x) { return {_mm256_set1_ps(x)}; }
inline F Load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void Store(float* p, F a) { _mm256_storeu_ps(p, a.v); }
inline F Add(F a, F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F Mul(F a, F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F Div(F a, F b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F Fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
// NaN-propagating maximum (either operand NaN -> NaN).
inline F Max(F a, F b) {
  const __m256 m = _mm256_max_ps(a.v, b.v);
  const __m256 nan = _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q);
  return {_mm256_blendv_ps(m, a.v, nan)};
}
inline float HSum(F a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// out[i] = HSum(a[i]) for 8 vectors, by a transposing reduction (9 shuffles/adds in all).
inline void HSum8(const F* a, float* out) {
  const __m256 t0 = _mm256_hadd_ps(a[0].v, a[1].v), t1 = _mm256_hadd_ps(a[2].v, a[3].v);
  const __m256 t2 = _mm256_hadd_ps(a[4].v, a[5].v), t3 = _mm256_hadd_ps(a[6].v, a[7].v);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

// Cephes' expf polynomial on x within Exp's clamp range: e^x = y 2^n, y returned and n in
// *n; a NaN x gives a NaN y.
inline __m256 ExpPoly(__m256 x, __m256i* n) {
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  *n = _mm256_cvtps_epi32(fx);
  return y;
}

// exp(x) to about 1 ulp (Cephes' expf polynomial). NaN stays NaN; x < -87.33 (below the
// smallest normal result) gives 0; +Inf gives +Inf.
inline F Exp(F xf) {
  const __m256 x0 = xf.v;
  __m256 x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x0);
  x = _mm256_max_ps(_mm256_set1_ps(-87.33654475f), x);
  __m256i n;
  __m256 y = ExpPoly(x, &n);
  // 2^fx in two steps so that fx = 128 (x near the top of the range) does not overflow the
  // exponent field.
  const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
  const __m256i b = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, b), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, b), 23));
  y = _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
  // Below the range: 0. Above it: +Inf. NaN: NaN.
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(),
                       _mm256_cmp_ps(x0, _mm256_set1_ps(-87.33654475f), _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()),
                       _mm256_cmp_ps(x0, _mm256_set1_ps(88.3762626647949f), _CMP_GT_OQ));
  return {_mm256_blendv_ps(y, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q))};
}

// e^x of x clamped to [-80, 40] (NaN stays NaN): Exp's value bit for bit there, without its
// edge cases (cheaper, for callers that need no more range).
inline F ExpClamped(F xf) {
  const __m256 x =
      _mm256_min_ps(_mm256_set1_ps(40.0f), _mm256_max_ps(_mm256_set1_ps(-80.0f), xf.v));
  __m256i n;
  const __m256 y = ExpPoly(x, &n);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(y, _mm256_castsi256_ps(e))};
}

inline F LoadF16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline F LoadBF16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline float F16Scalar(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// dst[k * 16 + r] = src[r * lds + k] for r < 16, k < kc: an [16 x kc] row block transposed
// into the packed-panel layout, 8 x 8 tiles at a time.
inline void Transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + lds);
  __m256 r2 = _mm256_loadu_ps(src + 2 * lds), r3 = _mm256_loadu_ps(src + 3 * lds);
  __m256 r4 = _mm256_loadu_ps(src + 4 * lds), r5 = _mm256_loadu_ps(src + 5 * lds);
  __m256 r6 = _mm256_loadu_ps(src + 6 * lds), r7 = _mm256_loadu_ps(src + 7 * lds);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  r0 = _mm256_shuffle_ps(t0, t2, 0x44);
  r1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  r2 = _mm256_shuffle_ps(t1, t3, 0x44);
  r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  r4 = _mm256_shuffle_ps(t4, t6, 0x44);
  r5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  r6 = _mm256_shuffle_ps(t5, t7, 0x44);
  r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(r0, r4, 0x20));
  _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(r1, r5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(r2, r6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(r3, r7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(r0, r4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(r1, r5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(r2, r6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(r3, r7, 0x31));
}
// dst[k * nr + r] = src[r * lds + k], r < nr (a multiple of 8), k < kc.
inline void PackTranspose(const float* src, int64_t lds, int nr, int64_t kc, float* dst) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    for (int r = 0; r < nr; r += 8) Transpose8x8(src + r * lds + k, lds, dst + k * nr + r, nr);
  }
  for (; k < kc; ++k) {
    for (int r = 0; r < nr; ++r) dst[k * nr + r] = src[r * lds + k];
  }
}

// ---- Weight decoders: one 32-element block -> 4 chunks of 8 floats ----
// Each provides kBlockBytes, a State loaded once per block, Chunk(state, c) for c < 4, and
// (float types) Elem(row, k) for K tails. Values are exactly the dequantized weights of
// engine/dtype.h (q * d + m is exact in f32 for 4/8-bit quanta and f16 scales), except that
// a non-finite block scale yields NaN for every element of the block.

struct DecF32 {
  static constexpr int64_t kBlockBytes = 128;
  using State = const float*;
  static State Load(const uint8_t* b) { return reinterpret_cast<const float*>(b); }
  static F Chunk(State s, int c) { return KILN_SIMD_AVX2_NS::Load(s + 8 * c); }
  static float Elem(const uint8_t* row, int64_t k) {
    float v;
    std::memcpy(&v, row + 4 * k, 4);
    return v;
  }
};
struct DecF16 {
  static constexpr int64_t kBlockBytes = 64;
  using State = const uint16_t*;
  static State Load(const uint8_t* b) { return reinterpret_cast<const uint16_t*>(b); }
  static F Chunk(State s, int c) { return LoadF16(s + 8 * c); }
  static float Elem(const uint8_t* row, int64_t k) { return F16Scalar(row + 2 * k); }
};
struct DecBF16 {
  static constexpr int64_t kBlockBytes = 64;
  using State = const uint16_t*;
  static State Load(const uint8_t* b) { return reinterpret_cast<const uint16_t*>(b); }
  static F Chunk(State s, int c) { return LoadBF16(s + 8 * c); }
  static float Elem(const uint8_t* row, int64_t k) {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    return BF16ToFloat(h);
  }
};
// q4_0: x = (q - 8) * d computed as fma(q, d, -8d) (exact for finite d).
struct DecQ4_0 {
  static constexpr int64_t kBlockBytes = 18;
  struct State {
    __m256i lo, hi;  // bytes 0-7 and 8-15, zero-extended to 32 bits
    __m256 d, off;
  };
  static State Load(const uint8_t* b) {
    const float d = F16Scalar(b);
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 10))),
            _mm256_set1_ps(d), _mm256_set1_ps(-8.0f * d)};
  }
  static F Chunk(const State& s, int c) { return {_mm256_fmadd_ps(Raw(s, c).v, s.d, s.off)}; }
  // Split-scale interface (GemvTileSplit): x = Raw * Scale + Offset, Offset per block.
  static constexpr bool kSplit = true;
  static F Raw(const State& s, int c) {
    const __m256i m = _mm256_set1_epi32(15);
    const __m256i q = c == 0   ? _mm256_and_si256(s.lo, m)
                      : c == 1 ? _mm256_and_si256(s.hi, m)
                      : c == 2 ? _mm256_srli_epi32(s.lo, 4)
                               : _mm256_srli_epi32(s.hi, 4);
    return {_mm256_cvtepi32_ps(q)};
  }
  static F Scale(const State& s) { return {s.d}; }
  static float Offset(const State& s) { return _mm256_cvtss_f32(s.off); }
};
// q4_1: x = q * d + m.
struct DecQ4_1 {
  static constexpr int64_t kBlockBytes = 20;
  using State = DecQ4_0::State;
  static State Load(const uint8_t* b) {
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 12))),
            _mm256_set1_ps(F16Scalar(b)), _mm256_set1_ps(F16Scalar(b + 2))};
  }
  static F Chunk(const State& s, int c) { return DecQ4_0::Chunk(s, c); }
  static constexpr bool kSplit = true;
  static F Raw(const State& s, int c) { return DecQ4_0::Raw(s, c); }
  static F Scale(const State& s) { return {s.d}; }
  static float Offset(const State& s) { return _mm256_cvtss_f32(s.off); }
};
// q8_0: x = q * d.
struct DecQ8_0 {
  static constexpr int64_t kBlockBytes = 34;
  struct State {
    const uint8_t* qs;
    __m256 d;
  };
  static State Load(const uint8_t* b) { return {b + 2, _mm256_set1_ps(F16Scalar(b))}; }
  static F Chunk(const State& s, int c) { return {_mm256_mul_ps(Raw(s, c).v, s.d)}; }
  static constexpr bool kSplit = true;
  static F Raw(const State& s, int c) {
    const __m256i q =
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.qs + 8 * c)));
    return {_mm256_cvtepi32_ps(q)};
  }
  static F Scale(const State& s) { return {s.d}; }
  static float Offset(const State&) { return 0.0f; }
};
// 2^(e - 128) for every e8m0 code (255: NaN), exact (e = 0 and 1 are subnormal).
struct E8M0HalfTable {
  float v[256];
  constexpr E8M0HalfTable() : v() {
    for (int e = 0; e < 255; ++e) {
      float f = 1.0f;
      for (int i = 128; i > e; --i) f *= 0.5f;
      for (int i = 128; i < e; ++i) f *= 2.0f;
      v[e] = f;
    }
    v[255] = __builtin_nanf("");
  }
  float operator[](uint8_t e) const { return v[e]; }
};
inline constexpr E8M0HalfTable kE8M0Half;

// mxfp4: x = e2m1(nibble) * 2^(e - 127), via a table of 2 * e2m1 as int8 and a scale of
// 2^(e - 128) (exact, including the subnormal e = 0 and 1; e = 255 is NaN).
struct DecMXFP4 {
  static constexpr int64_t kBlockBytes = 17;
  struct State {
    __m128i lo, hi;  // table values of elements 0-15 and 16-31
    __m256 d;
  };
  static State Load(const uint8_t* b) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1));
    const __m128i m = _mm_set1_epi8(15);
    const float d = kE8M0Half[b[0]];
    return {_mm_shuffle_epi8(table, _mm_and_si128(v, m)),
            _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m)), _mm256_set1_ps(d)};
  }
  static F Chunk(const State& s, int c) { return {_mm256_mul_ps(Raw(s, c).v, s.d)}; }
  static constexpr bool kSplit = true;
  static F Raw(const State& s, int c) {
    const __m128i src = c < 2 ? s.lo : s.hi;
    const __m128i part = (c & 1) ? _mm_srli_si128(src, 8) : src;
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part))};
  }
  static F Scale(const State& s) { return {s.d}; }
  static float Offset(const State&) { return 0.0f; }
};

// ---- q8 activations (kernels.h Q8Block): integer dot products per block ----
#define KILN_ISA_HAS_Q8 1

inline void QuantizeQ8(const float* x, int64_t K, Q8Block* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 32; ++b, x += 32) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(x + 8 * c);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float amax_s = _mm_cvtss_f32(m), d = amax_s / 127.0f;
    const __m256 id = _mm256_set1_ps(amax_s != 0 ? 127.0f / amax_s : 0.0f);
    __m256i q[4];
    for (int c = 0; c < 4; ++c) {
      q[c] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[c], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // int32 -> int8 keeping element order (packs interleave 128-bit lanes: undo with a permute).
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs), p8);
    const __m256i s16 =
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p8), _mm256_set1_epi16(1));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    out[b].d = RoundToF16(d);
    out[b].s = out[b].d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// Weight block for the q8 path: 32 8-bit values in element order, unsigned (q4: the
// nibbles) or signed (q8_0, mxfp4 table values), a scale, and the coefficient of s (the
// activation block's d * sum(q)): -8d for q4_0, m for q4_1, 0 otherwise.
struct Q8W {
  __m256i q;
  float d, off;
};
// The 32 nibbles of a q4 block in element order: low nibbles in the low 128 bits, high
// nibbles in the high 128 bits (one broadcast load, one variable shift, one and).
inline __m256i Nibbles(const uint8_t* qs) {
  const __m256i v =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)),
                          _mm256_set1_epi8(15));
}
// Q8Tile4 reads the scales itself: kTile4 says it may (an f16 d first in the block, then the
// f16 m for q4_1), kOff what multiplies x.s.
enum class Q8Off { kNone, kMinus8D, kMin };
struct Q8DecQ4_0 {
  static constexpr int64_t kBlockBytes = 18;
  static constexpr bool kSigned = false, kTile4 = true;
  static constexpr Q8Off kOff = Q8Off::kMinus8D;
  static constexpr int64_t kNibblesAt = 2;  // after d
  static Q8W Load(const uint8_t* b) {
    const float d = F16Scalar(b);
    return {Nibbles(b + kNibblesAt), d, -8.0f * d};
  }
};
struct Q8DecQ4_1 {
  static constexpr int64_t kBlockBytes = 20;
  static constexpr bool kSigned = false, kTile4 = true;
  static constexpr Q8Off kOff = Q8Off::kMin;
  static constexpr int64_t kNibblesAt = 4;  // after d and m
  static Q8W Load(const uint8_t* b) {
    return {Nibbles(b + kNibblesAt), F16Scalar(b), F16Scalar(b + 2)};
  }
};
struct Q8DecQ8_0 {
  static constexpr int64_t kBlockBytes = 34;
  static constexpr bool kSigned = true, kTile4 = true;
  static constexpr Q8Off kOff = Q8Off::kNone;
  static Q8W Load(const uint8_t* b) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), F16Scalar(b), 0.0f};
  }
};
struct Q8DecMXFP4 {
  static constexpr int64_t kBlockBytes = 17;
  static constexpr bool kSigned = true, kTile4 = false;  // e8m0 scale
  static constexpr Q8Off kOff = Q8Off::kNone;
  static Q8W Load(const uint8_t* b) {
    const DecMXFP4::State s = DecMXFP4::Load(b);
    return {_mm256_set_m128i(s.hi, s.lo), _mm256_cvtss_f32(s.d), 0.0f};
  }
};
// ---- Integer dots of weight blocks against activation blocks ----
// int32 lane j of a dot = the sum over elements 4j..4j+3 of w * x, exactly, on both paths
// (so the two give bit-identical results): with VNNI one vpdpbusd; without, maddubs + madd,
// whose int16 pair sums stay below 2^15 (|w| <= 128 against |x| <= 127, or 0 <= w <= 15).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KILN_Q8_VNNI 1
inline constexpr int kQ8MR = 6;  // q8 tile rows: 12 zmm accumulators + 6 offsets + 11 more
#else
#define KILN_Q8_VNNI 0
inline constexpr int kQ8MR = 2;  // 8 accumulators + 2 offsets + 4 weights + 2 of 16 ymm
#endif

// A weight block's bytes as the dot takes them. VNNI multiplies unsigned by signed bytes:
// unsigned weights (q4 nibbles) go first as they are; for signed ones the activations are
// made unsigned (x + 128) and `fix` holds -128 * (each lane's sum of weights), so that
// dot = fix + dot(x + 128, w). Without VNNI, maddubs: |w| first and x takes w's signs (`fix`
// holds w).
struct Q8WOp {
  __m256i q, fix;
};
template <bool kSigned>
inline Q8WOp Q8PrepW(__m256i q) {
#if KILN_Q8_VNNI
  if constexpr (kSigned) {
    const __m256i z = _mm256_setzero_si256();
    return {q, _mm256_sub_epi32(z, _mm256_dpbusd_epi32(z, _mm256_set1_epi8(char(0x80)), q))};
  }
  return {q, _mm256_setzero_si256()};
#else
  if constexpr (kSigned) return {_mm256_sign_epi8(q, q), q};
  return {q, q};
#endif
}
// An activation block's bytes as Q8Dot takes them (signed weights under VNNI: x + 128).
template <bool kSigned>
inline __m256i Q8PrepX(__m256i x) {
#if KILN_Q8_VNNI
  if constexpr (kSigned) return _mm256_xor_si256(x, _mm256_set1_epi8(char(0x80)));
#endif
  return x;
}
template <bool kSigned>
inline __m256i Q8Dot(const Q8WOp& w, __m256i x) {
#if KILN_Q8_VNNI
  if constexpr (kSigned) return _mm256_dpbusd_epi32(w.fix, x, w.q);
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w.q, x);
#else
  const __m256i p = kSigned ? _mm256_maddubs_epi16(w.q, _mm256_sign_epi8(x, w.fix))
                            : _mm256_maddubs_epi16(w.q, x);
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

// `v` as an opaque register value: a product that must be rounded before the sum it feeds
// (-ffp-contract=fast would fuse the two into one FMA where nothing else reads the product,
// and the two q8 sets must round alike).
inline __m256 Unfused(__m256 v) {
  asm("" : "+v"(v));
  return v;
}

// acc += (w.d * x.d) * dot(w.q, x.qs); off += w.off * x.s.
template <class W>
inline void Q8Accumulate(const Q8W& w, const Q8Block& x, F& acc, float& off) {
  const __m256i xq =
      Q8PrepX<W::kSigned>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs)));
  const __m256 dot = _mm256_cvtepi32_ps(Q8Dot<W::kSigned>(Q8PrepW<W::kSigned>(w.q), xq));
  acc.v = _mm256_fmadd_ps(dot, _mm256_set1_ps(w.d * x.d), acc.v);
  off += w.off * x.s;
}

// The q8 GEMV's main tile: four weight rows (q4_0, q4_1 or q8_0) against MR activation rows.
// Per block, the four rows' f16 scales (and q4_1 mins) are converted by one instruction.
// y[i * ldy + r] = sum over blocks of d_r * x.d * dot(q_r, x.qs) + off_r * x.s (off: q4_0
// -8 d, q4_1 m, q8_0 none); each row's arithmetic is the same for every MR (a row's result
// does not depend on its neighbours) and in both builds of this layer. Without VNNI the
// products d_r * x.d are formed for all four rows by one multiply and broadcast to each
// accumulator by a broadcast load (instead of scalar conversions and products per row and
// block, which bounded the per-row loop above). With VNNI, two weight rows share each
// 512-bit register (rows 2h and 2h + 1 in its halves): every half does exactly the 256-bit
// operations, at twice the width — what Intel's two 512-bit FMA ports need. q4 weights (q4_0,
// q4_1) without a packed strip take Q8Tile4Nibbles there instead: four rows per register.
// REQUIRES: W::kTile4.
#define KILN_ISA_HAS_Q8_TILE4 1

// The four rows' scales at byte `at`: q4_1 d0 m0 d1 m1 d2 m2 d3 m3; otherwise d0 d1 d2 d3
// (upper lanes unused).
template <class W>
inline __m256 Q8Scales(const uint8_t* const rows[4], int64_t at) {
  if constexpr (W::kOff == Q8Off::kMin) {
    uint32_t h[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) std::memcpy(&h[r], rows[r] + at, 4);
    const uint64_t lo = h[0] | uint64_t{h[1]} << 32, hi = h[2] | uint64_t{h[3]} << 32;
    return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo)));
  } else {
    // Assembled in an integer register: keeps the vector ports for the dot products.
    uint64_t h = 0;
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      uint16_t v;
      std::memcpy(&v, rows[r] + at, 2);
      h |= uint64_t{v} << (16 * r);
    }
    return _mm256_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h)));
  }
}

// Lane of row r's d in Q8Scales (interleaved with the mins for q4_1).
template <class W>
inline constexpr int kQ8Lane[4] = {0, W::kOff == Q8Off::kMin ? 2 : 1,
                                   W::kOff == Q8Off::kMin ? 4 : 2, W::kOff == Q8Off::kMin ? 6 : 3};

// off_i += the block's offset products (q4_0: d_r * x.s, scaled by -8 at the end; q4_1:
// m_r * x.s in the odd lanes, rounded before the sum); returns d_r * x.d (and q4_1's products).
template <class W>
inline __m256 Q8Offsets(__m256 sc, const Q8Block& x, __m256& off) {
  if constexpr (W::kOff == Q8Off::kMin) {
    const __m256 p = Unfused(_mm256_mul_ps(
        sc, _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(&x.d)))));
    off = _mm256_add_ps(off, p);  // x.d x.s x.d x.s ...
    return p;
  } else {
    if constexpr (W::kOff == Q8Off::kMinus8D) {
      off = _mm256_fmadd_ps(sc, _mm256_set1_ps(x.s), off);
    }
    return _mm256_mul_ps(sc, _mm256_set1_ps(x.d));
  }
}

// y[i * ldy + r] from row i's accumulator of row r and its offsets.
template <class W>
inline float Q8Finish(__m256 acc, __m256 off, int r) {
  alignas(32) float o[8];
  _mm256_store_ps(o, off);
  const float extra = W::kOff == Q8Off::kMin       ? o[2 * r + 1]
                      : W::kOff == Q8Off::kMinus8D ? -8.0f * o[r]
                                                   : 0.0f;
  return HSum(F{acc}) + extra;
}

// Block b of R weight rows transposed for the strips with weight rows in the lanes (Q8Tile16,
// Q8Tile8): groups[j][r] = bytes 4j..4j+3 of row r (as W::Load gives them), d[r], and m[r]
// (q4_1's min; 0 otherwise).
template <class W, int R>
struct Q8Transposed {
  alignas(64) uint32_t groups[8][R];
  alignas(64) float d[R], m[R];
  Q8Transposed(const uint8_t* w, int64_t ldw, int64_t b) {
    for (int r = 0; r < R; ++r) {
      const Q8W q = W::Load(w + r * ldw + b * W::kBlockBytes);
      alignas(32) uint32_t bytes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), q.q);
      for (int j = 0; j < 8; ++j) groups[j][r] = bytes[j];
      d[r] = q.d;
      m[r] = W::kOff == Q8Off::kMin ? q.off : 0.0f;
    }
  }
};

#if KILN_Q8_VNNI
// One block of a four-row strip as the VNNI tile takes it.
struct Q8StripBlock {
  __m512i q[2], fix[2];  // rows 2h and 2h + 1 in the halves (fix: signed weights only)
  __m512 d[2];           // their scales, each over its half
  __m256 sc;             // Q8Scales
};
template <class W>
inline Q8StripBlock Q8DecodeStripBlock(const uint8_t* const rows[4], int64_t at) {
  Q8StripBlock s;
  s.sc = Q8Scales<W>(rows, at);
  Q8WOp q[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) q[r] = Q8PrepW<W::kSigned>(W::Load(rows[r] + at).q);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    s.q[h] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * h].q), q[2 * h + 1].q, 1);
    if constexpr (W::kSigned) {
      s.fix[h] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * h].fix), q[2 * h + 1].fix, 1);
    }
    const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(kQ8Lane<W>[2 * h]),
                                           _mm256_set1_epi32(kQ8Lane<W>[2 * h + 1]), 1);
    s.d[h] = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(s.sc));
  }
  return s;
}

// A strip of four weight rows decoded once, `nb` blocks, for every tile of rows that follows
// (prefill: many tiles of rows share one strip).
#define KILN_ISA_HAS_Q8_PACKED 1
template <class W>
inline void Q8PackStrip(const uint8_t* w, int64_t ldw, int64_t nb, Q8StripBlock* out) {
  const uint8_t* rows[4] = {w, w + ldw, w + 2 * ldw, w + 3 * ldw};
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchAhead(w, ldw, 4, b * W::kBlockBytes, W::kBlockBytes);
    out[b] = Q8DecodeStripBlock<W>(rows, b * W::kBlockBytes);
  }
}

// MR rows of x against one decoded block of the strip.
template <class W, int MR>
inline void Q8TileBlock(const Q8StripBlock& s, const Q8Block* xq, int64_t ldxq, int64_t b,
                        __m512 (&acc)[MR][2], __m256 (&off)[MR]) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const Q8Block& x = xq[i * ldxq + b];
    Q8Offsets<W>(s.sc, x, off[i]);
    const __m512 xd = _mm512_set1_ps(x.d);
    const __m512i xv = _mm512_broadcast_i64x4(
        Q8PrepX<W::kSigned>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs))));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i dot = W::kSigned ? _mm512_dpbusd_epi32(s.fix[h], xv, s.q[h])
                                     : _mm512_dpbusd_epi32(_mm512_setzero_si512(), s.q[h], xv);
      acc[i][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s.d[h], xd), acc[i][h]);
    }
  }
}

// The tile over the strip's blocks, decoded here (`w`) or packed beforehand (`packed`).
template <class W, int MR>
inline void Q8Tile4Vnni(const Q8Block* xq, int64_t ldxq, const uint8_t* w, int64_t ldw,
                        const Q8StripBlock* packed, int64_t nb, float* y, int64_t ldy) {
  __m512 acc[MR][2];
  __m256 off[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    off[i] = _mm256_setzero_ps();
    acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  }
  const uint8_t* rows[4] = {w, w + ldw, w + 2 * ldw, w + 3 * ldw};
  for (int64_t b = 0; b < nb; ++b) {
    if (packed != nullptr) {
      Q8TileBlock<W, MR>(packed[b], xq, ldxq, b, acc, off);
    } else {
      PrefetchAhead(w, ldw, 4, b * W::kBlockBytes, W::kBlockBytes);
      Q8TileBlock<W, MR>(Q8DecodeStripBlock<W>(rows, b * W::kBlockBytes), xq, ldxq, b, acc, off);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512d a = _mm512_castps_pd(acc[i][r / 2]);
      const __m256 half =
          _mm256_castpd_ps(r % 2 == 0 ? _mm512_castpd512_pd256(a) : _mm512_extractf64x4_pd(a, 1));
      y[i * ldy + r] = Q8Finish<W>(half, off[i], r);
    }
  }
}

// The unsigned (q4) tile without a packed strip (decode: few rows of x): the four rows' 16
// nibble bytes in the four 128-bit lanes of one register, so one shift and two ands unpack a
// block of all four rows (where W::Load unpacks each row apart), and one vpdpbusd per half of
// the block (low nibbles: groups 0-3; high: groups 4-7) gives every row's group dots against
// that half of x broadcast to the four lanes. Per lane, the arithmetic is Q8Tile4Vnni's (the
// same integer dot, scale product and FMA, summed in HSum's order at the end): bit-identical.
template <class W, int MR>
inline void Q8Tile4Nibbles(const Q8Block* xq, int64_t ldxq, const uint8_t* w, int64_t ldw,
                           int64_t nb, float* y, int64_t ldy) {
  static_assert(!W::kSigned);
  __m512 lo_acc[MR], hi_acc[MR];
  __m256 off[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    off[i] = _mm256_setzero_ps();
    lo_acc[i] = hi_acc[i] = _mm512_setzero_ps();
  }
  // Lane l takes row l / 4's scale (kQ8Lane) from Q8Offsets' products.
  const __m512i scale_idx = _mm512_setr_epi32(
      kQ8Lane<W>[0], kQ8Lane<W>[0], kQ8Lane<W>[0], kQ8Lane<W>[0], kQ8Lane<W>[1], kQ8Lane<W>[1],
      kQ8Lane<W>[1], kQ8Lane<W>[1], kQ8Lane<W>[2], kQ8Lane<W>[2], kQ8Lane<W>[2], kQ8Lane<W>[2],
      kQ8Lane<W>[3], kQ8Lane<W>[3], kQ8Lane<W>[3], kQ8Lane<W>[3]);
  const __m512i mask = _mm512_set1_epi8(15);
  const uint8_t* rows[4] = {w, w + ldw, w + 2 * ldw, w + 3 * ldw};
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t at = b * W::kBlockBytes;
    PrefetchAhead(w, ldw, 4, at, W::kBlockBytes);
    const __m256 sc = Q8Scales<W>(rows, at);
    const auto nibbles = [&](int r) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + at + W::kNibblesAt));
    };
    __m512i v = _mm512_castsi128_si512(nibbles(0));
    v = _mm512_inserti32x4(v, nibbles(1), 1);
    v = _mm512_inserti32x4(v, nibbles(2), 2);
    v = _mm512_inserti32x4(v, nibbles(3), 3);
    const __m512i lo = _mm512_and_si512(v, mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Q8Block& x = xq[i * ldxq + b];
      const __m512 s =
          _mm512_permutexvar_ps(scale_idx, _mm512_castps256_ps512(Q8Offsets<W>(sc, x, off[i])));
      const __m512i x_lo =
          _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.qs)));
      const __m512i x_hi =
          _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.qs + 16)));
      const __m512i z = _mm512_setzero_si512();
      lo_acc[i] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, lo, x_lo)), s, lo_acc[i]);
      hi_acc[i] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, hi, x_hi)), s, hi_acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    alignas(64) float l[16], h[16];
    _mm512_store_ps(l, lo_acc[i]);
    _mm512_store_ps(h, hi_acc[i]);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m256 groups = _mm256_set_m128(_mm_load_ps(h + 4 * r), _mm_load_ps(l + 4 * r));
      y[i * ldy + r] = Q8Finish<W>(groups, off[i], r);
    }
  }
}

// MR rows of x against a strip packed by Q8PackStrip.
template <class W, int MR>
inline void Q8Tile4Packed(const Q8Block* xq, int64_t ldxq, const Q8StripBlock* packed, int64_t nb,
                          float* y, int64_t ldy) {
  Q8Tile4Vnni<W, MR>(xq, ldxq, nullptr, 0, packed, nb, y, ldy);
}

// ---- Sixteen-row strips (prefill): weight rows in the lanes ----
// One register holds the same group of four elements (4j..4j+3) of 16 weight rows, row r in
// lane r, and one vpdpbusd against those four activation bytes broadcast gives each row's
// int32 dot of the group: the lane the 256-bit path computes for that group. Per block and row
// of x the 16 rows then share one scale product and one offset update, where the four-row tile
// spends them on four rows. Each row's float operations stay those of the four-row tile (one
// accumulator per group, summed in HSum's order at the end), so results are bit-identical.
#define KILN_ISA_HAS_Q8_STRIP16 1
struct Q8Block16 {
  __m512i g[8];    // group j of the 16 rows (bytes as the dot takes them)
  __m512i fix[8];  // signed weights: -128 * each row's sum over group j
  __m512 d, m;     // d_r, and q4_1's m_r
};
template <class W>
inline void Q8PackStrip16(const uint8_t* w, int64_t ldw, int64_t nb, Q8Block16* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const Q8Transposed<W, 16> t(w, ldw, b);
    Q8Block16& o = out[b];
    for (int j = 0; j < 8; ++j) {
      o.g[j] = _mm512_load_si512(t.groups[j]);
      if constexpr (W::kSigned) {
        const __m512i z = _mm512_setzero_si512();
        o.fix[j] =
            _mm512_sub_epi32(z, _mm512_dpbusd_epi32(z, _mm512_set1_epi8(char(0x80)), o.g[j]));
      }
    }
    o.d = _mm512_load_ps(t.d);
    o.m = _mm512_load_ps(t.m);
  }
}

inline __m512 Unfused(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

// MR rows of x against a sixteen-row strip packed by Q8PackStrip16: y[i * ldy + r], r < 16.
template <class W, int MR>
inline void Q8Tile16(const Q8Block* xq, int64_t ldxq, const Q8Block16* p, int64_t nb, float* y,
                     int64_t ldy) {
  __m512 acc[MR][8], off[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    off[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const Q8Block16& s = p[b];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Q8Block& x = xq[i * ldxq + b];
      if constexpr (W::kOff == Q8Off::kMin) {
        off[i] = _mm512_add_ps(off[i], Unfused(_mm512_mul_ps(s.m, _mm512_set1_ps(x.s))));
      } else if constexpr (W::kOff == Q8Off::kMinus8D) {
        off[i] = _mm512_fmadd_ps(s.d, _mm512_set1_ps(x.s), off[i]);
      }
      const __m512 sc = _mm512_mul_ps(s.d, _mm512_set1_ps(x.d));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        int32_t g;
        std::memcpy(&g, x.qs + 4 * j, 4);
        __m512i xv = _mm512_set1_epi32(g);
        __m512i dot;
        if constexpr (W::kSigned) {
          xv = _mm512_xor_si512(xv, _mm512_set1_epi8(char(0x80)));
          dot = _mm512_dpbusd_epi32(s.fix[j], xv, s.g[j]);
        } else {
          dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), s.g[j], xv);
        }
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    // HSum's order over the eight groups: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
    const __m512 t = _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][4]), _mm512_add_ps(acc[i][2], acc[i][6])),
        _mm512_add_ps(_mm512_add_ps(acc[i][1], acc[i][5]), _mm512_add_ps(acc[i][3], acc[i][7])));
    __m512 out = _mm512_add_ps(t, _mm512_setzero_ps());  // as HSum + 0: -0 becomes +0
    if constexpr (W::kOff == Q8Off::kMin) {
      out = _mm512_add_ps(t, off[i]);
    } else if constexpr (W::kOff == Q8Off::kMinus8D) {
      out = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(-8.0f), off[i]));  // -8 off: exact
    }
    _mm512_storeu_ps(y + i * ldy, out);
  }
}
#endif  // KILN_Q8_VNNI

#if !KILN_Q8_VNNI
// ---- Eight-row strips (prefill, AVX2): weight rows in the lanes ----
// Q8Tile16's layout at AVX2's width: one register holds group j (elements 4j..4j+3) of eight
// weight rows, and maddubs + madd against those four activation bytes broadcast give each
// row's int32 dot of the group. Per block and row of x the eight rows share one scale product
// and one offset update; each row's float operations stay the four-row tile's (bit-identical).
#define KILN_ISA_HAS_Q8_STRIP8 1
struct Q8Block8 {
  __m256i g[8];   // group j of the 8 rows: the bytes (unsigned weights) or |w| (signed)
  __m256i sg[8];  // signed weights: w, whose signs x takes
  __m256 d, m;    // d_r, and q4_1's m_r
};
template <class W>
inline void Q8PackStrip8(const uint8_t* w, int64_t ldw, int64_t nb, Q8Block8* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const Q8Transposed<W, 8> t(w, ldw, b);
    Q8Block8& o = out[b];
    for (int j = 0; j < 8; ++j) {
      const __m256i g = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.groups[j]));
      o.g[j] = W::kSigned ? _mm256_sign_epi8(g, g) : g;
      o.sg[j] = g;
    }
    o.d = _mm256_load_ps(t.d);
    o.m = _mm256_load_ps(t.m);
  }
}

// One row of x against an eight-row strip packed by Q8PackStrip8: y[r], r < 8.
template <class W>
inline void Q8Tile8(const Q8Block* xq, const Q8Block8* p, int64_t nb, float* y) {
  __m256 acc[8], off = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const Q8Block8& s = p[b];
    const Q8Block& x = xq[b];
    if constexpr (W::kOff == Q8Off::kMin) {
      off = _mm256_add_ps(off, Unfused(_mm256_mul_ps(s.m, _mm256_set1_ps(x.s))));
    } else if constexpr (W::kOff == Q8Off::kMinus8D) {
      off = _mm256_fmadd_ps(s.d, _mm256_set1_ps(x.s), off);
    }
    const __m256 sc = _mm256_mul_ps(s.d, _mm256_set1_ps(x.d));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      int32_t g;
      std::memcpy(&g, x.qs + 4 * j, 4);
      const __m256i xv = _mm256_set1_epi32(g);
      const __m256i prod = W::kSigned ? _mm256_maddubs_epi16(s.g[j], _mm256_sign_epi8(xv, s.sg[j]))
                                      : _mm256_maddubs_epi16(s.g[j], xv);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones)), sc, acc[j]);
    }
  }
  // HSum's order over the eight groups: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
  const __m256 t =
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                    _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
  __m256 out = _mm256_add_ps(t, _mm256_setzero_ps());  // as HSum + 0: -0 becomes +0
  if constexpr (W::kOff == Q8Off::kMin) {
    out = _mm256_add_ps(t, off);
  } else if constexpr (W::kOff == Q8Off::kMinus8D) {
    out = _mm256_add_ps(t, _mm256_mul_ps(_mm256_set1_ps(-8.0f), off));  // -8 off: exact
  }
  _mm256_storeu_ps(y, out);
}
#endif  // !KILN_Q8_VNNI

template <class W, int MR>
inline void Q8Tile4(const Q8Block* xq, int64_t ldxq, const uint8_t* w, int64_t ldw, int64_t nb,
                    float* y, int64_t ldy) {
  static_assert(W::kTile4);
#if KILN_Q8_VNNI
  if constexpr (!W::kSigned) return Q8Tile4Nibbles<W, MR>(xq, ldxq, w, ldw, nb, y, ldy);
  Q8Tile4Vnni<W, MR>(xq, ldxq, w, ldw, nullptr, nb, y, ldy);
#else
  __m256 acc[MR][4], off[MR];
  alignas(32) float ps[MR][8];  // p through memory: broadcast loads use no vector ALU
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    off[i] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_ps();
  }
  const uint8_t* rows[4] = {w, w + ldw, w + 2 * ldw, w + 3 * ldw};
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t at = b * W::kBlockBytes;
    PrefetchAhead(w, ldw, 4, at, W::kBlockBytes);
    const __m256 sc = Q8Scales<W>(rows, at);
    Q8WOp q[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) q[r] = Q8PrepW<W::kSigned>(W::Load(rows[r] + at).q);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Q8Block& x = xq[i * ldxq + b];
      _mm256_store_ps(ps[i], Q8Offsets<W>(sc, x, off[i]));
      const __m256i xv =
          Q8PrepX<W::kSigned>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs)));
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(Q8Dot<W::kSigned>(q[r], xv));
        acc[i][r] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(&ps[i][kQ8Lane<W>[r]]), acc[i][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) y[i * ldy + r] = Q8Finish<W>(acc[i][r], off[i], r);
  }
#endif
}

}  // namespace kiln::cpu::KILN_SIMD_AVX2_NS
