// The OpenCL ("xpu") backend's device, stream and buffers, and the plumbing its kernels use.
//
// One XpuDevice per OpenCL device: its own context, buffers, programs and kernels. Buffers are
// cl_mem objects; because kernels receive plain addresses (engine/backend/kernel_abi.h), every
// buffer gets an opaque device address `tag | id << 40 | offset` that kernels resolve back to
// (cl_mem, byte offset) — pointer arithmetic on it works like on a real device pointer, the
// host never dereferences it (host_visible() is false). Buffers are limited to 1 TiB.
//
// Streams are in-order command queues. Copies to and from the host are blocking (the host
// memory may be reused as soon as the call returns); launches and device-to-device copies
// are asynchronous. Graph capture records launches into cl_khr_command_buffer command
// buffers when the device has the extension (library calls that cannot be recorded, such
// as CLBlast GEMMs, become replayed host steps between command buffers), and is otherwise
// left to the engine's recorded launch lists.
//
// Kernels: generated and templated OpenCL C is declared with DeclareKernel and built lazily
// at its first launch, together with every other kernel declared but not yet built (one
// clBuildProgram per batch: building is expensive, per kernel it dominates start-up). The
// hand-written library (cl/library.cl) is one more program. Program binaries are cached on
// disk (BinaryCache) keyed by source, build options and device/driver identity, so a second
// start builds nothing. PoCL is the exception: asking it for a binary makes it compile every
// kernel for any work-group size (tens of seconds for kernels with barriers in loops), while
// its own kernel cache keeps exactly what was built and compiled at first launch, under the
// same kind of key. On PoCL the backend therefore leaves caching to PoCL and points PoCL's
// cache into the kernel cache directory ($KILN_CACHE_DIR/pocl, unless POCL_CACHE_DIR is set).
//
// Thread-safety: XpuDevice is thread-safe. An XpuStream is used by one thread at a time.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "backends/xpu/cl_check.h"
#include "engine/backend/backend.h"

namespace kiln::xpu {

// What the backend knows about an OpenCL device (queried once, at selection).
struct DeviceInfo {
  int platform_index = 0;
  int device_index = 0;
  std::string platform_name;
  std::string platform_version;
  std::string name;
  std::string vendor;
  std::string version;         // "OpenCL 3.0 NEO"
  std::string driver_version;  // "23.35.27191"
  std::string opencl_c_version;
  std::string extensions;
  cl_device_type type = CL_DEVICE_TYPE_DEFAULT;
  uint32_t compute_units = 0;
  size_t max_work_group_size = 0;
  uint64_t global_mem_bytes = 0;
  uint64_t max_alloc_bytes = 0;
  uint64_t local_mem_bytes = 0;
  size_t max_param_bytes = 0;
  int opencl_major = 1, opencl_minor = 2;
  bool fp16 = false;            // cl_khr_fp16: half arithmetic (storage never needs it)
  bool fp64 = false;            // cl_khr_fp64
  bool command_buffer = false;  // cl_khr_command_buffer
  bool command_buffer_simultaneous = false;
  bool available = false;
  bool compiler_available = false;

  bool HasExtension(std::string_view ext) const;
  const char* KindName() const;  // "GPU", "accelerator", "CPU"
  // "Intel(R) Arc(TM) A770 (GPU, Intel(R) OpenCL Graphics, OpenCL 3.0 NEO, driver 23.35,
  //  512 CUs, 16.0 GiB, fp16 fp64 command-buffer)"
  std::string Describe() const;
  // Why the backend cannot use this device, or empty if it can.
  std::string Unusable() const;
};

struct Candidate {
  cl_platform_id platform = nullptr;
  cl_device_id device = nullptr;
  DeviceInfo info;
};

// Every OpenCL device of every platform (empty when no ICD or platform is installed).
StatusOr<std::vector<Candidate>> EnumerateDevices();

// The devices the backend uses, best first: usable GPUs, then accelerators, then CPUs
// (platform order within a kind). `override_spec` ("<platform>:<device>", the indices
// clinfo -l shows; from KILN_XPU_DEVICE) picks exactly one device instead; an override that
// names no device or an unusable one is an error.
StatusOr<std::vector<Candidate>> SelectDevices(std::vector<Candidate> all,
                                               std::string_view override_spec);

// Per-device knobs (tests use them to exercise the paths other hardware takes).
struct XpuOptions {
  bool disable_fp64 = false;            // behave as a device without cl_khr_fp64
  bool disable_command_buffer = false;  // capture falls back to the engine's recording
  // Program binary cache directory: empty = the default (BinaryCache::DefaultDir()),
  // "none" = no disk cache.
  std::string cache_dir;
  // Store program binaries even where the driver caches itself (PoCL): tests of the cache.
  bool force_binary_cache = false;
};

// Points PoCL's kernel cache at <cache dir>/pocl unless POCL_CACHE_DIR is set. PoCL reads it
// once, when OpenCL is first used in the process; CreateXpuBackend calls this first.
void PlacePoclCache(const std::string& cache_dir);

// Program binaries on disk, one file per (device identity, build options, source), written
// atomically (temporary file + rename) so concurrent processes never see partial files.
class BinaryCache {
 public:
  // `dir` empty: disabled.
  explicit BinaryCache(std::string dir) : dir_(std::move(dir)) {}
  // $KILN_CACHE_DIR/opencl, else $XDG_CACHE_HOME/kiln/opencl, else ~/.cache/kiln/opencl;
  // empty if none of these can be determined.
  static std::string DefaultDir();
  bool enabled() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  // The binary stored under exactly `key`, or empty.
  std::vector<unsigned char> Load(std::string_view key) const;
  Status Store(std::string_view key, const std::vector<unsigned char>& binary) const;

 private:
  std::string PathFor(std::string_view key) const;
  std::string dir_;
};

class XpuDevice;
class Recording;
struct ProgramUnit;

// One OpenCL kernel function in a (lazily built) program. Owned by its device; pointers stay
// valid for the device's lifetime.
class KernelSlot {
 public:
  const std::string& name() const { return name_; }

 private:
  friend class XpuDevice;
  friend struct Exec;
  std::string name_;
  std::string source_;  // the kernel's own source (empty for library kernels)
  int group_ = 0;
  std::atomic<ProgramUnit*> unit_{nullptr};  // set once built
  cl_kernel kernel_ = nullptr;
  std::mutex mu_;  // clSetKernelArg + enqueue are not thread-safe per cl_kernel
};

// Kernel arguments in the one calling convention every xpu kernel uses:
//   (__global uchar* buf0, ..., __global uchar* bufN-1, const metaM m)
// — the cl_mem of each tensor, then a struct of M longs (byte offsets, sizes, strides).
class ClArgs {
 public:
  static constexpr int kMaxMems = 24;
  static constexpr int kMaxMeta = 120;
  // The meta struct sizes the prelude declares (meta8 ... meta120); the smallest that holds n.
  static int MetaSize(int n);

  // Adds the buffer behind device address `p` as the next buffer argument and returns the
  // byte offset of `p` within it. On a bad address records an error (see ok()).
  int64_t Mem(const XpuDevice& dev, const void* p);
  void Long(int64_t v);
  // Appends a tensor descriptor (prelude.cl's TD: 18 longs: byte offset, rank, shape[8],
  // strides[8]) of `t`, whose buffer was added with Mem() and returned `byte_offset`.
  void Desc(const TensorArg& t, int64_t byte_offset);
  int num_meta() const { return nmeta_; }
  bool ok() const { return ok_; }

 private:
  friend struct Exec;
  friend class Recording;
  std::array<cl_mem, kMaxMems> mems_{};
  std::array<int64_t, kMaxMeta> meta_{};
  int nmems_ = 0;
  int nmeta_ = 0;
  bool ok_ = true;
};

// What XpuStream::Run hands kernels as ExecCtx::native_stream.
struct Exec {
  XpuDevice* device = nullptr;
  cl_command_queue queue = nullptr;
  Recording* capture = nullptr;  // non-null while capturing
  Status status;                 // the first error of the current Run

  void Fail(const Status& s) {
    if (status.ok()) status = s;
  }
  // Launches (or records) `k` over `dims` dimensions. `meta_size`: the kernel's declared
  // metaM (0: ClArgs::MetaSize(num_meta)). Zero-sized launches are skipped.
  void Enqueue(KernelSlot* k, const ClArgs& args, int dims, const size_t* global,
               const size_t* local, int meta_size = 0);
  // For library calls that cannot be recorded into a command buffer (CLBlast): while
  // capturing, records the launch to be re-run at replay and returns true (the caller does
  // nothing more); otherwise returns false.
  bool DeferWhileCapturing(KernelFn fn, const LaunchArgs& args);
};

class XpuDevice final : public backend::Device {
 public:
  // Takes the device; creates its context. Use Create().
  static StatusOr<std::unique_ptr<XpuDevice>> Create(const Candidate& c, int ordinal,
                                                     const XpuOptions& options = {});
  ~XpuDevice() override;

  // ---- backend::Device ----
  std::string_view name() const override { return name_; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t bytes) override;
  StatusOr<std::unique_ptr<backend::Buffer>> WrapHostMemory(
      void* data, size_t bytes, std::shared_ptr<void> keepalive) override;
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override;
  // Total: CL_DEVICE_GLOBAL_MEM_SIZE; free: the total minus this device's live allocations.
  StatusOr<backend::DeviceMemoryInfo> MemoryInfo() override;
  bool SupportsDType(DType t) const override;
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& request) override;
  // "xpu.device_info" -> const DeviceInfo*; "xpu.cl_context" -> cl_context;
  // "xpu.cl_device" -> cl_device_id.
  void* GetExtension(std::string_view name) override;

  // ---- For kernels and tests ----
  const DeviceInfo& info() const { return info_; }
  bool fp64() const { return fp64_; }
  bool command_buffer() const { return command_buffer_; }
  cl_context context() const { return context_; }
  cl_device_id device_id() const { return device_; }
  cl_platform_id platform() const { return platform_; }
  // The work-group size of every xpu kernel on this device (KILN_WG in the sources).
  size_t work_group() const { return wg_; }
  // cl_mem and byte offset behind a device address of this device; false if it is not one.
  bool Resolve(const void* p, cl_mem* mem, size_t* offset) const;

  enum Group { kGenerated = 0, kLibrary = 1 };
  // Declares a kernel whose source defines `__kernel void KNAME(...)`; KNAME is replaced by a
  // name derived from `prefix` and a hash of the source. The same source gives the same
  // slot. Not built until its first launch (or Build()).
  KernelSlot* DeclareKernel(std::string_view prefix, std::string_view source);
  // A kernel of the hand-written library (cl/library.cl).
  KernelSlot* LibraryKernel(std::string_view name);
  // Builds `k`'s program (with every other pending kernel of its group) if not built yet.
  Status EnsureBuilt(KernelSlot* k);
  // Builds every pending kernel now (e.g. after compiling all of a model's programs).
  Status BuildPending();
  // A dedicated cl_kernel for recording one command (command buffers read kernel arguments
  // when they execute, so a recorded command needs a kernel nobody else sets arguments on).
  StatusOr<cl_kernel> NewKernelObject(KernelSlot* k);

  struct Stats {
    int programs_built_from_source = 0;
    int programs_loaded_from_cache = 0;
    int kernels_built = 0;
    double build_seconds = 0;
  };
  Stats stats() const;
  // An internal queue for uploads made while compiling (rope tables); blocking writes only.
  Status Upload(cl_mem mem, size_t offset, const void* src, size_t bytes);

  // Device addresses: tag | id << 40 | offset.
  static constexpr uint64_t kAddressTag = 1ull << 62;
  static constexpr int kOffsetBits = 40;
  static constexpr uint32_t kMaxBuffers = 1u << 20;

 private:
  XpuDevice() = default;
  friend class XpuBuffer;
  uint32_t RegisterMem(cl_mem mem);
  void UnregisterMem(uint32_t id);
  std::string BuildOptions() const;
  std::string Prelude() const;
  std::string CacheIdentity() const;
  Status BuildBatch(int group, std::vector<KernelSlot*> batch);
  StatusOr<cl_program> BuildProgram(const std::string& source, bool* from_cache,
                                    std::string* cache_key);

  std::string name_;
  DeviceInfo info_;
  XpuOptions options_;
  bool fp64_ = false;
  bool command_buffer_ = false;
  size_t wg_ = 64;
  bool store_binaries_ = true;  // false where the driver caches compiled code itself
  cl_platform_id platform_ = nullptr;
  cl_device_id device_ = nullptr;
  cl_context context_ = nullptr;
  cl_command_queue upload_queue_ = nullptr;
  std::mutex upload_mu_;
  std::unique_ptr<BinaryCache> cache_;
  std::atomic<uint64_t> allocated_bytes_{0};  // live Allocate() bytes (XpuBuffer keeps it)

  // Address table: two levels of atomics so Resolve() takes no lock.
  static constexpr int kChunkBits = 10;
  std::unique_ptr<std::atomic<cl_mem>[]> chunks_[kMaxBuffers >> kChunkBits];
  std::mutex ids_mu_;
  std::vector<uint32_t> free_ids_;
  uint32_t next_id_ = 1;

  // Kernels and programs.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<KernelSlot>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<KernelSlot*> pending_[2] ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<ProgramUnit>> units_ ABSL_GUARDED_BY(mu_);
  std::mutex build_mu_;  // one build at a time (held while building; not under mu_)
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

// The backend: every selected device (xpu:0 is the preferred one).
class XpuBackend final : public backend::Backend {
 public:
  explicit XpuBackend(std::vector<std::unique_ptr<XpuDevice>> devices)
      : devices_(std::move(devices)) {}
  std::string_view name() const override { return "xpu"; }
  int device_count() const override { return static_cast<int>(devices_.size()); }
  backend::Device* device(int index) override {
    return index >= 0 && index < device_count() ? devices_[index].get() : nullptr;
  }

 private:
  std::vector<std::unique_ptr<XpuDevice>> devices_;
};

// Builds the backend from the selected devices (KILN_XPU_DEVICE honoured). NotFound when no
// usable device exists; the error says what was found and why it is not usable.
StatusOr<std::unique_ptr<XpuBackend>> CreateXpuBackend(const XpuOptions& options = {});

}  // namespace kiln::xpu
