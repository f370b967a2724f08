// A plugin from another build (as one left in the plugin folder after kilnd was upgraded): it
// links the engine as the gpu plugins do and adopts the host's services under another build
// identity, which is refused, naming both.
#include <string>

#include "engine/backend/plugin_abi.h"
#include "engine/compiler/host_services.h"

extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v1(
    const KilnBackendHostV1* host) {
  const kiln::Status s = kiln::compiler::AdoptHostServices(
      static_cast<const kiln::compiler::HostServices*>(host->services), "0123456789abcdef");
  if (s.ok()) return 0;  // registers nothing: the host reports that as a failure too
  host->log(host->registry, std::string(kiln::StatusMessage(s)).c_str());
  return 1;
}
