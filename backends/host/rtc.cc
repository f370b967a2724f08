#include "backends/host/rtc.h"

#include <dlfcn.h>

#include "absl/strings/str_join.h"

namespace kiln::host {

// The entry points used, with the C signatures nvrtc.h and hiprtc.h share, resolved by name.
struct RuntimeCompiler::Api {
  using Program = void*;
  const char* (*GetErrorString)(int);
  int (*Version)(int*, int*);
  int (*CreateProgram)(Program*, const char*, const char*, int, const char* const*,
                       const char* const*);
  int (*DestroyProgram)(Program*);
  int (*CompileProgram)(Program, int, const char* const*);
  int (*GetProgramLogSize)(Program, size_t*);
  int (*GetProgramLog)(Program, char*);
  struct Output {
    int (*Size)(Program, size_t*);
    int (*Get)(Program, char*);
  };
  std::vector<Output> outputs;
};

RuntimeCompiler::~RuntimeCompiler() = default;

StatusOr<std::unique_ptr<RuntimeCompiler>> RuntimeCompiler::Open(
    std::string_view prefix, std::span<const std::string> libraries,
    std::span<const char* const> outputs) {
  for (const std::string& lib : libraries) {
    void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) continue;
    auto api = std::make_unique<Api>();
    bool ok = true;
    auto sym = [&](auto& fn, std::string_view name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(
          dlsym(h, StrCat(prefix, name).c_str()));
      ok &= fn != nullptr;
    };
    sym(api->GetErrorString, "GetErrorString");
    sym(api->Version, "Version");
    sym(api->CreateProgram, "CreateProgram");
    sym(api->DestroyProgram, "DestroyProgram");
    sym(api->CompileProgram, "CompileProgram");
    sym(api->GetProgramLogSize, "GetProgramLogSize");
    sym(api->GetProgramLog, "GetProgramLog");
    for (const char* o : outputs) {
      Api::Output& out = api->outputs.emplace_back();
      sym(out.Size, StrCat("Get", o, "Size"));
      sym(out.Get, StrCat("Get", o));
    }
    if (!ok) {  // another library of that name, or a runtime without the compiler
      dlclose(h);
      continue;
    }
    std::unique_ptr<RuntimeCompiler> rc(new RuntimeCompiler());
    int major = 0, minor = 0;
    api->Version(&major, &minor);
    rc->version_ = StrCat(major, ".", minor);
    rc->path_ = lib;
    rc->api_ = std::move(api);
    return rc;
  }
  return NotFound("no ", prefix, " library (tried ", absl::StrJoin(libraries, ", "), ")");
}

StatusOr<std::string> RuntimeCompiler::Compile(const std::string& source, const std::string& name,
                                               const std::vector<std::string>& options,
                                               size_t output, std::string_view what) const {
  Api::Program prog = nullptr;
  int rc = api_->CreateProgram(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr);
  if (rc != 0) return Internal(what, ": CreateProgram: ", api_->GetErrorString(rc));
  std::vector<const char*> argv;
  for (const std::string& o : options) argv.push_back(o.c_str());
  rc = api_->CompileProgram(prog, static_cast<int>(argv.size()), argv.data());
  size_t log_size = 0;
  api_->GetProgramLogSize(prog, &log_size);
  std::string log(log_size, '\0');
  if (log_size > 0) api_->GetProgramLog(prog, log.data());
  if (rc != 0) {
    api_->DestroyProgram(&prog);
    if (log.size() > 20000) log = log.substr(0, 20000) + "\n...";
    return InvalidArgument(what, " failed to compile ", name, ": ", api_->GetErrorString(rc), "\n",
                           log);
  }
  size_t size = 0;
  api_->outputs.at(output).Size(prog, &size);
  std::string out(size, '\0');
  api_->outputs.at(output).Get(prog, out.data());
  api_->DestroyProgram(&prog);
  return out;
}

}  // namespace kiln::host
