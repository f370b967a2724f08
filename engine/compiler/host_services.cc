#include "engine/compiler/host_services.h"

#include <atomic>

#include "engine/compiler/build_id.h"
#include "engine/compiler/kernel_cache.h"

namespace kiln::compiler {

// compile.cc: the calling thread's compile context (its own copy's).
const void* ThreadCompileContext();

namespace {
// The host's services (they live as long as the host process, which outlives the plugin).
std::atomic<const HostServices*> g_adopted{nullptr};
}  // namespace

std::string_view BuildId() { return KILN_BUILD_ID; }

const HostServices& ThisProcessServices() {
  static const HostServices services = {
      .build_id = KILN_BUILD_ID,
      .compile_context = &ThreadCompileContext,
      .cache_dir = &CacheDir,
  };
  return services;
}

Status AdoptHostServices(const HostServices* host, std::string_view plugin_build_id) {
  if (host == nullptr) {
    g_adopted.store(nullptr);
    return OkStatus();
  }
  if (host->build_id == nullptr || plugin_build_id != host->build_id) {
    return FailedPrecondition(
        "the plugin was built from other sources than this program (plugin "
        "build ",
        plugin_build_id, ", program build ", host->build_id == nullptr ? "unknown" : host->build_id,
        "): install the plugins built with this kilnd");
  }
  if (host->compile_context == nullptr || host->cache_dir == nullptr) {
    return FailedPrecondition("the host's services are incomplete");
  }
  g_adopted.store(host, std::memory_order_release);
  return OkStatus();
}

const HostServices* AdoptedHostServices() { return g_adopted.load(std::memory_order_acquire); }

}  // namespace kiln::compiler
