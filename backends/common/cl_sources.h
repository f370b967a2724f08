// The device kernel library's sources, embedded at build time from backends/common/cl/
// (embed_cl.cmake). Each is a NUL-terminated string. The .cl files are OpenCL C; the gpu
// backend compiles the same files as CUDA after kClCudaCompat (cl/cuda_compat.h).
#pragma once

namespace kiln::devk {

extern const char kClPrelude[];     // cl/prelude.cl: dtype access, conversions, metadata types
extern const char kClLibrary[];     // cl/library.cl: the hand-written, dtype-generic kernels
extern const char kClLinear[];      // cl/linear.cl: Linear/MatMul templates (per dtype)
extern const char kClAttention[];   // cl/attention.cl: dense and paged attention templates
extern const char kClTraining[];    // cl/training.cl: fused cross-entropy and optimizer templates
extern const char kClSampling[];    // cl/sampling.cl: the sample op (engine/sampling.h)
extern const char kClCudaCompat[];  // cl/cuda_compat.h: OpenCL C names on CUDA

}  // namespace kiln::devk
