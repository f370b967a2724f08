// compiler::Compile: kiln::Compile (program.h) plus the compiler — fusion, batch code
// generation, regional reuse, the kernel cache — for devices that run generated kernels
// (a compiler::Target, target.h; the cpu backend is one). On other devices it is exactly
// kiln::Compile.
//
//   auto program = compiler::Compile(graph, {logits}, *device, {.metrics = &registry});
//
// Passes, in order: verify, dce, **fuse** (fusion.h; KILN_DUMP=fuse shows the groups),
// **prepare** (every kernel of the fused program generated and built as one batch, reusing
// kernels already in the process, the AOT table or the disk cache), lower_views, assign,
// plan, program. If fused kernels cannot be built, the program is compiled unfused (logged).
//
// Every compile logs one line (spdlog, info) like
//   compile llama: 30 regions blk.N in 1 structure (30); 602 nodes -> 302 launches (fused 420
//   nodes into 120 groups); kernels: 11 compiled, 0 cached, 289 reused (1 compiler run); 1.9 s
// and, given a metrics registry, adds to
//   kiln_compile_kernels_total{outcome="compiled|reused|cached"}  kernels by origin
//   kiln_compile_seconds_total                                   wall time of compiles
//
// Environment: KILN_FUSE=0 disables fusion (the rest still applies).
//
// Thread-safety: thread-safe; programs may be compiled concurrently (the fusion context is
// per thread).
#pragma once

#include <memory>
#include <span>
#include <string>

#include "engine/base/metrics.h"
#include "engine/compiler/region.h"
#include "engine/compiler/target.h"
#include "engine/program.h"

namespace kiln::compiler {

struct CompilerOptions {
  CompileOptions program;  // dump switches, guard bytes, alignment (program.h)
  bool fuse = true;
  metrics::Registry* metrics = nullptr;  // not owned; may be null
  std::string label;                     // names the program in the log line
};

struct CompileReport {
  int nodes = 0;     // computing nodes before fusion
  int launches = 0;  // launches of the program
  int fused_groups = 0;
  int fused_nodes = 0;
  bool unfused_fallback = false;  // fused kernels failed to build; compiled unfused
  RegionReport regions;
  CompileCounters kernels;  // during this compile
  double seconds = 0;       // wall time of the whole compile
  std::string ToString() const;
};

StatusOr<std::unique_ptr<Program>> Compile(const Graph& graph, std::span<const Value> outputs,
                                           backend::Device& device,
                                           const CompilerOptions& options = {},
                                           CompileReport* report = nullptr);
inline StatusOr<std::unique_ptr<Program>> Compile(const Graph& graph,
                                                  std::initializer_list<Value> outputs,
                                                  backend::Device& device,
                                                  const CompilerOptions& options = {},
                                                  CompileReport* report = nullptr) {
  return Compile(graph, std::span<const Value>(outputs.begin(), outputs.size()), device, options,
                 report);
}

}  // namespace kiln::compiler
