#include "backends/cpu/kernels/attention_mods.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kiln::cpu {
namespace {

// The generated functions read AttnAux as three ki64 per tensor.
static_assert(sizeof(AttnAux) == 3 * sizeof(int64_t) && sizeof(void*) == sizeof(int64_t));

// Hand-written around the printed expressions (kiln_KERNEL_NAME_mask / _score): AUX_DECL
// unpacks the aux tensors, SCORE(v, q, kv) calls score_mod (or is v) and MASK(q, kv) calls
// mask_mod (or is 1), both passing b, h and the aux tensors on.
constexpr const char* kTemplate = R"(
KERNEL void kiln_KERNEL_NAME_apply(float* s, ki64 ld, ki64 rows, ki64 n, ki64 b, ki64 h,
                                   ki64 q0, ki64 kv0, int masked, const ki64* ax) {
  (void)ax; (void)b; (void)h;
  AUX_DECL
  for (ki64 i = 0; i < rows; ++i) {
    float* row = s + i * ld;
    const ki64 q = q0 + i;
    if (masked) {
      for (ki64 j = 0; j < n; ++j) {
        const float v = SCORE(row[j], q, kv0 + j);
        row[j] = MASK(q, kv0 + j) ? v : -__builtin_inff();
      }
    } else {
      for (ki64 j = 0; j < n; ++j) row[j] = SCORE(row[j], q, kv0 + j);
    }
  }
}
KERNEL void kiln_KERNEL_NAME_apply_at(float* s, ki64 n, ki64 b, ki64 h, ki64 q,
                                      const ki64* kv, const ki64* ax) {
  (void)ax; (void)b; (void)h; (void)q;
  AUX_DECL
  for (ki64 j = 0; j < n; ++j) {
    const float v = SCORE(s[j], q, kv[j]);
    s[j] = MASK(q, kv[j]) ? v : -__builtin_inff();
  }
}
KERNEL int kiln_KERNEL_NAME_classify(ki64 b, ki64 h, ki64 q0, ki64 rows, ki64 kv0, ki64 n,
                                     const ki64* ax) {
  (void)ax; (void)b; (void)h;
  AUX_DECL
  ki64 kept = 0;
  for (ki64 i = 0; i < rows; ++i) {
    const ki64 q = q0 + i;
    for (ki64 j = 0; j < n; ++j) kept += MASK(q, kv0 + j) ? 1 : 0;
  }
  return kept == 0 ? 0 : (kept == rows * n ? 1 : 2);
}
KERNEL int kiln_KERNEL_NAME_any(ki64 b, ki64 h, ki64 q0, ki64 rows, ki64 kv0, ki64 n,
                                const ki64* ax) {
  (void)ax; (void)b; (void)h;
  AUX_DECL
  for (ki64 i = 0; i < rows; ++i) {
    const ki64 q = q0 + i;
    for (ki64 j0 = 0; j0 < n; j0 += 16) {
      const ki64 j1 = j0 + 16 < n ? j0 + 16 : n;
      ki64 kept = 0;
      for (ki64 j = j0; j < j1; ++j) kept += MASK(q, kv0 + j) ? 1 : 0;
      if (kept != 0) return 1;
    }
  }
  return 0;
}
)";

// The key blocks of query tile `t` (rows [t * tile, ...)) of head (b, h) under `mods`' mask,
// tiles of `tile` rows and keys.
std::vector<KeyBlock> ClassifyTile(const AttnMods& mods, int64_t b, int64_t h, int64_t t,
                                   int64_t tile, int64_t tq, int64_t tk, const AttnAux* aux) {
  std::vector<KeyBlock> blocks;
  const int64_t q0 = t * tile, rows = std::min(tile, tq - q0);
  for (int64_t kv0 = 0; kv0 < tk; kv0 += tile) {
    const int64_t n = std::min(tile, tk - kv0);
    const BlockKind kind = mods.Classify(b, h, q0, rows, kv0, n, aux);
    if (kind != BlockKind::kEmpty) blocks.push_back({kv0, n, kind == BlockKind::kPartial});
  }
  return blocks;
}

}  // namespace

StatusOr<std::shared_ptr<const AttnMods>> AttnMods::Compile(const Expr& mask, const Expr& score,
                                                            std::span<const DType> aux,
                                                            const SelectContext& ctx) {
  StatusOr<std::shared_ptr<const AttnMods>> m = CompileImpl(mask, score, aux, ctx);
  if (!m.ok()) {
    // Once per reason: such attention runs on the reference kernel (correct, slower).
    static std::mutex mu;
    static auto* seen = new std::set<std::string>();
    const std::string why(StatusMessage(m.status()));
    std::lock_guard<std::mutex> l(mu);
    if (seen->insert(why).second) {
      spdlog::warn(
          "cpu: attention modifiers not compiled ({}); those layers run the reference "
          "attention kernel",
          why.substr(0, 500));
    }
  }
  return m;
}

StatusOr<std::shared_ptr<const AttnMods>> AttnMods::CompileImpl(const Expr& mask, const Expr& score,
                                                                std::span<const DType> aux,
                                                                const SelectContext& ctx) {
  if (!ctx.compile) return Unavailable("no compiler for attention modifiers");
  std::string aux_decl, aux_args;
  compiler::ExprFunction mf, sf;
  mf.num_indices = sf.num_indices = 4;
  for (size_t k = 0; k < aux.size(); ++k) {
    absl::StrAppend(&aux_decl, "const ku8* x", k, " = (const ku8*)ax[", 3 * k, "]; const ki64 xn",
                    k, " = ax[", 3 * k + 1, "], xs", k, " = ax[", 3 * k + 2, "]; (void)x", k,
                    "; (void)xn", k, "; (void)xs", k, ";");
    absl::StrAppend(&aux_args, ", x", k, ", xn", k, ", xs", k);
    mf.aux.push_back(aux[k]);
  }
  sf.aux = mf.aux;
  std::string code;
  std::string score_call = "(v)", mask_call = "1";
  if (mask) {
    mf.name = absl::StrCat(compiler::kKernelName, "_mask");
    mf.value = mask;
    KILN_ASSIGN_OR_RETURN(std::string text, GenerateExprFunction(mf, compiler::Dialect::kCpp));
    absl::StrAppend(&code, text);
    mask_call = absl::StrCat(mf.name, "(b, h, q, kv", aux_args, ")");
  }
  if (score) {
    // As the reference: score_mod computes in the f32 queries' type.
    sf.name = absl::StrCat(compiler::kKernelName, "_score");
    sf.value =
        Expr::Cast(DType::kF32, Substitute(score, std::vector<Expr>{Expr::Input(0, DType::kF32)}));
    sf.inputs = {DType::kF32};
    KILN_ASSIGN_OR_RETURN(std::string text, GenerateExprFunction(sf, compiler::Dialect::kCpp));
    absl::StrAppend(&code, text);
    score_call = absl::StrCat(sf.name, "(v, b, h, q, kv", aux_args, ")");
  }
  absl::StrAppend(&code, "#define AUX_DECL ", aux_decl, "\n#define SCORE(v, q, kv) ", score_call,
                  "\n#define MASK(q, kv) ", mask_call, "\n", kTemplate,
                  "#undef AUX_DECL\n#undef SCORE\n#undef MASK\n");
  const compiler::GeneratedKernel g = compiler::NameKernel(compiler::Dialect::kCpp, code);
  KILN_ASSIGN_OR_RETURN(std::vector<void*> fns,
                        ctx.compile(g, {"_apply", "_apply_at", "_classify", "_any"}));
  auto m = std::make_shared<AttnMods>();
  m->apply_ = reinterpret_cast<ApplyFn>(fns[0]);
  m->apply_at_ = reinterpret_cast<ApplyAtFn>(fns[1]);
  if (mask) {
    m->classify_ = reinterpret_cast<ClassifyFn>(fns[2]);
    m->any_ = reinterpret_cast<ClassifyFn>(fns[3]);
  }
  m->has_score_ = static_cast<bool>(score);
  if (mask) {
    m->reads_b_ = mask.Uses(ExprOp::kIndex, 0);
    m->reads_h_ = mask.Uses(ExprOp::kIndex, 1);
    for (int k = 0; k < static_cast<int>(aux.size()); ++k) {
      if (mask.Uses(ExprOp::kLoad, k)) m->mask_aux_.push_back(k);
    }
  }
  m->label_ = absl::StrCat(mask ? "mask" : "", mask && score ? "+" : "", score ? "score" : "");
  return std::shared_ptr<const AttnMods>(std::move(m));
}

std::vector<AttnAux> AuxTensors(const LaunchArgs& a, int first) {
  std::vector<AttnAux> aux;
  for (int i = first; i < a.num_inputs; ++i) {
    aux.push_back({a.inputs[i].data, a.inputs[i].shape[0], a.inputs[i].strides[0]});
  }
  return aux;
}

std::string AuxKey(const AttnMods& mods, const LaunchArgs& a, int first) {
  std::string key;
  for (int k : mods.mask_aux()) {
    const TensorArg& t = a.inputs[first + k];
    const int64_t size = DTypeBlockBytes(t.dtype);  // not quantized: the mask compiled
    const int64_t len = t.shape[0];
    key.append(reinterpret_cast<const char*>(&len), sizeof(len));
    const char* p = static_cast<const char*>(t.data);
    if (t.strides[0] == 1) {
      key.append(p, static_cast<size_t>(len * size));
      continue;
    }
    for (int64_t e = 0; e < len; ++e) key.append(p + e * t.strides[0] * size, size);
  }
  return key;
}

std::shared_ptr<const BlockMask> BlockMasks::For(const AttnMods& mods, int64_t b, int64_t h,
                                                 int64_t tile, int64_t tq, int64_t tk,
                                                 const AttnAux* aux,
                                                 std::string_view aux_bytes) const {
  if (!mods.mask_reads_batch()) b = -1;
  if (!mods.mask_reads_head()) h = -1;
  auto key =
      std::make_tuple(b, h, tile, tq, tk, std::string(mods.mask_reads_aux() ? aux_bytes : ""));
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      // A table holds at most one block per (query tile, key tile).
      const int64_t tiles = (tq + tile - 1) / tile, kv_tiles = (tk + tile - 1) / tile;
      const size_t bytes = std::get<5>(key).size() + static_cast<size_t>(tiles) * 32 +
                           static_cast<size_t>(tiles * kv_tiles) * sizeof(KeyBlock);
      if (cache_.size() >= kMaxTables || bytes_ + bytes > kMaxBytes) {
        cache_.clear();
        bytes_ = 0;
      }
      auto entry = std::make_shared<Entry>();
      entry->tiles = tiles;
      entry->table.tiles.resize(static_cast<size_t>(tiles));
      bytes_ += bytes;
      it = cache_.emplace(std::move(key), std::move(entry)).first;
    }
    e = it->second;
  }
  if (e->done.load(std::memory_order_acquire) < e->tiles) {
    for (int64_t t; (t = e->next.fetch_add(1, std::memory_order_relaxed)) < e->tiles;) {
      e->table.tiles[static_cast<size_t>(t)] = ClassifyTile(
          mods, std::max<int64_t>(b, 0), std::max<int64_t>(h, 0), t, tile, tq, tk, aux);
      if (e->done.fetch_add(1, std::memory_order_acq_rel) + 1 == e->tiles) {
        std::lock_guard<std::mutex> l(e->mu);
        e->finished.notify_all();
      }
    }
    std::unique_lock<std::mutex> l(e->mu);
    e->finished.wait(l, [&] { return e->done.load(std::memory_order_acquire) == e->tiles; });
  }
  return std::shared_ptr<const BlockMask>(e, &e->table);
}

}  // namespace kiln::cpu
