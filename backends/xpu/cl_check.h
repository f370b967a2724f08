// OpenCL plumbing shared by the xpu backend: the headers at the API level we target, error
// names, and the checks that turn a failed OpenCL call into a Status naming the call, the
// error, the file and the line (never an exit or abort: a daemon keeps serving).
#pragma once

#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 300
#endif
// OpenCL 1.2 devices need clCreateCommandQueue (deprecated in 2.0).
#ifndef CL_USE_DEPRECATED_OPENCL_1_2_APIS
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#endif
#include <CL/cl.h>
#include <CL/cl_ext.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "engine/base/status.h"

namespace kiln::xpu {

// "CL_OUT_OF_RESOURCES", or "CL error -9999" for codes the table does not know.
std::string ClErrorName(cl_int err);

// The Status for a failed call: ResourceExhausted for allocation failures, Internal otherwise.
Status ClError(cl_int err, const char* call, const char* file, int line);

// A stable 64-bit FNV-1a hash (kernel names and on-disk cache keys must not change between
// processes, unlike absl::Hash).
uint64_t StableHash(std::string_view data, uint64_t seed = 1469598103934665603ull);
std::string Hex64(uint64_t v);

}  // namespace kiln::xpu

// Returns a Status from the enclosing function if the OpenCL call fails.
#define KILN_CL(call)                                                       \
  do {                                                                      \
    const cl_int kiln_cl_err_ = (call);                                     \
    if (kiln_cl_err_ != CL_SUCCESS)                                         \
      return ::kiln::xpu::ClError(kiln_cl_err_, #call, __FILE__, __LINE__); \
  } while (0)

// For calls that report errors through an out-parameter: `KILN_CL_ERR(err, "clCreateBuffer")`.
#define KILN_CL_ERR(err, what)                                                             \
  do {                                                                                     \
    if ((err) != CL_SUCCESS) return ::kiln::xpu::ClError((err), what, __FILE__, __LINE__); \
  } while (0)
