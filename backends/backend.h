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
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "engine/base/status.h"
#include "engine/kernel_abi.h"
#include "engine/ops.h"

namespace kiln::backend {

inline constexpr uint32_t kBackendInterfaceVersion = 1;
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

class Event {
 public:
  virtual ~Event() = default;
  virtual Status Wait() = 0;  // blocks until the work before the event is done
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

  // Default events: synchronize now and hand back a completed event.
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
// symbolic; concrete sizes arrive in TensorArg at run time.
struct KernelRequest {
  OpKind op = OpKind::kInput;
  const Attrs* attrs = nullptr;
  std::span<const TensorType> inputs;
  TensorType output;
  std::string_view name;  // the node's name, for diagnostics
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

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;  // "cpu", "ref", "cuda"
  virtual int device_count() const = 0;
  // REQUIRES: 0 <= index < device_count(). Owned by the backend.
  virtual Device* device(int index) = 0;
  virtual void* GetExtension(std::string_view name) {
    (void)name;
    return nullptr;
  }
};

}  // namespace kiln::backend
