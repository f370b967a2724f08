// The CPU kernels, written once over a vector layer and compiled per instruction set.
//
// A kernels_<isa>.cc file includes its vector layer (simd_<isa>.h, namespace
// kiln::cpu::<isa>) and then this header inside the same namespace, so every function here
// exists once per variant and never crosses variants (no ODR mixing of target flags).
// The vector layer provides: kLanes, kGemmMR, F with Zero/Set1/Load/Store/Add/Mul/Fma/Max/
// HSum/HSum8/Exp/LoadF16/LoadBF16, PackTranspose, and the weight decoders Dec*.
//
// Numerics: f32 activations are never quantized; weights are decoded to their exact f32
// values in registers and accumulated with f32 FMAs (so results match the f64 reference
// kernels to f32 rounding, well inside the op harness's f32 tolerance).
//
// No include guard on purpose: included once per kernels_<isa>.cc.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#include "backends/cpu/kernels/kernels.h"
#include "engine/backend/kernel_abi.h"

namespace kiln::cpu::KILN_ISA_NS {
namespace {

// ---- Thread-local scratch ----------------------------------------------------------------
enum ScratchSlot {
  kSlotPanel,
  kSlotRows,
  kSlotRow,
  kSlotKeys,
  kSlotValues,
  kSlotScores,
  kSlotAcc,
  kNumSlots
};

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};

// A per-thread buffer of at least `n` floats (64-byte aligned); grows, never shrinks.
float* Scratch(ScratchSlot slot, int64_t n) {
  thread_local std::unique_ptr<float, AlignedFree> bufs[kNumSlots];
  thread_local int64_t sizes[kNumSlots] = {};
  if (sizes[slot] < n) {
    const int64_t want = std::max<int64_t>(n, 2 * sizes[slot]);
    const size_t bytes = (static_cast<size_t>(want) * sizeof(float) + 63) / 64 * 64;
    bufs[slot].reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    KILN_CHECK(bufs[slot] != nullptr, "cpu kernels: out of memory for scratch");
    sizes[slot] = want;
  }
  return bufs[slot].get();
}

// Calls fn(Dec{}) with the register decoder for `t`; false if `t` has none.
template <class Fn>
bool WithDecoder(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32:
      fn(DecF32{});
      return true;
    case DType::kF16:
      fn(DecF16{});
      return true;
    case DType::kBF16:
      fn(DecBF16{});
      return true;
    case DType::kQ4_0:
      fn(DecQ4_0{});
      return true;
    case DType::kQ4_1:
      fn(DecQ4_1{});
      return true;
    case DType::kQ8_0:
      fn(DecQ8_0{});
      return true;
    case DType::kMXFP4:
      fn(DecMXFP4{});
      return true;
    default:
      return false;
  }
}

template <class D>
concept HasElem = requires(const uint8_t* p) {
  D::Elem(p, 0);
};

constexpr int kChunks = 32 / kLanes;  // vector chunks per 32-element block

const uint8_t* WeightRow(const GemmArgs& a, int64_t n) {
  return static_cast<const uint8_t*>(a.w) + n * a.w_row_bytes;
}

// dst[0, kc) = W[n, k0 : k0 + kc) as f32. k0 is a multiple of the weight's block size.
void DecodeRow(const GemmArgs& a, int64_t n, int64_t k0, int64_t kc, float* dst) {
  if (a.w_k_stride != 1) {  // strided f32 view (MatMul's right operand)
    const float* w = static_cast<const float*>(a.w) + n * (a.w_row_bytes / 4);
    for (int64_t k = 0; k < kc; ++k) dst[k] = w[(k0 + k) * a.w_k_stride];
    return;
  }
  const uint8_t* row = WeightRow(a, n);
  const bool fast = WithDecoder(a.wtype, [&](auto dec) {
    using D = decltype(dec);
    const int64_t nb = kc / 32;
    const uint8_t* b0 = row + (k0 / 32) * D::kBlockBytes;
    for (int64_t b = 0; b < nb; ++b) {
      const auto st = D::Load(b0 + b * D::kBlockBytes);
      for (int c = 0; c < kChunks; ++c) Store(dst + b * 32 + c * kLanes, D::Chunk(st, c));
    }
    if constexpr (HasElem<D>) {
      for (int64_t k = nb * 32; k < kc; ++k) dst[k] = D::Elem(row, k0 + k);
    }
  });
  if (!fast) {
    // K-quants: the engine's scalar dequantizer (k0 and kc are multiples of 256 here). It
    // fails only for types GetKernel never routes here, and a kernel has no way to report.
    (void)DequantizeRow(a.wtype, row + ByteOffset(a.wtype, k0), dst, kc);
  }
}

// ---- GEMV: weights decoded in registers ------------------------------------------------------

// y[i, j] = x[i, :] . W[j, :] for i < MR, j < NR.
template <class D, int MR, int NR>
void GemvTile(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t K, float* y,
              int64_t ldy) {
  // With few tiles in flight, two accumulators per tile (even and odd chunks) halve the FMA
  // dependency chain through a block.
  constexpr int kAcc = (MR * NR <= 4 && kChunks % 2 == 0) ? 2 : 1;
  F acc[MR][NR][kAcc];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      for (int u = 0; u < kAcc; ++u) acc[i][j][u] = Zero();
    }
  }
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    PrefetchAhead(w, ldw, NR, b * D::kBlockBytes, D::kBlockBytes);
    for (int j = 0; j < NR; ++j) {
      const auto st = D::Load(w + j * ldw + b * D::kBlockBytes);
      for (int c = 0; c < kChunks; ++c) {
        const F wv = D::Chunk(st, c);
        for (int i = 0; i < MR; ++i) {
          F& a = acc[i][j][c % kAcc];
          a = Fma(wv, Load(xb + i * ldx + c * kLanes), a);
        }
      }
    }
  }
  // The tail past the last whole block (float weights): explicit FMAs, so that every tile
  // sums it the same way whatever the compiler contracts.
  float tail[MR][NR] = {};
  if constexpr (HasElem<D>) {
    for (int64_t k = nb * 32; k < K; ++k) {
      for (int j = 0; j < NR; ++j) {
        const float wk = D::Elem(w + j * ldw, k);
        for (int i = 0; i < MR; ++i) tail[i][j] = std::fma(x[i * ldx + k], wk, tail[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      F sum = acc[i][j][0];
      for (int u = 1; u < kAcc; ++u) sum = Add(sum, acc[i][j][u]);
      y[i * ldy + j] = HSum(sum) + tail[i][j];
    }
  }
}

template <class D>
concept HasSplit = D::kSplit;

// GemvTile for quantized weights at small MR: sum raw quanta * x per block, then scale once
// per block (acc += d * sum) and add the block offset times the block's sum of x
// (`xsum[i * ldxs + b]`) — fewer operations per element than decoding every weight.
template <class D, int MR, int NR>
void GemvTileSplit(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* w,
                   int64_t ldw, int64_t K, float* y, int64_t ldy) {
  F acc[MR][NR];
  float off[MR][NR] = {};
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = Zero();
  }
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    PrefetchAhead(w, ldw, NR, b * D::kBlockBytes, D::kBlockBytes);
    for (int j = 0; j < NR; ++j) {
      const auto st = D::Load(w + j * ldw + b * D::kBlockBytes);
      F t[MR][2];
      for (int c = 0; c < kChunks; ++c) {
        const F q = D::Raw(st, c);
        for (int i = 0; i < MR; ++i) {
          const F xv = Load(xb + i * ldx + c * kLanes);
          t[i][c & 1] = c < 2 ? Mul(q, xv) : Fma(q, xv, t[i][c & 1]);
        }
      }
      const F d = D::Scale(st);
      const float o = D::Offset(st);
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = Fma(kChunks > 1 ? Add(t[i][0], t[i][1]) : t[i][0], d, acc[i][j]);
        off[i][j] += o * xsum[i * ldxs + b];
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = HSum(acc[i][j]) + off[i][j];
  }
}

// Rows of x in groups of up to 4 against one strip of `nr` (<= 4) weight rows. `xsum`: the
// block sums of x's last row, for a last group of one row (HasSplit weights).
template <class D>
void GemvStrip(const GemmArgs& a, int64_t n, int nr, const float* xsum) {
  const uint8_t* w = WeightRow(a, n);
  const int64_t ldw = a.w_row_bytes, nb = a.K / 32;
  for (int64_t m = 0; m < a.M; m += 4) {
    const int mr = static_cast<int>(std::min<int64_t>(4, a.M - m));
    const float* x = a.x + m * a.ldx;
    float* y = a.y + m * a.ldy + n;
    auto tile = [&]<int MR>() {
      if constexpr (MR == 1 && HasSplit<D>) {  // measured: a win for one row only
        const float* xs = xsum;                // this row is x's last (Gemv)
        if (nr == 4) return GemvTileSplit<D, MR, 4>(x, a.ldx, xs, nb, w, ldw, a.K, y, a.ldy);
        for (int j = 0; j < nr; ++j) {
          GemvTileSplit<D, MR, 1>(x, a.ldx, xs, nb, w + j * ldw, ldw, a.K, y + j, a.ldy);
        }
        return;
      } else if constexpr (MR <= 2) {  // MR x 4 accumulators
        if (nr == 4) return GemvTile<D, MR, 4>(x, a.ldx, w, ldw, a.K, y, a.ldy);
      } else {  // MR x 2
        if (nr == 4) {
          GemvTile<D, MR, 2>(x, a.ldx, w, ldw, a.K, y, a.ldy);
          return GemvTile<D, MR, 2>(x, a.ldx, w + 2 * ldw, ldw, a.K, y + 2, a.ldy);
        }
      }
      for (int j = 0; j < nr; ++j)
        GemvTile<D, MR, 1>(x, a.ldx, w + j * ldw, ldw, a.K, y + j, a.ldy);
    };
    switch (mr) {
      case 1:
        tile.template operator()<1>();
        break;
      case 2:
        tile.template operator()<2>();
        break;
      case 3:
        tile.template operator()<3>();
        break;
      default:
        tile.template operator()<4>();
        break;
    }
  }
}

// Generic weights (K-quants): each row dequantized once into scratch, then f32 dots.
void GemvGeneric(const GemmArgs& a, int64_t n0, int64_t n1) {
  float* row = Scratch(kSlotRow, a.K);
  for (int64_t n = n0; n < n1; ++n) {
    DecodeRow(a, n, 0, a.K, row);
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * a.ldx;
      F acc = Zero();
      int64_t k = 0;
      for (; k + kLanes <= a.K; k += kLanes) acc = Fma(Load(row + k), Load(x + k), acc);
      float s = HSum(acc);
      for (; k < a.K; ++k) s += row[k] * x[k];
      a.y[m * a.ldy + n] = s;
    }
  }
}

// Rows of x per tile against a decoded strip: MR x 4 accumulators, MR rows of x and one
// weight chunk in registers (AVX-512's 32: 24 + 6 + 1; AVX2's 16: 12 + 3 + 1).
constexpr int kDecodedMR = kLanes == 16 ? 6 : 3;

// y[i, j] = x[i, :] . w[j, :] for i < MR, j < 4, with the strip's four weight rows in f32
// (`w`, rows `ldw` floats apart). Per output this is GemvTile's arithmetic with one accumulator
// (MR x 4 > 4 for MR >= 2): the same FMAs in the same order, and the tail past the last whole
// block summed apart, so the result is bit-identical to decoding the weights in registers.
template <int MR>
void DecodedTile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y,
                 int64_t ldy) {
  static_assert(MR >= 2, "one row of x keeps GemvTile's two accumulators");
  constexpr int NR = 4;
  F acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = Zero();
  }
  const int64_t kv = K / 32 * 32;
  for (int64_t k = 0; k < kv; k += kLanes) {
    F xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = Load(x + i * ldx + k);
    for (int j = 0; j < NR; ++j) {
      const F wv = Load(w + j * ldw + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = Fma(wv, xv[i], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float tail = 0;
      for (int64_t k = kv; k < K; ++k) {
        tail = std::fma(x[i * ldx + k], w[j * ldw + k], tail);
      }
      y[i * ldy + j] = HSum(acc[i][j]) + tail;
    }
  }
}

template <int... I>
void DecodedTileDispatch(int mr, std::integer_sequence<int, I...>, const float* x, int64_t ldx,
                         const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy) {
  ((mr == I + 2 ? (DecodedTile<I + 2>(x, ldx, w, ldw, K, y, ldy), 0) : 0), ...);
}

// A strip of four weight rows against more rows of x than one tile takes: the strip is decoded
// once into scratch (GemvStrip would decode it again for every four rows of x; f32 rows are
// read in place) and every group of rows runs against the f32 rows; a last single row keeps
// GemvStrip's tile.
template <class D>
void GemvStripDecoded(const GemmArgs& a, int64_t n, const float* xsum) {
  const float* w;
  int64_t ldw;
  if constexpr (std::is_same_v<D, DecF32>) {
    w = reinterpret_cast<const float*>(WeightRow(a, n));
    ldw = a.w_row_bytes / 4;
  } else {
    float* rows = Scratch(kSlotRows, 4 * a.K);
    for (int r = 0; r < 4; ++r) DecodeRow(a, n + r, 0, a.K, rows + r * a.K);
    w = rows;
    ldw = a.K;
  }
  int64_t m = 0;
  for (; m + kDecodedMR <= a.M; m += kDecodedMR) {
    DecodedTile<kDecodedMR>(a.x + m * a.ldx, a.ldx, w, ldw, a.K, a.y + m * a.ldy + n, a.ldy);
  }
  const int rest = static_cast<int>(a.M - m);
  if (rest >= 2) {
    DecodedTileDispatch(rest, std::make_integer_sequence<int, kDecodedMR - 2>{}, a.x + m * a.ldx,
                        a.ldx, w, ldw, a.K, a.y + m * a.ldy + n, a.ldy);
  } else if (rest == 1) {
    GemmArgs one = a;
    one.x = a.x + m * a.ldx;
    one.y = a.y + m * a.ldy;
    one.M = 1;
    GemvStrip<D>(one, n, 4, xsum);
  }
}

void Gemv(const GemmArgs& a, int64_t n0, int64_t n1) {
  const bool fast = WithDecoder(a.wtype, [&](auto dec) {
    using D = decltype(dec);
    // One group of rows of x (GemvStrip's tiles take four) decodes each strip once anyway.
    const bool decode_once = a.M > 4;
    // Per-block sums of x for the block offsets of the one-row split tile. Rows go to tiles in
    // groups from the first (of four in GemvStrip, kDecodedMR in GemvStripDecoded), so only the
    // last row can be left alone in one.
    const bool lone_last_row = a.M % 4 == 1 || (decode_once && a.M % kDecodedMR == 1);
    const float* xsum = nullptr;
    if constexpr (HasSplit<D>) {
      if (lone_last_row) {
        const int64_t nb = a.K / 32;
        float* s = Scratch(kSlotRow, std::max<int64_t>(nb, 1));
        const float* x = a.x + (a.M - 1) * a.ldx;
        for (int64_t b = 0; b < nb; ++b) {
          F v = Zero();
          for (int c = 0; c < kChunks; ++c) v = Add(v, Load(x + b * 32 + c * kLanes));
          s[b] = HSum(v);
        }
        xsum = s;
      }
    }
    for (int64_t n = n0; n < n1; n += 4) {
      const int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
      if (decode_once && nr == 4) {
        GemvStripDecoded<D>(a, n, xsum);
      } else {
        GemvStrip<D>(a, n, nr, xsum);
      }
    }
  });
  if (!fast) GemvGeneric(a, n0, n1);
}

// ---- GEMM: packed f32 panels and an outer-product micro-kernel -----------------------------

constexpr int kNR = 2 * kLanes;   // micro-kernel columns (weight rows)
constexpr int64_t kKC = 256;      // K block (a multiple of every block size, 256)
constexpr int64_t kNC = 8 * kNR;  // weight rows per packed panel

// y[i, 0:ncols] (+)= sum_k x[i, k] * panel[k, 0:ncols] for i < MR.
template <int MR>
void Micro(const float* x, int64_t ldx, const float* p, int64_t kc, float* y, int64_t ldy,
           bool accumulate, int ncols) {
  F c0[MR], c1[MR];
  // Unrolled, so that the accumulators are registers from the start (a loop here compiled to
  // two `rep stos` over a stack copy of them: ~2% of the kernel's time).
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = Zero();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const F b0 = Load(p + k * kNR), b1 = Load(p + k * kNR + kLanes);
    for (int i = 0; i < MR; ++i) {
      const F av = Set1(x[i * ldx + k]);
      c0[i] = Fma(av, b0, c0[i]);
      c1[i] = Fma(av, b1, c1[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* yi = y + i * ldy;
    if (ncols == kNR) {
      if (accumulate) {
        c0[i] = Add(c0[i], Load(yi));
        c1[i] = Add(c1[i], Load(yi + kLanes));
      }
      Store(yi, c0[i]);
      Store(yi + kLanes, c1[i]);
    } else {
      float t[kNR];
      Store(t, c0[i]);
      Store(t + kLanes, c1[i]);
      for (int j = 0; j < ncols; ++j) yi[j] = accumulate ? yi[j] + t[j] : t[j];
    }
  }
}

template <int... I>
void MicroDispatch(int mr, std::integer_sequence<int, I...>, const float* x, int64_t ldx,
                   const float* p, int64_t kc, float* y, int64_t ldy, bool accumulate, int ncols) {
  ((mr == I + 1 ? (Micro<I + 1>(x, ldx, p, kc, y, ldy, accumulate, ncols), 0) : 0), ...);
}

void Gemm(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if (m0 >= m1 || n0 >= n1) return;
  float* panel = Scratch(kSlotPanel, kNC * kKC);
  float* rows = Scratch(kSlotRows, kNR * kKC);
  for (int64_t nb = n0; nb < n1; nb += kNC) {
    const int64_t nc = std::min(kNC, n1 - nb);
    const int nsub = static_cast<int>((nc + kNR - 1) / kNR);
    for (int64_t k0 = 0; k0 < a.K; k0 += kKC) {
      const int64_t kc = std::min(kKC, a.K - k0);
      for (int s = 0; s < nsub; ++s) {
        const int64_t r0 = nb + s * kNR;
        const int nr = static_cast<int>(std::min<int64_t>(kNR, nb + nc - r0));
        float* dst = panel + s * kKC * kNR;
        if (a.w_k_stride != 1 && a.w_row_bytes == 4) {
          // MatMul's [K, N] operand: panel rows are contiguous runs of N.
          const float* w = static_cast<const float*>(a.w);
          for (int64_t k = 0; k < kc; ++k) {
            const float* src = w + (k0 + k) * a.w_k_stride + r0;
            float* d = dst + k * kNR;
            for (int r = 0; r < nr; ++r) d[r] = src[r];
            for (int r = nr; r < kNR; ++r) d[r] = 0;
          }
          continue;
        }
        for (int r = 0; r < nr; ++r) DecodeRow(a, r0 + r, k0, kc, rows + r * kKC);
        for (int r = nr; r < kNR; ++r) std::fill(rows + r * kKC, rows + r * kKC + kc, 0.0f);
        PackTranspose(rows, kKC, kNR, kc, dst);
      }
      for (int64_t m = m0; m < m1; m += kGemmMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kGemmMR, m1 - m));
        for (int s = 0; s < nsub; ++s) {
          const int64_t c0 = nb + s * kNR;
          MicroDispatch(mr, std::make_integer_sequence<int, kGemmMR>{}, a.x + m * a.ldx + k0, a.ldx,
                        panel + s * kKC * kNR, kc, a.y + m * a.ldy + c0, a.ldy, k0 > 0,
                        static_cast<int>(std::min<int64_t>(kNR, nb + nc - c0)));
        }
      }
    }
  }
}

void Dequant(const GemmArgs& a, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) DecodeRow(a, n, 0, a.K, dst + (n - n0) * a.K);
}

// ---- Paged attention ---------------------------------------------------------------------------

// s = cap * tanh(pre * s / cap) in place, Gemma's soft-capping score_mod on scores scaled by
// `pre`: cap - 2 cap / (e^(2 pre s / cap) + 1) through the ISA's exp, in one pass (e^x
// overflowing to inf gives cap; the absolute error stays within a few ulps of cap).
void SoftCap(float* s, int64_t n, float pre, float cap) {
  const float k2 = 2 * pre / cap;
  const F k2v = Set1(k2), c = Set1(cap), minus_two_c = Set1(-2 * cap), one = Set1(1);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F e = Exp(Mul(Load(s + j), k2v));
    Store(s + j, Add(c, Div(minus_two_c, Add(e, one))));
  }
  for (; j < n; ++j) s[j] = cap - 2 * cap / (std::exp(s[j] * k2) + 1);
}

constexpr int64_t kKeyTile = 64;

inline float Dot(const float* a, const float* b, int64_t n) {
  F acc = Zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = Fma(Load(a + i), Load(b + i), acc);
  float s = HSum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Rows of a K or V tile as f32: pointers into the cache (f32) or into converted scratch.
void ConvertRow(const void* src, DType t, int64_t n, float* dst) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (t == DType::kF16) {
    for (; i + kLanes <= n; i += kLanes) Store(dst + i, LoadF16(h + i));
    for (; i < n; ++i) dst[i] = F16ToFloat(h[i]);
  } else {
    for (; i + kLanes <= n; i += kLanes) Store(dst + i, LoadBF16(h + i));
    for (; i < n; ++i) dst[i] = BF16ToFloat(h[i]);
  }
}

void SmallGemm(const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb, float* c,
               int64_t ldc, int64_t m, int64_t n, int64_t k, float alpha, bool accumulate);

// The addresses of key j's K and V rows (kv head t.g) in the paged caches; false when its
// block-table entry is invalid (the key is skipped).
inline bool KvRows(const AttnArgs& a, const AttnTask& t, int64_t j, const char** kp,
                   const char** vp) {
  const int64_t blk = t.blocks[j / a.block_size];
  if (blk < 0) return false;
  const int64_t slot = j % a.block_size;
  const int64_t esize = a.kv_dtype == DType::kF32 ? 4 : 2;
  *kp = static_cast<const char*>(a.k) + esize * (blk * a.k_sb + slot * a.k_ss + t.g * a.k_sh);
  *vp = static_cast<const char*>(a.v) + esize * (blk * a.v_sb + slot * a.v_ss + t.g * a.v_sh);
  return true;
}

// The keys [lo, hi) of [j0, j1) the native mask lets the query at position `pos` see: kv <=
// pos (causal, window), pos - kv < window, kv >= pos - pos % chunk.
inline std::pair<int64_t, int64_t> KeyRangeAt(const AttnArgs& a, int64_t pos, int64_t j0,
                                              int64_t j1) {
  int64_t lo = j0, hi = j1;
  if (a.mask != MaskKind::kNone) hi = std::min(hi, pos + 1);
  if (a.mask == MaskKind::kSlidingWindow) lo = std::max(lo, pos - a.window + 1);
  if (a.chunk > 0) lo = std::max(lo, pos - pos % a.chunk);
  return {lo, hi};
}

// Online softmax: folds one row's scores s[0..n), whose maximum is m, into its running state
// ah (acc[Dv], then max and sum): s becomes exp(s - the new maximum), the max and sum move on;
// returns the factor acc must be scaled by (0 for the first scores), or -1 if every score so
// far is -inf (nothing changes). NaN propagates.
inline float FoldScores(float* s, int64_t n, float m, float* ah, int64_t Dv) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float m_old = ah[Dv];
  const float m_new = (std::isnan(m) || std::isnan(m_old)) ? NAN : std::max(m, m_old);
  if (m_new == ninf) return -1;
  const float corr = m_old == ninf ? 0.0f : std::exp(m_old - m_new);
  F sum = Zero();
  int64_t p = 0;
  for (; p + kLanes <= n; p += kLanes) {
    const F e = Exp(Add(Load(s + p), Set1(-m_new)));
    Store(s + p, e);
    sum = Add(sum, e);
  }
  float l = HSum(sum);
  for (; p < n; ++p) {
    s[p] = std::exp(s[p] - m_new);
    l += s[p];
  }
  ah[Dv + 1] = ah[Dv + 1] * corr + l;
  ah[Dv] = m_new;
  return corr;
}

// Writes a finished row's output from its state ah (zeros when no key was visible).
inline void FinishAttnRow(const float* ah, int64_t Dv, float* out) {
  const float l = ah[Dv + 1];
  if (ah[Dv] == -std::numeric_limits<float>::infinity() || l == 0) {
    std::fill(out, out + Dv, 0.0f);
    return;
  }
  const float inv = 1.0f / l;
  for (int64_t e = 0; e < Dv; ++e) out[e] = ah[e] * inv;
}

// Query rows per block of AttendRows, and the fewest rows a task needs to take that path.
constexpr int64_t kRowTile = 32;
constexpr int64_t kMinTileRows = 4;

// Attend for a task of several query rows (prefill), blocks of kRowTile rows at a time: per
// tile of keys, K (transposed) and V are gathered once for the block's rows and the group's
// query heads, the scores and P V are small GEMMs, and each row then takes Attend's steps —
// modifiers, its own key range as -inf, the online softmax.
void AttendRows(const AttnArgs& a, const AttnTask& t) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, Dv = a.Dv;
  const bool convert = a.kv_dtype != DType::kF32;
  float* kt = Scratch(kSlotKeys, kKeyTile * std::max<int64_t>(D, 1));     // kt[e * kKeyTile + i]
  float* vt = Scratch(kSlotValues, kKeyTile * std::max<int64_t>(Dv, 1));  // V rows, contiguous
  float* krow = Scratch(kSlotRow, std::max<int64_t>(D, 1));               // a converted K row
  float* scores = Scratch(kSlotScores, kRowTile * kKeyTile);
  const int64_t acc_ld = G * (Dv + 2);
  float* acc = Scratch(kSlotAcc, kRowTile * acc_ld);  // per (row, head): acc[Dv], max, sum
  int64_t kpos[kKeyTile];
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r0 = t.t0; r0 < t.t1; r0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, t.t1 - r0);
    const int64_t first = t.pos0 + (r0 - t.t0), last = first + rows - 1;  // positions
    // The keys any row of the block sees (both bounds grow with the position).
    const int64_t lo = KeyRangeAt(a, first, t.j0, t.j1).first;
    const int64_t hi = KeyRangeAt(a, last, t.j0, t.j1).second;
    for (int64_t i = 0; i < rows * G; ++i) {
      float* ah = acc + i * (Dv + 2);
      std::fill(ah, ah + Dv, 0.0f);
      ah[Dv] = ninf;
      ah[Dv + 1] = 0;
    }
    for (int64_t jt = lo; jt < hi; jt += kKeyTile) {
      const int64_t jend = std::min(hi, jt + kKeyTile);
      int64_t n = 0;  // keys with a valid block
      for (int64_t j = jt; j < jend; ++j) {
        const char *kp, *vp;
        if (!KvRows(a, t, j, &kp, &vp)) continue;
        const float* k = reinterpret_cast<const float*>(kp);
        if (convert) {
          ConvertRow(kp, a.kv_dtype, D, krow);
          k = krow;
          ConvertRow(vp, a.kv_dtype, Dv, vt + n * Dv);
        } else {
          std::copy_n(reinterpret_cast<const float*>(vp), Dv, vt + n * Dv);
        }
        for (int64_t e = 0; e < D; ++e) kt[e * kKeyTile + n] = k[e];
        kpos[n] = j;
        ++n;
      }
      if (n == 0) continue;
      // A value that is not finite (an overflowed f16 cache) must not reach the rows that do
      // not see its key (0 x inf): then P V skips zero weights, as Attend and the reference do.
      bool finite_v;
      {
        // v * 0 is 0 for finite v, NaN for inf and NaN.
        F probe = Zero();
        const F zero = Zero();
        int64_t x = 0;
        for (; x + kLanes <= n * Dv; x += kLanes) probe = Fma(Load(vt + x), zero, probe);
        float rest = HSum(probe);
        for (; x < n * Dv; ++x) rest += vt[x] * 0.0f;
        finite_v = rest == 0.0f;
      }
      for (int64_t h = 0; h < G; ++h) {
        const int64_t head = t.g * G + h;
        SmallGemm(a.q + r0 * a.q_st + head * a.q_sh, a.q_st, 1, kt, kKeyTile, scores, kKeyTile,
                  rows, n, D, a.scale, false);
        for (int64_t i = 0; i < rows; ++i) {
          float* s = scores + i * kKeyTile;
          const int64_t pos = first + i;
          // Modifiers (compiled; or ALiBi, then soft-capping), then the row's own key range.
          if (a.mods != nullptr) {
            a.mods(a.mods_ctx, s, n, t.seq, head, pos, kpos);
          } else {
            if (a.alibi_slopes != nullptr) {
              const float slope = a.alibi_slopes[head];
              for (int64_t k = 0; k < n; ++k) s[k] += slope * static_cast<float>(kpos[k] - pos);
            }
            if (a.softcap > 0) SoftCap(s, n, 1.0f, a.softcap);
          }
          const auto [row_lo, row_hi] = KeyRangeAt(a, pos, t.j0, t.j1);
          for (int64_t k = 0; k < n; ++k) {
            if (kpos[k] >= row_hi || kpos[k] < row_lo) s[k] = ninf;
          }
          // Online softmax: rescale the row's running state to the new maximum.
          float m = ninf;
          for (int64_t k = 0; k < n; ++k) {
            m = (std::isnan(m) || std::isnan(s[k])) ? NAN : std::max(m, s[k]);
          }
          float* ah = acc + (i * G + h) * (Dv + 2);
          const float corr = FoldScores(s, n, m, ah, Dv);
          if (corr < 0) {  // every score -inf: contributes nothing
            std::fill(s, s + n, 0.0f);
            continue;
          }
          if (corr != 1.0f) {
            for (int64_t e = 0; e < Dv; ++e) ah[e] *= corr;
          }
        }
        // acc += P V for the block's rows of head h.
        if (finite_v) {
          SmallGemm(scores, kKeyTile, 1, vt, Dv, acc + h * (Dv + 2), acc_ld, rows, Dv, n, 1.0f,
                    true);
          continue;
        }
        for (int64_t i = 0; i < rows; ++i) {
          const float* s = scores + i * kKeyTile;
          float* ah = acc + (i * G + h) * (Dv + 2);
          for (int64_t k = 0; k < n; ++k) {
            if (s[k] == 0.0f) continue;
            for (int64_t e = 0; e < Dv; ++e) ah[e] += s[k] * vt[k * Dv + e];
          }
        }
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t h = 0; h < G; ++h) {
        FinishAttnRow(acc + (i * G + h) * (Dv + 2), Dv,
                      a.out + (r0 + i) * a.o_st + (t.g * G + h) * a.o_sh);
      }
    }
  }
}

void Attend(const AttnArgs& a, const AttnTask& t) {
  if (t.partial == nullptr && t.t1 - t.t0 >= kMinTileRows) {
    AttendRows(a, t);
    return;
  }
  const int64_t G = a.Hq / a.Hkv, D = a.D, Dv = a.Dv;
  const bool convert = a.kv_dtype != DType::kF32;
  float* kbuf = convert ? Scratch(kSlotKeys, kKeyTile * D) : nullptr;
  float* vbuf = convert ? Scratch(kSlotValues, kKeyTile * Dv) : nullptr;
  float* scores = Scratch(kSlotScores, G * kKeyTile);
  float* acc = Scratch(kSlotAcc, G * (Dv + 2));  // per head: acc[Dv], then max, sum
  const float* krow[kKeyTile];
  const float* vrow[kKeyTile];
  int64_t kpos[kKeyTile];  // the position of each visible key (ALiBi)
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = t.t0; r < t.t1; ++r) {
    const int64_t pos = t.pos0 + (r - t.t0);
    const auto [lo, hi] = KeyRangeAt(a, pos, t.j0, t.j1);
    for (int64_t h = 0; h < G; ++h) {
      float* ah = acc + h * (Dv + 2);
      std::fill(ah, ah + Dv, 0.0f);
      ah[Dv] = ninf;
      ah[Dv + 1] = 0;
    }
    for (int64_t jt = lo; jt < hi; jt += kKeyTile) {
      const int64_t jend = std::min(hi, jt + kKeyTile);
      int n = 0;  // visible keys with a valid block
      for (int64_t j = jt; j < jend; ++j) {
        const char *kp, *vp;
        if (!KvRows(a, t, j, &kp, &vp)) continue;
        if (convert) {
          ConvertRow(kp, a.kv_dtype, D, kbuf + n * D);
          ConvertRow(vp, a.kv_dtype, Dv, vbuf + n * Dv);
          krow[n] = kbuf + n * D;
          vrow[n] = vbuf + n * Dv;
        } else {
          krow[n] = reinterpret_cast<const float*>(kp);
          vrow[n] = reinterpret_cast<const float*>(vp);
        }
        kpos[n] = j;
        ++n;
      }
      if (n == 0) continue;
      for (int64_t h = 0; h < G; ++h) {
        const float* q = a.q + r * a.q_st + (t.g * G + h) * a.q_sh;
        float* s = scores + h * kKeyTile;
        int i = 0;
        for (; i + 8 <= n; i += 8) {  // 8 keys at once, one transposing reduction
          F dacc[8];
          for (F& d : dacc) d = Zero();
          int64_t e = 0;
          for (; e + kLanes <= D; e += kLanes) {
            const F qv = Load(q + e);
            for (int u = 0; u < 8; ++u) dacc[u] = Fma(qv, Load(krow[i + u] + e), dacc[u]);
          }
          HSum8(dacc, s + i);
          for (; e < D; ++e) {
            for (int u = 0; u < 8; ++u) s[i + u] += q[e] * krow[i + u][e];
          }
        }
        for (; i < n; ++i) s[i] = Dot(q, krow[i], D);
        // Compiled modifiers; or ALiBi, then soft-capping, each scaling the scores as it
        // modifies them.
        float mul = a.scale;
        if (a.mods != nullptr) {
          for (int i = 0; i < n; ++i) s[i] *= mul;
          mul = 1;
          a.mods(a.mods_ctx, s, n, t.seq, t.g * G + h, pos, kpos);
        }
        if (a.alibi_slopes != nullptr) {
          const float slope = a.alibi_slopes[t.g * G + h];
          for (int i = 0; i < n; ++i) s[i] = s[i] * mul + slope * static_cast<float>(kpos[i] - pos);
          mul = 1;
        }
        if (a.softcap > 0) {
          SoftCap(s, n, mul, a.softcap);
          mul = 1;
        }
        // Online softmax: rescale the running state to the new maximum.
        F mv = Set1(ninf);
        int64_t i8 = 0;
        for (; i8 + kLanes <= n; i8 += kLanes) {
          const F sv = Mul(Load(s + i8), Set1(mul));
          Store(s + i8, sv);
          mv = Max(mv, sv);
        }
        float m = ninf;
        {
          float lanes[kLanes];
          Store(lanes, mv);
          for (float v : lanes) m = (std::isnan(m) || std::isnan(v)) ? NAN : std::max(m, v);
        }
        for (; i8 < n; ++i8) {
          s[i8] *= mul;
          m = (std::isnan(m) || std::isnan(s[i8])) ? NAN : std::max(m, s[i8]);
        }
        float* ah = acc + h * (Dv + 2);
        const float corr = FoldScores(s, n, m, ah, Dv);
        if (corr < 0) continue;  // every score -inf: contributes nothing
        // acc = acc * corr + sum_i p_i v_i, up to 8 vectors of Dv at a time in registers.
        int64_t e = 0;
        for (; e + kLanes <= Dv; e += 8 * kLanes) {
          const int nv = static_cast<int>(std::min<int64_t>(8, (Dv - e) / kLanes));
          F o[8];
          const F cv = Set1(corr);
          for (int u = 0; u < nv; ++u) o[u] = Mul(Load(ah + e + u * kLanes), cv);
          for (int k = 0; k < n; ++k) {
            const F pk = Set1(s[k]);
            for (int u = 0; u < nv; ++u) o[u] = Fma(pk, Load(vrow[k] + e + u * kLanes), o[u]);
          }
          for (int u = 0; u < nv; ++u) Store(ah + e + u * kLanes, o[u]);
          if (nv < 8) {
            e += nv * kLanes;
            break;
          }
        }
        for (; e < Dv; ++e) {
          float o = ah[e] * corr;
          for (int k = 0; k < n; ++k) o += s[k] * vrow[k][e];
          ah[e] = o;
        }
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      const float* ah = acc + h * (Dv + 2);
      if (t.partial != nullptr) {
        float* dst = t.partial + ((r - t.t0) * G + h) * AttnPartialFloats(Dv);
        std::copy(ah + Dv, ah + Dv + 2, dst);
        std::copy(ah, ah + Dv, dst + 2);
        continue;
      }
      FinishAttnRow(ah, Dv, a.out + r * a.o_st + (t.g * G + h) * a.o_sh);
    }
  }
}

// ---- Softmax rows (the fused cross-entropy) ------------------------------------------------

// Elements per float partial sum of SoftmaxStats before it is added in double.
constexpr int64_t kStatsChunk = 1024;

// The maximum of a row (NaN if any element is NaN; -inf for n = 0).
float RowMax(const float* x, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  F mv = Set1(ninf);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) mv = Max(Load(x + j), mv);  // NaN in x propagates
  float lanes[kLanes];
  Store(lanes, mv);
  float m = ninf;
  for (float v : lanes) m = (std::isnan(m) || std::isnan(v)) ? NAN : std::max(m, v);
  for (; j < n; ++j) m = (std::isnan(m) || std::isnan(x[j])) ? NAN : std::max(m, x[j]);
  return m;
}

// sum(exp(x - m)) as softmax_stats sums it; given a non-const row, also x[j] = exp(x[j] - m).
template <class T>
double SumExp(T* x, int64_t n, float m) {
  constexpr bool kStore = !std::is_const_v<T>;
  const F neg_m = Set1(-m);
  double total = 0;
  for (int64_t c = 0; c < n; c += kStatsChunk) {
    const int64_t e = std::min(n, c + kStatsChunk);
    F acc = Zero();
    int64_t k = c;
    for (; k + kLanes <= e; k += kLanes) {
      const F v = Exp(Add(Load(x + k), neg_m));
      if constexpr (kStore) Store(x + k, v);
      acc = Add(acc, v);
    }
    float part = HSum(acc);
    for (; k < e; ++k) {
      const float v = std::exp(x[k] - m);
      if constexpr (kStore) x[k] = v;
      part += v;
    }
    total += part;
  }
  return total;
}

void SoftmaxStats(const float* x, int64_t n, float* max_out, double* sum_out) {
  const float m = RowMax(x, n);
  *max_out = m;
  *sum_out = SumExp(x, n, m);
}

void Softmax(float* x, int64_t n, float* max_out, double* sum_out) {
  const float m = RowMax(x, n);
  *max_out = m;
  if (m == -std::numeric_limits<float>::infinity()) {
    std::fill(x, x + n, 0.0f);
    *sum_out = 0;
    return;
  }
  const double sum = SumExp(x, n, m);
  *sum_out = sum;
  const float scale = static_cast<float>(1.0 / sum);
  const F c = Set1(scale);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(x + j, Mul(Load(x + j), c));
  for (; j < n; ++j) x[j] *= scale;
}

void ScaledExp(const float* x, int64_t n, float shift, float scale, float* y) {
  const F neg = Set1(-shift), c = Set1(scale);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(y + j, Mul(Exp(Add(Load(x + j), neg)), c));
  for (; j < n; ++j) y[j] = std::exp(x[j] - shift) * scale;
}

// ---- Small products (training attention) ---------------------------------------------------

// Vectors of columns per register block: 4 x kSmallNV accumulators fit the register file
// (AVX-512: 16 of 32 zmm; AVX2 and the portable layer: 8).
constexpr int kSmallNV = kLanes >= 16 ? 4 : 2;

// Rows [0, MR) x columns [j, j + NV * kLanes) of SmallGemm.
template <int MR, int NV>
void SmallBlock(const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb, float* c,
                int64_t ldc, int64_t j, int64_t k, float alpha, bool accumulate) {
  F s[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int u = 0; u < NV; ++u) s[r][u] = Zero();
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* brow = b + kk * ldb + j;
    F bv[NV];
    for (int u = 0; u < NV; ++u) bv[u] = Load(brow + u * kLanes);
    for (int r = 0; r < MR; ++r) {
      const F av = Set1(a[r * a_rs + kk * a_cs]);
      for (int u = 0; u < NV; ++u) s[r][u] = Fma(av, bv[u], s[r][u]);
    }
  }
  const F al = Set1(alpha);
  for (int r = 0; r < MR; ++r) {
    float* crow = c + r * ldc + j;
    for (int u = 0; u < NV; ++u) {
      const F v = Mul(s[r][u], al);
      Store(crow + u * kLanes, accumulate ? Add(Load(crow + u * kLanes), v) : v);
    }
  }
}

template <int MR>
void SmallRows(const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb, float* c,
               int64_t ldc, int64_t n, int64_t k, float alpha, bool accumulate) {
  int64_t j = 0;
  for (; j + kSmallNV * kLanes <= n; j += kSmallNV * kLanes) {
    SmallBlock<MR, kSmallNV>(a, a_rs, a_cs, b, ldb, c, ldc, j, k, alpha, accumulate);
  }
  for (; j + kLanes <= n; j += kLanes) {
    SmallBlock<MR, 1>(a, a_rs, a_cs, b, ldb, c, ldc, j, k, alpha, accumulate);
  }
  for (; j < n; ++j) {
    for (int r = 0; r < MR; ++r) {
      float acc = 0;
      for (int64_t kk = 0; kk < k; ++kk) acc += a[r * a_rs + kk * a_cs] * b[kk * ldb + j];
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + alpha * acc : alpha * acc;
    }
  }
}

void SmallGemm(const float* a, int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb, float* c,
               int64_t ldc, int64_t m, int64_t n, int64_t k, float alpha, bool accumulate) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) {
    SmallRows<4>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, n, k, alpha, accumulate);
  }
  for (; r < m; ++r) {
    SmallRows<1>(a + r * a_rs, a_rs, a_cs, b, ldb, c + r * ldc, ldc, n, k, alpha, accumulate);
  }
}

}  // namespace

const IsaKernels kTable = {kIsa,         Gemv,    Gemm,      Dequant,   Attend,
                           SoftmaxStats, Softmax, ScaledExp, SmallGemm, SoftCap};

}  // namespace kiln::cpu::KILN_ISA_NS

// The q8 kernels, in variants whose vector layer has their primitives.
#if KILN_ISA_HAS_Q8
#include "backends/cpu/kernels/q8_impl.h"
#endif
