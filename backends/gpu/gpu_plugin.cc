// The entry point of libkiln_backend_cuda.so and libkiln_backend_hip.so
// (engine/backend/plugin_abi.h): adopts the host's engine state (refusing a host of another
// build), then registers the backend where a driver, a device and the runtime compiler exist,
// and declines (saying why) elsewhere, so kilnd without a GPU starts as it would without the
// plugin.
#include <cstddef>
#include <string>

#include "backends/gpu/gpu_device.h"
#include "engine/backend/plugin_abi.h"
#include "engine/compiler/host_services.h"

extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v1(
    const KilnBackendHostV1* host) {
  if (host == nullptr || host->abi_version != KILN_BACKEND_ABI_VERSION) return 1;
  const auto* services =
      host->struct_size >= offsetof(KilnBackendHostV1, services) + sizeof(host->services)
          ? static_cast<const kiln::compiler::HostServices*>(host->services)
          : nullptr;
  if (services == nullptr) {
    host->log(host->registry, "the host passes no engine services (a kilnd of another build)");
    return 1;
  }
  if (const kiln::Status s = kiln::compiler::AdoptHostServices(services, kiln::compiler::BuildId());
      !s.ok()) {
    host->log(host->registry, std::string(kiln::StatusMessage(s)).c_str());
    return 1;
  }
  kiln::StatusOr<std::unique_ptr<kiln::gpu::GpuBackend>> b = kiln::gpu::CreateGpuBackend();
  if (!b.ok()) {
    const std::string why(kiln::StatusMessage(b.status()));
    host->log(host->registry, why.c_str());
    return b.status().code() == kiln::StatusCode::kUnavailable ? KILN_BACKEND_DECLINED : 1;
  }
  return host->register_backend(host->registry, b->release(),
                                kiln::backend::kBackendInterfaceVersion);
}
