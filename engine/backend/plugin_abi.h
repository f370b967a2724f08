/* The C entry point of out-of-tree backend plugins.
 *
 * A plugin is a shared library named libkiln_backend_<name>.so that exports
 *
 *   int kiln_backend_register_v1(const KilnBackendHostV1* host);
 *
 * The host (backends/registry.cc) dlopens every such file in its plugin directories, checks
 * the ABI version, and calls the entry point once. The plugin creates its backend(s) — C++
 * objects implementing kiln::backend::Backend from engine/backend/backend.h, allocated with `new`
 * — and hands each to host->register_backend, passing the kBackendInterfaceVersion it was
 * compiled against. The host takes ownership (and deletes the object itself if it refuses
 * it, e.g. for a version mismatch or a duplicate name). The entry point returns 0 on success;
 * KILN_BACKEND_DECLINED when it has nothing to offer on this machine (no driver, no device:
 * it says why through host->log first; the host logs that at info level, not as an error);
 * any other value makes the host log an error and skip the plugin, deleting the backends it
 * handed over. The host never unloads a library whose entry point ran (a GPU runtime inside
 * one cannot be unloaded safely once initialised). A plugin must be
 * built with the same C++ toolchain and standard library as the host. The host may call the
 * entry point again for another, independent set of backends (backend::MakeCudaBackend).
 *
 * Plain C so the versioned symbol and struct stay stable. Bump the _v1 suffix (and add
 * KilnBackendHostV2) for incompatible changes; extend V1 only by appending fields, which
 * plugins detect with struct_size.
 */
#ifndef KILN_BACKENDS_PLUGIN_ABI_H_
#define KILN_BACKENDS_PLUGIN_ABI_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_BACKEND_ABI_VERSION 1
#define KILN_BACKEND_ENTRY_V1 "kiln_backend_register_v1"
#define KILN_BACKEND_DECLINED 2

typedef struct KilnBackendHostV1 {
  uint32_t abi_version;       /* KILN_BACKEND_ABI_VERSION */
  uint32_t struct_size;       /* sizeof(KilnBackendHostV1) as the host built it */
  uint32_t interface_version; /* kiln::backend::kBackendInterfaceVersion of the host */
  void* registry;             /* opaque; pass back to the callbacks */
  /* Takes ownership of `backend` (a kiln::backend::Backend*). 0 on success. */
  int (*register_backend)(void* registry, void* backend, uint32_t interface_version);
  /* Logs a message from the plugin under the host's logger. */
  void (*log)(void* registry, const char* message);
  /* Appended: the host's process-wide engine state (a const kiln::compiler::HostServices*,
   * engine/compiler/host_services.h), for plugins that link the engine's code themselves, as
   * the gpu plugins do; they adopt it, which refuses a plugin from another build. Present when
   * struct_size covers it. */
  const void* services;
} KilnBackendHostV1;

typedef int (*KilnBackendRegisterV1Fn)(const KilnBackendHostV1* host);

#ifdef __cplusplus
}
#endif

#endif /* KILN_BACKENDS_PLUGIN_ABI_H_ */
