// The entry point of libkiln_backend_cuda.so (engine/backend/plugin_abi.h): registers the
// "cuda" backend where a driver, a device and NVRTC exist, and declines (saying why) elsewhere,
// so kilnd without a GPU starts as it would without the plugin.
#include <string>

#include "backends/gpu/gpu_device.h"
#include "engine/backend/plugin_abi.h"

extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v1(
    const KilnBackendHostV1* host) {
  if (host == nullptr || host->abi_version != KILN_BACKEND_ABI_VERSION) return 1;
  kiln::StatusOr<std::unique_ptr<kiln::gpu::GpuBackend>> b = kiln::gpu::CreateGpuBackend();
  if (!b.ok()) {
    const std::string why(kiln::StatusMessage(b.status()));
    host->log(host->registry, why.c_str());
    return b.status().code() == kiln::StatusCode::kUnavailable ? KILN_BACKEND_DECLINED : 1;
  }
  return host->register_backend(host->registry, b->release(),
                                kiln::backend::kBackendInterfaceVersion);
}
