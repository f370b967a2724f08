// The backend registry: which device families this process can use, including plugins.
//
//   backend::Registry& r = backend::Registry::Global();   // ref + cpu + autoloaded plugins
//   KILN_ASSIGN_OR_RETURN(backend::Device* dev, r.GetDevice("cpu"));
//
// Plugin autoload (plugin_abi.h): every libkiln_backend_*.so in the directories of
// KILN_BACKEND_PATH (colon-separated), then in lib/kiln/backends beside the binary's folder
// (<prefix>/bin/kilnd -> <prefix>/lib/kiln/backends), then in the default directory
// (<install prefix>/lib/kiln/backends), is dlopened in name order and its versioned entry
// point called; a file name already loaded from an earlier directory is skipped. A plugin
// that fails to load, lacks the entry point, has another ABI or interface version, or reports
// an error is logged and skipped — it never takes the daemon down. One that declines (the
// cuda plugin without a driver or a device) is logged at info. KILN_BACKEND_AUTOLOAD=0 turns
// autoload off.
//
// `Global()` is a convenience for binaries; tests and embedders can build their own
// Registry (nothing here assumes one per process). A plugin library whose entry point ran
// stays loaded for the process' lifetime, whatever it returned: the GPU runtimes inside the
// gpu plugins cannot be unloaded safely once initialised.
//
// Thread-safety: all methods are thread-safe; Backend/Device pointers stay valid for the
// registry's lifetime.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "engine/backend/backend.h"

namespace kiln::backend {

class Registry {
 public:
  Registry() = default;
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // AlreadyExists if a backend of that name is registered.
  Status Register(std::unique_ptr<Backend> backend);
  // Registers ref and cpu (idempotent).
  void RegisterBuiltins();
  Backend* Find(std::string_view name) const;
  std::vector<Backend*> backends() const;
  // "cpu", "cpu:0", "ref". NotFound names the backends that exist.
  StatusOr<Device*> GetDevice(std::string_view spec) const;

  // Loads one plugin file and registers its backends. Errors say why: NotFound (no file),
  // FailedPrecondition (dlopen message, a refused version or duplicate name, the plugin
  // failed), InvalidArgument (no entry point), Unavailable (the plugin declined, with its
  // reason).
  Status LoadPlugin(const std::string& path);
  // A new backend from libkiln_backend_<name>.so, searched in PluginDirs() and then in the
  // build tree's plugin folder (for test and bench binaries), outside any registry: what
  // MakeCudaBackend returns. The library stays loaded for the process' lifetime. NotFound
  // names the folders searched; the other errors are LoadPlugin's.
  static StatusOr<std::unique_ptr<Backend>> LoadBackendFromPlugin(std::string_view name);
  // Loads every libkiln_backend_*.so in `dir`; returns how many registered. Failures are
  // logged and recorded in plugin_errors().
  int LoadPluginsFrom(const std::string& dir);
  // The directories autoload searches (KILN_BACKEND_PATH entries, then the default).
  static std::vector<std::string> PluginDirs();
  // The <name>s of the libkiln_backend_<name>.so files LoadBackendFromPlugin would find, in
  // name order (what `kiln backends` reports on).
  static std::vector<std::string> PluginNames();
  // Loads plugins from PluginDirs() unless KILN_BACKEND_AUTOLOAD=0; returns the count.
  int Autoload();
  std::vector<std::string> plugin_errors() const;

  // The process-wide registry: builtins plus Autoload(), on first use.
  static Registry& Global();

 private:
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Backend>> backends_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> loaded_files_ ABSL_GUARDED_BY(mu_);  // plugin file names
  std::vector<std::string> errors_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln::backend
