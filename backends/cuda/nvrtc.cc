#include "backends/cuda/nvrtc.h"

#include <cstdlib>
#include <mutex>

#include "absl/strings/str_join.h"

namespace kiln::cuda {

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
    static constexpr const char* kOutputs[] = {"PTX", "CUBIN"};
    StatusOr<std::unique_ptr<host::RuntimeCompiler>> rtc =
        host::RuntimeCompiler::Open("nvrtc", candidates, kOutputs);
    if (!rtc.ok()) {
      result = new StatusOr<const Nvrtc*>(
          Unavailable("NVRTC not found (tried ", absl::StrJoin(candidates, ", "),
                      "); install the CUDA toolkit or set KILN_NVRTC"));
      return;
    }
    auto* n = new Nvrtc();
    n->rtc_ = std::move(*rtc);
    n->version_ = n->rtc_->version();
    n->path_ = n->rtc_->path();
    result = new StatusOr<const Nvrtc*>(n);
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
  std::vector<std::string> opts = {"--gpu-architecture=" + arch, "-default-device"};
  opts.insert(opts.end(), options.begin(), options.end());
  return rtc_->Compile(source, name, opts, cubin ? 1 : 0,
                       StrCat("NVRTC (", version_, ", ", arch, ")"));
}

}  // namespace kiln::cuda
