// How the CPU device uses its JIT: expression-form kernels with the interpreter as fallback,
// and the kernels of fused groups (engine/compiler/target.h).
//
// Thread-safety: thread-safe (the JIT is).
#pragma once

#include <functional>

#include "backends/cpu/jit/cpu_jit.h"
#include "engine/backend/backend.h"

namespace kiln::cpu::jit {

// The spec the JIT compiles for `req`: a fused group's spec, else the op's expression form.
StatusOr<compiler::KernelSpec> JitSpecFor(const KernelRequest& req);

// The generated kernel for `req`'s expression form, keeping `interp` (the interpreter kernel
// for the same request) as its fallback and its name.
Kernel ExpressionKernel(CpuJit& jit, const KernelRequest& req, Kernel interp);

// The kernel of a fused group: generated code for reductions; for a GEMM group, `gemm` (the
// device's kernel for group.GemmRequest()) then the generated epilogue over each thread's
// share of rows (after all threads finished the GEMM, whatever split it used).
using KernelProvider = std::function<StatusOr<Kernel>(const KernelRequest&)>;
StatusOr<Kernel> FusedKernel(const compiler::FusedGroup& group, CpuJit& jit,
                             const KernelProvider& gemm);

}  // namespace kiln::cpu::jit
