// Shared plumbing for backends that run kernels on the host CPU (ref, cpu): aligned host
// buffers, a stream that runs launch lists on a persistent thread pool with a barrier
// between launches, and capture as a recorded launch list with pre-bound pointers.
//
// A host stream's Run() finishes the work before returning, so Synchronize is a no-op and
// events complete at once. Thread-safety: HostDevice is thread-safe; a HostStream is used by
// one thread at a time (its pool threads are private to it).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
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

// How a multi-threaded HostStream reacts to a descheduled thread. Every launch is split
// statically over the pool and ends in a barrier, so a thread that the OS takes off its core
// (a busy neighbour process, a container CPU quota below the visible cores) stalls every
// launch: 2 threads beside one busy process decoded 5x slower than 1 thread. The stream
// measures the share of its threads' time spent waiting at barriers. When that share (an
// EWMA over runs of at least `min_run_seconds`, each run weighing half) exceeds
// `max_wait_share`, or one run alone waits `immediate_wait_share`, the calling thread runs
// every share of each launch itself, one after another (ExecCtx::shares_in_sequence), for
// `backoff_seconds`; then the stream tries all threads again, and while the first run back
// still waits that much the backoff grows `backoff_growth`-fold (up to `max_backoff_seconds`).
// Each such probe is a slow run (a SmolLM2 decode step took 40-70 ms instead of ~15 beside a
// busy process), so few of them: beside the neighbour, 256 tokens at 4x growth take 3 probes
// where doubling took 5. The shares are the pool's, so the results are bit-identical to
// the pool's (a training run resumed from a checkpoint still repeats its losses). On a quiet
// machine the waits are ~16% and nothing changes.
//
// A CPU quota that allows at most one CPU is the same problem known in advance: the pool's
// threads only take turns being throttled (2 threads under a 1-CPU quota decoded at 0.77-0.92x
// of one thread). Where `quota_cpus` is set (the cpu backend reads the cgroup's, cpu_budget.h),
// it is read again at most every `quota_recheck_seconds`, and while it allows at most one CPU
// the calling thread runs every launch's shares, as in a fallback.
struct StragglerPolicy {
  bool enabled = true;
  // Quiet SmolLM2 decode waits 0.16 of the time (p90 0.17); beside a busy process 0.3-0.8.
  double max_wait_share = 0.4;
  double immediate_wait_share = 0.6;
  double min_run_seconds = 200e-6;
  double backoff_seconds = 0.2;
  double backoff_growth = 4;
  double max_backoff_seconds = 6.4;
  // The CPUs the process's quota allows; nullopt: no quota. Unset: not checked.
  std::function<std::optional<double>()> quota_cpus = nullptr;
  double quota_recheck_seconds = 1.0;
};
// KILN_CPU_STRAGGLER_FALLBACK=0 disables it (the policy's other fields keep their defaults).
StragglerPolicy StragglerPolicyFromEnv();

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
  HostStream(Device* device, int threads, StragglerPolicy policy = StragglerPolicyFromEnv());
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

  // Runs so far on the calling thread alone because of stragglers or a quota (tests, logs).
  int64_t single_thread_runs() const { return single_runs_; }
  // Times the stream switched to the calling thread alone.
  int64_t straggler_fallbacks() const { return fallbacks_; }

 private:
  class Recording;
  void Execute(std::span<const Launch> launches);
  void Worker(int index);
  // barrier_.Wait(), adding the time waited to *waited while the straggler policy is on.
  void BarrierWait(int64_t* waited);
  // Whether the quota (StragglerPolicy::quota_cpus, re-read when due at `now`) allows at most
  // one CPU.
  bool QuotaAllowsOneCpu(int64_t now);

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
  // Straggler fallback (StragglerPolicy), touched by the calling thread only except wait_ns_.
  const StragglerPolicy policy_;
  std::atomic<int64_t> wait_ns_{0};  // the workers' barrier waits in the current run
  double wait_share_ = 0;            // EWMA of the waiting share of runs
  int64_t single_until_ns_ = 0;      // run on the calling thread alone until then (steady clock)
  double backoff_s_ = 0;
  bool probing_ = false;  // the first multi-threaded run after a fallback decides alone
  int64_t single_runs_ = 0, fallbacks_ = 0;
  int64_t quota_due_ns_ = 0;  // when to read the quota again (steady clock)
  bool quota_one_cpu_ = false;
};

}  // namespace kiln::backend
