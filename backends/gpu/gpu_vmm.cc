#include "backends/gpu/gpu_vmm.h"

#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"

#if KILN_GPU_HIP
#include "backends/gpu/gpu_runtime.h"

// HIP: the runtime has the virtual memory calls itself (hipMemCreate, hipMemMap, ...).
namespace kiln::gpu {

struct ExpandableSegment::Api {};

namespace {

hipMemAllocationProp DeviceProp(int ordinal) {
  hipMemAllocationProp prop = {};
  prop.type = hipMemAllocationTypePinned;
  prop.location.type = hipMemLocationTypeDevice;
  prop.location.id = ordinal;
  return prop;
}

void* Ptr(unsigned long long p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

}  // namespace

StatusOr<std::unique_ptr<ExpandableSegment>> ExpandableSegment::Create(int ordinal,
                                                                       uint64_t reserve_bytes) {
  static const Api api;
  // HIP 5.2 has no attribute for virtual memory management: a device without it fails the
  // first call below.
  std::unique_ptr<ExpandableSegment> s(new ExpandableSegment());
  s->api_ = &api;
  s->ordinal_ = ordinal;
  const hipMemAllocationProp prop = DeviceProp(ordinal);
  size_t g = 0;
  if (hipError_t r =
          hipMemGetAllocationGranularity(&g, &prop, hipMemAllocationGranularityRecommended);
      r != hipSuccess || g == 0) {
    return Unavailable("expandable segments: hipMemGetAllocationGranularity: ", hipGetErrorName(r));
  }
  s->granularity_ = g;
  s->reserved_ = (reserve_bytes + g - 1) / g * g;
  void* base = nullptr;
  if (hipError_t r = hipMemAddressReserve(&base, s->reserved_, g, nullptr, 0); r != hipSuccess) {
    return Unavailable("expandable segments: hipMemAddressReserve of ", s->reserved_,
                       " bytes: ", hipGetErrorName(r));
  }
  s->base_ = reinterpret_cast<uintptr_t>(base);
  return s;
}

ExpandableSegment::~ExpandableSegment() {
  if (api_ == nullptr || base_ == 0) return;
  uint64_t offset = 0;
  for (const auto& [size, handle] : chunks_) {
    (void)hipMemUnmap(Ptr(base_ + offset), size);
    (void)hipMemRelease(reinterpret_cast<hipMemGenericAllocationHandle_t>(handle));
    offset += size;
  }
  (void)hipMemAddressFree(Ptr(base_), reserved_);
}

Status ExpandableSegment::MapTo(uint64_t bytes) {
  if (bytes <= mapped_) return OkStatus();
  if (bytes > reserved_) {
    return InvalidArgument("expandable segment: ", bytes, " bytes past its reservation of ",
                           reserved_);
  }
  const uint64_t size = (bytes - mapped_ + granularity_ - 1) / granularity_ * granularity_;
  const hipMemAllocationProp prop = DeviceProp(ordinal_);
  hipMemGenericAllocationHandle_t handle = nullptr;
  if (hipError_t r = hipMemCreate(&handle, size, &prop, 0); r != hipSuccess) {
    if (r == hipErrorOutOfMemory) {
      return ResourceExhausted("hipMemCreate of ", size, " bytes: ", hipGetErrorName(r));
    }
    return Internal("hipMemCreate of ", size, " bytes: ", hipGetErrorName(r));
  }
  void* at = Ptr(base_ + mapped_);
  if (hipError_t r = hipMemMap(at, size, 0, handle, 0); r != hipSuccess) {
    (void)hipMemRelease(handle);
    return Internal("hipMemMap of ", size, " bytes: ", hipGetErrorName(r));
  }
  hipMemAccessDesc access = {};
  access.location = prop.location;
  access.flags = hipMemAccessFlagsProtReadWrite;
  if (hipError_t r = hipMemSetAccess(at, size, &access, 1); r != hipSuccess) {
    (void)hipMemUnmap(at, size);
    (void)hipMemRelease(handle);
    return Internal("hipMemSetAccess of ", size, " bytes: ", hipGetErrorName(r));
  }
  chunks_.emplace_back(size, reinterpret_cast<uintptr_t>(handle));
  mapped_ += size;
  return OkStatus();
}

}  // namespace kiln::gpu

#else
#include <cuda.h>
#include <cuda_runtime_api.h>

namespace kiln::gpu {

// The driver entry points, looked up once through the runtime.
struct ExpandableSegment::Api {
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuGetErrorName) error_name = nullptr;
  decltype(&::cuDeviceGetAttribute) attribute = nullptr;
  std::string missing;  // the first entry point that could not be had

  static const Api& Get() {
    static const Api* api = [] {
      auto* a = new Api();
      auto load = [&](const char* symbol, auto* fn) {
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        void* p = nullptr;
        if (cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess || p == nullptr) {
          (void)cudaGetLastError();
          if (a->missing.empty()) a->missing = symbol;
          return;
        }
        *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      };
      load("cuMemGetAllocationGranularity", &a->granularity);
      load("cuMemAddressReserve", &a->reserve);
      load("cuMemAddressFree", &a->address_free);
      load("cuMemCreate", &a->create);
      load("cuMemRelease", &a->release);
      load("cuMemMap", &a->map);
      load("cuMemUnmap", &a->unmap);
      load("cuMemSetAccess", &a->set_access);
      load("cuGetErrorName", &a->error_name);
      load("cuDeviceGetAttribute", &a->attribute);
      return a;
    }();
    return *api;
  }
  std::string Error(CUresult r) const {
    const char* name = nullptr;
    if (error_name != nullptr) error_name(r, &name);
    return name != nullptr ? name : absl::StrCat("CUresult ", static_cast<int>(r));
  }
};

namespace {

CUmemAllocationProp DeviceProp(int ordinal) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  return prop;
}

}  // namespace

StatusOr<std::unique_ptr<ExpandableSegment>> ExpandableSegment::Create(int ordinal,
                                                                       uint64_t reserve_bytes) {
  const Api& api = Api::Get();
  if (!api.missing.empty()) {
    return Unavailable("expandable segments: the driver has no ", api.missing);
  }
  int vmm = 0;  // the runtime's device ordinal is the driver's CUdevice
  if (api.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, ordinal) !=
          CUDA_SUCCESS ||
      vmm == 0) {
    return Unavailable("expandable segments: device ", ordinal,
                       " does not support virtual memory management");
  }
  std::unique_ptr<ExpandableSegment> s(new ExpandableSegment());
  s->api_ = &api;
  s->ordinal_ = ordinal;
  const CUmemAllocationProp prop = DeviceProp(ordinal);
  size_t g = 0;
  if (CUresult r = api.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
      r != CUDA_SUCCESS || g == 0) {
    return Unavailable("expandable segments: cuMemGetAllocationGranularity: ", api.Error(r));
  }
  s->granularity_ = g;
  s->reserved_ = (reserve_bytes + g - 1) / g * g;
  CUdeviceptr base = 0;
  if (CUresult r = api.reserve(&base, s->reserved_, g, 0, 0); r != CUDA_SUCCESS) {
    return Unavailable("expandable segments: cuMemAddressReserve of ", s->reserved_,
                       " bytes: ", api.Error(r));
  }
  s->base_ = base;
  return s;
}

ExpandableSegment::~ExpandableSegment() {
  if (api_ == nullptr || base_ == 0) return;
  uint64_t offset = 0;
  for (const auto& [size, handle] : chunks_) {
    api_->unmap(base_ + offset, size);
    api_->release(handle);
    offset += size;
  }
  api_->address_free(base_, reserved_);
}

Status ExpandableSegment::MapTo(uint64_t bytes) {
  if (bytes <= mapped_) return OkStatus();
  if (bytes > reserved_) {
    return InvalidArgument("expandable segment: ", bytes, " bytes past its reservation of ",
                           reserved_);
  }
  const uint64_t size = (bytes - mapped_ + granularity_ - 1) / granularity_ * granularity_;
  const CUmemAllocationProp prop = DeviceProp(ordinal_);
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = api_->create(&handle, size, &prop, 0); r != CUDA_SUCCESS) {
    const std::string why = api_->Error(r);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      return ResourceExhausted("cuMemCreate of ", size, " bytes: ", why);
    }
    return Internal("cuMemCreate of ", size, " bytes: ", why);
  }
  const CUdeviceptr at = base_ + mapped_;
  if (CUresult r = api_->map(at, size, 0, handle, 0); r != CUDA_SUCCESS) {
    api_->release(handle);
    return Internal("cuMemMap of ", size, " bytes: ", api_->Error(r));
  }
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = api_->set_access(at, size, &access, 1); r != CUDA_SUCCESS) {
    api_->unmap(at, size);
    api_->release(handle);
    return Internal("cuMemSetAccess of ", size, " bytes: ", api_->Error(r));
  }
  chunks_.emplace_back(size, handle);
  mapped_ += size;
  return OkStatus();
}

}  // namespace kiln::gpu

#endif  // KILN_GPU_HIP
