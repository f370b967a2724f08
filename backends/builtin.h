// The backends built into every Kiln binary:
//
//   ref  the reference backend: plain loops for every op, single-threaded. The oracle the op
//        harness checks every other backend against; always registered.
//   cpu  the CPU backend, always present as the fallback device. In this version it runs
//        pointwise and reduction ops by interpreting their expression forms (split over a
//        persistent thread pool) and everything else with the reference kernels; generated
//        and library kernels replace both (issue 4). Threads: KILN_CPU_THREADS (default:
//        hardware concurrency, at most 8).
//   xpu  the OpenCL backend (backends/xpu): Intel GPUs through their OpenCL runtime, PoCL's
//        CPU device in CI. Present only when the build found OpenCL and CLBlast and a usable
//        OpenCL device exists (GPUs preferred, then accelerators, then CPUs;
//        KILN_XPU_DEVICE=<platform>:<device> picks one, KILN_XPU_DEVICE=none disables it).
//   cuda the gpu backend (backends/gpu): NVIDIA GPUs through the CUDA runtime (linked
//        statically), NVRTC and cuBLAS (opened at run time). Not built into the binaries: it
//        is the plugin libkiln_backend_cuda.so (registry.h says where it is looked for),
//        built when the build found the CUDA toolkit (KILN_CUDA=auto|ON|OFF); it registers
//        only where a driver and a device exist. KILN_CUDA_DEVICES=none disables it.
//
// The factories are thread-safe; each call makes an independent backend with its own device.
#pragma once

#include <memory>

#include "engine/backend/backend.h"

namespace kiln::backend {

std::unique_ptr<Backend> MakeRefBackend();
// Arithmetic choices of a cpu backend (a model's `activations` setting).
struct CpuOptions {
  // Quantize activations to 8-bit blocks for q4_0/q4_1/q8_0/mxfp4 weights at every batch
  // size (llama.cpp's numerics); KILN_CPU_Q8_ACTIVATIONS=1 also turns it on.
  bool q8_activations = false;
  // Round activations to bf16 for bf16 weights, vdpbf16ps dots (llama.cpp's numerics for bf16
  // weights), where the CPU has AVX-512 BF16; KILN_CPU_BF16_ACTIVATIONS=1 also turns it on.
  bool bf16_activations = false;
};
// threads 0: from KILN_CPU_THREADS / cores.
std::unique_ptr<Backend> MakeCpuBackend(int threads = 0, CpuOptions options = {});
// Null (and logged) when there is no usable OpenCL device or the build has no OpenCL.
std::unique_ptr<Backend> MakeXpuBackend();
// A new cuda backend from its plugin (Registry::LoadBackendFromPlugin("cuda")); null, and
// the reason logged, when there is no plugin, no CUDA driver or no device.
std::unique_ptr<Backend> MakeCudaBackend();

}  // namespace kiln::backend
