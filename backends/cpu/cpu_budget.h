// How many CPUs this process may actually use: the CPUs of its affinity mask, capped by its
// cgroup's CPU quota (cgroup v2 `cpu.max`, cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`)
// rounded up — a container limited to 1.5 CPUs on a 16-core host gets 2, not 16. A pool sized
// by the host's core count under such a quota spends most of each step waiting on throttled
// workers (docs/performance.md). The cpu backend's default thread count comes from here.
//
// Thread-safety: the functions are thread-safe (they read /proc and /sys each call).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kiln::backend {

struct CpuBudget {
  int affinity_cpus = 1;             // CPUs in the affinity mask (sched_getaffinity)
  std::optional<double> quota_cpus;  // quota / period of the strictest cgroup; none: unlimited
  std::string quota_source;          // the file it came from, for the start-up log
  // min(affinity_cpus, ceil(quota_cpus)), at least 1.
  int cpus() const;
};

// Reads the budget of this process. `root` prefixes /proc and /sys (tests use a fake tree).
CpuBudget ReadCpuBudget(const std::string& root = "");

// "max 100000" -> nullopt; "150000 100000" -> 1.5; malformed -> nullopt.
std::optional<double> ParseCpuMax(std::string_view contents);
// cgroup v1: quota "-1" (unlimited) or "150000" over period "100000".
std::optional<double> ParseCfsQuota(std::string_view quota, std::string_view period);

}  // namespace kiln::backend
