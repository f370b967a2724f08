// MakeCudaBackend (backends/builtin.h): the gpu backend when a CUDA driver and device exist.
#include "backends/builtin.h"
#include "backends/gpu/gpu_device.h"
#include "spdlog/spdlog.h"

namespace kiln::backend {

std::unique_ptr<Backend> MakeCudaBackend() {
  StatusOr<std::unique_ptr<gpu::GpuBackend>> b = gpu::CreateGpuBackend();
  if (!b.ok()) {
    spdlog::info("cuda: backend not registered: {}", StatusMessage(b.status()));
    return nullptr;
  }
  return *std::move(b);
}

}  // namespace kiln::backend
