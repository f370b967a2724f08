#include "backends/cpu/jit/cpu_jit.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "backends/cpu/jit/aot.h"
#include "engine/compiler/hash.h"
#include "spdlog/spdlog.h"

namespace kiln::cpu::jit {

struct CpuJit::Entry {
  CpuJit* jit = nullptr;
  std::string key, entry, code;
  bool epilogue = false;
  // Functions (GetFunctions): the symbols entry + suffix, resolved into `addresses` (written
  // before `done`); not a kernel.
  std::vector<std::string> suffixes;
  std::vector<void*> addresses;
  Kernel fallback;  // fn == nullptr: none
  std::atomic<KernelFn> fn{nullptr};
  std::atomic<void*> inplace{nullptr}, from_acc{nullptr};
  std::atomic<bool> done{false};
  std::string error;  // why it failed (written before `done`)
};

namespace {

int64_t MicrosSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               t0)
      .count();
}

bool EnvOff(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && (std::string_view(v) == "0" || std::string_view(v) == "false");
}

}  // namespace

// Launch path of a kernel whose code was not loaded yet.
void JitTrampoline(const LaunchArgs& a, const ExecCtx& c) {
  const auto& e = *static_cast<const CpuJit::Entry*>(a.kernel_data);
  KernelFn fn = e.fn.load(std::memory_order_acquire);
  if (fn == nullptr) fn = e.jit->Resolve(e);
  fn(a, c);
}

// Launch path of a kernel whose code failed to build: the interpreter (or an abort).
void JitFallback(const LaunchArgs& a, const ExecCtx& c) {
  const auto& e = *static_cast<const CpuJit::Entry*>(a.kernel_data);
  if (e.fallback.fn == nullptr) {
    std::fprintf(stderr, "kiln: generated kernel %s could not be built and has no fallback: %s\n",
                 e.entry.c_str(), e.error.c_str());
    std::abort();
  }
  LaunchArgs b = a;
  b.kernel_data = e.fallback.data.get();
  e.fallback.fn(b, c);
}

JitOptions JitOptionsFromEnv() {
  JitOptions o;
  o.enabled = !EnvOff("KILN_CPU_JIT");
  o.use_aot = !EnvOff("KILN_CPU_AOT");
  return o;
}

CpuJit::CpuJit(JitOptions options) : options_(std::move(options)), cache_(options_.cache_dir) {}

CpuJit::~CpuJit() = default;

bool CpuJit::available() const {
  if (!options_.enabled) return false;
  std::call_once(probe_once_, [this] {
    toolchain_ = DetectToolchain();
    if (!toolchain_.ok()) {
      spdlog::warn("cpu: generated kernels disabled: {}", StatusMessage(toolchain_.status()));
    }
  });
  return toolchain_.ok();
}

compiler::FusionCaps CpuJit::caps() const {
  compiler::FusionCaps c;
  const bool on = options_.enabled && (available() || (options_.use_aot && !AotKernels().empty()));
  c.pointwise = c.reductions = c.gemm_epilogues = on;
  return c;
}

compiler::CompileCounters CpuJit::counters() const {
  compiler::CompileCounters c;
  c.compiled = compiled_.load();
  c.cached = cached_.load();
  c.reused = reused_.load();
  c.compiler_runs = runs_.load();
  c.seconds = static_cast<double>(micros_.load()) * 1e-6;
  return c;
}

std::shared_ptr<CpuJit::Entry> CpuJit::Lookup(const compiler::GeneratedKernel& k,
                                              const Kernel& fallback, bool epilogue, bool count,
                                              const std::vector<std::string>* suffixes) {
  const bool function = suffixes != nullptr;
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k.key);
  if (it != entries_.end()) {
    if (count) reused_.fetch_add(1, std::memory_order_relaxed);
    if (it->second->fallback.fn == nullptr && fallback.fn != nullptr &&
        !it->second->done.load(std::memory_order_acquire)) {
      it->second->fallback = fallback;  // still unresolved: nobody reads it yet
    }
    return it->second;
  }
  auto e = std::make_shared<Entry>();
  e->jit = this;
  e->key = k.key;
  e->entry = k.entry;
  e->code = k.code;
  e->epilogue = epilogue;
  if (function) e->suffixes = *suffixes;
  e->fallback = fallback;
  entries_.emplace(k.key, e);
  if (options_.use_aot && !function) {
    if (const AotKernel* a = FindAotKernel(k.key)) {
      e->inplace.store(reinterpret_cast<void*>(a->inplace));
      e->from_acc.store(reinterpret_cast<void*>(a->from_acc));
      e->fn.store(a->fn != nullptr ? a->fn : JitFallback);
      e->done.store(true, std::memory_order_release);
      cached_.fetch_add(1, std::memory_order_relaxed);
      return e;
    }
  }
  pending_.push_back(e);
  return e;
}

Kernel CpuJit::GetKernel(const compiler::KernelSpec& spec, Kernel fallback, std::string name) {
  if (!options_.enabled) {
    fallback.name = std::move(name);
    return fallback;
  }
  const auto t0 = std::chrono::steady_clock::now();
  StatusOr<compiler::GeneratedKernel> g = compiler::GenerateKernel(spec, compiler::Dialect::kCpp);
  if (!g.ok()) {
    spdlog::warn("cpu: no generated kernel for {}: {}", name, StatusMessage(g.status()));
    fallback.name = std::move(name);
    return fallback;
  }
  std::shared_ptr<Entry> e = Lookup(*g, fallback, false, /*count=*/false);
  if (!e->done.load(std::memory_order_acquire) && !available()) {
    // Not in the AOT table and nothing can build it.
    std::vector<std::shared_ptr<Entry>> one{e};
    Fail(one, Unavailable("no kernel compiler"));
  }
  micros_.fetch_add(MicrosSince(t0), std::memory_order_relaxed);
  if (e->done.load(std::memory_order_acquire)) {
    KernelFn fn = e->fn.load(std::memory_order_acquire);
    if (fn != JitFallback) return Kernel{fn, nullptr, std::move(name)};
    if (fallback.fn != nullptr) {
      fallback.name = std::move(name);
      return fallback;
    }
  }
  return Kernel{JitTrampoline, std::shared_ptr<const void>(e, e.get()), std::move(name)};
}

StatusOr<compiler::GemmEpilogue> CpuJit::GetEpilogue(const compiler::KernelSpec& spec) {
  if (spec.kind != compiler::KernelKind::kGemmEpilogue) {
    return InvalidArgument("GetEpilogue: not an epilogue spec");
  }
  KILN_ASSIGN_OR_RETURN(compiler::GeneratedKernel g,
                        compiler::GenerateKernel(spec, compiler::Dialect::kCpp));
  std::shared_ptr<Entry> e = Lookup(g, Kernel{}, true, /*count=*/false);
  if (!e->done.load(std::memory_order_acquire)) {
    if (!available()) return Unavailable("no kernel compiler for a GEMM epilogue");
    KILN_RETURN_IF_ERROR(Flush());
  }
  if (!e->done.load(std::memory_order_acquire) || e->inplace.load() == nullptr) {
    return Internal("GEMM epilogue ", e->entry, " is unavailable: ", e->error);
  }
  compiler::GemmEpilogue ep;
  ep.inplace = reinterpret_cast<decltype(ep.inplace)>(e->inplace.load());
  ep.from_acc = reinterpret_cast<decltype(ep.from_acc)>(e->from_acc.load());
  return ep;
}

StatusOr<std::vector<void*>> CpuJit::GetFunctions(const compiler::GeneratedKernel& g,
                                                  const std::vector<std::string>& suffixes) {
  if (!options_.enabled) return Unavailable("generated kernels are disabled (KILN_CPU_JIT=0)");
  std::shared_ptr<Entry> e = Lookup(g, Kernel{}, false, /*count=*/false, &suffixes);
  if (e->suffixes != suffixes) {
    return InvalidArgument("GetFunctions: ", g.entry, " was asked for other symbols before");
  }
  if (!e->done.load(std::memory_order_acquire)) {
    // Built on its own (one compiler run at most), so that a failure here leaves the queued
    // kernels alone and theirs leave it alone.
    std::lock_guard<std::mutex> fl(flush_mu_);
    {
      std::lock_guard<std::mutex> l(mu_);
      std::erase(pending_, e);
    }
    if (!e->done.load(std::memory_order_acquire)) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::shared_ptr<Entry>> one{e};
      Status s = OkStatus();
      if (!available()) {
        s = Unavailable("no kernel compiler");
      } else if (LoadFromIndex(*e)) {
        cached_.fetch_add(1, std::memory_order_relaxed);
      } else {
        s = CompileBatch(one);
      }
      micros_.fetch_add(MicrosSince(t0), std::memory_order_relaxed);
      if (!s.ok()) {
        e->error = std::string(StatusMessage(s).substr(0, 2000));
        e->fn.store(JitFallback, std::memory_order_release);
        e->done.store(true, std::memory_order_release);
      }
    }
  }
  if (e->addresses.size() != suffixes.size()) {
    return Unavailable("generated functions ", g.entry, " are unavailable: ", e->error);
  }
  return e->addresses;
}

KernelFn CpuJit::Resolve(const Entry& e) {
  const Status s = Flush();
  (void)s;  // failures are recorded in the entries (fallbacks) and logged
  KernelFn fn = e.fn.load(std::memory_order_acquire);
  return fn != nullptr ? fn : JitFallback;
}

Status CpuJit::Flush() {
  std::lock_guard<std::mutex> fl(flush_mu_);
  std::vector<std::shared_ptr<Entry>> batch;
  {
    std::lock_guard<std::mutex> l(mu_);
    batch.swap(pending_);
  }
  if (batch.empty()) return OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<Entry>> todo;
  for (auto& e : batch) {
    if (e->done.load(std::memory_order_acquire)) continue;
    if (available() && LoadFromIndex(*e)) {
      cached_.fetch_add(1, std::memory_order_relaxed);
    } else {
      todo.push_back(e);
    }
  }
  Status s = OkStatus();
  if (!todo.empty()) {
    s = available() ? CompileBatch(todo) : Unavailable("no kernel compiler");
    if (!s.ok()) Fail(todo, s);
  }
  micros_.fetch_add(MicrosSince(t0), std::memory_order_relaxed);
  return s;
}

void CpuJit::Fail(std::vector<std::shared_ptr<Entry>>& batch, const Status& why) {
  if (!warned_.exchange(true)) {
    spdlog::warn("cpu: generated kernels failed to build; using the interpreter: {}",
                 StatusMessage(why).substr(0, 2000));
  }
  for (auto& e : batch) {
    e->error = std::string(StatusMessage(why).substr(0, 2000));
    e->fn.store(JitFallback, std::memory_order_release);
    e->done.store(true, std::memory_order_release);
  }
}

bool CpuJit::LoadFromIndex(Entry& e) {
  const std::string& ns = toolchain_->cache_namespace;
  StatusOr<std::string> batch = cache_.Get(ns, StrCat("k", e.key));
  if (!batch.ok()) return false;
  StatusOr<std::string> so = cache_.GetFile(ns, *batch, ".so");
  if (!so.ok()) return false;
  std::vector<std::shared_ptr<Entry>> one;
  one.push_back(std::shared_ptr<Entry>(std::shared_ptr<Entry>{}, &e));
  return LoadBatch(*so, one).ok();
}

Status CpuJit::LoadBatch(const std::string& so_path, std::vector<std::shared_ptr<Entry>>& batch) {
  void*& handle = loaded_[so_path];
  if (handle == nullptr) {
    handle = dlopen(so_path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* err = dlerror();
      loaded_.erase(so_path);
      return Internal("dlopen '", so_path, "': ", err != nullptr ? err : "?");
    }
  }
  // Resolve everything first: a batch is published only if complete.
  struct Syms {
    void* fn = nullptr;
    void* inplace = nullptr;
    void* acc = nullptr;
    std::vector<void*> functions;
  };
  std::vector<Syms> syms(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const Entry& e = *batch[i];
    if (!e.suffixes.empty()) {
      for (const std::string& suffix : e.suffixes) {
        void* f = dlsym(handle, (e.entry + suffix).c_str());
        if (f == nullptr) return Internal("'", so_path, "' lacks ", e.entry, suffix);
        syms[i].functions.push_back(f);
      }
    } else if (e.epilogue) {
      syms[i].inplace = dlsym(handle, (e.entry + "_inplace").c_str());
      syms[i].acc = dlsym(handle, (e.entry + "_acc").c_str());
      if (syms[i].inplace == nullptr || syms[i].acc == nullptr) {
        return Internal("'", so_path, "' lacks ", e.entry, "_inplace/_acc");
      }
    } else {
      syms[i].fn = dlsym(handle, e.entry.c_str());
      if (syms[i].fn == nullptr) return Internal("'", so_path, "' lacks ", e.entry);
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    Entry& e = *batch[i];
    e.inplace.store(syms[i].inplace);
    e.from_acc.store(syms[i].acc);
    e.addresses = std::move(syms[i].functions);
    e.fn.store(
        e.epilogue || !e.suffixes.empty() ? JitFallback : reinterpret_cast<KernelFn>(syms[i].fn),
        std::memory_order_release);
    e.done.store(true, std::memory_order_release);
  }
  return OkStatus();
}

Status CpuJit::CompileBatch(std::vector<std::shared_ptr<Entry>>& batch) {
  const Toolchain& tc = *toolchain_;
  const std::string& ns = tc.cache_namespace;
  std::vector<std::string> keys;
  for (const auto& e : batch) keys.push_back(e->key);
  std::sort(keys.begin(), keys.end());
  compiler::Hasher h;
  h.Add(ns);
  for (const std::string& k : keys) h.Add(k);
  const std::string bk = StrCat("b", h.Hex());
  // One process compiles a batch; others wait here and then find it in the cache.
  KILN_ASSIGN_OR_RETURN(compiler::DiskCache::Lock lock, cache_.LockKey(ns, bk));
  if (StatusOr<std::string> so = cache_.GetFile(ns, bk, ".so"); so.ok()) {
    if (LoadBatch(*so, batch).ok()) {
      cached_.fetch_add(static_cast<int64_t>(batch.size()), std::memory_order_relaxed);
      return OkStatus();
    }
  }
  KILN_ASSIGN_OR_RETURN(std::string tmp, cache_.MakeTempDir(ns));
  std::vector<compiler::GeneratedKernel> ks;
  for (const auto& e : batch) {
    compiler::GeneratedKernel g;
    g.entry = e->entry;
    g.code = e->code;
    g.key = e->key;
    g.dialect = compiler::Dialect::kCpp;
    ks.push_back(std::move(g));
  }
  const std::string src = tmp + "/kernels.cc", so = tmp + "/kernels.so";
  {
    std::ofstream out(src);
    out << compiler::ModuleSource(compiler::Dialect::kCpp, ks);
    if (!out.flush()) return Internal("cannot write '", src, "'");
  }
  runs_.fetch_add(1, std::memory_order_relaxed);
  Status s = CompileSharedObject(tc, src, so);
  if (s.ok()) s = cache_.PutFile(ns, bk, ".so", so);
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
  KILN_RETURN_IF_ERROR(s);
  for (const auto& e : batch) KILN_RETURN_IF_ERROR(cache_.Put(ns, StrCat("k", e->key), bk));
  KILN_ASSIGN_OR_RETURN(std::string path, cache_.GetFile(ns, bk, ".so"));
  KILN_RETURN_IF_ERROR(LoadBatch(path, batch));
  compiled_.fetch_add(static_cast<int64_t>(batch.size()), std::memory_order_relaxed);
  return OkStatus();
}

Status CpuJit::Prepare(std::span<const KernelRequest> requests) {
  if (!options_.enabled || !spec_fn_) return OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<Entry>> fused;
  for (const KernelRequest& req : requests) {
    const bool is_fused = compiler::FusedGroupOf(req) != nullptr;
    StatusOr<compiler::KernelSpec> spec = spec_fn_(req);
    if (!spec.ok()) {
      if (is_fused) return spec.status();
      continue;  // no generated kernel for this op: the device uses another
    }
    StatusOr<compiler::GeneratedKernel> g =
        compiler::GenerateKernel(*spec, compiler::Dialect::kCpp);
    if (!g.ok()) {
      if (is_fused) return g.status();
      continue;
    }
    std::shared_ptr<Entry> e;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (entries_.contains(g->key)) reused_.fetch_add(1, std::memory_order_relaxed);
    }
    e = Lookup(*g, Kernel{}, spec->kind == compiler::KernelKind::kGemmEpilogue, /*count=*/false);
    if (is_fused) fused.push_back(e);
  }
  micros_.fetch_add(MicrosSince(t0), std::memory_order_relaxed);
  Status s = available() ? Flush() : OkStatus();
  for (const auto& e : fused) {
    if (!e->done.load(std::memory_order_acquire) || e->fn.load() == JitFallback) {
      if (!e->epilogue || e->inplace.load() == nullptr) {
        return Internal("fused kernel ", e->entry, " is unavailable: ",
                        e->error.empty() ? std::string(StatusMessage(s)) : e->error);
      }
    }
  }
  return s;
}

}  // namespace kiln::cpu::jit
