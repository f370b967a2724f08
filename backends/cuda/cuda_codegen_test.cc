// The CUDA printer's output compiles: every sample kernel (every op's expression form, fused
// groups of Llama blocks at f32/f16/bf16 and other patterns) through NVRTC, for A100
// (compute_80; H100 compute_90 too with KILN_HARNESS_FULL=1). No GPU needed; skipped (not passed)
// without NVRTC. The device skeleton's numerics are checked on PoCL, where the xpu backend runs
// the same printer's OpenCL dialect in production (xpu_harness_test, xpu_compiler_test).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string_view>

#include "absl/strings/str_join.h"
#include "backends/cuda/nvrtc.h"
#include "engine/compiler/codegen.h"
#include "engine/compiler/testing/samples.h"

namespace kiln::cuda {
namespace {

using compiler::Dialect;
using compiler::GeneratedKernel;

TEST(CudaCodegenTest, SampleKernelsCompileWithNvrtc) {
  StatusOr<const Nvrtc*> nvrtc = Nvrtc::Load();
  if (!nvrtc.ok()) GTEST_SKIP() << "NVRTC not installed: " << nvrtc.status().message();
  std::vector<GeneratedKernel> ks;
  int skipped = 0, fused = 0, training = 0;
  for (const compiler::testing::Sample& s : compiler::testing::SampleSpecs()) {
    if (s.spec.kind == compiler::KernelKind::kGemmEpilogue) {
      ++skipped;  // GEMM epilogues are C++ only (a device GEMM would take them as functions)
      continue;
    }
    StatusOr<GeneratedKernel> k = compiler::GenerateKernel(s.spec, Dialect::kCuda);
    ASSERT_TRUE(k.ok()) << s.label << ": " << k.status();
    fused += s.label.rfind("fused", 0) == 0;
    training += s.label.find("training step") != std::string::npos;
    ks.push_back(*std::move(k));
  }
  ASSERT_GT(ks.size(), 100u);
  EXPECT_GT(training, 5) << "the training step's backward kernels are among the samples";
  const std::string src = compiler::ModuleSource(Dialect::kCuda, ks);
  // One architecture by default (~10 s); A100 and H100 with KILN_HARNESS_FULL=1.
  const char* full = std::getenv("KILN_HARNESS_FULL");
  std::vector<std::string> archs = {"compute_80"};
  if (full != nullptr && std::string_view(full) == "1") archs.push_back("compute_90");
  for (const std::string& arch : archs) {
    StatusOr<std::string> ptx = (*nvrtc)->CompileToPtx(src, "kiln_samples.cu", arch);
    ASSERT_TRUE(ptx.ok()) << ptx.status();
    for (const GeneratedKernel& k : ks) {
      EXPECT_NE(ptx->find(".entry " + k.entry), std::string::npos) << k.entry << " not in the PTX";
    }
  }
  std::printf(
      "NVRTC %s (%s): %zu kernels compiled for %s (%d fused, %d of a training step); skipped %d "
      "GEMM "
      "epilogues (no device form)\n",
      (*nvrtc)->version().c_str(), (*nvrtc)->path().c_str(), ks.size(),
      absl::StrJoin(archs, ", ").c_str(), fused, training, skipped);
}

TEST(CudaCodegenTest, CompileErrorsCarryTheLog) {
  StatusOr<const Nvrtc*> nvrtc = Nvrtc::Load();
  if (!nvrtc.ok()) GTEST_SKIP() << "NVRTC not installed: " << nvrtc.status().message();
  StatusOr<std::string> ptx = (*nvrtc)->CompileToPtx(
      "extern \"C\" __global__ void k() { undefined_thing(); }", "bad.cu", "compute_80");
  ASSERT_FALSE(ptx.ok());
  EXPECT_NE(std::string(ptx.status().message()).find("undefined_thing"), std::string::npos)
      << ptx.status();
}

}  // namespace
}  // namespace kiln::cuda
