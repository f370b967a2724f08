#include "backends/cpu/kernels/attention.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cpu/kernels/attention_mods.h"
#include "backends/cpu/kernels/kernels.h"
#include "engine/backend/launch_scratch.h"

namespace kiln::cpu {
namespace {

using backend::Kernel;
using backend::KernelRequest;

// With several threads and few rows, a decode row is split over its context into parts of
// whole key tiles (kAttnKeyTile), at most kMaxPartsPerThread per thread: one sequence has
// fewer kv heads than a pool has threads, or a count that does not divide among them
// (SmolLM2's 3 over 2 threads left one thread a head behind the other in every layer). The
// kernels give a row the same result split or not (kernels.h), so whether a row is split —
// which depends on the rest of the batch — never changes a sequence's numerics. Rows are
// split only while the step has fewer unsplit items than the threads want (the partial states
// are per tile: a large batch of long rows would write megabytes of them).
constexpr int64_t kMaxPartsPerThread = 2;

// Partial softmax states and arrival counters of one launch's split rows.
struct SplitScratch {
  std::vector<float> partials;
  std::unique_ptr<std::atomic<int>[]> arrivals;
  size_t num_arrivals = 0;
};

struct AttnData {
  const IsaKernels* k = nullptr;
  MaskKind mask = MaskKind::kNone;
  int64_t window = 0;
  int64_t chunk = 0;
  float scale = 1;
  std::vector<float> alibi_slopes;  // per query head; empty: no ALiBi
  float softcap = 0;
  std::shared_ptr<const AttnMods> mods;  // compiled modifiers (AttnArgs::mods)
  Kernel fallback;
  backend::LaunchScratch<SplitScratch> scratch;

  // The scratch of launch `a` with room for `floats` partial floats and `rows` counters.
  SplitScratch* ScratchFor(const LaunchArgs* a, size_t floats, size_t rows) const {
    return &scratch.For(a, [&](SplitScratch& s) {
      if (s.partials.size() < floats) s.partials.resize(floats);
      if (s.num_arrivals < rows) {
        s.arrivals.reset(new std::atomic<int>[rows]);
        for (size_t i = 0; i < rows; ++i) s.arrivals[i].store(0, std::memory_order_relaxed);
        s.num_arrivals = rows;
      }
    });
  }
};

struct Item {
  int64_t seq, g, t0, t1, pos0, j0, j1;
  int64_t split = -1;  // index of the split row (decode split over the context), else -1
  int64_t tile = 0;    // the part's first key tile, from the split row's first
  int64_t cost = 0;
};

struct SplitRow {
  int64_t seq, g, t, parts, tiles;  // `parts` tasks cover `tiles` key tiles
  size_t offset;  // into SplitScratch::partials: [tile][query head of the group][state]
};

// AttnArgs::mods and mods_any over AttnData::mods and a launch's aux tensors; one per thread
// of a launch.
struct ModsCtx {
  const AttnMods* mods = nullptr;
  const AttnAux* aux = nullptr;
  mutable uint64_t scored = 0;  // calls of CallMods: (row, query head, key tile) triples
  // CallModsAny's answers for blocks of rows, by (b, first head or -1, q0, rows, kv0): a mask
  // that does not read the head gives every kv head's items the same, and a thread's items
  // repeat the same blocks for each of its kv heads.
  mutable std::map<std::array<int64_t, 5>, bool> any;
};
std::atomic<uint64_t> g_tiles_scored{0};  // PagedAttentionCompiledTilesScored

void CallMods(const void* ctx, float* s, int64_t n, int64_t b, int64_t h, int64_t q,
              const int64_t* kv) {
  const auto& m = *static_cast<const ModsCtx*>(ctx);
  m.mods->ApplyAt(s, n, b, h, q, kv, m.aux);
  ++m.scored;
}
bool CallModsAny(const void* ctx, int64_t b, int64_t h0, int64_t nh, int64_t q0, int64_t rows,
                 int64_t kv0, int64_t n) {
  const auto& m = *static_cast<const ModsCtx*>(ctx);
  const bool per_head = m.mods->mask_reads_head();
  auto classify = [&] {
    for (int64_t h = h0; h < h0 + (per_head ? nh : 1); ++h) {
      if (m.mods->Any(b, h, q0, rows, kv0, n, m.aux)) return true;
    }
    return false;
  };
  if (rows == 1) return classify();  // a decode row: cheaper than a lookup
  const auto [it, inserted] = m.any.try_emplace({b, per_head ? h0 : -1, q0, rows, kv0}, false);
  if (inserted) it->second = classify();
  return it->second;
}

void PagedAttentionKernel(const LaunchArgs& a, const ExecCtx& c) {
  const AttnData& d = *static_cast<const AttnData*>(a.kernel_data);
  const TensorArg &q = a.inputs[0], &kc = a.inputs[1], &vc = a.inputs[2];
  const TensorArg &bt = a.inputs[3], &sl = a.inputs[4], &qs = a.inputs[5], &o = a.output;
  if (!InnerContiguous(q) || !InnerContiguous(kc) || !InnerContiguous(vc) || !InnerContiguous(o)) {
    return RunFallback(d.fallback, a, c);
  }
  const int64_t T = q.shape[0], Hq = q.shape[1], D = q.shape[2];
  const int64_t NB = kc.shape[0], BS = kc.shape[1], Hkv = kc.shape[2], Dv = vc.shape[3];
  const int64_t S = bt.shape[0], MB = bt.shape[1];
  const int64_t G = Hq / Hkv;
  // Query ranges; overlapping ranges (bad data) go to the reference kernel, which defines
  // their meaning (later sequences overwrite earlier ones).
  std::vector<int64_t> q0(S), q1(S), len(S);
  int64_t prev_end = 0;
  for (int64_t s = 0; s < S; ++s) {
    q0[s] = std::clamp<int64_t>(LoadInt(qs.data, qs.dtype, s * qs.strides[0]), 0, T);
    q1[s] = std::clamp<int64_t>(LoadInt(qs.data, qs.dtype, (s + 1) * qs.strides[0]), q0[s], T);
    len[s] = std::max<int64_t>(LoadInt(sl.data, sl.dtype, s * sl.strides[0]), 0);
    if (q1[s] > q0[s]) {
      if (q0[s] < prev_end) return RunFallback(d.fallback, a, c);
      prev_end = q1[s];
    }
  }

  // Work items, identical on every thread.
  const int nt = c.thread_count;
  int64_t num_items_unsplit = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (q1[s] > q0[s]) num_items_unsplit += Hkv;
  }
  std::vector<Item> items;
  std::vector<SplitRow> splits;
  size_t split_floats = 0;
  const int64_t want = 4 * nt;  // items to aim for
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nq = q1[s] - q0[s];
    if (nq == 0) continue;
    const int64_t pos0 = len[s] - nq;
    for (int64_t g = 0; g < Hkv; ++g) {
      // Key tiles a decode row (position len - 1) sees.
      int64_t klo =
          d.mask == MaskKind::kSlidingWindow ? std::max<int64_t>(0, len[s] - d.window) : 0;
      if (d.chunk > 0 && len[s] > 0) klo = std::max(klo, (len[s] - 1) - (len[s] - 1) % d.chunk);
      const int64_t tile0 = klo / kAttnKeyTile,
                    tiles = AttnPartialTiles(tile0 * kAttnKeyTile, len[s]);
      if (nq == 1 && nt > 1 && tiles >= 2 && num_items_unsplit < want) {
        const int64_t parts = std::min<int64_t>(tiles, kMaxPartsPerThread * nt);
        splits.push_back({s, g, q0[s], parts, tiles, split_floats});
        split_floats += static_cast<size_t>(tiles * G * AttnPartialFloats(Dv));
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t b = tile0 + tiles * p / parts, e = tile0 + tiles * (p + 1) / parts;
          const int64_t j0 = b * kAttnKeyTile, j1 = std::min(e * kAttnKeyTile, len[s]);
          items.push_back({s, g, q0[s], q1[s], pos0, j0, j1,
                           static_cast<int64_t>(splits.size()) - 1, b - tile0,
                           j1 - std::max(j0, klo)});
        }
        continue;
      }
      // Rows in chunks so that there are enough items to balance.
      const int64_t chunks =
          std::clamp<int64_t>(want / std::max<int64_t>(num_items_unsplit, 1), 1, nq);
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t t0 = q0[s] + nq * ch / chunks, t1 = q0[s] + nq * (ch + 1) / chunks;
        if (t0 == t1) continue;
        const int64_t last = pos0 + (t1 - q0[s]);  // visible keys of the last row (causal)
        const int64_t keys =
            d.mask == MaskKind::kNone ? len[s] : std::clamp<int64_t>(last, 1, len[s]);
        items.push_back({s, g, t0, t1, pos0 + (t0 - q0[s]), 0, len[s], -1, 0,
                         (t1 - t0) * std::max<int64_t>(keys, 1)});
      }
    }
  }

  // Rows covered by no sequence are zero (this thread's share of them).
  {
    const int64_t r0 = T * c.thread_index / nt, r1 = T * (c.thread_index + 1) / nt;
    std::vector<char> covered(static_cast<size_t>(std::max<int64_t>(r1 - r0, 0)), 0);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t t = std::max(q0[s], r0); t < std::min(q1[s], r1); ++t) covered[t - r0] = 1;
    }
    for (int64_t t = r0; t < r1; ++t) {
      if (covered[t - r0]) continue;
      for (int64_t h = 0; h < Hq; ++h) {
        float* out = static_cast<float*>(o.data) + t * o.strides[0] + h * o.strides[1];
        std::fill(out, out + Dv, 0.0f);
      }
    }
  }
  if (items.empty()) return;

  // This thread's items: a contiguous run by cumulative cost.
  int64_t total = 0;
  for (const Item& it : items) total += it.cost;
  const int64_t lo = total * c.thread_index / nt, hi = total * (c.thread_index + 1) / nt;
  SplitScratch* scratch = splits.empty() ? nullptr : d.ScratchFor(&a, split_floats, splits.size());

  AttnArgs args;
  args.q = static_cast<const float*>(q.data);
  args.q_st = q.strides[0];
  args.q_sh = q.strides[1];
  args.k = kc.data;
  args.v = vc.data;
  args.kv_dtype = kc.dtype;
  args.k_sb = kc.strides[0];
  args.k_ss = kc.strides[1];
  args.k_sh = kc.strides[2];
  args.v_sb = vc.strides[0];
  args.v_ss = vc.strides[1];
  args.v_sh = vc.strides[2];
  args.block_size = BS;
  args.out = static_cast<float*>(o.data);
  args.o_st = o.strides[0];
  args.o_sh = o.strides[1];
  args.Hq = Hq;
  args.Hkv = Hkv;
  args.D = D;
  args.Dv = Dv;
  args.scale = d.scale;
  args.mask = d.mask;
  args.window = d.window;
  args.chunk = d.chunk;
  args.alibi_slopes = d.alibi_slopes.empty() ? nullptr : d.alibi_slopes.data();
  args.softcap = d.softcap;
  const std::vector<AttnAux> aux = AuxTensors(a, 6);
  ModsCtx mods;
  mods.mods = d.mods.get();
  mods.aux = aux.data();
  if (d.mods != nullptr) {
    args.mods = CallMods;
    if (d.mods->has_mask()) args.mods_any = CallModsAny;
    args.mods_ctx = &mods;
  }

  std::vector<int64_t> blocks;
  int64_t blocks_seq = -1;
  int64_t start = 0;
  for (const Item& it : items) {
    const int64_t mid = start + it.cost / 2;  // an item belongs to the thread owning its middle
    start += it.cost;
    if (mid < lo || mid >= hi) continue;
    if (it.seq != blocks_seq) {
      blocks_seq = it.seq;
      blocks.assign(static_cast<size_t>((len[it.seq] + BS - 1) / BS), -1);
      for (int64_t slot = 0; slot < static_cast<int64_t>(blocks.size()) && slot < MB; ++slot) {
        const int64_t b = LoadInt(bt.data, bt.dtype, it.seq * bt.strides[0] + slot * bt.strides[1]);
        blocks[slot] = (b >= 0 && b < NB) ? b : -1;
      }
    }
    AttnTask task;
    task.seq = it.seq;
    task.blocks = blocks.data();
    task.t0 = it.t0;
    task.t1 = it.t1;
    task.pos0 = it.pos0;
    task.g = it.g;
    task.j0 = it.j0;
    task.j1 = it.j1;
    if (it.split < 0) {
      d.k->attend(args, task);
      continue;
    }
    const SplitRow& sr = splits[it.split];
    float* base = scratch->partials.data() + sr.offset;
    task.partial = base + it.tile * G * AttnPartialFloats(Dv);
    d.k->attend(args, task);
    // The last part to finish combines all of them (acquire: sees every part's writes).
    std::atomic<int>& arrived = scratch->arrivals[it.split];
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 < sr.parts) continue;
    arrived.store(0, std::memory_order_relaxed);  // ready for the next launch
    const int64_t stride = G * AttnPartialFloats(Dv);
    for (int64_t h = 0; h < G; ++h) {
      float* out = args.out + sr.t * args.o_st + (sr.g * G + h) * args.o_sh;
      d.k->attend_combine(base + h * AttnPartialFloats(Dv), sr.tiles, stride, Dv, out);
    }
  }
  if (mods.scored > 0) g_tiles_scored.fetch_add(mods.scored, std::memory_order_relaxed);
}

}  // namespace

uint64_t PagedAttentionCompiledTilesScored() {
  return g_tiles_scored.load(std::memory_order_relaxed);
}

std::optional<std::pair<MaskKind, int64_t>> ClassifyMask(const Expr& mask) {
  if (!mask) return std::pair{MaskKind::kNone, int64_t{0}};
  if (mask == attn::CausalMask()) return std::pair{MaskKind::kCausal, int64_t{0}};
  // SlidingWindowMask(w) = (kv <= q) && (q - kv < w): read w, then compare whole trees.
  const ExprNode& n = mask.node();
  if (n.op == ExprOp::kAnd && n.args.size() == 2 && n.args[1].node().args.size() == 2) {
    const ExprNode& w = n.args[1].node().args[1].node();
    if (w.op == ExprOp::kConst && w.type == DType::kI64 && w.ivalue > 0 &&
        mask == attn::SlidingWindowMask(w.ivalue)) {
      return std::pair{MaskKind::kSlidingWindow, w.ivalue};
    }
  }
  return std::nullopt;
}

std::optional<double> SoftCapOf(const Expr& score, const Expr& inner) {
  // cap * tanh(inner / cap): read the cap, then compare whole trees.
  const ExprNode& n = score.node();
  if (n.op != ExprOp::kMul || n.args.size() != 2 || n.args[0].node().op != ExprOp::kConst) {
    return std::nullopt;
  }
  const double cap = n.args[0].node().fvalue;
  if (!(cap > 0) || score != attn::Then(inner, attn::SoftCapScore(cap))) return std::nullopt;
  return cap;
}

namespace {

// The paged kernel's view of a mask: ClassifyMask's, or attn::ChunkedMask(c) alone or And-ed
// with a sliding window (as ForwardContext::AttentionFor builds it).
struct PagedMask {
  MaskKind kind = MaskKind::kNone;
  int64_t window = 0, chunk = 0;
};

// c of a mask that is exactly attn::ChunkedMask(c), else 0. ChunkedMask(c) is
// And(Le(kv, q), Ge(kv, q - Mod(q, c))).
int64_t ChunkOf(const Expr& mask) {
  const ExprNode& n = mask.node();
  if (n.op != ExprOp::kAnd || n.args.size() != 2) return 0;
  const ExprNode& ge = n.args[1].node();
  if (ge.args.size() != 2) return 0;
  const ExprNode& sub = ge.args[1].node();
  if (sub.args.size() != 2) return 0;
  const ExprNode& mod = sub.args[1].node();
  if (mod.op != ExprOp::kMod || mod.args.size() != 2) return 0;
  const ExprNode& c = mod.args[1].node();
  if (c.op != ExprOp::kConst || c.type != DType::kI64 || c.ivalue <= 0) return 0;
  return mask == attn::ChunkedMask(c.ivalue) ? c.ivalue : 0;
}

std::optional<PagedMask> ClassifyPagedMask(const Expr& mask) {
  if (const auto m = ClassifyMask(mask)) return PagedMask{m->first, m->second, 0};
  if (const int64_t c = ChunkOf(mask)) return PagedMask{MaskKind::kCausal, 0, c};
  const ExprNode& n = mask.node();
  if (n.op != ExprOp::kAnd || n.args.size() != 2) return std::nullopt;
  const int64_t c = ChunkOf(n.args[0]);
  const auto w = ClassifyMask(n.args[1]);
  if (c == 0 || !w || w->first != MaskKind::kSlidingWindow) return std::nullopt;
  return PagedMask{MaskKind::kSlidingWindow, w->second, c};
}

// The score_mod the paged kernel implements: none, attn::AlibiScore(heads), SoftCapScore(cap),
// or ALiBi then the cap (attn::Then). Sets `alibi` and `softcap` (0: none); false for any
// other.
bool ClassifyPagedScore(const Expr& score, int64_t heads, bool* alibi, double* softcap) {
  *alibi = false;
  *softcap = 0;
  if (!score) return true;
  const Expr bias = attn::AlibiScore(heads);
  if (score == bias) return *alibi = true;
  if (const auto cap = SoftCapOf(score)) {
    *softcap = *cap;
    return true;
  }
  if (const auto cap = SoftCapOf(score, bias)) {
    *softcap = *cap;
    return *alibi = true;
  }
  return false;
}

// ALiBi's slope of each query head, evaluated from the score_mod itself (score 0, one key
// after the query), so the kernel's slopes are the reference's to the bit.
std::vector<float> AlibiSlopes(int64_t heads) {
  const ExprProgram bias(attn::AlibiScore(heads));
  std::vector<float> slopes;
  const ExprValue score{.f = 0};
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t index[] = {0, h, 0, 1};  // b, h, q_idx, kv_idx
    ExprEnv env;
    env.inputs = &score;
    env.index = index;
    slopes.push_back(static_cast<float>(bias.Eval(env).f));
  }
  return slopes;
}

}  // namespace

StatusOr<std::optional<Kernel>> MakePagedAttentionKernel(const KernelRequest& req,
                                                         const SelectContext& ctx) {
  if (req.inputs.size() < 6) return std::optional<Kernel>();
  const DType kv = req.inputs[1].dtype;
  if (req.inputs[0].dtype != DType::kF32 || req.output.dtype != DType::kF32 ||
      req.inputs[2].dtype != kv || (kv != DType::kF32 && kv != DType::kF16 && kv != DType::kBF16)) {
    return std::optional<Kernel>();
  }
  const Expr &mask_mod = req.attrs->expr[0], &score_mod = req.attrs->expr[1];
  // Natively: the masks and score_mods above. Anything else runs compiled (AttnArgs::mods);
  // a mask And(native, rest) keeps the native part's key range and runs whole compiled.
  const auto heads = req.inputs[0].shape[1].TryConstant();
  bool alibi = false;
  double softcap = 0;  // > 0: the cap
  Expr compiled_mask, compiled_score;
  if (score_mod && (!heads || !ClassifyPagedScore(score_mod, *heads, &alibi, &softcap))) {
    alibi = false;
    softcap = 0;
    compiled_score = score_mod;
  }
  std::optional<PagedMask> mask = ClassifyPagedMask(mask_mod);
  if (!mask) {
    const ExprNode& n = mask_mod.node();
    if (n.op == ExprOp::kAnd && n.args.size() == 2) mask = ClassifyPagedMask(n.args[0]);
    if (!mask) mask = PagedMask{};
    compiled_mask = mask_mod;
    // The compiled functions apply score_mod before the mask, as the op does: a native score
    // (applied after them) would see hidden keys' -inf.
    alibi = false;
    softcap = 0;
    compiled_score = score_mod;
  }
  auto d = std::make_shared<AttnData>();
  if (compiled_mask || compiled_score) {
    std::vector<DType> aux;
    for (size_t i = 6; i < req.inputs.size(); ++i) aux.push_back(req.inputs[i].dtype);
    StatusOr<std::shared_ptr<const AttnMods>> mods =
        AttnMods::Compile(compiled_mask, compiled_score, aux, ctx);
    if (!mods.ok()) return std::optional<Kernel>();
    d->mods = *std::move(mods);
  }
  d->k = KernelsFor(ctx.isa);
  if (d->k == nullptr) d->k = KernelsFor(Isa::kScalar);
  d->mask = mask->kind;
  d->window = mask->window;
  d->chunk = mask->chunk;
  d->scale = static_cast<float>(req.attrs->floats[0]);
  d->softcap = static_cast<float>(softcap);
  if (alibi) d->alibi_slopes = AlibiSlopes(*heads);
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  static const char* kMaskNames[] = {"none", "causal", "window"};
  std::string name = absl::StrCat(
      "cpu.paged_attention.", IsaName(d->k->isa), "[", kMaskNames[static_cast<int>(d->mask)],
      d->chunk > 0 ? absl::StrCat(" chunk ", d->chunk) : "", alibi ? " alibi" : "",
      softcap > 0 ? absl::StrCat(" softcap ", softcap) : "",
      d->mods != nullptr ? absl::StrCat(" compiled ", d->mods->label()) : "", "]");
  return std::optional<Kernel>(Kernel{PagedAttentionKernel, std::move(d), std::move(name)});
}

}  // namespace kiln::cpu
