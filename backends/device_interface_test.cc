// What GPU backends need from the interface, on every device this build has (ref, cpu and,
// where an OpenCL device exists, xpu; where a CUDA device exists, cuda): memory info, pinned host
// buffers, asynchronous copies with their stated semantics, and events across streams.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <vector>

#include "backends/builtin.h"
#include "backends/host/host_device.h"

namespace kiln::backend {
namespace {

std::vector<std::unique_ptr<Backend>> AllBackends() {
  std::vector<std::unique_ptr<Backend>> out;
  out.push_back(MakeRefBackend());
  out.push_back(MakeCpuBackend(2));
  if (std::unique_ptr<Backend> xpu = MakeXpuBackend()) out.push_back(std::move(xpu));
  if (std::unique_ptr<Backend> cuda = MakeCudaBackend()) out.push_back(std::move(cuda));
  return out;
}

TEST(DeviceInterfaceTest, EveryDeviceReportsItsMemory) {
  for (auto& b : AllBackends()) {
    Device& dev = *b->device(0);
    StatusOr<DeviceMemoryInfo> m = dev.MemoryInfo();
    ASSERT_TRUE(m.ok()) << dev.name() << ": " << m.status();
    EXPECT_GT(m->total_bytes, 1u << 20) << dev.name();
    EXPECT_LE(m->free_bytes, m->total_bytes) << dev.name();
  }
}

TEST(DeviceInterfaceTest, XpuFreeMemoryShrinksByWhatItAllocates) {
  std::unique_ptr<Backend> xpu = MakeXpuBackend();
  if (xpu == nullptr) GTEST_SKIP() << "no OpenCL device";
  Device& dev = *xpu->device(0);
  const uint64_t before = dev.MemoryInfo()->free_bytes;
  {
    auto buf = dev.Allocate(64 << 20);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_EQ(dev.MemoryInfo()->free_bytes, before - (64 << 20));
  }
  EXPECT_EQ(dev.MemoryInfo()->free_bytes, before);
}

// pinned host -> device (async, stream A) -> event -> stream B waits -> device copy ->
// pinned host (async) -> synchronize: the data arrives intact, in order.
TEST(DeviceInterfaceTest, AsyncCopiesAndEventsAcrossStreamsKeepOrder) {
  constexpr size_t kBytes = 1 << 20;
  for (auto& b : AllBackends()) {
    Device& dev = *b->device(0);
    SCOPED_TRACE(std::string(dev.name()));
    auto src = dev.AllocatePinnedHost(kBytes);
    auto dst = dev.AllocatePinnedHost(kBytes);
    ASSERT_TRUE(src.ok() && dst.ok());
    ASSERT_NE((*src)->data(), nullptr);
    auto* s = static_cast<uint32_t*>((*src)->data());
    std::iota(s, s + kBytes / 4, 7u);
    std::memset((*dst)->data(), 0, kBytes);
    auto a = dev.Allocate(kBytes), c = dev.Allocate(kBytes);
    ASSERT_TRUE(a.ok() && c.ok());
    auto sa = dev.CreateStream(), sb = dev.CreateStream();
    ASSERT_TRUE(sa.ok() && sb.ok());
    ASSERT_TRUE((*sa)->CopyToDeviceAsync(**a, 0, s, kBytes).ok());
    auto ev = (*sa)->RecordEvent();
    ASSERT_TRUE(ev.ok()) << ev.status();
    ASSERT_TRUE((*sb)->WaitEvent(**ev).ok());
    ASSERT_TRUE((*sb)->CopyOnDevice(**c, 0, **a, 0, kBytes).ok());
    ASSERT_TRUE((*sb)->CopyToHostAsync((*dst)->data(), **c, 0, kBytes).ok());
    auto done = (*sb)->RecordEvent();
    ASSERT_TRUE(done.ok());
    ASSERT_TRUE((*done)->Wait().ok());
    EXPECT_TRUE((*done)->Done());
    EXPECT_EQ(std::memcmp((*dst)->data(), s, kBytes), 0);
    // Out-of-range async copies are refused, not run.
    EXPECT_FALSE((*sa)->CopyToDeviceAsync(**a, kBytes - 4, s, 8).ok());
    EXPECT_FALSE((*sa)->CopyToHostAsync((*dst)->data(), **a, kBytes, 1).ok());
  }
}

TEST(HostMemoryInfoTest, ReadsMeminfoAndHonoursTheCgroupLimit) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("kiln-meminfo-" + std::to_string(getpid())))
          .string();
  std::filesystem::create_directories(dir + "/cg");
  std::ofstream(dir + "/meminfo") << "MemTotal:       16384 kB\nMemFree:    1 kB\n"
                                     "MemAvailable:   8192 kB\n";
  StatusOr<DeviceMemoryInfo> m = HostMemoryInfo(dir + "/meminfo", dir + "/none");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->total_bytes, 16384u << 10);
  EXPECT_EQ(m->free_bytes, 8192u << 10);
  // A container limited to 4 MiB with 3 MiB in use: 4 MiB total, 1 MiB free.
  std::ofstream(dir + "/cg/memory.max") << (4 << 20) << "\n";
  std::ofstream(dir + "/cg/memory.current") << (3 << 20) << "\n";
  m = HostMemoryInfo(dir + "/meminfo", dir + "/cg");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->total_bytes, 4u << 20);
  EXPECT_EQ(m->free_bytes, 1u << 20);
  // "max" means no limit.
  std::ofstream(dir + "/cg/memory.max") << "max\n";
  m = HostMemoryInfo(dir + "/meminfo", dir + "/cg");
  EXPECT_EQ(m->total_bytes, 16384u << 10);
  // No meminfo: a clear error, not zeros.
  EXPECT_EQ(HostMemoryInfo(dir + "/missing", "").status().code(), StatusCode::kUnavailable);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln::backend
