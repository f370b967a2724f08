// The GPU runtime the gpu backend is compiled against: the CUDA runtime, or HIP's when the
// sources are compiled as the HIP backend (KILN_GPU_HIP=1, backends/gpu/CMakeLists.txt). The
// backend is written against CUDA's names; for HIP this header maps each name it uses to HIP's
// (as ggml's vendors/hip.h does), and the few calls whose signatures differ go through the
// kiln::gpu::rt wrappers below, which both builds use.
//
//   rt::LoadModule          a compiled code object (cubin / HSA code object) as a module
//   rt::GetKernel           a kernel of a module by name
//   rt::Launch              a kernel launch (grid, block, arguments, stream)
//   rt::UnloadModule
//   rt::Instantiate         a captured graph as an executable graph
//
// Errors name the call: the wrappers' real names are rt::k*Call; other calls are named as the
// source spells them (their CUDA names, in both builds).
#pragma once

#include <cstddef>

#if KILN_GPU_HIP
#include <hip/hip_runtime_api.h>

// Types and constants.
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorMemoryAllocation hipErrorOutOfMemory
#define cudaErrorNotReady hipErrorNotReady
#define cudaStream_t hipStream_t
#define cudaEvent_t hipEvent_t
#define cudaGraph_t hipGraph_t
#define cudaGraphExec_t hipGraphExec_t
#define cudaDeviceProp hipDeviceProp_t
#define cudaStreamCaptureStatus hipStreamCaptureStatus
#define cudaStreamCaptureStatusNone hipStreamCaptureStatusNone
#define cudaStreamCaptureModeRelaxed hipStreamCaptureModeRelaxed
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaHostAllocPortable hipHostMallocPortable
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
// Calls with the same arguments.
#define cudaGetLastError hipGetLastError
#define cudaGetErrorName hipGetErrorName
#define cudaGetErrorString hipGetErrorString
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaDriverGetVersion hipDriverGetVersion
#define cudaRuntimeGetVersion hipRuntimeGetVersion
#define cudaSetDevice hipSetDevice
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaHostAlloc hipHostMalloc
#define cudaFreeHost hipHostFree
#define cudaMemGetInfo hipMemGetInfo
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaStreamIsCapturing hipStreamIsCapturing
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDestroy hipEventDestroy
#define cudaEventRecord hipEventRecord
#define cudaEventQuery hipEventQuery
#define cudaEventSynchronize hipEventSynchronize
#define cudaGraphDestroy hipGraphDestroy
#define cudaGraphExecDestroy hipGraphExecDestroy
#define cudaGraphLaunch hipGraphLaunch
#else
#include <cuda_runtime_api.h>
#endif

namespace kiln::gpu::rt {

#if KILN_GPU_HIP
using Module = hipModule_t;
inline constexpr const char* kLoadModuleCall = "hipModuleLoadData";
inline constexpr const char* kGetKernelCall = "hipModuleGetFunction";
inline constexpr const char* kLaunchCall = "hipModuleLaunchKernel";
inline constexpr const char* kInstantiateCall = "hipGraphInstantiate";
inline constexpr const char* kDeviceCountCall = "hipGetDeviceCount";
using Function = hipFunction_t;

inline hipError_t LoadModule(Module* m, const void* image) { return hipModuleLoadData(m, image); }
inline hipError_t GetKernel(Function* f, Module m, const char* name) {
  return hipModuleGetFunction(f, m, name);
}
inline hipError_t UnloadModule(Module m) { return hipModuleUnload(m); }
inline hipError_t Launch(Function f, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                         hipStream_t stream) {
  return hipModuleLaunchKernel(f, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                               static_cast<unsigned>(shared_bytes), stream, args, nullptr);
}
inline hipError_t Instantiate(hipGraphExec_t* exec, hipGraph_t graph) {
  return hipGraphInstantiate(exec, graph, nullptr, nullptr, 0);
}
// Errors that mean "no GPU here" rather than a failure.
inline bool IsNoDevice(hipError_t e) {
  return e == hipErrorNoDevice || e == hipErrorInsufficientDriver || e == hipErrorNotInitialized;
}
#else
using Module = cudaLibrary_t;
inline constexpr const char* kLoadModuleCall = "cudaLibraryLoadData";
inline constexpr const char* kGetKernelCall = "cudaLibraryGetKernel";
inline constexpr const char* kLaunchCall = "cudaLaunchKernel";
inline constexpr const char* kInstantiateCall = "cudaGraphInstantiate";
inline constexpr const char* kDeviceCountCall = "cudaGetDeviceCount";
using Function = cudaKernel_t;

inline cudaError_t LoadModule(Module* m, const void* image) {
  return cudaLibraryLoadData(m, image, nullptr, nullptr, 0, nullptr, nullptr, 0);
}
inline cudaError_t GetKernel(Function* f, Module m, const char* name) {
  return cudaLibraryGetKernel(f, m, name);
}
inline cudaError_t UnloadModule(Module m) { return cudaLibraryUnload(m); }
inline cudaError_t Launch(Function f, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                          cudaStream_t stream) {
  return cudaLaunchKernel(reinterpret_cast<const void*>(f), grid, block, args, shared_bytes,
                          stream);
}
inline cudaError_t Instantiate(cudaGraphExec_t* exec, cudaGraph_t graph) {
  return cudaGraphInstantiate(exec, graph, 0);
}
inline bool IsNoDevice(cudaError_t e) {
  return e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorStubLibrary ||
         e == cudaErrorInitializationError || e == cudaErrorDevicesUnavailable;
}
#endif

}  // namespace kiln::gpu::rt
