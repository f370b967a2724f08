// Attention speed on a CUDA GPU: cuDNN SDPA (backends/gpu/gpu_sdpa.h) forward and backward,
// causal bf16, against Kiln's own attention kernel (the engine's attention op on the `cuda`
// backend, which runs the shared template unless KILN_CUDNN_SDPA=1) on the same problem, in the
// same run. Prints milliseconds, TFLOP/s and the fraction of the GPU's peak dense bf16 rate.
//
//   build/tests/bench/gpu_sdpa_bench [--iters N] [--peak-tflops X]
//
// FLOPs are counted as FlashAttention's benchmarks count them: a forward is two matrix
// products, 4·B·H·T·S·D, halved for a causal mask; a backward is 2.5 forwards (five products).
// The peak is the data sheet's dense bf16 rate for H100/H200 SXM (989.4 TFLOP/s) unless
// --peak-tflops names another. Without a GPU or cuDNN it says so and exits 0.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backends/gpu/gpu_device.h"
#include "backends/gpu/gpu_sdpa.h"
#include "backends/gpu/host_copy.h"
#include "engine/builder.h"
#include "engine/program.h"

namespace kiln::gpu {
namespace {

double Flops(const SdpaKey& k, bool backward) {
  double f = 4.0 * k.batch * k.q_heads * k.q_len * k.kv_len * k.head_dim;
  if (k.causal) f /= 2;
  return backward ? 2.5 * f : f;
}

std::vector<Dim> Dims(const std::vector<int64_t>& shape) {
  return std::vector<Dim>(shape.begin(), shape.end());
}

// Median milliseconds of `iters` runs of `fn` on `stream`, timed with CUDA events, after one
// untimed warm-up (which builds graphs and kernels).
template <typename Fn>
double MedianMs(cudaStream_t stream, int iters, Fn fn) {
  if (!fn()) return -1;
  cudaStreamSynchronize(stream);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, stream);
    if (!fn()) return -1;
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void Report(const char* what, const SdpaKey& key, bool backward, double ms, double peak) {
  if (ms < 0) {
    std::printf("  %-34s failed\n", what);
    return;
  }
  const double tflops = Flops(key, backward) / (ms * 1e-3) / 1e12;
  std::printf("  %-34s %9.3f ms  %7.1f TFLOP/s  %5.1f%% of peak\n", what, ms, tflops,
              100 * tflops / peak);
}

int Run(int iters, double peak) {
  auto backend = CreateGpuBackend();
  if (!backend.ok()) {
    std::printf("gpu_sdpa_bench: no CUDA device: %s\n",
                std::string(StatusMessage(backend.status())).c_str());
    return 0;
  }
  auto& dev = static_cast<GpuDevice&>(*(*backend)->device(0));
  std::printf("device: %s; peak dense bf16 %.1f TFLOP/s\n", dev.info().Describe().c_str(), peak);
  if (!SdpaCompiled()) std::printf("cuDNN SDPA: not compiled into this build\n");

  cudaStream_t s = nullptr;
  if (cudaStreamCreate(&s) != cudaSuccess) return 1;
  std::unique_ptr<SdpaRunner> runner;
  if (SdpaCompiled()) {
    auto r = SdpaRunner::Create(s);
    if (r.ok()) {
      runner = *std::move(r);
    } else {
      std::printf("cuDNN SDPA: %s\n", std::string(StatusMessage(r.status())).c_str());
    }
  }
  MallocScratch workspaces;
  const SdpaScratch scratch = workspaces.fn();

  const std::vector<SdpaKey> problems = {
      // The figure: 4k x 4k, head dim 128 (32 query heads, 8 KV heads).
      {.q_heads = 32,
       .kv_heads = 8,
       .q_len = 4096,
       .kv_len = 4096,
       .head_dim = 128,
       .scale = 1 / std::sqrt(128.0f)},
      // SmolLM2-135M's attention (9 heads, 3 KV heads, head dim 64) at a 4k prompt.
      {.q_heads = 9, .kv_heads = 3, .q_len = 4096, .kv_len = 4096, .head_dim = 64, .scale = 0.125f},
  };
  auto io = dev.CreateStream();
  if (!io.ok()) return 1;
  std::mt19937_64 rng(0);
  std::normal_distribution<double> dist(0, 1);
  for (SdpaKey key : problems) {
    key.dtype = DType::kBF16;
    key.causal = true;
    key.stats = true;
    std::printf("%s\n", key.Describe().c_str());
    const std::vector<int64_t> q_shape = {key.batch, key.q_heads, key.q_len, key.head_dim};
    const std::vector<int64_t> kv_shape = {key.batch, key.kv_heads, key.kv_len, key.head_dim};
    auto make = [&](const std::vector<int64_t>& shape) {
      int64_t n = 1;
      for (int64_t x : shape) n *= x;
      std::vector<double> v(n);
      for (double& x : v) x = dist(rng);
      return *DeviceTensor(dev, **io, key.dtype, shape, v);
    };
    const Tensor q = make(q_shape), k = make(kv_shape), v = make(kv_shape), d_o = make(q_shape);
    const Tensor o = *Tensor::Empty(dev, key.dtype, q_shape);
    const Tensor stats = *Tensor::Empty(dev, DType::kF32, {key.batch, key.q_heads, key.q_len});
    const Tensor dq = *Tensor::Empty(dev, key.dtype, q_shape);
    const Tensor dk = *Tensor::Empty(dev, key.dtype, kv_shape);
    const Tensor dv = *Tensor::Empty(dev, key.dtype, kv_shape);
    if (runner) {
      const SdpaForwardArgs fwd = {q.data(), k.data(), v.data(), o.data(),
                                   static_cast<float*>(stats.data())};
      const SdpaBackwardArgs bwd = {q.data(),  k.data(),   v.data(),
                                    o.data(),  d_o.data(), static_cast<const float*>(stats.data()),
                                    dq.data(), dk.data(),  dv.data()};
      // Times one cuDNN call; says why when it fails.
      auto time = [&](const char* what, bool backward, auto call) {
        Status last;
        Report(what, key, backward,
               MedianMs(s, iters,
                        [&] {
                          last = call();
                          return last.ok();
                        }),
               peak);
        if (!last.ok()) std::printf("  cuDNN: %s\n", std::string(StatusMessage(last)).c_str());
      };
      time("cuDNN SDPA forward", false, [&] { return runner->Forward(key, fwd, scratch); });
      time("cuDNN SDPA backward", true, [&] { return runner->Backward(key, bwd, scratch); });
    }

    // Kiln's attention op on the same inputs (its kernel, unless KILN_CUDNN_SDPA=1).
    Graph g;
    Builder b(&g);
    const AttentionOutputs att = b.AttentionWithLse(
        b.Input("q", key.dtype, Dims(q_shape)), b.Input("k", key.dtype, Dims(kv_shape)),
        b.Input("v", key.dtype, Dims(kv_shape)), {key.scale, attn::CausalMask(), {}});
    auto prog = Compile(g, {att.out, att.lse}, dev);
    auto stream = dev.CreateStream();
    if (!prog.ok() || !stream.ok() || !(*prog)->Bind("q", q).ok() || !(*prog)->Bind("k", k).ok() ||
        !(*prog)->Bind("v", v).ok()) {
      std::printf("  Kiln attention op: could not compile or bind\n");
      continue;
    }
    // The op runs on its own stream: time it on the host around a synchronisation.
    auto run = [&] { return (*prog)->Run(**stream).ok() && (*stream)->Synchronize().ok(); };
    if (!run()) {
      std::printf("  Kiln attention op: run failed\n");
      continue;
    }
    std::vector<double> ms;
    for (int i = 0; i < std::min(iters, 3); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    Report("Kiln attention op forward", key, false, ms[ms.size() / 2], peak);
  }
  runner.reset();
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace
}  // namespace kiln::gpu

int main(int argc, char** argv) {
  CLI::App app("cuDNN SDPA and Kiln attention speed on a CUDA GPU");
  int iters = 10;
  double peak = 989.4;
  app.add_option("--iters", iters, "timed runs per figure (median)")->check(CLI::Range(1, 1000));
  app.add_option("--peak-tflops", peak, "the GPU's peak dense bf16 TFLOP/s")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  return kiln::gpu::Run(iters, peak);
}
