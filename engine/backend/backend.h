// The backend interface, split by lifetime (ggml-backend style):
//
//   Backend   a registry entry for a device family ("ref", "cpu", "cuda"); owns its devices
//   Device    one accelerator: allocates buffers, compiles kernels, creates streams
//   Stream    an ordered queue: runs launch lists, copies, events, optional graph capture
//   Buffer    a device allocation; freed when its owner drops it
//
// The engine compiles a graph into a Program against a Device (asking GetKernel for each
// node) and runs it on a Stream. Optional capabilities return Unimplemented / false by
// default; backend-specific extras go through GetExtension(name), never a wider interface.
// A backend is an allocator, a kernel provider and a launcher — keep it small.
//
// Ownership: the registry owns Backends, a Backend owns its Devices (stable pointers for the
// process lifetime), callers own Streams and Buffers (unique_ptr; a Buffer must not outlive
// its Device). Thread-safety: Backend and Device methods are thread-safe; a Stream is used
// by one thread at a time.
//
// Plugins implement these classes in a shared library (see plugin_abi.h). Every method is
// defined inline here so a plugin needs no symbols from the host; bump
// kBackendInterfaceVersion whenever this header or kernel_abi.h changes layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "engine/backend/kernel_abi.h"
#include "engine/base/status.h"
#include "engine/ops.h"

namespace kiln::backend {

// 3: LaunchArgs::extra_outputs (multi-output nodes), in-place writes beyond kv_write.
// 4: ExecCtx::shares_in_sequence.
// 5: Backend::Open and Backend::opened (devices opened on first use).
inline constexpr uint32_t kBackendInterfaceVersion = 5;
// Every Allocate() result is aligned to at least this many bytes.
inline constexpr size_t kMinAlignment = 64;

class Device;
class Stream;

class Buffer {
 public:
  virtual ~Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // The device address (a host pointer when device().host_visible()).
  void* data() const { return data_; }
  size_t size() const { return size_; }
  Device& device() const { return *device_; }

 protected:
  Buffer(Device* device, void* data, size_t size) : device_(device), data_(data), size_(size) {}

 private:
  Device* device_;
  void* data_;
  size_t size_;
};

// Plain host memory as a Buffer of `device` (the default pinned host buffer, see
// Device::AllocatePinnedHost). data() is a host pointer.
class HostMemoryBuffer final : public Buffer {
 public:
  static std::unique_ptr<Buffer> Make(Device* device, size_t bytes) {
    const size_t rounded = (bytes + kMinAlignment - 1) / kMinAlignment * kMinAlignment;
    void* p = std::aligned_alloc(kMinAlignment, rounded == 0 ? kMinAlignment : rounded);
    if (p == nullptr) return nullptr;
    return std::unique_ptr<Buffer>(new HostMemoryBuffer(device, p, bytes));
  }
  ~HostMemoryBuffer() override { std::free(data()); }

 private:
  HostMemoryBuffer(Device* device, void* data, size_t size) : Buffer(device, data, size) {}
};

// A point in a stream's work. Recorded on one stream, it may be waited on by the host
// (Wait/Done) or by another stream of the same device (Stream::WaitEvent), which then runs
// nothing enqueued after the wait until the work before the event is done.
class Event {
 public:
  virtual ~Event() = default;
  virtual Status Wait() = 0;  // blocks the host until the work before the event is done
  virtual bool Done() = 0;
};

// Work recorded from a stream by BeginCapture/EndCapture, replayable as a unit.
class ExecGraph {
 public:
  virtual ~ExecGraph() = default;
  // REQUIRES: `stream` belongs to the device the graph was captured on.
  virtual Status Replay(Stream& stream) = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device& device() = 0;

  // Runs the launches in order (asynchronously on device backends; host backends may
  // finish before returning). While capturing, records them instead (copying `args`).
  virtual Status Run(std::span<const Launch> launches) = 0;
  virtual Status CopyToDevice(const Buffer& dst, size_t dst_offset, const void* src,
                              size_t bytes) = 0;
  virtual Status CopyToHost(void* dst, const Buffer& src, size_t src_offset, size_t bytes) = 0;
  virtual Status CopyOnDevice(const Buffer& dst, size_t dst_offset, const Buffer& src,
                              size_t src_offset, size_t bytes) = 0;
  // Blocks until everything enqueued has finished.
  virtual Status Synchronize() = 0;

  // Copies in stream order. CopyToDevice/CopyToHost above are *blocking*: `src` may be reused
  // (and `dst` read) as soon as they return. These are *asynchronous*: the copy happens when
  // the stream reaches it, so `src` must stay valid and unchanged, and `dst` must not be
  // read, until the stream has passed this point — after Synchronize(), or once an event
  // recorded after the copy is done. They are truly asynchronous from and to pinned host
  // memory (Device::AllocatePinnedHost); from pageable memory a backend may stage or block.
  // Default: the blocking copy (complete when it returns, which satisfies the contract).
  virtual Status CopyToDeviceAsync(const Buffer& dst, size_t dst_offset, const void* src,
                                   size_t bytes) {
    return CopyToDevice(dst, dst_offset, src, bytes);
  }
  virtual Status CopyToHostAsync(void* dst, const Buffer& src, size_t src_offset, size_t bytes) {
    return CopyToHost(dst, src, src_offset, bytes);
  }

  // Events (see Event). RecordEvent marks everything enqueued so far; WaitEvent makes this
  // stream wait for an event recorded on any stream of the same device, without blocking
  // the host where the backend can. Default events: synchronize now and hand back a
  // completed event; WaitEvent blocks the host until the event is done.
  virtual StatusOr<std::unique_ptr<Event>> RecordEvent() {
    KILN_RETURN_IF_ERROR(Synchronize());
    struct Completed final : Event {
      Status Wait() override { return OkStatus(); }
      bool Done() override { return true; }
    };
    return std::unique_ptr<Event>(new Completed());
  }
  virtual Status WaitEvent(Event& event) { return event.Wait(); }

  // Optional graph capture (CUDA/HIP graphs, OpenCL command buffers, recorded launch lists).
  virtual bool SupportsCapture() const { return false; }
  virtual Status BeginCapture() { return Unimplemented("this stream cannot capture graphs"); }
  virtual StatusOr<std::unique_ptr<ExecGraph>> EndCapture() {
    return Unimplemented("this stream cannot capture graphs");
  }
};

// What the engine asks a device to run: one node, with input/output types. Shapes may be
// symbolic; concrete sizes arrive in TensorArg at run time. `output` is output 0; the types
// of a multi-output node's other outputs follow from the op table (InferOutputs in ops.h).
struct KernelRequest {
  OpKind op = OpKind::kInput;
  const Attrs* attrs = nullptr;
  std::span<const TensorType> inputs;
  TensorType output;
  std::string_view name;  // the node's name, for diagnostics
};

// Memory of a device, in bytes. `free_bytes` is what the backend can tell: the driver's figure
// on GPUs, MemAvailable for host memory, or the total minus what this process allocated.
struct DeviceMemoryInfo {
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
};

// What a device's caching allocator holds, for metrics (kiln_device_memory_*).
struct DeviceAllocatorStats {
  uint64_t reserved_bytes = 0;        // taken from the driver: in live buffers + cached
  uint64_t allocated_bytes = 0;       // in live buffers
  uint64_t peak_allocated_bytes = 0;  // the most allocated_bytes has been
  int64_t segments = 0;               // driver allocations held
};

struct Kernel {
  KernelFn fn = nullptr;
  std::shared_ptr<const void> data;  // passed as LaunchArgs::kernel_data; kept by the Program
  std::string name;                  // "ref.rms_norm", for dumps and profiles
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string_view name() const = 0;  // "cpu:0"
  // True if Buffer::data() is a host pointer the CPU may read and write.
  virtual bool host_visible() const { return false; }

  // Allocates `bytes` (aligned to kMinAlignment). ResourceExhausted when out of memory.
  virtual StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) = 0;
  // Uses host memory in place (e.g. an mmap'd weight file); `keepalive` is held by the
  // buffer. Optional.
  virtual StatusOr<std::unique_ptr<Buffer>> WrapHostMemory(void* data, size_t bytes,
                                                           std::shared_ptr<void> keepalive) {
    (void)data, (void)bytes, (void)keepalive;
    return Unimplemented(std::string(name()), " cannot wrap host memory");
  }
  // Host memory the device copies to and from fastest, asynchronously (CUDA/HIP page-locked
  // memory). data() is a host pointer; pass it as the host side of Stream copies, never as a
  // kernel argument unless host_visible(). Default: ordinary aligned host memory.
  virtual StatusOr<std::unique_ptr<Buffer>> AllocatePinnedHost(size_t bytes) {
    std::unique_ptr<Buffer> b = HostMemoryBuffer::Make(this, bytes);
    if (b == nullptr) return ResourceExhausted("cannot allocate ", bytes, " bytes of host memory");
    return b;
  }
  // Total and free device memory (see DeviceMemoryInfo). Default: Unimplemented.
  virtual StatusOr<DeviceMemoryInfo> MemoryInfo() {
    return Unimplemented(std::string(name()), " cannot report its memory");
  }
  // Its allocator's figures; nullopt where it keeps none (host memory). Thread-safe.
  virtual std::optional<DeviceAllocatorStats> AllocatorStatistics() const { return std::nullopt; }
  virtual StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;

  // Capability queries.
  virtual bool SupportsDType(DType t) const = 0;
  // A kernel for the request, or Unimplemented if this device does not run that op with
  // those types (the compiler then reports the node and the device).
  virtual StatusOr<Kernel> GetKernel(const KernelRequest& request) = 0;

  // Backend-specific extras by name (e.g. "cuda.cublas_handle"); null if unknown.
  virtual void* GetExtension(std::string_view name) {
    (void)name;
    return nullptr;
  }
};

// Device extension (a non-null marker): the device's matmul takes a 2-D right operand of
// another type than its left (f16/bf16 or block-quantized, autograd's dx = g w for a frozen
// weight) as it is. Without it, kiln::Compile casts that operand first (pass cast_matmul_rhs).
inline constexpr std::string_view kMatMulMixedRhsExtension = "kiln.matmul_mixed_rhs";

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;  // "cpu", "ref", "cuda"
  virtual int device_count() const = 0;
  // REQUIRES: 0 <= index < device_count(). Owned by the backend. A backend whose devices open
  // on first use (a GPU's context costs hundreds of MB) opens it here, and returns null (and
  // logs why) when it cannot; Open says why.
  virtual Device* device(int index) = 0;
  // The device, opened if need be; NotFound for an index out of range, the reason a device
  // that exists could not be opened.
  virtual StatusOr<Device*> Open(int index) {
    if (index < 0 || index >= device_count()) {
      return NotFound("backend '", ToAbsl(name()), "' has ", device_count(),
                      " device(s); no index ", index);
    }
    return device(index);
  }
  // False while device `index` exists but has not been opened: what reports on every device
  // (metrics) skips it rather than open it.
  virtual bool opened(int index) const {
    (void)index;
    return true;
  }
  virtual void* GetExtension(std::string_view name) {
    (void)name;
    return nullptr;
  }
};

}  // namespace kiln::backend
