// The AVX-512 (F/BW/VL/DQ) vector layer of the CPU kernels (16 float lanes). Included only
// by kernels_avx512.cc, compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma
// -mf16c, inside namespace kiln::cpu::avx512. Same contract as simd_avx2.h.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "engine/dtype.h"

namespace kiln::cpu::avx512 {

inline constexpr int kLanes = 16;
inline constexpr int kGemmMR = 12;  // 12 x 2 accumulators + 2 + 1 = 27 zmm of 32
// No q8 path of its own: the AVX2 one serves AVX-512 CPUs.
#define KILN_ISA_HAS_Q8 0

struct F {
  __m512 v;
};
inline F Zero() { return {_mm512_setzero_ps()}; }
inline F Set1(float x) { return {_mm512_set1_ps(x)}; }
inline F Load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void Store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline F Add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F Mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F Div(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F Fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F Max(F a, F b) {
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return {_mm512_mask_blend_ps(nan, _mm512_max_ps(a.v, b.v), a.v)};
}
inline float HSum(F a) { return _mm512_reduce_add_ps(a.v); }
// The sums of eight vectors, each by the same tree: its two 256-bit halves added lane by lane,
// then the avx2 layer's transposing reduction (fewer shuffles than eight reduce_adds).
inline void HSum8(const F* a, float* out) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i) {
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i].v), _mm512_extractf32x8_ps(a[i].v, 1));
  }
  const __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}
// Cephes' expf polynomial on x within Exp's clamp range: e^x = y 2^n, y returned and n in
// *n; a NaN x gives a NaN y.
inline __m512 ExpPoly(__m512 x, __m512i* n) {
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  *n = _mm512_cvtps_epi32(fx);
  return y;
}

inline F Exp(F xf) {
  const __m512 x0 = xf.v;
  __m512 x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x0);
  x = _mm512_max_ps(_mm512_set1_ps(-87.33654475f), x);
  __m512i n;
  __m512 y = ExpPoly(x, &n);
  const __m512i n1 = _mm512_srai_epi32(n, 1), n2 = _mm512_sub_epi32(n, n1);
  const __m512i b = _mm512_set1_epi32(127);
  const __m512 p1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, b), 23));
  const __m512 p2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, b), 23));
  y = _mm512_mul_ps(_mm512_mul_ps(y, p1), p2);
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(-87.33654475f), _CMP_LT_OQ), y,
                           _mm512_setzero_ps());
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(88.3762626647949f), _CMP_GT_OQ), y,
                           _mm512_set1_ps(__builtin_inff()));
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q), y, x0)};
}

// e^x of x clamped to [-80, 40] (NaN stays NaN): Exp's value bit for bit there, without its
// edge cases (cheaper, for callers that need no more range).
inline F ExpClamped(F xf) {
  const __m512 x =
      _mm512_min_ps(_mm512_set1_ps(40.0f), _mm512_max_ps(_mm512_set1_ps(-80.0f), xf.v));
  __m512i n;
  const __m512 y = ExpPoly(x, &n);
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return {_mm512_mul_ps(y, _mm512_castsi512_ps(e))};
}

inline F LoadF16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F LoadBF16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline float F16Scalar(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline void Transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
inline void PackTranspose(const float* src, int64_t lds, int nr, int64_t kc, float* dst) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    for (int r = 0; r < nr; r += 8) Transpose8x8(src + r * lds + k, lds, dst + k * nr + r, nr);
  }
  for (; k < kc; ++k) {
    for (int r = 0; r < nr; ++r) dst[k * nr + r] = src[r * lds + k];
  }
}

// ---- Weight decoders: one 32-element block -> 2 chunks of 16 floats ----
struct DecF32 {
  static constexpr int64_t kBlockBytes = 128;
  using State = const float*;
  static State Load(const uint8_t* b) { return reinterpret_cast<const float*>(b); }
  static F Chunk(State s, int c) { return avx512::Load(s + 16 * c); }
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
  static F Chunk(State s, int c) { return LoadF16(s + 16 * c); }
  static float Elem(const uint8_t* row, int64_t k) { return F16Scalar(row + 2 * k); }
};
struct DecBF16 {
  static constexpr int64_t kBlockBytes = 64;
  using State = const uint16_t*;
  static State Load(const uint8_t* b) { return reinterpret_cast<const uint16_t*>(b); }
  static F Chunk(State s, int c) { return LoadBF16(s + 16 * c); }
  static float Elem(const uint8_t* row, int64_t k) {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    return BF16ToFloat(h);
  }
};
struct DecQ4_0 {
  static constexpr int64_t kBlockBytes = 18;
  struct State {
    __m512i q;  // the 16 bytes, zero-extended to 32 bits
    __m512 d, off;
  };
  static State Load(const uint8_t* b) {
    const float d = F16Scalar(b);
    return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))),
            _mm512_set1_ps(d), _mm512_set1_ps(-8.0f * d)};
  }
  static F Chunk(const State& s, int c) {
    const __m512i q =
        c == 0 ? _mm512_and_si512(s.q, _mm512_set1_epi32(15)) : _mm512_srli_epi32(s.q, 4);
    return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s.d, s.off)};
  }
};
struct DecQ4_1 {
  static constexpr int64_t kBlockBytes = 20;
  using State = DecQ4_0::State;
  static State Load(const uint8_t* b) {
    return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4))),
            _mm512_set1_ps(F16Scalar(b)), _mm512_set1_ps(F16Scalar(b + 2))};
  }
  static F Chunk(const State& s, int c) { return DecQ4_0::Chunk(s, c); }
};
struct DecQ8_0 {
  static constexpr int64_t kBlockBytes = 34;
  struct State {
    const uint8_t* qs;
    __m512 d;
  };
  static State Load(const uint8_t* b) { return {b + 2, _mm512_set1_ps(F16Scalar(b))}; }
  static F Chunk(const State& s, int c) {
    const __m512i q =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.qs + 16 * c)));
    return {_mm512_mul_ps(_mm512_cvtepi32_ps(q), s.d)};
  }
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

struct DecMXFP4 {
  static constexpr int64_t kBlockBytes = 17;
  struct State {
    __m128i lo, hi;
    __m512 d;
  };
  static State Load(const uint8_t* b) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1));
    const __m128i m = _mm_set1_epi8(15);
    const float d = kE8M0Half[b[0]];
    return {_mm_shuffle_epi8(table, _mm_and_si128(v, m)),
            _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m)), _mm512_set1_ps(d)};
  }
  static F Chunk(const State& s, int c) {
    return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c == 0 ? s.lo : s.hi)), s.d)};
  }
};

}  // namespace kiln::cpu::avx512
