// The HIP half of gpu_kernels_compile_test: every kernel a GPU device would build for the op
// harness' cases (forward and gradient: the kernel library, the templates, the generated
// kernels), for SmolLM2's fused step program and for a LoRA training step (forward, backward,
// optimizer) compiles as HIP for gfx90a (MI200; gfx1030 too with KILN_HARNESS_FULL=1) — the
// OpenCL C library through cl/cuda_compat.h, the generated kernels in the printer's HIP dialect
// — with hiprtc, in process, as a runtime HIP backend would; with hipcc where hiprtc is missing.
// The kernel set is gpu_kernels_compile_test's (backends/common/testing/kernel_set.h). No GPU
// needed; skipped (not passed) without hiprtc and hipcc.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string_view>

#include "backends/common/testing/kernel_set.h"
#include "backends/rocm/hipcc.h"
#include "backends/rocm/hiprtc.h"

namespace kiln::rocm {
namespace {

using devk::testing::CompileOnlyHost;

// hiprtc's options besides the architecture: cuda_compat.h's #pragma once is in the main file.
const std::vector<std::string> kOptions = {"-O3", "-Wno-pragma-once-outside-header"};
// The harness-only kernels (most of the source): the same code at -O1.
const std::vector<std::string> kHarnessOptions = {"-O1", "-Wno-pragma-once-outside-header"};

TEST(HipKernelsCompileTest, EveryHarnessKernelAndStepProgramCompilesForGfx90a) {
  StatusOr<const Hiprtc*> rtc = Hiprtc::Load();
  std::string compiler;
  if (rtc.ok()) {
    compiler = StrCat("hiprtc (", (*rtc)->path(), ", hiprtcVersion ", (*rtc)->version(), ")");
  } else if (StatusOr<std::string> hipcc = FindHipcc(&compiler); !hipcc.ok()) {
    GTEST_SKIP() << "neither hiprtc nor hipcc installed: " << rtc.status().message() << "; "
                 << hipcc.status().message();
  }
  CompileOnlyHost host(compiler::Dialect::kHip, "hip");
  const auto t0 = std::chrono::steady_clock::now();
  StatusOr<devk::testing::KernelSetCounts> n = devk::testing::DeclareKernelSet(host);
  ASSERT_TRUE(n.ok()) << n.status();
  const double declare_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // gfx90a by default; gfx1030 (RDNA2) too with KILN_HARNESS_FULL=1.
  std::vector<std::string> archs = {"gfx90a"};
  if (const char* full = std::getenv("KILN_HARNESS_FULL");
      full != nullptr && std::string_view(full) == "1") {
    archs.push_back("gfx1030");
  }
  for (const std::string& arch : archs) {
    for (const devk::testing::KernelProgram& p : devk::testing::KernelPrograms(host, *n)) {
      StatusOr<std::string> co = rtc.ok()
                                     ? (*rtc)->Compile(p.source, p.name + ".hip", arch,
                                                       p.harness_only ? kHarnessOptions : kOptions)
                                     : CompileCodeObject(p.source, {arch});
      ASSERT_TRUE(co.ok()) << arch << ", " << p.name << ": " << co.status();
      // Every declared entry point is a symbol of its program's code object.
      for (const std::string& e : p.entries) {
        EXPECT_NE(co->find(e + std::string(1, '\0')), std::string::npos)
            << e << " not in " << p.name << "'s code object";
      }
    }
  }
  std::printf(
      "%s: %zu kernels of SmolLM2's step program, %zu more of %s's LoRA training step, %zu more "
      "of %d harness cases (+%zu library kernels) compiled for %zu architecture(s) in %.1f s "
      "(%.1f s declaring)\n",
      compiler.c_str(), n->step_kernels, n->training_kernels, n->training_model.c_str(),
      n->harness_kernels, n->harness_cases, host.library.size(), archs.size(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), declare_s);
}

TEST(HipKernelsCompileTest, HiprtcErrorsCarryTheLog) {
  StatusOr<const Hiprtc*> rtc = Hiprtc::Load();
  if (!rtc.ok()) GTEST_SKIP() << "hiprtc not installed: " << rtc.status().message();
  StatusOr<std::string> co = (*rtc)->Compile(
      "extern \"C\" __global__ void k() { undefined_thing(); }", "bad.hip", "gfx90a");
  ASSERT_FALSE(co.ok());
  EXPECT_NE(std::string(co.status().message()).find("undefined_thing"), std::string::npos)
      << co.status();
}

}  // namespace
}  // namespace kiln::rocm
