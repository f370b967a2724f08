#include "backends/host/host_device.h"

#include <gtest/gtest.h>

#include <atomic>

#include "backends/builtin.h"

namespace kiln::backend {
namespace {

struct Shared {
  std::atomic<int64_t> slot[8];
  int64_t sum = 0;
};

// Launch 1: every thread writes its slot. Launch 2: thread 0 sums the slots. The barrier
// between launches makes the sum always complete.
void WriteSlot(const LaunchArgs& a, const ExecCtx& c) {
  auto* s = static_cast<Shared*>(const_cast<void*>(a.kernel_data));
  s->slot[c.thread_index].store(c.thread_index + 1, std::memory_order_relaxed);
}
void SumSlots(const LaunchArgs& a, const ExecCtx& c) {
  auto* s = static_cast<Shared*>(const_cast<void*>(a.kernel_data));
  if (c.thread_index == 0) {
    int64_t t = 0;
    for (int i = 0; i < c.thread_count; ++i) t += s->slot[i].exchange(0, std::memory_order_relaxed);
    s->sum += t;
  }
}

TEST(HostStreamTest, ThreadPoolRunsEveryLaunchOnEveryThreadWithBarriers) {
  HostDevice* dev = nullptr;
  auto backend = MakeCpuBackend(3);
  dev = static_cast<HostDevice*>(backend->device(0));
  ASSERT_EQ(dev->threads(), 3);
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  Shared shared{};
  LaunchArgs args;
  args.kernel_data = &shared;
  std::vector<Launch> launches;
  for (int i = 0; i < 50; ++i) {
    launches.push_back({WriteSlot, &args});
    launches.push_back({SumSlots, &args});
  }
  for (int rep = 0; rep < 20; ++rep) ASSERT_TRUE((*stream)->Run(launches).ok());
  EXPECT_EQ(shared.sum, 20 * 50 * (1 + 2 + 3));
  ASSERT_TRUE((*stream)->Run({}).ok());  // an empty list is fine
}

TEST(HostStreamTest, CaptureRecordsThenReplays) {
  auto backend = MakeRefBackend();
  auto stream = backend->device(0)->CreateStream();
  ASSERT_TRUE(stream.ok());
  Shared shared{};
  LaunchArgs args;
  args.kernel_data = &shared;
  const Launch l[] = {{WriteSlot, &args}, {SumSlots, &args}};
  ASSERT_TRUE((*stream)->SupportsCapture());
  ASSERT_TRUE((*stream)->BeginCapture().ok());
  EXPECT_FALSE((*stream)->BeginCapture().ok());
  ASSERT_TRUE((*stream)->Run(l).ok());
  EXPECT_EQ(shared.sum, 0);  // recorded, not run
  auto graph = (*stream)->EndCapture();
  ASSERT_TRUE(graph.ok());
  ASSERT_TRUE((*graph)->Replay(**stream).ok());
  ASSERT_TRUE((*graph)->Replay(**stream).ok());
  EXPECT_EQ(shared.sum, 2);
  auto other = MakeCpuBackend(1);
  auto other_stream = other->device(0)->CreateStream();
  EXPECT_FALSE((*graph)->Replay(**other_stream).ok());  // wrong device
}

TEST(HostDeviceTest, BuffersAreAlignedAndCopiesChecked) {
  auto backend = MakeRefBackend();
  Device* dev = backend->device(0);
  auto buf = dev->Allocate(100);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*buf)->data()) % kMinAlignment, 0u);
  auto stream = dev->CreateStream();
  const char src[8] = "abcdefg";
  EXPECT_TRUE((*stream)->CopyToDevice(**buf, 92, src, 8).ok());
  EXPECT_EQ((*stream)->CopyToDevice(**buf, 93, src, 8).code(), StatusCode::kOutOfRange);
  char back[8];
  EXPECT_TRUE((*stream)->CopyToHost(back, **buf, 92, 8).ok());
  EXPECT_STREQ(back, "abcdefg");
  int keep = 0;
  auto wrapped = dev->WrapHostMemory(&keep, sizeof(keep), nullptr);
  ASSERT_TRUE(wrapped.ok());
  EXPECT_EQ((*wrapped)->data(), &keep);
}

}  // namespace
}  // namespace kiln::backend
