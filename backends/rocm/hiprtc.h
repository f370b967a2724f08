// hiprtc (HIP's runtime compiler), loaded at run time: compiles HIP C — generated kernels
// (engine/compiler/codegen.h, Dialect::kHip) and the kernel library after cl/cuda_compat.h — to
// a code object for an AMD GPU, in process, as a runtime HIP backend would. No ROCm is needed
// to build Kiln: the library is found when used. hipcc.h is the same compile through the
// compiler driver.
//
// Library search: $KILN_HIPRTC (a path), then the loader's path: libhiprtc.so (ROCm 6 and
// later), libhiprtc.so.6, libamdhip64.so, libamdhip64.so.5 (ROCm 5 keeps hiprtc inside the HIP
// runtime; Debian: apt install libamdhip64-dev). KILN_HIPRTC=none: not loaded.
//
// Thread-safety: Load() is thread-safe (once per process); Compile is thread-safe (programs
// are independent).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/host/rtc.h"
#include "engine/base/status.h"

namespace kiln::rocm {

class Hiprtc {
 public:
  // The process' hiprtc, or Unavailable (with the places searched).
  static StatusOr<const Hiprtc*> Load();

  // hiprtc's version ("5.2") and the library's path.
  const std::string& version() const { return version_; }
  const std::string& path() const { return path_; }

  // Compiles `source` (a HIP translation unit named `name`) for `arch` ("gfx90a"); returns
  // the code object. Errors carry hiprtc's log.
  StatusOr<std::string> Compile(const std::string& source, const std::string& name,
                                const std::string& arch,
                                const std::vector<std::string>& options = {}) const;

 private:
  Hiprtc() = default;
  std::string version_, path_;
  std::unique_ptr<host::RuntimeCompiler> rtc_;
};

}  // namespace kiln::rocm
