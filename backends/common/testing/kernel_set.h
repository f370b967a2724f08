// The kernels a GPU device (CUDA or HIP) would build for the op harness, SmolLM2's serving step
// and a LoRA training step, gathered without a device: what the kernel compile tests
// (backends/gpu/gpu_kernels_compile_test.cc with NVRTC, backends/rocm/hip_kernels_compile_test.cc
// with hiprtc) compile for their architectures.
//
// CompileOnlyHost declares like GpuDevice (same names, sources, fusion caps) in the dialect it is
// given and keeps the sources; its buffers are host memory and its streams host streams, so
// models bind their weights and nothing runs. Test-only (it links the harness and the trainer).
//
// Thread-safety: a CompileOnlyHost is used by one thread.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backends/common/device_kernels.h"
#include "engine/base/status.h"

namespace kiln::devk::testing {

class CompileOnlyHost final : public KernelHost, public compiler::Target {
 public:
  // `dialect`: kCuda or kHip (generated kernels); `prefix`: the templates' name prefix.
  CompileOnlyHost(compiler::Dialect dialect, const char* prefix);
  ~CompileOnlyHost() override;

  std::string_view name() const override { return name_; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t bytes) override;
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override;
  bool SupportsDType(DType t) const override { return t != DType::kInvalid; }
  const char* kernel_prefix() const override { return prefix_; }
  compiler::Dialect dialect() const override { return dialect_; }
  bool fp64() const override { return true; }
  size_t max_param_bytes() const override { return 4096; }
  bool element_block_weights() const override { return true; }  // as GpuDevice
  // A warp, or a gfx90a wavefront (the kernels take the width from the compiler there).
  int linear_lanes() const override { return dialect_ == compiler::Dialect::kHip ? 64 : 32; }
  bool HasGemm(DType) const override { return false; }  // compile the GEMM templates too
  const char* blas_name() const override { return "none"; }
  KernelSlot* DeclareKernel(std::string_view prefix, std::string_view source) override;
  KernelSlot* DeclareGenerated(const compiler::GeneratedKernel& k) override;
  KernelSlot* LibraryKernel(std::string_view name) override;
  bool Resolve(const void* p, void** mem, size_t* offset) const override;
  Status Upload(const backend::Buffer& dst, const void* src, size_t bytes) override;
  void* GetExtension(std::string_view name) override;
  compiler::FusionCaps caps() const override { return DeviceFusionCaps(max_param_bytes()); }
  Status Prepare(std::span<const backend::KernelRequest> requests) override {
    return DeclareKernels(*this, requests);
  }
  compiler::CompileCounters counters() const override { return {}; }

  std::vector<std::string> kernels;         // sources of generated and templated kernels, in order
  std::vector<std::string> kernel_entries;  // the entry of each of `kernels`
  std::set<std::string> entries;            // every declared entry (library ones included)
  std::set<std::string> library;            // entries of the kernel library

 private:
  KernelSlot* Add(const std::string& name, std::string source);
  const compiler::Dialect dialect_;
  const char* const prefix_;
  const std::string name_;
  std::vector<std::unique_ptr<KernelSlot>> slots_;
};

struct KernelSetCounts {
  size_t step_kernels = 0;      // kernels of SmolLM2's fused serving step (Q4_1 and f16 weights)
  size_t training_kernels = 0;  // more of the LoRA training step
  std::string training_model;   // the model the training step is of
  int harness_cases = 0;        // forward and gradient cases declared
  size_t harness_kernels = 0;   // more of the harness cases
};

// Declares on `host`, in this order: SmolLM2-135M's serving step program as serving compiles
// it (fused; 2 layers declare the kernels of 30) with Q4_1 and f16 weights; the training step
// (forward, backward, AdamW; LoRA on every linear layer) of the default SmolLM2 GGUF
// (.kiln/models, models/io/test_paths.h) or, without it, of the tiny fixture
// tests/fixtures/models/llama_gqa_f32; then every op-harness case (forward and gradient; errors
// are the harness's to find). So `host.kernels` starts with every kernel the two model steps
// run. Errors: a step program that does not compile; a step without kernels of its own, no
// more than 100 further harness kernels, or no library kernel.
StatusOr<KernelSetCounts> DeclareKernelSet(CompileOnlyHost& host);

// One program a GPU device would build from what `host` declared (GpuProgramSource in `host`'s
// dialect) and the entries it must define.
struct KernelProgram {
  std::string name;  // file name for the compiler's messages
  std::string source;
  std::vector<std::string> entries;  // each must be a symbol of the compiled code object
  bool harness_only = false;         // kernels only the op harness declared
};

// The kernel library; the kernels of the two model steps; the rest of the harness' kernels.
// The compile tests build the first two with the runtime's own options and may build the
// harness-only program with cheaper ones: it is most of the compile time.
std::vector<KernelProgram> KernelPrograms(const CompileOnlyHost& host, const KernelSetCounts& n);

}  // namespace kiln::devk::testing
