// OpenCL C on CUDA and HIP: the few OpenCL C names the device kernel library
// (backends/common/cl/*.cl) and the printer's OpenCL-free device dialect rely on, mapped to
// CUDA's — which HIP spells the same (threadIdx, __shared__, __syncthreads, the bit-cast
// intrinsics), as ggml's ggml-cuda/vendors/hip.h relies on. Prepended to every program the gpu
// backend builds, which NVRTC compiles with -default-device (functions without an execution
// space are __device__); under HIP (__HIP__: hiprtc or hipcc) clang's force_cuda_host_device
// pragma does that. So the library's sources are the xpu backend's, unchanged: one kernel
// source for OpenCL, CUDA and HIP. The other vendor branches: the half conversions (PTX's cvt
// on CUDA, clang's _Float16 on HIP) and two names HIP's headers take already (`half`, `__local`).
//
// Semantics kept: OpenCL's `long` is 64 bits (as CUDA's `long` on LP64 hosts); the
// convert_*_sat_rtz conversions truncate, saturate and map NaN to 0; vload_half/vstore_half_rte
// convert exactly / round to nearest even; barrier() synchronizes the block. Only the global,
// local and group ids of dimensions 0..2 exist.
#pragma once

#if defined(__HIP__)
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>  // hiprtc includes it itself
#endif
// Functions without an execution space are __host__ __device__ to the end of the program.
#pragma clang force_cuda_host_device begin
#endif

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
#if defined(__HIP__)
#define half kiln_cl_half  // HIP's hip_fp16.h has a `half` of its own
#endif
typedef unsigned short half;  // storage only (OpenCL without cl_khr_fp16)

#define __kernel extern "C" __global__
#define __global
#undef __local  // hipcc's device library headers define it (an address space)
#define __local __shared__
#define __constant __constant__
#define CLK_LOCAL_MEM_FENCE 1
#define CLK_GLOBAL_MEM_FENCE 2

__device__ __forceinline__ void barrier(int) { __syncthreads(); }

__device__ __forceinline__ long get_local_id(int d) {
  return d == 0 ? threadIdx.x : (d == 1 ? threadIdx.y : threadIdx.z);
}
__device__ __forceinline__ long get_local_size(int d) {
  return d == 0 ? blockDim.x : (d == 1 ? blockDim.y : blockDim.z);
}
__device__ __forceinline__ long get_group_id(int d) {
  return d == 0 ? blockIdx.x : (d == 1 ? blockIdx.y : blockIdx.z);
}
__device__ __forceinline__ long get_num_groups(int d) {
  return d == 0 ? gridDim.x : (d == 1 ? gridDim.y : gridDim.z);
}
__device__ __forceinline__ long get_global_id(int d) {
  return get_group_id(d) * get_local_size(d) + get_local_id(d);
}
__device__ __forceinline__ long get_global_size(int d) {
  return get_num_groups(d) * get_local_size(d);
}

// Bit casts (OpenCL's as_<type> take any type of the same size).
__device__ __forceinline__ float as_float(uint x) { return __uint_as_float(x); }
__device__ __forceinline__ float as_float(int x) { return __int_as_float(x); }
__device__ __forceinline__ uint as_uint(float x) { return __float_as_uint(x); }
__device__ __forceinline__ int as_int(float x) { return __float_as_int(x); }
__device__ __forceinline__ double as_double(long x) { return __longlong_as_double(x); }
__device__ __forceinline__ double as_double(ulong x) { return __longlong_as_double((long long)x); }
__device__ __forceinline__ long as_long(double x) { return __double_as_longlong(x); }
__device__ __forceinline__ ulong as_ulong(double x) { return (ulong)__double_as_longlong(x); }

// Half storage: exact widening, narrowing rounded to nearest even.
#if defined(__HIP__)
__device__ __forceinline__ float vload_half(long i, const half* p) {
  return (float)__builtin_bit_cast(_Float16, p[i]);
}
__device__ __forceinline__ void vstore_half_rte(float v, long i, half* p) {
  p[i] = __builtin_bit_cast(unsigned short, (_Float16)v);
}
#else
__device__ __forceinline__ float vload_half(long i, const half* p) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i]));
  return f;
}
__device__ __forceinline__ void vstore_half_rte(float v, long i, half* p) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  p[i] = h;
}
#endif

// Saturating conversions toward zero; NaN gives 0.
#define KILN_CL_SAT(NAME, T, LO, HI)                                           \
  __device__ __forceinline__ T NAME(double v) {                                \
    if (v != v) return 0;                                                      \
    const double t = trunc(v);                                                 \
    return t <= (double)(LO) ? (T)(LO) : (t >= (double)(HI) ? (T)(HI) : (T)t); \
  }                                                                            \
  __device__ __forceinline__ T NAME(float v) { return NAME((double)v); }
KILN_CL_SAT(convert_char_sat_rtz, signed char, -128, 127)
KILN_CL_SAT(convert_uchar_sat_rtz, uchar, 0, 255)
KILN_CL_SAT(convert_short_sat_rtz, short, -32768, 32767)
KILN_CL_SAT(convert_int_sat_rtz, int, -2147483648.0, 2147483647)
#undef KILN_CL_SAT
__device__ __forceinline__ long convert_long_sat_rtz(double v) {
  if (v != v) return 0;
  const double t = trunc(v);
  if (t >= 9223372036854775808.0) return 9223372036854775807L;
  if (t <= -9223372036854775808.0) return -9223372036854775807L - 1L;
  return (long)t;
}
__device__ __forceinline__ long convert_long_sat_rtz(float v) {
  return convert_long_sat_rtz((double)v);
}

template <typename T>
__device__ __forceinline__ T clamp(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// Sub-groups: a CUDA warp (32 lanes) or a HIP wavefront (64 on gfx90a, 32 on gfx1030), KILN_SG
// lanes that exchange registers; sub_group_sum returns the sum over all of them to each lane
// (every lane must call it). Kernels that use them are declared only for devices that report
// the width (KernelHost::linear_lanes).
#if defined(__HIP__)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define KILN_SG __AMDGCN_WAVEFRONT_SIZE
#else
#define KILN_SG 64  // hipcc's host pass, which compiles no kernel body
#endif
template <typename T>
__device__ __forceinline__ T sub_group_sum(T v) {
  for (int o = KILN_SG / 2; o > 0; o >>= 1) v += __shfl_xor(v, o);
  return v;
}
#else
#define KILN_SG 32
template <typename T>
__device__ __forceinline__ T sub_group_sum(T v) {
  for (int o = KILN_SG / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
#endif

#ifndef NAN
#define NAN __int_as_float(0x7fc00000)
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
