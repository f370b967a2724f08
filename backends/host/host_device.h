// Shared plumbing for backends that run kernels on the host CPU (ref, cpu): aligned host
// buffers, a stream that runs launch lists on a persistent thread pool with a barrier
// between launches, and capture as a recorded launch list with pre-bound pointers.
//
// A host stream's Run() finishes the work before returning, so Synchronize is a no-op and
// events complete at once. Thread-safety: HostDevice is thread-safe; a HostStream is used by
// one thread at a time (its pool threads are private to it).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend/backend.h"

namespace kiln::backend {

// A barrier for a fixed number of threads: spins briefly, then sleeps on the futex behind
// std::atomic::wait (so idle pool threads do not burn the shared cores).
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}
  void Wait();

 private:
  const int threads_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
};

class HostDevice : public Device {
 public:
  // `threads`: how many threads each stream of this device runs launches on (>= 1).
  HostDevice(std::string name, int threads)
      : name_(std::move(name)), threads_(threads < 1 ? 1 : threads) {}
  std::string_view name() const override { return name_; }
  bool host_visible() const override { return true; }
  int threads() const { return threads_; }
  StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override;
  StatusOr<std::unique_ptr<Buffer>> WrapHostMemory(void* data, size_t bytes,
                                                   std::shared_ptr<void> keepalive) override;
  StatusOr<std::unique_ptr<Stream>> CreateStream() override;
  bool SupportsDType(DType t) const override { return t != DType::kInvalid; }
  // The machine's memory, bounded by the cgroup's memory.max inside a container.
  StatusOr<DeviceMemoryInfo> MemoryInfo() override;
  // kMatMulMixedRhsExtension: host kernels (the reference's and the cpu backend's) take a
  // quantized or f16 matmul right operand as it is. Subclasses chain to this.
  void* GetExtension(std::string_view name) override {
    static char marker;
    return name == backend::kMatMulMixedRhsExtension ? &marker : nullptr;
  }

 private:
  std::string name_;
  int threads_;
};

// Host memory as DeviceMemoryInfo: MemTotal/MemAvailable from `proc_meminfo`, bounded by
// the cgroup v2 limit in `cgroup_dir` (memory.max, memory.current) when one is set.
StatusOr<DeviceMemoryInfo> HostMemoryInfo(const std::string& proc_meminfo = "/proc/meminfo",
                                          const std::string& cgroup_dir = "/sys/fs/cgroup");

class HostStream : public Stream {
 public:
  HostStream(Device* device, int threads);
  ~HostStream() override;
  Device& device() override { return *device_; }
  Status Run(std::span<const Launch> launches) override;
  Status CopyToDevice(const Buffer& dst, size_t dst_offset, const void* src, size_t bytes) override;
  Status CopyToHost(void* dst, const Buffer& src, size_t src_offset, size_t bytes) override;
  Status CopyOnDevice(const Buffer& dst, size_t dst_offset, const Buffer& src, size_t src_offset,
                      size_t bytes) override;
  Status Synchronize() override { return OkStatus(); }
  bool SupportsCapture() const override { return true; }
  Status BeginCapture() override;
  StatusOr<std::unique_ptr<ExecGraph>> EndCapture() override;

 private:
  class Recording;
  void Execute(std::span<const Launch> launches);
  void Worker(int index);

  Device* device_;
  const int threads_;
  std::unique_ptr<Recording> recording_;  // non-null while capturing
  // Pool state: the main thread publishes a job (launches + a new job number); workers run
  // every launch with their index and meet at the barrier after each one.
  std::vector<std::thread> workers_;
  SpinBarrier barrier_;
  std::atomic<uint64_t> job_{0};
  std::atomic<bool> stop_{false};
  std::span<const Launch> current_;
};

}  // namespace kiln::backend
