// The OpenCL C sources of the xpu backend, embedded at build time from backends/xpu/cl/*.cl
// (embed_cl.cmake). Each is a NUL-terminated string.
#pragma once

namespace kiln::xpu {

extern const char kClPrelude[];    // cl/prelude.cl: dtype access, conversions, metadata types
extern const char kClLibrary[];    // cl/library.cl: the hand-written, dtype-generic kernels
extern const char kClLinear[];     // cl/linear.cl: Linear/MatMul templates (per dtype)
extern const char kClAttention[];  // cl/attention.cl: dense and paged attention templates
extern const char kClTraining[];   // cl/training.cl: fused cross-entropy and optimizer templates
extern const char kClSampling[];   // cl/sampling.cl: the sample op (engine/sampling.h)

}  // namespace kiln::xpu
