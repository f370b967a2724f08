// What NVRTC and hiprtc share: one C API under two prefixes (nvrtc*, hiprtc*) — create a
// program from source, compile it with options, read its log and its output — loaded at run
// time by name. backends/cuda/nvrtc.h and backends/rocm/hiprtc.h are its users; each adds its
// vendor's search path and options.
//
// Thread-safety: a RuntimeCompiler is immutable after Open; Compile is thread-safe (programs
// are independent).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::host {

class RuntimeCompiler {
 public:
  // Opens the first of `libraries` (paths or names for dlopen) that exports `prefix` +
  // GetErrorString, Version, CreateProgram, DestroyProgram, CompileProgram, GetProgramLogSize,
  // GetProgramLog and, for each of `outputs` ("CUBIN"), Get<output>Size and Get<output>.
  // NotFound (listing `libraries`) when none does. The library stays loaded for the process.
  static StatusOr<std::unique_ptr<RuntimeCompiler>> Open(std::string_view prefix,
                                                         std::span<const std::string> libraries,
                                                         std::span<const char* const> outputs);
  ~RuntimeCompiler();

  // The library's Version() ("13.0") and the library opened.
  const std::string& version() const { return version_; }
  const std::string& path() const { return path_; }

  // Compiles `source` (a translation unit named `name`) with `options`; returns output number
  // `output` of Open's `outputs`. Errors: InvalidArgument "<what> failed to compile <name>:
  // <error>" and the compiler's log.
  StatusOr<std::string> Compile(const std::string& source, const std::string& name,
                                const std::vector<std::string>& options, size_t output,
                                std::string_view what) const;

 private:
  RuntimeCompiler() = default;
  struct Api;
  std::unique_ptr<Api> api_;
  std::string version_, path_;
};

}  // namespace kiln::host
