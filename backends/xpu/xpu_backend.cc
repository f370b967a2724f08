// MakeXpuBackend (backends/builtin.h): the OpenCL backend when a usable device exists.
#include <cstdlib>
#include <string_view>

#include "backends/builtin.h"
#include "backends/xpu/xpu_device.h"
#include "spdlog/spdlog.h"

namespace kiln::backend {

std::unique_ptr<Backend> MakeXpuBackend() {
  if (const char* env = std::getenv("KILN_XPU_DEVICE"); env && std::string_view(env) == "none") {
    spdlog::info("xpu: disabled (KILN_XPU_DEVICE=none)");
    return nullptr;
  }
  StatusOr<std::unique_ptr<xpu::XpuBackend>> b = xpu::CreateXpuBackend();
  if (!b.ok()) {
    spdlog::info("xpu: backend not registered: {}", StatusMessage(b.status()));
    return nullptr;
  }
  return *std::move(b);
}

}  // namespace kiln::backend
