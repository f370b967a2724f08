// The backends built into every Kiln binary:
//
//   ref  the reference backend: plain loops for every op, single-threaded. The oracle the op
//        harness checks every other backend against; always registered.
//   cpu  the CPU backend, always present as the fallback device. In this version it runs
//        pointwise and reduction ops by interpreting their expression forms (split over a
//        persistent thread pool) and everything else with the reference kernels; generated
//        and library kernels replace both (issue 4). Threads: KILN_CPU_THREADS (default:
//        hardware concurrency, at most 8).
//
// The factories are thread-safe; each call makes an independent backend with its own device.
#pragma once

#include <memory>

#include "backends/backend.h"

namespace kiln::backend {

std::unique_ptr<Backend> MakeRefBackend();
std::unique_ptr<Backend> MakeCpuBackend(int threads = 0);  // 0: from KILN_CPU_THREADS / cores

}  // namespace kiln::backend
