#include "backends/cpu/kernels/attention_train.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "backends/cpu/kernels/attention.h"
#include "backends/cpu/kernels/attention_mods.h"
#include "backends/cpu/kernels/kernels.h"

namespace kiln::cpu {
namespace {

using backend::Kernel;
using backend::KernelRequest;

constexpr int64_t kTileRows = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::atomic<uint64_t> g_scores_visited{0};  // DenseAttentionScoresVisited

// Which keys a query row may see: kv <= q when causal, q - kv < window when window > 0, and
// the same document id (aux 0, row-major over rows of row_len tokens) when docs.
struct TrainMask {
  bool causal = false;
  int64_t window = 0;
  bool docs = false;
  int64_t row_len = 0;
};

std::optional<TrainMask> ClassifyTrainMask(const Expr& mask, const KernelRequest& req,
                                           int num_fixed) {
  const int num_aux = static_cast<int>(req.inputs.size()) - num_fixed;
  TrainMask m;
  if (const auto simple = ClassifyMask(mask)) {
    m.causal = simple->first != MaskKind::kNone;
    m.window = simple->second;
    return num_aux == 0 ? std::optional<TrainMask>(m) : std::nullopt;
  }
  // DocumentMask(0, Tk, w) = And(causal or window, same document).
  const ExprNode& n = mask.node();
  const auto tk = req.inputs[1].shape[2].TryConstant();
  if (n.op != ExprOp::kAnd || n.args.size() != 2 || num_aux != 1 || !tk) return std::nullopt;
  const auto first = ClassifyMask(n.args[0]);
  if (!first || first->first == MaskKind::kNone) return std::nullopt;
  const DType ids = req.inputs[num_fixed].dtype;
  if (ids != DType::kI32 && ids != DType::kI64) return std::nullopt;
  if (mask != attn::DocumentMask(0, *tk, first->second)) return std::nullopt;
  m.causal = true;
  m.window = first->second;
  m.docs = true;
  m.row_len = *tk;
  return m;
}

struct TrainAttnData {
  const IsaKernels* k = nullptr;
  TrainMask mask;
  float scale = 1;
  float softcap = 0;  // > 0: score_mod attn::SoftCapScore(softcap) (forward only)
  // Compiled modifiers (the kernels' generic path; null: the native masks above) and their
  // cached block masks.
  std::shared_ptr<const AttnMods> mods;
  BlockMasks blocks;
  Kernel fallback;
};

float* Row(const TensorArg& t, int64_t b, int64_t h, int64_t i) {
  return static_cast<float*>(t.data) + b * t.strides[0] + h * t.strides[1] + i * t.strides[2];
}

// The log-sum-exp of row i of head (b, h).
float* LseAt(const TensorArg& lse, int64_t b, int64_t h, int64_t i) {
  return static_cast<float*>(lse.data) + b * lse.strides[0] + h * lse.strides[1] +
         i * lse.strides[2];
}

// Keys [lo, hi) that query rows [r0, r1) may see before per-element masking.
std::pair<int64_t, int64_t> KeyRange(const TrainMask& m, int64_t r0, int64_t r1, int64_t tk) {
  const int64_t hi = m.causal ? std::min(tk, r1) : tk;
  const int64_t lo = m.window > 0 ? std::max<int64_t>(0, r0 - m.window + 1) : 0;
  return {lo, std::max(lo, hi)};
}

// Document masks: for each position of every row (B x row_len), the first key position whose
// document id equals its own. Keys before the smallest of these over a tile's rows belong to
// none of the tile's documents, so the tile skips them (block skipping for packed rows).
// `contiguous[b]`: every document of row b is one run of consecutive positions (what packing
// makes), so a query sees exactly the keys from its document's start on, and the row's mask
// needs no id comparisons.
struct DocRuns {
  std::vector<int64_t> start;
  std::vector<char> contiguous;
};
DocRuns DocStarts(const TrainMask& m, const TensorArg* ids, int64_t batch) {
  DocRuns runs;
  if (!m.docs) return runs;
  runs.start.resize(static_cast<size_t>(batch * m.row_len));
  runs.contiguous.assign(static_cast<size_t>(batch), 1);
  absl::flat_hash_map<int64_t, int64_t> first;
  for (int64_t b = 0; b < batch; ++b) {
    first.clear();
    int64_t previous = 0;
    for (int64_t j = 0; j < m.row_len; ++j) {
      const int64_t id = LoadIndex(*ids, b * m.row_len + j);
      const auto [it, fresh] = first.try_emplace(id, j);
      // A document seen before, after another one: not a single run.
      if (!fresh && j > 0 && id != previous) runs.contiguous[b] = 0;
      runs.start[b * m.row_len + j] = it->second;
      previous = id;
    }
  }
  return runs;
}

// KeyRange narrowed by the documents of batch row b (DocStarts); KeyRange without them.
std::pair<int64_t, int64_t> TileKeys(const TrainMask& m, const DocRuns& docs, int64_t b, int64_t r0,
                                     int64_t r1, int64_t tk) {
  auto [lo, hi] = KeyRange(m, r0, r1, tk);
  if (!docs.start.empty()) {
    int64_t doc_lo = hi;
    for (int64_t q = r0; q < r1; ++q) doc_lo = std::min(doc_lo, docs.start[b * m.row_len + q]);
    lo = std::clamp(doc_lo, lo, hi);
  }
  return {lo, hi};
}

// Sets the scores of tile rows [r0, r0 + rows) x keys [lo, lo + n) that the mask hides to -inf:
// the causal and window bounds as runs, documents as runs too when they are contiguous (a
// query's visible keys start at its document's start), else by comparing ids.
void ApplyMask(const TrainMask& m, const TensorArg* ids, const DocRuns& docs, int64_t b, int64_t r0,
               int64_t rows, int64_t lo, int64_t n, float* s) {
  if (!m.causal && !m.docs) return;
  const bool runs = m.docs && docs.contiguous[b] != 0;
  const bool compare = m.docs && !runs;
  const bool dense_i32 = compare && ids->dtype == DType::kI32 && ids->strides[0] == 1;
  const int32_t* ids32 =
      dense_i32 ? static_cast<const int32_t*>(ids->data) + b * m.row_len : nullptr;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t q = r0 + i;
    float* row = s + i * n;
    // Visible keys before any id comparison: [first, last) of the tile's columns.
    const int64_t last = m.causal ? std::clamp<int64_t>(q - lo + 1, 0, n) : n;
    int64_t first = m.window > 0 ? std::clamp<int64_t>(q - m.window + 1 - lo, 0, last) : int64_t{0};
    if (runs) {
      first = std::clamp<int64_t>(docs.start[b * m.row_len + q] - lo, first, last);
    }
    std::fill(row, row + first, kNegInf);
    std::fill(row + last, row + n, kNegInf);
    if (!compare) continue;
    if (ids32 != nullptr) {
      const int32_t doc = ids32[q];
      const int32_t* kv = ids32 + lo;
      for (int64_t j = first; j < last; ++j) {
        if (kv[j] != doc) row[j] = kNegInf;
      }
      continue;
    }
    const int64_t doc = LoadIndex(*ids, b * m.row_len + q);
    for (int64_t j = first; j < last; ++j) {
      if (LoadIndex(*ids, b * m.row_len + lo + j) != doc) row[j] = kNegInf;
    }
  }
}

// kt[d * ld + j] = x[row j0 + j, element d] for j in [0, n), of one head (a transposed copy).
void Transpose(const TensorArg& x, int64_t b, int64_t h, int64_t j0, int64_t n, int64_t dim,
               float* kt, int64_t ld) {
  for (int64_t j = 0; j < n; ++j) {
    const float* row = Row(x, b, h, j0 + j);
    for (int64_t e = 0; e < dim; ++e) kt[e * ld + j] = row[e];
  }
}

// sum(a[e] * b[e]) in double, over eight partial sums (independent chains: a serial double
// sum of a 64-element row was a tenth of the backward's own time).
double DotInDouble(const float* a, const float* b, int64_t n) {
  double part[8] = {};
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    for (int u = 0; u < 8; ++u) part[u] += static_cast<double>(a[e + u]) * b[e + u];
  }
  for (; e < n; ++e) part[0] += static_cast<double>(a[e]) * b[e];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

struct Scratch {
  std::vector<float> s, dp, kt, vt;
};
Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

// Softmax of one row of n scores in place (a fully masked row: zeros); returns its
// log-sum-exp (-inf for a fully masked row).
float SoftmaxRow(const IsaKernels& k, float* p, int64_t n) {
  float m = kNegInf;
  double sum = 0;
  k.softmax(p, n, &m, &sum);
  if (m == kNegInf) return kNegInf;
  return static_cast<float>(static_cast<double>(m) + std::log(sum));
}

// Calls fn(b, h, t) for this thread's share of the items (batch, head, query tile), in order,
// split into runs of equal cost (cost(t): causal tiles differ up to Tk / 64-fold); an item
// belongs to the thread whose share holds its cost midpoint.
template <typename Cost, typename Fn>
void ForEachTileItem(const ExecCtx& c, int64_t B, int64_t Hq, int64_t tiles, const Cost& cost,
                     const Fn& fn) {
  double per_bh = 0;
  for (int64_t t = 0; t < tiles; ++t) per_bh += cost(t);
  const double total = per_bh * static_cast<double>(B * Hq);
  const double lo_share = total * c.thread_index / c.thread_count;
  const double hi_share = total * (c.thread_index + 1) / c.thread_count;
  double before = 0;
  for (int64_t item = 0; item < B * Hq * tiles; ++item) {
    const int64_t t = item % tiles;
    const double item_cost = cost(t), mid = before + item_cost / 2;
    before += item_cost;
    if (mid >= lo_share && mid < hi_share) fn(item / (Hq * tiles), item / tiles % Hq, t);
  }
}

constexpr int64_t kKeyAlign = 16;

// The row stride of a transposed copy of tk keys: tk rounded up to whole vectors, plus one
// cache line, so that the head dimension's rows do not fall into the same cache sets (at
// 4,096 keys they would be 16 KiB apart: every row of a GEMM panel in one L1 set).
int64_t KtStride(int64_t tk) { return (tk + kKeyAlign - 1) / kKeyAlign * kKeyAlign + 16; }

void DenseForward(const LaunchArgs& a, const ExecCtx& c) {
  const auto& d = *static_cast<const TrainAttnData*>(a.kernel_data);
  const TensorArg &q = a.inputs[0], &k = a.inputs[1], &v = a.inputs[2], &o = a.output;
  const TensorArg* lse = a.num_extra_outputs > 0 ? &a.extra_outputs[0] : nullptr;
  const TensorArg* ids = d.mask.docs ? &a.inputs[3] : nullptr;
  if (!InnerContiguous(q) || !InnerContiguous(k) || !InnerContiguous(v) || !InnerContiguous(o) ||
      (lse != nullptr && lse->dtype != DType::kF32)) {
    RunFallback(d.fallback, a, c);
    return;
  }
  const int64_t B = q.shape[0], Hq = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Tk = k.shape[2], Dv = v.shape[3];
  const int64_t group = Hq / Hkv, tiles = (Tq + kTileRows - 1) / kTileRows;
  Scratch& sc = ThreadScratch();
  sc.s.resize(static_cast<size_t>(kTileRows * std::max<int64_t>(Tk, 1)));
  const int64_t kt_ld = KtStride(Tk);
  sc.kt.resize(static_cast<size_t>(std::max<int64_t>(D * kt_ld, 1)));
  // Cost of a tile: rows x visible keys.
  auto cost = [&](int64_t t) {
    const int64_t r0 = t * kTileRows, rows = std::min(kTileRows, Tq - r0);
    const auto [lo, hi] = KeyRange(d.mask, r0, r0 + rows, Tk);
    return static_cast<double>(rows * (hi - lo + 8));
  };
  const DocRuns docs = DocStarts(d.mask, ids, B);
  // The keys of kv head (kt_b, kt_g) transposed so far: [0, kt_done) of sc.kt (ld kt_ld). A
  // thread's items come in (batch, head, tile) order, so the `group` query heads of a kv head
  // and their tiles reuse one transposed copy, extended as the causal range grows.
  int64_t kt_b = -1, kt_g = -1, kt_done = 0;
  ForEachTileItem(c, B, Hq, tiles, cost, [&](int64_t b, int64_t h, int64_t t) {
    const int64_t g = h / group, r0 = t * kTileRows, rows = std::min(kTileRows, Tq - r0);
    auto [lo, hi] = TileKeys(d.mask, docs, b, r0, r0 + rows, Tk);
    // The scores from a multiple of kKeyAlign keys (the mask hides the extra ones): their
    // columns then start on whole vectors (a window of 256 started one key past one, 319 keys
    // a tile). P V starts at the tile's first key: the extra keys' values are never read (an
    // inf there would make 0 x inf).
    const int64_t extra = hi > lo ? lo % kKeyAlign : 0;
    lo -= extra;
    const int64_t n = hi - lo;
    g_scores_visited.fetch_add(static_cast<uint64_t>(rows * n), std::memory_order_relaxed);
    float* s = sc.s.data();
    if (n > 0) {
      if (b != kt_b || g != kt_g) {
        kt_b = b;
        kt_g = g;
        kt_done = 0;
      }
      if (hi > kt_done) {
        Transpose(k, b, g, kt_done, hi - kt_done, D, sc.kt.data() + kt_done, kt_ld);
        kt_done = hi;
      }
      // S = scale Q K^T over the tile's keys.
      d.k->small_gemm(Row(q, b, h, r0), q.strides[2], 1, sc.kt.data() + lo, kt_ld, s, n, rows, n, D,
                      d.scale, false);
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* p = s + i * n;
      if (n > 0) {
        // Gemma's soft-capping, then the mask (the op applies score_mod first), a row at a
        // time so that the row stays in L1 through the softmax below.
        if (d.softcap > 0) d.k->soft_cap(p, n, 1.0f, d.softcap);
        ApplyMask(d.mask, ids, docs, b, r0 + i, 1, lo, n, p);
      }
      const float row_lse = SoftmaxRow(*d.k, p, n);
      if (lse != nullptr) *LseAt(*lse, b, h, r0 + i) = row_lse;
    }
    if (n > 0) {
      d.k->small_gemm(s + extra, n, 1, Row(v, b, g, lo + extra), v.strides[2], Row(o, b, h, r0),
                      o.strides[2], rows, Dv, n - extra, 1.0f, false);
    } else {
      for (int64_t i = 0; i < rows; ++i) std::fill_n(Row(o, b, h, r0 + i), Dv, 0.0f);
    }
  });
}

// The keys of one query tile a launch visits: runs of consecutive keys [kv0, kv0 + n), and
// for each its blocks (compiled modifiers: the partial ones get the mask).
struct KeyRun {
  int64_t kv0 = 0, n = 0, col = 0;  // col: the run's first column in the tile's scores
  size_t first = 0, last = 0;       // its blocks [first, last) of the tile's KeyBlocks
};
std::vector<KeyRun> Runs(const std::vector<KeyBlock>& blocks) {
  std::vector<KeyRun> runs;
  int64_t col = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (runs.empty() || runs.back().kv0 + runs.back().n != blocks[i].kv0) {
      runs.push_back({blocks[i].kv0, 0, col, i, i});
    }
    runs.back().n += blocks[i].n;
    runs.back().last = i + 1;
    col += blocks[i].n;
  }
  return runs;
}

// The forward under compiled modifiers: per query tile, the scores of its non-empty key blocks
// side by side (S = scale Q K^T run by run, over the kv head's transposed keys shared by the
// tiles and query heads that follow), score_mod on every block and mask_mod on the partial
// ones, the softmax, then P V run by run.
void DenseForwardMods(const LaunchArgs& a, const ExecCtx& c) {
  const auto& d = *static_cast<const TrainAttnData*>(a.kernel_data);
  const TensorArg &q = a.inputs[0], &k = a.inputs[1], &v = a.inputs[2], &o = a.output;
  const TensorArg* lse = a.num_extra_outputs > 0 ? &a.extra_outputs[0] : nullptr;
  if (!InnerContiguous(q) || !InnerContiguous(k) || !InnerContiguous(v) || !InnerContiguous(o) ||
      (lse != nullptr && lse->dtype != DType::kF32)) {
    RunFallback(d.fallback, a, c);
    return;
  }
  const std::vector<AttnAux> aux = AuxTensors(a, 3);
  const std::string aux_bytes = AuxKey(*d.mods, a, 3);
  const int64_t B = q.shape[0], Hq = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Tk = k.shape[2], Dv = v.shape[3];
  const int64_t group = Hq / Hkv, tiles = (Tq + kTileRows - 1) / kTileRows;
  Scratch& sc = ThreadScratch();
  sc.s.resize(static_cast<size_t>(kTileRows * std::max<int64_t>(Tk, 1)));
  const int64_t kt_ld = KtStride(Tk);
  sc.kt.resize(static_cast<size_t>(std::max<int64_t>(D * kt_ld, 1)));
  // Items (batch, head, tile) split by cost as DenseForward does: the keys each tile visits
  // where one table serves every head, else every key.
  const bool one_table = !d.mods->mask_reads_batch() && !d.mods->mask_reads_head();
  std::shared_ptr<const BlockMask> shared =
      one_table ? d.blocks.For(*d.mods, 0, 0, kTileRows, Tq, Tk, aux.data(), aux_bytes) : nullptr;
  auto cost = [&](int64_t t) {
    const int64_t rows = std::min(kTileRows, Tq - t * kTileRows);
    int64_t keys = Tk;
    if (shared != nullptr) {
      keys = 0;
      for (const KeyBlock& kb : shared->tiles[static_cast<size_t>(t)]) keys += kb.n;
    }
    return static_cast<double>(rows * (keys + 8));
  };
  std::shared_ptr<const BlockMask> table;  // of head (table_b, table_h)
  int64_t table_b = 0, table_h = 0;
  // The keys of kv head (kt_b, kt_g) transposed so far, as in DenseForward: [0, kt_done).
  int64_t kt_b = -1, kt_g = -1, kt_done = 0;
  ForEachTileItem(c, B, Hq, tiles, cost, [&](int64_t b, int64_t h, int64_t t) {
    const int64_t g = h / group, r0 = t * kTileRows, rows = std::min(kTileRows, Tq - r0);
    if (!one_table && (table == nullptr || b != table_b || h != table_h)) {
      table = d.blocks.For(*d.mods, b, h, kTileRows, Tq, Tk, aux.data(), aux_bytes);
      table_b = b;
      table_h = h;
    }
    const std::vector<KeyBlock>& blocks = (one_table ? shared : table)->tiles[t];
    const std::vector<KeyRun> runs = Runs(blocks);
    int64_t n = 0;
    for (const KeyBlock& kb : blocks) n += kb.n;
    g_scores_visited.fetch_add(static_cast<uint64_t>(rows * n), std::memory_order_relaxed);
    if (n == 0) {
      for (int64_t i = 0; i < rows; ++i) std::fill_n(Row(o, b, h, r0 + i), Dv, 0.0f);
      if (lse != nullptr) {
        for (int64_t i = 0; i < rows; ++i) *LseAt(*lse, b, h, r0 + i) = kNegInf;
      }
      return;
    }
    float* s = sc.s.data();
    if (b != kt_b || g != kt_g) {
      kt_b = b;
      kt_g = g;
      kt_done = 0;
    }
    const int64_t end = runs.back().kv0 + runs.back().n;  // runs are in key order
    if (end > kt_done) {
      Transpose(k, b, g, kt_done, end - kt_done, D, sc.kt.data() + kt_done, kt_ld);
      kt_done = end;
    }
    // S = scale Q K^T, run by run into the run's columns.
    for (const KeyRun& r : runs) {
      d.k->small_gemm(Row(q, b, h, r0), q.strides[2], 1, sc.kt.data() + r.kv0, kt_ld, s + r.col, n,
                      rows, r.n, D, d.scale, false);
    }
    int64_t col = 0;
    for (const KeyBlock& kb : blocks) {
      if (d.mods->has_score() || kb.partial) {
        d.mods->Apply(s + col, n, rows, kb.n, b, h, r0, kb.kv0, kb.partial, aux.data());
      }
      col += kb.n;
    }
    for (int64_t i = 0; i < rows; ++i) {
      const float row_lse = SoftmaxRow(*d.k, s + i * n, n);
      if (lse != nullptr) *LseAt(*lse, b, h, r0 + i) = row_lse;
    }
    for (const KeyRun& r : runs) {
      d.k->small_gemm(s + r.col, n, 1, Row(v, b, g, r.kv0), v.strides[2], Row(o, b, h, r0),
                      o.strides[2], rows, Dv, r.n, 1.0f, r.col > 0);
    }
  });
}

// What the backward of one (batch, kv head) item works on.
struct BackwardArgs {
  const TensorArg &q, &k, &v, &o, &dout, &lse, &dq, &dk, &dv;
  int64_t Tk, D, Dv;
  int64_t ld;  // of the transposed K and V (KtStride)
};

// The backward of query tile rows [r0, r0 + rows) of head h against keys [kv0, kv0 + n) of kv
// head g: P = exp(scale Q K^T - lse) (`mask(p)` hides scores in place, before the exponential),
// dS = P (dP - D_i), then dV += P^T dO, dK += scale dS^T Q, and dQ = scale dS K (+= with
// accumulate_dq). kt/vt: K and V of head g transposed (ld x.ld); di: D_i of the tile's rows.
template <typename MaskFn>
void BackwardKeys(const TrainAttnData& d, const BackwardArgs& x, Scratch& sc, int64_t b, int64_t g,
                  int64_t h, int64_t r0, int64_t rows, int64_t kv0, int64_t n, const float* di,
                  bool accumulate_dq, const MaskFn& mask) {
  float *p = sc.s.data(), *ds = sc.dp.data();
  const float* qt = Row(x.q, b, h, r0);
  const float* dot = Row(x.dout, b, h, r0);
  d.k->small_gemm(qt, x.q.strides[2], 1, sc.kt.data() + kv0, x.ld, p, n, rows, n, x.D, d.scale,
                  false);
  mask(p);
  // dP = dO V^T.
  d.k->small_gemm(dot, x.dout.strides[2], 1, sc.vt.data() + kv0, x.ld, ds, n, rows, n, x.Dv, 1.0f,
                  false);
  for (int64_t i = 0; i < rows; ++i) {
    float* prow = p + i * n;
    float* drow = ds + i * n;
    const float l = *LseAt(x.lse, b, h, r0 + i);
    if (l == kNegInf) {
      std::fill(prow, prow + n, 0.0f);
    } else {
      d.k->scaled_exp(prow, n, l, 1.0f, prow);
    }
    for (int64_t j = 0; j < n; ++j) drow[j] = prow[j] * (drow[j] - di[i]);
  }
  d.k->small_gemm(p, 1, n, dot, x.dout.strides[2], Row(x.dv, b, g, kv0), x.dv.strides[2], n, x.Dv,
                  rows, 1.0f, true);
  d.k->small_gemm(ds, 1, n, qt, x.q.strides[2], Row(x.dk, b, g, kv0), x.dk.strides[2], n, x.D, rows,
                  d.scale, true);
  d.k->small_gemm(ds, n, 1, Row(x.k, b, g, kv0), x.k.strides[2], Row(x.dq, b, h, r0),
                  x.dq.strides[2], rows, x.D, n, d.scale, accumulate_dq);
}

void Backward(const LaunchArgs& a, const ExecCtx& c) {
  const auto& d = *static_cast<const TrainAttnData*>(a.kernel_data);
  const BackwardArgs x{a.inputs[0],
                       a.inputs[1],
                       a.inputs[2],
                       a.inputs[3],
                       a.inputs[4],
                       a.inputs[5],
                       a.output,
                       a.extra_outputs[0],
                       a.extra_outputs[1],
                       a.inputs[1].shape[2],
                       a.inputs[0].shape[3],
                       a.inputs[2].shape[3],
                       KtStride(a.inputs[1].shape[2])};
  const TensorArg* ids = d.mask.docs && d.mods == nullptr ? &a.inputs[6] : nullptr;
  for (const TensorArg* t : {&x.q, &x.k, &x.v, &x.o, &x.dout, &x.dq, &x.dk, &x.dv}) {
    if (!InnerContiguous(*t)) {
      RunFallback(d.fallback, a, c);
      return;
    }
  }
  if (x.lse.dtype != DType::kF32) {
    RunFallback(d.fallback, a, c);
    return;
  }
  const std::vector<AttnAux> aux = AuxTensors(a, 6);
  const std::string aux_bytes = d.mods != nullptr ? AuxKey(*d.mods, a, 6) : std::string();
  const int64_t B = x.q.shape[0], Hq = x.q.shape[1], Tq = x.q.shape[2];
  const int64_t Hkv = x.k.shape[1], Tk = x.Tk, D = x.D, Dv = x.Dv;
  const int64_t group = Hq / Hkv;
  Scratch& sc = ThreadScratch();
  const size_t tile = static_cast<size_t>(kTileRows * std::max<int64_t>(Tk, 1));
  sc.s.resize(tile);
  sc.dp.resize(tile);
  sc.kt.resize(static_cast<size_t>(std::max<int64_t>(D * x.ld, 1)));
  sc.vt.resize(static_cast<size_t>(std::max<int64_t>(Dv * x.ld, 1)));
  const DocRuns docs = DocStarts(d.mask, ids, B);
  std::shared_ptr<const BlockMask> table;
  float di[kTileRows];
  for (int64_t item = c.thread_index; item < B * Hkv; item += c.thread_count) {
    const int64_t b = item / Hkv, g = item % Hkv;
    for (int64_t j = 0; j < Tk; ++j) {
      std::fill_n(Row(x.dk, b, g, j), D, 0.0f);
      std::fill_n(Row(x.dv, b, g, j), Dv, 0.0f);
    }
    Transpose(x.k, b, g, 0, Tk, D, sc.kt.data(), x.ld);
    Transpose(x.v, b, g, 0, Tk, Dv, sc.vt.data(), x.ld);
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      if (d.mods != nullptr) {
        table = d.blocks.For(*d.mods, b, h, kTileRows, Tq, Tk, aux.data(), aux_bytes);
      }
      for (int64_t r0 = 0; r0 < Tq; r0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, Tq - r0);
        // D_i = rowsum(dO o).
        for (int64_t i = 0; i < rows; ++i) {
          const float* orow = Row(x.o, b, h, r0 + i);
          const float* grow = Row(x.dout, b, h, r0 + i);
          di[i] = static_cast<float>(DotInDouble(grow, orow, Dv));
        }
        bool any = false;
        if (d.mods == nullptr) {
          const auto [lo, hi] = TileKeys(d.mask, docs, b, r0, r0 + rows, Tk);
          if (hi > lo) {
            BackwardKeys(d, x, sc, b, g, h, r0, rows, lo, hi - lo, di, false, [&](float* p) {
              ApplyMask(d.mask, ids, docs, b, r0, rows, lo, hi - lo, p);
            });
            any = true;
          }
        } else {
          const std::vector<KeyBlock>& blocks = table->tiles[r0 / kTileRows];
          for (const KeyRun& r : Runs(blocks)) {
            BackwardKeys(d, x, sc, b, g, h, r0, rows, r.kv0, r.n, di, any, [&](float* p) {
              for (size_t i = r.first; i < r.last; ++i) {
                const KeyBlock& kb = blocks[i];
                if (kb.partial) {
                  d.mods->Apply(p + (kb.kv0 - r.kv0), r.n, rows, kb.n, b, h, r0, kb.kv0, true,
                                aux.data());
                }
              }
            });
            any = true;
          }
        }
        if (!any) {
          for (int64_t i = 0; i < rows; ++i) std::fill_n(Row(x.dq, b, h, r0 + i), D, 0.0f);
        }
      }
    }
  }
}

StatusOr<std::optional<Kernel>> Make(const KernelRequest& req, const SelectContext& ctx,
                                     int num_fixed, bool backward, const char* what) {
  const Attrs& at = *req.attrs;
  for (int i = 0; i < num_fixed; ++i) {
    if (req.inputs[i].dtype != DType::kF32) return std::optional<Kernel>();
  }
  // The attention_backward op never has a score_mod: the engine differentiates score_mods
  // through their decomposition.
  if (backward && at.expr[1]) return std::optional<Kernel>();
  auto d = std::make_shared<TrainAttnData>();
  d->k = KernelsFor(ctx.isa);
  if (d->k == nullptr) d->k = KernelsFor(Isa::kScalar);
  d->scale = static_cast<float>(at.floats[0]);
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  // Natively: the causal, window and document masks, and Gemma's soft-capping.
  const std::optional<double> softcap =
      at.expr[1] ? SoftCapOf(at.expr[1]) : std::optional<double>();
  const auto mask = ClassifyTrainMask(at.expr[0], req, num_fixed);
  std::string kind;
  if (mask && (!at.expr[1] || softcap)) {
    d->mask = *mask;
    const double cap = softcap.value_or(0.0);
    d->softcap = static_cast<float>(cap);
    kind = absl::StrCat(mask->docs ? "documents" : (mask->causal ? "causal" : "none"),
                        mask->window > 0 ? absl::StrCat(" window ", mask->window) : "",
                        softcap.has_value() ? absl::StrCat(" softcap ", cap) : "");
  } else {
    // Anything else: the modifiers compiled into the kernel, where they compile.
    std::vector<DType> aux;
    for (size_t i = static_cast<size_t>(num_fixed); i < req.inputs.size(); ++i) {
      aux.push_back(req.inputs[i].dtype);
    }
    StatusOr<std::shared_ptr<const AttnMods>> mods =
        AttnMods::Compile(at.expr[0], at.expr[1], aux, ctx);
    if (!mods.ok()) return std::optional<Kernel>();
    d->mods = *std::move(mods);
    kind = absl::StrCat("compiled ", d->mods->label());
  }
  const KernelFn fn = backward ? Backward : (d->mods != nullptr ? DenseForwardMods : DenseForward);
  std::string name = absl::StrCat("cpu.", what, ".", IsaName(d->k->isa), "[", kind, "]");
  return std::optional<Kernel>(Kernel{fn, std::move(d), std::move(name)});
}

}  // namespace

uint64_t DenseAttentionScoresVisited() { return g_scores_visited.load(std::memory_order_relaxed); }

StatusOr<std::optional<Kernel>> MakeDenseAttentionKernel(const KernelRequest& req,
                                                         const SelectContext& ctx) {
  return Make(req, ctx, 3, /*backward=*/false, "attention");
}

StatusOr<std::optional<Kernel>> MakeAttentionBackwardKernel(const KernelRequest& req,
                                                            const SelectContext& ctx) {
  return Make(req, ctx, 6, /*backward=*/true, "attention_backward");
}

}  // namespace kiln::cpu
