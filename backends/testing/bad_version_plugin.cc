// A plugin built against another backend interface version: the host must refuse it
// (and delete the object it was handed) without crashing.
#include "engine/backend/backend.h"
#include "engine/backend/plugin_abi.h"

namespace {
class StaleBackend final : public kiln::backend::Backend {
 public:
  std::string_view name() const override { return "stale"; }
  int device_count() const override { return 0; }
  kiln::backend::Device* device(int) override { return nullptr; }
};
}  // namespace

extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v1(
    const KilnBackendHostV1* host) {
  return host->register_backend(host->registry, new StaleBackend(),
                                kiln::backend::kBackendInterfaceVersion + 1000);
}
