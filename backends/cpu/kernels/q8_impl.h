// The q8 kernels (kernels.h Q8Kernels): products of weights with activations quantized to 8
// bits per 32-element block, in integer dots (ggml's numerics; see kernels.h Q8Block).
//
// Written once over a vector layer with the q8 primitives (QuantizeQ8, Q8Dec*, Q8Accumulate,
// kQ8MR; simd_avx2.h also the four-row tile Q8Tile4 and the strips with weight rows in the
// lanes, Q8Tile8 / Q8Tile16) and compiled in the scalar and avx2 variants (kernels_impl.h)
// and, from the AVX2 layer with AVX-512 VL and VNNI, in kernels_q8_vnni.cc: there the dots are
// vpdpbusd and the tiles take kQ8MR = 6 activation rows in the 32 vector registers. The avx2
// and VNNI sets give bit-identical results (the integer dots are exact and the float
// operations the same, in the same order); in every set a row's result does not depend on
// how many rows share the call, nor on which tile computed it.
//
// No include guard on purpose: included once per variant, inside no namespace.

#include <algorithm>
#include <vector>

#include "backends/cpu/kernels/kernels.h"

namespace kiln::cpu::KILN_ISA_NS {
namespace {

template <class W, int MR, int NR>
void GemvQ8Tile(const Q8Block* xq, int64_t ldxq, const uint8_t* w, int64_t ldw, int64_t nb,
                float* y, int64_t ldy) {
  F acc[MR][NR];
  float off[MR][NR] = {};
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) acc[i][j] = Zero();
  }
  for (int64_t b = 0; b < nb; ++b) {
    PrefetchAhead(w, ldw, NR, b * W::kBlockBytes, W::kBlockBytes);
    for (int j = 0; j < NR; ++j) {
      const auto wb = W::Load(w + j * ldw + b * W::kBlockBytes);
      for (int i = 0; i < MR; ++i) Q8Accumulate<W>(wb, xq[i * ldxq + b], acc[i][j], off[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = HSum(acc[i][j]) + off[i][j];
  }
}

// MR activation rows against `nr` (<= 4) weight rows: the vector layer's four-row tile where
// it has one for this weight type.
template <class W, int MR>
void Q8Strip(const Q8Block* xq, int64_t nb, const uint8_t* w, int64_t ldw, int nr, float* y,
             int64_t ldy) {
#if defined(KILN_ISA_HAS_Q8_TILE4)
  if constexpr (W::kTile4) {
    if (nr == 4) return Q8Tile4<W, MR>(xq, nb, w, ldw, nb, y, ldy);
  }
#endif
  // The generic tile keeps MR x NR accumulators: at most two rows at a time (more spill).
  if constexpr (MR > 2) {
    Q8Strip<W, 2>(xq, nb, w, ldw, nr, y, ldy);
    return Q8Strip<W, MR - 2>(xq + 2 * nb, nb, w, ldw, nr, y + 2 * ldy, ldy);
  }
  if (nr == 4) return GemvQ8Tile<W, MR, 4>(xq, nb, w, ldw, nb, y, ldy);
  for (int j = 0; j < nr; ++j) GemvQ8Tile<W, MR, 1>(xq, nb, w + j * ldw, ldw, nb, y + j, ldy);
}

// The last `rows` (< kQ8MR) activation rows.
template <class W, int MR = kQ8MR - 1>
void Q8StripRest(int rows, const Q8Block* xq, int64_t nb, const uint8_t* w, int64_t ldw, int nr,
                 float* y, int64_t ldy) {
  if constexpr (MR >= 1) {
    if (rows == MR) return Q8Strip<W, MR>(xq, nb, w, ldw, nr, y, ldy);
    Q8StripRest<W, MR - 1>(rows, xq, nb, w, ldw, nr, y, ldy);
  }
}

#if defined(KILN_ISA_HAS_Q8_PACKED)
// From this many rows of x a four-row strip is decoded once (Q8PackStrip) for all its tiles.
constexpr int64_t kQ8PackMinM = 2 * kQ8MR;

// MR rows against a packed strip; the last rows (< kQ8MR) by the largest MR that fits.
template <class W, int MR = kQ8MR>
void Q8PackedRows(const Q8Block* xq, int64_t nb, const Q8StripBlock* packed, int64_t M, float* y,
                  int64_t ldy) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) Q8Tile4Packed<W, MR>(xq + m * nb, nb, packed, nb, y + m * ldy, ldy);
  if constexpr (MR > 1) {
    if (m < M) Q8PackedRows<W, MR - 1>(xq + m * nb, nb, packed, M - m, y + m * ldy, ldy);
  }
}
#endif

#if defined(KILN_ISA_HAS_Q8_STRIP16) || defined(KILN_ISA_HAS_Q8_STRIP8)
// From this many rows of x, strips with the weight rows in the lanes (Q8Tile16, Q8Tile8):
// their packing (a transpose of the strip's bytes) pays off only over many rows.
constexpr int64_t kQ8LaneStripMinM = 32;
#endif

// Weight rows in strips (sixteen rows for many rows of x where the layer has them, otherwise
// four), each strip against every row of x a tile at a time: the strip stays in L1, the
// activations stream from L2.
template <class W>
void GemvQ8Rows(const GemmArgs& a, const Q8Block* xq, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / 32, ldw = a.w_row_bytes;
  int64_t n = n0;
#if defined(KILN_ISA_HAS_Q8_STRIP16)
  // Prefill: sixteen weight rows at a time in the lanes (every weight type: the strip is
  // decoded through W::Load), then the rest in strips of four.
  if (a.M >= kQ8LaneStripMinM && n + 16 <= n1) {
    thread_local std::vector<Q8Block16> packed;
    packed.resize(static_cast<size_t>(nb));
    for (; n + 16 <= n1; n += 16) {
      Q8PackStrip16<W>(static_cast<const uint8_t*>(a.w) + n * ldw, ldw, nb, packed.data());
      int64_t m = 0;
      for (; m + 2 <= a.M; m += 2) {
        Q8Tile16<W, 2>(xq + m * nb, nb, packed.data(), nb, a.y + m * a.ldy + n, a.ldy);
      }
      if (m < a.M) Q8Tile16<W, 1>(xq + m * nb, nb, packed.data(), nb, a.y + m * a.ldy + n, a.ldy);
    }
  }
#endif
#if defined(KILN_ISA_HAS_Q8_STRIP8)
  // Prefill: eight weight rows at a time in the lanes, then the rest in strips of four.
  if (a.M >= kQ8LaneStripMinM && n + 8 <= n1) {
    thread_local std::vector<Q8Block8> packed;
    packed.resize(static_cast<size_t>(nb));
    for (; n + 8 <= n1; n += 8) {
      Q8PackStrip8<W>(static_cast<const uint8_t*>(a.w) + n * ldw, ldw, nb, packed.data());
      for (int64_t m = 0; m < a.M; ++m) {
        Q8Tile8<W>(xq + m * nb, packed.data(), nb, a.y + m * a.ldy + n);
      }
    }
  }
#endif
  for (; n < n1; n += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, n1 - n));
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + n * ldw;
#if defined(KILN_ISA_HAS_Q8_PACKED)
    if constexpr (W::kTile4) {
      if (nr == 4 && a.M >= kQ8PackMinM) {
        thread_local std::vector<Q8StripBlock> packed;
        packed.resize(static_cast<size_t>(nb));
        Q8PackStrip<W>(w, ldw, nb, packed.data());
        Q8PackedRows<W>(xq, nb, packed.data(), a.M, a.y + n, a.ldy);
        continue;
      }
    }
#endif
    int64_t m = 0;
    for (; m + kQ8MR <= a.M; m += kQ8MR) {
      Q8Strip<W, kQ8MR>(xq + m * nb, nb, w, ldw, nr, a.y + m * a.ldy + n, a.ldy);
    }
    if (m < a.M) {
      Q8StripRest<W>(static_cast<int>(a.M - m), xq + m * nb, nb, w, ldw, nr, a.y + m * a.ldy + n,
                     a.ldy);
    }
  }
}

void GemvQ8(const GemmArgs& a, const Q8Block* xq, int64_t n0, int64_t n1) {
  switch (a.wtype) {
    case DType::kQ4_0:
      return GemvQ8Rows<Q8DecQ4_0>(a, xq, n0, n1);
    case DType::kQ4_1:
      return GemvQ8Rows<Q8DecQ4_1>(a, xq, n0, n1);
    case DType::kQ8_0:
      return GemvQ8Rows<Q8DecQ8_0>(a, xq, n0, n1);
    case DType::kMXFP4:
      return GemvQ8Rows<Q8DecMXFP4>(a, xq, n0, n1);
    default:
      KILN_CHECK(false, "gemv_q8: weight type without a q8 path");
  }
}

}  // namespace

const Q8Kernels kQ8Table = {KILN_Q8_VNNI ? "avx512_vnni" : IsaName(kIsa), kQ8MR, QuantizeQ8,
                            GemvQ8};

}  // namespace kiln::cpu::KILN_ISA_NS
