// Every kernel the cuda backend would build for the op harness' cases — forward and gradient:
// the kernel library, the templates (linear, matmul, attention, training, sampling) and the
// generated kernels — for SmolLM2's fused step program (Q4_1 and f16 weights) and for a LoRA
// training step (forward, backward, optimizer) compiles with NVRTC for sm_90 (H100; sm_80 too
// with KILN_HARNESS_FULL=1), through the same program sources GpuDevice builds
// (devk::GpuProgramSource), in three programs: the library and the two model steps' kernels
// with the runtime's NVRTC options, the rest of the harness' with fast-compile. No GPU needed: a
// compile-only KernelHost collects what the device layer declares
// (backends/common/testing/kernel_set.h; hip_kernels_compile_test compiles the same set as HIP).
// Skipped (not passed) without NVRTC.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "backends/common/testing/kernel_set.h"
#include "backends/cuda/nvrtc.h"
#include "backends/gpu/gpu_device.h"

namespace kiln::gpu {
namespace {

using devk::testing::CompileOnlyHost;

TEST(GpuKernelsCompileTest, EveryHarnessKernelCompilesForHopperAndAmpere) {
  StatusOr<const cuda::Nvrtc*> nvrtc = cuda::Nvrtc::Load();
  if (!nvrtc.ok()) GTEST_SKIP() << "NVRTC not installed: " << nvrtc.status().message();
  CompileOnlyHost host(compiler::Dialect::kCuda, "cuda");
  const auto t0 = std::chrono::steady_clock::now();
  StatusOr<devk::testing::KernelSetCounts> n = devk::testing::DeclareKernelSet(host);
  ASSERT_TRUE(n.ok()) << n.status();
  // H100 by default; A100 too with KILN_HARNESS_FULL=1.
  std::vector<std::string> archs = {"sm_90"};
  if (const char* full = std::getenv("KILN_HARNESS_FULL"); full && std::string(full) == "1") {
    archs.push_back("sm_80");
  }
  // The library and the model steps' kernels with the runtime's options. The harness-only
  // kernels (most of the source) at NVRTC's mildest fast-compile level: it parses, checks and
  // assembles the same code with fewer expensive optimisations, 106 s -> 31 s here.
  for (const std::string& arch : archs) {
    for (const devk::testing::KernelProgram& p : devk::testing::KernelPrograms(host, *n)) {
      std::vector<std::string> options = NvrtcOptions();
      if (p.harness_only) options.push_back("--Ofast-compile=min");
      StatusOr<std::string> bin = (*nvrtc)->CompileToCubin(p.source, p.name + ".cu", arch, options);
      ASSERT_TRUE(bin.ok()) << arch << ", " << p.name << ": " << bin.status();
      // Every declared entry point is a symbol of its program's cubin (its ELF string table).
      for (const std::string& e : p.entries) {
        EXPECT_NE(bin->find(e + std::string(1, '\0')), std::string::npos)
            << e << " not in " << p.name << "'s cubin";
      }
    }
  }
  std::printf(
      "NVRTC %s: %zu kernels of SmolLM2's step program, %zu more of %s's LoRA training step, "
      "%zu more of %d harness cases (+%zu library kernels) compiled for %zu architecture(s) in "
      "%.1f s\n",
      (*nvrtc)->version().c_str(), n->step_kernels, n->training_kernels, n->training_model.c_str(),
      n->harness_kernels, n->harness_cases, host.library.size(), archs.size(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace
}  // namespace kiln::gpu
