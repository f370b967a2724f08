// The CPU backend's kernel compiler: generated C++ (engine/compiler/codegen.h), built by the
// system compiler into shared objects, loaded with dlopen, cached on disk.
//
//   GetKernel(spec) -> a kernel. Where does the code come from, in order:
//     1. this process already has it (same source key)      -> "reused"
//     2. the AOT table compiled into the binary (aot.h)     -> "cached"
//     3. the disk cache (engine/compiler/kernel_cache.h)    -> "cached"
//     4. queued: compiled with everything else queued, in one shared object per batch,
//        at the next Flush()                                -> "compiled"
//   A queued kernel is a trampoline until then; its first launch flushes if nobody did.
//   compiler::Compile flushes through Target::Prepare right after fusion, so a program's
//   kernels cost one compiler run and launch without the trampoline.
//
// Cache layout (under DiskCache's directory, namespace = the toolchain's, which hashes the
// compiler identity, flags and CPU feature level): `<batch>.so` shared objects and, per
// kernel, an index entry `k<key>` naming its batch, so a second process (or a program that
// mixes kernels of several earlier batches) compiles nothing. Concurrent processes lock the
// batch key while compiling: the second waits and then loads the first's result.
//
// Failures never break a program: with no compiler, or if a batch fails to build or load,
// kernels fall back to the given interpreter kernel (logged once). Fused kernels have no
// interpreter: Prepare reports the error and the compiler retries the program unfused.
//
// Environment: KILN_CPU_JIT=0 disables generated kernels (interpreter only); KILN_CPU_AOT=0
// ignores the AOT table; KILN_CACHE_DIR (see kernel_cache.h); KILN_CXX, KILN_CXX_FLAGS
// (toolchain.h).
//
// Thread-safety: every method is thread-safe. Kernels stay valid for the CpuJit's lifetime
// (shared objects are never unloaded).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "backends/cpu/jit/toolchain.h"
#include "engine/backend/backend.h"
#include "engine/compiler/codegen.h"
#include "engine/compiler/gemm_epilogue.h"
#include "engine/compiler/kernel_cache.h"
#include "engine/compiler/target.h"

namespace kiln::cpu::jit {

using backend::Kernel;
using backend::KernelRequest;

struct JitOptions {
  bool enabled = true;    // false: interpreter kernels only
  bool use_aot = true;    // consult the AOT table
  std::string cache_dir;  // empty: compiler::CacheDir()
};
// From the environment (KILN_CPU_JIT, KILN_CPU_AOT).
JitOptions JitOptionsFromEnv();

class CpuJit final : public compiler::Target {
 public:
  explicit CpuJit(JitOptions options = JitOptionsFromEnv());
  ~CpuJit() override;

  // True if generated kernels can be built here (the toolchain probe succeeded); the first
  // call probes.
  bool available() const;

  // A kernel running `spec`, named `name`; `fallback` runs instead if the code cannot be
  // built. A null fallback.fn means "no fallback" (fused kernels): the kernel aborts with a
  // message if its code fails to build (Prepare reports such failures first).
  Kernel GetKernel(const compiler::KernelSpec& spec, Kernel fallback, std::string name);

  // The epilogue functions for a kGemmEpilogue spec, resolving (and compiling) them now.
  StatusOr<compiler::GemmEpilogue> GetEpilogue(const compiler::KernelSpec& spec);

  // Hand-written code calling generated expressions (compiler::NameKernel names it): the
  // addresses of its functions `g.entry + suffix` for each suffix (their C signatures are the
  // caller's contract), compiled now if no cache has them. Unavailable without a compiler or
  // with KILN_CPU_JIT=0 (the caller then runs without them); never an interpreter fallback.
  StatusOr<std::vector<void*>> GetFunctions(const compiler::GeneratedKernel& g,
                                            const std::vector<std::string>& suffixes);

  // Builds every queued kernel (one compiler run at most).
  Status Flush();

  // compiler::Target. Prepare needs the device to map requests to specs.
  using SpecFn = std::function<StatusOr<compiler::KernelSpec>(const KernelRequest&)>;
  void SetSpecFn(SpecFn fn) { spec_fn_ = std::move(fn); }
  compiler::FusionCaps caps() const override;
  Status Prepare(std::span<const KernelRequest> requests) override;
  compiler::CompileCounters counters() const override;

  const std::string& cache_dir() const { return cache_.dir(); }

 private:
  struct Entry;
  friend void JitTrampoline(const LaunchArgs&, const ExecCtx&);
  friend void JitFallback(const LaunchArgs&, const ExecCtx&);
  // Returns the entry for `kernel` (new entries are queued). Counts reuse.
  std::shared_ptr<Entry> Lookup(const compiler::GeneratedKernel& kernel, const Kernel& fallback,
                                bool epilogue, bool count,
                                const std::vector<std::string>* suffixes = nullptr);
  // Called by trampolines: flushes and returns the function to run.
  KernelFn Resolve(const Entry& e);
  Status CompileBatch(std::vector<std::shared_ptr<Entry>>& batch);
  Status LoadBatch(const std::string& so_path, std::vector<std::shared_ptr<Entry>>& batch);
  bool LoadFromIndex(Entry& e);
  void Fail(std::vector<std::shared_ptr<Entry>>& batch, const Status& why);

  JitOptions options_;
  mutable std::once_flag probe_once_;
  mutable StatusOr<Toolchain> toolchain_{Unavailable("not probed")};
  compiler::DiskCache cache_;
  SpecFn spec_fn_;

  std::mutex mu_;  // entries_, pending_
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_;
  std::vector<std::shared_ptr<Entry>> pending_;
  std::mutex flush_mu_;                             // one flush at a time
  absl::flat_hash_map<std::string, void*> loaded_;  // so path -> dlopen handle (flush_mu_)

  std::atomic<int64_t> compiled_{0}, cached_{0}, reused_{0}, runs_{0}, micros_{0};
  std::atomic<bool> warned_{false};
};

}  // namespace kiln::cpu::jit
