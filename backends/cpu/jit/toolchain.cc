#include "backends/cpu/jit/toolchain.h"

#include <unistd.h>

#include <cstdlib>
#include <mutex>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "backends/host/command.h"
#include "engine/compiler/hash.h"

namespace kiln::cpu::jit {

using host::CommandOutput;
using host::ReadFileOrEmpty;
using host::RunCommand;

std::string CpuFeatureLevel() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool v2 = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt") &&
                  __builtin_cpu_supports("ssse3");
  const bool v3 = v2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("movbe");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (v4) return "x86-64-v4";
  if (v3) return "x86-64-v3";
  if (v2) return "x86-64-v2";
  return "x86-64";
#else
  return "baseline";
#endif
}

StatusOr<Toolchain> DetectToolchain() {
  static std::once_flag once;
  static StatusOr<Toolchain>* result = nullptr;
  std::call_once(once, [] {
    Toolchain tc;
    const char* env = std::getenv("KILN_CXX");
    tc.compiler = env != nullptr && *env != '\0' ? env : "c++";
    StatusOr<std::string> version = CommandOutput({tc.compiler, "--version"});
    StatusOr<std::string> machine = CommandOutput({tc.compiler, "-dumpmachine"});
    if (!version.ok() || !machine.ok()) {
      result = new StatusOr<Toolchain>(
          Unavailable("no usable C++ compiler for generated kernels (", tc.compiler,
                      "): ", StatusMessage(version.ok() ? machine.status() : version.status()),
                      "; set KILN_CXX or install g++"));
      return;
    }
    const std::string first = std::string(absl::StripAsciiWhitespace(
        std::vector<std::string>(absl::StrSplit(*version, '\n')).front()));
    tc.identity = StrCat(first, " ", absl::StripAsciiWhitespace(*machine));
    tc.feature_level = CpuFeatureLevel();
    // No sanitizer flags here, even in a KILN_SANITIZE build of kilnd: the kernels index
    // tensors inside one planned arena (engine/planner.h), where ASan sees no bounds, and
    // they are checked by the op harness (sentinels around every buffer) instead; ASan would
    // only slow the model tests several times over. Uninstrumented code loads fine into a
    // sanitized process, and TSan, not seeing it, reports nothing about its disjoint slices.
    // KILN_CXX_FLAGS can still add -fsanitize=... (the flags are part of the cache key).
    tc.flags = {"-std=c++17",
                "-O3",
                "-fPIC",
                "-shared",
                "-fno-math-errno",
                "-fno-trapping-math",
                "-fopenmp-simd",
                "-fno-semantic-interposition",
                "-fvisibility=hidden",
                "-w"};
    if (tc.feature_level != "baseline") tc.flags.push_back("-march=" + tc.feature_level);
    if (const char* extra = std::getenv("KILN_CXX_FLAGS"); extra != nullptr) {
      for (absl::string_view f : absl::StrSplit(extra, ' ', absl::SkipEmpty())) {
        tc.flags.emplace_back(f);
      }
    }
    compiler::Hasher h;
    h.Add(tc.identity);
    for (const std::string& f : tc.flags) h.Add(f);
    tc.cache_namespace = StrCat("cpu-", h.Hex().substr(0, 16));
    result = new StatusOr<Toolchain>(std::move(tc));
  });
  return *result;
}

Status CompileSharedObject(const Toolchain& tc, const std::string& source_path,
                           const std::string& so_path) {
  std::vector<std::string> argv = {tc.compiler};
  argv.insert(argv.end(), tc.flags.begin(), tc.flags.end());
  argv.insert(argv.end(), {"-o", so_path, source_path, "-lmvec", "-lm"});
  const std::string log = so_path + ".log";
  KILN_ASSIGN_OR_RETURN(int rc, RunCommand(argv, log));
  if (rc != 0) {
    std::string out = ReadFileOrEmpty(log);
    if (out.size() > 4000) out = out.substr(0, 4000) + "\n...";
    return Internal("the kernel compiler failed (exit ", rc, "): `", absl::StrJoin(argv, " "),
                    "`\n", out);
  }
  unlink(log.c_str());
  return OkStatus();
}

}  // namespace kiln::cpu::jit
