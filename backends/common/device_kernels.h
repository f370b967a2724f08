// The device kernel layer: which kernel runs each op on a device that runs the kernel library
// (backends/common/cl/*.cl) and the engine's generated kernels, and the launchers that bind
// their arguments. Shared by the xpu backend (OpenCL) and the gpu backend (CUDA, which
// compiles the same OpenCL C after cl/cuda_compat.h), so every op's device kernel is written
// once.
//
//   generated   pointwise/generator ops, reductions/row ops and fused groups: the engine's
//               printer (engine/compiler/codegen.h) in the host's dialect; attention, paged
//               attention and attention_backward from a template (cl/attention.cl) with the
//               node's mask_mod/score_mod printed in
//   templated   Linear with quantized / f16 / bf16 weights (dequantize-in-register dot
//               products), MatMul and Linear fallbacks (tiled), per dtype combination
//   library     dtype-generic data movement: contiguous, concat, gather, scatters, take_along,
//               top_k, kv_write, rope, dim_value (cl/library.cl)
//   BLAS        GEMM for MatMul and Linear with float operands of one dtype, where the host
//               has one (CLBlast, cuBLAS) and the strides fit BLAS; Linear with f16, bf16 or
//               block-quantized weights and at least kCastGemmRows rows (prefill, training)
//               converts the weight into the queue's scratch first (exactly: the same values
//               the templates dequantize in registers), where the host offers scratch
//
// A device implements KernelHost (what kernels need: declaring and building kernel sources,
// resolving device addresses, a BLAS GEMM) and hands its Stream's Queue to kernels as
// ExecCtx::native_stream. KernelHost::GetKernel is this layer's (device_kernels.cc).
//
// The calling convention of every kernel: the buffer of each tensor, then one struct of int64
// values passed by value —
//   templates and library:  (uchar* buf0, ..., const metaM m): byte offsets, sizes, strides
//                           (prelude.cl's meta8 ... meta120);
//   generated (engine ABI): (T* out, const T0* in0, ..., KMeta m): element offsets and
//                           strides (compiler::DeviceLaunch packs them).
// A device address resolves to (buffer handle, byte offset): a cl_mem and an offset on OpenCL,
// the pointer itself and 0 on CUDA.
//
// Thread-safety: GetKernel is thread-safe when the host's Declare*/Upload are. A Queue is used
// by one thread at a time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "engine/backend/backend.h"
#include "engine/compiler/codegen.h"
#include "engine/compiler/target.h"

namespace kiln::devk {

class KernelHost;

// One kernel function of a host's program; owned by the host (stable pointer).
class KernelSlot {
 public:
  virtual ~KernelSlot() = default;
  const std::string& name() const { return name_; }

 protected:
  std::string name_;
};

// A launch's arguments: buffers, then metadata values (see the calling convention above).
class Args {
 public:
  static constexpr int kMaxMems = 40;
  static constexpr int kMaxMeta = 256;
  // The meta struct sizes the prelude declares (meta8 ... meta120); the smallest that holds n,
  // or -1.
  static int MetaSize(int n);

  // Adds the buffer behind device address `p` as the next buffer argument and returns the
  // byte offset of `p` within it. On a bad address records an error (see ok()).
  int64_t Mem(const KernelHost& host, const void* p);
  void Long(int64_t v);
  // Reserves the next `n` meta values (zeroed) for the caller to fill; empty (and !ok()) if
  // they do not fit.
  std::span<int64_t> Reserve(int n);
  // Appends a tensor descriptor (prelude.cl's TD: 18 longs: byte offset, rank, shape[8],
  // strides[8]) of `t`, whose buffer was added with Mem() and returned `byte_offset`.
  void Desc(const TensorArg& t, int64_t byte_offset);

  bool ok() const { return ok_; }
  int num_mems() const { return nmems_; }
  void* const* mems() const { return mems_.data(); }
  int num_meta() const { return nmeta_; }
  const int64_t* meta() const { return meta_.data(); }

 private:
  std::array<void*, kMaxMems> mems_{};
  std::array<int64_t, kMaxMeta> meta_{};
  int nmems_ = 0;
  int nmeta_ = 0;
  bool ok_ = true;
};

// C[batch] = op(A)[batch] x op(B)[batch], row-major, in one dtype. Operands are buffer handles
// (Args::Mem's) with element offsets; `trans` means the operand's transpose is row-major with
// leading dimension `ld`.
struct GemmOperand {
  void* mem = nullptr;
  size_t offset = 0;  // elements
  size_t ld = 0;
  bool trans = false;
  size_t batch_stride = 0;  // elements
};
struct GemmCall {
  DType dtype = DType::kF32;
  GemmOperand a, b, c;
  size_t batch = 1, m = 0, n = 0, k = 0;
};

// Dense attention offered to a library (cuDNN SDPA) before the template runs: the launcher's
// tensors, q [B,Hq,T,D], k/v [B,Hkv,S,D], out [B,Hq,T,D], lse [B,Hq,T] (null without it), as
// the node has them (any dtype, any strides: the host checks what it handles). Offered only
// when the node has no score_mod, no aux tensors, and its mask is attn::CausalMask().
struct AttentionCall {
  const TensorArg* q = nullptr;
  const TensorArg* k = nullptr;
  const TensorArg* v = nullptr;
  const TensorArg* out = nullptr;
  const TensorArg* lse = nullptr;
  double scale = 0;
};
// Its backward (attention_backward), offered under the same conditions: q, k, v, the forward's
// out and lse, the output's gradient d_out; writes dq [B,Hq,T,D], dk and dv [B,Hkv,S,D].
struct AttentionBackwardCall {
  const TensorArg* q = nullptr;
  const TensorArg* k = nullptr;
  const TensorArg* v = nullptr;
  const TensorArg* out = nullptr;
  const TensorArg* d_out = nullptr;
  const TensorArg* lse = nullptr;
  const TensorArg* dq = nullptr;
  const TensorArg* dk = nullptr;
  const TensorArg* dv = nullptr;
  double scale = 0;
};

// What a device's Stream hands kernels as ExecCtx::native_stream while it runs launches.
class Queue {
 public:
  explicit Queue(KernelHost* h) : host(h) {}
  virtual ~Queue() = default;

  KernelHost* host;
  Status status;  // the first error of the current run

  void Fail(const Status& s) {
    if (status.ok()) status = s;
  }
  // Launches (or records) `k` over `dims` (1..3) dimensions: `global` work-items in total
  // (multiples of `local`) in groups of `local`. `meta_size`: the kernel's declared metaM
  // (0: Args::MetaSize(num_meta)). Zero-sized launches are skipped.
  virtual void Enqueue(KernelSlot* k, const Args& args, int dims, const size_t* global,
                       const size_t* local, int meta_size = 0) = 0;
  // For library calls a capture cannot record (CLBlast in an OpenCL command buffer): while
  // capturing, records the launch to be re-run at replay and returns true (the caller does
  // nothing more); otherwise returns false.
  virtual bool DeferWhileCapturing(KernelFn fn, const LaunchArgs& args) {
    (void)fn, (void)args;
    return false;
  }
  // Runs `call` through the host's BLAS; false when the host has none for it or declines
  // (the caller falls back to its own kernel).
  virtual bool Gemm(const GemmCall& call) {
    (void)call;
    return false;
  }
  // Runs causal dense attention through the host's library; false when the host has none or
  // declines (the caller runs the template).
  virtual bool Attention(const AttentionCall& call) {
    (void)call;
    return false;
  }
  virtual bool AttentionBackward(const AttentionBackwardCall& call) {
    (void)call;
    return false;
  }
  // The device address of at least `bytes` of scratch memory for temporaries between launches
  // (a weight converted for a BLAS GEMM). Work enqueued on this queue may use it until the next
  // Scratch call: the stream runs in order. Null when the host offers none (the caller takes
  // another path) or cannot allocate.
  virtual void* Scratch(size_t bytes) {
    (void)bytes;
    return nullptr;
  }
};

// Rows of a Linear from which converting the weight for a BLAS GEMM beats the templates.
inline constexpr int64_t kCastGemmRows = 32;

inline Queue& QueueOf(const ExecCtx& c) { return *static_cast<Queue*>(c.native_stream); }

class KernelHost : public backend::Device {
 public:
  // Which kernel runs `request` (device_kernels.cc). Unimplemented for ops and dtype
  // combinations the layer has no kernel for.
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& request) override;

  // "xpu", "cuda": the first part of kernel names ("cuda.lib.gather").
  virtual const char* kernel_prefix() const = 0;
  // The printer's dialect for generated kernels and modifier functions.
  virtual compiler::Dialect dialect() const = 0;
  const compiler::CodegenOptions& codegen_options() const { return codegen_; }
  // The work-group (block) size of every kernel (KILN_WG in the sources).
  size_t work_group() const { return static_cast<size_t>(codegen_.work_group_size); }
  // Whether kernels may compute in double (f64 tensors, f64 accumulation).
  virtual bool fp64() const = 0;
  // Why the device has no f64, for errors ("cl_khr_fp64 missing").
  virtual const char* no_fp64_reason() const { return "no f64 support"; }
  // The largest kernel argument list in bytes (buffers and the meta struct).
  virtual size_t max_param_bytes() const = 0;
  // Why the device declines the sample op's kernel (serial per row: one work-item walks the
  // vocabulary), so that models sample on the host; empty: it offers the kernel.
  virtual std::string SampleKernelDeclined() const { return ""; }
  // Whether the Linear template reads 32-element block weights (Q4_0, Q4_1, Q8_0, MXFP4)
  // element by element, work-items side by side, instead of a whole block per work-item: on
  // GPUs a decode GEMV's K / 32 blocks leave most of a 256-wide work-group idle otherwise.
  virtual bool element_block_weights() const { return false; }
  // The lanes of a sub-group (a CUDA warp) whose shuffles the Linear template's decode kernel
  // reduces over (LINEAR_SG in cl/linear.cl: a sub-group per weight row, no local memory, no
  // barrier); 0: the device has none, and the work-group kernel runs.
  virtual int linear_lanes() const { return 0; }
  // Whether Queue::Gemm handles this dtype, and the BLAS' name for kernel names ("clblast").
  virtual bool HasGemm(DType t) const = 0;
  virtual const char* blas_name() const = 0;

  // Declares a kernel whose source defines `__kernel void KNAME(...)`; KNAME is replaced by a
  // name derived from `prefix` and a hash of the source. The same source gives the same slot.
  // Compiled with the prelude and the printer's preamble, lazily or in a batch.
  virtual KernelSlot* DeclareKernel(std::string_view prefix, std::string_view source) = 0;
  // A kernel generated by the engine's printer (dialect()). The same entry gives the same slot.
  virtual KernelSlot* DeclareGenerated(const compiler::GeneratedKernel& kernel) = 0;
  // A kernel of the hand-written library (cl/library.cl).
  virtual KernelSlot* LibraryKernel(std::string_view name) = 0;
  // Buffer handle and byte offset behind a device address of this device; false if it is
  // not one.
  virtual bool Resolve(const void* p, void** mem, size_t* offset) const = 0;
  // Blocking upload into a buffer of this device (tables kernels read, made at compile time).
  virtual Status Upload(const backend::Buffer& dst, const void* src, size_t bytes) = 0;

 protected:
  compiler::CodegenOptions codegen_;
};

// What the last launch of an attention, paged_attention or attention_backward kernel with a
// block table (a mask other than a plain causal or sliding-window one; see cl/attention.cl)
// classified and visited, for tests and diagnostics. Tiles are work_group() query rows (paged:
// query tokens) x work_group() keys; `empty` + `full` + `partial` is the table's size (per
// batch row and head where the mask reads them; paged: per head, over the key positions a
// block-table row addresses). `visited`: the blocks its work-group rows walked, summed over
// rows (the forward's and dq's key blocks, dk/dv's query blocks per query head).
struct BlockTableStats {
  int64_t empty = 0, full = 0, partial = 0;
  uint64_t visited = 0;
};
// Reads them back (blocking): call once the streams that ran `launch` have finished.
// InvalidArgument for a launch of another kernel, NotFound when it has no table or has not run.
StatusOr<BlockTableStats> LastBlockTableStats(KernelHost& dev, const Launch& launch);

// compiler::Target helpers every host shares:
// - the fusion caps of a device whose kernel arguments take `max_param_bytes`: pointwise chains
//   and reductions with prologue/epilogue (GEMM epilogues do not fuse: the GEMMs are BLAS calls
//   and templates), up to as many inputs as fit at rank 8;
// - DeclareKernels: GetKernel for every request that declares a generated or templated kernel
//   (library kernels come from one program; some of their GetKernel calls do work). The first
//   error of a fused group is returned (the compiler then compiles the program unfused); other
//   errors surface when the program is assigned, naming the node. The host then builds what
//   was declared.
compiler::FusionCaps DeviceFusionCaps(size_t max_param_bytes);
Status DeclareKernels(KernelHost& host, std::span<const backend::KernelRequest> requests);

// `source` (a template declared through KernelHost::DeclareKernel) with every KNAME token
// replaced by `name`.
std::string NameKernel(std::string_view source, std::string_view name);

// The prelude of every program: KILN_WG, KILN_FP64 or KILN_NO_FP64, DT_<NAME> codes, then
// cl/prelude.cl.
std::string ProgramPrelude(size_t work_group, bool fp64);

// The source of one program of a CUDA or HIP device (`dialect` kCuda or kHip): cl/cuda_compat.h
// (OpenCL C names on CUDA and HIP), the prelude (f64 on), then the kernel library (`library`)
// or the printer's preamble in `dialect` and each of `kernels` (the sources of declared
// kernels). What the gpu backend builds and the kernel compile tests compile.
std::string GpuProgramSource(compiler::Dialect dialect, bool library, size_t work_group,
                             std::span<const std::string> kernels);
// The name a GPU device gives a template declared with `prefix` and `source`: the prefix and
// the source's hash, so equal templates share one kernel.
std::string TemplateKernelName(std::string_view prefix, std::string_view source);

}  // namespace kiln::devk
