// A plugin with nothing to offer on this machine (as the cuda plugin without a driver or a
// device): it says why and returns KILN_BACKEND_DECLINED, which the host logs at info level and
// does not count as an error.
#include "engine/backend/plugin_abi.h"

extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v1(
    const KilnBackendHostV1* host) {
  host->log(host->registry, "no frobnicator attached");
  return KILN_BACKEND_DECLINED;
}
