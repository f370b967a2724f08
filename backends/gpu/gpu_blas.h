// cuBLAS, opened at run time (libcublas.so.13 / .12): GEMMs for the gpu backend's MatMul and
// Linear (devk::GemmCall), f32 and f64 exactly (no TF32), f16 and bf16 with f32 accumulation.
// One handle per stream, with a fixed workspace so calls can be captured into CUDA graphs.
//
// Thread-safety: Blas::Load is thread-safe; a BlasHandle is used by one thread at a time.
#pragma once

#include <memory>
#include <string>

#include "backends/common/device_kernels.h"
#include "backends/gpu/gpu_runtime.h"
#include "engine/base/status.h"

namespace kiln::gpu {

struct BlasApi;

class BlasHandle {
 public:
  // The process' cuBLAS (Unavailable when it cannot be opened), bound to `stream` on the
  // current device.
  static StatusOr<std::unique_ptr<BlasHandle>> Create(cudaStream_t stream);
  ~BlasHandle();
  // Whether Gemm handles `t`.
  static bool Supports(DType t);
  // C = op(A) x op(B) per devk::GemmCall (row-major); false (with the reason in `*why`) when
  // cuBLAS refuses it.
  bool Gemm(const devk::GemmCall& call, std::string* why);

 private:
  BlasHandle() = default;
  const BlasApi* api_ = nullptr;
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
};

}  // namespace kiln::gpu
