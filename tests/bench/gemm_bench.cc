// GEMV/GEMM throughput of the cpu backend's Linear kernels per weight type, beside this
// machine's memory bandwidth measured by the same program (docs/performance.md).
//
//   build/tests/bench/gemm_bench [--benchmark_filter=q4_0] [--threads=2]
//
// BM_MemoryBandwidth: a streaming read of 1 GiB (far beyond L3) on the same threads, as one
// sequential stream per thread and as 8 interleaved streams per thread (the pattern the
// GEMV kernels produce: several weight rows at once); the larger figure is the machine's.
// BM_Throughput/f32_fma, bf16_dot: one core's rate of 512-bit FMAs and of vdpbf16ps;
// avx2_f32_fma, avx2_q8_group: of 256-bit FMAs and of the AVX2 q8 tile's inner step.
// BM_Linear/<weights>/N/K/M/<impl>: y[M, N] = x[M, K] · w[N, K]^T through the kernel the
// cpu backend selects (autotuned: "auto") or a forced implementation, run on the backend's
// thread pool. Decode shapes (M <= 16) rotate over copies of the weights totalling more than
// 256 MiB, so every byte comes from memory as in a real decode step; GB/s counts weight
// bytes per second. KILN_BENCH_HOT=1 uses one copy instead (weights stay in cache where they
// fit): the kernel's compute ceiling, to tell a memory-bound kernel from a compute-bound one.
// Shapes: SmolLM2-135M (K = 576; N = 576, 1536, 49152; N = 192: its k/v projections), the
// fused projections a decode step could run instead (N = 960: q, k and v in one GEMV; N = 3072:
// gate and up), and a 1B model (K = 2048, N = 8192).
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/builtin.h"
#include "backends/cpu/kernels/autotune.h"
#include "backends/cpu/kernels/isa.h"
#include "backends/cpu/kernels/linear.h"
#include "backends/cpu/kernels/select.h"
#include "backends/ref/ref_kernels.h"
#include "engine/builder.h"

namespace kiln {
namespace {

int Threads() {
  const char* t = std::getenv("KILN_CPU_THREADS");
  return t != nullptr && std::atoi(t) > 0 ? std::atoi(t) : 2;
}

struct Free {
  void operator()(void* p) const { std::free(p); }
};
std::unique_ptr<uint8_t, Free> Alloc(size_t n) {
  auto p = std::unique_ptr<uint8_t, Free>(
      static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096)));
  return p;
}

// ---- Memory bandwidth ----------------------------------------------------------------------

__attribute__((target("avx2"))) float ReadStreams(const uint8_t* p, size_t bytes, int streams) {
  // `streams` sequential pointers through consecutive 64 KiB rows, like a GEMV strip.
  const size_t row = 64 << 10;
  __m256 acc[8];
  for (__m256& a : acc) a = _mm256_setzero_ps();
  for (size_t strip = 0; strip + streams * row <= bytes; strip += streams * row) {
    for (size_t i = 0; i < row; i += 128) {
      for (int s = 0; s < streams; ++s) {
        const float* q = reinterpret_cast<const float*>(p + strip + s * row + i);
        for (int u = 0; u < 4; ++u)
          acc[(u + s) & 7] = _mm256_add_ps(acc[(u + s) & 7], _mm256_load_ps(q + 8 * u));
      }
    }
  }
  for (int u = 1; u < 8; ++u) acc[0] = _mm256_add_ps(acc[0], acc[u]);
  float f[8];
  _mm256_storeu_ps(f, acc[0]);
  return f[0];
}

void BM_MemoryBandwidth(benchmark::State& state) {
  const int streams = static_cast<int>(state.range(0));
  const size_t bytes = size_t{1} << 30;
  auto buf = Alloc(bytes);
  std::memset(buf.get(), 1, bytes);
  const int nt = Threads();
  float sink = 0;
  for (auto _ : state) {
    std::vector<std::thread> ts;
    std::vector<float> r(nt);
    for (int t = 0; t < nt; ++t) {
      ts.emplace_back(
          [&, t] { r[t] = ReadStreams(buf.get() + bytes / nt * t, bytes / nt, streams); });
    }
    for (std::thread& t : ts) t.join();
    for (float v : r) sink += v;
  }
  benchmark::DoNotOptimize(sink);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
}

// ---- Instruction throughput -------------------------------------------------------------------

// One core's rate of 512-bit f32 FMAs and of bf16 dot products (vdpbf16ps: 32 multiply-adds
// of bf16 pairs into 16 f32 lanes), 24 independent accumulators each: the compute ceilings of
// an f32 GEMM and of a bf16 one on this CPU (issue 18, item 5). GFLOP/s counts 2 per multiply-
// add.
constexpr int kThroughputAccs = 24;

__attribute__((target("avx512f"))) float SumLanes(const __m512 (&acc)[kThroughputAccs]) {
  alignas(64) float lanes[16];
  __m512 s = acc[0];
  for (int i = 1; i < kThroughputAccs; ++i) s = _mm512_add_ps(s, acc[i]);
  _mm512_store_ps(lanes, s);
  float sum = 0;
  for (float v : lanes) sum += v;
  return sum;
}

__attribute__((target("avx512f"))) float FmaLoop(int64_t n) {
  __m512 acc[kThroughputAccs];
  for (int i = 0; i < kThroughputAccs; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.0f);
  asm("" : "+v"(a), "+v"(b));  // values the compiler cannot fold
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < kThroughputAccs; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  return SumLanes(acc);
}

__attribute__((target("avx512f,avx512bf16"))) float Dpbf16Loop(int64_t n) {
  __m512 acc[kThroughputAccs];
  for (int i = 0; i < kThroughputAccs; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0);
  asm("" : "+v"(a), "+v"(b));  // values the compiler cannot fold
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < kThroughputAccs; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  return SumLanes(acc);
}

// The AVX2 rates behind the q8 path's prefill there (issue 18, item 4): the f32 GEMM's step is
// a 256-bit FMA (8 multiply-adds); the q8 tile's (Q8Tile8, simd_avx2.h) is one group of four
// activation bytes against eight weight rows: a broadcast, maddubs + madd (the group's int32
// dot per row), a conversion and an FMA into the group's accumulator (32 multiply-adds, the
// numerics' one rounding per group). Twelve FMA chains; eight group chains, the tile's count,
// with the weights from L1 as there.
constexpr int kAvx2FmaChains = 12, kQ8Groups = 8;

__attribute__((target("avx2,fma"))) float Avx2FmaLoop(int64_t n) {
  constexpr int kAccs = kAvx2FmaChains;
  __m256 acc[kAccs];
  for (int i = 0; i < kAccs; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0.0f);
  asm("" : "+x"(a), "+x"(b));
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kAccs; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  for (int i = 1; i < kAccs; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  return _mm256_cvtss_f32(acc[0]);
}

__attribute__((target("avx2,fma"))) float Avx2Q8GroupLoop(int64_t n) {
  alignas(32) uint8_t w[kQ8Groups][32];
  alignas(32) int8_t x[32];
  for (int j = 0; j < kQ8Groups; ++j) std::memset(w[j], j + 1, 32);
  for (int i = 0; i < 32; ++i) x[i] = static_cast<int8_t>(i - 16);
  __m256 acc[kQ8Groups];
  for (int j = 0; j < kQ8Groups; ++j) acc[j] = _mm256_setzero_ps();
  __m256 sc = _mm256_set1_ps(1e-6f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < n; ++k) {
    asm("" : "+x"(sc) : "r"(w), "r"(x) : "memory");  // fresh loads each round, as in the tile
#pragma GCC unroll 8
    for (int j = 0; j < kQ8Groups; ++j) {
      int32_t g;
      std::memcpy(&g, x + 4 * j, 4);
      const __m256i p = _mm256_maddubs_epi16(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(w[j])), _mm256_set1_epi32(g));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), sc, acc[j]);
    }
  }
  for (int j = 1; j < kQ8Groups; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  return _mm256_cvtss_f32(acc[0]);
}

// One loop of BM_Throughput: its instructions per round, multiply-adds per instruction (a q8
// group counts as one instruction), and the CPU features it needs.
struct ThroughputLoop {
  float (*run)(int64_t rounds);
  int per_round, macs;
  bool (*supported)();
  const char* needs;
};

void BM_Throughput(benchmark::State& state, const ThroughputLoop& loop) {
  if (!loop.supported()) {
    state.SkipWithError(absl::StrCat("this CPU has no ", loop.needs).c_str());
    return;
  }
  const int64_t n = 1 << 20;
  float sink = 0;
  for (auto _ : state) {
    int64_t iters = n;
    benchmark::DoNotOptimize(iters);  // a call the compiler cannot hoist out of this loop
    sink += loop.run(iters);
  }
  benchmark::DoNotOptimize(sink);
  const double instructions = static_cast<double>(n) * loop.per_round;
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * instructions * loop.macs * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["Ginstr/s"] =
      benchmark::Counter(instructions * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// ---- Linear ----------------------------------------------------------------------------------

backend::Device& Cpu() {
  static backend::Backend* b = backend::MakeCpuBackend(Threads()).release();
  return *b->device(0);
}

// Valid weights of any type: quantized from random floats (one row, repeated).
void FillWeights(DType t, uint8_t* p, int64_t n, int64_t k) {
  std::vector<float> row(k);
  uint64_t s = 88172645463325252ull;
  for (float& v : row) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    v = static_cast<float>(static_cast<int64_t>(s % 2001) - 1000) * 0.001f;
  }
  const int64_t rb = DTypeBytes(t, k);
  std::vector<uint8_t> enc(rb);
  if (IsQuantized(t)) {
    (void)QuantizeRow(t, row.data(), enc.data(), k);
  } else {
    (void)ConvertElements(DType::kF32, row.data(), t, enc.data(), k);
  }
  for (int64_t r = 0; r < n; ++r) std::memcpy(p + r * rb, enc.data(), rb);
}

void BM_Linear(benchmark::State& state, DType wt, int64_t N, int64_t K, int64_t M,
               const char* impl) {
  backend::Device& dev = Cpu();
  // The kernel exactly as the cpu backend would make it (auto) or with a forced choice.
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 512);
  const Value y = b.Linear(b.Input("x", DType::kF32, {T, K}), b.Weight("w", wt, {N, K}));
  const Node& n = g.node(y.id);
  std::vector<TensorType> in = {{DType::kF32, {T, K}}, {wt, {N, K}}};
  backend::KernelRequest req;
  req.op = n.op;
  req.attrs = &n.attrs;
  req.inputs = in;
  req.output = {n.dtype, n.shape};
  cpu::SelectContext ctx = cpu::DefaultSelectContext(&dev, Threads(), ref::KernelFor);
  if (std::string(impl) != "auto") ctx.force_gemm = impl;
  auto k = cpu::SelectKernel(req, ctx);
  if (!k.ok() || !k->has_value()) {
    state.SkipWithError("no kernel");
    return;
  }
  const backend::Kernel kernel = **k;
  const int64_t wbytes = DTypeBytes(wt, K) * N;
  const char* hot = std::getenv("KILN_BENCH_HOT");
  const bool rotate = M <= 16 && !(hot != nullptr && std::string_view(hot) == "1");
  const int copies =
      rotate ? static_cast<int>(std::max<int64_t>(1, (int64_t{256} << 20) / wbytes + 1)) : 1;
  auto w = Alloc(static_cast<size_t>(wbytes) * copies);
  for (int c = 0; c < copies; ++c) FillWeights(wt, w.get() + c * wbytes, N, K);
  auto x = Alloc(4 * M * K), out = Alloc(4 * M * N);
  for (int64_t i = 0; i < M * K; ++i)
    reinterpret_cast<float*>(x.get())[i] = static_cast<float>(i % 13) * 0.1f - 0.6f;
  auto stream = dev.CreateStream();
  if (!stream.ok()) {
    state.SkipWithError("no stream");
    return;
  }
  TensorArg inputs[2] = {cpu::Arg2D(x.get(), DType::kF32, M, K), cpu::Arg2D(w.get(), wt, N, K)};
  LaunchArgs args;
  args.kernel_data = kernel.data.get();
  args.inputs = inputs;
  args.num_inputs = 2;
  args.output = cpu::Arg2D(out.get(), DType::kF32, M, N);
  const Launch launch{kernel.fn, &args};
  int c = 0;
  for (auto _ : state) {
    inputs[1].data = w.get() + (c++ % copies) * wbytes;
    (void)(*stream)->Run(std::span<const Launch>(&launch, 1));
  }
  state.SetLabel(kernel.name);
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(wbytes),
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * M * N * K * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void Register() {
  benchmark::RegisterBenchmark("BM_MemoryBandwidth/streams:1", BM_MemoryBandwidth)
      ->Arg(1)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_MemoryBandwidth/streams:8", BM_MemoryBandwidth)
      ->Arg(8)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  const auto avx512 = [] { return __builtin_cpu_supports("avx512f") != 0; };
  const auto bf16 = [] { return __builtin_cpu_supports("avx512bf16") != 0; };
  const auto avx2 = [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); };
  static const std::pair<const char*, ThroughputLoop> kLoops[] = {
      {"f32_fma", {FmaLoop, kThroughputAccs, 16, avx512, "AVX-512"}},
      {"bf16_dot", {Dpbf16Loop, kThroughputAccs, 32, bf16, "AVX512_BF16"}},
      {"avx2_f32_fma", {Avx2FmaLoop, kAvx2FmaChains, 8, avx2, "AVX2 and FMA"}},
      {"avx2_q8_group", {Avx2Q8GroupLoop, kQ8Groups, 32, avx2, "AVX2 and FMA"}},
  };
  for (const auto& [name, loop] : kLoops) {
    benchmark::RegisterBenchmark(absl::StrCat("BM_Throughput/", name).c_str(), BM_Throughput, loop)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  struct Shape {
    int64_t n, k;
  };
  const Shape shapes[] = {{576, 576}, {1536, 576}, {49152, 576}, {8192, 2048},
                          {192, 576}, {960, 576},  {3072, 576}};
  const DType types[] = {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kMXFP4,
                         DType::kF16,  DType::kBF16, DType::kF32};
  for (DType t : types) {
    for (const Shape& s : shapes) {
      for (int64_t m : {1, 2, 4, 8, 16, 32, 128, 512}) {
        benchmark::RegisterBenchmark(
            absl::StrCat("BM_Linear/", DTypeName(t), "/N:", s.n, "/K:", s.k, "/M:", m, "/auto")
                .c_str(),
            [=](benchmark::State& st) { BM_Linear(st, t, s.n, s.k, m, "auto"); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  // Small M (a prompt chunk beside a few decodes): GEMV over strips decoded once against the
  // packed GEMM, forced, to place the autotuner's threshold between them.
  for (DType t : {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0}) {
    for (int64_t m : {8, 16, 24, 32, 48, 64}) {
      for (const char* impl : {"gemv", "gemm"}) {
        benchmark::RegisterBenchmark(
            absl::StrCat("BM_Linear/", DTypeName(t), "/N:1536/K:576/M:", m, "/", impl).c_str(),
            [=](benchmark::State& st) { BM_Linear(st, t, 1536, 576, m, impl); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  // oneDNN's f32 GEMM on the prefill shapes: the ratio the target is stated against.
  for (const Shape& s : shapes) {
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_Linear/f32/N:", s.n, "/K:", s.k, "/M:512/onednn").c_str(),
        [=](benchmark::State& st) { BM_Linear(st, DType::kF32, s.n, s.k, 512, "onednn"); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // Training's M (4 x 256 tokens): the packed GEMM against oneDNN, on f32 weights and on
  // q4_1 ones (decoded to f32 panels first).
  for (const Shape& s : shapes) {
    for (DType t : {DType::kF32, DType::kQ4_1}) {
      for (const char* impl : {"gemm", t == DType::kF32 ? "onednn" : "onednn_dequant"}) {
        benchmark::RegisterBenchmark(
            absl::StrCat("BM_Linear/", DTypeName(t), "/N:", s.n, "/K:", s.k, "/M:1024/", impl)
                .c_str(),
            [=](benchmark::State& st) { BM_Linear(st, t, s.n, s.k, 1024, impl); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
}

}  // namespace
}  // namespace kiln

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  kiln::Register();
  benchmark::AddCustomContext("cpu", kiln::cpu::CpuDescription());
  benchmark::AddCustomContext("isa", kiln::cpu::IsaName(kiln::cpu::ActiveIsa()));
  benchmark::AddCustomContext("threads", std::to_string(kiln::Threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
