// Codegen: prints a KernelSpec (kernel_spec.h) as source code in one of four dialects —
// C++ for the CPU backend, OpenCL C (xpu), CUDA C (NVRTC) and HIP C (hipcc/hiprtc) — from one
// printer core. The dialects differ only in a header of typedefs and macros (address spaces,
// bit casts, math function names, thread indices) and in the kernel skeleton (the CPU splits
// work over pool threads per the kernel ABI; devices use work-items).
//
// A module is `Preamble(dialect)` followed by kernels. Every kernel's text is generated with
// a placeholder name, hashed (SHA-256 over the dialect, the preamble and the text) and named
// `kiln_<first 16 hex digits>`, so identical kernels get identical names and keys — the key of
// the on-disk kernel cache and of in-process reuse.
//
// Numerics follow the expression IR (expr.h) and the reference kernels: NaN-propagating
// max/min, integer division by 0 giving 0, Python-signed integer modulo, float -> integer
// stores that truncate and saturate (NaN -> 0), integer -> integer stores that wrap,
// round-to-nearest-even narrow-float stores (f16, bf16, fp8), fully -inf rows in softmax.
// Generated f32 code rounds once per operation like the interpreter; transcendental functions
// come from the target's math library (on the CPU, glibc's vector math library where the
// compiler vectorizes), so results may differ from the interpreter in the last bit.
//
// ---- C++ (CPU) ABI ----
// `extern "C" void <entry>(const LaunchArgs&, const ExecCtx&)` — a KernelFn (kernel_abi.h),
// mirrored in the preamble with static_asserts on the layout. Every pool thread calls it;
// each processes its share (contiguous ranges of elements or rows; small launches run on
// thread 0 only). kGemmEpilogue kernels export `<entry>_inplace` and `<entry>_acc`
// (gemm_epilogue.h) instead.
//
// ---- Device ABI (OpenCL C, CUDA, HIP) ----
//   kernel void <entry>(T_out* out, const T_0* arg0, ..., KMeta_<entry> meta)
// Pointers are the buffers' base addresses (typed by element); `meta` is a struct of int64
// values `v[]`, passed by value, laid out as (see PackDeviceMeta):
//   iteration shape [rank]; output: offset, strides[out_rank];
//   per arg in order: kFull/kOut: offset, strides[arg rank]; kAux: offset, length, stride.
// Offsets and strides are in elements. Pointwise kernels use a grid-stride loop over the
// output elements (any 1-D global size). Reduce kernels use one work-group (block) of exactly
// `work_group_size` work-items per output row, looping over rows by group id. See
// DeviceLaunchGeometry. kGemmEpilogue has no device form (Unimplemented).
//
// Thread-safety: pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/backend/kernel_abi.h"
#include "engine/compiler/kernel_spec.h"

namespace kiln::compiler {

enum class Dialect : uint8_t { kCpp, kOpenCL, kCuda, kHip };
const char* DialectName(Dialect d);  // "c++", "opencl", "cuda", "hip"

struct CodegenOptions {
  // Work-items per work-group of device reduce kernels (a power of two, 32..1024).
  int work_group_size = 128;
};

struct GeneratedKernel {
  std::string entry;  // "kiln_0123456789abcdef" (the symbol; epilogues add _inplace/_acc)
  std::string code;   // the kernel's definitions (compile after Preamble(dialect))
  std::string key;    // hex SHA-256 of dialect + preamble + code: the cache key
  Dialect dialect = Dialect::kCpp;
};

// Typedefs, ABI mirror (C++), conversion and math helpers for `dialect`.
const std::string& Preamble(Dialect dialect);

// Prints one kernel. Errors: the spec fails Validate(), or the dialect cannot express it
// (kGemmEpilogue on a device dialect).
StatusOr<GeneratedKernel> GenerateKernel(const KernelSpec& spec, Dialect dialect,
                                         const CodegenOptions& options = {});

// Preamble + the kernels (duplicates by entry are emitted once). REQUIRES: same dialect.
std::string ModuleSource(Dialect dialect, std::span<const GeneratedKernel> kernels);

// ---- Device launch helpers ----

// The `meta` values of a device kernel for one launch: `args` as the engine resolved them
// (shapes and strides), `offsets` the element offset of each tensor within the buffer the
// launcher binds (output first, then args in order; empty: all 0).
std::vector<int64_t> PackDeviceMeta(const KernelSpec& spec, const LaunchArgs& args,
                                    std::span<const int64_t> offsets = {});

struct DeviceGeometry {
  int64_t global_size = 0;  // work-items in total (a multiple of local_size)
  int64_t local_size = 0;   // work-items per group
};
// REQUIRES: the spec generated with `options`.
DeviceGeometry DeviceLaunchGeometry(const KernelSpec& spec, const LaunchArgs& args,
                                    const CodegenOptions& options = {});

}  // namespace kiln::compiler
