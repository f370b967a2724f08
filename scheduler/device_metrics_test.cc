#include "scheduler/device_metrics.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "engine/backend/backend.h"

namespace kiln::scheduler {
namespace {

// A device with a memory figure and allocator statistics (as a GPU has), or neither.
class FakeDevice final : public backend::Device {
 public:
  FakeDevice(std::string name, bool reports) : name_(std::move(name)), reports_(reports) {}
  std::string_view name() const override { return name_; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t) override {
    return Unimplemented("fake");
  }
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
    return Unimplemented("fake");
  }
  bool SupportsDType(DType) const override { return false; }
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest&) override {
    return Unimplemented("fake");
  }
  StatusOr<backend::DeviceMemoryInfo> MemoryInfo() override {
    if (!reports_) return Unimplemented("fake");
    return backend::DeviceMemoryInfo{80ull << 30, 70ull << 30};
  }
  std::optional<backend::DeviceAllocatorStats> AllocatorStatistics() const override {
    if (!reports_) return std::nullopt;
    return backend::DeviceAllocatorStats{6ull << 30, 5ull << 30, 7ull << 30, 12};
  }

 private:
  std::string name_;
  bool reports_;
};

TEST(DeviceMetricsTest, GpusReportTheirMemoryHostDevicesNothing) {
  metrics::Registry registry;
  FakeDevice gpu("cuda:0", true), host("cpu:0", false);
  backend::Device* devices[] = {&gpu, &host};
  internal::CollectDeviceMetrics(registry, devices);
  const std::string text = registry.Serialize();
  for (const char* line :
       {"kiln_device_memory_bytes{device=\"cuda:0\",kind=\"total\"} 85899345920\n",
        "kiln_device_memory_bytes{device=\"cuda:0\",kind=\"free\"} 75161927680\n",
        "kiln_device_memory_bytes{device=\"cuda:0\",kind=\"reserved\"} 6442450944\n",
        "kiln_device_memory_bytes{device=\"cuda:0\",kind=\"allocated\"} 5368709120\n",
        "kiln_device_memory_bytes{device=\"cuda:0\",kind=\"peak_allocated\"} 7516192768\n",
        "kiln_device_memory_segments{device=\"cuda:0\"} 12\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
  EXPECT_EQ(text.find("cpu:0"), std::string::npos) << text;
}

// kilnd registers the families whatever the machine has; with no GPU they stay empty.
TEST(DeviceMetricsTest, RegisteredFamiliesScrapeWithoutAGpu) {
  metrics::Registry registry;
  RegisterDeviceMetrics(registry, [] { return std::vector<backend::Device*>(); });
  const std::string text = registry.Serialize();
  EXPECT_NE(text.find("# TYPE kiln_device_memory_bytes gauge"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE kiln_device_memory_segments gauge"), std::string::npos) << text;
}

}  // namespace
}  // namespace kiln::scheduler
