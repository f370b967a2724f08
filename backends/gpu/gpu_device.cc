#include "backends/gpu/gpu_device.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "backends/gpu/gpu_blas.h"
#include "backends/gpu/gpu_runtime.h"
#include "backends/gpu/gpu_sdpa.h"
#if KILN_GPU_HIP
#include "backends/rocm/hiprtc.h"
#else
#include "backends/cuda/nvrtc.h"
#endif
#include "engine/compiler/hash.h"
#include "engine/ops.h"
#include "spdlog/spdlog.h"

namespace kiln::gpu {
namespace {

using Clock = std::chrono::steady_clock;

// A CUDA runtime error as a Status naming the call and where it was made. Out of memory is
// ResourceExhausted; no driver or device is Unavailable.
Status CudaStatus(cudaError_t e, std::string_view call, const char* file, int line) {
  (void)cudaGetLastError();  // clear the sticky-free error state for the next call
  const std::string msg = absl::StrCat(ToAbsl(call), " failed (", file, ":", line,
                                       "): ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) return ResourceExhausted(msg);
  if (rt::IsNoDevice(e)) return Unavailable(msg);
  return Internal(msg);
}

#define KILN_CUDA_CALL(expr)                                        \
  do {                                                              \
    const cudaError_t kiln_cuda_err_ = (expr);                      \
    if (kiln_cuda_err_ != cudaSuccess) {                            \
      return CudaStatus(kiln_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                               \
  } while (0)

std::string GiB(uint64_t bytes) {
  return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1ull << 30));
}

// The expandable segment's range alignment: every block is a multiple of RoundedSize's grain.
constexpr uint64_t kSegmentAlignment = 512;

// The rounded size of an allocation (cudaMalloc aligns to 256 bytes).
size_t RoundedSize(size_t bytes) {
  constexpr size_t kGrain = kSegmentAlignment;
  return std::max<size_t>((bytes + kGrain - 1) / kGrain * kGrain, kGrain);
}

}  // namespace

// ---- Kernel slots
// ---------------------------------------------------------------------------------

class GpuKernelSlot final : public devk::KernelSlot {
 public:
  GpuKernelSlot(std::string name, std::string source, int group) : source_(std::move(source)) {
    name_ = std::move(name);
    group_ = group;
  }
  const std::string& source() const { return source_; }
  int group() const { return group_; }
  bool built() const { return built_.load(std::memory_order_acquire); }
  // The kernel, or the reason it could not be built. REQUIRES: built().
  rt::Function kernel() const { return kernel_; }
  const Status& status() const { return status_; }
  void Set(rt::Function k, Status s) {
    kernel_ = k;
    status_ = std::move(s);
    built_.store(true, std::memory_order_release);
  }

 private:
  std::string source_;
  int group_ = 0;
  std::atomic<bool> built_{false};
  rt::Function kernel_ = nullptr;
  Status status_;
};

// ---- Buffers -----------------------------------------------------------------------------------

namespace {

class GpuBuffer final : public backend::Buffer {
 public:
  GpuBuffer(GpuDevice* dev, void* p, size_t bytes, size_t block)
      : Buffer(dev, p, bytes), dev_(dev), block_(block) {}
  ~GpuBuffer() override { dev_->Release(data(), block_); }

 private:
  GpuDevice* dev_;
  size_t block_;
};

class PinnedBuffer final : public backend::Buffer {
 public:
  PinnedBuffer(backend::Device* dev, void* p, size_t bytes) : Buffer(dev, p, bytes) {}
  ~PinnedBuffer() override { (void)cudaFreeHost(data()); }
};

}  // namespace

// Released blocks become reusable once the device has finished the work enqueued before
// their release: one synchronisation (never while a stream captures) frees all of them.
bool GpuDevice::ReclaimParked() {
  if (parked_.empty() || capturing_.load() != 0) return false;
  if (cudaDeviceSynchronize() != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  ++astats_.device_syncs;
  for (auto& [size, q] : parked_) {
    if (ranges_ != nullptr) {
      ranges_->Free(static_cast<uint64_t>(static_cast<char*>(q) - segment_->base()), size);
    } else {
      free_.emplace(size, q);
    }
  }
  parked_.clear();
  return true;
}

// Best fit among the segment's free ranges; else its released blocks once the device is done
// with them; else more pages mapped at its end (at least 64 MiB at a time).
StatusOr<void*> GpuDevice::AllocateFromSegment(size_t block) {
  auto take = [&]() -> void* {
    const std::optional<uint64_t> o = ranges_->Allocate(block);
    return o ? segment_->base() + *o : nullptr;
  };
  void* p = take();
  if (p == nullptr && ReclaimParked()) p = take();
  Status grown = OkStatus();
  if (p == nullptr) {
    const uint64_t need = ranges_->capacity() + ranges_->Align(block - ranges_->tail_free());
    const uint64_t step =
        std::min<uint64_t>(ranges_->capacity() + (uint64_t{64} << 20), segment_->reserved());
    grown = segment_->MapTo(std::max(need, step));
    if (!grown.ok() && step > need) grown = segment_->MapTo(need);
    if (grown.ok()) {
      ranges_->Grow(segment_->mapped());
      p = take();
    }
  }
  astats_.reserved_bytes = segment_->mapped();
  astats_.segments = segment_->chunks();
  if (p == nullptr) {
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    (void)cudaGetLastError();
    return ResourceExhausted(
        name_, ": out of memory allocating ", block, " bytes from the expandable segment (",
        StatusMessage(grown), "); the device has ", free_b, " of ", total_b,
        " bytes free, Kiln holds ", segment_->mapped(), " bytes (", astats_.allocated_bytes,
        " in use, ", ranges_->free_bytes(), " free in ", ranges_->free_ranges(), " ranges)");
  }
  astats_.allocated_bytes += block;
  astats_.peak_allocated_bytes = std::max(astats_.peak_allocated_bytes, astats_.allocated_bytes);
  return p;
}

StatusOr<void*> GpuDevice::AllocateRaw(size_t block) {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  if (segment_ != nullptr) return AllocateFromSegment(block);
  // Exact-size reuse keeps Release() simple: the buffer releases `block` bytes.
  auto exact = [&]() -> void* {
    auto it = free_.find(block);
    if (it == free_.end()) return nullptr;
    void* p = it->second;
    free_.erase(it);
    ++astats_.cache_hits;
    return p;
  };
  void* p = exact();
  if (p == nullptr && ReclaimParked()) p = exact();
  if (p == nullptr) {
    cudaError_t e = cudaMalloc(&p, block);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      // Empty the cache and retry once.
      (void)ReclaimParked();
      for (auto& [size, q] : free_) {
        (void)cudaFree(q);
        astats_.reserved_bytes -= size;
        --astats_.segments;
      }
      free_.clear();
      e = cudaMalloc(&p, block);
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      (void)cudaGetLastError();
      return ResourceExhausted(name_, ": out of memory allocating ", block, " bytes (",
                               cudaGetErrorName(e), "); the device has ", free_b, " of ", total_b,
                               " bytes free, Kiln holds ", astats_.reserved_bytes, " bytes (",
                               astats_.allocated_bytes, " in use)");
    }
    astats_.reserved_bytes += block;
    ++astats_.segments;
  }
  astats_.allocated_bytes += block;
  astats_.peak_allocated_bytes = std::max(astats_.peak_allocated_bytes, astats_.allocated_bytes);
  return p;
}

void GpuDevice::Release(void* p, size_t block) {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  astats_.allocated_bytes -= block;
  parked_.emplace_back(block, p);
}

std::string GpuDevice::SampleKernelDeclined() const {
  static const bool device_sampling = [] {
    const char* v = std::getenv("KILN_GPU_DEVICE_SAMPLING");
    return v != nullptr && std::string_view(v) == "1";
  }();
  if (device_sampling) return "";
  return "the sample kernel is serial per row, slower than sampling on the host (H100: 137 vs "
         "299 tokens/s decoding SmolLM2); KILN_GPU_DEVICE_SAMPLING=1 uses it";
}

std::optional<backend::DeviceAllocatorStats> GpuDevice::AllocatorStatistics() const {
  const AllocatorStats a = allocator_stats();
  return backend::DeviceAllocatorStats{a.reserved_bytes, a.allocated_bytes, a.peak_allocated_bytes,
                                       a.segments};
}

AllocatorStats GpuDevice::allocator_stats() const {
  std::lock_guard<std::mutex> lock(alloc_mu_);
  return astats_;
}

StatusOr<std::unique_ptr<backend::Buffer>> GpuDevice::Allocate(size_t bytes) {
  KILN_CUDA_CALL(cudaSetDevice(info_.ordinal));
  const size_t block = RoundedSize(bytes);
  KILN_ASSIGN_OR_RETURN(void* p, AllocateRaw(block));
  return std::unique_ptr<backend::Buffer>(new GpuBuffer(this, p, bytes, block));
}

StatusOr<std::unique_ptr<backend::Buffer>> GpuDevice::AllocatePinnedHost(size_t bytes) {
  KILN_CUDA_CALL(cudaSetDevice(info_.ordinal));
  void* p = nullptr;
  KILN_CUDA_CALL(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable));
  return std::unique_ptr<backend::Buffer>(new PinnedBuffer(this, p, bytes));
}

StatusOr<backend::DeviceMemoryInfo> GpuDevice::MemoryInfo() {
  KILN_CUDA_CALL(cudaSetDevice(info_.ordinal));
  size_t free_b = 0, total_b = 0;
  KILN_CUDA_CALL(cudaMemGetInfo(&free_b, &total_b));
  // Blocks this process caches count as free: they serve the next allocations.
  std::lock_guard<std::mutex> lock(alloc_mu_);
  uint64_t cached = ranges_ != nullptr ? ranges_->free_bytes() : 0;
  for (const auto& [size, p] : free_) cached += size;
  for (const auto& [size, p] : parked_) cached += size;
  return backend::DeviceMemoryInfo{total_b, free_b + cached};
}

bool GpuDevice::Resolve(const void* p, void** mem, size_t* offset) const {
  if (p == nullptr) return false;
  *mem = const_cast<void*>(p);
  *offset = 0;
  return true;
}

Status GpuDevice::Upload(const backend::Buffer& dst, const void* src, size_t bytes) {
  if (&dst.device() != this) {
    return InvalidArgument("Upload: the buffer is on ", ToAbsl(dst.device().name()), ", not ",
                           name_);
  }
  KILN_CUDA_CALL(cudaSetDevice(info_.ordinal));
  KILN_CUDA_CALL(cudaMemcpy(dst.data(), src, bytes, cudaMemcpyHostToDevice));
  return OkStatus();
}

// ---- Queue and streams
// ----------------------------------------------------------------------------

namespace {

class GpuQueue final : public devk::Queue {
 public:
  GpuQueue(GpuDevice* dev, cudaStream_t stream) : devk::Queue(dev), dev_(dev), stream_(stream) {}

  void Enqueue(devk::KernelSlot* slot, const devk::Args& args, int dims, const size_t* global,
               const size_t* local, int meta_size) override {
    if (!status.ok()) return;
    auto* k = static_cast<GpuKernelSlot*>(slot);
    if (!args.ok()) {
      return Fail(Internal(kBackendName, " kernel ", k->name(),
                           ": a tensor is not on this device or the launch has too many "
                           "arguments"));
    }
    unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1};
    for (int d = 0; d < dims; ++d) {
      if (global[d] == 0) return;  // nothing to do
      const size_t g = (global[d] + local[d] - 1) / local[d];
      if (g > (d == 0 ? 0x7fffffffu : 65535u) || local[d] > 1024) {
        return Fail(Unimplemented(kBackendName, " kernel ", k->name(), ": ", global[d],
                                  " work-items in groups of ", local[d], " in dimension ", d,
                                  " exceed the grid"));
      }
      grid[d] = static_cast<unsigned>(g);
      block[d] = static_cast<unsigned>(local[d]);
    }
    if (meta_size == 0) meta_size = devk::Args::MetaSize(args.num_meta());
    if (meta_size < args.num_meta()) {
      return Fail(Internal(kBackendName, " kernel ", k->name(), ": ", args.num_meta(),
                           " metadata values for meta", meta_size));
    }
    if (Status s = dev_->EnsureBuilt(k); !s.ok()) return Fail(s);
    void* params[devk::Args::kMaxMems + 1];
    for (int i = 0; i < args.num_mems(); ++i) params[i] = const_cast<void**>(args.mems()) + i;
    params[args.num_mems()] = const_cast<int64_t*>(args.meta());
    const cudaError_t e = rt::Launch(k->kernel(), dim3(grid[0], grid[1], grid[2]),
                                     dim3(block[0], block[1], block[2]), params, 0, stream_);
    if (e != cudaSuccess) {
      Fail(CudaStatus(e, absl::StrCat(rt::kLaunchCall, "(", k->name(), ")"), __FILE__, __LINE__));
    }
  }

  bool Gemm(const devk::GemmCall& call) override {
    if (blas_ == nullptr) return false;
    std::string why;
    if (blas_->Gemm(call, &why)) return true;
    static std::atomic<int> logged{0};
    if (logged.fetch_add(1) < 3)
      spdlog::debug("{}: {}; using Kiln's GEMM kernel", kBackendName, why);
    return false;
  }

  // Causal prefill attention and its backward through cuDNN SDPA unless KILN_CUDNN_SDPA=0
  // (checked on an H100: gpu_sdpa_test; 4k x 4k, head dim 128: 0.27 ms against the template's
  // 166 ms): f16/bf16, dense row-major tensors, head dim 64 or 128, not while capturing
  // (building a graph is not capturable). Anything else, a missing libcudnn or any cuDNN error
  // runs Kiln's template.
  bool Attention(const devk::AttentionCall& c) override {
    const std::optional<SdpaKey> key = SdpaKeyFor({c.q, c.k, c.v, c.out}, c.lse, c.scale);
    if (!key) return false;
    return SdpaDone(*key, [&] {
      return sdpa_->Forward(*key,
                            {c.q->data, c.k->data, c.v->data, c.out->data,
                             c.lse != nullptr ? static_cast<float*>(c.lse->data) : nullptr},
                            [this](size_t bytes) { return Scratch(bytes); });
    });
  }
  bool AttentionBackward(const devk::AttentionBackwardCall& c) override {
    const std::optional<SdpaKey> key =
        SdpaKeyFor({c.q, c.k, c.v, c.out, c.d_out, c.dq, c.dk, c.dv}, c.lse, c.scale);
    if (!key) return false;
    return SdpaDone(*key, [&] {
      return sdpa_->Backward(
          *key,
          {c.q->data, c.k->data, c.v->data, c.out->data, c.d_out->data,
           static_cast<const float*>(c.lse->data), c.dq->data, c.dk->data, c.dv->data},
          [this](size_t bytes) { return Scratch(bytes); });
    });
  }

  // Grow-only: a buffer stays alive until the stream goes (work in flight or captured in a
  // graph may still use it).
  void* Scratch(size_t bytes) override {
    if (!scratch_.empty() && scratch_.back()->size() >= bytes) return scratch_.back()->data();
    const size_t grow = scratch_.empty() ? bytes : std::max(bytes, 2 * scratch_.back()->size());
    StatusOr<std::unique_ptr<backend::Buffer>> b = dev_->Allocate(grow);
    if (!b.ok()) return nullptr;
    scratch_.push_back(*std::move(b));
    return scratch_.back()->data();
  }

  void set_blas(BlasHandle* b) { blas_ = b; }
  void ReleaseSdpa() { sdpa_.reset(); }

 private:
  // The SDPA problem of an attention launch whose rank-4 tensors are `t` (q, k, v first; all
  // of q's dtype) and whose log-sum-exp is `lse` (f32; null for a forward without it), when
  // cuDNN is enabled, has not failed on this stream, the stream is not capturing and SDPA
  // handles the problem; otherwise nullopt.
  std::optional<SdpaKey> SdpaKeyFor(std::initializer_list<const TensorArg*> t, const TensorArg* lse,
                                    double scale) {
    static const bool enabled = [] {
      if (!SdpaCompiled()) return false;  // built without cudnn-frontend, or for HIP
      const char* e = std::getenv("KILN_CUDNN_SDPA");
      return e == nullptr || std::string_view(e) != "0";
    }();
    if (!enabled || !status.ok() || sdpa_failed_) return std::nullopt;
    const auto dense = [](const TensorArg& x) {
      int64_t stride = 1;
      for (int i = x.rank - 1; i >= 0; --i) {
        if (x.shape[i] != 1 && x.strides[i] != stride) return false;
        stride *= x.shape[i];
      }
      return true;
    };
    const TensorArg &q = **t.begin(), &k = *t.begin()[1], &v = *t.begin()[2];
    for (const TensorArg* x : t) {
      if (x->rank != 4 || x->dtype != q.dtype || !dense(*x)) return std::nullopt;
    }
    if (v.shape[3] != q.shape[3] ||
        (lse != nullptr && (lse->dtype != DType::kF32 || !dense(*lse)))) {
      return std::nullopt;
    }
    const SdpaKey key = {.batch = q.shape[0],
                         .q_heads = q.shape[1],
                         .kv_heads = k.shape[1],
                         .q_len = q.shape[2],
                         .kv_len = k.shape[2],
                         .head_dim = q.shape[3],
                         .dtype = q.dtype,
                         .causal = true,
                         .stats = lse != nullptr,
                         .scale = static_cast<float>(scale)};
    if (!SdpaSupports(key).ok()) return std::nullopt;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      return std::nullopt;
    }
    return key;
  }
  // Runs `call` (which uses sdpa_, created here first): true when cuDNN ran it; on an error,
  // logs it and stops offering attention to cuDNN on this stream (the template runs it).
  template <typename Call>
  bool SdpaDone(const SdpaKey& key, Call call) {
    Status st = OkStatus();
    if (sdpa_ == nullptr) {
      StatusOr<std::unique_ptr<SdpaRunner>> r = SdpaRunner::Create(stream_);
      if (r.ok()) sdpa_ = *std::move(r);
      st = r.status();
    }
    if (st.ok()) st = call();
    if (st.ok()) {
      dev_->CountSdpaCall();
      return true;
    }
    sdpa_failed_ = true;
    spdlog::warn("{}: cuDNN SDPA for {}: {}; using Kiln's attention kernel", kBackendName,
                 key.Describe(), StatusMessage(st));
    return false;
  }

  GpuDevice* dev_;
  cudaStream_t stream_;
  BlasHandle* blas_ = nullptr;
  std::vector<std::unique_ptr<backend::Buffer>> scratch_;
  std::unique_ptr<SdpaRunner> sdpa_;  // created at the first SDPA call
  bool sdpa_failed_ = false;
};

class GpuEvent final : public backend::Event {
 public:
  explicit GpuEvent(cudaEvent_t e) : e_(e) {}
  ~GpuEvent() override { (void)cudaEventDestroy(e_); }
  Status Wait() override {
    KILN_CUDA_CALL(cudaEventSynchronize(e_));
    return OkStatus();
  }
  bool Done() override {
    const cudaError_t e = cudaEventQuery(e_);
    if (e != cudaSuccess && e != cudaErrorNotReady) (void)cudaGetLastError();
    return e != cudaErrorNotReady;
  }
  cudaEvent_t event() const { return e_; }

 private:
  cudaEvent_t e_;
};

class GpuGraph final : public backend::ExecGraph {
 public:
  GpuGraph(GpuDevice* dev, cudaGraphExec_t exec) : dev_(dev), exec_(exec) {}
  ~GpuGraph() override { (void)cudaGraphExecDestroy(exec_); }
  Status Replay(backend::Stream& stream) override;

 private:
  GpuDevice* dev_;
  cudaGraphExec_t exec_;
};

}  // namespace

class GpuStream final : public backend::Stream {
 public:
  GpuStream(GpuDevice* dev, cudaStream_t s, std::unique_ptr<BlasHandle> blas)
      : dev_(dev), stream_(s), blas_(std::move(blas)), queue_(dev, s) {
    queue_.set_blas(blas_.get());
  }
  ~GpuStream() override {
    if (capturing_) {
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(stream_, &g);
      if (g != nullptr) (void)cudaGraphDestroy(g);
      dev_->CaptureEnded();
    }
    (void)cudaStreamSynchronize(stream_);
    blas_.reset();
    queue_.ReleaseSdpa();  // its cuDNN handle is bound to the stream
    (void)cudaStreamDestroy(stream_);
  }
  backend::Device& device() override { return *dev_; }
  cudaStream_t stream() const { return stream_; }
  bool capturing() const { return capturing_; }

  Status Run(std::span<const Launch> launches) override {
    KILN_CUDA_CALL(cudaSetDevice(dev_->ordinal()));
    queue_.status = OkStatus();
    ExecCtx ctx;
    ctx.native_stream = static_cast<devk::Queue*>(&queue_);
    for (const Launch& l : launches) {
      l.fn(*l.args, ctx);
      if (!queue_.status.ok()) break;
    }
    return queue_.status;
  }

  Status CopyToDevice(const backend::Buffer& dst, size_t dst_offset, const void* src,
                      size_t bytes) override {
    KILN_RETURN_IF_ERROR(Check(dst, dst_offset, bytes, "CopyToDevice", /*blocking=*/true));
    if (bytes == 0) return OkStatus();
    KILN_CUDA_CALL(cudaMemcpyAsync(static_cast<char*>(dst.data()) + dst_offset, src, bytes,
                                   cudaMemcpyHostToDevice, stream_));
    KILN_CUDA_CALL(cudaStreamSynchronize(stream_));
    return OkStatus();
  }
  Status CopyToHost(void* dst, const backend::Buffer& src, size_t src_offset,
                    size_t bytes) override {
    KILN_RETURN_IF_ERROR(Check(src, src_offset, bytes, "CopyToHost", /*blocking=*/true));
    if (bytes == 0) return OkStatus();
    KILN_CUDA_CALL(cudaMemcpyAsync(dst, static_cast<const char*>(src.data()) + src_offset, bytes,
                                   cudaMemcpyDeviceToHost, stream_));
    KILN_CUDA_CALL(cudaStreamSynchronize(stream_));
    return OkStatus();
  }
  Status CopyOnDevice(const backend::Buffer& dst, size_t dst_offset, const backend::Buffer& src,
                      size_t src_offset, size_t bytes) override {
    KILN_RETURN_IF_ERROR(Check(dst, dst_offset, bytes, "CopyOnDevice", false));
    KILN_RETURN_IF_ERROR(Check(src, src_offset, bytes, "CopyOnDevice", false));
    if (bytes == 0) return OkStatus();
    KILN_CUDA_CALL(cudaMemcpyAsync(static_cast<char*>(dst.data()) + dst_offset,
                                   static_cast<const char*>(src.data()) + src_offset, bytes,
                                   cudaMemcpyDeviceToDevice, stream_));
    return OkStatus();
  }
  Status CopyToDeviceAsync(const backend::Buffer& dst, size_t dst_offset, const void* src,
                           size_t bytes) override {
    KILN_RETURN_IF_ERROR(Check(dst, dst_offset, bytes, "CopyToDeviceAsync", false));
    if (bytes == 0) return OkStatus();
    KILN_CUDA_CALL(cudaMemcpyAsync(static_cast<char*>(dst.data()) + dst_offset, src, bytes,
                                   cudaMemcpyHostToDevice, stream_));
    return OkStatus();
  }
  Status CopyToHostAsync(void* dst, const backend::Buffer& src, size_t src_offset,
                         size_t bytes) override {
    KILN_RETURN_IF_ERROR(Check(src, src_offset, bytes, "CopyToHostAsync", false));
    if (bytes == 0) return OkStatus();
    KILN_CUDA_CALL(cudaMemcpyAsync(dst, static_cast<const char*>(src.data()) + src_offset, bytes,
                                   cudaMemcpyDeviceToHost, stream_));
    return OkStatus();
  }
  Status Synchronize() override {
    if (capturing_) return FailedPrecondition("Synchronize while the stream is capturing");
    KILN_CUDA_CALL(cudaStreamSynchronize(stream_));
    return OkStatus();
  }

  StatusOr<std::unique_ptr<backend::Event>> RecordEvent() override {
    cudaEvent_t e = nullptr;
    KILN_CUDA_CALL(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    auto ev = std::make_unique<GpuEvent>(e);
    KILN_CUDA_CALL(cudaEventRecord(e, stream_));
    return std::unique_ptr<backend::Event>(std::move(ev));
  }
  Status WaitEvent(backend::Event& event) override {
    auto* e = dynamic_cast<GpuEvent*>(&event);
    if (e == nullptr) return event.Wait();
    KILN_CUDA_CALL(cudaStreamWaitEvent(stream_, e->event(), 0));
    return OkStatus();
  }

  bool SupportsCapture() const override { return true; }
  Status BeginCapture() override {
    if (capturing_) return FailedPrecondition("BeginCapture: already capturing");
    KILN_CUDA_CALL(cudaSetDevice(dev_->ordinal()));
    KILN_CUDA_CALL(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    capturing_ = true;
    dev_->CaptureBegan();
    return OkStatus();
  }
  StatusOr<std::unique_ptr<backend::ExecGraph>> EndCapture() override {
    if (!capturing_) return FailedPrecondition("EndCapture without BeginCapture");
    capturing_ = false;
    dev_->CaptureEnded();
    cudaGraph_t graph = nullptr;
    KILN_CUDA_CALL(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = rt::Instantiate(&exec, graph);
    (void)cudaGraphDestroy(graph);
    if (e != cudaSuccess) return CudaStatus(e, rt::kInstantiateCall, __FILE__, __LINE__);
    return std::unique_ptr<backend::ExecGraph>(new GpuGraph(dev_, exec));
  }

 private:
  Status Check(const backend::Buffer& b, size_t off, size_t bytes, const char* what,
               bool blocking) const {
    if (&b.device() != dev_) {
      return InvalidArgument(what, ": the buffer is on ", ToAbsl(b.device().name()), ", not ",
                             ToAbsl(dev_->name()));
    }
    if (off > b.size() || bytes > b.size() - off) {
      return OutOfRange(what, ": ", bytes, " bytes at offset ", off, " of a ", b.size(),
                        "-byte buffer");
    }
    if (blocking && capturing_) {
      return FailedPrecondition(what, " blocks, which a capturing stream cannot");
    }
    return OkStatus();
  }

  GpuDevice* dev_;
  cudaStream_t stream_;
  std::unique_ptr<BlasHandle> blas_;
  GpuQueue queue_;
  bool capturing_ = false;
};

Status GpuGraph::Replay(backend::Stream& stream) {
  if (&stream.device() != dev_) {
    return InvalidArgument("Replay: the graph was captured on ", ToAbsl(dev_->name()),
                           ", the stream is on ", ToAbsl(stream.device().name()));
  }
  auto& s = static_cast<GpuStream&>(stream);
  if (s.capturing()) return FailedPrecondition("Replay while the stream is capturing");
  KILN_CUDA_CALL(cudaGraphLaunch(exec_, s.stream()));
  return OkStatus();
}

StatusOr<std::unique_ptr<backend::Stream>> GpuDevice::CreateStream() {
  KILN_CUDA_CALL(cudaSetDevice(info_.ordinal));
  cudaStream_t s = nullptr;
  KILN_CUDA_CALL(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  StatusOr<std::unique_ptr<BlasHandle>> blas = BlasHandle::Create(s);
  if (!blas.ok()) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) spdlog::warn("{}: {}", name_, StatusMessage(blas.status()));
  }
  return std::unique_ptr<backend::Stream>(
      new GpuStream(this, s, blas.ok() ? *std::move(blas) : nullptr));
}

// ---- Kernels
// ---------------------------------------------------------------------------------------

bool GpuDevice::HasGemm(DType t) const { return BlasHandle::Supports(t); }

devk::KernelSlot* GpuDevice::Declare(std::string name, std::string source, int group) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = slots_.try_emplace(name);
  if (inserted) {
    it->second = std::make_unique<GpuKernelSlot>(std::move(name), std::move(source), group);
    pending_[group].push_back(it->second.get());
  } else {
    reused_.fetch_add(1, std::memory_order_relaxed);
  }
  return it->second.get();
}

devk::KernelSlot* GpuDevice::DeclareKernel(std::string_view prefix, std::string_view source) {
  std::string name = devk::TemplateKernelName(prefix, source);
  std::string src = devk::NameKernel(source, name);
  return Declare(std::move(name), std::move(src), kGenerated);
}

devk::KernelSlot* GpuDevice::DeclareGenerated(const compiler::GeneratedKernel& kernel) {
  return Declare(kernel.entry, kernel.code, kGenerated);
}

devk::KernelSlot* GpuDevice::LibraryKernel(std::string_view name) {
  return Declare(std::string(name), "", kLibrary);
}

#if !KILN_GPU_HIP
std::vector<std::string> NvrtcOptions() {
  // 161: OpenCL's #pragma in the shared prelude; 177/550: unused locals in templates.
  return {"-std=c++17", "-diag-suppress=161,177,550"};
}
#endif

namespace {

// The runtime compiler for this build: its version (part of the kernel cache's identity) and
// a compile of one program to a code object for `arch`.
#if KILN_GPU_HIP
StatusOr<std::string> CompilerVersion() {
  KILN_ASSIGN_OR_RETURN(const rocm::Hiprtc* hiprtc, rocm::Hiprtc::Load());
  return absl::StrCat("hiprtc ", hiprtc->version());
}
StatusOr<std::string> CompileProgram(const std::string& source, const std::string& arch) {
  KILN_ASSIGN_OR_RETURN(const rocm::Hiprtc* hiprtc, rocm::Hiprtc::Load());
  // cuda_compat.h's #pragma once is in the main file.
  return hiprtc->Compile(source, "kiln.hip", arch, {"-O3", "-Wno-pragma-once-outside-header"});
}
#else
StatusOr<std::string> CompilerVersion() {
  KILN_ASSIGN_OR_RETURN(const cuda::Nvrtc* nvrtc, cuda::Nvrtc::Load());
  return nvrtc->version();
}
StatusOr<std::string> CompileProgram(const std::string& source, const std::string& arch) {
  KILN_ASSIGN_OR_RETURN(const cuda::Nvrtc* nvrtc, cuda::Nvrtc::Load());
  return nvrtc->CompileToCubin(source, "kiln.cu", arch, NvrtcOptions());
}
#endif

}  // namespace

StatusOr<std::string> GpuDevice::Cubin(const std::string& source, bool* from_cache) {
  *from_cache = false;
  const std::string key = compiler::Sha256Hex(source);
  if (cache_ != nullptr) {
    StatusOr<std::string> hit = cache_->Get(cache_ns_, key);
    if (hit.ok()) {
      *from_cache = true;
      return hit;
    }
  }
  KILN_ASSIGN_OR_RETURN(std::string cubin, CompileProgram(source, info_.Arch()));
  if (cache_ != nullptr) {
    if (Status s = cache_->Put(cache_ns_, key, cubin); !s.ok()) {
      spdlog::warn("{}: cannot cache a kernel binary: {}", name_, StatusMessage(s));
    }
  }
  return cubin;
}

Status GpuDevice::BuildBatch(int group, std::vector<GpuKernelSlot*> batch) {
  if (batch.empty()) return OkStatus();
  KILN_CUDA_CALL(cudaSetDevice(info_.ordinal));
  void* lib_program = nullptr;
  if (group == kLibrary) {
    absl::MutexLock lock(&mu_);
    lib_program = library_program_;
  }
  rt::Module lib = static_cast<rt::Module>(lib_program);
  Status status = OkStatus();
  bool from_cache = false;
  const auto t0 = Clock::now();
  if (lib == nullptr) {
    std::vector<std::string> kernels;
    for (GpuKernelSlot* k : batch) kernels.push_back(k->source());
    const std::string source =
        devk::GpuProgramSource(kDialect, group == kLibrary, work_group(), kernels);
    if (const char* dump = std::getenv("KILN_GPU_DUMP_SOURCES"); dump != nullptr && *dump) {
      std::ofstream(absl::StrCat(dump, "/", compiler::Sha256Hex(source).substr(0, 16), ".cu"))
          << source;
    }
    StatusOr<std::string> cubin = Cubin(source, &from_cache);
    if (!cubin.ok()) {
      status = cubin.status();
    } else {
      const cudaError_t e = rt::LoadModule(&lib, cubin->data());
      if (e != cudaSuccess) status = CudaStatus(e, rt::kLoadModuleCall, __FILE__, __LINE__);
    }
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      libraries_.push_back(lib);
      if (group == kLibrary) library_program_ = lib;
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  for (GpuKernelSlot* k : batch) {
    if (!status.ok()) {
      k->Set(nullptr, status);
      continue;
    }
    rt::Function kernel = nullptr;
    const cudaError_t e = rt::GetKernel(&kernel, lib, k->name().c_str());
    k->Set(kernel, e == cudaSuccess
                       ? OkStatus()
                       : CudaStatus(e, absl::StrCat(rt::kGetKernelCall, "(", k->name(), ")"),
                                    __FILE__, __LINE__));
  }
  absl::MutexLock lock(&mu_);
  if (lib_program == nullptr) {
    ++(from_cache ? bstats_.programs_from_cache : bstats_.programs_built);
    bstats_.build_seconds += secs;
  }
  (from_cache ? bstats_.kernels_from_cache : bstats_.kernels_built) +=
      static_cast<int>(batch.size());
  return status;
}

Status GpuDevice::BuildPending() {
  std::lock_guard<std::mutex> build(build_mu_);
  for (int group : {kLibrary, kGenerated}) {
    std::vector<GpuKernelSlot*> batch;
    {
      absl::MutexLock lock(&mu_);
      batch.swap(pending_[group]);
    }
    KILN_RETURN_IF_ERROR(BuildBatch(group, std::move(batch)));
  }
  return OkStatus();
}

Status GpuDevice::EnsureBuilt(GpuKernelSlot* k) {
  if (!k->built()) KILN_RETURN_IF_ERROR(BuildPending());
  if (!k->built()) return Internal(kBackendName, ": kernel ", k->name(), " was not built");
  return k->status();
}

GpuDevice::BuildStats GpuDevice::build_stats() const {
  absl::MutexLock lock(&mu_);
  return bstats_;
}

compiler::FusionCaps GpuDevice::caps() const { return devk::DeviceFusionCaps(max_param_bytes()); }

Status GpuDevice::Prepare(std::span<const backend::KernelRequest> requests) {
  KILN_RETURN_IF_ERROR(devk::DeclareKernels(*this, requests));
  return BuildPending();
}

compiler::CompileCounters GpuDevice::counters() const {
  const BuildStats s = build_stats();
  compiler::CompileCounters c;
  c.compiled = s.kernels_built;
  c.cached = s.kernels_from_cache;
  c.reused = reused_.load(std::memory_order_relaxed);
  c.compiler_runs = s.programs_built;
  c.seconds = s.build_seconds;
  return c;
}

void* GpuDevice::GetExtension(std::string_view name) {
  if (name == compiler::kTargetExtension) return static_cast<compiler::Target*>(this);
  if (name == "gpu.device_info") return &info_;
  if (name == "gpu.sdpa_calls") return &sdpa_calls_;
  return nullptr;
}

// ---- Device and backend ----------------------------------------------------------------------

std::string DeviceInfo::Describe() const {
  return absl::StrCat(name, " (", Arch(), ", ", multiprocessors, " SMs, ", GiB(total_bytes),
                      ", driver ", driver_version / 1000, ".", driver_version % 1000 / 10, ")");
}

StatusOr<std::unique_ptr<GpuDevice>> GpuDevice::Create(int ordinal, const GpuOptions& options) {
  std::unique_ptr<GpuDevice> d(new GpuDevice());
  d->options_ = options;
  d->name_ = absl::StrCat(ToAbsl(kBackendName), ":", ordinal);
  DeviceInfo& info = d->info_;
  info.ordinal = ordinal;
  cudaDeviceProp prop{};
  KILN_CUDA_CALL(cudaGetDeviceProperties(&prop, ordinal));
  info.name = prop.name;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
#if KILN_GPU_HIP
  // "gfx90a:sramecc+:xnack-": hiprtc takes the processor name.
  info.arch = prop.gcnArchName;
  info.arch.resize(std::min(info.arch.size(), info.arch.find(':')));
#else
  info.arch = absl::StrCat("sm_", prop.major, prop.minor);
#endif
  info.total_bytes = prop.totalGlobalMem;
  KILN_CUDA_CALL(cudaDriverGetVersion(&info.driver_version));
  KILN_CUDA_CALL(cudaRuntimeGetVersion(&info.runtime_version));
  KILN_CUDA_CALL(cudaSetDevice(ordinal));
  KILN_CUDA_CALL(cudaFree(nullptr));  // creates the primary context now, not at first use
  d->codegen_.work_group_size = 256;
  if (const char* v = std::getenv("KILN_GPU_LINEAR_BLOCKS"); v != nullptr && *v == '1') {
    d->element_block_weights_ = false;
  }
  if (const char* v = std::getenv("KILN_GPU_LINEAR_SG"); v != nullptr && *v == '0') {
    d->linear_lanes_ = 0;
  }
  if (options.expandable_segments) {
    StatusOr<std::unique_ptr<ExpandableSegment>> seg =
        ExpandableSegment::Create(ordinal, info.total_bytes);
    if (seg.ok()) {
      d->segment_ = *std::move(seg);
      d->ranges_ = std::make_unique<RangeAllocator>(kSegmentAlignment);
      spdlog::info("{}: expandable segment of {:.1f} GiB addresses, pages of {} KiB", d->name_,
                   d->segment_->reserved() / 1073741824.0, d->segment_->granularity() >> 10);
    } else {
      spdlog::warn("{}: {}; allocating with cudaMalloc", d->name_, StatusMessage(seg.status()));
    }
  }
  if (options.cache_dir != "none") {
    KILN_ASSIGN_OR_RETURN(const std::string compiler_version, CompilerVersion());
    d->cache_ = std::make_unique<compiler::DiskCache>(options.cache_dir);
    d->cache_ns_ = absl::StrCat(
        ToAbsl(kBackendName), "-",
        compiler::Sha256Hex(absl::StrCat("kiln-", ToAbsl(kBackendName), "-v1\n", compiler_version,
                                         "\n", info.Arch(), "\n", d->work_group()))
            .substr(0, 16));
  }
  return d;
}

GpuDevice::~GpuDevice() {
  (void)cudaSetDevice(info_.ordinal);
  (void)cudaDeviceSynchronize();
  {
    absl::MutexLock lock(&mu_);
    for (void* lib : libraries_) (void)rt::UnloadModule(static_cast<rt::Module>(lib));
  }
  std::lock_guard<std::mutex> lock(alloc_mu_);
  if (segment_ != nullptr) {
    ranges_.reset();
    segment_.reset();  // unmaps every page
    return;
  }
  for (auto& [size, p] : free_) (void)cudaFree(p);
  for (auto& [size, p] : parked_) (void)cudaFree(p);
}

StatusOr<std::unique_ptr<GpuBackend>> CreateGpuBackend(const GpuOptions& given) {
#if KILN_GPU_HIP
  static constexpr const char* kDevicesEnv = "KILN_HIP_DEVICES";
  static constexpr const char* kSegmentsEnv = "KILN_HIP_EXPANDABLE_SEGMENTS";
  static constexpr const char* kVendor = "HIP";
#else
  static constexpr const char* kDevicesEnv = "KILN_CUDA_DEVICES";
  static constexpr const char* kSegmentsEnv = "KILN_CUDA_EXPANDABLE_SEGMENTS";
  static constexpr const char* kVendor = "CUDA";
#endif
  GpuOptions options = given;
  if (const char* v = std::getenv(kSegmentsEnv); v != nullptr) {
    options.expandable_segments = std::string_view(v) == "1";
  }
  if (const char* v = std::getenv(kDevicesEnv); v != nullptr && std::string(v) == "none") {
    return Unavailable("the ", kBackendName, " backend is disabled (", kDevicesEnv, "=none)");
  }
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return CudaStatus(e, rt::kDeviceCountCall, __FILE__, __LINE__);
  }
  if (count == 0) return Unavailable("no ", kVendor, " device");
  if (StatusOr<std::string> compiler = CompilerVersion(); !compiler.ok()) {
    // A machine with a GPU and no runtime compiler is misconfigured, not one without a GPU.
    return FailedPrecondition(count, " ", kVendor, " device(s), but ",
                              StatusMessage(compiler.status()));
  }
  spdlog::info("{}: {} device(s), opened at first use", kBackendName, count);
  return std::make_unique<GpuBackend>(count, options);
}

GpuBackend::GpuBackend(int device_count, GpuOptions options)
    : count_(device_count),
      options_(std::move(options)),
      devices_(static_cast<size_t>(device_count)),
      failures_(static_cast<size_t>(device_count)) {}

StatusOr<backend::Device*> GpuBackend::Open(int index) {
  if (index < 0 || index >= count_) {
    return NotFound("backend '", kBackendName, "' has ", count_, " device(s); no index ", index);
  }
  absl::MutexLock lock(&mu_);
  const size_t i = static_cast<size_t>(index);
  if (devices_[i] != nullptr) return devices_[i].get();
  KILN_RETURN_IF_ERROR(failures_[i]);  // a device that failed to open is not retried
  StatusOr<std::unique_ptr<GpuDevice>> d = GpuDevice::Create(index, options_);
  if (!d.ok()) {
    failures_[i] =
        Status(d.status().code(),
               absl::StrCat(ToAbsl(kBackendName), ":", index,
                            " could not be opened: ", ToAbsl(StatusMessage(d.status()))));
    spdlog::error("{}", StatusMessage(failures_[i]));
    return failures_[i];
  }
  spdlog::info("{}:{}: {}", kBackendName, index, (*d)->info().Describe());
  devices_[i] = *std::move(d);
  return devices_[i].get();
}

backend::Device* GpuBackend::device(int index) {
  StatusOr<backend::Device*> d = Open(index);
  return d.ok() ? *d : nullptr;
}

bool GpuBackend::opened(int index) const {
  absl::MutexLock lock(&mu_);
  return index >= 0 && index < count_ && devices_[static_cast<size_t>(index)] != nullptr;
}

}  // namespace kiln::gpu
