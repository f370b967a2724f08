// hipcc (ROCm's compiler driver): compiles generated HIP C (engine/compiler/codegen.h,
// Dialect::kHip) to a code object for AMD GPUs. The ROCm backend's kernel compiler and what
// the codegen tests use to prove the HIP printer's output compiles without a GPU.
//
// The compiler: $KILN_HIPCC, else `hipcc` on PATH (Debian: apt install hipcc, ROCm 5.2).
// Targets: gfx90a (MI200) and gfx1030 (RDNA2) by default.
//
// Thread-safety: thread-safe (each call uses its own temporary directory).
#pragma once

#include <string>
#include <vector>

#include "engine/base/status.h"

namespace kiln::rocm {

// The hipcc to run and its version line, or Unavailable.
StatusOr<std::string> FindHipcc(std::string* version = nullptr);

// Compiles `source` into a code object (`--genco`) for `archs`; returns its bytes. Errors
// carry hipcc's output.
StatusOr<std::string> CompileCodeObject(const std::string& source,
                                        const std::vector<std::string>& archs = {"gfx90a",
                                                                                 "gfx1030"});

}  // namespace kiln::rocm
