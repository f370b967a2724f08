// Paged attention on the cpu backend (docs/performance.md): decode with 1k and 4k contexts
// (one sequence: split over the context; 16 sequences: over sequences and kv heads) and a
// 512-token causal prefill, with SmolLM2-135M's attention shape (9 query heads, 3 kv heads,
// head dim 64, blocks of 16 tokens) and f32 or f16 caches.
//
//   build/tests/bench/attention_bench [--benchmark_filter=decode]
//
// GB/s counts the K and V bytes a step must read (every visible key once).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/builtin.h"
#include "backends/cpu/kernels/isa.h"
#include "backends/cpu/kernels/select.h"
#include "backends/ref/ref_kernels.h"
#include "engine/builder.h"

namespace kiln {
namespace {

constexpr int64_t kHq = 9, kHkv = 3, kD = 64, kBS = 16;

int Threads() {
  const char* t = std::getenv("KILN_CPU_THREADS");
  return t != nullptr && std::atoi(t) > 0 ? std::atoi(t) : 2;
}

backend::Device& Cpu() {
  static backend::Backend* b = backend::MakeCpuBackend(Threads()).release();
  return *b->device(0);
}

TensorArg Arg(void* data, DType t, std::vector<int64_t> shape) {
  TensorArg a;
  a.data = data;
  a.dtype = t;
  a.rank = static_cast<int32_t>(shape.size());
  int64_t s = 1;
  for (int i = a.rank - 1; i >= 0; --i) {
    a.shape[i] = shape[i];
    a.strides[i] = s;
    s *= shape[i];
  }
  return a;
}

// `seqs` sequences of `ctx` tokens, each adding `nq` query rows (1: decode).
void BM_PagedAttention(benchmark::State& state, int64_t seqs, int64_t ctx, int64_t nq, DType cache,
                       bool reference) {
  const int64_t blocks_per_seq = (ctx + kBS - 1) / kBS, nb = seqs * blocks_per_seq, T = seqs * nq;
  const int64_t esize = cache == DType::kF32 ? 4 : 2;
  std::vector<uint8_t> k(nb * kBS * kHkv * kD * esize), v(k.size());
  std::vector<float> q(T * kHq * kD), out(T * kHq * kD);
  for (size_t i = 0; i < k.size(); ++i) k[i] = v[i] = static_cast<uint8_t>(i * 7 % 61);
  if (cache == DType::kF16) {  // small finite halves
    for (size_t i = 1; i < k.size(); i += 2) k[i] = v[i] = 0x30;
  } else {
    for (size_t i = 3; i < k.size(); i += 4) k[i] = v[i] = 0x3c;
  }
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 17) * 0.05f - 0.4f;
  std::vector<int32_t> table(nb), lens(seqs, static_cast<int32_t>(ctx)), starts(seqs + 1);
  for (int64_t i = 0; i < nb; ++i) table[i] = static_cast<int32_t>((i * 7919) % nb);  // scattered
  for (int64_t s = 0; s <= seqs; ++s) starts[s] = static_cast<int32_t>(s * nq);

  Graph g;
  Builder b(&g);
  AttentionParams p;
  p.scale = 0.125;
  p.mask_mod = attn::CausalMask();
  const Value y = b.PagedAttention(
      b.Input("q", DType::kF32, {T, kHq, kD}), b.State("k", cache, {nb, kBS, kHkv, kD}),
      b.State("v", cache, {nb, kBS, kHkv, kD}), b.Input("bt", DType::kI32, {seqs, blocks_per_seq}),
      b.Input("sl", DType::kI32, {seqs}), b.Input("qs", DType::kI32, {seqs + 1}), p);
  if (!b.status().ok()) {
    state.SkipWithError(std::string(StatusMessage(b.status())).c_str());
    return;
  }
  const Node& n = g.node(y.id);
  std::vector<TensorType> in;
  for (int32_t id : n.inputs) in.push_back({g.node(id).dtype, g.node(id).shape});
  backend::KernelRequest req;
  req.op = n.op;
  req.attrs = &n.attrs;
  req.inputs = in;
  req.output = {n.dtype, n.shape};
  backend::Device& dev = Cpu();
  StatusOr<backend::Kernel> kernel = ref::KernelFor(req);
  if (!reference) kernel = dev.GetKernel(req);
  if (!kernel.ok()) {
    state.SkipWithError("no kernel");
    return;
  }
  TensorArg args_in[6] = {Arg(q.data(), DType::kF32, {T, kHq, kD}),
                          Arg(k.data(), cache, {nb, kBS, kHkv, kD}),
                          Arg(v.data(), cache, {nb, kBS, kHkv, kD}),
                          Arg(table.data(), DType::kI32, {seqs, blocks_per_seq}),
                          Arg(lens.data(), DType::kI32, {seqs}),
                          Arg(starts.data(), DType::kI32, {seqs + 1})};
  LaunchArgs args;
  args.kernel_data = kernel->data.get();
  args.inputs = args_in;
  args.num_inputs = 6;
  args.output = Arg(out.data(), DType::kF32, {T, kHq, kD});
  auto stream = dev.CreateStream();
  const Launch launch{kernel->fn, &args};
  for (auto _ : state) (void)(*stream)->Run(std::span<const Launch>(&launch, 1));
  state.SetLabel(kernel->name);
  const double kv_bytes = 2.0 * seqs * ctx * kHkv * kD * esize;
  state.counters["GB/s"] =
      benchmark::Counter(kv_bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

void Register() {
  for (DType cache : {DType::kF32, DType::kF16}) {
    for (int64_t ctx : {1024, 4096}) {
      for (int64_t seqs : {1, 16}) {
        benchmark::RegisterBenchmark(
            absl::StrCat("BM_PagedAttention/decode/", DTypeName(cache), "/ctx:", ctx,
                         "/seqs:", seqs)
                .c_str(),
            [=](benchmark::State& s) { BM_PagedAttention(s, seqs, ctx, 1, cache, false); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
    benchmark::RegisterBenchmark(
        absl::StrCat("BM_PagedAttention/prefill/", DTypeName(cache), "/tokens:512").c_str(),
        [=](benchmark::State& s) { BM_PagedAttention(s, 1, 512, 512, cache, false); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // The reference kernel on the smallest case, for scale.
  benchmark::RegisterBenchmark(
      "BM_PagedAttention/decode/f32/ctx:1024/seqs:1/reference",
      [](benchmark::State& s) { BM_PagedAttention(s, 1, 1024, 1, DType::kF32, true); })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
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
