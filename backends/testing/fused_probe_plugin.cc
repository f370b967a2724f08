// A plugin whose device is a compiler target that only reports what the compiler tells it:
// how many kernel requests it saw as fused groups (compiler::FusedGroupOf) while the host's
// compiler prepared and assigned a program. It links the engine's compiler as the gpu plugins
// do; without adopting the host's services its copy of FusedGroupOf would see no group at all
// (the compile context is the host's). registry_test compiles a fusible chain on it, and asks
// which kernel cache directory it would use (the host's, which kilnd configures).
#include <atomic>
#include <memory>
#include <span>
#include <string>

#include "engine/backend/backend.h"
#include "engine/backend/plugin_abi.h"
#include "engine/compiler/host_services.h"
#include "engine/compiler/kernel_cache.h"
#include "engine/compiler/target.h"

namespace {

using namespace kiln;

class ProbeDevice final : public backend::Device, public compiler::Target {
 public:
  std::string_view name() const override { return "fusedprobe:0"; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t) override {
    return Unimplemented("fusedprobe has no memory");
  }
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
    return Unimplemented("fusedprobe has no streams");
  }
  bool SupportsDType(DType) const override { return true; }
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& request) override {
    if (compiler::FusedGroupOf(request) != nullptr) fused_seen_.fetch_add(1);
    return Unimplemented("fusedprobe runs nothing");
  }
  void* GetExtension(std::string_view name) override {
    if (name == compiler::kTargetExtension) return static_cast<compiler::Target*>(this);
    if (name == "fusedprobe.fused_seen") return &fused_seen_;
    if (name == "fusedprobe.cache_dir") {  // the kernel cache directory this copy resolves
      cache_dir_ = compiler::CacheDir();
      return &cache_dir_;
    }
    return nullptr;
  }
  compiler::FusionCaps caps() const override { return {.pointwise = true, .reductions = true}; }
  Status Prepare(std::span<const backend::KernelRequest> requests) override {
    for (const backend::KernelRequest& r : requests) {
      if (compiler::FusedGroupOf(r) != nullptr) fused_seen_.fetch_add(1);
    }
    return OkStatus();
  }
  compiler::CompileCounters counters() const override { return {}; }

 private:
  std::atomic<int> fused_seen_{0};
  std::string cache_dir_;
};

class ProbeBackend final : public backend::Backend {
 public:
  std::string_view name() const override { return "fusedprobe"; }
  int device_count() const override { return 1; }
  backend::Device* device(int) override { return &device_; }

 private:
  ProbeDevice device_;
};

}  // namespace

extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v1(
    const KilnBackendHostV1* host) {
  const Status s = compiler::AdoptHostServices(
      static_cast<const compiler::HostServices*>(host->services), compiler::BuildId());
  if (!s.ok()) {
    host->log(host->registry, std::string(StatusMessage(s)).c_str());
    return 1;
  }
  return host->register_backend(host->registry, new ProbeBackend(),
                                backend::kBackendInterfaceVersion);
}
