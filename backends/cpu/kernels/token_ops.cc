// RoPE, the KV-cache write and the embedding gradient on the cpu backend: per-token
// operations of every step, split over the pool's threads by token (RoPE by token and head),
// with direct indexing. The reference loops (thread 0 only, generic per-element indexing) took
// about a tenth of a SmolLM2 decode step while the other thread waited at the barrier. Numerics
// are the reference's exactly: rotations in double, one rounding to the output type.
#include "backends/cpu/kernels/token_ops.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/ops.h"

namespace kiln::cpu {
namespace {

using backend::Kernel;
using backend::KernelRequest;

std::pair<int64_t, int64_t> Share(int64_t n, const ExecCtx& c) {
  const int64_t per = (n + c.thread_count - 1) / c.thread_count;
  const int64_t b = std::min(n, per * c.thread_index);
  return {b, std::min(n, b + per)};
}

// ---- RoPE -------------------------------------------------------------------------------------

// cos and sin of every rotary pair's angle at positions [0, kRopeTablePositions), computed
// exactly as the kernel would (the same double angle): steps read them instead of calling
// cos and sin (64 calls per token for SmolLM2, ~2 us of a decode step's launch while the other
// threads waited). One table per distinct set of frequencies and sign, shared by every kernel
// that has them (a model's q and k rotations in every program), 2 MiB for 32 pairs.
constexpr int64_t kRopeTablePositions = 4096;
using RopeTable = std::vector<double>;  // [position][pair][cos, sin]

std::shared_ptr<const RopeTable> RopeTableFor(const std::vector<double>& inv, double sign) {
  static std::mutex mu;
  static std::map<std::pair<std::vector<double>, double>, std::weak_ptr<const RopeTable>> tables;
  std::lock_guard<std::mutex> lock(mu);
  std::erase_if(tables, [](const auto& e) { return e.second.expired(); });  // unloaded models
  std::weak_ptr<const RopeTable>& slot = tables[{inv, sign}];
  if (std::shared_ptr<const RopeTable> t = slot.lock()) return t;
  const int64_t half = static_cast<int64_t>(inv.size());
  auto t = std::make_shared<RopeTable>(static_cast<size_t>(kRopeTablePositions * half * 2));
  for (int64_t p = 0; p < kRopeTablePositions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = sign * static_cast<double>(p) * inv[i];
      (*t)[(p * half + i) * 2] = std::cos(angle);
      (*t)[(p * half + i) * 2 + 1] = std::sin(angle);
    }
  }
  slot = t;
  return t;
}

struct RopeData {
  std::vector<double> inv;  // inverse frequency per rotary pair
  bool interleaved = false;
  double sign = 1;
  std::shared_ptr<const RopeTable> table;
  Kernel fallback;
};

void RopeKernel(const LaunchArgs& a, const ExecCtx& c) {
  const RopeData& d = *static_cast<const RopeData*>(a.kernel_data);
  const TensorArg &x = a.inputs[0], &pos = a.inputs[1], &o = a.output;
  // Fast layout: x and out [T, H, D] with contiguous rows of D (any token and head strides:
  // prefill's q and k are slices of the joined q|k|v projection), positions [T].
  if (x.rank != 3 || pos.rank != 1 || o.rank != 3 || x.strides[2] != 1 || o.strides[2] != 1) {
    return RunFallback(d.fallback, a, c);
  }
  const int64_t T = x.shape[0], H = x.shape[1], D = x.shape[2];
  const int64_t half = static_cast<int64_t>(d.inv.size()), rd = 2 * half;
  // Split by (token, head) rows: one decode token's heads spread over the threads.
  const auto [r0, r1] = Share(T * H, c);
  thread_local std::vector<double> computed;  // [pair][cos, sin] beyond the table
  const double* cs = nullptr;
  int64_t cs_token = -1;
  const float* xs = static_cast<const float*>(x.data);
  float* os = static_cast<float*>(o.data);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r / H;
    if (t != cs_token) {
      cs_token = t;
      const int64_t p = LoadIndex(pos, t);
      if (p >= 0 && p < kRopeTablePositions) {
        cs = d.table->data() + p * half * 2;
      } else {
        computed.resize(static_cast<size_t>(rd));
        for (int64_t i = 0; i < half; ++i) {
          const double angle = d.sign * static_cast<double>(p) * d.inv[i];
          computed[2 * i] = std::cos(angle);
          computed[2 * i + 1] = std::sin(angle);
        }
        cs = computed.data();
      }
    }
    const int64_t h = r % H;
    const float* xr = xs + t * x.strides[0] + h * x.strides[1];
    float* orow = os + t * o.strides[0] + h * o.strides[1];
    for (int64_t i = 0; i < half; ++i) {
      const int64_t d0 = d.interleaved ? 2 * i : i, d1 = d.interleaved ? 2 * i + 1 : i + half;
      const double x0 = xr[d0], x1 = xr[d1], cosv = cs[2 * i], sinv = cs[2 * i + 1];
      orow[d0] = static_cast<float>(x0 * cosv - x1 * sinv);
      orow[d1] = static_cast<float>(x0 * sinv + x1 * cosv);
    }
    if (orow != xr) std::memcpy(orow + rd, xr + rd, static_cast<size_t>(D - rd) * sizeof(float));
  }
}

// ---- KV-cache write ---------------------------------------------------------------------------

struct KvWriteData {
  Kernel fallback;
};

void KvWriteKernel(const LaunchArgs& a, const ExecCtx& c) {
  const KvWriteData& d = *static_cast<const KvWriteData*>(a.kernel_data);
  const TensorArg &x = a.inputs[1], &slots = a.inputs[2], &cache = a.output;
  // Fast layout: a token's heads contiguous in x (any token stride: prefill's v is a slice of
  // the joined q|k|v projection), a contiguous cache.
  const bool x_rows = x.rank == 3 && x.strides[2] == 1 && x.strides[1] == x.shape[2];
  if (!x_rows || cache.rank != 4 || slots.rank != 1 || !cache.IsContiguous()) {
    return RunFallback(d.fallback, a, c);
  }
  const int64_t T = x.shape[0], row = x.shape[1] * x.shape[2];
  const int64_t capacity = cache.shape[0] * cache.shape[1];
  const auto [t0, t1] = Share(T, c);
  const float* xs = static_cast<const float*>(x.data);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = LoadIndex(slots, t);
    if (slot < 0 || slot >= capacity) continue;  // padding rows (and bad slots) write nothing
    const float* src = xs + t * x.strides[0];
    switch (cache.dtype) {
      case DType::kF32:
        std::memcpy(static_cast<float*>(cache.data) + slot * row, src,
                    static_cast<size_t>(row) * sizeof(float));
        break;
      case DType::kF16: {
        uint16_t* dst = static_cast<uint16_t*>(cache.data) + slot * row;
        for (int64_t e = 0; e < row; ++e) dst[e] = FloatToF16(src[e]);
        break;
      }
      default: {  // bf16 (MakeKvWriteKernel admits nothing else)
        uint16_t* dst = static_cast<uint16_t*>(cache.data) + slot * row;
        for (int64_t e = 0; e < row; ++e) dst[e] = FloatToBF16(src[e]);
        break;
      }
    }
  }
}

// ---- Contiguous (a strided view copied into rows) ----------------------------------------------

struct CopyData {
  Kernel fallback;
  int axis = 0;  // concat's
};

// Rows [r0, r1) of x's last axis copied to the same rows of the tensor at `dst` + `dst_offset`
// elements, whose strides are `ds` and whose last axis is dense.
template <class T>
void CopyRows(const TensorArg& x, void* dst, int64_t dst_offset, const int64_t* ds, int64_t r0,
              int64_t r1) {
  const int r = x.rank;
  const int64_t inner = x.shape[r - 1], step = x.strides[r - 1];
  const T* src = static_cast<const T*>(x.data);
  T* out = static_cast<T*>(dst) + dst_offset;
  for (int64_t row = r0; row < r1; ++row) {
    int64_t off = 0, doff = 0, rem = row;
    for (int i = r - 2; i >= 0; --i) {
      const int64_t at = rem % x.shape[i];
      off += at * x.strides[i];
      doff += at * ds[i];
      rem /= x.shape[i];
    }
    T* d = out + doff;
    if (step == 1) {
      std::memcpy(d, src + off, static_cast<size_t>(inner) * sizeof(T));
    } else {
      for (int64_t e = 0; e < inner; ++e) d[e] = src[off + e * step];
    }
  }
}

// CopyRows by element size (1, 2, 4 or 8 bytes).
void CopyRowsOfSize(int64_t bytes, const TensorArg& x, void* dst, int64_t dst_offset,
                    const int64_t* ds, int64_t r0, int64_t r1) {
  switch (bytes) {
    case 1:
      return CopyRows<uint8_t>(x, dst, dst_offset, ds, r0, r1);
    case 2:
      return CopyRows<uint16_t>(x, dst, dst_offset, ds, r0, r1);
    case 4:
      return CopyRows<uint32_t>(x, dst, dst_offset, ds, r0, r1);
    default:
      return CopyRows<uint64_t>(x, dst, dst_offset, ds, r0, r1);
  }
}

int64_t Rows(const TensorArg& x) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < x.rank; ++i) rows *= x.shape[i];
  return rows;
}

// Attention's head transposes in training (q/k/v [B, T, H, D] <-> [B, H, T, D] and their
// gradients): rows of the last axis split over the pool, memcpy where that axis is dense.
void ContiguousKernel(const LaunchArgs& a, const ExecCtx& c) {
  const CopyData& d = *static_cast<const CopyData*>(a.kernel_data);
  const TensorArg &x = a.inputs[0], &o = a.output;
  if (x.rank < 1 || !o.IsContiguous() || x.rank != o.rank) return RunFallback(d.fallback, a, c);
  const auto [r0, r1] = Share(Rows(x), c);
  CopyRowsOfSize(DTypeBytes(x.dtype, 1), x, o.data, 0, o.strides, r0, r1);
}

// Concatenation into a contiguous output (the chunked classifier's dx, 4 x [256, 576] in a
// fine-tuning step, took 9.5 ms on the reference's one thread): each input's rows copied into
// its slice of the output, the rows of all inputs split over the pool.
void ConcatKernel(const LaunchArgs& a, const ExecCtx& c) {
  const CopyData& d = *static_cast<const CopyData*>(a.kernel_data);
  const TensorArg& o = a.output;
  if (o.rank < 1 || !o.IsContiguous()) return RunFallback(d.fallback, a, c);
  int64_t total = 0;
  for (int j = 0; j < a.num_inputs; ++j) {
    if (a.inputs[j].rank != o.rank) return RunFallback(d.fallback, a, c);
    total += Rows(a.inputs[j]);
  }
  const auto [r0, r1] = Share(total, c);
  const int64_t bytes = DTypeBytes(o.dtype, 1);
  int64_t first_row = 0, at = 0;  // input j's first row among all, and its offset along the axis
  for (int j = 0; j < a.num_inputs; ++j) {
    const TensorArg& x = a.inputs[j];
    const int64_t rows = Rows(x);
    const int64_t lo = std::max(r0, first_row) - first_row;
    const int64_t hi = std::min(r1, first_row + rows) - first_row;
    if (lo < hi) CopyRowsOfSize(bytes, x, o.data, at * o.strides[d.axis], o.strides, lo, hi);
    first_row += rows;
    at += x.shape[d.axis];
  }
}

// ---- Embedding gradient -------------------------------------------------------------------

// scatter_add_rows (the embedding's gradient: zeros [V, E], row ids[i] += src[i]): each
// thread owns a range of output rows, zeroes them and adds the source rows that land in them
// in the order of `ids`, as the reference does (f32 adds: the same roundings), so no two
// threads write one row. The reference loop ran on one thread with per-element indexing
// (~100 ms per full fine-tuning step of SmolLM2, V = 49,152).
void ScatterAddRowsKernel(const LaunchArgs& a, const ExecCtx& c) {
  const Kernel& fallback = *static_cast<const Kernel*>(a.kernel_data);
  const TensorArg &ids = a.inputs[0], &src = a.inputs[1], &o = a.output;
  if (ids.rank != 1 || src.rank != 2 || o.rank != 2 || !o.IsContiguous() || !InnerContiguous(src) ||
      src.shape[0] != ids.shape[0] || src.shape[1] != o.shape[1]) {
    return RunFallback(fallback, a, c);
  }
  const int64_t V = o.shape[0], E = o.shape[1];
  const auto [v0, v1] = Share(V, c);
  if (v0 >= v1) return;
  float* out = static_cast<float*>(o.data);
  std::memset(out + v0 * E, 0, static_cast<size_t>((v1 - v0) * E) * sizeof(float));
  const float* in = static_cast<const float*>(src.data);
  for (int64_t i = 0; i < ids.shape[0]; ++i) {
    const int64_t r = LoadIndex(ids, i);
    if (r < v0 || r >= v1) continue;  // also skips ids outside [0, V), as the reference does
    const float* row = in + i * src.strides[0];
    float* dst = out + r * E;
    for (int64_t e = 0; e < E; ++e) dst[e] += row[e];
  }
}

bool IsIndex(DType t) { return t == DType::kI32 || t == DType::kI64; }

}  // namespace

StatusOr<std::optional<Kernel>> MakeRopeKernel(const KernelRequest& req, const SelectContext& ctx) {
  if (req.inputs.size() != 2 || req.inputs[0].dtype != DType::kF32 ||
      req.output.dtype != DType::kF32 || !IsIndex(req.inputs[1].dtype)) {
    return std::optional<Kernel>();
  }
  auto d = std::make_shared<RopeData>();
  const Attrs& at = *req.attrs;
  const int64_t half = at.ints[0] / 2;
  for (int64_t i = 0; i < half; ++i) d->inv.push_back(RopeInvFreq(at, i));
  d->interleaved = at.ints[1] == 1;
  d->sign = at.ints[3] ? -1.0 : 1.0;
  d->table = RopeTableFor(d->inv, d->sign);
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  return std::optional<Kernel>(Kernel{RopeKernel, std::move(d), "cpu.rope"});
}

StatusOr<std::optional<Kernel>> MakeKvWriteKernel(const KernelRequest& req,
                                                  const SelectContext& ctx) {
  const DType cache = req.output.dtype;
  if (req.inputs.size() != 3 || req.inputs[1].dtype != DType::kF32 ||
      !IsIndex(req.inputs[2].dtype) ||
      (cache != DType::kF32 && cache != DType::kF16 && cache != DType::kBF16)) {
    return std::optional<Kernel>();
  }
  auto d = std::make_shared<KvWriteData>();
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  return std::optional<Kernel>(
      Kernel{KvWriteKernel, std::move(d), absl::StrCat("cpu.kv_write.", DTypeName(cache))});
}

StatusOr<std::optional<Kernel>> MakeContiguousKernel(const KernelRequest& req,
                                                     const SelectContext& ctx) {
  const DType t = req.output.dtype;
  if (req.inputs.size() != 1 || req.inputs[0].dtype != t || IsQuantized(t)) {
    return std::optional<Kernel>();
  }
  const int64_t bytes = DTypeBytes(t, 1);
  if (bytes != 1 && bytes != 2 && bytes != 4 && bytes != 8) return std::optional<Kernel>();
  auto d = std::make_shared<CopyData>();
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  return std::optional<Kernel>(Kernel{ContiguousKernel, std::move(d), "cpu.contiguous"});
}

StatusOr<std::optional<Kernel>> MakeConcatKernel(const KernelRequest& req,
                                                 const SelectContext& ctx) {
  const DType t = req.output.dtype;
  if (req.inputs.empty() || IsQuantized(t)) return std::optional<Kernel>();
  for (const auto& in : req.inputs) {
    if (in.dtype != t) return std::optional<Kernel>();
  }
  const int64_t bytes = DTypeBytes(t, 1);
  if (bytes != 1 && bytes != 2 && bytes != 4 && bytes != 8) return std::optional<Kernel>();
  auto d = std::make_shared<CopyData>();
  d->axis = static_cast<int>(req.attrs->ints[0]);
  KILN_ASSIGN_OR_RETURN(d->fallback, ctx.reference(req));
  return std::optional<Kernel>(Kernel{ConcatKernel, std::move(d), "cpu.concat"});
}

StatusOr<std::optional<Kernel>> MakeScatterAddRowsKernel(const KernelRequest& req,
                                                         const SelectContext& ctx) {
  if (req.inputs.size() != 2 || !IsIndex(req.inputs[0].dtype) ||
      req.inputs[1].dtype != DType::kF32 || req.output.dtype != DType::kF32) {
    return std::optional<Kernel>();
  }
  KILN_ASSIGN_OR_RETURN(Kernel fallback, ctx.reference(req));
  return std::optional<Kernel>(Kernel{
      ScatterAddRowsKernel, std::make_shared<Kernel>(std::move(fallback)), "cpu.scatter_add_rows"});
}

}  // namespace kiln::cpu
