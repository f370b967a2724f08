// The system C++ compiler as the CPU backend's kernel compiler: detection, the flags every
// generated kernel is built with, and building a shared object.
//
// Flags: -O3 at a portable x86-64 feature level chosen from this CPU's features (x86-64-v2,
// -v3 with AVX2/FMA/F16C, -v4 with AVX-512) rather than -march=native, so a kernel cache
// shared between machines of the same level stays valid; -fno-math-errno and
// -fno-trapping-math (lets the vectorizer if-convert selects; results are unchanged),
// -fopenmp-simd (our loops carry `omp simd` reduction clauses instead of -ffast-math, which
// would break NaN/Inf semantics), and glibc's vector math library.
//
// Environment: KILN_CXX picks the compiler (default `c++`); KILN_CXX_FLAGS adds flags.
//
// Thread-safety: DetectToolchain caches its result (thread-safe); CompileSharedObject is
// reentrant.
#pragma once

#include <string>
#include <vector>

#include "engine/base/status.h"

namespace kiln::cpu::jit {

struct Toolchain {
  std::string compiler;            // as run: "c++", "/usr/bin/clang++"
  std::string identity;            // "c++ (Debian 12.2.0-14) 12.2.0 x86_64-linux-gnu"
  std::string feature_level;       // "x86-64-v3" (or "baseline" off x86-64)
  std::vector<std::string> flags;  // compile and link flags (without -o and sources)
  std::string cache_namespace;     // "cpu-" + hash(identity, flags): part of every cache key
};

// Probes the compiler once per process (runs `<compiler> --version` and `-dumpmachine`).
// Unavailable if there is none or it does not run.
StatusOr<Toolchain> DetectToolchain();

// The -march flags for this CPU ("-march=x86-64-v3") and the level's name.
std::string CpuFeatureLevel();

// Builds `source_path` into the shared object `so_path`. The error carries the compiler's
// output (truncated).
Status CompileSharedObject(const Toolchain& tc, const std::string& source_path,
                           const std::string& so_path);

}  // namespace kiln::cpu::jit
