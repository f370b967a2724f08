// Kernel selection for the cpu backend's hand-tuned kernels: the one entry point
// backends/cpu/cpu_backend.cc calls before its generic paths.
//
// Covered (f32 activations and outputs):
//   linear      x [..., K] f32, w [N, K] f32/f16/bf16/q4_0/q4_1/q8_0/mxfp4 (K-quants through
//               the dequantizer) — GEMV with weights decoded in registers (decode), packed
//               GEMM (prefill), oneDNN f32 GEMM (f32 weights) or weight panels dequantized
//               for oneDNN; chosen per M range by autotuning (autotune.h). Under an opt-in
//               numerics policy, every M: q8 activations with integer dots (quantized
//               weights), or bf16 activations with vdpbf16ps (bf16 weights).
//   matmul      f32 (batched, broadcast batch dims) — packed GEMM or oneDNN; 2-D with a
//               f16/bf16/q4_0/q4_1/q8_0/mxfp4 right operand (a frozen weight: dx = g w) —
//               its column panels decoded to f32 per thread, then oneDNN or the packed GEMM.
//   rope, kv_write, contiguous  threaded direct loops (token_ops.h).
//   attention, attention_backward  dense f32 attention: causal, window or document masks
//               and soft-capping (the forward) natively; with a compile function, any other
//               mask_mod (and score_mod in the forward) compiled into the kernel, iterating
//               over its block mask (attention_train.h, attention_mods.h).
//   adamw, adam, sgd, adagrad  contiguous f32 tensors — one threaded pass, the reference's
//               arithmetic (optimizer.h).
//   fused_cross_entropy  f32 logits, contiguous rows — vectorised, threads over rows
//               (cross_entropy.h).
//   paged_attention  q f32, K/V caches both f32, f16 or bf16, mask none, causal, sliding
//               window, chunked (alone or with a window), score_mod none, ALiBi, soft-capping
//               (Gemma 2) or ALiBi then the cap natively; any other mask_mod and score_mod
//               compiled into the kernel (with a compile function; attention_mods.h),
//               skipping the key tiles a compiled mask hides —
//               threads over (sequence, kv head, query rows), and a decode row of >= 128
//               keys over its context (by its length and the pool size only: batch-independent).
// Everything else (and layouts the kernels do not take, found at run time: non-contiguous
// rows, overlapping sequences) runs the reference kernel.
//
// Instruction set: ActiveIsa() (isa.h; KILN_CPU_ISA lowers it). Thread-safety: thread-safe.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "backends/cpu/kernels/isa.h"
#include "engine/backend/backend.h"
#include "engine/compiler/codegen.h"

namespace kiln::cpu {

class GemmTuner;

struct SelectContext {
  backend::Device* device = nullptr;  // for autotuning runs (CreateStream)
  int threads = 1;                    // the device's pool size (part of tuning keys)
  Isa isa = Isa::kScalar;
  GemmTuner* tuner = nullptr;  // null: heuristics only
  // The reference kernel factory (the fallback for layouts the fast kernels do not take).
  StatusOr<backend::Kernel> (*reference)(const backend::KernelRequest&) = nullptr;
  // Numerics policy: allow quantizing activations to q8 blocks for q4_0/q4_1/q8_0/mxfp4
  // weights (ggml's decode numerics: ~1e-5 normalized MSE against exact f32 products, beyond
  // the op harness's f32 tolerance). Off by default; KILN_CPU_Q8_ACTIVATIONS=1 turns it on.
  bool q8_activations = false;
  // Numerics policy: allow rounding activations to bf16 for bf16 weights, products accumulated
  // with vdpbf16ps (ggml's numerics for bf16 weights; kernels.h Bf16Kernels) — only where the
  // CPU has AVX-512 BF16, exact f32 elsewhere. Off by default; KILN_CPU_BF16_ACTIVATIONS=1
  // turns it on.
  bool bf16_activations = false;
  // Tests and debugging: use this GEMM implementation ("gemv", "gemv_q8", "gemm",
  // "onednn", "onednn_dequant", "gemm_avx2" (avx512 only), "gemm_bf16") for every M where it
  // applies. Null: tuned or heuristic choice.
  const char* force_gemm = nullptr;
  // Builds hand-written code that calls generated expressions and returns the addresses of
  // its functions `g.entry + suffix` (the cpu backend passes its JIT's GetFunctions). Null:
  // kernels that need it (attention modifiers the kernels do not implement) are not selected.
  std::function<StatusOr<std::vector<void*>>(const compiler::GeneratedKernel& g,
                                             const std::vector<std::string>& suffixes)>
      compile;
};

// The cpu backend's context: ActiveIsa(), GemmTuner::Global() (autotuning with the disk
// cache), KILN_CPU_Q8_ACTIVATIONS, the given device, pool size and reference kernels.
SelectContext DefaultSelectContext(
    backend::Device* device, int threads,
    StatusOr<backend::Kernel> (*reference)(const backend::KernelRequest&));

// A hand-tuned kernel for `req`, or nullopt if none covers it (the backend then uses its
// generic path). Errors only for real failures (e.g. a timing run failed).
StatusOr<std::optional<backend::Kernel>> SelectKernel(const backend::KernelRequest& req,
                                                      const SelectContext& ctx);

// ---- Helpers of the hand-tuned kernels ----

// Runs `fallback` (the reference kernel, from SelectContext::reference) for a launch whose
// layout a fast kernel finds it cannot take at run time.
inline void RunFallback(const backend::Kernel& fallback, const LaunchArgs& a, const ExecCtx& c) {
  LaunchArgs fa = a;
  fa.kernel_data = fallback.data.get();
  fallback.fn(fa, c);
}

// The last axis is contiguous (or has at most one element).
inline bool InnerContiguous(const TensorArg& t) {
  return t.shape[t.rank - 1] <= 1 || t.strides[t.rank - 1] == 1;
}

// The i32/i64 element at element offset `off` of an index tensor.
inline int64_t IndexAt(const TensorArg& t, int64_t off) {
  return t.dtype == DType::kI64 ? static_cast<const int64_t*>(t.data)[off]
                                : static_cast<const int32_t*>(t.data)[off];
}
// Element i of a 1-D (possibly strided) index tensor.
inline int64_t LoadIndex(const TensorArg& t, int64_t i) {
  return IndexAt(t, i * (t.rank > 0 ? t.strides[0] : 0));
}

}  // namespace kiln::cpu
