// The op harness on the cuda backend (built as hip_harness_test too, on the hip backend from the
// same sources): every forward case and every gradient case must pass on each device against
// `ref` (unsupported counts as a failure). Kernels of all cases are
// declared first and built as one batch. Also: a captured CUDA graph replays what a direct run
// computes, the allocator reuses what is released and names the numbers when memory runs out,
// in both of its modes (cudaMalloc blocks; one expandable segment).
//
// Without a driver or device the tests skip, saying why (ctest shows them as skipped).
// KILN_GPU_HARNESS_OP=<op> limits the harness to one op (debugging).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "backends/builtin.h"
#include "backends/gpu/gpu_device.h"
#include "engine/builder.h"
#include "engine/capture.h"
#include "engine/program.h"
#include "engine/testing/op_harness.h"

namespace kiln::gpu {
namespace {

struct Devices {
  std::unique_ptr<backend::Backend> ref;
  std::unique_ptr<GpuBackend> cuda;
  std::string why_none;
};

Devices& Get() {
  static Devices* d = [] {
    auto* r = new Devices();
    // The sample op's kernel is declined by default (host sampling is faster); test it anyway.
    setenv("KILN_GPU_DEVICE_SAMPLING", "1", /*overwrite=*/0);
    r->ref = backend::MakeRefBackend();
    auto b = CreateGpuBackend();
    if (b.ok()) {
      r->cuda = *std::move(b);
    } else {
      r->why_none = std::string(StatusMessage(b.status()));
    }
    return r;
  }();
  return *d;
}

class Teardown : public ::testing::Environment {
 public:
  void TearDown() override { Get().cuda.reset(); }
};
const auto* const kTeardown = ::testing::AddGlobalTestEnvironment(new Teardown());

#define REQUIRE_GPU() \
  if (!Get().cuda) GTEST_SKIP() << "no " << kBackendName << " device: " << Get().why_none

void RunCases(bool gradient) {
  REQUIRE_GPU();
  Devices& d = Get();
  const char* only = std::getenv("KILN_GPU_HARNESS_OP");
  for (int i = 0; i < d.cuda->device_count(); ++i) {
    auto* dev = static_cast<GpuDevice*>(d.cuda->device(i));
    std::printf("%s: %s\n", std::string(dev->name()).c_str(), dev->info().Describe().c_str());
    const harness::SuiteResult r = harness::RunBatchBuilt(
        gradient, *d.ref->device(0), *dev, [&] { return dev->BuildPending(); }, only ? only : "");
    ASSERT_TRUE(r.build.ok()) << r.build;
    for (const std::string& f : r.failures) ADD_FAILURE() << dev->name() << ": " << f;
    const GpuDevice::BuildStats st = dev->build_stats();
    std::printf("%s %s: %s; programs: %d built, %d from the cache (%.1f s building)\n",
                std::string(dev->name()).c_str(), gradient ? "gradient" : "forward",
                r.Summary().c_str(), st.programs_built, st.programs_from_cache, st.build_seconds);
    EXPECT_GT(r.ran, 0);
  }
}

TEST(GpuHarnessTest, EveryForwardCasePasses) { RunCases(/*gradient=*/false); }
TEST(GpuHarnessTest, EveryGradientCasePasses) { RunCases(/*gradient=*/true); }

// y = linear(rms_norm(x), w) + x through a program: a direct run and a captured CUDA graph's
// replay give the same bytes, and the replay reads new input values copied into the same
// tensors.
TEST(GpuDeviceTest, CapturedGraphReplaysWhatADirectRunComputes) {
  REQUIRE_GPU();
  GpuDevice& dev = *static_cast<GpuDevice*>(Get().cuda->device(0));
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {64, 256});
  const Value w = b.Input("w", DType::kF32, {256, 256});
  const Value nw = b.Input("nw", DType::kF32, {256});
  const Value y = b.Add(b.Linear(b.RmsNorm(x, nw, 1e-6), w), x);
  ASSERT_TRUE(b.status().ok()) << b.status();
  StatusOr<std::unique_ptr<Program>> p = Compile(g, {y}, dev);
  ASSERT_TRUE(p.ok()) << p.status();
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto upload = [&](const char* name, std::vector<int64_t> shape, std::vector<float> v) {
    StatusOr<Tensor> t = Tensor::Empty(dev, DType::kF32, std::move(shape));
    EXPECT_TRUE(t.ok());
    EXPECT_TRUE((*stream)->CopyToDevice(*t->buffer(), 0, v.data(), v.size() * 4).ok());
    EXPECT_TRUE((*p)->Bind(name, *t).ok());
    return *t;
  };
  std::vector<float> xv(64 * 256), wv(256 * 256), nv(256, 1.5f);
  for (size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<float>((i * 37) % 101) / 50 - 1;
  for (size_t i = 0; i < wv.size(); ++i) wv[i] = static_cast<float>((i * 13) % 97) / 400 - 0.1f;
  const Tensor xt = upload("x", {64, 256}, xv);
  upload("w", {256, 256}, wv);
  upload("nw", {256}, nv);
  auto read = [&]() {
    std::vector<float> out(xv.size());
    StatusOr<Tensor> o = (*p)->Output(0);
    EXPECT_TRUE(o.ok());
    EXPECT_TRUE((*stream)
                    ->CopyToHost(out.data(), *o->buffer(), DTypeBytes(DType::kF32, o->offset()),
                                 out.size() * 4)
                    .ok());
    return out;
  };
  ASSERT_TRUE((*p)->Run(**stream).ok());
  const std::vector<float> first = read();
  // Second input, direct.
  std::vector<float> x2(xv.size());
  for (size_t i = 0; i < x2.size(); ++i) x2[i] = xv[x2.size() - 1 - i] * 0.5f;
  ASSERT_TRUE((*stream)->CopyToDevice(*xt.buffer(), 0, x2.data(), x2.size() * 4).ok());
  ASSERT_TRUE((*p)->Run(**stream).ok());
  const std::vector<float> direct = read();
  // Capture with the first input bound, replay with the second.
  ASSERT_TRUE((*stream)->CopyToDevice(*xt.buffer(), 0, xv.data(), xv.size() * 4).ok());
  auto captured = CapturedProgram::Capture(**p, **stream);
  ASSERT_TRUE(captured.ok()) << captured.status();
  EXPECT_TRUE((*captured)->native()) << "CUDA graphs";
  ASSERT_TRUE((*stream)->CopyToDevice(*xt.buffer(), 0, x2.data(), x2.size() * 4).ok());
  ASSERT_TRUE((*captured)->Replay(**stream).ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  const std::vector<float> replayed = read();
  EXPECT_EQ(std::memcmp(direct.data(), replayed.data(), direct.size() * 4), 0);
  EXPECT_NE(std::memcmp(first.data(), direct.data(), direct.size() * 4), 0);
}

TEST(GpuDeviceTest, AllocatorReusesReleasedBlocksAndNamesTheNumbersWhenFull) {
  REQUIRE_GPU();
  GpuDevice& dev = *static_cast<GpuDevice*>(Get().cuda->device(0));
  const AllocatorStats before = dev.allocator_stats();
  {
    auto a = dev.Allocate(3 << 20);
    ASSERT_TRUE(a.ok()) << a.status();
  }
  {
    auto a = dev.Allocate(3 << 20);
    ASSERT_TRUE(a.ok()) << a.status();
  }
  const AllocatorStats after = dev.allocator_stats();
  if (dev.expandable()) {  // KILN_CUDA_EXPANDABLE_SEGMENTS=1: mapped pages, at most one more
    EXPECT_LE(after.segments, before.segments + 1);
  } else {
    EXPECT_EQ(after.segments, before.segments + 1) << "the second allocation reuses the first";
  }
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_GE(after.peak_allocated_bytes, before.allocated_bytes + (3u << 20));
  auto huge = dev.Allocate(size_t{1} << 50);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status();
  EXPECT_NE(std::string(StatusMessage(huge.status())).find("bytes free"), std::string::npos)
      << huge.status();
  StatusOr<backend::DeviceMemoryInfo> m = dev.MemoryInfo();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->total_bytes, 1ull << 30);
}

// The expandable segment (KILN_CUDA_EXPANDABLE_SEGMENTS=1): buffers hold what is written to
// them, the segment grows by mapping pages, and released ranges coalesce so that a larger
// request reuses them without growing; out of memory still names the numbers.
TEST(GpuDeviceTest, ExpandableSegmentGrowsAndReusesCoalescedRanges) {
  REQUIRE_GPU();
  auto made = GpuDevice::Create(0, {.cache_dir = "none", .expandable_segments = true});
  ASSERT_TRUE(made.ok()) << made.status();
  GpuDevice& dev = **made;
  if (!dev.expandable()) GTEST_SKIP() << "no virtual memory management here (logged)";
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  {
    std::vector<std::unique_ptr<backend::Buffer>> held;
    for (size_t bytes : {size_t{1000}, size_t{3} << 20, size_t{100} << 20}) {
      auto b = dev.Allocate(bytes);
      ASSERT_TRUE(b.ok()) << b.status();
      std::vector<uint8_t> in(bytes), out(bytes);
      for (size_t i = 0; i < bytes; ++i) in[i] = static_cast<uint8_t>(i * 7 + bytes);
      ASSERT_TRUE((*stream)->CopyToDevice(**b, 0, in.data(), bytes).ok());
      ASSERT_TRUE((*stream)->CopyToHost(out.data(), **b, 0, bytes).ok());
      EXPECT_EQ(in, out) << bytes << " bytes";
      held.push_back(*std::move(b));
    }
    const AllocatorStats s = dev.allocator_stats();
    EXPECT_GE(s.segments, 2) << "grown at least once past the first 64 MiB";
    EXPECT_GE(s.reserved_bytes, (size_t{103} << 20));
    EXPECT_EQ(s.allocated_bytes, 512u * 2 + (size_t{103} << 20));
  }
  const AllocatorStats freed = dev.allocator_stats();
  EXPECT_EQ(freed.allocated_bytes, 0u);
  {
    // 103 MiB were released in three neighbouring ranges: 100 MiB fit once they coalesce.
    auto b = dev.Allocate(size_t{100} << 20);
    ASSERT_TRUE(b.ok()) << b.status();
  }
  EXPECT_EQ(dev.allocator_stats().reserved_bytes, freed.reserved_bytes) << "reused, not grown";
  auto huge = dev.Allocate(size_t{1} << 50);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status();
  EXPECT_NE(std::string(StatusMessage(huge.status())).find("expandable segment"), std::string::npos)
      << huge.status();
}

}  // namespace
}  // namespace kiln::gpu
