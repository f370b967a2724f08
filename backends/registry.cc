#include "backends/registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "backends/builtin.h"
#include "engine/backend/plugin_abi.h"
#include "spdlog/spdlog.h"

#ifndef KILN_BACKEND_DEFAULT_DIR
#define KILN_BACKEND_DEFAULT_DIR "/usr/local/lib/kiln/backends"
#endif

namespace kiln::backend {

Registry::~Registry() {
  std::vector<void*> handles;
  {
    absl::MutexLock lock(&mu_);
    backends_.clear();  // plugin objects die while their code is still loaded
    handles.swap(handles_);
  }
  for (void* h : handles) dlclose(h);
}

Status Registry::Register(std::unique_ptr<Backend> backend) {
  if (backend == nullptr) return InvalidArgument("Register: null backend");
  absl::MutexLock lock(&mu_);
  for (const auto& b : backends_) {
    if (b->name() == backend->name()) {
      return AlreadyExists("a backend named '", ToAbsl(backend->name()), "' is already registered");
    }
  }
  backends_.push_back(std::move(backend));
  return OkStatus();
}

void Registry::RegisterBuiltins() {
  // Register fails only for a duplicate name, which the Find checks rule out (a concurrent
  // registration of the same builtin is equally fine).
  if (Find("ref") == nullptr) (void)Register(MakeRefBackend());
  if (Find("cpu") == nullptr) (void)Register(MakeCpuBackend());
}

Backend* Registry::Find(std::string_view name) const {
  absl::MutexLock lock(&mu_);
  for (const auto& b : backends_) {
    if (b->name() == name) return b.get();
  }
  return nullptr;
}

std::vector<Backend*> Registry::backends() const {
  absl::MutexLock lock(&mu_);
  std::vector<Backend*> out;
  for (const auto& b : backends_) out.push_back(b.get());
  return out;
}

StatusOr<Device*> Registry::GetDevice(std::string_view spec) const {
  std::string_view name = spec;
  int index = 0;
  if (const size_t colon = spec.find(':'); colon != std::string_view::npos) {
    name = spec.substr(0, colon);
    const std::string num(spec.substr(colon + 1));
    char* end = nullptr;
    const long v = std::strtol(num.c_str(), &end, 10);
    if (num.empty() || *end != '\0' || v < 0) {
      return InvalidArgument("device '", ToAbsl(spec), "': expected <backend>[:<index>]");
    }
    index = static_cast<int>(v);
  }
  Backend* b = Find(name);
  if (b == nullptr) {
    std::string known;
    for (Backend* x : backends())
      absl::StrAppend(&known, known.empty() ? "" : ", ", ToAbsl(x->name()));
    return NotFound("no backend '", ToAbsl(name), "'; registered: ", known);
  }
  if (index >= b->device_count()) {
    return NotFound("backend '", ToAbsl(name), "' has ", b->device_count(), " device(s); no index ",
                    index);
  }
  return b->device(index);
}

namespace {

struct LoadCtx {
  Registry* registry;
  std::string path;
  int registered = 0;
  std::string error;
};

int RegisterFromPlugin(void* ctx, void* backend, uint32_t interface_version) {
  auto* c = static_cast<LoadCtx*>(ctx);
  std::unique_ptr<Backend> b(static_cast<Backend*>(backend));
  if (b == nullptr) {
    c->error = "registered a null backend";
    return 1;
  }
  if (interface_version != kBackendInterfaceVersion) {
    c->error = absl::StrCat("built against backend interface v", interface_version, ", host has v",
                            kBackendInterfaceVersion);
    return 1;
  }
  const Status s = c->registry->Register(std::move(b));
  if (!s.ok()) {
    c->error = std::string(StatusMessage(s));
    return 1;
  }
  ++c->registered;
  return 0;
}

void LogFromPlugin(void* ctx, const char* message) {
  spdlog::info("backend plugin {}: {}", static_cast<LoadCtx*>(ctx)->path, message ? message : "");
}

}  // namespace

Status Registry::LoadPlugin(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return Unavailable("cannot load backend plugin ", path, ": ",
                       err ? err : "unknown dlopen error");
  }
  dlerror();
  auto entry = reinterpret_cast<KilnBackendRegisterV1Fn>(dlsym(handle, KILN_BACKEND_ENTRY_V1));
  if (entry == nullptr) {
    dlclose(handle);
    return InvalidArgument("backend plugin ", path, " does not export ", KILN_BACKEND_ENTRY_V1);
  }
  LoadCtx ctx{this, path, 0, {}};
  KilnBackendHostV1 host{};
  host.abi_version = KILN_BACKEND_ABI_VERSION;
  host.struct_size = sizeof(KilnBackendHostV1);
  host.interface_version = kBackendInterfaceVersion;
  host.registry = &ctx;
  host.register_backend = RegisterFromPlugin;
  host.log = LogFromPlugin;
  const int rc = entry(&host);
  if (rc != 0 || ctx.registered == 0) {
    // Backends it did register stay (their code must stay loaded too).
    absl::MutexLock lock(&mu_);
    if (ctx.registered > 0) {
      handles_.push_back(handle);
    } else {
      dlclose(handle);
    }
    return FailedPrecondition("backend plugin ", path, " failed to register (code ", rc, ")",
                              ctx.error.empty() ? "" : ": ", ctx.error);
  }
  absl::MutexLock lock(&mu_);
  handles_.push_back(handle);
  return OkStatus();
}

int Registry::LoadPluginsFrom(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("libkiln_backend_", 0) == 0 && name.size() > 3 &&
        name.substr(name.size() - 3) == ".so") {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  int loaded = 0;
  for (const std::string& f : files) {
    const Status s = LoadPlugin(f);
    if (s.ok()) {
      ++loaded;
      spdlog::info("loaded backend plugin {}", f);
    } else {
      spdlog::warn("skipping backend plugin: {}", std::string(StatusMessage(s)));
      absl::MutexLock lock(&mu_);
      errors_.push_back(std::string(StatusMessage(s)));
    }
  }
  return loaded;
}

std::vector<std::string> Registry::PluginDirs() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("KILN_BACKEND_PATH")) {
    for (absl::string_view d : absl::StrSplit(env, ':', absl::SkipEmpty())) dirs.emplace_back(d);
  }
  dirs.emplace_back(KILN_BACKEND_DEFAULT_DIR);
  return dirs;
}

int Registry::Autoload() {
  const char* flag = std::getenv("KILN_BACKEND_AUTOLOAD");
  if (flag != nullptr && std::string_view(flag) == "0") return 0;
  int n = 0;
  for (const std::string& d : PluginDirs()) n += LoadPluginsFrom(d);
  return n;
}

std::vector<std::string> Registry::plugin_errors() const {
  absl::MutexLock lock(&mu_);
  return errors_;
}

Registry& Registry::Global() {
  static Registry* r = [] {
    auto* reg = new Registry();
    reg->RegisterBuiltins();
    reg->Autoload();
    return reg;
  }();
  return *r;
}

}  // namespace kiln::backend
