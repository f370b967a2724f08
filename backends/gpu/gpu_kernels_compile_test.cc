// Every kernel the cuda backend would build for the op harness' cases — forward and gradient:
// the kernel library, the templates (linear, matmul, attention, training, sampling) and the
// generated kernels — and for SmolLM2's fused step program (Q4_1 and f16 weights) compiles with
// NVRTC for sm_90 (H100; sm_80 too with KILN_HARNESS_FULL=1), through the same program sources
// GpuDevice builds (gpu::ProgramSource). No GPU needed: a compile-only KernelHost collects what the
// device layer declares. Skipped (not passed) without NVRTC.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <set>

#include "backends/builtin.h"
#include "backends/cuda/nvrtc.h"
#include "backends/gpu/gpu_device.h"
#include "engine/compiler/compile.h"
#include "engine/compiler/testing/llama_graph.h"
#include "engine/testing/op_harness.h"

namespace kiln::gpu {
namespace {

class CollectSlot final : public devk::KernelSlot {
 public:
  explicit CollectSlot(std::string name) { name_ = std::move(name); }
};

// Declares like GpuDevice (same names, same sources, same dialect, same fusion) and keeps the
// sources.
class CompileOnlyHost final : public devk::KernelHost, public compiler::Target {
 public:
  CompileOnlyHost() { codegen_.work_group_size = 256; }
  std::string_view name() const override { return "cuda-compile:0"; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t bytes) override {
    std::unique_ptr<backend::Buffer> b = backend::HostMemoryBuffer::Make(this, bytes);
    return b;
  }
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
    return Unimplemented("compile only");
  }
  bool SupportsDType(DType t) const override { return t != DType::kInvalid; }
  const char* kernel_prefix() const override { return "cuda"; }
  compiler::Dialect dialect() const override { return compiler::Dialect::kCuda; }
  bool fp64() const override { return true; }
  size_t max_param_bytes() const override { return 4096; }
  bool HasGemm(DType) const override { return false; }  // compile the GEMM templates too
  const char* blas_name() const override { return "cublas"; }
  devk::KernelSlot* DeclareKernel(std::string_view prefix, std::string_view source) override {
    const std::string name = TemplateKernelName(prefix, source);
    return Add(name, devk::NameKernel(source, name));
  }
  devk::KernelSlot* DeclareGenerated(const compiler::GeneratedKernel& k) override {
    return Add(k.entry, k.code);
  }
  devk::KernelSlot* LibraryKernel(std::string_view name) override {
    library.insert(std::string(name));
    return Add(std::string(name), "");
  }
  bool Resolve(const void* p, void** mem, size_t* offset) const override {
    *mem = const_cast<void*>(p);
    *offset = 0;
    return p != nullptr;
  }
  Status Upload(const backend::Buffer& dst, const void* src, size_t bytes) override {
    std::memcpy(dst.data(), src, bytes);
    return OkStatus();
  }
  void* GetExtension(std::string_view name) override {
    return name == compiler::kTargetExtension ? static_cast<compiler::Target*>(this) : nullptr;
  }
  compiler::FusionCaps caps() const override { return devk::DeviceFusionCaps(max_param_bytes()); }
  Status Prepare(std::span<const backend::KernelRequest> requests) override {
    return devk::DeclareKernels(*this, requests);
  }
  compiler::CompileCounters counters() const override { return {}; }

  std::vector<std::string> kernels;  // sources of generated and templated kernels
  std::set<std::string> entries;     // every declared entry (library ones included)
  std::set<std::string> library;

 private:
  devk::KernelSlot* Add(const std::string& name, std::string source) {
    if (entries.insert(name).second && !source.empty()) kernels.push_back(std::move(source));
    slots_.push_back(std::make_unique<CollectSlot>(name));
    return slots_.back().get();
  }
  std::vector<std::unique_ptr<CollectSlot>> slots_;
};

TEST(GpuKernelsCompileTest, EveryHarnessKernelCompilesForHopperAndAmpere) {
  StatusOr<const cuda::Nvrtc*> nvrtc = cuda::Nvrtc::Load();
  if (!nvrtc.ok()) GTEST_SKIP() << "NVRTC not installed: " << nvrtc.status().message();
  CompileOnlyHost host;
  int cases = 0;
  for (bool gradient : {false, true}) {
    for (const harness::OpCase& c :
         gradient ? harness::GradientCases(false) : harness::ForwardCases(false)) {
      (void)harness::CompileCase(c, gradient, host);  // declares; errors are the harness' to find
      ++cases;
    }
  }
  const size_t harness_kernels = host.kernels.size();
  // SmolLM2-135M's step program as serving compiles it (fused; 2 layers compile the kernels of
  // 30), with Q4_1 (the default GGUF) and f16 weights.
  for (DType w : {DType::kQ4_1, DType::kF16}) {
    compiler::testing::LlamaConfig c;
    c.layers = 2;
    c.dim = 576;
    c.heads = 9;
    c.kv_heads = 3;
    c.head_dim = 64;
    c.ffn = 1536;
    c.vocab = 49152;
    c.weight_dtype = w;
    StatusOr<compiler::testing::LlamaGraph> g = compiler::testing::BuildLlama(c);
    ASSERT_TRUE(g.ok()) << g.status();
    StatusOr<std::unique_ptr<Program>> p = compiler::Compile(g->graph, {g->logits}, host);
    ASSERT_TRUE(p.ok()) << DTypeName(w) << ": " << p.status();
  }
  ASSERT_GT(harness_kernels, 100u);
  EXPECT_GT(host.kernels.size(), harness_kernels)
      << "the step program has fused kernels of its own";
  ASSERT_FALSE(host.library.empty());
  const std::string lib = ProgramSource(true, host.work_group(), {});
  const std::string gen = ProgramSource(false, host.work_group(), host.kernels);
  // H100 by default (~30 s); A100 too with KILN_HARNESS_FULL=1.
  std::vector<std::string> archs = {"sm_90"};
  if (const char* full = std::getenv("KILN_HARNESS_FULL"); full && std::string(full) == "1") {
    archs.push_back("sm_80");
  }
  for (const std::string& arch : archs) {
    StatusOr<std::string> lib_bin =
        (*nvrtc)->CompileToCubin(lib, "kiln_lib.cu", arch, NvrtcOptions());
    ASSERT_TRUE(lib_bin.ok()) << arch << ": " << lib_bin.status();
    StatusOr<std::string> gen_bin =
        (*nvrtc)->CompileToCubin(gen, "kiln_gen.cu", arch, NvrtcOptions());
    ASSERT_TRUE(gen_bin.ok()) << arch << ": " << gen_bin.status();
    // Every declared entry point is a symbol of its program's cubin (its ELF string table).
    for (const std::string& e : host.entries) {
      const std::string& bin = host.library.count(e) ? *lib_bin : *gen_bin;
      EXPECT_NE(bin.find(e + std::string(1, '\0')), std::string::npos) << e << " not in the cubin";
    }
  }
  std::printf(
      "NVRTC %s: %zu kernels of %d harness cases, %zu more of SmolLM2's step program (+%zu "
      "library kernels) compiled for %zu architecture(s)\n",
      (*nvrtc)->version().c_str(), harness_kernels, cases, host.kernels.size() - harness_kernels,
      host.library.size(), archs.size());
}

}  // namespace
}  // namespace kiln::gpu
