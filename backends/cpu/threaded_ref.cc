#include "backends/cpu/threaded_ref.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/ref/ref_kernels.h"
#include "engine/backend/launch_scratch.h"
#include "engine/sampling.h"

namespace kiln::cpu {
namespace {

// This thread's share [begin, end) of n items.
std::pair<int64_t, int64_t> Share(int64_t n, const ExecCtx& c) {
  return {n * c.thread_index / c.thread_count, n * (c.thread_index + 1) / c.thread_count};
}

struct TrainingData {
  int64_t ignore_index = 0;    // fused_cross_entropy
  OpKind op = OpKind::kAdamW;  // optimizers: the op and its attributes
  Attrs attrs;
};
const TrainingData& Data(const LaunchArgs& a) {
  return *static_cast<const TrainingData*>(a.kernel_data);
}

void FusedCrossEntropyKernel(const LaunchArgs& a, const ExecCtx& c) {
  const auto [begin, end] = Share(ref::FusedCrossEntropyRowCount(a), c);
  ref::FusedCrossEntropyRows(a, Data(a).ignore_index, begin, end);
}

void OptimizerKernel(const LaunchArgs& a, const ExecCtx& c) {
  const auto [begin, end] = Share(a.output.numel(), c);
  ref::OptimizerElements(a, Data(a).op, Data(a).attrs, begin, end);
}

// Plain greedy rows (temperature 0; no penalty, logit bias, ban or token mask in effect; no
// logprobs) are an argmax over the vocabulary. With fewer rows than threads, every thread
// scans a slice of each row's vocabulary and the last one to finish combines the slices, so a
// one-sequence decode step no longer waits while one thread scans 49,152 logits (0.17 ms of a
// 12.6 ms SmolLM2 step). The result is std::max_element's, as sampling::Pick's: the first
// maximum; a NaN first logit wins; other NaNs never do.
struct ArgmaxScratch {
  std::vector<int64_t> best;  // [row][thread]: the slice's first maximum, -1 if none
  std::atomic<int> arrived{0};
};
struct SampleData {
  backend::LaunchScratch<ArgmaxScratch> scratch;
  // Launch `a`'s scratch with room for `slots` slices.
  ArgmaxScratch* For(const LaunchArgs* a, size_t slots) const {
    return &scratch.For(a, [&](ArgmaxScratch& s) {
      if (s.best.size() < slots) s.best.resize(slots);
    });
  }
};

int64_t At(const TensorArg& t, int64_t i, int64_t j) {
  return i * t.strides[0] + j * (t.rank > 1 ? t.strides[1] : 0);
}

// Every row of the launch is plain greedy (see above).
bool PlainGreedy(const LaunchArgs& a) {
  const TensorArg &logits = a.inputs[0], &params = a.inputs[1], &pen_tokens = a.inputs[3];
  const TensorArg& banned = a.inputs[5];
  const TensorArg* bias = a.num_inputs > 6 ? &a.inputs[6] : nullptr;
  const TensorArg* allowed = a.num_inputs > 7 ? &a.inputs[7] : nullptr;
  const int64_t S = logits.shape[0], V = logits.shape[1];
  for (int64_t s = 0; s < S; ++s) {
    float prm[sampling::kNumParams];
    for (int k = 0; k < sampling::kNumParams; ++k) {
      prm[k] = static_cast<const float*>(params.data)[At(params, s, k)];
    }
    const sampling::RowParams p = sampling::UnpackParams(prm);
    if (p.temperature != 0.0f || p.logprobs >= 0 || p.repetition_penalty != 1.0f ||
        p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
      return false;
    }
    for (int64_t j = 0; bias != nullptr && j < pen_tokens.shape[1]; ++j) {
      const int32_t t = static_cast<const int32_t*>(pen_tokens.data)[At(pen_tokens, s, j)];
      if (t >= 0 && t < V && static_cast<const float*>(bias->data)[At(*bias, s, j)] != 0.0f) {
        return false;
      }
    }
    for (int64_t j = 0; j < banned.shape[1]; ++j) {
      const int32_t t = static_cast<const int32_t*>(banned.data)[At(banned, s, j)];
      if (t >= 0 && t < V) return false;
    }
    for (int64_t w = 0; allowed != nullptr && w < allowed->shape[1]; ++w) {
      if (static_cast<const int32_t*>(allowed->data)[At(*allowed, s, w)] != -1) return false;
    }
  }
  return true;
}

void SampleKernel(const LaunchArgs& a, const ExecCtx& c) {
  const int64_t S = ref::SampleRowCount(a);
  if (c.thread_count <= 1 || S >= c.thread_count || !PlainGreedy(a)) {
    const auto [begin, end] = Share(S, c);
    return ref::SampleRows(a, begin, end);
  }
  const TensorArg& logits = a.inputs[0];
  const int64_t V = logits.shape[1], nt = c.thread_count;
  ArgmaxScratch* sc = static_cast<const SampleData*>(a.kernel_data)->For(&a, S * nt);
  const auto [v0, v1] = Share(V, c);
  const float* base = static_cast<const float*>(logits.data);
  auto logit = [&](int64_t s, int64_t v) { return base[At(logits, s, v)]; };
  for (int64_t s = 0; s < S; ++s) {
    // Slice 0 keeps max_element's start at 0 (a NaN there wins); later slices start at their
    // first non-NaN logit.
    int64_t best = v0 == 0 && v0 < v1 ? 0 : -1;
    for (int64_t v = v0; v < v1; ++v) {
      const float l = logit(s, v);
      if (best < 0) {
        if (!std::isnan(l)) best = v;
      } else if (logit(s, best) < l) {
        best = v;
      }
    }
    sc->best[s * nt + c.thread_index] = best;
  }
  // The last slice to finish combines (acquire: it sees every slice's result).
  if (sc->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 < nt) return;
  sc->arrived.store(0, std::memory_order_relaxed);  // ready for the next launch
  const TensorArg &token = a.output, &logprob = a.extra_outputs[0];
  const TensorArg &top_ids = a.extra_outputs[1], &top_lps = a.extra_outputs[2];
  for (int64_t s = 0; s < S; ++s) {
    int64_t best = sc->best[s * nt];
    for (int64_t t = 1; t < nt; ++t) {
      const int64_t b = sc->best[s * nt + t];
      if (b >= 0 && (best < 0 || logit(s, best) < logit(s, b))) best = b;
    }
    const bool none = best < 0 || logit(s, best) == -std::numeric_limits<float>::infinity();
    static_cast<int32_t*>(token.data)[s * token.strides[0]] =
        none ? sampling::kNoToken : static_cast<int32_t>(best);
    static_cast<float*>(logprob.data)[s * logprob.strides[0]] = 0.0f;
    for (int64_t i = 0; i < top_ids.shape[1]; ++i) {
      static_cast<int32_t*>(top_ids.data)[At(top_ids, s, i)] = -1;
      static_cast<float*>(top_lps.data)[At(top_lps, s, i)] = 0.0f;
    }
  }
}

// gather of whole rows of a table in the output's own dtype (embeddings: token and position
// rows), copied with memcpy over the threads; other layouts run the reference loop, which
// converts element by element.
struct GatherData {
  backend::Kernel reference;
};

bool DenseRows(const TensorArg& t) {  // every axis but the first is dense
  int64_t expect = 1;
  for (int d = t.rank - 1; d >= 1; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expect) return false;
    expect *= t.shape[d];
  }
  return true;
}

void GatherKernel(const LaunchArgs& a, const ExecCtx& c) {
  const TensorArg &table = a.inputs[0], &ids = a.inputs[1], &o = a.output;
  const bool fast = table.dtype == o.dtype && DenseRows(table) && o.IsContiguous() &&
                    ids.IsContiguous() && (ids.dtype == DType::kI32 || ids.dtype == DType::kI64);
  if (!fast) {
    const backend::Kernel& ref = static_cast<const GatherData*>(a.kernel_data)->reference;
    LaunchArgs args = a;
    args.kernel_data = ref.data.get();
    ref.fn(args, c);
    return;
  }
  int64_t row_elems = 1;
  for (int d = 1; d < table.rank; ++d) row_elems *= table.shape[d];
  const size_t row_bytes = static_cast<size_t>(ByteOffset(table.dtype, row_elems));
  const auto [begin, end] = Share(ids.numel(), c);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = ids.dtype == DType::kI32 ? static_cast<const int32_t*>(ids.data)[i]
                                               : static_cast<const int64_t*>(ids.data)[i];
    char* dst = static_cast<char*>(o.data) + static_cast<size_t>(i) * row_bytes;
    if (r < 0 || r >= table.shape[0]) {
      std::memset(dst, 0, row_bytes);  // out of range: zeros, as the reference
    } else {
      std::memcpy(
          dst, static_cast<const char*>(table.data) + ByteOffset(table.dtype, r * table.strides[0]),
          row_bytes);
    }
  }
}

}  // namespace

std::optional<backend::Kernel> ThreadedReferenceKernel(const backend::KernelRequest& req) {
  auto d = std::make_shared<TrainingData>();
  switch (req.op) {
    case OpKind::kFusedCrossEntropy:
      d->ignore_index = req.attrs->ints[0];
      return backend::Kernel{FusedCrossEntropyKernel, std::move(d), "cpu.fused_cross_entropy"};
    case OpKind::kAdamW:
    case OpKind::kAdam:
    case OpKind::kSgd:
    case OpKind::kAdagrad:
      d->op = req.op;
      d->attrs = *req.attrs;
      return backend::Kernel{OptimizerKernel, std::move(d), absl::StrCat("cpu.", OpName(req.op))};
    case OpKind::kSample:
      return backend::Kernel{SampleKernel, std::make_shared<SampleData>(), "cpu.sample"};
    case OpKind::kGather: {
      if (req.inputs[0].dtype != req.output.dtype || IsQuantized(req.output.dtype)) {
        return std::nullopt;
      }
      StatusOr<backend::Kernel> reference = ref::KernelFor(req);
      if (!reference.ok()) return std::nullopt;
      auto g = std::make_shared<GatherData>();
      g->reference = *std::move(reference);
      return backend::Kernel{GatherKernel, std::move(g), "cpu.gather"};
    }
    default:
      return std::nullopt;
  }
}

}  // namespace kiln::cpu
