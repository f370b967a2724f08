// A tiny out-of-tree backend, built as libkiln_backend_toy.so for registry_test: one
// host-memory device that runs f32 `add` with its own kernel and nothing else. It uses only
// the headers (backend.h, kernel_abi.h, plugin_abi.h), as a real plugin would.
#include <cstdlib>
#include <cstring>

#include "engine/backend/backend.h"
#include "engine/backend/plugin_abi.h"

namespace {

using kiln::DType;
using kiln::ExecCtx;
using kiln::LaunchArgs;
using kiln::Status;
using kiln::StatusOr;
using kiln::TensorArg;
using namespace kiln::backend;

class ToyBuffer final : public Buffer {
 public:
  ToyBuffer(Device* d, size_t n)
      : Buffer(d, std::aligned_alloc(kMinAlignment, (n + 63) / 64 * 64 + 64), n) {}
  ~ToyBuffer() override { std::free(data()); }
};

class ToyStream final : public Stream {
 public:
  explicit ToyStream(Device* d) : device_(d) {}
  Device& device() override { return *device_; }
  Status Run(std::span<const kiln::Launch> launches) override {
    for (const kiln::Launch& l : launches) l.fn(*l.args, ExecCtx{});
    return kiln::OkStatus();
  }
  Status CopyToDevice(const Buffer& dst, size_t off, const void* src, size_t n) override {
    std::memcpy(static_cast<char*>(dst.data()) + off, src, n);
    return kiln::OkStatus();
  }
  Status CopyToHost(void* dst, const Buffer& src, size_t off, size_t n) override {
    std::memcpy(dst, static_cast<const char*>(src.data()) + off, n);
    return kiln::OkStatus();
  }
  Status CopyOnDevice(const Buffer& dst, size_t doff, const Buffer& src, size_t soff,
                      size_t n) override {
    std::memmove(static_cast<char*>(dst.data()) + doff, static_cast<const char*>(src.data()) + soff,
                 n);
    return kiln::OkStatus();
  }
  Status Synchronize() override { return kiln::OkStatus(); }

 private:
  Device* device_;
};

float At(const TensorArg& t, const int64_t* idx) {
  int64_t off = 0;
  for (int d = 0; d < t.rank; ++d) off += idx[d] * t.strides[d];
  return static_cast<const float*>(t.data)[off];
}

void ToyAdd(const LaunchArgs& a, const ExecCtx& ctx) {
  if (ctx.thread_index != 0) return;
  const TensorArg& o = a.output;
  int64_t idx[kiln::kMaxRank] = {};
  for (int64_t n = 0; n < o.numel(); ++n) {
    int64_t off = 0;
    for (int d = 0; d < o.rank; ++d) off += idx[d] * o.strides[d];
    static_cast<float*>(o.data)[off] = At(a.inputs[0], idx) + At(a.inputs[1], idx);
    for (int d = o.rank - 1; d >= 0; --d) {
      if (++idx[d] < o.shape[d]) break;
      idx[d] = 0;
    }
  }
}

class ToyDevice final : public Device {
 public:
  std::string_view name() const override { return "toy:0"; }
  bool host_visible() const override { return true; }
  StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override {
    return std::unique_ptr<Buffer>(new ToyBuffer(this, bytes));
  }
  StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new ToyStream(this));
  }
  bool SupportsDType(DType t) const override { return t == DType::kF32; }
  StatusOr<Kernel> GetKernel(const KernelRequest& r) override {
    if (r.op == kiln::OpKind::kAdd && r.output.dtype == DType::kF32)
      return Kernel{ToyAdd, nullptr, "toy.add"};
    return kiln::Unimplemented("the toy backend only adds f32 tensors");
  }
};

class ToyBackend final : public Backend {
 public:
  std::string_view name() const override { return "toy"; }
  int device_count() const override { return 1; }
  Device* device(int index) override { return index == 0 ? &device_ : nullptr; }

 private:
  ToyDevice device_;
};

}  // namespace

extern "C" __attribute__((visibility("default"))) int kiln_backend_register_v1(
    const KilnBackendHostV1* host) {
  if (host == nullptr || host->abi_version != KILN_BACKEND_ABI_VERSION) return 1;
  host->log(host->registry, "toy backend registering");
  return host->register_backend(host->registry, new ToyBackend(), kBackendInterfaceVersion);
}
