// Linear and MatMul kernels of the cpu backend (see select.h for what is covered).
//
// The kernel data holds a plan: the implementation per range of M (rows of x), chosen at
// compile time by timing (autotune.h) or, for small or untunable shapes, by a heuristic.
// At run time the kernel reads M from its arguments, picks the range's implementation and
// splits the work over the pool: by rows of N for GEMV (each weight byte read once), by
// 2-D tiles for GEMM, by N tiles for oneDNN.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "backends/cpu/kernels/select.h"

namespace kiln::cpu {

enum class GemmImpl : uint8_t {
  kGemv,           // weights decoded in registers (kernels.h gemv)
  kGemvQ8,         // activations quantized to q8, integer dots (only with q8_activations)
  kGemm,           // packed panels + micro-kernel (kernels.h gemm)
  kOneDnn,         // oneDNN f32 matmul (f32 weights)
  kOneDnnDequant,  // weight panels decoded to f32, then oneDNN
  kGemmAvx2,       // the avx2 variant's packed GEMM on an avx512 CPU: one more candidate for
                   // the tuner (a Zen 4 runs 512-bit FMAs as two 256-bit halves)
  kGemmBf16,       // bf16 weights, activations rounded to bf16, vdpbf16ps (only with
                   // bf16_activations on a CPU with AVX-512 BF16)
};
const char* GemmImplName(GemmImpl impl);

// Representative M values timed for a symbolic M: decode batch sizes and prefill chunks.
// (The compile request does not carry the symbol's upper bound; 512 stands in for it.)
std::span<const int64_t> RepresentativeMs();

StatusOr<std::optional<backend::Kernel>> MakeGemmKernel(const backend::KernelRequest& req,
                                                        const SelectContext& ctx);

// The plan of a kernel made by MakeGemmKernel, "1-8:gemv 9-:gemm" (tests, dumps).
std::string DescribeGemmPlan(const backend::Kernel& kernel);

// A row-major [rows, cols] tensor argument over `data`: for callers that launch these kernels
// directly (the tuner's timing runs, benches, tests).
TensorArg Arg2D(void* data, DType t, int64_t rows, int64_t cols);

}  // namespace kiln::cpu
