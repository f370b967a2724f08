#include "backends/cpu/kernels/linear.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cpu/kernels/autotune.h"
#include "backends/cpu/kernels/kernels.h"
#include "backends/cpu/kernels/onednn_gemm.h"

namespace kiln::cpu {
namespace {

using backend::Kernel;
using backend::KernelRequest;

// Shapes below this many weight elements are not worth timing (the heuristic is fine)...
constexpr int64_t kMinTunedWeights = 1 << 16;
// ...except products with a fixed M of at least kMinTunedSkinnyM rows (training's LoRA
// products, N or K = the rank: the packed GEMM pads N = 8 to its register tile, and oneDNN
// or GEMV ran them ~20% faster), from this many weight elements.
constexpr int64_t kMinTunedSkinnyWeights = 1 << 12;
constexpr int64_t kMinTunedSkinnyM = 256;
// GEMV up to this M whatever the timings say: every weight byte is read and decoded once,
// while the packed GEMM only adds packing.
constexpr int64_t kGemvMaxM = 8;
// Heuristic (untuned shapes): GEMV up to this M. Each weight strip is decoded once and runs
// against every row of x; gemm_bench's forced pairs (q4_1/q8_0, N = 1536, K = 576, an AVX-512
// Xeon) had it ahead of the packed GEMM up to M = 16-32 and even at 48-64.
constexpr int64_t kGemvHeuristicMaxM = 32;
// Smallest M for which kOneDnnDequant may be chosen.
constexpr int64_t kDequantMinM = 64;
// Weights with more rows are timed on their first this many: every candidate splits rows
// evenly, so the rest only repeats the same work, and a first start times every shape
// (SmolLM2's 49,152-row LM head took 3.5 of its 4.3 s of tuning on a Zen 3).
constexpr int64_t kMaxTimedN = 8192;
// The q8 path splits rows of x, not weight rows, between threads from this many rows when
// there are too few weight rows to share (fewer than 32 per thread): each thread then
// quantizes only its own rows. Otherwise weight rows are split even for prefill: each thread
// then decodes (packs) only its own weight strips, which costs more than quantizing every row
// of x (SmolLM2 prefill in 128-row chunks on an AVX-512 VNNI Xeon: q8 / exact tokens/s
// 0.96-1.01 with rows split, 0.94-1.30, median 1.05, with weight rows split).
constexpr int64_t kQ8SplitRowsMinM = 64;
// The bf16 path splits weight rows between threads when each gets at least this many, else
// rows of x.
constexpr int64_t kBf16SplitNMinRows = 32;
// Decoded matmuls: blocks of K (MatMulDecodedKernel) for K from this long, used when x has
// more than this many bytes.
constexpr int64_t kKBlockedMinK = 8192;
constexpr int64_t kKBlockedMinXBytes = int64_t{16} << 20;
// Rows of a weight panel decoded for oneDNN at a time (kOneDnnDequant).
constexpr int64_t kDequantPanel = 64;

struct Plan {
  std::vector<std::pair<int64_t, GemmImpl>> upto;  // (max M, impl) ascending; last: all M
  GemmImpl For(int64_t m) const {
    for (const auto& [mx, impl] : upto) {
      if (m <= mx) return impl;
    }
    return upto.back().second;
  }
};

struct GemmData {
  bool matmul = false;
  const IsaKernels* k = nullptr;
  const IsaKernels* k_avx2 = nullptr;  // kGemmAvx2's kernels (Linear on avx512 only); else null
  const Q8Kernels* q8 = nullptr;       // the q8 kernels (kernels.h Q8KernelsFor); null: off
  const Bf16Kernels* bf16 = nullptr;   // the bf16 kernels (kernels.h Bf16KernelsFor); null: off
  Plan plan;
  // MatMul with a column-major `a` (autograd's dW = g^T x), which oneDNN reads in place while
  // the others copy it into rows first: timed apart. None: `plan` serves both layouts.
  std::optional<Plan> plan_col;
  std::shared_ptr<const OneDnnGemm> onednn_k;   // W rows K-contiguous ([N, K])
  std::shared_ptr<const OneDnnGemm> onednn_n;   // W N-contiguous ([K, N], matmul)
  std::shared_ptr<const OneDnnGemm> onednn_nt;  // the same with x column-major (dW = g^T x)
  // Decoded matmuls with a long K: oneDNN over `kblock` rows of b at a time, the first block
  // writing y and the others adding to it (MatMulDecodedKernel). kblock 0: none.
  int64_t kblock = 0;
  std::shared_ptr<const OneDnnGemm> onednn_kb_first, onednn_kb_acc;
  Kernel fallback;
};

// [begin, end) of `units` for this thread.
std::pair<int64_t, int64_t> Share(int64_t units, int t, int n) {
  return {units * t / n, units * (t + 1) / n};
}

// This thread's rows of x [m0, m1) and weight rows [n0, n1): a share of the weight rows in
// units of `n_unit` if `split_n`, else a share of the rows of x in units of `m_unit`.
struct Part {
  int64_t m0, m1, n0, n1;
};
Part PartOf(const GemmArgs& g, int t, int nt, bool split_n, int64_t n_unit, int64_t m_unit) {
  Part p{0, g.M, 0, g.N};
  if (split_n) {
    const auto [b, e] = Share((g.N + n_unit - 1) / n_unit, t, nt);
    p.n0 = std::min(g.N, b * n_unit);
    p.n1 = std::min(g.N, e * n_unit);
  } else {
    const auto [b, e] = Share((g.M + m_unit - 1) / m_unit, t, nt);
    p.m0 = std::min(g.M, b * m_unit);
    p.m1 = std::min(g.M, e * m_unit);
  }
  return p;
}

// The implementation to use for this layout (the plan's, or the packed GEMM where the
// plan's cannot take it).
GemmImpl Resolve(const GemmData& d, GemmImpl impl, const GemmArgs& g) {
  switch (impl) {
    case GemmImpl::kGemv:
      return g.w_k_stride == 1 ? impl : GemmImpl::kGemm;
    case GemmImpl::kGemvQ8:
      if (g.w_k_stride != 1) return GemmImpl::kGemm;
      return (d.q8 != nullptr && HasQ8Path(g.wtype)) ? impl : GemmImpl::kGemv;
    case GemmImpl::kOneDnn:
      if (g.wtype != DType::kF32) return GemmImpl::kGemm;
      if (g.w_k_stride == 1) return d.onednn_k ? impl : GemmImpl::kGemm;
      return (d.onednn_n && g.w_row_bytes == 4) ? impl : GemmImpl::kGemm;
    case GemmImpl::kOneDnnDequant:
      return (d.onednn_k && g.w_k_stride == 1) ? impl : GemmImpl::kGemm;
    case GemmImpl::kGemmAvx2:
      return d.k_avx2 != nullptr ? impl : GemmImpl::kGemm;
    case GemmImpl::kGemmBf16:
      return (d.bf16 != nullptr && g.wtype == DType::kBF16 && g.w_k_stride == 1) ? impl
                                                                                 : GemmImpl::kGemm;
    case GemmImpl::kGemm:
      return impl;
  }
  return GemmImpl::kGemm;
}

// This thread's share of one GEMM problem.
void RunGemm(const GemmData& d, GemmImpl impl, const GemmArgs& g, int t, int nt) {
  if (g.M <= 0 || g.N <= 0) return;
  if (g.K == 0) {
    const auto [m0, m1] = Share(g.M, t, nt);
    for (int64_t m = m0; m < m1; ++m) std::fill(g.y + m * g.ldy, g.y + m * g.ldy + g.N, 0.0f);
    return;
  }
  // 2-D split: along N in units of 16 columns when each thread gets enough of them,
  // otherwise along M in units of 8 rows.
  const auto [m0, m1, n0, n1] = PartOf(g, t, nt, g.N >= 64 * nt || g.M < 8 * nt, 16, 8);
  switch (impl) {
    case GemmImpl::kGemv: {
      const auto [b, e] = Share((g.N + 3) / 4, t, nt);  // strips of 4 weight rows
      d.k->gemv(g, std::min(g.N, b * 4), std::min(g.N, e * 4));
      return;
    }
    case GemmImpl::kGemvQ8: {
      // Every thread quantizes all rows and takes a share of the weight rows (each weight
      // byte read and decoded once), or, with many rows and few weight rows, a share of the
      // rows in whole tiles, quantizing only those (no barrier either way).
      const int64_t nb = g.K / 32;
      GemmArgs rows = g;
      int64_t n0 = 0, n1 = g.N;
      if (g.M >= kQ8SplitRowsMinM && g.N < 32 * nt) {
        const int64_t tile = d.q8->tile_rows;
        const auto [b, e] = Share((g.M + tile - 1) / tile, t, nt);
        const int64_t mb = std::min(g.M, b * tile), me = std::min(g.M, e * tile);
        rows.x = g.x + mb * g.ldx;
        rows.y = g.y + mb * g.ldy;
        rows.M = me - mb;
      } else {
        const auto [b, e] = Share((g.N + 3) / 4, t, nt);
        n0 = std::min(g.N, b * 4);
        n1 = std::min(g.N, e * 4);
      }
      if (rows.M <= 0 || n0 >= n1) return;
      thread_local std::vector<Q8Block> xq;
      xq.resize(static_cast<size_t>(rows.M * nb));
      for (int64_t m = 0; m < rows.M; ++m) {
        d.q8->quantize(rows.x + m * rows.ldx, rows.K, xq.data() + m * nb);
      }
      d.q8->gemv(rows, xq.data(), n0, n1);
      return;
    }
    case GemmImpl::kGemmBf16: {
      // Weight rows split in strips of four (each weight byte read once; every thread rounds
      // all rows of x), or, with too few weight rows to share, rows of x in tiles of four
      // (each thread rounding only its own).
      const auto [mb, me, nb, ne] =
          PartOf(g, t, nt, g.N >= kBf16SplitNMinRows * nt || g.M < 4 * nt, 4, 4);
      if (mb >= me || nb >= ne) return;
      const int64_t ld = Bf16RowElems(g.K);
      thread_local std::vector<uint16_t> xb;
      xb.resize(static_cast<size_t>((me - mb) * ld));
      for (int64_t m = mb; m < me; ++m)
        d.bf16->round(g.x + m * g.ldx, g.K, xb.data() + (m - mb) * ld);
      d.bf16->gemm(g, xb.data(), ld, mb, me, nb, ne);
      return;
    }
    case GemmImpl::kGemm:
      d.k->gemm(g, m0, m1, n0, n1);
      return;
    case GemmImpl::kGemmAvx2:
      d.k_avx2->gemm(g, m0, m1, n0, n1);
      return;
    case GemmImpl::kOneDnn:
      (g.x_transposed      ? d.onednn_nt
       : g.w_k_stride == 1 ? d.onednn_k
                           : d.onednn_n)
          ->Run(g, m0, m1, n0, n1);
      return;
    case GemmImpl::kOneDnnDequant: {
      const auto [b, e] = Share((g.N + 15) / 16, t, nt);
      const int64_t nb = std::min(g.N, b * 16), ne = std::min(g.N, e * 16);
      thread_local std::vector<float> panel;
      panel.resize(static_cast<size_t>(kDequantPanel * g.K));
      for (int64_t n = nb; n < ne; n += kDequantPanel) {
        const int64_t p = std::min(kDequantPanel, ne - n);
        d.k->dequant(g, n, n + p, panel.data());
        GemmArgs sub = g;
        sub.w = panel.data();
        sub.wtype = DType::kF32;
        sub.w_row_bytes = 4 * g.K;
        sub.y = g.y + n;
        sub.N = p;
        d.onednn_k->Run(sub, 0, g.M, 0, p);
      }
      return;
    }
  }
}

// Collapses the leading axes of `t` (all but the last) into rows with one stride. False if
// they do not form a single stride sequence.
bool RowStride(const TensorArg& t, int64_t inner, int64_t* rows, int64_t* ld) {
  *rows = 1;
  *ld = inner;
  bool first = true;
  int64_t expect = 0;
  for (int i = t.rank - 2; i >= 0; --i) {
    *rows *= t.shape[i];
    if (t.shape[i] == 1) continue;
    if (first) {
      *ld = t.strides[i];
      expect = t.strides[i] * t.shape[i];
      first = false;
    } else if (t.strides[i] != expect) {
      return false;
    } else {
      expect *= t.shape[i];
    }
  }
  return *ld >= 0;
}

bool LinearProblem(const LaunchArgs& a, GemmArgs* g) {
  const TensorArg &x = a.inputs[0], &w = a.inputs[1], &o = a.output;
  const int64_t K = x.shape[x.rank - 1], N = w.shape[0];
  if ((K > 1 && x.strides[x.rank - 1] != 1) || (N > 1 && o.strides[o.rank - 1] != 1)) return false;
  if (K > 1 && w.strides[1] != 1) return false;
  int64_t M = 0, ldx = 0, mo = 0, ldy = 0;
  if (!RowStride(x, K, &M, &ldx) || !RowStride(o, N, &mo, &ldy) || mo != M) return false;
  if (M > 1 && ldy < N) return false;
  const int64_t wrow = N > 1 ? w.strides[0] : K;
  if (wrow < 0 || wrow % DTypeBlockElems(w.dtype) != 0) return false;
  g->x = static_cast<const float*>(x.data);
  g->ldx = ldx;
  g->w = w.data;
  g->wtype = w.dtype;
  g->w_row_bytes = ByteOffset(w.dtype, wrow);
  g->w_k_stride = 1;
  g->y = static_cast<float*>(o.data);
  g->ldy = ldy;
  g->M = M;
  g->N = N;
  g->K = K;
  return true;
}

void LinearKernel(const LaunchArgs& a, const ExecCtx& c) {
  const GemmData& d = *static_cast<const GemmData*>(a.kernel_data);
  GemmArgs g;
  if (!LinearProblem(a, &g)) return RunFallback(d.fallback, a, c);
  RunGemm(d, Resolve(d, d.plan.For(g.M), g), g, c.thread_index, c.thread_count);
}

// MatMul: (a [..., M, K], b [..., K, N]) -> [..., M, N], batch axes possibly broadcast.
void MatMulKernel(const LaunchArgs& args, const ExecCtx& c) {
  const GemmData& d = *static_cast<const GemmData*>(args.kernel_data);
  const TensorArg &a = args.inputs[0], &b = args.inputs[1], &o = args.output;
  const int r = o.rank;
  const int64_t M = a.shape[r - 2], K = a.shape[r - 1], N = b.shape[r - 1];
  GemmArgs g;
  g.M = M;
  g.N = N;
  g.K = K;
  g.ldx = a.strides[r - 2];
  g.ldy = o.strides[r - 2];
  g.wtype = DType::kF32;
  const bool x_ok = K <= 1 || a.strides[r - 1] == 1;
  const bool y_ok = (N <= 1 || o.strides[r - 1] == 1) && (M <= 1 || g.ldy >= N);
  if (!y_ok) return RunFallback(d.fallback, args, c);
  // A transposed `a` (autograd's dW = g^T x, attention's dK = dS^T Q) is copied into rows
  // first: M*K loads against the GEMM's M*N*K, instead of the reference loop.
  const bool transpose_a = !x_ok;
  if (transpose_a) g.ldx = K;
  // Rows [m0, m1) of `a` into a_rows (its other rows are not read), in tiles of 16 rows so
  // that each cache line of a column-major source is used whole.
  thread_local std::vector<float> a_rows;
  auto rows_of = [&](const float* src, int64_t m0, int64_t m1) {
    a_rows.resize(static_cast<size_t>(M * K));
    const int64_t sm = a.strides[r - 2], sk = a.strides[r - 1];
    for (int64_t mt = m0; mt < m1; mt += 16) {
      const int64_t me = std::min(m1, mt + 16);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t m = mt; m < me; ++m) a_rows[m * K + k] = src[m * sm + k * sk];
      }
    }
    return a_rows.data();
  };
  // The rows of `a` this thread's GEMM tiles read (RunGemm's split; all when it splits N).
  auto my_rows = [&](bool whole) -> std::pair<int64_t, int64_t> {
    const int nt = c.thread_count;
    if (whole || N >= 64 * nt || M < 8 * nt) return {0, M};
    const auto [b, e] = Share((M + 7) / 8, c.thread_index, nt);
    return {std::min(M, b * 8), std::min(M, e * 8)};
  };
  if (K <= 1 || b.strides[r - 2] == 1) {  // W = b^T has K-contiguous rows
    g.w_row_bytes = 4 * b.strides[r - 1];
    g.w_k_stride = 1;
  } else {
    g.w_row_bytes = 4 * b.strides[r - 1];
    g.w_k_stride = b.strides[r - 2];
  }
  const GemmImpl impl = Resolve(d, (transpose_a && d.plan_col ? *d.plan_col : d.plan).For(M), g);
  // oneDNN reads a column-major `a` where it lies (the copy into rows costs dW GEMMs ~25%).
  const bool transposed_in_place = transpose_a && impl == GemmImpl::kOneDnn && g.w_k_stride != 1 &&
                                   d.onednn_nt != nullptr && (M <= 1 || a.strides[r - 2] == 1);
  int64_t batches = 1;
  for (int i = 0; i < r - 2; ++i) batches *= o.shape[i];
  // Many batches: whole batches per thread. Few: every thread takes part of each.
  const bool per_thread = batches >= c.thread_count;
  const auto [b0, b1] = per_thread ? Share(batches, c.thread_index, c.thread_count)
                                   : std::pair<int64_t, int64_t>{0, batches};
  for (int64_t bi = b0; bi < b1; ++bi) {
    int64_t rem = bi, ao = 0, bo = 0, oo = 0;
    for (int i = r - 3; i >= 0; --i) {
      const int64_t idx = rem % o.shape[i];
      rem /= o.shape[i];
      ao += idx * a.strides[i];
      bo += idx * b.strides[i];
      oo += idx * o.strides[i];
    }
    GemmArgs gb = g;
    gb.x = static_cast<const float*>(a.data) + ao;
    if (transposed_in_place) {
      gb.x_transposed = true;
      gb.ldx = a.strides[r - 1];
    } else if (transpose_a) {
      const auto [m0, m1] =
          my_rows(per_thread || (impl != GemmImpl::kGemm && impl != GemmImpl::kOneDnn));
      gb.x = rows_of(gb.x, m0, m1);
    }
    gb.w = static_cast<const float*>(b.data) + bo;
    gb.y = static_cast<float*>(o.data) + oo;
    if (per_thread) {
      RunGemm(d, impl, gb, 0, 1);
    } else {
      RunGemm(d, impl, gb, c.thread_index, c.thread_count);
    }
  }
}

// MatMul with a 2-D f16/bf16/block-quantized right operand b [K, N] (a frozen linear weight
// [N_out, K_in] read as it is: autograd's dx = g w). Each thread owns whole blocks of N and
// decodes b[:, n:n+P] panel by panel into f32 scratch [K, P] for the GEMM: the weight is read
// once per step and never exists as f32, and the scratch stays cache-sized.
void MatMulDecodedKernel(const LaunchArgs& args, const ExecCtx& c) {
  const GemmData& d = *static_cast<const GemmData*>(args.kernel_data);
  const TensorArg &a = args.inputs[0], &b = args.inputs[1], &o = args.output;
  const int64_t M = a.shape[0], K = a.shape[1], N = b.shape[1];
  const bool ok = K > 0 && (K <= 1 || a.strides[1] == 1) && (N <= 1 || o.strides[1] == 1) &&
                  (N <= 1 || b.strides[1] == 1) && (M <= 1 || o.strides[0] >= N) &&
                  (K <= 1 || b.strides[0] % DTypeBlockElems(b.dtype) == 0);
  if (!ok) return RunFallback(d.fallback, args, c);
  if (M <= 0 || N <= 0) return;
  GemmArgs g;
  g.x = static_cast<const float*>(a.data);
  g.ldx = K <= 1 ? K : a.strides[0];
  g.ldy = o.strides[0];
  g.M = M;
  g.K = K;
  g.wtype = DType::kF32;
  // This thread's columns of b [n_begin, n_end), in whole blocks of every quantized type.
  constexpr int64_t kUnit = 32;
  const auto [u0, u1] = Share((N + kUnit - 1) / kUnit, c.thread_index, c.thread_count);
  const int64_t n_begin = std::min(N, u0 * kUnit), n_end = std::min(N, u1 * kUnit);
  thread_local std::vector<float> scratch;
  GemmArgs src;  // b's rows restricted to columns [n, n + p): "W" rows of p elements
  src.w_row_bytes = ByteOffset(b.dtype, b.strides[0]);
  src.wtype = b.dtype;
  // y[:, n:n+p] (+)= x[:, k0:k1] b[k0:k1, n:n+p], through oneDNN `gemm` or the packed GEMM.
  auto product = [&](int64_t n, int64_t p, int64_t k0, int64_t k1, const OneDnnGemm* gemm) {
    src.w = static_cast<const uint8_t*>(b.data) + ByteOffset(b.dtype, n);
    src.K = p;
    scratch.resize(static_cast<size_t>((k1 - k0) * p));
    d.k->dequant(src, k0, k1, scratch.data());
    GemmArgs sub = g;
    sub.x = g.x + k0;
    sub.K = k1 - k0;
    sub.w = scratch.data();
    sub.w_row_bytes = 4;  // element (j, k) of W = panel^T at scratch[(k - k0) * p + j]
    sub.w_k_stride = p;
    sub.N = p;
    sub.y = static_cast<float*>(o.data) + n;
    if (gemm != nullptr) {
      gemm->Run(sub, 0, M, 0, p);
    } else {
      d.k->gemm(sub, 0, M, 0, p);
    }
  };
  if (d.kblock > 0 && M * K * 4 > kKBlockedMinXBytes) {
    // x is larger than the caches (the classifier head's dx = dlogits w, K = vocabulary):
    // column panels would stream all of it once per panel. Instead this thread decodes its
    // columns `kblock` rows of b at a time and accumulates the blocks' products, reading x
    // once.
    for (int64_t k0 = 0; k0 < K && n_begin < n_end; k0 += d.kblock) {
      product(n_begin, n_end - n_begin, k0, k0 + d.kblock,
              (k0 == 0 ? d.onednn_kb_first : d.onednn_kb_acc).get());
    }
    return;
  }
  // Panels of whole blocks, about 128 KiB of f32 (at least one block wide), all of K.
  const int64_t panel =
      std::clamp<int64_t>((32 * 1024 / std::max<int64_t>(K, 1)) / kUnit * kUnit, kUnit, 8 * kUnit);
  for (int64_t n = n_begin; n < n_end; n += panel) {
    product(n, std::min(panel, n_end - n), 0, K, d.onednn_n.get());
  }
}

// ---- Compile time ---------------------------------------------------------------------------

bool LinearWeightCovered(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16 || IsQuantized(t);
}

// Deterministic, finite, non-denormal weight bytes for timing runs.
void FillSynthetic(DType t, uint8_t* p, int64_t rows, int64_t K) {
  const int64_t rb = DTypeBytes(t, K), total = rows * rb;
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (int64_t i = 0; i < total; ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    p[i] = static_cast<uint8_t>(s);
  }
  auto put16 = [](uint8_t* q, float v) {
    const uint16_t h = FloatToF16(v);
    std::memcpy(q, &h, 2);
  };
  switch (t) {
    case DType::kF32:
      for (int64_t i = 0; i < total / 4; ++i) {
        const float v = static_cast<float>(p[4 * i] % 200) * 0.01f - 1.0f;
        std::memcpy(p + 4 * i, &v, 4);
      }
      break;
    case DType::kF16:
    case DType::kBF16:
      for (int64_t i = 0; i < total / 2; ++i) {
        const float v = static_cast<float>(p[2 * i] % 200) * 0.01f - 1.0f;
        const uint16_t h = t == DType::kF16 ? FloatToF16(v) : FloatToBF16(v);
        std::memcpy(p + 2 * i, &h, 2);
      }
      break;
    default:
      if (!IsQuantized(t) || DTypeBlockElems(t) != 32) break;
      for (int64_t b = 0; b < total / DTypeBlockBytes(t); ++b) {
        uint8_t* q = p + b * DTypeBlockBytes(t);
        if (t == DType::kMXFP4) {
          q[0] = 120;
        } else {
          put16(q, 0.01f);
          if (t == DType::kQ4_1) put16(q + 2, -0.05f);
        }
      }
      break;
  }
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
std::unique_ptr<uint8_t, AlignedFree> AlignedBytes(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) + 63) / 64 * 64;
  return std::unique_ptr<uint8_t, AlignedFree>(
      static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
}

// Times candidate implementations of one shape through the device's own stream (its pool).
class TimingBench {
 public:
  // `x_col`: a matmul's left operand column-major (strides {1, M}).
  static StatusOr<std::unique_ptr<TimingBench>> Create(backend::Device& dev, bool matmul, DType wt,
                                                       int64_t max_m, int64_t N, int64_t K,
                                                       bool x_col) {
    std::unique_ptr<TimingBench> b(new TimingBench());
    KILN_ASSIGN_OR_RETURN(b->stream_, dev.CreateStream());
    b->matmul_ = matmul;
    b->x_col_ = x_col;
    b->wt_ = wt;
    b->N_ = N;
    b->K_ = K;
    b->x_ = AlignedBytes(4 * max_m * K);
    b->y_ = AlignedBytes(4 * max_m * N);
    b->w_ = AlignedBytes(matmul ? 4 * K * N : DTypeBytes(wt, K) * N);
    if (b->x_ == nullptr || b->y_ == nullptr || b->w_ == nullptr) {
      return ResourceExhausted("cpu autotune: no memory for a ", N, "x", K, " timing run");
    }
    float* x = reinterpret_cast<float*>(b->x_.get());
    for (int64_t i = 0; i < max_m * K; ++i) x[i] = static_cast<float>(i % 97) * 0.01f - 0.5f;
    if (matmul) {
      FillSynthetic(DType::kF32, b->w_.get(), K, N);
    } else {
      FillSynthetic(wt, b->w_.get(), N, K);
    }
    return b;
  }

  Status Run(const GemmData& base, GemmImpl impl, int64_t m) {
    GemmData d = base;
    d.plan.upto = {{1, impl}};
    d.plan_col.reset();
    TensorArg in[2] = {
        Arg2D(x_.get(), DType::kF32, m, K_),
        matmul_ ? Arg2D(w_.get(), DType::kF32, K_, N_) : Arg2D(w_.get(), wt_, N_, K_)};
    if (x_col_) {
      in[0].strides[0] = 1;
      in[0].strides[1] = m;
    }
    LaunchArgs args;
    args.kernel_data = &d;
    args.inputs = in;
    args.num_inputs = 2;
    args.output = Arg2D(y_.get(), DType::kF32, m, N_);
    const Launch l{matmul_ ? MatMulKernel : LinearKernel, &args};
    KILN_RETURN_IF_ERROR(stream_->Run(std::span<const Launch>(&l, 1)));
    return stream_->Synchronize();
  }

 private:
  TimingBench() = default;
  std::unique_ptr<backend::Stream> stream_;
  bool matmul_ = false, x_col_ = false;
  DType wt_ = DType::kF32;
  int64_t N_ = 0, K_ = 0;
  std::unique_ptr<uint8_t, AlignedFree> x_, y_, w_;
};

// Plan from per-M choices: each representative M owns the range up to the geometric mean
// with the next one.
Plan PlanFrom(std::span<const int64_t> ms, const std::vector<GemmImpl>& impls) {
  Plan p;
  for (size_t i = 0; i < ms.size(); ++i) {
    const int64_t mx = i + 1 < ms.size()
                           ? static_cast<int64_t>(std::sqrt(double(ms[i]) * double(ms[i + 1])))
                           : INT64_MAX;
    if (!p.upto.empty() && p.upto.back().second == impls[i]) {
      p.upto.back().first = mx;
    } else {
      p.upto.push_back({mx, impls[i]});
    }
  }
  return p;
}

std::string PlanString(const Plan& p) {
  std::string s;
  int64_t lo = 1;
  for (const auto& [mx, impl] : p.upto) {
    absl::StrAppend(&s, s.empty() ? "" : " ", lo, "-", mx == INT64_MAX ? "" : absl::StrCat(mx), ":",
                    GemmImplName(impl));
    if (mx == INT64_MAX) break;
    lo = mx + 1;
  }
  return s;
}

}  // namespace

TensorArg Arg2D(void* data, DType t, int64_t rows, int64_t cols) {
  TensorArg a;
  a.data = data;
  a.dtype = t;
  a.rank = 2;
  a.shape[0] = rows;
  a.shape[1] = cols;
  a.strides[0] = cols;
  a.strides[1] = 1;
  return a;
}

const char* GemmImplName(GemmImpl impl) {
  switch (impl) {
    case GemmImpl::kGemv:
      return "gemv";
    case GemmImpl::kGemvQ8:
      return "gemv_q8";
    case GemmImpl::kGemm:
      return "gemm";
    case GemmImpl::kOneDnn:
      return "onednn";
    case GemmImpl::kOneDnnDequant:
      return "onednn_dequant";
    case GemmImpl::kGemmAvx2:
      return "gemm_avx2";
    case GemmImpl::kGemmBf16:
      return "gemm_bf16";
  }
  return "?";
}

std::span<const int64_t> RepresentativeMs() {
  static constexpr int64_t kMs[] = {1, 2, 4, 8, 16, 32, 128, 512};
  return kMs;
}

StatusOr<std::optional<Kernel>> MakeGemmKernel(const KernelRequest& req, const SelectContext& ctx) {
  const bool matmul = req.op == OpKind::kMatMul;
  const TensorType &x = req.inputs[0], &w = req.inputs[1];
  if (x.dtype != DType::kF32 || req.output.dtype != DType::kF32) return std::optional<Kernel>();
  // A matmul's right operand other than f32: decoded panels (MatMulDecodedKernel).
  const bool decoded = matmul && w.dtype != DType::kF32;
  if (decoded  ? !HasFastDecoder(w.dtype) || w.shape.size() != 2 || x.shape.size() != 2
      : matmul ? false
               : !LinearWeightCovered(w.dtype)) {
    return std::optional<Kernel>();
  }
  auto d = std::make_shared<GemmData>();
  d->matmul = matmul;
  d->k = KernelsFor(ctx.isa);
  if (d->k == nullptr) d->k = KernelsFor(Isa::kScalar);
  if (ctx.q8_activations && !matmul && HasQ8Path(w.dtype)) {
    d->q8 = Q8KernelsFor(d->k->isa);
  }
  if (ctx.bf16_activations && !matmul && w.dtype == DType::kBF16) {
    d->bf16 = Bf16KernelsFor(d->k->isa);  // null without AVX-512 BF16: exact f32 below
  }
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));

  const std::optional<int64_t> K = x.shape.back().TryConstant();
  const std::optional<int64_t> N = matmul ? w.shape.back().TryConstant() : w.shape[0].TryConstant();
  // oneDNN primitives (run-time M, N and strides; one per weight layout).
  const bool fast_decode = HasFastDecoder(w.dtype);
  if (K && (w.dtype == DType::kF32 || fast_decode)) {
    if (auto g = OneDnnGemm::Create(*K, /*w_k_contiguous=*/true); g.ok())
      d->onednn_k = *std::move(g);
    if (matmul) {
      if (auto g = OneDnnGemm::Create(*K, /*w_k_contiguous=*/false); g.ok()) {
        d->onednn_n = *std::move(g);
      }
      if (w.dtype == DType::kF32) {
        if (auto g = OneDnnGemm::Create(*K, /*w_k_contiguous=*/false, /*x_transposed=*/true);
            g.ok()) {
          d->onednn_nt = *std::move(g);
        }
      }
    }
  }
  if (decoded) {  // oneDNN (onednn_n above) on the decoded [K, P] panels, or the packed GEMM
    if (ctx.force_gemm != nullptr && std::string_view(ctx.force_gemm) == "gemm") {
      d->onednn_n.reset();
    }
    if (K && *K >= kKBlockedMinK && d->onednn_n) {
      for (int64_t kb : {1024, 768, 512, 384, 256}) {
        if (*K % kb != 0) continue;
        auto first = OneDnnGemm::Create(kb, /*w_k_contiguous=*/false);
        auto acc = OneDnnGemm::Create(kb, /*w_k_contiguous=*/false, /*x_transposed=*/false,
                                      /*accumulate=*/true);
        if (first.ok() && acc.ok()) {
          d->kblock = kb;
          d->onednn_kb_first = *std::move(first);
          d->onednn_kb_acc = *std::move(acc);
        }
        break;
      }
    }
    const std::string name =
        absl::StrCat("cpu.matmul.", IsaName(d->k->isa), "[decode_", DTypeName(w.dtype),
                     d->onednn_n ? (d->kblock > 0 ? "+onednn,k_blocks" : "+onednn") : "+gemm", "]");
    return std::optional<Kernel>(Kernel{MatMulDecodedKernel, std::move(d), name});
  }
  std::vector<GemmImpl> candidates;
  if (d->q8 != nullptr) {
    // With q8 activations every M uses them: a sequence's numerics must not depend on how
    // many others share its step (nor on timing), so nothing else is a candidate.
    candidates.push_back(GemmImpl::kGemvQ8);
  } else if (d->bf16 != nullptr) {
    candidates.push_back(GemmImpl::kGemmBf16);  // likewise
  } else {
    if (!matmul) candidates.push_back(GemmImpl::kGemv);
    // On f32 weights oneDNN goes first, so that the packed GEMM must beat it by the tuner's
    // margin: timed alone the two are within 2-3% on training's shapes (M = 1024; gemm_bench),
    // but with oneDNN a full fine-tuning step was 6% shorter (docs/decisions.md).
    const bool onednn_f32 = w.dtype == DType::kF32 && (d->onednn_k || d->onednn_n);
    if (onednn_f32) candidates.push_back(GemmImpl::kOneDnn);
    candidates.push_back(GemmImpl::kGemm);
    if (!onednn_f32 && !matmul && fast_decode && d->onednn_k) {
      candidates.push_back(GemmImpl::kOneDnnDequant);
    }
    // On AVX-512 CPUs the avx2 GEMM too, last, so that it must win by the tuner's margin: a
    // Zen 4 runs 512-bit FMAs as two 256-bit halves, and there it was 2-10% ahead at M = 512
    // (gemm_bench, docs/performance.md "Issue 18 on a Zen 4").
    if (!matmul && d->k->isa == Isa::kAvx512 && KernelsFor(Isa::kAvx2) != nullptr) {
      d->k_avx2 = KernelsFor(Isa::kAvx2);
      candidates.push_back(GemmImpl::kGemmAvx2);
    }
  }
  if (matmul) {
    d->plan.upto = {{INT64_MAX, GemmImpl::kGemm}};
  } else if (d->q8 != nullptr) {
    d->plan.upto = {{INT64_MAX, GemmImpl::kGemvQ8}};
  } else if (d->bf16 != nullptr) {
    d->plan.upto = {{INT64_MAX, GemmImpl::kGemmBf16}};
  } else {
    d->plan.upto = {{kGemvHeuristicMaxM, GemmImpl::kGemv}, {INT64_MAX, GemmImpl::kGemm}};
  }

  // M: rows of x (Linear) or of each matrix (MatMul; batched MatMul is not timed).
  std::optional<int64_t> m_const;
  if (matmul) {
    m_const = x.shape[x.shape.size() - 2].TryConstant();
  } else {
    Dim m = 1;
    for (size_t i = 0; i + 1 < x.shape.size(); ++i) m = m * x.shape[i];
    m_const = m.TryConstant();
  }
  const int64_t min_weights =
      m_const && *m_const >= kMinTunedSkinnyM ? kMinTunedSkinnyWeights : kMinTunedWeights;
  bool tunable = ctx.tuner != nullptr && K && N && *N * *K >= min_weights &&
                 (fast_decode || w.dtype == DType::kF32);
  if (matmul) tunable = tunable && x.shape.size() == 2;
  if (ctx.force_gemm != nullptr) {
    for (GemmImpl c : {GemmImpl::kGemv, GemmImpl::kGemvQ8, GemmImpl::kGemm, GemmImpl::kOneDnn,
                       GemmImpl::kOneDnnDequant, GemmImpl::kGemmAvx2, GemmImpl::kGemmBf16}) {
      if (std::string_view(ctx.force_gemm) == GemmImplName(c)) d->plan.upto = {{INT64_MAX, c}};
    }
    tunable = false;
  }
  if (tunable && candidates.size() > 1) {
    std::vector<int64_t> ms;
    if (m_const) {
      ms.push_back(std::max<int64_t>(*m_const, 1));
    } else {
      const auto rep = RepresentativeMs();
      ms.assign(rep.begin(), rep.end());
    }
    std::vector<std::string> names;
    for (GemmImpl c : candidates) names.push_back(GemmImplName(c));
    // One timed plan per layout of `a` the kernel can meet: row-major, and for f32 matmuls
    // (training's dW = g^T x) column-major, where oneDNN reads it in place.
    auto tune = [&](bool x_col) -> StatusOr<std::optional<Plan>> {
      const std::string key =
          absl::StrCat(OpName(req.op), " x=f32", x_col ? " col" : "", " w=", DTypeName(w.dtype),
                       " N=", *N, " K=", *K, " ", IsaName(d->k->isa),
                       d->q8 != nullptr ? absl::StrCat(" q8:", d->q8->name) : "",
                       " threads=", ctx.threads, " cpu=", CpuDescription());
      std::unique_ptr<TimingBench> bench;
      const GemmTuner::RunFn run = [&](int c, int64_t m) -> Status {
        if (bench == nullptr) {
          KILN_ASSIGN_OR_RETURN(bench, TimingBench::Create(*ctx.device, matmul, w.dtype,
                                                           *std::max_element(ms.begin(), ms.end()),
                                                           std::min(*N, kMaxTimedN), *K, x_col));
        }
        return bench->Run(*d, candidates[c], m);
      };
      KILN_ASSIGN_OR_RETURN(std::optional<std::vector<int>> choice,
                            ctx.tuner->Choose(key, names, ms, run));
      if (!choice) return std::optional<Plan>();
      std::vector<GemmImpl> impls;
      for (size_t i = 0; i < choice->size(); ++i) {
        GemmImpl impl = candidates[(*choice)[i]];
        // Timings on a busy machine can pick anything. Where the outcome is known by
        // construction it is not left to them: for a few rows of x (decode) every weight byte
        // is read once by GEMV, while packing panels (gemm) or decoding the whole weight
        // first (onednn_dequant) only adds work; f32 weights may also go to oneDNN.
        if (!matmul && ms[i] <= kGemvMaxM && impl != GemmImpl::kGemv &&
            !(w.dtype == DType::kF32 && impl == GemmImpl::kOneDnn)) {
          impl = GemmImpl::kGemv;
        } else if (impl == GemmImpl::kOneDnnDequant && ms[i] < kDequantMinM) {
          impl = GemmImpl::kGemm;
        }
        impls.push_back(impl);
      }
      return std::optional<Plan>(PlanFrom(ms, impls));
    };
    KILN_ASSIGN_OR_RETURN(std::optional<Plan> rows, tune(false));
    if (rows) d->plan = *std::move(rows);
    if (d->onednn_nt != nullptr) {
      KILN_ASSIGN_OR_RETURN(d->plan_col, tune(true));
    }
  }
  std::string plan = PlanString(d->plan);
  if (d->plan_col && PlanString(*d->plan_col) != plan) {
    absl::StrAppend(&plan, " col ", PlanString(*d->plan_col));
  }
  if (d->q8 != nullptr && std::string_view(d->q8->name) != IsaName(d->k->isa)) {
    absl::StrAppend(&plan, " ", d->q8->name);  // "1-:gemv_q8 avx512_vnni"
  }
  if (d->bf16 != nullptr) absl::StrAppend(&plan, " ", d->bf16->name);  // "1-:gemm_bf16 avx512_bf16"
  const std::string name =
      absl::StrCat("cpu.", OpName(req.op), ".", IsaName(d->k->isa), "[", plan, "]");
  return std::optional<Kernel>(Kernel{matmul ? MatMulKernel : LinearKernel, std::move(d), name});
}

std::string DescribeGemmPlan(const Kernel& kernel) {
  if (kernel.fn != LinearKernel && kernel.fn != MatMulKernel) return "";
  return PlanString(static_cast<const GemmData*>(kernel.data.get())->plan);
}

}  // namespace kiln::cpu
