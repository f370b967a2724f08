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
  kSlotTileAcc,
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
    // A local copy: through the capture, every store would reload `dst` (it may alias it).
    float* const out = dst;
    for (int64_t b = 0; b < nb; ++b) {
      const auto st = D::Load(b0 + b * D::kBlockBytes);
      for (int c = 0; c < kChunks; ++c) Store(out + b * 32 + c * kLanes, D::Chunk(st, c));
    }
    if constexpr (HasElem<D>) {
      for (int64_t k = nb * 32; k < kc; ++k) out[k] = D::Elem(row, k0 + k);
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
// `pre`: cap - 2 cap / (e^x + 1), x = 2 pre s / cap, through the ISA's exp, in one pass (the
// absolute error stays within a few ulps of cap). x is clamped to [-80, 40] first (ExpClamped,
// cheaper than Exp): past 40 the result is cap in f32, below -80 it is -cap.
void SoftCap(float* s, int64_t n, float pre, float cap) {
  const float k2 = 2 * pre / cap;
  const F k2v = Set1(k2), c = Set1(cap), minus_two_c = Set1(-2 * cap), one = Set1(1);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const F e = ExpClamped(Mul(Load(s + j), k2v));
    Store(s + j, Add(c, Div(minus_two_c, Add(e, one))));
  }
  for (; j < n; ++j) s[j] = cap - 2 * cap / (std::exp(s[j] * k2) + 1);
}

constexpr int64_t kKeyTile = kAttnKeyTile;

// A f16 or bf16 cache row as f32.
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

// ---- One arithmetic for every query row ----
//
// A row's attention is defined tile by tile, over key tiles of kKeyTile positions aligned to
// multiples of kKeyTile, so that it comes out the same, bit for bit, whichever rows share its
// task and however its keys are split between tasks at tile boundaries: computed alone
// (decode, AttendOneByOne) or in a block of rows (prefill, AttendRows), a prompt prefilled in
// one step, in chunks, or after a prefix-cache hit gives the same rows. (The q8 path needs
// that: a difference of one ulp anywhere flips a rounding of its 8-bit activations, and
// greedy answers then differ.)
//
// Per tile, row and query head: the scores of the tile's slots (Dot8, scaled, the modifiers,
// -inf where the key is hidden or has no block), p = exp(s - the tile's max), the tile's state
// {max, sum p, acc = sum p V} from zero, folded in order into the row's running state
// (FoldTile). Groups of kLanes slots the row cannot see are skipped: they would add exact
// zeros. So are whole tiles a compiled mask hides (AttnArgs::mods_any): their state is empty.

// The maximum of a row (NaN if any element is NaN; -inf for n = 0).
inline float RowMax(const float* x, int64_t n) {
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

static_assert(kLanes % 8 == 0 && kKeyTile % kLanes == 0);

// The scaled scores of q against the K rows k[0..8): per key, lane-wise FMA chains over the
// head dimension and HSum8 (the same tree for every key), then the D % kLanes tail in order,
// times `scale`.
[[gnu::always_inline]] inline void Dot8(const float* q, const float* const* k, int64_t D,
                                        float scale, float* s) {
  F acc[8];
  for (F& x : acc) x = Zero();
  int64_t e = 0;
  for (; e + kLanes <= D; e += kLanes) {
    const F qv = Load(q + e);
    for (int u = 0; u < 8; ++u) acc[u] = Fma(qv, Load(k[u] + e), acc[u]);
  }
  HSum8(acc, s);
  for (; e < D; ++e) {
    for (int u = 0; u < 8; ++u) s[u] = std::fma(q[e], k[u][e], s[u]);
  }
  for (int u = 0; u < 8; ++u) s[u] *= scale;
}

// One key tile, keys [jt, jt + kKeyTile), as f32 rows: the cache's own rows (f32) or rows
// converted into scratch; `zero` for slots outside the gathered range or without a block.
struct KeyTile {
  int64_t jt = 0;
  int64_t count = 0;  // slots with a key
  const float* k[kKeyTile];
  const float* v[kKeyTile];
  int64_t pos[kKeyTile];  // jt + slot, for the compiled modifiers (set only for them)
  bool valid[kKeyTile];
};

// Gathers the keys [lo, hi) of tile `jt` into `tile`: converted K rows into kbuf, converted V
// rows into vbuf. With `copy_rows` every row is copied there, contiguous (AttendRows: the
// block's rows read the tile many times; its P V product reads vbuf as a matrix, zeros for
// empty slots); otherwise f32 rows are read in the cache.
void GatherTile(const AttnArgs& a, const AttnTask& t, int64_t jt, int64_t lo, int64_t hi,
                const float* zero, float* kbuf, float* vbuf, bool copy_rows, KeyTile* tile) {
  const bool convert = a.kv_dtype != DType::kF32;
  const int64_t esize = convert ? 2 : 4;
  tile->jt = jt;
  tile->count = 0;
  auto empty = [&](int64_t i0, int64_t i1) {  // slots without a key
    for (int64_t i = i0; i < i1; ++i) {
      tile->valid[i] = false;
      tile->k[i] = zero;
      tile->v[i] = zero;
      if (copy_rows) {
        std::fill_n(vbuf + i * a.Dv, a.Dv, 0.0f);
        tile->v[i] = vbuf + i * a.Dv;
      }
    }
  };
  // A cache row as f32: converted or copied into dst, or read where it lies.
  auto row = [&](const char* src, int64_t n, float* dst) -> const float* {
    if (convert) {
      ConvertRow(src, a.kv_dtype, n, dst);
      return dst;
    }
    if (!copy_rows) return reinterpret_cast<const float*>(src);
    std::copy_n(reinterpret_cast<const float*>(src), n, dst);
    return dst;
  };
  const int64_t begin = std::max(lo, jt), end = std::max(begin, std::min(hi, jt + kKeyTile));
  empty(0, begin - jt);
  empty(end - jt, kKeyTile);
  // Runs of keys within one block: [j, j + run).
  for (int64_t j = begin; j < end;) {
    const int64_t slot0 = j % a.block_size, run = std::min(a.block_size - slot0, end - j);
    const int64_t blk = t.blocks[j / a.block_size];
    if (blk < 0) {
      empty(j - jt, j - jt + run);
      j += run;
      continue;
    }
    const char* kp =
        static_cast<const char*>(a.k) + esize * (blk * a.k_sb + slot0 * a.k_ss + t.g * a.k_sh);
    const char* vp =
        static_cast<const char*>(a.v) + esize * (blk * a.v_sb + slot0 * a.v_ss + t.g * a.v_sh);
    for (int64_t r = 0; r < run; ++r, kp += esize * a.k_ss, vp += esize * a.v_ss) {
      const int64_t i = j + r - jt;
      tile->valid[i] = true;
      tile->k[i] = row(kp, a.D, kbuf + i * a.D);
      tile->v[i] = row(vp, a.Dv, vbuf + i * a.Dv);
    }
    tile->count += run;
    j += run;
  }
  if (a.mods != nullptr) {
    for (int64_t i = 0; i < kKeyTile; ++i) tile->pos[i] = jt + i;
  }
}

struct TileStats {
  float max, sum;  // max -inf: the row sees no key of the tile
  int64_t k0, k1;  // p is zero outside slots [k0, k1)
};

// Dot8's scores for rows of queries q[r * q_st] (r in [0, rows)) against the slots [k0, k1)
// of `tile` (multiples of 8) into s[r * kKeyTile + slot]: two rows by four keys at a time
// (eight accumulators, six loads per eight FMAs), each pair's value exactly Dot8's.
void BlockDots(const float* q, int64_t q_st, int64_t rows, const KeyTile& tile, int64_t k0,
               int64_t k1, int64_t D, float scale, float* s) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float* q0 = q + r * q_st;
    const float* q1 = q0 + q_st;
    float* s0 = s + r * kKeyTile;
    float* s1 = s0 + kKeyTile;
    for (int64_t k = k0; k < k1; k += 4) {
      const float* const* kr = tile.k + k;
      F acc[8];
      for (F& x : acc) x = Zero();
      int64_t e = 0;
      for (; e + kLanes <= D; e += kLanes) {
        const F a0 = Load(q0 + e), a1 = Load(q1 + e);
        for (int u = 0; u < 4; ++u) {
          const F kv = Load(kr[u] + e);
          acc[u] = Fma(a0, kv, acc[u]);
          acc[4 + u] = Fma(a1, kv, acc[4 + u]);
        }
      }
      float out[8];
      HSum8(acc, out);
      for (; e < D; ++e) {
        for (int u = 0; u < 4; ++u) {
          out[u] = std::fma(q0[e], kr[u][e], out[u]);
          out[4 + u] = std::fma(q1[e], kr[u][e], out[4 + u]);
        }
      }
      for (int u = 0; u < 4; ++u) {
        s0[k + u] = out[u] * scale;
        s1[k + u] = out[4 + u] * scale;
      }
    }
  }
  for (; r < rows; ++r) {
    for (int64_t k = k0; k < k1; k += 8) {
      Dot8(q + r * q_st, tile.k + k, D, scale, s + r * kKeyTile + k);
    }
  }
}

// One row's p = exp(s - max) over `tile` in s[0..kKeyTile) (query q of head `head` at position
// `pos`), zeros where the key is hidden. With `dots_done` s already holds the row's Dot8
// scores on the slot groups it sees (BlockDots).
TileStats TileRowScores(const AttnArgs& a, const AttnTask& t, const KeyTile& tile, const float* q,
                        int64_t head, int64_t pos, float* s, bool dots_done = false) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const auto [lo, hi] = KeyRangeAt(a, pos, t.j0, t.j1);
  const int64_t v0 = std::max(lo, tile.jt) - tile.jt;
  const int64_t v1 = std::min(hi, tile.jt + kKeyTile) - tile.jt;
  if (v0 >= v1) return {ninf, 0, 0, 0};
  const int64_t g0 = v0 / kLanes * kLanes, g1 = (v1 + kLanes - 1) / kLanes * kLanes;
  if (!dots_done) {
    for (int64_t g = g0; g < g1; g += 8) Dot8(q, tile.k + g, a.D, a.scale, s + g);
  }
  // Compiled modifiers over the whole tile (each slot at the same place every time); or ALiBi,
  // then soft-capping.
  if (a.mods != nullptr) {
    std::fill(s, s + g0, 0.0f);
    std::fill(s + g1, s + kKeyTile, 0.0f);
    a.mods(a.mods_ctx, s, kKeyTile, t.seq, head, pos, tile.pos);
  } else {
    if (a.alibi_slopes != nullptr) {
      const float slope = a.alibi_slopes[head];
      for (int64_t k = g0; k < g1; ++k) {
        s[k] = std::fma(slope, static_cast<float>(tile.jt + k - pos), s[k]);
      }
    }
    if (a.softcap > 0) SoftCap(s + g0, g1 - g0, 1.0f, a.softcap);
  }
  std::fill(s + g0, s + v0, ninf);
  std::fill(s + v1, s + g1, ninf);
  if (tile.count < kKeyTile) {
    for (int64_t k = v0; k < v1; ++k) {
      if (!tile.valid[k]) s[k] = ninf;
    }
  }
  const float m = RowMax(s + g0, g1 - g0);
  if (m == ninf) {
    std::fill(s, s + kKeyTile, 0.0f);
    return {ninf, 0, 0, 0};
  }
  std::fill(s, s + g0, 0.0f);
  std::fill(s + g1, s + kKeyTile, 0.0f);
  const F neg_m = Set1(-m);
  F sum = Zero();
  for (int64_t g = g0; g < g1; g += kLanes) {
    const F e = Exp(Add(Load(s + g), neg_m));
    Store(s + g, e);
    sum = Add(sum, e);
  }
  return {m, HSum(sum), g0, g1};
}

// acc[0..Dv) = sum of p[k] v[k] over the tile's slots with p[k] != 0 (the others add exact zeros;
// an inf or NaN value the row does not see must not reach it), FMA chains from zero in slot
// order: per element what SmallGemm's columns compute over all slots.
template <int NV>
[[gnu::always_inline]] inline void PvBlock(const float* p, const float* const* vrow, int64_t k0,
                                           int64_t k1, int64_t e, float* acc) {
  F o[NV];
  for (int u = 0; u < NV; ++u) o[u] = Zero();
  for (int64_t k = k0; k < k1; ++k) {
    if (p[k] == 0.0f) continue;
    const F pk = Set1(p[k]);
    const float* v = vrow[k] + e;
    for (int u = 0; u < NV; ++u) o[u] = Fma(pk, Load(v + u * kLanes), o[u]);
  }
  for (int u = 0; u < NV; ++u) Store(acc + e + u * kLanes, o[u]);
}

// `p` is zero outside slots [k0, k1).
void PvRow(const float* p, const float* const* vrow, int64_t k0, int64_t k1, int64_t Dv,
           float* acc) {
  int64_t e = 0;
  for (; e + 8 * kLanes <= Dv; e += 8 * kLanes) PvBlock<8>(p, vrow, k0, k1, e, acc);
  for (; e + 4 * kLanes <= Dv; e += 4 * kLanes) PvBlock<4>(p, vrow, k0, k1, e, acc);
  for (; e + kLanes <= Dv; e += kLanes) PvBlock<1>(p, vrow, k0, k1, e, acc);
  for (; e < Dv; ++e) {
    float o = 0;
    for (int64_t k = k0; k < k1; ++k) {
      if (p[k] != 0.0f) o = std::fma(p[k], vrow[k][e], o);
    }
    acc[e] = o;
  }
}

// A row's running state ah = {acc[Dv], max, sum} before its first tile.
inline void ClearAttnRow(float* ah, int64_t Dv) {
  std::fill(ah, ah + Dv, 0.0f);
  ah[Dv] = -std::numeric_limits<float>::infinity();
  ah[Dv + 1] = 0;
}

// Folds a tile's state {max, sum, acc_t} into the running state ah.
inline void FoldTile(float* ah, float m_t, float l_t, const float* acc_t, int64_t Dv) {
  const float ninf = -std::numeric_limits<float>::infinity();
  if (m_t == ninf) return;
  const float m_old = ah[Dv];
  if (m_old == ninf) {
    std::copy_n(acc_t, Dv, ah);
    ah[Dv] = m_t;
    ah[Dv + 1] = l_t;
    return;
  }
  const float m = (std::isnan(m_old) || std::isnan(m_t)) ? NAN : std::max(m_old, m_t);
  // exp(0) is exactly 1: skipped, not approximated.
  const float cs = m == m_old ? 1.0f : std::exp(m_old - m);
  const float ct = m == m_t ? 1.0f : std::exp(m_t - m);
  ah[Dv + 1] = std::fma(ah[Dv + 1], cs, l_t * ct);
  const F csv = Set1(cs), ctv = Set1(ct);
  int64_t e = 0;
  for (; e + kLanes <= Dv; e += kLanes) {
    Store(ah + e, Fma(Load(ah + e), csv, Mul(Load(acc_t + e), ctv)));
  }
  for (; e < Dv; ++e) ah[e] = std::fma(ah[e], cs, acc_t[e] * ct);
  ah[Dv] = m;
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

// IsaKernels::attend_combine: folds n tile states in order and finishes the row.
void CombineTiles(const float* tiles, int64_t n, int64_t stride, int64_t Dv, float* out) {
  float* ah = Scratch(kSlotAcc, Dv + 2);
  ClearAttnRow(ah, Dv);
  for (int64_t i = 0; i < n; ++i) {
    const float* st = tiles + i * stride;
    FoldTile(ah, st[0], st[1], st + 2, Dv);
  }
  FinishAttnRow(ah, Dv, out);
}

// A zero row of max(D, Dv) floats (the keys a tile does not have).
const float* ZeroRow(const AttnArgs& a) {
  const int64_t n = std::max<int64_t>({a.D, a.Dv, 1});
  float* z = Scratch(kSlotRow, n);
  std::fill_n(z, n, 0.0f);
  return z;
}

// Query rows per block of AttendRows, and the fewest rows a task needs to take that path.
constexpr int64_t kRowTile = 32;
constexpr int64_t kMinTileRows = 4;

// Attend for a task of several query rows (prefill), blocks of kRowTile rows at a time: each
// key tile is gathered once for the block's rows and the group's query heads, and P V is one
// small GEMM per head.
void AttendRows(const AttnArgs& a, const AttnTask& t) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, Dv = a.Dv;
  const float* zero = ZeroRow(a);
  float* kbuf = Scratch(kSlotKeys, kKeyTile * std::max<int64_t>(D, 1));
  float* vt = Scratch(kSlotValues, kKeyTile * std::max<int64_t>(Dv, 1));
  float* scores = Scratch(kSlotScores, kRowTile * kKeyTile);
  float* tacc = Scratch(kSlotTileAcc, kRowTile * std::max<int64_t>(Dv, 1));
  const int64_t acc_ld = G * (Dv + 2);
  float* acc = Scratch(kSlotAcc, kRowTile * acc_ld);  // per (row, head): acc[Dv], max, sum
  TileStats stats[kRowTile];
  KeyTile tile;
  for (int64_t r0 = t.t0; r0 < t.t1; r0 += kRowTile) {
    const int64_t rows = std::min(kRowTile, t.t1 - r0);
    const int64_t first = t.pos0 + (r0 - t.t0), last = first + rows - 1;  // positions
    // The keys any row of the block sees (both bounds grow with the position).
    const int64_t lo = KeyRangeAt(a, first, t.j0, t.j1).first;
    const int64_t hi = KeyRangeAt(a, last, t.j0, t.j1).second;
    for (int64_t i = 0; i < rows * G; ++i) ClearAttnRow(acc + i * (Dv + 2), Dv);
    for (int64_t jt = lo / kKeyTile * kKeyTile; jt < hi; jt += kKeyTile) {
      if (a.mods_any != nullptr &&
          !a.mods_any(a.mods_ctx, t.seq, t.g * G, G, first, rows, jt, kKeyTile)) {
        continue;  // the mask hides the tile from every row and head of the block
      }
      GatherTile(a, t, jt, lo, hi, zero, kbuf, vt, /*copy_rows=*/true, &tile);
      if (tile.count == 0) continue;
      // An inf or NaN value (an overflowed f16 cache) must not reach the rows that do not see
      // its key (0 x inf): then P V skips zero weights row by row (PvRow).
      bool finite_v;
      {
        F probe = Zero();  // v * 0 is 0 for finite v, NaN for inf and NaN
        const F zero_v = Zero();
        int64_t x = 0;
        for (; x + kLanes <= kKeyTile * Dv; x += kLanes) probe = Fma(Load(vt + x), zero_v, probe);
        float rest = HSum(probe);
        for (; x < kKeyTile * Dv; ++x) rest += vt[x] * 0.0f;
        finite_v = rest == 0.0f;
      }
      // The slot groups any row of the block sees.
      const int64_t k0 = (std::max(lo, jt) - jt) / kLanes * kLanes;
      const int64_t k1 = (std::min(hi, jt + kKeyTile) - jt + kLanes - 1) / kLanes * kLanes;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t head = t.g * G + h;
        const float* q = a.q + r0 * a.q_st + head * a.q_sh;
        BlockDots(q, a.q_st, rows, tile, k0, k1, D, a.scale, scores);
        for (int64_t i = 0; i < rows; ++i) {
          stats[i] = TileRowScores(a, t, tile, q + i * a.q_st, head, first + i,
                                   scores + i * kKeyTile, /*dots_done=*/true);
        }
        if (finite_v) {
          SmallGemm(scores, kKeyTile, 1, vt, Dv, tacc, Dv, rows, Dv, kKeyTile, 1.0f, false);
        } else {
          for (int64_t i = 0; i < rows; ++i) {
            PvRow(scores + i * kKeyTile, tile.v, stats[i].k0, stats[i].k1, Dv, tacc + i * Dv);
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          FoldTile(acc + (i * G + h) * (Dv + 2), stats[i].max, stats[i].sum, tacc + i * Dv, Dv);
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
  const float* zero = ZeroRow(a);
  float* kbuf = Scratch(kSlotKeys, kKeyTile * std::max<int64_t>(D, 1));
  float* vbuf = Scratch(kSlotValues, kKeyTile * std::max<int64_t>(Dv, 1));
  float* scores = Scratch(kSlotScores, kKeyTile);
  float* tacc = Scratch(kSlotTileAcc, std::max<int64_t>(Dv, 1));
  float* acc = Scratch(kSlotAcc, G * (Dv + 2));  // per head: acc[Dv], then max, sum
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t PF = AttnPartialFloats(Dv);
  const int64_t tile0 = t.j0 / kKeyTile;
  const int64_t ntiles = AttnPartialTiles(t.j0, t.j1);
  KeyTile tile;
  for (int64_t r = t.t0; r < t.t1; ++r) {
    const int64_t pos = t.pos0 + (r - t.t0);
    const auto [lo, hi] = KeyRangeAt(a, pos, t.j0, t.j1);
    float* part = t.partial == nullptr ? nullptr : t.partial + (r - t.t0) * ntiles * G * PF;
    if (part != nullptr) {
      for (int64_t i = 0; i < ntiles * G; ++i) {
        part[i * PF] = ninf;
        part[i * PF + 1] = 0;
        std::fill_n(part + i * PF + 2, Dv, 0.0f);
      }
    }
    for (int64_t h = 0; h < G; ++h) ClearAttnRow(acc + h * (Dv + 2), Dv);
    for (int64_t jt = lo / kKeyTile * kKeyTile; jt < hi; jt += kKeyTile) {
      if (a.mods_any != nullptr &&
          !a.mods_any(a.mods_ctx, t.seq, t.g * G, G, pos, 1, jt, kKeyTile)) {
        continue;  // hidden from the row: its partial state stays empty
      }
      GatherTile(a, t, jt, lo, hi, zero, kbuf, vbuf, /*copy_rows=*/false, &tile);
      if (tile.count == 0) continue;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t head = t.g * G + h;
        const TileStats st =
            TileRowScores(a, t, tile, a.q + r * a.q_st + head * a.q_sh, head, pos, scores);
        if (st.max == ninf) continue;
        if (part != nullptr) {
          float* dst = part + ((jt / kKeyTile - tile0) * G + h) * PF;
          dst[0] = st.max;
          dst[1] = st.sum;
          PvRow(scores, tile.v, st.k0, st.k1, Dv, dst + 2);
          continue;
        }
        PvRow(scores, tile.v, st.k0, st.k1, Dv, tacc);
        FoldTile(acc + h * (Dv + 2), st.max, st.sum, tacc, Dv);
      }
    }
    if (part != nullptr) continue;
    for (int64_t h = 0; h < G; ++h) {
      FinishAttnRow(acc + h * (Dv + 2), Dv, a.out + r * a.o_st + (t.g * G + h) * a.o_sh);
    }
  }
}

// ---- Softmax rows (the fused cross-entropy) ------------------------------------------------

// Elements per float partial sum of SoftmaxStats before it is added in double.
constexpr int64_t kStatsChunk = 1024;

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
      float acc = 0;  // what a vector column's lane computes (attention relies on it)
      for (int64_t kk = 0; kk < k; ++kk)
        acc = std::fma(a[r * a_rs + kk * a_cs], b[kk * ldb + j], acc);
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

const IsaKernels kTable = {kIsa,         Gemv,    Gemm,      Dequant,   Attend, CombineTiles,
                           SoftmaxStats, Softmax, ScaledExp, SmallGemm, SoftCap};

}  // namespace kiln::cpu::KILN_ISA_NS

// The q8 kernels, in variants whose vector layer has their primitives.
#if KILN_ISA_HAS_Q8
#include "backends/cpu/kernels/q8_impl.h"
#endif
