#include "backends/rocm/hiprtc.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string_view>

#include "absl/strings/str_join.h"

namespace kiln::rocm {

// The few hiprtc entry points used, with hiprtc's C signatures (hip/hiprtc.h), by name.
struct Hiprtc::Api {
  using Program = void*;
  const char* (*GetErrorString)(int);
  int (*Version)(int*, int*);
  int (*CreateProgram)(Program*, const char*, const char*, int, const char* const*,
                       const char* const*);
  int (*DestroyProgram)(Program*);
  int (*CompileProgram)(Program, int, const char* const*);
  int (*GetProgramLogSize)(Program, size_t*);
  int (*GetProgramLog)(Program, char*);
  int (*GetCodeSize)(Program, size_t*);
  int (*GetCode)(Program, char*);
};

StatusOr<const Hiprtc*> Hiprtc::Load() {
  static std::once_flag once;
  static StatusOr<const Hiprtc*>* result = nullptr;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    const char* env = std::getenv("KILN_HIPRTC");
    if (env != nullptr && std::string_view(env) == "none") {
      result = new StatusOr<const Hiprtc*>(Unavailable("hiprtc disabled (KILN_HIPRTC=none)"));
      return;
    }
    if (env != nullptr && *env != '\0') candidates.push_back(env);
    for (const char* n : {"libhiprtc.so", "libhiprtc.so.6", "libamdhip64.so", "libamdhip64.so.5"}) {
      candidates.push_back(n);
    }
    for (const std::string& c : candidates) {
      void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h == nullptr) continue;
      auto* api = new Api();
      bool ok = true;
      auto sym = [&](auto& fn, const char* name) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
        ok &= fn != nullptr;
      };
      sym(api->GetErrorString, "hiprtcGetErrorString");
      sym(api->Version, "hiprtcVersion");
      sym(api->CreateProgram, "hiprtcCreateProgram");
      sym(api->DestroyProgram, "hiprtcDestroyProgram");
      sym(api->CompileProgram, "hiprtcCompileProgram");
      sym(api->GetProgramLogSize, "hiprtcGetProgramLogSize");
      sym(api->GetProgramLog, "hiprtcGetProgramLog");
      sym(api->GetCodeSize, "hiprtcGetCodeSize");
      sym(api->GetCode, "hiprtcGetCode");
      if (!ok) {  // a HIP runtime without hiprtc
        delete api;
        dlclose(h);
        continue;
      }
      auto* r = new Hiprtc();
      r->api_ = api;
      r->path_ = c;
      int major = 0, minor = 0;
      api->Version(&major, &minor);
      r->version_ = StrCat(major, ".", minor);
      result = new StatusOr<const Hiprtc*>(r);
      return;
    }
    result = new StatusOr<const Hiprtc*>(
        Unavailable("hiprtc not found (tried ", absl::StrJoin(candidates, ", "),
                    "); install ROCm's HIP runtime (libamdhip64) or set KILN_HIPRTC"));
  });
  return *result;
}

StatusOr<std::string> Hiprtc::Compile(const std::string& source, const std::string& name,
                                      const std::string& arch,
                                      const std::vector<std::string>& options) const {
  Api::Program prog = nullptr;
  int rc = api_->CreateProgram(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr);
  if (rc != 0) return Internal("hiprtcCreateProgram: ", api_->GetErrorString(rc));
  std::vector<std::string> opts = {"--offload-arch=" + arch};
  opts.insert(opts.end(), options.begin(), options.end());
  std::vector<const char*> argv;
  for (const std::string& o : opts) argv.push_back(o.c_str());
  rc = api_->CompileProgram(prog, static_cast<int>(argv.size()), argv.data());
  size_t log_size = 0;
  api_->GetProgramLogSize(prog, &log_size);
  std::string log(log_size, '\0');
  if (log_size > 0) api_->GetProgramLog(prog, log.data());
  if (rc != 0) {
    api_->DestroyProgram(&prog);
    if (log.size() > 20000) log = log.substr(0, 20000) + "\n...";
    return InvalidArgument("hiprtc (", version_, ", ", arch, ") failed to compile ", name, ": ",
                           api_->GetErrorString(rc), "\n", log);
  }
  size_t size = 0;
  api_->GetCodeSize(prog, &size);
  std::string out(size, '\0');
  api_->GetCode(prog, out.data());
  api_->DestroyProgram(&prog);
  return out;
}

}  // namespace kiln::rocm
