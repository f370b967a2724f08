#include "backends/xpu/xpu_device.h"

#include <clblast.h>
#include <clblast_half.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "backends/common/cl_sources.h"
#include "engine/compiler/hash.h"
#include "engine/ops.h"
#include "spdlog/spdlog.h"

namespace kiln::xpu {
namespace {

using Clock = std::chrono::steady_clock;

// True on a thread inside XpuDevice::Prepare: kernels found already declared count as reused.
thread_local bool tl_preparing = false;

// ---- Queries ------------------------------------------------------------------------------------

std::string DeviceString(cl_device_id d, cl_device_info param) {
  size_t n = 0;
  if (clGetDeviceInfo(d, param, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  if (clGetDeviceInfo(d, param, n, s.data(), nullptr) != CL_SUCCESS) return "";
  while (!s.empty() && (s.back() == '\0' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string PlatformString(cl_platform_id p, cl_platform_info param) {
  size_t n = 0;
  if (clGetPlatformInfo(p, param, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  if (clGetPlatformInfo(p, param, n, s.data(), nullptr) != CL_SUCCESS) return "";
  while (!s.empty() && (s.back() == '\0' || s.back() == ' ')) s.pop_back();
  return s;
}

template <typename T>
T DeviceValue(cl_device_id d, cl_device_info param) {
  T v{};
  if (clGetDeviceInfo(d, param, sizeof(T), &v, nullptr) != CL_SUCCESS) return T{};
  return v;
}

// "OpenCL 3.0 NEO" -> (3, 0).
void ParseVersion(const std::string& v, int* major, int* minor) {
  int a = 1, b = 0;
  if (std::sscanf(v.c_str(), "OpenCL %d.%d", &a, &b) == 2) {
    *major = a;
    *minor = b;
  }
}

DeviceInfo QueryDevice(cl_platform_id p, cl_device_id d) {
  DeviceInfo i;
  i.platform_name = PlatformString(p, CL_PLATFORM_NAME);
  i.platform_version = PlatformString(p, CL_PLATFORM_VERSION);
  i.name = DeviceString(d, CL_DEVICE_NAME);
  i.vendor = DeviceString(d, CL_DEVICE_VENDOR);
  i.version = DeviceString(d, CL_DEVICE_VERSION);
  i.driver_version = DeviceString(d, CL_DRIVER_VERSION);
  i.opencl_c_version = DeviceString(d, CL_DEVICE_OPENCL_C_VERSION);
  i.extensions = DeviceString(d, CL_DEVICE_EXTENSIONS);
  i.type = DeviceValue<cl_device_type>(d, CL_DEVICE_TYPE);
  i.compute_units = DeviceValue<cl_uint>(d, CL_DEVICE_MAX_COMPUTE_UNITS);
  i.max_work_group_size = DeviceValue<size_t>(d, CL_DEVICE_MAX_WORK_GROUP_SIZE);
  i.global_mem_bytes = DeviceValue<cl_ulong>(d, CL_DEVICE_GLOBAL_MEM_SIZE);
  i.max_alloc_bytes = DeviceValue<cl_ulong>(d, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
  i.local_mem_bytes = DeviceValue<cl_ulong>(d, CL_DEVICE_LOCAL_MEM_SIZE);
  i.max_param_bytes = DeviceValue<size_t>(d, CL_DEVICE_MAX_PARAMETER_SIZE);
  i.available = DeviceValue<cl_bool>(d, CL_DEVICE_AVAILABLE) != 0;
  i.compiler_available = DeviceValue<cl_bool>(d, CL_DEVICE_COMPILER_AVAILABLE) != 0;
  ParseVersion(i.version, &i.opencl_major, &i.opencl_minor);
  i.fp16 = i.HasExtension("cl_khr_fp16");
  i.fp64 = i.HasExtension("cl_khr_fp64");
  i.command_buffer = i.HasExtension("cl_khr_command_buffer");
  if (i.command_buffer) {
    const auto caps = DeviceValue<cl_device_command_buffer_capabilities_khr>(
        d, CL_DEVICE_COMMAND_BUFFER_CAPABILITIES_KHR);
    i.command_buffer_simultaneous = (caps & CL_COMMAND_BUFFER_CAPABILITY_SIMULTANEOUS_USE_KHR) != 0;
  }
  return i;
}

int KindRank(cl_device_type t) {
  if (t & CL_DEVICE_TYPE_GPU) return 0;
  if (t & CL_DEVICE_TYPE_ACCELERATOR) return 1;
  return 2;
}

// ---- Command buffers (cl_khr_command_buffer, loaded per platform) -------------------------------

struct CommandBufferApi {
  clCreateCommandBufferKHR_fn create = nullptr;
  clFinalizeCommandBufferKHR_fn finalize = nullptr;
  clReleaseCommandBufferKHR_fn release = nullptr;
  clEnqueueCommandBufferKHR_fn enqueue = nullptr;
  clCommandNDRangeKernelKHR_fn ndrange = nullptr;
  clCommandCopyBufferKHR_fn copy = nullptr;
  bool Load(cl_platform_id p) {
    auto get = [&](const char* name) { return clGetExtensionFunctionAddressForPlatform(p, name); };
    create = reinterpret_cast<clCreateCommandBufferKHR_fn>(get("clCreateCommandBufferKHR"));
    finalize = reinterpret_cast<clFinalizeCommandBufferKHR_fn>(get("clFinalizeCommandBufferKHR"));
    release = reinterpret_cast<clReleaseCommandBufferKHR_fn>(get("clReleaseCommandBufferKHR"));
    enqueue = reinterpret_cast<clEnqueueCommandBufferKHR_fn>(get("clEnqueueCommandBufferKHR"));
    ndrange = reinterpret_cast<clCommandNDRangeKernelKHR_fn>(get("clCommandNDRangeKernelKHR"));
    copy = reinterpret_cast<clCommandCopyBufferKHR_fn>(get("clCommandCopyBufferKHR"));
    return create && finalize && release && enqueue && ndrange && copy;
  }
};

const CommandBufferApi& CbApi(cl_platform_id p) {
  // One platform in practice; loaded on first use per platform.
  static std::mutex mu;
  static std::vector<std::pair<cl_platform_id, CommandBufferApi>>* apis =
      new std::vector<std::pair<cl_platform_id, CommandBufferApi>>();
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [plat, api] : *apis) {
    if (plat == p) return api;
  }
  CommandBufferApi api;
  if (!api.Load(p)) api = CommandBufferApi{};
  apis->emplace_back(p, api);
  return apis->back().second;
}

std::string BuildLog(cl_program prog, cl_device_id dev) {
  size_t n = 0;
  clGetProgramBuildInfo(prog, dev, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
  std::string log(n, '\0');
  if (n > 0) clGetProgramBuildInfo(prog, dev, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr);
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  if (log.size() > 4000) log = log.substr(0, 4000) + "\n...";
  return log;
}

// The source lines a build log points at ("file.cl:722:48: error ..."), so an error names the
// generated code and not just a line number in a temporary file.
std::string SourceContext(const std::string& log, const std::string& source) {
  std::vector<absl::string_view> lines = absl::StrSplit(source, '\n');
  std::vector<int> shown;
  std::string out;
  size_t at = 0;
  while ((at = log.find(".cl:", at)) != std::string::npos && shown.size() < 3) {
    at += 4;
    const int line = std::atoi(log.c_str() + at);
    if (line <= 0 || line > static_cast<int>(lines.size())) continue;
    if (std::find(shown.begin(), shown.end(), line) != shown.end()) continue;
    shown.push_back(line);
    absl::StrAppend(&out, "\nline ", line, ": ", lines[line - 1]);
  }
  return out;
}

StatusOr<std::vector<unsigned char>> ProgramBinary(cl_program prog) {
  size_t size = 0;
  KILN_CL(clGetProgramInfo(prog, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr));
  std::vector<unsigned char> bin(size);
  unsigned char* ptrs[1] = {bin.data()};
  KILN_CL(clGetProgramInfo(prog, CL_PROGRAM_BINARIES, sizeof(ptrs), ptrs, nullptr));
  return bin;
}

}  // namespace

// ---- DeviceInfo ---------------------------------------------------------------------------------

bool DeviceInfo::HasExtension(std::string_view ext) const {
  for (absl::string_view e : absl::StrSplit(ToAbsl(extensions), ' ', absl::SkipEmpty())) {
    if (ToStd(e) == ext) return true;
  }
  return false;
}

const char* DeviceInfo::KindName() const {
  switch (KindRank(type)) {
    case 0:
      return "GPU";
    case 1:
      return "accelerator";
    default:
      return "CPU";
  }
}

std::string DeviceInfo::Describe() const {
  std::string feats;
  if (fp16) feats += " fp16";
  if (fp64) feats += " fp64";
  if (command_buffer) feats += " command-buffer";
  return absl::StrCat(name, " (", KindName(), ", ", platform_name, ", ", version, ", driver ",
                      driver_version, ", ", compute_units, " CUs, ",
                      absl::StrFormat("%.1f", global_mem_bytes / 1073741824.0), " GiB,",
                      feats.empty() ? " no fp16/fp64" : feats, ")");
}

std::string DeviceInfo::Unusable() const {
  if (!available) return "the device is not available";
  if (!compiler_available) return "the driver has no OpenCL C compiler";
  if (opencl_major < 1 || (opencl_major == 1 && opencl_minor < 2))
    return absl::StrCat("OpenCL 1.2 or later is required (the device has ", version, ")");
  if (max_param_bytes < 1024) {
    return absl::StrCat("kernel arguments of 1024 bytes are required (the device allows ",
                        max_param_bytes, ")");
  }
  if (max_work_group_size < 16) return "work-groups of 16 items are required";
  return "";
}

StatusOr<std::vector<Candidate>> EnumerateDevices() {
  std::vector<Candidate> out;
  cl_uint np = 0;
  cl_int err = clGetPlatformIDs(0, nullptr, &np);
  if (err == CL_PLATFORM_NOT_FOUND_KHR || np == 0) return out;  // no ICD installed
  KILN_CL_ERR(err, "clGetPlatformIDs");
  std::vector<cl_platform_id> platforms(np);
  KILN_CL(clGetPlatformIDs(np, platforms.data(), nullptr));
  for (cl_uint p = 0; p < np; ++p) {
    cl_uint nd = 0;
    err = clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 0, nullptr, &nd);
    if (err == CL_DEVICE_NOT_FOUND || nd == 0) continue;
    KILN_CL_ERR(err, "clGetDeviceIDs");
    std::vector<cl_device_id> devices(nd);
    KILN_CL(clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, nd, devices.data(), nullptr));
    for (cl_uint d = 0; d < nd; ++d) {
      Candidate c{platforms[p], devices[d], QueryDevice(platforms[p], devices[d])};
      c.info.platform_index = static_cast<int>(p);
      c.info.device_index = static_cast<int>(d);
      out.push_back(std::move(c));
    }
  }
  return out;
}

StatusOr<std::vector<Candidate>> SelectDevices(std::vector<Candidate> all,
                                               std::string_view override_spec) {
  if (!override_spec.empty()) {
    int p = -1, d = -1;
    char extra = 0;
    const std::string spec(override_spec);
    if (std::sscanf(spec.c_str(), "%d:%d%c", &p, &d, &extra) != 2 || p < 0 || d < 0) {
      return InvalidArgument("KILN_XPU_DEVICE='", spec,
                             "': expected <platform>:<device> indices as `clinfo -l` lists them, "
                             "e.g. 0:0");
    }
    for (Candidate& c : all) {
      if (c.info.platform_index != p || c.info.device_index != d) continue;
      if (const std::string why = c.info.Unusable(); !why.empty()) {
        return FailedPrecondition("KILN_XPU_DEVICE=", spec, " selects ", c.info.name,
                                  ", which cannot be used: ", why);
      }
      return std::vector<Candidate>{c};
    }
    std::string known;
    for (const Candidate& c : all) {
      absl::StrAppend(&known, known.empty() ? "" : ", ", c.info.platform_index, ":",
                      c.info.device_index, " ", c.info.name);
    }
    return NotFound("KILN_XPU_DEVICE=", spec,
                    " names no OpenCL device; found: ", known.empty() ? "none" : known);
  }
  std::vector<Candidate> usable;
  for (Candidate& c : all) {
    if (c.info.Unusable().empty()) usable.push_back(std::move(c));
  }
  std::stable_sort(usable.begin(), usable.end(), [](const Candidate& a, const Candidate& b) {
    return KindRank(a.info.type) < KindRank(b.info.type);
  });
  return usable;
}

// ---- Programs -----------------------------------------------------------------------------------

struct ProgramUnit {
  cl_program program = nullptr;
  bool library = false;
  int kernels = 0;
  Status status;
};

// ---- Buffers ------------------------------------------------------------------------------------

class XpuBuffer final : public backend::Buffer {
 public:
  XpuBuffer(XpuDevice* dev, uint32_t id, cl_mem mem, size_t bytes, std::shared_ptr<void> keepalive)
      : Buffer(dev,
               reinterpret_cast<void*>(XpuDevice::kAddressTag | static_cast<uint64_t>(id)
                                                                    << XpuDevice::kOffsetBits),
               bytes),
        dev_(dev),
        id_(id),
        mem_(mem),
        keepalive_(std::move(keepalive)) {}
  ~XpuBuffer() override {
    dev_->UnregisterMem(id_);
    clReleaseMemObject(mem_);
    dev_->allocated_bytes_.fetch_sub(counted_bytes_, std::memory_order_relaxed);
  }
  cl_mem mem() const { return mem_; }
  // Device memory this buffer counts against the device (Allocate, not wrapped memory).
  void Count(size_t bytes) {
    counted_bytes_ = bytes;
    dev_->allocated_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }

 private:
  XpuDevice* dev_;
  uint32_t id_;
  cl_mem mem_;
  std::shared_ptr<void> keepalive_;
  size_t counted_bytes_ = 0;
};

uint32_t XpuDevice::RegisterMem(cl_mem mem) {
  uint32_t id = 0;
  {
    std::lock_guard<std::mutex> lock(ids_mu_);
    if (!free_ids_.empty()) {
      id = free_ids_.back();
      free_ids_.pop_back();
    } else if (next_id_ < kMaxBuffers) {
      id = next_id_++;
    } else {
      return 0;
    }
    auto& chunk = chunks_[id >> kChunkBits];
    if (!chunk) {
      chunk.reset(new std::atomic<cl_mem>[1u << kChunkBits]);
      for (uint32_t i = 0; i < (1u << kChunkBits); ++i) chunk[i].store(nullptr);
    }
  }
  chunks_[id >> kChunkBits][id & ((1u << kChunkBits) - 1)].store(mem, std::memory_order_release);
  return id;
}

void XpuDevice::UnregisterMem(uint32_t id) {
  chunks_[id >> kChunkBits][id & ((1u << kChunkBits) - 1)].store(nullptr,
                                                                 std::memory_order_release);
  std::lock_guard<std::mutex> lock(ids_mu_);
  free_ids_.push_back(id);
}

bool XpuDevice::ResolveMem(const void* p, cl_mem* mem, size_t* offset) const {
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  if ((a & ~((1ull << 62) - 1)) != kAddressTag) return false;
  const uint64_t id = (a >> kOffsetBits) & (kMaxBuffers - 1);
  const auto& chunk = chunks_[id >> kChunkBits];
  if (id == 0 || !chunk) return false;
  *mem = chunk[id & ((1u << kChunkBits) - 1)].load(std::memory_order_acquire);
  *offset = static_cast<size_t>(a & ((1ull << kOffsetBits) - 1));
  return *mem != nullptr;
}

bool XpuDevice::Resolve(const void* p, void** mem, size_t* offset) const {
  cl_mem m = nullptr;
  if (!ResolveMem(p, &m, offset)) return false;
  *mem = m;
  return true;
}

StatusOr<std::unique_ptr<backend::Buffer>> XpuDevice::Allocate(size_t bytes) {
  if (bytes >= (1ull << kOffsetBits) || bytes > info_.max_alloc_bytes) {
    return ResourceExhausted(name_, ": cannot allocate ", bytes, " bytes in one buffer (",
                             info_.name, " allows ", info_.max_alloc_bytes, ")");
  }
  cl_int err = CL_SUCCESS;
  cl_mem mem =
      clCreateBuffer(context_, CL_MEM_READ_WRITE, std::max<size_t>(bytes, 64), nullptr, &err);
  KILN_CL_ERR(err, "clCreateBuffer");
  const uint32_t id = RegisterMem(mem);
  if (id == 0) {
    clReleaseMemObject(mem);
    return ResourceExhausted(name_, ": more than ", kMaxBuffers, " live buffers");
  }
  auto buffer = std::make_unique<XpuBuffer>(this, id, mem, bytes, nullptr);
  buffer->Count(bytes);
  return std::unique_ptr<backend::Buffer>(std::move(buffer));
}

StatusOr<backend::DeviceMemoryInfo> XpuDevice::MemoryInfo() {
  // OpenCL has no free-memory query: the total minus what this process allocated.
  const uint64_t total = info_.global_mem_bytes;
  const uint64_t used = allocated_bytes_.load(std::memory_order_relaxed);
  return backend::DeviceMemoryInfo{total, used < total ? total - used : 0};
}

StatusOr<std::unique_ptr<backend::Buffer>> XpuDevice::WrapHostMemory(
    void* data, size_t bytes, std::shared_ptr<void> keepalive) {
  if (bytes == 0 || bytes >= (1ull << kOffsetBits)) {
    return InvalidArgument(name_, ": cannot wrap ", bytes, " bytes of host memory");
  }
  // The driver may use the memory in place (integrated GPUs, CPU devices) or keep a device
  // copy: wrapped memory must not change afterwards (weights).
  cl_int err = CL_SUCCESS;
  cl_mem mem = clCreateBuffer(context_, CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, bytes, data, &err);
  KILN_CL_ERR(err, "clCreateBuffer(CL_MEM_USE_HOST_PTR)");
  const uint32_t id = RegisterMem(mem);
  if (id == 0) {
    clReleaseMemObject(mem);
    return ResourceExhausted(name_, ": more than ", kMaxBuffers, " live buffers");
  }
  return std::unique_ptr<backend::Buffer>(
      new XpuBuffer(this, id, mem, bytes, std::move(keepalive)));
}

bool XpuDevice::SupportsDType(DType t) const {
  if (t == DType::kInvalid) return false;
  if (t == DType::kF64) return fp64_;
  return true;
}

void* XpuDevice::GetExtension(std::string_view name) {
  if (name == compiler::kTargetExtension) return static_cast<compiler::Target*>(this);
  if (name == "xpu.device_info") return &info_;
  if (name == "xpu.cl_context") return context_;
  if (name == "xpu.cl_device") return device_;
  return nullptr;
}

// ---- compiler::Target ---------------------------------------------------------------------------

compiler::FusionCaps XpuDevice::caps() const {
  return devk::DeviceFusionCaps(info_.max_param_bytes);
}

Status XpuDevice::Prepare(std::span<const backend::KernelRequest> requests) {
  tl_preparing = true;
  const Status status = devk::DeclareKernels(*this, requests);
  tl_preparing = false;
  KILN_RETURN_IF_ERROR(status);
  return BuildPending();
}

compiler::CompileCounters XpuDevice::counters() const {
  const Stats s = stats();
  compiler::CompileCounters c;
  c.compiled = s.kernels_built;
  c.cached = s.kernels_from_cache;
  c.reused = reused_.load(std::memory_order_relaxed);
  c.compiler_runs = s.programs_built_from_source;
  c.seconds = s.build_seconds;
  return c;
}

// ---- Streams, events, capture -------------------------------------------------------------------

// A recorded graph: command buffers, with host steps (library calls) between them.
class XpuGraph final : public backend::ExecGraph {
 public:
  struct Segment {
    cl_command_buffer_khr cb = nullptr;
    std::vector<cl_kernel> kernels;  // dedicated kernel objects, owned
    cl_event last = nullptr;         // last replay (devices without simultaneous use)
    KernelFn fn = nullptr;           // host step
    LaunchArgs args;
    std::vector<TensorArg> inputs;
  };
  XpuGraph(XpuDevice* dev, std::vector<std::unique_ptr<Segment>> segs)
      : dev_(dev), segs_(std::move(segs)) {}
  ~XpuGraph() override;
  Status Replay(backend::Stream& stream) override;

 private:
  XpuDevice* dev_;
  std::vector<std::unique_ptr<Segment>> segs_;
};

class Recording {
 public:
  Recording(XpuDevice* dev, cl_command_queue q) : dev_(dev), queue_(q) {}
  ~Recording() {
    for (auto& s : segs_) ReleaseSegment(CbApi(dev_->platform()), *s);
  }
  Status Record(KernelSlot* k, const ClArgs& args, int dims, const size_t* global,
                const size_t* local, int meta_size, cl_kernel kobj);
  Status RecordCopy(cl_mem src, cl_mem dst, size_t src_off, size_t dst_off, size_t bytes);
  void RecordHost(KernelFn fn, const LaunchArgs& a);
  StatusOr<std::unique_ptr<XpuGraph>> Finish();

  static void ReleaseSegment(const CommandBufferApi& api, XpuGraph::Segment& s) {
    if (s.last) clWaitForEvents(1, &s.last);
    if (s.cb) api.release(s.cb);
    s.cb = nullptr;
    for (cl_kernel k : s.kernels) clReleaseKernel(k);
    s.kernels.clear();
    if (s.last) clReleaseEvent(s.last);
    s.last = nullptr;
  }

 private:
  Status OpenSegment();
  XpuDevice* dev_;
  cl_command_queue queue_;
  std::vector<std::unique_ptr<XpuGraph::Segment>> segs_;
  XpuGraph::Segment* open_ = nullptr;  // the command-buffer segment being recorded
  cl_sync_point_khr last_point_ = 0;
  bool has_point_ = false;
};

namespace {

class XpuEvent final : public backend::Event {
 public:
  explicit XpuEvent(cl_event e) : e_(e) {}
  ~XpuEvent() override { clReleaseEvent(e_); }
  Status Wait() override {
    KILN_CL(clWaitForEvents(1, &e_));
    return OkStatus();
  }
  bool Done() override {
    cl_int st = CL_COMPLETE;
    if (clGetEventInfo(e_, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(st), &st, nullptr) !=
        CL_SUCCESS) {
      return true;
    }
    return st == CL_COMPLETE || st < 0;
  }
  cl_event event() const { return e_; }

 private:
  cl_event e_;
};

}  // namespace

class XpuStream final : public backend::Stream {
 public:
  XpuStream(XpuDevice* dev, cl_command_queue q) : dev_(dev), queue_(q), exec_(dev) {
    exec_.queue = q;
  }
  ~XpuStream() override {
    recording_.reset();
    clFinish(queue_);
    clReleaseCommandQueue(queue_);
  }
  backend::Device& device() override { return *dev_; }

  Status Run(std::span<const Launch> launches) override {
    exec_.status = OkStatus();
    exec_.capture = recording_.get();
    ExecCtx ctx;
    ctx.native_stream = &exec_;
    for (const Launch& l : launches) {
      l.fn(*l.args, ctx);
      if (!exec_.status.ok()) break;
    }
    exec_.capture = nullptr;
    return exec_.status;
  }

  StatusOr<cl_mem> Mem(const backend::Buffer& b, size_t off, size_t bytes, const char* what) {
    if (&b.device() != dev_) {
      return InvalidArgument(what, ": the buffer is on ", ToAbsl(b.device().name()), ", not ",
                             ToAbsl(dev_->name()));
    }
    if (off > b.size() || bytes > b.size() - off) {
      return OutOfRange(what, ": ", bytes, " bytes at offset ", off, " exceed a buffer of ",
                        b.size());
    }
    return static_cast<const XpuBuffer&>(b).mem();
  }

  // Blocking transfers (the host memory is free again on return) and non-blocking ones (it
  // must stay untouched until the queue passes them: engine/backend/backend.h).
  Status CopyToDevice(const backend::Buffer& dst, size_t dst_offset, const void* src,
                      size_t bytes) override {
    return Write(dst, dst_offset, src, bytes, CL_TRUE, "CopyToDevice");
  }
  Status CopyToHost(void* dst, const backend::Buffer& src, size_t src_offset,
                    size_t bytes) override {
    return Read(dst, src, src_offset, bytes, CL_TRUE, "CopyToHost");
  }
  Status CopyToDeviceAsync(const backend::Buffer& dst, size_t dst_offset, const void* src,
                           size_t bytes) override {
    return Write(dst, dst_offset, src, bytes, CL_FALSE, "CopyToDeviceAsync");
  }
  Status CopyToHostAsync(void* dst, const backend::Buffer& src, size_t src_offset,
                         size_t bytes) override {
    return Read(dst, src, src_offset, bytes, CL_FALSE, "CopyToHostAsync");
  }
  Status Write(const backend::Buffer& dst, size_t dst_offset, const void* src, size_t bytes,
               cl_bool blocking, const char* what) {
    KILN_ASSIGN_OR_RETURN(cl_mem m, Mem(dst, dst_offset, bytes, what));
    if (recording_) return FailedPrecondition(what, " while capturing a graph");
    if (bytes == 0) return OkStatus();
    KILN_CL(clEnqueueWriteBuffer(queue_, m, blocking, dst_offset, bytes, src, 0, nullptr, nullptr));
    return OkStatus();
  }
  Status Read(void* dst, const backend::Buffer& src, size_t src_offset, size_t bytes,
              cl_bool blocking, const char* what) {
    KILN_ASSIGN_OR_RETURN(cl_mem m, Mem(src, src_offset, bytes, what));
    if (recording_) return FailedPrecondition(what, " while capturing a graph");
    if (bytes == 0) return OkStatus();
    KILN_CL(clEnqueueReadBuffer(queue_, m, blocking, src_offset, bytes, dst, 0, nullptr, nullptr));
    return OkStatus();
  }
  Status CopyOnDevice(const backend::Buffer& dst, size_t dst_offset, const backend::Buffer& src,
                      size_t src_offset, size_t bytes) override {
    KILN_ASSIGN_OR_RETURN(cl_mem d, Mem(dst, dst_offset, bytes, "CopyOnDevice (destination)"));
    KILN_ASSIGN_OR_RETURN(cl_mem s, Mem(src, src_offset, bytes, "CopyOnDevice (source)"));
    if (bytes == 0) return OkStatus();
    if (d == s && src_offset < dst_offset + bytes && dst_offset < src_offset + bytes) {
      return InvalidArgument("CopyOnDevice: source and destination overlap");
    }
    if (recording_) return recording_->RecordCopy(s, d, src_offset, dst_offset, bytes);
    KILN_CL(clEnqueueCopyBuffer(queue_, s, d, src_offset, dst_offset, bytes, 0, nullptr, nullptr));
    return OkStatus();
  }
  Status Synchronize() override {
    KILN_CL(clFinish(queue_));
    return OkStatus();
  }
  StatusOr<std::unique_ptr<backend::Event>> RecordEvent() override {
    cl_event e = nullptr;
    KILN_CL(clEnqueueMarkerWithWaitList(queue_, 0, nullptr, &e));
    return std::unique_ptr<backend::Event>(new XpuEvent(e));
  }
  Status WaitEvent(backend::Event& event) override {
    if (auto* e = dynamic_cast<XpuEvent*>(&event)) {
      cl_event ev = e->event();
      KILN_CL(clEnqueueBarrierWithWaitList(queue_, 1, &ev, nullptr));
      return OkStatus();
    }
    return event.Wait();
  }
  bool SupportsCapture() const override { return dev_->command_buffer(); }
  Status BeginCapture() override {
    if (!dev_->command_buffer()) {
      return Unimplemented(ToAbsl(dev_->name()), " has no cl_khr_command_buffer");
    }
    if (recording_) return FailedPrecondition("BeginCapture: already capturing");
    recording_ = std::make_unique<Recording>(dev_, queue_);
    return OkStatus();
  }
  StatusOr<std::unique_ptr<backend::ExecGraph>> EndCapture() override {
    if (!recording_) return FailedPrecondition("EndCapture without BeginCapture");
    std::unique_ptr<Recording> r = std::move(recording_);
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<XpuGraph> g, r->Finish());
    return std::unique_ptr<backend::ExecGraph>(std::move(g));
  }

  Exec& exec() { return exec_; }
  cl_command_queue queue() const { return queue_; }
  bool capturing() const { return recording_ != nullptr; }

 private:
  XpuDevice* dev_;
  cl_command_queue queue_;
  Exec exec_;
  std::unique_ptr<Recording> recording_;
};

Status Recording::OpenSegment() {
  const CommandBufferApi& api = CbApi(dev_->platform());
  cl_command_buffer_properties_khr props[] = {CL_COMMAND_BUFFER_FLAGS_KHR, 0, 0};
  if (dev_->info().command_buffer_simultaneous) props[1] = CL_COMMAND_BUFFER_SIMULTANEOUS_USE_KHR;
  cl_int err = CL_SUCCESS;
  cl_command_buffer_khr cb = api.create(1, &queue_, props, &err);
  KILN_CL_ERR(err, "clCreateCommandBufferKHR");
  auto seg = std::make_unique<XpuGraph::Segment>();
  seg->cb = cb;
  open_ = seg.get();
  segs_.push_back(std::move(seg));
  has_point_ = false;
  return OkStatus();
}

Status Recording::Record(KernelSlot* k, const ClArgs& args, int dims, const size_t* global,
                         const size_t* local, int meta_size, cl_kernel kobj) {
  (void)k;
  if (open_ == nullptr) {
    const Status s = OpenSegment();
    if (!s.ok()) {
      clReleaseKernel(kobj);
      return s;
    }
  }
  open_->kernels.push_back(kobj);  // owned by the segment from here on
  for (int i = 0; i < args.num_mems(); ++i) {
    KILN_CL(clSetKernelArg(kobj, i, sizeof(cl_mem), &args.mems()[i]));
  }
  KILN_CL(clSetKernelArg(kobj, args.num_mems(), sizeof(int64_t) * meta_size, args.meta()));
  const CommandBufferApi& api = CbApi(dev_->platform());
  cl_sync_point_khr point = 0;
  // Commands of a command buffer run in any order unless chained: keep the stream's order.
  KILN_CL(api.ndrange(open_->cb, nullptr, nullptr, kobj, dims, nullptr, global, local,
                      has_point_ ? 1 : 0, has_point_ ? &last_point_ : nullptr, &point, nullptr));
  last_point_ = point;
  has_point_ = true;
  return OkStatus();
}

Status Recording::RecordCopy(cl_mem src, cl_mem dst, size_t src_off, size_t dst_off, size_t bytes) {
  if (open_ == nullptr) KILN_RETURN_IF_ERROR(OpenSegment());
  const CommandBufferApi& api = CbApi(dev_->platform());
  cl_sync_point_khr point = 0;
  KILN_CL(api.copy(open_->cb, nullptr, src, dst, src_off, dst_off, bytes, has_point_ ? 1 : 0,
                   has_point_ ? &last_point_ : nullptr, &point, nullptr));
  last_point_ = point;
  has_point_ = true;
  return OkStatus();
}

void Recording::RecordHost(KernelFn fn, const LaunchArgs& a) {
  open_ = nullptr;  // the next kernel starts a new command buffer after this step
  auto seg = std::make_unique<XpuGraph::Segment>();
  seg->fn = fn;
  seg->args = a;
  seg->inputs.assign(a.inputs, a.inputs + a.num_inputs);
  seg->inputs.insert(seg->inputs.end(), a.extra_outputs, a.extra_outputs + a.num_extra_outputs);
  seg->args.inputs = seg->inputs.data();
  seg->args.extra_outputs = a.num_extra_outputs > 0 ? seg->inputs.data() + a.num_inputs : nullptr;
  segs_.push_back(std::move(seg));
}

StatusOr<std::unique_ptr<XpuGraph>> Recording::Finish() {
  const CommandBufferApi& api = CbApi(dev_->platform());
  for (auto& s : segs_) {
    if (s->cb != nullptr) KILN_CL(api.finalize(s->cb));
  }
  return std::make_unique<XpuGraph>(dev_, std::move(segs_));
}

XpuGraph::~XpuGraph() {
  const CommandBufferApi& api = CbApi(dev_->platform());
  for (auto& s : segs_) Recording::ReleaseSegment(api, *s);
}

Status XpuGraph::Replay(backend::Stream& stream) {
  if (&stream.device() != dev_) {
    return InvalidArgument("Replay: the graph was captured on ", ToAbsl(dev_->name()),
                           ", the stream is on ", ToAbsl(stream.device().name()));
  }
  auto& s = static_cast<XpuStream&>(stream);
  if (s.capturing()) return FailedPrecondition("Replay while the stream is capturing");
  const CommandBufferApi& api = CbApi(dev_->platform());
  cl_command_queue q = s.queue();
  for (auto& seg : segs_) {
    if (seg->cb != nullptr) {
      if (seg->last != nullptr) {  // not simultaneously usable: the last replay must be done
        KILN_CL(clWaitForEvents(1, &seg->last));
        clReleaseEvent(seg->last);
        seg->last = nullptr;
      }
      cl_event* ev = dev_->info().command_buffer_simultaneous ? nullptr : &seg->last;
      KILN_CL(api.enqueue(1, &q, seg->cb, 0, nullptr, ev));
      continue;
    }
    Exec& ex = s.exec();
    ex.status = OkStatus();
    ExecCtx ctx;
    ctx.native_stream = &ex;
    seg->fn(seg->args, ctx);
    KILN_RETURN_IF_ERROR(ex.status);
  }
  return OkStatus();
}

// ---- Exec ---------------------------------------------------------------------------------------

Exec::Exec(XpuDevice* dev) : devk::Queue(dev), device(dev) {}

void Exec::Enqueue(devk::KernelSlot* slot, const ClArgs& args, int dims, const size_t* global,
                   const size_t* local, int meta_size) {
  auto* k = static_cast<KernelSlot*>(slot);
  if (!status.ok()) return;
  if (!args.ok()) {
    Fail(Internal("xpu kernel ", k->name(),
                  ": a tensor is not on this device or the launch has too many arguments"));
    return;
  }
  for (int d = 0; d < dims; ++d) {
    if (global[d] == 0) return;  // nothing to do (OpenCL rejects empty ranges)
  }
  if (meta_size == 0) meta_size = ClArgs::MetaSize(args.num_meta());
  if (meta_size < args.num_meta()) {
    Fail(Internal("xpu kernel ", k->name(), ": ", args.num_meta(), " metadata values for meta",
                  meta_size));
    return;
  }
  if (Status s = device->EnsureBuilt(k); !s.ok()) {
    Fail(s);
    return;
  }
  if (capture != nullptr) {
    StatusOr<cl_kernel> kobj = device->NewKernelObject(k);
    if (!kobj.ok()) {
      Fail(kobj.status());
      return;
    }
    Fail(capture->Record(k, args, dims, global, local, meta_size, *kobj));
    return;
  }
  std::lock_guard<std::mutex> lock(k->mu_);
  auto run = [&]() -> Status {
    for (int i = 0; i < args.num_mems(); ++i) {
      KILN_CL(clSetKernelArg(k->kernel_, i, sizeof(cl_mem), &args.mems()[i]));
    }
    KILN_CL(clSetKernelArg(k->kernel_, args.num_mems(), sizeof(int64_t) * meta_size, args.meta()));
    KILN_CL(clEnqueueNDRangeKernel(queue, k->kernel_, dims, nullptr, global, local, 0, nullptr,
                                   nullptr));
    return OkStatus();
  };
  if (Status s = run(); !s.ok()) Fail(Annotate(s, absl::StrCat("kernel ", k->name())));
}

bool Exec::DeferWhileCapturing(KernelFn fn, const LaunchArgs& args) {
  if (capture == nullptr) return false;
  capture->RecordHost(fn, args);
  return true;
}

namespace {

template <typename T>
T Alpha(double v) {
  return static_cast<T>(v);
}
template <>
half Alpha<half>(double v) {
  return FloatToHalf(static_cast<float>(v));
}

template <typename T>
bool BlasGemm(cl_command_queue q, const devk::GemmCall& g) {
  using clblast::Transpose;
  const auto mem = [](void* m) { return static_cast<cl_mem>(m); };
  const Transpose ta = g.a.trans ? Transpose::kYes : Transpose::kNo;
  const Transpose tb = g.b.trans ? Transpose::kYes : Transpose::kNo;
  clblast::StatusCode st;
  if (g.batch == 1) {
    st = clblast::Gemm<T>(clblast::Layout::kRowMajor, ta, tb, g.m, g.n, g.k, Alpha<T>(1),
                          mem(g.a.mem), g.a.offset, g.a.ld, mem(g.b.mem), g.b.offset, g.b.ld,
                          Alpha<T>(0), mem(g.c.mem), g.c.offset, g.c.ld, &q, nullptr);
  } else {
    st = clblast::GemmStridedBatched<T>(
        clblast::Layout::kRowMajor, ta, tb, g.m, g.n, g.k, Alpha<T>(1), mem(g.a.mem), g.a.offset,
        g.a.ld, g.a.batch_stride, mem(g.b.mem), g.b.offset, g.b.ld, g.b.batch_stride, Alpha<T>(0),
        mem(g.c.mem), g.c.offset, g.c.ld, g.c.batch_stride, g.batch, &q, nullptr);
  }
  if (st != clblast::StatusCode::kSuccess) {
    static std::atomic<int> logged{0};
    if (logged.fetch_add(1) < 3) {
      spdlog::debug("xpu: CLBlast GEMM declined ({}); using the generic kernel",
                    static_cast<int>(st));
    }
    return false;
  }
  return true;
}

}  // namespace

bool Exec::Gemm(const devk::GemmCall& call) {
  switch (call.dtype) {
    case DType::kF32:
      return BlasGemm<float>(queue, call);
    case DType::kF64:
      return BlasGemm<double>(queue, call);
    case DType::kF16:
      return BlasGemm<half>(queue, call);
    default:
      return false;
  }
}

bool XpuDevice::HasGemm(DType t) const {
  return t == DType::kF32 || (t == DType::kF64 && fp64_) || (t == DType::kF16 && info_.fp16);
}

// ---- Device -------------------------------------------------------------------------------------

StatusOr<std::unique_ptr<XpuDevice>> XpuDevice::Create(const Candidate& c, int ordinal,
                                                       const XpuOptions& options) {
  std::unique_ptr<XpuDevice> d(new XpuDevice());
  d->name_ = absl::StrCat("xpu:", ordinal);
  d->info_ = c.info;
  d->options_ = options;
  d->platform_ = c.platform;
  d->device_ = c.device;
  d->fp64_ = c.info.fp64 && !options.disable_fp64;
  d->command_buffer_ = c.info.command_buffer && !options.disable_command_buffer &&
                       CbApi(c.platform).create != nullptr;
  // One work-group size for every kernel: PoCL compiles a kernel once per local size, and
  // GPUs like 256; CPU devices run work-groups as loops, where 64 is plenty.
  const size_t want = (c.info.type & CL_DEVICE_TYPE_GPU) ? 256 : 64;
  size_t wg = 16;
  while (wg * 2 <= std::min(want, c.info.max_work_group_size)) wg *= 2;
  d->codegen_.work_group_size = static_cast<int>(wg);
  cl_context_properties props[] = {CL_CONTEXT_PLATFORM,
                                   reinterpret_cast<cl_context_properties>(c.platform), 0};
  cl_int err = CL_SUCCESS;
  d->context_ = clCreateContext(props, 1, &c.device, nullptr, nullptr, &err);
  KILN_CL_ERR(err, "clCreateContext");
  KILN_ASSIGN_OR_RETURN(d->upload_queue_, [&]() -> StatusOr<cl_command_queue> {
    cl_int e = CL_SUCCESS;
    cl_command_queue q =
        c.info.opencl_major >= 2
            ? clCreateCommandQueueWithProperties(d->context_, c.device, nullptr, &e)
            : clCreateCommandQueue(d->context_, c.device, 0, &e);
    KILN_CL_ERR(e, "clCreateCommandQueue");
    return q;
  }());
  if (options.cache_dir != "none") {
    d->cache_ = std::make_unique<compiler::DiskCache>(options.cache_dir);
    d->cache_ns_ = absl::StrCat("opencl-", compiler::Sha256Hex(d->CacheIdentity()).substr(0, 16));
  }
  d->store_binaries_ =
      options.force_binary_cache || c.info.platform_name != "Portable Computing Language";
  return d;
}

XpuDevice::~XpuDevice() {
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, slot] : slots_) {
      if (slot->kernel_) clReleaseKernel(slot->kernel_);
    }
    for (auto& u : units_) {
      if (u->program) clReleaseProgram(u->program);
    }
  }
  if (upload_queue_) clReleaseCommandQueue(upload_queue_);
  if (context_) clReleaseContext(context_);
}

StatusOr<std::unique_ptr<backend::Stream>> XpuDevice::CreateStream() {
  cl_int err = CL_SUCCESS;
  cl_command_queue q = info_.opencl_major >= 2
                           ? clCreateCommandQueueWithProperties(context_, device_, nullptr, &err)
                           : clCreateCommandQueue(context_, device_, 0, &err);
  KILN_CL_ERR(err, "clCreateCommandQueue");
  return std::unique_ptr<backend::Stream>(new XpuStream(this, q));
}

Status XpuDevice::Upload(const backend::Buffer& dst, const void* src, size_t bytes) {
  cl_mem mem = nullptr;
  size_t offset = 0;
  if (!ResolveMem(dst.data(), &mem, &offset)) {
    return InvalidArgument("Upload: the buffer is not on ", ToAbsl(name_));
  }
  std::lock_guard<std::mutex> lock(upload_mu_);
  KILN_CL(
      clEnqueueWriteBuffer(upload_queue_, mem, CL_TRUE, offset, bytes, src, 0, nullptr, nullptr));
  return OkStatus();
}

XpuDevice::Stats XpuDevice::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.corrupt_cache_entries = cache_ ? cache_->corrupt_entries() : 0;
  return s;
}

std::string XpuDevice::BuildOptions() const { return "-cl-std=CL1.2"; }

std::string XpuDevice::Prelude() const { return devk::ProgramPrelude(work_group(), fp64_); }

std::string XpuDevice::CacheIdentity() const {
  return absl::StrCat("kiln-xpu-v2\n", info_.platform_name, "\n", info_.platform_version, "\n",
                      info_.vendor, "\n", info_.name, "\n", info_.version, "\n",
                      info_.driver_version, "\n", BuildOptions());
}

KernelSlot* XpuDevice::DeclareKernel(std::string_view prefix, std::string_view source) {
  std::string name = absl::StrCat(ToAbsl(prefix), "_", Hex64(StableHash(source)));
  std::string src = devk::NameKernel(source, name);
  return Declare(std::move(name), std::move(src));
}

KernelSlot* XpuDevice::DeclareGenerated(const compiler::GeneratedKernel& kernel) {
  return Declare(kernel.entry, kernel.code);
}

KernelSlot* XpuDevice::Declare(std::string name, std::string source) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = slots_.try_emplace(name);
  if (inserted) {
    it->second = std::make_unique<KernelSlot>();
    KernelSlot& k = *it->second;
    k.name_ = std::move(name);
    k.source_ = std::move(source);
    k.group_ = kGenerated;
    pending_[kGenerated].push_back(&k);
  } else if (tl_preparing) {
    reused_.fetch_add(1, std::memory_order_relaxed);
  }
  return it->second.get();
}

KernelSlot* XpuDevice::LibraryKernel(std::string_view name) {
  const std::string key = absl::StrCat("lib:", ToAbsl(name));
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = slots_.try_emplace(key);
  if (inserted) {
    it->second = std::make_unique<KernelSlot>();
    it->second->name_ = std::string(name);
    it->second->group_ = kLibrary;
    pending_[kLibrary].push_back(it->second.get());
  }
  return it->second.get();
}

StatusOr<cl_kernel> XpuDevice::NewKernelObject(KernelSlot* k) {
  ProgramUnit* unit = k->unit_.load(std::memory_order_acquire);
  if (unit == nullptr || !unit->status.ok()) return FailedPrecondition("kernel not built");
  cl_int err = CL_SUCCESS;
  cl_kernel kobj = clCreateKernel(unit->program, k->name_.c_str(), &err);
  KILN_CL_ERR(err, "clCreateKernel");
  return kobj;
}

Status XpuDevice::EnsureBuilt(KernelSlot* k) {
  if (ProgramUnit* u = k->unit_.load(std::memory_order_acquire)) return u->status;
  std::lock_guard<std::mutex> build(build_mu_);
  if (ProgramUnit* u = k->unit_.load(std::memory_order_acquire)) return u->status;
  std::vector<KernelSlot*> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(pending_[k->group_]);
  }
  if (std::find(batch.begin(), batch.end(), k) == batch.end()) batch.push_back(k);
  Status s = BuildBatch(k->group_, std::move(batch));
  if (ProgramUnit* u = k->unit_.load(std::memory_order_acquire)) return u->status;
  return s.ok() ? Internal("xpu: kernel ", k->name_, " was not built") : s;
}

Status XpuDevice::BuildPending() {
  for (int g : {kGenerated, kLibrary}) {
    KernelSlot* first = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (!pending_[g].empty()) first = pending_[g].front();
    }
    if (first != nullptr) KILN_RETURN_IF_ERROR(EnsureBuilt(first));
  }
  return OkStatus();
}

StatusOr<cl_program> XpuDevice::BuildProgram(const std::string& source, bool* from_cache) {
  const std::string options = BuildOptions();
  *from_cache = false;
  cl_int err = CL_SUCCESS;
  const bool cached = cache_ != nullptr && store_binaries_;
  const std::string key = cached ? compiler::Sha256Hex(source) : "";
  std::optional<compiler::DiskCache::Lock> lock;
  if (cached) {
    // One process builds a program; others wait here, then load its binary.
    StatusOr<compiler::DiskCache::Lock> l = cache_->LockKey(cache_ns_, key);
    if (l.ok()) lock.emplace(*std::move(l));
    if (StatusOr<std::string> bin = cache_->Get(cache_ns_, key); bin.ok()) {
      const auto* ptr = reinterpret_cast<const unsigned char*>(bin->data());
      const size_t size = bin->size();
      cl_int bin_status = CL_SUCCESS;
      cl_program p =
          clCreateProgramWithBinary(context_, 1, &device_, &size, &ptr, &bin_status, &err);
      if (err == CL_SUCCESS && bin_status == CL_SUCCESS &&
          clBuildProgram(p, 1, &device_, options.c_str(), nullptr, nullptr) == CL_SUCCESS) {
        *from_cache = true;
        return p;
      }
      // A binary the driver no longer accepts (e.g. after a driver update): rebuild.
      if (p) clReleaseProgram(p);
      spdlog::info("{}: a cached program binary was rejected by the driver; rebuilding", name_);
    }
  }
  const char* src = source.c_str();
  const size_t len = source.size();
  cl_program p = clCreateProgramWithSource(context_, 1, &src, &len, &err);
  KILN_CL_ERR(err, "clCreateProgramWithSource");
  err = clBuildProgram(p, 1, &device_, options.c_str(), nullptr, nullptr);
  if (err != CL_SUCCESS) {
    const std::string log = BuildLog(p, device_);
    clReleaseProgram(p);
    return Internal(name_, ": building OpenCL C failed (", ClErrorName(err), "):\n", log,
                    SourceContext(log, source));
  }
  if (cached) {
    StatusOr<std::vector<unsigned char>> bin = ProgramBinary(p);
    const Status st =
        bin.ok()
            ? cache_->Put(cache_ns_, key,
                          std::string_view(reinterpret_cast<const char*>(bin->data()), bin->size()))
            : bin.status();
    if (!st.ok()) {
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true)) {
        spdlog::warn("{}: program binaries are not cached: {}", name_, StatusMessage(st));
      }
    }
  }
  return p;
}

Status XpuDevice::BuildBatch(int group, std::vector<KernelSlot*> batch) {
  // The library is one program: later-declared library kernels come from it too.
  if (group == kLibrary) {
    ProgramUnit* lib = nullptr;
    {
      absl::MutexLock lock(&mu_);
      for (auto& u : units_) {
        if (u->library) lib = u.get();
      }
    }
    if (lib != nullptr) {
      KILN_RETURN_IF_ERROR(lib->status);
      for (KernelSlot* k : batch) {
        cl_int err = CL_SUCCESS;
        k->kernel_ = clCreateKernel(lib->program, k->name_.c_str(), &err);
        KILN_CL_ERR(err, absl::StrCat("clCreateKernel(", k->name_, ")").c_str());
        k->unit_.store(lib, std::memory_order_release);
      }
      return OkStatus();
    }
  }
  std::string source = Prelude();
  if (group == kLibrary) {
    source += devk::kClLibrary;
  } else {
    source += compiler::Preamble(compiler::Dialect::kOpenCL);
    for (KernelSlot* k : batch) absl::StrAppend(&source, "\n", k->source_, "\n");
  }
  if (const char* dump = std::getenv("KILN_XPU_DUMP_SOURCES"); dump != nullptr && *dump) {
    // Debug aid: every program's source, by content hash.
    std::ofstream(absl::StrCat(dump, "/", Hex64(StableHash(source)), ".cl")) << source;
  }
  const auto t0 = Clock::now();
  bool from_cache = false;
  StatusOr<cl_program> prog = BuildProgram(source, &from_cache);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!prog.ok()) {
    if (batch.size() > 1 && group == kGenerated) {
      // Attribute the failure: build the halves (bisecting down to the broken kernels). Their
      // own statuses are recorded per kernel (each slot's unit); this call reports the batch's.
      const size_t half = batch.size() / 2;
      (void)BuildBatch(group, std::vector<KernelSlot*>(batch.begin(), batch.begin() + half));
      (void)BuildBatch(group, std::vector<KernelSlot*>(batch.begin() + half, batch.end()));
      return prog.status();
    }
    auto unit = std::make_unique<ProgramUnit>();
    unit->library = group == kLibrary;
    unit->status = prog.status();
    for (KernelSlot* k : batch) k->unit_.store(unit.get(), std::memory_order_release);
    absl::MutexLock lock(&mu_);
    units_.push_back(std::move(unit));
    return prog.status();
  }
  auto unit = std::make_unique<ProgramUnit>();
  unit->program = *prog;
  unit->library = group == kLibrary;
  unit->kernels = group == kLibrary ? 0 : static_cast<int>(batch.size());
  for (KernelSlot* k : batch) {
    cl_int err = CL_SUCCESS;
    k->kernel_ = clCreateKernel(unit->program, k->name_.c_str(), &err);
    if (err != CL_SUCCESS) {
      unit->status =
          ClError(err, absl::StrCat("clCreateKernel(", k->name_, ")").c_str(), __FILE__, __LINE__);
    }
  }
  // Publish only once every kernel object exists (launchers read kernel_ after unit_).
  for (KernelSlot* k : batch) k->unit_.store(unit.get(), std::memory_order_release);
  spdlog::info("{}: {} program ({} kernel{}) {} in {:.0f} ms", name_,
               group == kLibrary ? "library" : "generated", batch.size(),
               batch.size() == 1 ? "" : "s", from_cache ? "loaded from the cache" : "built",
               secs * 1e3);
  const Status result = unit->status;
  absl::MutexLock lock(&mu_);
  (from_cache ? stats_.programs_loaded_from_cache : stats_.programs_built_from_source) += 1;
  (from_cache ? stats_.kernels_from_cache : stats_.kernels_built) += static_cast<int>(batch.size());
  stats_.build_seconds += secs;
  units_.push_back(std::move(unit));
  return result;
}

// ---- The backend --------------------------------------------------------------------------------

void PlacePoclCache(const std::string& cache_dir) {
  if (cache_dir == "none" || std::getenv("POCL_CACHE_DIR") != nullptr) return;
  const std::string dir = cache_dir.empty() ? compiler::CacheDir() : cache_dir;
  setenv("POCL_CACHE_DIR", absl::StrCat(dir, "/pocl").c_str(), /*overwrite=*/0);
}

StatusOr<std::unique_ptr<XpuBackend>> CreateXpuBackend(const XpuOptions& options) {
  PlacePoclCache(options.cache_dir);
  KILN_ASSIGN_OR_RETURN(std::vector<Candidate> all, EnumerateDevices());
  std::string found;
  for (const Candidate& c : all) {
    const std::string why = c.info.Unusable();
    absl::StrAppend(&found, "\n  ", c.info.platform_index, ":", c.info.device_index, " ",
                    c.info.Describe(), why.empty() ? "" : absl::StrCat(" -- unusable: ", why));
  }
  const char* env = std::getenv("KILN_XPU_DEVICE");
  KILN_ASSIGN_OR_RETURN(std::vector<Candidate> chosen,
                        SelectDevices(all, env != nullptr ? env : ""));
  if (chosen.empty()) {
    return NotFound("no usable OpenCL device",
                    all.empty() ? " (no OpenCL platform is installed)" : ":", found);
  }
  std::vector<std::unique_ptr<XpuDevice>> devices;
  for (size_t i = 0; i < chosen.size(); ++i) {
    StatusOr<std::unique_ptr<XpuDevice>> d =
        XpuDevice::Create(chosen[i], static_cast<int>(devices.size()), options);
    if (!d.ok()) {
      spdlog::warn("xpu: skipping {}: {}", chosen[i].info.name, StatusMessage(d.status()));
      continue;
    }
    devices.push_back(*std::move(d));
  }
  if (devices.empty()) return NotFound("no OpenCL device could be opened:", found);
  std::string used;
  for (const auto& d : devices) {
    absl::StrAppend(&used, "\n  ", ToAbsl(d->name()), " = ", d->info().Describe(),
                    d->fp64() ? "" : " [no f64 tensors]",
                    d->command_buffer() ? "" : " [capture: engine recording]");
  }
  spdlog::info("xpu: OpenCL devices found:{}\nxpu: using:{}", found, used);
  return std::make_unique<XpuBackend>(std::move(devices));
}

}  // namespace kiln::xpu
