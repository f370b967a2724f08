// The kernels on bf16 activations for bf16 weights (kernels.h Bf16Kernels), with AVX-512 BF16:
// each dot product runs along K in the lanes of a 512-bit register, 32 multiply-adds per
// vdpbf16ps (two bf16 pairs per f32 lane). CMake compiles this file with -mavx512bf16; nothing
// here may run unless Bf16KernelsFor() chose it (CpuHasAvx512Bf16()).
//
// One arithmetic for every (row of x, weight row) pair, whatever M, the tile or the thread:
// lane l accumulates elements [32c + 2l, 32c + 2l + 2) of every 32-element chunk c in order
// (vdpbf16ps: the odd element's product, then the even one's, each added with one rounding;
// bf16 products are exact in f32), and the 16 lanes are then summed by Reduce16's fixed tree.
// A tile holds 4 rows of x by 4 weight rows, 16 accumulators; a smaller tile pads with zero
// accumulators and reduces them with the same tree, so its results are the same bits.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <utility>

#include "backends/cpu/kernels/kernels.h"

#if !defined(__AVX512BF16__)
#error "kernels_bf16.cc needs -mavx512bf16"
#endif

namespace kiln::cpu {
namespace avx512bf16 {
namespace {

constexpr int kMR = 4;           // rows of x per tile
constexpr int kNR = 4;           // weight rows per tile (a strip, as the GEMVs read them)
constexpr int64_t kMBlock = 64;  // rows of x per pass over a share's weight strips (in L2)
constexpr int64_t kChunk = 32;   // K elements per vdpbf16ps

// Lane 4j + i of the result is the sum of the 16 lanes of v[4i + j], always in this order:
// s_l = (v_l + v_{l+8}) + (v_{l+4} + v_{l+12}) for l < 4, then (s_0 + s_2) + (s_1 + s_3). Each
// lane's sum depends on its own vector only.
__m512 Reduce16(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // quarters (a0 + a2, a1 + a3, b0 + b2, b1 + b3)
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarter q: vector 4i + q's four partial sums
    const __m512 a = t[2 * i], b = t[2 * i + 1];
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 w1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(w0), _mm512_castps_pd(w1));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(w0), _mm512_castps_pd(w1));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

void Round(const float* x, int64_t K, uint16_t* out) {
  for (int64_t k = 0; k < K; k += kChunk) {
    const int64_t r = std::min<int64_t>(kChunk, K - k);
    const __mmask16 lo = r >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << r) - 1);
    const __mmask16 hi = r >= 32  ? 0xFFFF
                         : r > 16 ? static_cast<__mmask16>((1u << (r - 16)) - 1)
                                  : 0;
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + k + 16),
                                           _mm512_maskz_loadu_ps(lo, x + k));
    _mm512_storeu_si512(out + k, reinterpret_cast<__m512i>(b));
  }
}

// y[i, j] (rows ldy apart) for i < MR, j < NR: x rows xb + i * ldxb (bf16, zero-padded to
// whole chunks), weight rows w + j * ldw (bf16, K elements).
template <int MR, int NR>
void Tile(const uint16_t* xb, int64_t ldxb, const uint8_t* w, int64_t ldw, int64_t K, bool prefetch,
          float* y, int64_t ldy) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t full = K / kChunk * kChunk;
  for (int64_t k = 0; k < full; k += kChunk) {
    if (prefetch) {  // a chunk is 4 x 64 bytes: two calls of two lines each
      PrefetchAhead(w, ldw, kNR, 2 * k, kChunk);
      PrefetchAhead(w, ldw, kNR, 2 * k + kChunk, kChunk);
    }
    __m512bh xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      xv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + i * ldxb + k));
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * ldw + 2 * k));
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i * kNR + j] = _mm512_dpbf16_ps(acc[i * kNR + j], xv[i], wv);
    }
  }
  if (full < K) {  // the last, partial chunk: weights masked (x is zero-padded)
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (K - full)) - 1);
    __m512bh xv[MR];
    for (int i = 0; i < MR; ++i)
      xv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + i * ldxb + full));
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv =
          reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, w + j * ldw + 2 * full));
      for (int i = 0; i < MR; ++i) acc[i * kNR + j] = _mm512_dpbf16_ps(acc[i * kNR + j], xv[i], wv);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, Reduce16(acc));
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = sums[4 * j + i];
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint8_t*, int64_t, int64_t, bool, float*,
                        int64_t);
template <int... I>
constexpr auto MakeTiles(std::integer_sequence<int, I...>) {
  return std::array<TileFn, sizeof...(I)>{&Tile<I / kNR + 1, I % kNR + 1>...};
}
constexpr auto kTiles = MakeTiles(std::make_integer_sequence<int, kMR * kNR>{});

void Gemm(const GemmArgs& a, const uint16_t* xb, int64_t ldxb, int64_t m0, int64_t m1, int64_t n0,
          int64_t n1) {
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  for (int64_t mb = m0; mb < m1; mb += kMBlock) {
    const int64_t me = std::min(m1, mb + kMBlock);
    for (int64_t n = n0; n < n1; n += kNR) {
      const int nr = static_cast<int>(std::min<int64_t>(kNR, n1 - n));
      for (int64_t m = mb; m < me; m += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, me - m));
        // The first tile of a strip reads it from memory (decode): prefetch ahead of it.
        kTiles[(mr - 1) * kNR + nr - 1](xb + (m - m0) * ldxb, ldxb, w + n * a.w_row_bytes,
                                        a.w_row_bytes, a.K, m == mb, a.y + m * a.ldy + n, a.ldy);
      }
    }
  }
}

constexpr Bf16Kernels kTable = {"avx512_bf16", &Round, &Gemm};

// Multiply-adds per second of `kChains` independent chains of `step`, kSteps steps each. The
// chains start from different values, so that the compiler cannot compute one and copy it.
template <class Step>
double MacRate(int macs_per_step, Step step) {
  constexpr int kChains = 12;  // past both instructions' latency x throughput on current cores
  constexpr int kSteps = 20000;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < kSteps; ++s) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = step(acc[i]);
  }
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < kChains; ++i) __asm__ volatile("" : : "v"(acc[i]));  // keep the chains
  const double sec = std::chrono::duration<double>(t1 - t0).count();
  return sec > 0 ? double{kChains} * kSteps * macs_per_step / sec : 0;
}

}  // namespace

double MeasureDotSpeedup() {
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-7f);
  __asm__ volatile("" : "+v"(a), "+v"(b));  // opaque: nothing folds at compile time
  const __m512bh ah = _mm512_cvtne2ps_pbh(a, a), bh = _mm512_cvtne2ps_pbh(b, b);
  double fma = 0, dot = 0;
  for (int round = 0; round < 3; ++round) {  // the best of three: a preempted run only loses
    fma = std::max(fma, MacRate(16, [&](__m512 c) { return _mm512_fmadd_ps(a, b, c); }));
    dot = std::max(dot, MacRate(32, [&](__m512 c) { return _mm512_dpbf16_ps(c, ah, bh); }));
  }
  return fma > 0 ? dot / fma : 0;
}

}  // namespace avx512bf16

const Bf16Kernels& Avx512Bf16Kernels() { return avx512bf16::kTable; }

}  // namespace kiln::cpu
