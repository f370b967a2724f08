#include "backends/rocm/hiprtc.h"

#include <cstdlib>
#include <mutex>
#include <string_view>

#include "absl/strings/str_join.h"

namespace kiln::rocm {

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
    static constexpr const char* kOutputs[] = {"Code"};
    StatusOr<std::unique_ptr<host::RuntimeCompiler>> rtc =
        host::RuntimeCompiler::Open("hiprtc", candidates, kOutputs);
    if (rtc.ok()) {
      auto* r = new Hiprtc();
      r->rtc_ = std::move(*rtc);
      r->version_ = r->rtc_->version();
      r->path_ = r->rtc_->path();
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
  std::vector<std::string> opts = {"--offload-arch=" + arch};
  opts.insert(opts.end(), options.begin(), options.end());
  return rtc_->Compile(source, name, opts, 0, StrCat("hiprtc (", version_, ", ", arch, ")"));
}

}  // namespace kiln::rocm
