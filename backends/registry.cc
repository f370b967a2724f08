#include "backends/registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "backends/builtin.h"
#include "engine/backend/plugin_abi.h"
#include "engine/compiler/host_services.h"
#include "spdlog/spdlog.h"

#ifndef KILN_BACKEND_DEFAULT_DIR
#define KILN_BACKEND_DEFAULT_DIR "/usr/local/lib/kiln/backends"
#endif
#ifndef KILN_BACKEND_BUILD_DIR
#define KILN_BACKEND_BUILD_DIR KILN_BACKEND_DEFAULT_DIR
#endif

namespace kiln::backend {

Registry::~Registry() {
  // The plugins' objects go; their libraries stay loaded (CallPlugin).
  absl::MutexLock lock(&mu_);
  backends_.clear();
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
  return b->Open(index);
}

namespace {

// One call of a plugin's entry point: what it handed over and said.
struct PluginCall {
  std::string path;
  std::vector<std::unique_ptr<Backend>> backends;  // accepted (interface version checked)
  std::string error;                               // why one was refused
  std::string message;                             // the last thing it logged
};

int CollectFromPlugin(void* ctx, void* backend, uint32_t interface_version) {
  auto* c = static_cast<PluginCall*>(ctx);
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
  c->backends.push_back(std::move(b));
  return 0;
}

void LogFromPlugin(void* ctx, const char* message) {
  auto* c = static_cast<PluginCall*>(ctx);
  c->message = message ? message : "";
  spdlog::info("backend plugin {}: {}", c->path, c->message);
}

// The <name> of a file named libkiln_backend_<name>.so; nullopt for any other file.
std::optional<std::string> PluginNameOf(const std::string& file) {
  constexpr std::string_view kPrefix = "libkiln_backend_", kSuffix = ".so";
  if (file.size() <= kPrefix.size() + kSuffix.size() || !file.starts_with(kPrefix) ||
      !file.ends_with(kSuffix)) {
    return std::nullopt;
  }
  return file.substr(kPrefix.size(), file.size() - kPrefix.size() - kSuffix.size());
}

// Where LoadBackendFromPlugin and PluginNames look: PluginDirs(), then the build tree's folder.
std::vector<std::string> SearchDirs() {
  std::vector<std::string> dirs = Registry::PluginDirs();
  dirs.emplace_back(KILN_BACKEND_BUILD_DIR);
  return dirs;
}

// dlopens `path` and calls its entry point once; what it hands over is in call.backends. A
// plugin whose entry point ran stays loaded for the process' lifetime, even when it reports an
// error or registers nothing: its objects need its code, and a GPU runtime it initialised
// (HIP's starts threads) cannot be unloaded safely. Errors: NotFound (no such file),
// FailedPrecondition (cannot be loaded, failed), InvalidArgument (no entry point), Unavailable
// (declined: nothing to offer on this machine, with its reason).
Status CallPlugin(PluginCall& call) {
  const std::string& path = call.path;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return NotFound("no backend plugin ", path);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    return FailedPrecondition("cannot load backend plugin ", path, ": ",
                              err ? err : "unknown dlopen error");
  }
  dlerror();
  auto entry = reinterpret_cast<KilnBackendRegisterV1Fn>(dlsym(handle, KILN_BACKEND_ENTRY_V1));
  if (entry == nullptr) {
    dlclose(handle);
    return InvalidArgument("backend plugin ", path, " does not export ", KILN_BACKEND_ENTRY_V1);
  }
  KilnBackendHostV1 host{};
  host.abi_version = KILN_BACKEND_ABI_VERSION;
  host.struct_size = sizeof(KilnBackendHostV1);
  host.interface_version = kBackendInterfaceVersion;
  host.registry = &call;
  host.register_backend = CollectFromPlugin;
  host.log = LogFromPlugin;
  host.services = &compiler::ThisProcessServices();
  const int rc = entry(&host);
  if (rc == 0 && !call.backends.empty()) return OkStatus();
  call.backends.clear();
  if (rc == KILN_BACKEND_DECLINED) {
    return Unavailable("backend plugin ", path, " has nothing to offer here: ",
                       call.message.empty() ? "(it gave no reason)" : call.message);
  }
  // Why: a backend it handed over was refused, or else what it said last.
  const std::string& why = call.error.empty() ? call.message : call.error;
  return FailedPrecondition("backend plugin ", path, " failed to register (code ", rc, ")",
                            why.empty() ? "" : ": ", why);
}

}  // namespace

Status Registry::LoadPlugin(const std::string& path) {
  PluginCall call;
  call.path = path;
  KILN_RETURN_IF_ERROR(CallPlugin(call));
  int registered = 0;
  std::string refused;
  for (std::unique_ptr<Backend>& b : call.backends) {
    if (const Status s = Register(std::move(b)); s.ok()) {
      ++registered;
    } else {
      refused = std::string(StatusMessage(s));
    }
  }
  if (registered == 0) {
    return FailedPrecondition("backend plugin ", path, " failed to register: ", refused);
  }
  return OkStatus();
}

StatusOr<std::unique_ptr<Backend>> Registry::LoadBackendFromPlugin(std::string_view name) {
  const std::string file = absl::StrCat("libkiln_backend_", ToAbsl(name), ".so");
  std::string searched;
  for (const std::string& dir : SearchDirs()) {
    PluginCall call;
    call.path = absl::StrCat(dir, "/", file);
    const Status s = CallPlugin(call);
    if (s.code() == StatusCode::kNotFound) {
      absl::StrAppend(&searched, searched.empty() ? "" : ", ", dir);
      continue;
    }
    KILN_RETURN_IF_ERROR(s);
    for (std::unique_ptr<Backend>& b : call.backends) {
      if (b->name() == name) return std::move(b);
    }
    return FailedPrecondition(call.path, " registered no backend named '", ToAbsl(name), "'");
  }
  return NotFound("no ", file, " in ", searched);
}

std::vector<std::string> Registry::PluginNames() {
  std::vector<std::string> names;
  for (const std::string& dir : SearchDirs()) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      if (std::optional<std::string> n = PluginNameOf(entry.path().filename().string())) {
        names.push_back(*std::move(n));
      }
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

int Registry::LoadPluginsFrom(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (PluginNameOf(entry.path().filename().string())) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  int loaded = 0;
  for (const std::string& f : files) {
    const std::string file = std::filesystem::path(f).filename().string();
    {
      absl::MutexLock lock(&mu_);
      if (std::find(loaded_files_.begin(), loaded_files_.end(), file) != loaded_files_.end()) {
        spdlog::debug("skipping backend plugin {}: {} is already loaded", f, file);
        continue;
      }
    }
    const Status s = LoadPlugin(f);
    if (s.ok()) {
      ++loaded;
      spdlog::info("loaded backend plugin {}", f);
      absl::MutexLock lock(&mu_);
      loaded_files_.push_back(file);
    } else if (s.code() == StatusCode::kUnavailable) {
      // Declined (no driver, no device): not an error; the plugin has said why (LogFromPlugin).
      spdlog::debug("{}", StatusMessage(s));
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
  // Beside the binary: <prefix>/bin/kilnd finds <prefix>/lib/kiln/backends, and so do the
  // build tree's server/kilnd and bin/kiln.
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path beside = exe.parent_path().parent_path() / "lib/kiln/backends";
    if (std::filesystem::is_directory(beside, ec)) dirs.push_back(beside.lexically_normal());
  }
  if (std::find(dirs.begin(), dirs.end(), KILN_BACKEND_DEFAULT_DIR) == dirs.end()) {
    dirs.emplace_back(KILN_BACKEND_DEFAULT_DIR);
  }
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

std::unique_ptr<Backend> MakeCudaBackend() {
  StatusOr<std::unique_ptr<Backend>> b = Registry::LoadBackendFromPlugin("cuda");
  if (!b.ok()) {
    spdlog::info("cuda: backend not available: {}", StatusMessage(b.status()));
    return nullptr;
  }
  return *std::move(b);
}

}  // namespace kiln::backend
