// Devices for the engine's own tests.
//
// The engine depends only on the backend interface (engine/backend/); it never includes a
// backend. Its tests still run on real devices: this header declares how a test gets one, and
// the test binary links the definitions from backends/ (library kiln_test_devices,
// backends/testing/test_devices.cc). Nothing outside tests uses it.
//
// Thread-safety: each call makes an independent backend; thread-safe.
#pragma once

#include <memory>
#include <string_view>

#include "engine/backend/backend.h"

namespace kiln {

// A new built-in backend, owned by the caller: "ref" (the reference kernels, the oracle),
// "cpu" (with `threads` pool threads; 0: the default) or "xpu" (the OpenCL backend; null when
// the build or the machine has no usable OpenCL device: such tests GTEST_SKIP). REQUIRES: one
// of those names (a programmer error otherwise: aborts with a message).
std::unique_ptr<backend::Backend> MakeTestBackend(std::string_view name, int threads = 0);

}  // namespace kiln
