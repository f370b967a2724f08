#include "backends/cpu/jit/fused.h"

#include <atomic>
#include <thread>

namespace kiln::cpu::jit {
namespace {

// A barrier for the threads of one launch (they all run the same kernel; the pool's own
// barrier only separates launches).
class LaunchBarrier {
 public:
  void Wait(int threads) const {
    if (threads <= 1) return;
    const uint32_t gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      gen_.notify_all();
      return;
    }
    for (int spin = 0; spin < 4096; ++spin) {
      if (gen_.load(std::memory_order_acquire) != gen) return;
    }
    while (gen_.load(std::memory_order_acquire) == gen) gen_.wait(gen, std::memory_order_acquire);
  }

 private:
  mutable std::atomic<int> arrived_{0};
  mutable std::atomic<uint32_t> gen_{0};
};

struct GemmEpilogueData {
  Kernel gemm;
  compiler::GemmEpilogue epilogue;
  LaunchBarrier barrier;
};

void GemmWithEpilogue(const LaunchArgs& a, const ExecCtx& c) {
  const auto& d = *static_cast<const GemmEpilogueData*>(a.kernel_data);
  LaunchArgs g = a;  // the GEMM sees its own data and its two operands
  g.kernel_data = d.gemm.data.get();
  g.num_inputs = 2;
  d.gemm.fn(g, c);
  const TensorArg& o = a.output;
  int64_t rows = 1;
  for (int i = 0; i + 1 < o.rank; ++i) rows *= o.shape[i];
  if (c.shares_in_sequence) {
    // No barrier (the later shares have not run yet): the last share, after every GEMM share,
    // applies the epilogue to all rows. It is element-wise, so the split does not matter.
    if (c.thread_index + 1 == c.thread_count) d.epilogue.inplace(a, 0, rows);
    return;
  }
  d.barrier.Wait(c.thread_count);
  const int64_t cols = o.rank > 0 ? o.shape[o.rank - 1] : 1;
  // Split rows only when there is enough work for every thread.
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(c.thread_count, rows * cols / 4096 > 0 ? rows : 1));
  if (c.thread_index >= parts) return;
  const int64_t r0 = rows * c.thread_index / parts, r1 = rows * (c.thread_index + 1) / parts;
  if (r0 < r1) d.epilogue.inplace(a, r0, r1);
}

}  // namespace

StatusOr<compiler::KernelSpec> JitSpecFor(const KernelRequest& req) {
  if (const compiler::FusedGroup* g = compiler::FusedGroupOf(req)) return g->spec;
  return compiler::SpecFromRequest(req);
}

Kernel ExpressionKernel(CpuJit& jit, const KernelRequest& req, Kernel interp) {
  StatusOr<compiler::KernelSpec> spec = compiler::SpecFromRequest(req);
  if (!spec.ok()) return interp;  // e.g. quantized inputs: the interpreter dequantizes
  std::string name = interp.name;
  return jit.GetKernel(*spec, std::move(interp), std::move(name));
}

StatusOr<Kernel> FusedKernel(const compiler::FusedGroup& group, CpuJit& jit,
                             const KernelProvider& gemm) {
  const std::string name = StrCat("cpu.fused.", group.label);
  if (group.kind == compiler::FusedGroup::Kind::kReduce) {
    return jit.GetKernel(group.spec, Kernel{}, name);
  }
  auto d = std::make_shared<GemmEpilogueData>();
  KILN_ASSIGN_OR_RETURN(d->gemm, gemm(group.GemmRequest()));
  KILN_ASSIGN_OR_RETURN(d->epilogue, jit.GetEpilogue(group.spec));
  std::string full_name = StrCat(name, " [", d->gemm.name, " + epilogue]");
  return Kernel{GemmWithEpilogue, std::move(d), std::move(full_name)};
}

}  // namespace kiln::cpu::jit
