// NVRTC (the CUDA runtime compiler), loaded at run time: compiles generated CUDA C
// (engine/compiler/codegen.h, Dialect::kCuda) to PTX or cubins. Functions without an execution
// space compile as __device__ (-default-device). The CUDA backend's kernel compiler, and
// what the codegen tests use to prove the CUDA printer's output compiles on machines without
// a GPU. No CUDA toolkit is needed to build Kiln: libnvrtc is found when used.
//
// Library search: $KILN_NVRTC (a path), $CUDA_HOME/lib64, $CUDA_PATH/lib64,
// /usr/local/cuda/lib64, then the loader's path (libnvrtc.so, .so.13, .so.12, .so.11).
//
// Thread-safety: Load() is thread-safe (once per process); Nvrtc methods are thread-safe
// (NVRTC programs are independent).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/host/rtc.h"
#include "engine/base/status.h"

namespace kiln::cuda {

class Nvrtc {
 public:
  // The process' NVRTC, or Unavailable (with the places searched).
  static StatusOr<const Nvrtc*> Load();

  // "13.0" and the library's path.
  const std::string& version() const { return version_; }
  const std::string& path() const { return path_; }

  // Compiles `source` (a .cu translation unit) for `arch` ("compute_80"); returns the PTX.
  // Errors carry NVRTC's log.
  StatusOr<std::string> CompileToPtx(const std::string& source, const std::string& name,
                                     const std::string& arch,
                                     const std::vector<std::string>& options = {}) const;
  // Compiles `source` for a real architecture (`arch` "sm_90"); returns the cubin.
  StatusOr<std::string> CompileToCubin(const std::string& source, const std::string& name,
                                       const std::string& arch,
                                       const std::vector<std::string>& options = {}) const;

 private:
  Nvrtc() = default;
  StatusOr<std::string> Compile(const std::string& source, const std::string& name,
                                const std::string& arch, const std::vector<std::string>& options,
                                bool cubin) const;
  std::string version_, path_;
  std::unique_ptr<host::RuntimeCompiler> rtc_;
};

}  // namespace kiln::cuda
