// The reference backend: one host device running the reference kernels on one thread.
#include "backends/builtin.h"
#include "backends/host/host_device.h"
#include "backends/ref/ref_kernels.h"

namespace kiln::backend {
namespace {

class RefDevice final : public HostDevice {
 public:
  RefDevice() : HostDevice("ref:0", 1) {}
  StatusOr<Kernel> GetKernel(const KernelRequest& request) override {
    return ref::KernelFor(request);
  }
};

class RefBackend final : public Backend {
 public:
  std::string_view name() const override { return "ref"; }
  int device_count() const override { return 1; }
  Device* device(int index) override { return index == 0 ? &device_ : nullptr; }

 private:
  RefDevice device_;
};

}  // namespace

std::unique_ptr<Backend> MakeRefBackend() { return std::make_unique<RefBackend>(); }

}  // namespace kiln::backend
