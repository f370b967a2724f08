// cuDNN SDPA (gpu_sdpa.h). Without a GPU: the forward and backward graphs of the shapes Kiln
// serves and trains are built and pass cudnn-frontend's validate() for sm_90 (no device or
// handle needed; libcudnn must be loadable, as the frontend reads cudnnGetVersion()). With a
// GPU: SDPA's forward (out, lse) and backward (dQ, dK, dV) match Kiln's own attention kernel
// (and its autograd backward) on the cuda backend, on random inputs, called directly and
// through the engine's attention and attention_backward ops (cuDNN is their default on cuda).
#include "backends/gpu/gpu_sdpa.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "backends/gpu/gpu_device.h"
#include "backends/gpu/host_copy.h"
#include "engine/autograd.h"
#include "engine/builder.h"
#include "engine/program.h"

namespace kiln::gpu {
namespace {

constexpr int kHopper = 90;

#define REQUIRE_SDPA_BUILT() \
  if (!SdpaCompiled()) GTEST_SKIP() << StatusMessage(ValidateSdpa({}, false, kHopper))

// Validates `key`'s graph; skips (saying why) when libcudnn cannot be opened here.
void ExpectValid(const SdpaKey& key, bool backward) {
  const Status st = ValidateSdpa(key, backward, kHopper);
  if (absl::IsUnavailable(st)) GTEST_SKIP() << StatusMessage(st);
  EXPECT_TRUE(st.ok()) << (backward ? "backward " : "forward ") << key.Describe() << ": " << st;
}

SdpaKey SmolLm2(DType t) {
  // SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64; a 512-token prefill.
  return {.batch = 1,
          .q_heads = 9,
          .kv_heads = 3,
          .q_len = 512,
          .kv_len = 512,
          .head_dim = 64,
          .dtype = t,
          .causal = true,
          .stats = true,
          .scale = 0.125f};
}

TEST(GpuSdpa, ValidatesSmolLm2ShapesForSm90) {
  REQUIRE_SDPA_BUILT();
  for (DType t : {DType::kBF16, DType::kF16}) {
    SdpaKey key = SmolLm2(t);
    ExpectValid(key, /*backward=*/true);
    ExpectValid(key, /*backward=*/false);
    key.stats = false;  // inference
    ExpectValid(key, /*backward=*/false);
    key.batch = 4;
    ExpectValid(key, /*backward=*/false);
  }
}

TEST(GpuSdpa, ValidatesHeadDim128At4kForSm90) {
  REQUIRE_SDPA_BUILT();
  for (DType t : {DType::kBF16, DType::kF16}) {
    const SdpaKey key = {.batch = 1,
                         .q_heads = 32,
                         .kv_heads = 8,
                         .q_len = 4096,
                         .kv_len = 4096,
                         .head_dim = 128,
                         .dtype = t,
                         .causal = true,
                         .stats = true,
                         .scale = 1 / std::sqrt(128.0f)};
    ExpectValid(key, /*backward=*/false);
    ExpectValid(key, /*backward=*/true);
  }
}

// validate() does check: cuDNN's f16/bf16 SDPA forward needs Ampere or newer. (Its backward
// node has no architecture check in validate(); that is left to check_support on a device.)
TEST(GpuSdpa, ValidateRejectsForwardBeforeSm80) {
  REQUIRE_SDPA_BUILT();
  const SdpaKey key = SmolLm2(DType::kBF16);
  const Status st = ValidateSdpa(key, /*backward=*/false, 75);
  if (absl::IsUnavailable(st)) GTEST_SKIP() << StatusMessage(st);
  EXPECT_NE(StatusMessage(st).find("requires SM80"), std::string_view::npos) << st;
  EXPECT_TRUE(ValidateSdpa(key, /*backward=*/false, 80).ok());
}

TEST(GpuSdpa, RejectsWhatItDoesNotHandle) {
  SdpaKey key = SmolLm2(DType::kF32);
  EXPECT_EQ(StatusMessage(SdpaSupports(key)), "cuDNN SDPA: dtype f32 (allowed: f16, bf16)");
  key = SmolLm2(DType::kBF16);
  key.head_dim = 96;
  EXPECT_EQ(StatusMessage(SdpaSupports(key)), "cuDNN SDPA: head dim 96 (allowed: 64, 128)");
  key = SmolLm2(DType::kBF16);
  key.kv_heads = 4;
  EXPECT_FALSE(SdpaSupports(key).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateSdpa(key, false, kHopper)));
  key = SmolLm2(DType::kBF16);
  key.stats = false;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateSdpa(key, /*backward=*/true, kHopper)));
}

// The GPU comparison.

struct Gpu {
  std::unique_ptr<GpuBackend> backend;
  std::string why_none;
};

Gpu& GetGpu() {
  static Gpu* g = [] {
    auto* r = new Gpu();
    auto b = CreateGpuBackend();
    if (b.ok()) {
      r->backend = *std::move(b);
    } else {
      r->why_none = std::string(StatusMessage(b.status()));
    }
    return r;
  }();
  return *g;
}

std::vector<double> RandomValues(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0, 1);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

std::vector<Dim> Dims(const std::vector<int64_t>& shape) {
  return std::vector<Dim>(shape.begin(), shape.end());
}

// max |a - b| / max |b|.
double RelError(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return diff / scale;
}

TEST(GpuSdpa, MatchesKilnAttentionForwardAndBackward) {
  REQUIRE_SDPA_BUILT();
  if (!GetGpu().backend) GTEST_SKIP() << "no CUDA device: " << GetGpu().why_none;
  backend::Device& dev = *GetGpu().backend->device(0);
  // Before the first attention launch (the backend reads it once): the bf16/f16 programs below
  // then run their attention through cuDNN; the f32 reference does not qualify.
  setenv("KILN_CUDNN_SDPA", "1", 1);
  const auto* sdpa_calls =
      static_cast<const std::atomic<int64_t>*>(dev.GetExtension("gpu.sdpa_calls"));
  ASSERT_NE(sdpa_calls, nullptr);
  for (DType t : {DType::kBF16, DType::kF16}) {
    SdpaKey key = SmolLm2(t);
    key.q_len = key.kv_len = 256;
    const int64_t b = key.batch, hq = key.q_heads, hkv = key.kv_heads, n = key.q_len,
                  d = key.head_dim;
    const std::vector<int64_t> q_shape = {b, hq, n, d}, kv_shape = {b, hkv, n, d};
    auto stream = dev.CreateStream();
    ASSERT_TRUE(stream.ok());
    // Inputs in the SDPA dtype; Kiln's reference runs in f32 on the same (rounded) values.
    auto make = [&](std::vector<int64_t> shape, uint64_t seed) {
      int64_t count = 1;
      for (int64_t x : shape) count *= x;
      return *DeviceTensor(dev, **stream, t, shape, RandomValues(count, seed));
    };
    auto host = [&](const Tensor& x) { return *HostDoubles(**stream, x); };
    const Tensor q = make(q_shape, 1), k = make(kv_shape, 2), v = make(kv_shape, 3),
                 d_o = make(q_shape, 4);

    Graph g;
    Builder bld(&g);
    const Value vq = bld.Input("q", DType::kF32, Dims(q_shape));
    const Value vk = bld.Input("k", DType::kF32, Dims(kv_shape));
    const Value vv = bld.Input("v", DType::kF32, Dims(kv_shape));
    const Value vdo = bld.Input("do", DType::kF32, Dims(q_shape));
    const AttentionOutputs att =
        bld.AttentionWithLse(vq, vk, vv, {key.scale, attn::CausalMask(), {}});
    const Value wrt[] = {vq, vk, vv};
    auto grads = Gradients(bld, att.out, wrt, vdo);
    ASSERT_TRUE(grads.ok()) << grads.status();
    auto prog = Compile(g, {att.out, att.lse, (*grads)[0], (*grads)[1], (*grads)[2]}, dev);
    ASSERT_TRUE(prog.ok()) << prog.status();
    auto f32 = [&](const Tensor& x) {
      return *DeviceTensor(dev, **stream, DType::kF32, x.shape(), host(x));
    };
    ASSERT_TRUE((*prog)->Bind("q", f32(q)).ok());
    ASSERT_TRUE((*prog)->Bind("k", f32(k)).ok());
    ASSERT_TRUE((*prog)->Bind("v", f32(v)).ok());
    ASSERT_TRUE((*prog)->Bind("do", f32(d_o)).ok());
    ASSERT_TRUE((*prog)->Run(**stream).ok());
    ASSERT_TRUE((*stream)->Synchronize().ok());

    // cuDNN on its own stream, workspace from cudaMalloc.
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    auto runner = SdpaRunner::Create(s);
    if (absl::IsUnavailable(runner.status())) {
      cudaStreamDestroy(s);
      GTEST_SKIP() << "no cuDNN on this GPU machine: " << StatusMessage(runner.status());
    }
    ASSERT_TRUE(runner.ok()) << runner.status();
    MallocScratch workspaces;
    const SdpaScratch scratch = workspaces.fn();
    const Tensor o = *Tensor::Empty(dev, t, q_shape);
    const Tensor stats = *Tensor::Empty(dev, DType::kF32, {b, hq, n});
    const Tensor dq = *Tensor::Empty(dev, t, q_shape), dk = *Tensor::Empty(dev, t, kv_shape),
                 dv = *Tensor::Empty(dev, t, kv_shape);
    Status st = (*runner)->Forward(
        key, {q.data(), k.data(), v.data(), o.data(), static_cast<float*>(stats.data())}, scratch);
    ASSERT_TRUE(st.ok()) << st;
    st = (*runner)->Backward(
        key,
        {q.data(), k.data(), v.data(), o.data(), d_o.data(),
         static_cast<const float*>(stats.data()), dq.data(), dk.data(), dv.data()},
        scratch);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);

    const char* names[] = {"out", "lse", "dq", "dk", "dv"};
    const Tensor* mine[] = {&o, &stats, &dq, &dk, &dv};
    const double tolerance[] = {2e-2, 1e-3, 5e-2, 5e-2, 5e-2};
    for (int i = 0; i < 5; ++i) {
      const double err = RelError(host(*mine[i]), host(*(*prog)->Output(i)));
      std::printf("%s %s: max error / max |kiln| = %.3g\n", DTypeName(t), names[i], err);
      EXPECT_LT(err, tolerance[i]) << names[i] << " " << key.Describe();
    }
    EXPECT_EQ((*runner)->graphs_built(), 2);

    // The wired path: Kiln's attention op and its fused backward (attention_backward) in the
    // SDPA dtype, which the backend hands to cuDNN: two SDPA calls.
    Graph wg;
    Builder wb(&wg);
    const Value wq = wb.Input("q", t, Dims(q_shape)), wk = wb.Input("k", t, Dims(kv_shape)),
                wv = wb.Input("v", t, Dims(kv_shape)), wdo = wb.Input("do", t, Dims(q_shape));
    const AttentionParams wp = {key.scale, attn::CausalMask(), {}};
    const AttentionOutputs watt = wb.AttentionWithLse(wq, wk, wv, wp);
    const AttentionGrads wgrads = wb.AttentionBackward(wq, wk, wv, watt.out, wdo, watt.lse, wp);
    auto wprog = Compile(wg, {watt.out, watt.lse, wgrads.dq, wgrads.dk, wgrads.dv}, dev);
    ASSERT_TRUE(wprog.ok()) << wprog.status();
    ASSERT_TRUE((*wprog)->Bind("q", q).ok());
    ASSERT_TRUE((*wprog)->Bind("k", k).ok());
    ASSERT_TRUE((*wprog)->Bind("v", v).ok());
    ASSERT_TRUE((*wprog)->Bind("do", d_o).ok());
    const int64_t calls_before = sdpa_calls->load();
    ASSERT_TRUE((*wprog)->Run(**stream).ok());
    ASSERT_TRUE((*stream)->Synchronize().ok());
    EXPECT_EQ(sdpa_calls->load(), calls_before + 2)
        << "the attention and attention_backward ops did not both run cuDNN";
    for (int i = 0; i < 5; ++i) {
      const double err = RelError(host(*(*wprog)->Output(i)), host(*(*prog)->Output(i)));
      std::printf("%s wired %s: max error / max |kiln| = %.3g\n", DTypeName(t), names[i], err);
      EXPECT_LT(err, tolerance[i]) << "wired " << names[i] << " " << key.Describe();
    }
    cudaStreamDestroy(s);
  }
}

}  // namespace
}  // namespace kiln::gpu
