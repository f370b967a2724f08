// What a backend plugin's own copy of the engine takes from its host's.
//
// A plugin (engine/backend/plugin_abi.h; the cuda and hip ones in backends/gpu) links the
// engine statically, so the process-wide state the engine keeps would be the plugin's own and
// never set: the compile context a device reads while the compiler prepares a program
// (FusedGroupOf: the fused groups), and the kernel cache directory kilnd configures
// (SetCacheDir). The host hands the plugin its services (KilnBackendHostV1::services, filled by
// backends/registry.cc); the plugin adopts them before it makes its backends:
//
//   host:    host.services = &compiler::ThisProcessServices();
//   plugin:  KILN_RETURN_IF_ERROR(compiler::AdoptHostServices(services, compiler::BuildId()));
//
// A plugin must come from the same build as its host: the objects that cross (Attrs and their
// expressions, the compile context) are laid out by the same headers. The build identity is a
// hash of engine/'s headers (build_id.cmake), so a plugin left from an older build is refused
// by name instead of crashing the daemon.
//
// Thread-safety: all thread-safe. A plugin's entry point may run more than once
// (Registry::LoadBackendFromPlugin); adopting the same services again changes nothing.
#pragma once

#include <string>
#include <string_view>

#include "engine/base/status.h"

namespace kiln::compiler {

struct HostServices {
  const char* build_id = nullptr;              // BuildId() of the host
  const void* (*compile_context)() = nullptr;  // the calling thread's compile context
  std::string (*cache_dir)() = nullptr;        // CacheDir() as the host resolves it
};

// This build's identity: 16 hex digits.
std::string_view BuildId();

// This process' services, for the plugins it loads.
const HostServices& ThisProcessServices();

// This copy of the engine reads the host's state from now on (`host` is kept: it must outlive
// the plugin, as ThisProcessServices() does); FailedPrecondition (naming both builds) when
// `plugin_build_id` is not the host's. `host` null: back to its own (tests).
Status AdoptHostServices(const HostServices* host, std::string_view plugin_build_id);

// What compile.cc and kernel_cache.cc consult: the adopted services, or null.
const HostServices* AdoptedHostServices();

}  // namespace kiln::compiler
