// Codegen: prints a KernelSpec (kernel_spec.h) as source code in one of four dialects —
// C++ for the CPU backend, OpenCL C (the xpu backend), CUDA C (NVRTC) and HIP C (hipcc/hiprtc) —
// from one printer core. Every backend that runs generated code gets it from here: cpu compiles
// the C++ (backends/cpu/jit), xpu builds the OpenCL C (backends/xpu), and hand-written kernels
// that take expressions (attention's mask_mod/score_mod) print them with GenerateExprFunction.
//
// One printer: the expression printer (SSA temporaries, shared subtrees once, loop-invariant
// values hoisted to the row level), one reduce printer (stages, combines, epilogues) with a
// C++ and a device skeleton, and pointwise skeletons. The dialects differ only in the preamble
// (typedefs, address spaces, bit casts, math names, thread indices — CUDA and HIP share theirs,
// HIP adding its runtime header) and in the skeleton (the CPU splits work over pool threads per
// the kernel ABI; devices use work-items).
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
// compiler vectorizes), so results may differ from the interpreter in the last bit. Only f64
// values are computed in double (i64 -> float conversions go through double where the dialect
// has it): OpenCL devices without cl_khr_fp64 (or with KILN_NO_FP64 defined before the
// preamble) run every kernel without f64 tensors.
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
// Pointers are buffer addresses typed by element (OpenCL: the cl_mem of each tensor); `meta`
// is a struct of int64 values `v[]`, passed by value, laid out as (DeviceLaunch packs it):
//   iteration shape [rank]; output: offset, strides[out_rank];
//   per arg in order: kFull/kOut: offset, strides[arg rank]; kAux: offset, length, stride;
//   pointwise kernels: a `dense` flag (every tensor row-major with the output's shape).
// Offsets (from the pointers) and strides are in elements. Reduce kernels iterate in a
// canonical order (kept axes, then reduced axes; outputs without the reduced axes), so one
// kernel serves every reduction with as many of each, keepdim or not; DeviceLaunch permutes
// the shapes and strides. Pointwise kernels use a grid-stride loop over the output elements
// (any 1-D global size). Reduce kernels use one work-group (block) of exactly
// `work_group_size` work-items per output row, looping over rows by group id. See
// DeviceLaunch. kGemmEpilogue has no device form (Unimplemented).
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
  // Work-items per work-group of device kernels (a power of two, 1..1024). Reduce kernels
  // size their local scratch by it, so launches must use exactly this local size.
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

// Names hand-written code as GenerateKernel names its kernels: `text` (to be compiled after
// Preamble(dialect)) spells its symbols with the placeholder kKernelName, which becomes the
// entry `kiln_<hash>` everywhere in it (a prefix: `kiln_KERNEL_NAME_block` -> `<entry>_block`).
inline constexpr const char* kKernelName = "kiln_KERNEL_NAME";
GeneratedKernel NameKernel(Dialect dialect, const std::string& text);

// Preamble + the kernels (duplicates by entry are emitted once). REQUIRES: same dialect.
std::string ModuleSource(Dialect dialect, std::span<const GeneratedKernel> kernels);

// ---- Expression functions ----

// One expression as a function, for hand-written kernels that take expressions as parameters
// (attention's mask_mod / score_mod), printed by the kernel printer (same numerics):
//   KFN <T> <name>(<T0> in0, ..., ki64 idx0, ..., GLOBAL const ku8* x0, ki64 xn0, ki64 xs0, ...)
// T is the expression's C type (float, double, ki64, bool); Input(i) is `in<i>`, of expression
// type inputs[i]; Index(a) is `idx<a>` (a < num_indices); Load(k, e) reads element e of aux
// tensor k, whose element 0 is at byte address x<k>, with length xn<k> and stride xs<k>
// (elements); reads out of range give 0. Compile after Preamble(dialect).
struct ExprFunction {
  std::string name;
  Expr value;
  std::vector<DType> inputs;  // expression types (f32, f64, i64, bool)
  int num_indices = 0;
  std::vector<DType> aux;  // element dtypes of the aux tensors
};
// Errors: leaves the function does not have (InvalidArgument), quantized aux tensors.
StatusOr<std::string> GenerateExprFunction(const ExprFunction& f, Dialect dialect);

// ---- Device launches ----

struct DeviceGeometry {
  int64_t global_size = 0;  // work-items in total (a multiple of local_size)
  int64_t local_size = 0;   // work-items per group
};

// What a device backend needs to launch a generated kernel: its meta values and geometry.
// Made once per kernel from its spec; no allocation per launch. Copyable value.
class DeviceLaunch {
 public:
  DeviceLaunch() = default;
  // REQUIRES: `spec` passes Validate(); `options` are those the kernel was generated with.
  explicit DeviceLaunch(const KernelSpec& spec, const CodegenOptions& options = {});

  // Values in the kernel's meta struct (its size is 8 * meta_size() bytes).
  int meta_size() const { return meta_size_; }
  // The meta values of one launch: `args` as the engine resolved them (shapes, strides),
  // `offsets` the element offset of each tensor from the pointer the launcher binds (output
  // first, then args in order; missing: 0). REQUIRES: meta.size() >= meta_size().
  void PackMeta(const LaunchArgs& args, std::span<const int64_t> offsets,
                std::span<int64_t> meta) const;
  DeviceGeometry Geometry(const LaunchArgs& args) const;

 private:
  struct Arg {
    ArgRole role;
    int rank;
    int at;  // position of its offset in the meta values
  };
  KernelKind kind_ = KernelKind::kPointwise;
  int rank_ = 0;
  int shape_arg_ = -1;  // the arg whose shape is the iteration space (-1: the output)
  int64_t wg_ = 128;
  int out_at_ = 0, dense_at_ = -1, meta_size_ = 1;
  uint32_t reduced_ = 0;       // reduced axes (bit mask)
  std::vector<int> perm_;      // the spec's axis of each iteration axis of the kernel
  std::vector<int> out_axes_;  // the axis of output-shaped tensors behind each meta stride
  std::vector<Arg> args_;
};

}  // namespace kiln::compiler
