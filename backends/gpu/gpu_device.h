// The gpu backend ("cuda"): NVIDIA GPUs through the CUDA runtime, NVRTC and cuBLAS. Built as
// the plugin libkiln_backend_cuda.so (gpu_plugin.cc); the same sources compiled with
// KILN_GPU_HIP=1 are the "hip" backend (libkiln_backend_hip.so): AMD GPUs through the HIP
// runtime and hiprtc, the printer's HIP dialect, no BLAS and no cuDNN (gpu_runtime.h maps the
// runtime's names; what follows says CUDA for both).
//
// Kernels are the device kernel layer's (backends/common/device_kernels.h): the engine's
// generated kernels in the printer's CUDA dialect, and the kernel library (cl/*.cl, OpenCL C)
// compiled as CUDA after cl/cuda_compat.h — the same sources the xpu backend runs. NVRTC
// compiles them at run time for the device's architecture (sm_XY) to cubins, cached on disk by
// source, architecture and NVRTC version (compiler::DiskCache namespace
// `cuda-<hash of that identity>`), and loads them with cudaLibraryLoadData. Kernels are
// declared and built lazily at their first launch, or as one batch when the compiler prepares
// a program (compiler::Target::Prepare); the library is one more program.
//
// Linking: the CUDA runtime is linked statically and the driver is only reached through it, so
// binaries start on machines without a driver; NVRTC and cuBLAS are opened at run time
// (backends/cuda/nvrtc.h, gpu_blas.h). CreateGpuBackend says why there is no backend: no
// driver, no device, no NVRTC. Devices are opened (their context created) at first use.
//
// Memory: Allocate() is a caching allocator over cudaMalloc, or over one expandable segment
// (GpuOptions::expandable_segments; best-fit ranges that coalesce). Freed blocks are parked until
// the device has finished the work enqueued before their release (one device synchronisation
// makes every parked block reusable), so a block is never handed out while a kernel may still
// use it; on out-of-memory the cache is emptied and the allocation retried, then the error
// names the request and the numbers (AllocatorStats).
//
// Streams are CUDA streams (blocking copies synchronise the stream; launches, device-to-device
// copies and the async copies do not). Graph capture is CUDA stream capture (relaxed mode),
// replayed with cudaGraphLaunch; cuBLAS calls are captured too (each stream's handle has a
// fixed workspace). A graph refers to its stream's scratch memory (devk::Queue::Scratch), which
// lives as long as the stream: replay a graph only while the stream it was captured on exists.
//
// Thread-safety: GpuDevice is thread-safe; a GpuStream is used by one thread at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "backends/common/device_kernels.h"
#include "backends/gpu/gpu_vmm.h"
#include "backends/gpu/range_allocator.h"
#include "engine/backend/backend.h"
#include "engine/compiler/kernel_cache.h"
#include "engine/compiler/target.h"

namespace kiln::gpu {

// The same sources build the CUDA backend and, with KILN_GPU_HIP=1, the HIP one
// (gpu_runtime.h maps the runtime's names): its name, its devices' ("hip:0") and its kernel
// dialect.
#if KILN_GPU_HIP
inline constexpr std::string_view kBackendName = "hip";
inline constexpr compiler::Dialect kDialect = compiler::Dialect::kHip;
#else
inline constexpr std::string_view kBackendName = "cuda";
inline constexpr compiler::Dialect kDialect = compiler::Dialect::kCuda;
#endif

// What the backend knows of a device (queried once).
struct DeviceInfo {
  int ordinal = 0;
  std::string name;  // "NVIDIA H100 80GB HBM3"
  std::string arch;  // what kernels are compiled for: "sm_90", "gfx90a"
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
  uint64_t total_bytes = 0;
  int driver_version = 0;   // 13000
  int runtime_version = 0;  // 13000
  const std::string& Arch() const { return arch; }
  std::string Describe() const;  // "NVIDIA H100 (sm_90, 132 SMs, 79.1 GiB, driver 13.0)"
};

struct AllocatorStats {
  uint64_t reserved_bytes = 0;   // held from the driver (in use + cached)
  uint64_t allocated_bytes = 0;  // in live buffers
  uint64_t peak_allocated_bytes = 0;
  int64_t segments = 0;      // cudaMalloc blocks held (expandable: mapped page chunks)
  int64_t cache_hits = 0;    // allocations served from the cache
  int64_t device_syncs = 0;  // synchronisations made to reuse released blocks
};

struct GpuOptions {
  // Kernel cache directory: empty = compiler::CacheDir(), "none" = no disk cache.
  std::string cache_dir;
  // Allocate from one expandable segment (gpu_vmm.h: reserved addresses, pages mapped as it
  // grows, freed ranges coalesced) instead of cudaMalloc blocks cached by exact size.
  // CreateGpuBackend sets it from KILN_CUDA_EXPANDABLE_SEGMENTS=1. Falls back to cudaMalloc,
  // logged, where the driver or device has no virtual memory management.
  bool expandable_segments = false;
};

// NVRTC's options for every program (besides the architecture and -default-device).
std::vector<std::string> NvrtcOptions();

class GpuKernelSlot;
class GpuStream;

class GpuDevice final : public devk::KernelHost, public compiler::Target {
 public:
  static StatusOr<std::unique_ptr<GpuDevice>> Create(int ordinal, const GpuOptions& options = {});
  ~GpuDevice() override;

  // ---- backend::Device ----
  std::string_view name() const override { return name_; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t bytes) override;
  StatusOr<std::unique_ptr<backend::Buffer>> AllocatePinnedHost(size_t bytes) override;
  StatusOr<backend::DeviceMemoryInfo> MemoryInfo() override;
  std::optional<backend::DeviceAllocatorStats> AllocatorStatistics() const override;
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override;
  bool SupportsDType(DType t) const override { return t != DType::kInvalid; }
  // "gpu.device_info" -> const DeviceInfo*; "gpu.sdpa_calls" -> const std::atomic<int64_t>*
  // (attention launches cuDNN SDPA ran; KILN_CUDNN_SDPA=0 turns it off); compiler::kTargetExtension
  // -> compiler::Target*; backend::kMatMulMixedRhsExtension is not offered (the compiler casts such
  // operands).
  void* GetExtension(std::string_view name) override;

  // ---- compiler::Target ----
  compiler::FusionCaps caps() const override;
  Status Prepare(std::span<const backend::KernelRequest> requests) override;
  compiler::CompileCounters counters() const override;

  // ---- devk::KernelHost ----
  const char* kernel_prefix() const override { return kBackendName.data(); }
  compiler::Dialect dialect() const override { return kDialect; }
  bool fp64() const override { return true; }
  size_t max_param_bytes() const override { return 4096; }
  // The sample kernel runs one work-item per row over the whole vocabulary: on an H100 a
  // SmolLM2 decode step spent 4.2 ms in it, and sampling on the host decoded 2.2x faster
  // (299 vs 137 tokens/s). Declined unless KILN_GPU_DEVICE_SAMPLING=1.
  std::string SampleKernelDeclined() const override;
  // True (KILN_GPU_LINEAR_BLOCKS=1: false, the block-per-work-item path, for comparisons).
  bool element_block_weights() const override { return element_block_weights_; }
  int linear_lanes() const override { return linear_lanes_; }
  bool HasGemm(DType t) const override;
  const char* blas_name() const override { return "cublas"; }
  devk::KernelSlot* DeclareKernel(std::string_view prefix, std::string_view source) override;
  devk::KernelSlot* DeclareGenerated(const compiler::GeneratedKernel& kernel) override;
  devk::KernelSlot* LibraryKernel(std::string_view name) override;
  bool Resolve(const void* p, void** mem, size_t* offset) const override;
  Status Upload(const backend::Buffer& dst, const void* src, size_t bytes) override;

  // ---- For streams and tests ----
  const DeviceInfo& info() const { return info_; }
  int ordinal() const { return info_.ordinal; }
  // Builds `k`'s program (with every other pending kernel of its group) if not built yet.
  Status EnsureBuilt(GpuKernelSlot* k);
  Status BuildPending();
  AllocatorStats allocator_stats() const;
  bool expandable() const { return segment_ != nullptr; }  // allocating from a segment
  struct BuildStats {
    int programs_built = 0;
    int programs_from_cache = 0;
    int kernels_built = 0;
    int kernels_from_cache = 0;
    double build_seconds = 0;
  };
  BuildStats build_stats() const;

  // Caching allocator (see the file comment).
  StatusOr<void*> AllocateRaw(size_t bytes);
  void Release(void* p, size_t bytes);
  // Streams of this device that are capturing: the allocator must not synchronise the device
  // then (it would invalidate the capture), so it allocates new blocks instead.
  void CaptureBegan() { capturing_.fetch_add(1); }
  void CaptureEnded() { capturing_.fetch_sub(1); }
  void CountSdpaCall() { sdpa_calls_.fetch_add(1); }

 private:
  GpuDevice() = default;
  enum Group { kGenerated = 0, kLibrary = 1 };
  devk::KernelSlot* Declare(std::string name, std::string source, int group);
  Status BuildBatch(int group, std::vector<GpuKernelSlot*> batch);
  // The module's cubin: from the disk cache, or compiled by NVRTC (and stored).
  StatusOr<std::string> Cubin(const std::string& source, bool* from_cache);

  std::string name_;
  DeviceInfo info_;
  GpuOptions options_;
  std::unique_ptr<compiler::DiskCache> cache_;
  std::string cache_ns_;

  // Allocator.
  StatusOr<void*> AllocateFromSegment(size_t block);  // REQUIRES: alloc_mu_ held
  // Synchronises the device and makes the parked blocks reusable; false when there are none,
  // a stream captures or the synchronisation fails. REQUIRES: alloc_mu_ held.
  bool ReclaimParked();
  mutable std::mutex alloc_mu_;
  std::unique_ptr<ExpandableSegment> segment_;    // with expandable_segments
  std::unique_ptr<RangeAllocator> ranges_;        // its free and allocated ranges
  std::multimap<size_t, void*> free_;             // reusable blocks by size
  std::vector<std::pair<size_t, void*>> parked_;  // released, maybe still in use by the device
  AllocatorStats astats_;
  std::atomic<int> capturing_{0};
  std::atomic<int64_t> sdpa_calls_{0};
  bool element_block_weights_ = true;
  int linear_lanes_ = 32;  // a warp; 0 with KILN_GPU_LINEAR_SG=0 (the work-group kernel)

  // Kernels and programs.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<GpuKernelSlot>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<GpuKernelSlot*> pending_[2] ABSL_GUARDED_BY(mu_);
  std::vector<void*> libraries_ ABSL_GUARDED_BY(mu_);     // cudaLibrary_t, unloaded at the end
  void* library_program_ ABSL_GUARDED_BY(mu_) = nullptr;  // the kernel library's module
  BuildStats bstats_ ABSL_GUARDED_BY(mu_);
  std::mutex build_mu_;
  std::atomic<int64_t> reused_{0};
};

// The "cuda" backend: one GpuDevice per CUDA device, each opened (its primary context created)
// at its first use rather than when the backend is made, so a process that never runs on the
// GPU does not pay a context.
class GpuBackend final : public backend::Backend {
 public:
  GpuBackend(int device_count, GpuOptions options);
  std::string_view name() const override { return kBackendName; }
  int device_count() const override { return count_; }
  // Opens the device; null (logged once) when it cannot be opened.
  backend::Device* device(int index) override;
  StatusOr<backend::Device*> Open(int index) override;
  bool opened(int index) const override;

 private:
  const int count_;
  const GpuOptions options_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<GpuDevice>> devices_ ABSL_GUARDED_BY(mu_);  // null until opened
  std::vector<Status> failures_ ABSL_GUARDED_BY(mu_);                     // why one could not be
};

// The CUDA devices (KILN_CUDA_DEVICES=none disables the backend; KILN_CUDA_EXPANDABLE_SEGMENTS=1
// sets options.expandable_segments), none opened yet. Unavailable with the reason when there is
// no driver, no device or no NVRTC.
StatusOr<std::unique_ptr<GpuBackend>> CreateGpuBackend(const GpuOptions& options = {});

}  // namespace kiln::gpu
