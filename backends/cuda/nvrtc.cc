#include "backends/cuda/nvrtc.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "absl/strings/str_join.h"

namespace kiln::cuda {

// The few NVRTC entry points used, with NVRTC's C signatures (nvrtc.h), resolved by name.
struct Nvrtc::Api {
  using Program = void*;
  const char* (*GetErrorString)(int);
  int (*Version)(int*, int*);
  int (*CreateProgram)(Program*, const char*, const char*, int, const char* const*,
                       const char* const*);
  int (*DestroyProgram)(Program*);
  int (*CompileProgram)(Program, int, const char* const*);
  int (*GetProgramLogSize)(Program, size_t*);
  int (*GetProgramLog)(Program, char*);
  int (*GetPTXSize)(Program, size_t*);
  int (*GetPTX)(Program, char*);
  int (*GetCUBINSize)(Program, size_t*);
  int (*GetCUBIN)(Program, char*);
};

StatusOr<const Nvrtc*> Nvrtc::Load() {
  static std::once_flag once;
  static StatusOr<const Nvrtc*>* result = nullptr;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    if (const char* p = std::getenv("KILN_NVRTC")) candidates.push_back(p);
    for (const char* env : {"CUDA_HOME", "CUDA_PATH"}) {
      if (const char* p = std::getenv(env)) candidates.push_back(StrCat(p, "/lib64/libnvrtc.so"));
    }
    candidates.push_back("/usr/local/cuda/lib64/libnvrtc.so");
    for (const char* n : {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11"}) {
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
      sym(api->GetErrorString, "nvrtcGetErrorString");
      sym(api->Version, "nvrtcVersion");
      sym(api->CreateProgram, "nvrtcCreateProgram");
      sym(api->DestroyProgram, "nvrtcDestroyProgram");
      sym(api->CompileProgram, "nvrtcCompileProgram");
      sym(api->GetProgramLogSize, "nvrtcGetProgramLogSize");
      sym(api->GetProgramLog, "nvrtcGetProgramLog");
      sym(api->GetPTXSize, "nvrtcGetPTXSize");
      sym(api->GetPTX, "nvrtcGetPTX");
      sym(api->GetCUBINSize, "nvrtcGetCUBINSize");
      sym(api->GetCUBIN, "nvrtcGetCUBIN");
      if (!ok) {
        delete api;
        dlclose(h);
        continue;
      }
      auto* n = new Nvrtc();
      n->handle_ = h;
      n->api_ = api;
      n->path_ = c;
      int major = 0, minor = 0;
      api->Version(&major, &minor);
      n->version_ = StrCat(major, ".", minor);
      result = new StatusOr<const Nvrtc*>(n);
      return;
    }
    result = new StatusOr<const Nvrtc*>(
        Unavailable("NVRTC not found (tried ", absl::StrJoin(candidates, ", "),
                    "); install the CUDA toolkit or set KILN_NVRTC"));
  });
  return *result;
}

StatusOr<std::string> Nvrtc::CompileToPtx(const std::string& source, const std::string& name,
                                          const std::string& arch,
                                          const std::vector<std::string>& options) const {
  return Compile(source, name, arch, options, /*cubin=*/false);
}

StatusOr<std::string> Nvrtc::CompileToCubin(const std::string& source, const std::string& name,
                                            const std::string& arch,
                                            const std::vector<std::string>& options) const {
  return Compile(source, name, arch, options, /*cubin=*/true);
}

StatusOr<std::string> Nvrtc::Compile(const std::string& source, const std::string& name,
                                     const std::string& arch,
                                     const std::vector<std::string>& options, bool cubin) const {
  Api::Program prog = nullptr;
  int rc = api_->CreateProgram(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr);
  if (rc != 0) return Internal("nvrtcCreateProgram: ", api_->GetErrorString(rc));
  std::vector<std::string> opts = {"--gpu-architecture=" + arch, "-default-device"};
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
    return InvalidArgument("NVRTC (", version_, ", ", arch, ") failed to compile ", name, ": ",
                           api_->GetErrorString(rc), "\n", log);
  }
  size_t size = 0;
  (cubin ? api_->GetCUBINSize : api_->GetPTXSize)(prog, &size);
  std::string out(size, '\0');
  (cubin ? api_->GetCUBIN : api_->GetPTX)(prog, out.data());
  api_->DestroyProgram(&prog);
  return out;
}

}  // namespace kiln::cuda
