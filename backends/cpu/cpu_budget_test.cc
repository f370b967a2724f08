// The CPU budget: cgroup v2 `cpu.max` and v1 CFS quotas parsed, the strictest cgroup on the
// process' path (its own or an ancestor) taken, and the thread count rounded up from it — on
// fake /proc and /sys trees, and once on this machine (whatever its limits are).
#include "backends/cpu/cpu_budget.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

namespace kiln::backend {
namespace {

namespace fs = std::filesystem;

class FakeRoot {
 public:
  FakeRoot() {
    std::random_device rd;
    root_ = fs::temp_directory_path() / ("kiln_cpu_budget_" + std::to_string(rd()));
    fs::create_directories(root_);
  }
  ~FakeRoot() { fs::remove_all(root_); }
  void Write(const std::string& path, const std::string& contents) {
    const fs::path p = root_ / path.substr(1);
    fs::create_directories(p.parent_path());
    std::ofstream(p) << contents;
  }
  std::string root() const { return root_.string(); }

 private:
  fs::path root_;
};

TEST(CpuBudget, ParsesCpuMax) {
  EXPECT_EQ(ParseCpuMax("max 100000\n"), std::nullopt);
  EXPECT_DOUBLE_EQ(*ParseCpuMax("150000 100000\n"), 1.5);
  EXPECT_DOUBLE_EQ(*ParseCpuMax("50000 100000"), 0.5);
  EXPECT_EQ(ParseCpuMax(""), std::nullopt);
  EXPECT_EQ(ParseCpuMax("garbage"), std::nullopt);
  EXPECT_EQ(ParseCpuMax("0 100000"), std::nullopt);
  EXPECT_EQ(ParseCfsQuota("-1\n", "100000\n"), std::nullopt);
  EXPECT_DOUBLE_EQ(*ParseCfsQuota("200000\n", "100000\n"), 2.0);
  EXPECT_EQ(ParseCfsQuota("x", "100000"), std::nullopt);
}

TEST(CpuBudget, CpusRoundTheQuotaUpAndNeverExceedTheAffinity) {
  CpuBudget b;
  b.affinity_cpus = 16;
  EXPECT_EQ(b.cpus(), 16);
  b.quota_cpus = 1.5;
  EXPECT_EQ(b.cpus(), 2);
  b.quota_cpus = 2.0;
  EXPECT_EQ(b.cpus(), 2);
  b.quota_cpus = 0.2;
  EXPECT_EQ(b.cpus(), 1);
  b.affinity_cpus = 1;
  b.quota_cpus = 4;
  EXPECT_EQ(b.cpus(), 1);
}

TEST(CpuBudget, CgroupV2TakesTheStrictestOnThePath) {
  FakeRoot r;
  r.Write("/proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  r.Write("/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n");
  r.Write("/sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n");
  r.Write("/sys/fs/cgroup/kubepods/cpu.max", "400000 100000\n");
  const CpuBudget b = ReadCpuBudget(r.root());
  ASSERT_TRUE(b.quota_cpus.has_value());
  EXPECT_DOUBLE_EQ(*b.quota_cpus, 1.5);
  EXPECT_NE(b.quota_source.find("kubepods/pod1/cpu.max"), std::string::npos) << b.quota_source;
  EXPECT_LE(b.cpus(), 2);
}

TEST(CpuBudget, CgroupNamespaceRootAndV1) {
  FakeRoot v2;  // inside a cgroup namespace the container's own cgroup is "/"
  v2.Write("/proc/self/cgroup", "0::/\n");
  v2.Write("/sys/fs/cgroup/cpu.max", "100000 100000\n");
  EXPECT_DOUBLE_EQ(*ReadCpuBudget(v2.root()).quota_cpus, 1.0);
  EXPECT_EQ(ReadCpuBudget(v2.root()).cpus(), 1);

  FakeRoot v1;
  v1.Write("/proc/self/cgroup", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n");
  v1.Write("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n");
  v1.Write("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  const CpuBudget b = ReadCpuBudget(v1.root());
  ASSERT_TRUE(b.quota_cpus.has_value());
  EXPECT_DOUBLE_EQ(*b.quota_cpus, 2.5);
  EXPECT_LE(b.cpus(), 3);
}

TEST(CpuBudget, NoCgroupOrNoLimitMeansTheAffinity) {
  FakeRoot none;  // no /proc/self/cgroup at all
  EXPECT_FALSE(ReadCpuBudget(none.root()).quota_cpus.has_value());
  FakeRoot unlimited;
  unlimited.Write("/proc/self/cgroup", "0::/user.slice\n");
  unlimited.Write("/sys/fs/cgroup/user.slice/cpu.max", "max 100000\n");
  const CpuBudget b = ReadCpuBudget(unlimited.root());
  EXPECT_FALSE(b.quota_cpus.has_value());
  EXPECT_EQ(b.cpus(), b.affinity_cpus);
}

TEST(CpuBudget, ThisProcessHasAtLeastOneCpu) {
  const CpuBudget b = ReadCpuBudget();
  EXPECT_GE(b.affinity_cpus, 1);
  EXPECT_LE(b.affinity_cpus, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_GE(b.cpus(), 1);
}

}  // namespace
}  // namespace kiln::backend
