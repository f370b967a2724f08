#include "backends/host/host_device.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kiln::backend {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

class HostBuffer final : public Buffer {
 public:
  HostBuffer(Device* d, void* p, size_t n, bool owned, std::shared_ptr<void> keepalive)
      : Buffer(d, p, n), owned_(owned), keepalive_(std::move(keepalive)) {}
  ~HostBuffer() override {
    if (owned_) std::free(data());
  }

 private:
  bool owned_;
  std::shared_ptr<void> keepalive_;
};

Status CheckRange(const Buffer& b, size_t offset, size_t bytes, const char* what) {
  if (offset > b.size() || bytes > b.size() - offset) {
    return OutOfRange(what, ": ", bytes, " bytes at offset ", offset, " exceed a buffer of ",
                      b.size());
  }
  return OkStatus();
}

}  // namespace

void SpinBarrier::Wait() {
  const uint32_t gen = generation_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
    arrived_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    return;
  }
  for (int spin = 0; spin < 4000; ++spin) {
    if (generation_.load(std::memory_order_acquire) != gen) return;
    CpuRelax();
  }
  while (generation_.load(std::memory_order_acquire) == gen)
    generation_.wait(gen, std::memory_order_acquire);
}

StatusOr<std::unique_ptr<Buffer>> HostDevice::Allocate(size_t bytes) {
  const size_t n = (std::max<size_t>(bytes, 1) + kMinAlignment - 1) / kMinAlignment * kMinAlignment;
  void* p = std::aligned_alloc(kMinAlignment, n);
  if (p == nullptr) return ResourceExhausted(name_, ": cannot allocate ", bytes, " bytes");
  return std::unique_ptr<Buffer>(new HostBuffer(this, p, bytes, /*owned=*/true, nullptr));
}

StatusOr<std::unique_ptr<Buffer>> HostDevice::WrapHostMemory(void* data, size_t bytes,
                                                             std::shared_ptr<void> keepalive) {
  return std::unique_ptr<Buffer>(
      new HostBuffer(this, data, bytes, /*owned=*/false, std::move(keepalive)));
}

StatusOr<DeviceMemoryInfo> HostDevice::MemoryInfo() { return HostMemoryInfo(); }

StatusOr<DeviceMemoryInfo> HostMemoryInfo(const std::string& proc_meminfo,
                                          const std::string& cgroup_dir) {
  uint64_t total = 0, available = 0;
  {
    std::ifstream in(proc_meminfo);
    std::string key, unit;
    uint64_t kib = 0;
    while (in >> key >> kib) {
      std::getline(in, unit);
      if (key == "MemTotal:") total = kib << 10;
      if (key == "MemAvailable:") available = kib << 10;
    }
  }
  if (total == 0) return Unavailable("cannot read the machine's memory from ", proc_meminfo);
  if (available == 0 || available > total) available = total;
  // cgroup v2: memory.max ("max" or bytes) and memory.current bound what this process gets.
  auto read_u64 = [](const std::string& path, uint64_t* v) {
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
      return false;
    *v = std::stoull(text);
    return true;
  };
  uint64_t limit = 0, current = 0;
  if (!cgroup_dir.empty() && read_u64(cgroup_dir + "/memory.max", &limit) && limit < total) {
    total = limit;
    const uint64_t used = read_u64(cgroup_dir + "/memory.current", &current) ? current : 0;
    available = std::min(available, used < limit ? limit - used : 0);
  }
  return DeviceMemoryInfo{total, available};
}

StatusOr<std::unique_ptr<Stream>> HostDevice::CreateStream() {
  return std::unique_ptr<Stream>(new HostStream(this, threads_));
}

// A captured launch list: deep copies of the launch arguments, replayed as recorded.
class HostStream::Recording final : public ExecGraph {
 public:
  explicit Recording(Device* device) : device_(device) {}
  void Add(std::span<const Launch> launches) {
    for (const Launch& l : launches) {
      auto args = std::make_unique<LaunchArgs>(*l.args);
      // Inputs, then extra outputs, in one array.
      const int n_in = l.args->num_inputs, n_out = l.args->num_extra_outputs;
      auto inputs = std::make_unique<TensorArg[]>(static_cast<size_t>(std::max(n_in + n_out, 1)));
      std::copy(l.args->inputs, l.args->inputs + n_in, inputs.get());
      std::copy(l.args->extra_outputs, l.args->extra_outputs + n_out, inputs.get() + n_in);
      args->inputs = inputs.get();
      args->extra_outputs = n_out > 0 ? inputs.get() + n_in : nullptr;
      launches_.push_back({l.fn, args.get()});
      args_.push_back(std::move(args));
      inputs_.push_back(std::move(inputs));
    }
  }
  Status Replay(Stream& stream) override {
    if (&stream.device() != device_) {
      return InvalidArgument("replay on ", ToAbsl(stream.device().name()),
                             " of a graph captured on ", ToAbsl(device_->name()));
    }
    return stream.Run(launches_);
  }

 private:
  Device* device_;
  std::vector<std::unique_ptr<LaunchArgs>> args_;
  std::vector<std::unique_ptr<TensorArg[]>> inputs_;
  std::vector<Launch> launches_;
};

StragglerPolicy StragglerPolicyFromEnv() {
  StragglerPolicy p;
  const char* v = std::getenv("KILN_CPU_STRAGGLER_FALLBACK");
  p.enabled = v == nullptr || std::strcmp(v, "0") != 0;
  return p;
}

HostStream::HostStream(Device* device, int threads, StragglerPolicy policy)
    : device_(device),
      threads_(threads),
      barrier_(threads),
      policy_(policy),
      backoff_s_(policy.backoff_seconds) {
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { Worker(i); });
}

HostStream::~HostStream() {
  stop_.store(true, std::memory_order_release);
  job_.fetch_add(1, std::memory_order_release);
  job_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void HostStream::Worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    job_.wait(seen, std::memory_order_acquire);
    seen = job_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    const ExecCtx ctx{index, threads_, nullptr};
    // A copy: once this thread has passed the job's last barrier the calling thread may
    // already be publishing the next job into current_, and a loop that re-read current_
    // would run the next job's later launches out of step with the others (a deadlock seen
    // beside a busy process, when this thread was descheduled right after that barrier).
    const std::span<const Launch> launches = current_;
    int64_t waited = 0;
    for (size_t i = 0; i < launches.size(); ++i) {
      launches[i].fn(*launches[i].args, ctx);
      // Published before the last barrier, which the calling thread passes only after it.
      if (i + 1 == launches.size()) wait_ns_.fetch_add(waited, std::memory_order_relaxed);
      BarrierWait(&waited);
    }
  }
}

void HostStream::BarrierWait(int64_t* waited) {
  if (!policy_.enabled) return barrier_.Wait();  // nothing measured: no clock reads
  const int64_t t0 = NowNs();
  barrier_.Wait();
  *waited += NowNs() - t0;
}

bool HostStream::QuotaAllowsOneCpu(int64_t now) {
  if (!policy_.quota_cpus || now < quota_due_ns_) return quota_one_cpu_;
  quota_due_ns_ = now + static_cast<int64_t>(policy_.quota_recheck_seconds * 1e9);
  const std::optional<double> cpus = policy_.quota_cpus();
  const bool one = cpus.has_value() && *cpus <= 1.0;
  if (one != quota_one_cpu_) {
    if (one) {
      spdlog::info(
          "{}: the cgroup's CPU quota allows {:.2f} CPUs, so its {} threads would only take turns "
          "being throttled; running launches on one thread while that holds (re-read every "
          "{:.0f} s; KILN_CPU_STRAGGLER_FALLBACK=0 turns this off)",
          device_->name(), *cpus, threads_, policy_.quota_recheck_seconds);
    } else {
      spdlog::info("{}: the CPU quota now allows more than one CPU; launches run on {} threads",
                   device_->name(), threads_);
    }
  }
  quota_one_cpu_ = one;
  return one;
}

void HostStream::Execute(std::span<const Launch> launches) {
  if (threads_ == 1) {
    const ExecCtx ctx{0, 1, nullptr};
    for (const Launch& l : launches) l.fn(*l.args, ctx);
    return;
  }
  if (launches.empty()) return;  // publishing an empty job would let workers race ahead
  const int64_t start = NowNs();
  if (policy_.enabled && (start < single_until_ns_ || QuotaAllowsOneCpu(start))) {
    // Stragglers, or a quota of one CPU: the calling thread runs every share of each launch
    // itself, in order (the workers stay asleep). The shares are the pool's, so the results
    // are too.
    for (const Launch& l : launches) {
      for (int i = 0; i < threads_; ++i) {
        l.fn(*l.args, ExecCtx{i, threads_, nullptr, /*shares_in_sequence=*/true});
      }
    }
    ++single_runs_;
    return;
  }
  const ExecCtx ctx{0, threads_, nullptr};
  current_ = launches;
  job_.fetch_add(1, std::memory_order_release);
  job_.notify_all();
  int64_t waited = 0;
  for (const Launch& l : launches) {
    l.fn(*l.args, ctx);
    BarrierWait(&waited);  // every thread finished this launch before anyone starts the next
  }
  if (!policy_.enabled) return;
  const int64_t end = NowNs();
  waited += wait_ns_.exchange(0, std::memory_order_relaxed);
  const double run_ns = static_cast<double>(end - start);
  if (run_ns < policy_.min_run_seconds * 1e9) return;  // too short to tell
  const double share = static_cast<double>(waited) / (run_ns * threads_);
  if (probing_) {  // the first run back on every thread: it alone decides
    probing_ = false;
    if (share <= policy_.max_wait_share) {
      spdlog::debug("{}: back on {} threads (the probe run waited {:.0f}%, {:.2f} ms)",
                    device_->name(), threads_, 100 * share, run_ns / 1e6);
      backoff_s_ = policy_.backoff_seconds;
      wait_share_ = share;
      return;
    }
    backoff_s_ = std::min(backoff_s_ * policy_.backoff_growth, policy_.max_backoff_seconds);
  } else {
    wait_share_ = 0.5 * wait_share_ + 0.5 * share;
    if (wait_share_ <= policy_.max_wait_share && share < policy_.immediate_wait_share) return;
  }
  single_until_ns_ = end + static_cast<int64_t>(backoff_s_ * 1e9);
  spdlog::debug("{}: one thread for {:.1f} s (the last run waited {:.0f}%, {:.2f} ms)",
                device_->name(), backoff_s_, 100 * share, run_ns / 1e6);
  if (fallbacks_++ == 0) {
    spdlog::info(
        "{}: its {} threads spent {:.0f}% of a run waiting for each other (a thread is being "
        "descheduled: a busy neighbour or a CPU quota?); running launches on one thread for "
        "{:.1f} s, then trying {} again (KILN_CPU_STRAGGLER_FALLBACK=0 turns this off)",
        device_->name(), threads_, 100 * share, backoff_s_, threads_);
  }
  wait_share_ = 0;
  probing_ = true;
}

Status HostStream::Run(std::span<const Launch> launches) {
  if (recording_) {
    recording_->Add(launches);
    return OkStatus();
  }
  Execute(launches);
  return OkStatus();
}

Status HostStream::CopyToDevice(const Buffer& dst, size_t dst_offset, const void* src,
                                size_t bytes) {
  KILN_RETURN_IF_ERROR(CheckRange(dst, dst_offset, bytes, "CopyToDevice"));
  if (bytes) std::memcpy(static_cast<char*>(dst.data()) + dst_offset, src, bytes);
  return OkStatus();
}

Status HostStream::CopyToHost(void* dst, const Buffer& src, size_t src_offset, size_t bytes) {
  KILN_RETURN_IF_ERROR(CheckRange(src, src_offset, bytes, "CopyToHost"));
  if (bytes) std::memcpy(dst, static_cast<const char*>(src.data()) + src_offset, bytes);
  return OkStatus();
}

Status HostStream::CopyOnDevice(const Buffer& dst, size_t dst_offset, const Buffer& src,
                                size_t src_offset, size_t bytes) {
  KILN_RETURN_IF_ERROR(CheckRange(dst, dst_offset, bytes, "CopyOnDevice"));
  KILN_RETURN_IF_ERROR(CheckRange(src, src_offset, bytes, "CopyOnDevice"));
  if (bytes) {
    std::memmove(static_cast<char*>(dst.data()) + dst_offset,
                 static_cast<const char*>(src.data()) + src_offset, bytes);
  }
  return OkStatus();
}

Status HostStream::BeginCapture() {
  if (recording_) return FailedPrecondition("BeginCapture: already capturing");
  recording_ = std::make_unique<Recording>(device_);
  return OkStatus();
}

StatusOr<std::unique_ptr<ExecGraph>> HostStream::EndCapture() {
  if (!recording_) return FailedPrecondition("EndCapture without BeginCapture");
  return std::unique_ptr<ExecGraph>(std::move(recording_));
}

}  // namespace kiln::backend
