// The CPU backend. Pointwise, generator and reduction ops run generated C++ compiled from the
// op table's expression forms (backends/cpu/jit), with an interpreter of the same forms as
// the fallback (no compiler, KILN_CPU_JIT=0) — so the op harness, comparing this backend with
// `ref`, proves every form and its generated code right; fused groups from compiler::Compile
// run generated code too. Both split their rows over the stream's thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"
#include "backends/builtin.h"
#include "backends/cpu/cpu_budget.h"
#include "backends/cpu/jit/fused.h"
#include "backends/cpu/kernels/kernels.h"
#include "backends/cpu/kernels/select.h"
#include "backends/cpu/threaded_ref.h"
#include "backends/host/host_device.h"
#include "backends/ref/ref_kernels.h"
#include "spdlog/spdlog.h"

namespace kiln::backend {
namespace {

bool IsFloatExpr(DType t) { return t == DType::kF32 || t == DType::kF64; }

ExprValue LoadValue(const TensorArg& t, int64_t off, DType expr_type) {
  ExprValue v;
  if (IsFloatExpr(expr_type)) {
    v.f = LoadElement(t.data, t.dtype, off);
  } else {
    v.i = LoadInt(t.data, t.dtype, off);
  }
  return v;
}

void StoreValue(const TensorArg& t, int64_t off, ExprValue v, DType expr_type) {
  if (IsFloatExpr(expr_type)) {
    StoreElement(t.data, t.dtype, off, v.f);
  } else {
    StoreInt(t.data, t.dtype, off, v.i);
  }
}

int64_t Offset(const TensorArg& t, const int64_t* idx) {
  int64_t o = 0;
  for (int d = 0; d < t.rank; ++d) o += idx[d] * t.strides[d];
  return o;
}

// idx = the row-major multi-index of linear position `pos` in `shape`.
void Unravel(int64_t pos, const int64_t* shape, int rank, int64_t* idx) {
  for (int d = rank - 1; d >= 0; --d) {
    const int64_t s = shape[d] > 0 ? shape[d] : 1;
    idx[d] = pos % s;
    pos /= s;
  }
}

void Advance(int64_t* idx, const int64_t* shape, int rank) {
  for (int d = rank - 1; d >= 0; --d) {
    if (++idx[d] < shape[d]) return;
    idx[d] = 0;
  }
}

// This thread's share [begin, end) of n items.
std::pair<int64_t, int64_t> Share(int64_t n, const ExecCtx& c) {
  return {n * c.thread_index / c.thread_count, n * (c.thread_index + 1) / c.thread_count};
}

struct AuxCtx {
  const TensorArg* aux;
  int count;
};
ExprValue LoadAux(const void* ctx, int k, int64_t i, DType type) {
  const AuxCtx& a = *static_cast<const AuxCtx*>(ctx);
  if (k >= a.count || i < 0 || i >= a.aux[k].shape[0]) {
    ExprValue z;
    z.i = 0;
    if (IsFloatExpr(type)) z.f = 0;
    return z;
  }
  return LoadValue(a.aux[k], i * a.aux[k].strides[0], type);
}

// ---- Pointwise: evaluate the form at every output element ----

struct PointwiseData {
  ExprProgram prog;
  std::vector<DType> leaf;  // expression type each input loads as
  int num_main = 0;
  int num_aux = 0;
};

void PointwiseKernel(const LaunchArgs& a, const ExecCtx& c) {
  const PointwiseData& d = *static_cast<const PointwiseData*>(a.kernel_data);
  const TensorArg& o = a.output;
  const auto [begin, end] = Share(o.numel(), c);
  if (begin >= end) return;
  int64_t idx[kMaxRank] = {};
  Unravel(begin, o.shape, o.rank, idx);
  ExprValue vals[16];
  const AuxCtx aux{a.inputs + d.num_main, d.num_aux};
  ExprEnv env;
  env.inputs = vals;
  env.index = idx;
  env.load = LoadAux;
  env.load_ctx = &aux;
  for (int64_t k = begin; k < end; ++k) {
    for (int i = 0; i < d.num_main; ++i)
      vals[i] = LoadValue(a.inputs[i], Offset(a.inputs[i], idx), d.leaf[i]);
    StoreValue(o, Offset(o, idx), d.prog.Eval(env), d.prog.type());
    Advance(idx, o.shape, o.rank);
  }
}

// ---- Reductions: run the form's stages over each row ----

struct ReduceData {
  std::vector<ExprProgram> stages;
  std::vector<ReduceKind> kinds;
  ExprProgram output;
  bool elementwise = false;
  bool keepdim = false;
  std::vector<int> axes;    // reduced axes of input 0
  std::vector<DType> leaf;  // per input
};

void Combine(ReduceKind kind, DType t, ExprValue v, int64_t pos, ExprValue& acc,
             int64_t& best_pos) {
  const bool fl = IsFloatExpr(t);
  const auto round = [&](double x) {
    return t == DType::kF32 ? static_cast<double>(static_cast<float>(x)) : x;
  };
  switch (kind) {
    case ReduceKind::kSum:
      if (fl) {
        acc.f = round(acc.f + v.f);
      } else {
        acc.i = static_cast<int64_t>(static_cast<uint64_t>(acc.i) + static_cast<uint64_t>(v.i));
      }
      return;
    case ReduceKind::kMax:
      if (fl) {
        acc.f = (std::isnan(acc.f) || std::isnan(v.f)) ? std::numeric_limits<double>::quiet_NaN()
                                                       : std::max(acc.f, v.f);
      } else {
        acc.i = std::max(acc.i, v.i);
      }
      return;
    case ReduceKind::kMin:
      if (fl) {
        acc.f = (std::isnan(acc.f) || std::isnan(v.f)) ? std::numeric_limits<double>::quiet_NaN()
                                                       : std::min(acc.f, v.f);
      } else {
        acc.i = std::min(acc.i, v.i);
      }
      return;
    case ReduceKind::kArgMax:
      if (fl ? ((std::isnan(v.f) && !std::isnan(acc.f)) || v.f > acc.f) : v.i > acc.i) {
        acc = v;
        best_pos = pos;
      }
      return;
  }
}

ExprValue Init(ReduceKind kind, DType t) {
  ExprValue v;
  const bool fl = IsFloatExpr(t);
  const double inf = std::numeric_limits<double>::infinity();
  switch (kind) {
    case ReduceKind::kSum:
      fl ? (void)(v.f = 0) : (void)(v.i = 0);
      break;
    case ReduceKind::kMin:
      fl ? (void)(v.f = inf) : (void)(v.i = std::numeric_limits<int64_t>::max());
      break;
    default:
      fl ? (void)(v.f = -inf) : (void)(v.i = std::numeric_limits<int64_t>::min());
      break;
  }
  return v;
}

void ReduceKernel(const LaunchArgs& a, const ExecCtx& c) {
  const ReduceData& d = *static_cast<const ReduceData*>(a.kernel_data);
  const TensorArg& x = a.inputs[0];
  const TensorArg& o = a.output;
  bool reduced[kMaxRank] = {};
  for (int ax : d.axes) reduced[ax] = true;
  int64_t kshape[kMaxRank], rshape[kMaxRank];
  int kaxes[kMaxRank], raxes[kMaxRank], nk = 0, nr = 0;
  for (int i = 0; i < x.rank; ++i) {
    if (reduced[i]) {
      raxes[nr] = i;
      rshape[nr++] = x.shape[i];
    } else {
      kaxes[nk] = i;
      kshape[nk++] = x.shape[i];
    }
  }
  int64_t rows = 1, count = 1;
  for (int i = 0; i < nk; ++i) rows *= kshape[i];
  for (int i = 0; i < nr; ++i) count *= rshape[i];
  const auto [begin, end] = Share(rows, c);
  ExprValue vals[8], accs[8];
  int64_t pos_index[1] = {0};
  ExprEnv env;
  env.inputs = vals;
  env.index = pos_index;
  env.acc = accs;
  env.count = count;
  for (int64_t row = begin; row < end; ++row) {
    int64_t kidx[kMaxRank] = {}, xi[kMaxRank] = {};
    Unravel(row, kshape, nk, kidx);
    for (int i = 0; i < nk; ++i) xi[kaxes[i]] = kidx[i];
    // Per-row inputs (e.g. cross-entropy targets) are indexed by the kept axes.
    for (int i = 1; i < a.num_inputs; ++i)
      vals[i] = LoadValue(a.inputs[i], Offset(a.inputs[i], kidx), d.leaf[i]);
    auto for_each_reduced = [&](auto&& fn) {
      if (count == 0) return;
      int64_t ridx[kMaxRank] = {};
      for (int64_t p = 0; p < count; ++p) {
        for (int i = 0; i < nr; ++i) xi[raxes[i]] = ridx[i];
        pos_index[0] = p;
        fn(p);
        Advance(ridx, rshape, nr);
      }
    };
    for (size_t s = 0; s < d.stages.size(); ++s) {
      ExprValue acc = Init(d.kinds[s], d.stages[s].type());
      int64_t best = 0;
      for_each_reduced([&](int64_t p) {
        vals[0] = LoadValue(x, Offset(x, xi), d.leaf[0]);
        Combine(d.kinds[s], d.stages[s].type(), d.stages[s].Eval(env), p, acc, best);
      });
      if (d.kinds[s] == ReduceKind::kArgMax) acc.i = best;
      accs[s] = acc;
    }
    if (d.elementwise) {
      for_each_reduced([&](int64_t) {
        vals[0] = LoadValue(x, Offset(x, xi), d.leaf[0]);
        StoreValue(o, Offset(o, xi), d.output.Eval(env), d.output.type());
      });
      continue;
    }
    int64_t oi[kMaxRank] = {};
    if (d.keepdim) {
      for (int i = 0; i < nk; ++i) oi[kaxes[i]] = kidx[i];
    } else {
      for (int i = 0; i < nk; ++i) oi[i] = kidx[i];
    }
    StoreValue(o, Offset(o, oi), d.output.Eval(env), d.output.type());
  }
}

class CpuDevice final : public HostDevice {
 public:
  CpuDevice(int threads, CpuOptions options) : HostDevice("cpu:0", threads), options_(options) {
    jit_.SetSpecFn(cpu::jit::JitSpecFor);
  }

  // Streams that also watch the cgroup's CPU quota (StragglerPolicy::quota_cpus).
  StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    StragglerPolicy policy = StragglerPolicyFromEnv();
    policy.quota_cpus = [] { return ReadCpuBudget().quota_cpus; };
    return std::unique_ptr<Stream>(new HostStream(this, threads(), std::move(policy)));
  }

  // The compiler's view of this device (engine/compiler/target.h): fusion and batch builds.
  void* GetExtension(std::string_view name) override {
    if (name == compiler::kTargetExtension) return static_cast<compiler::Target*>(&jit_);
    return HostDevice::GetExtension(name);
  }

  StatusOr<Kernel> GetKernel(const KernelRequest& req) override {
    // Fused groups from compiler::Compile run generated code (backends/cpu/jit).
    if (const compiler::FusedGroup* g = compiler::FusedGroupOf(req)) {
      return cpu::jit::FusedKernel(*g, jit_,
                                   [this](const KernelRequest& r) { return GetKernel(r); });
    }
    // Hand-tuned kernels (backends/cpu/kernels: GEMV/GEMM, paged attention) where they apply.
    cpu::SelectContext ctx = cpu::DefaultSelectContext(this, threads(), ref::KernelFor);
    ctx.q8_activations = ctx.q8_activations || options_.q8_activations;
    ctx.bf16_activations = ctx.bf16_activations || options_.bf16_activations;
    ctx.compile = [this](const compiler::GeneratedKernel& g, const std::vector<std::string>& fns) {
      return jit_.GetFunctions(g, fns);
    };
    KILN_ASSIGN_OR_RETURN(std::optional<Kernel> fast, cpu::SelectKernel(req, ctx));
    if (fast) return *std::move(fast);
    if (std::optional<Kernel> k = cpu::ThreadedReferenceKernel(req)) return *std::move(k);
    const OpDef& def = GetOpDef(req.op);
    std::vector<DType> in;
    for (const TensorType& t : req.inputs) in.push_back(t.dtype);
    if (def.pointwise != nullptr) {
      auto d = std::make_shared<PointwiseData>();
      d->prog = ExprProgram(def.pointwise(*req.attrs, in, req.output.dtype));
      d->num_aux = req.op == OpKind::kMap && !req.attrs->ints.empty()
                       ? static_cast<int>(req.attrs->ints[0])
                       : 0;
      d->num_main = static_cast<int>(in.size()) - d->num_aux;
      if (d->num_main > 16) return ref::KernelFor(req);
      for (DType t : in) d->leaf.push_back(ExprTypeOf(t));
      // Generated code where it builds; the interpreter as its fallback.
      return cpu::jit::ExpressionKernel(
          jit_, req, Kernel{PointwiseKernel, std::move(d), absl::StrCat("cpu.expr.", def.name)});
    }
    if (def.reduce != nullptr) {
      const ReduceForm form = def.reduce(*req.attrs, in, req.output.dtype);
      auto d = std::make_shared<ReduceData>();
      for (const ReduceStage& s : form.stages) {
        d->stages.emplace_back(s.value);
        d->kinds.push_back(s.kind);
      }
      if (d->stages.size() > 8 || in.size() > 8) return ref::KernelFor(req);
      d->output = ExprProgram(form.output);
      d->elementwise = form.elementwise_output;
      const int rank = static_cast<int>(req.inputs[0].shape.size());
      if (def.cls == OpClass::kReduce) {
        d->keepdim = req.attrs->ints[0] != 0;
        for (size_t i = 1; i < req.attrs->ints.size(); ++i)
          d->axes.push_back(static_cast<int>(req.attrs->ints[i]));
      } else {
        d->axes = {rank - 1};
      }
      for (DType t : in) d->leaf.push_back(ExprTypeOf(t));
      return cpu::jit::ExpressionKernel(
          jit_, req, Kernel{ReduceKernel, std::move(d), absl::StrCat("cpu.reduce.", def.name)});
    }
    KILN_ASSIGN_OR_RETURN(Kernel k, ref::KernelFor(req));
    k.name = absl::StrCat("cpu.", k.name);
    return k;
  }

 private:
  const CpuOptions options_;
  cpu::jit::CpuJit jit_;
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, CpuOptions options) : device_(threads, options) {}
  std::string_view name() const override { return "cpu"; }
  int device_count() const override { return 1; }
  Device* device(int index) override { return index == 0 ? &device_ : nullptr; }

 private:
  CpuDevice device_;
};

// KILN_CPU_THREADS, else the CPUs this process may use (affinity and cgroup quota,
// cpu_budget.h), at most 8. Read at each backend's creation (a model load), so a changed
// quota applies to the next model; logged when the count differs from the last one logged.
int DefaultThreads() {
  if (const char* env = std::getenv("KILN_CPU_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const CpuBudget b = ReadCpuBudget();
  const int n = std::clamp(b.cpus(), 1, 8);
  static std::atomic<int> logged{0};
  if (logged.exchange(n) != n) {
    if (b.quota_cpus) {
      spdlog::info(
          "cpu backend: {} threads ({} CPUs in the affinity mask, cgroup quota {:.2f} CPUs "
          "from {})",
          n, b.affinity_cpus, *b.quota_cpus, b.quota_source);
    } else {
      spdlog::info("cpu backend: {} threads ({} CPUs in the affinity mask, no cgroup CPU quota)", n,
                   b.affinity_cpus);
    }
  }
  return n;
}

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int threads, CpuOptions options) {
  if (options.bf16_activations && cpu::Bf16KernelsFor(cpu::ActiveIsa()) == nullptr) {
    spdlog::warn(
        "activations: bf16 needs AVX-512 BF16 (vdpbf16ps) running faster than FMAs, and the "
        "avx512 kernels; this CPU ({}, kernels {}, vdpbf16ps at {:.2f}x the FMAs' multiply-adds) "
        "runs bf16 weights with exact f32 activations instead",
        cpu::CpuDescription(), cpu::IsaName(cpu::ActiveIsa()), cpu::Bf16DotSpeedup());
  }
  return std::make_unique<CpuBackend>(threads > 0 ? threads : DefaultThreads(), options);
}

}  // namespace kiln::backend
