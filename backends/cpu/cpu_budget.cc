#include "backends/cpu/cpu_budget.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kiln::backend {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The cgroup directories of this process from /proc/self/cgroup, innermost first with their
// ancestors up to the hierarchy's root: v2 ("0::/a/b") under <root>/sys/fs/cgroup, v1 lines
// naming the cpu controller under <root>/sys/fs/cgroup/<controllers>.
struct CgroupDirs {
  std::vector<std::string> v2, v1;
};

std::vector<std::string> WithAncestors(const std::string& mount, absl::string_view path) {
  std::vector<std::string> out;
  std::string p(absl::StripSuffix(path, "/"));
  while (true) {
    out.push_back(mount + p);
    if (p.empty()) break;
    p = p.substr(0, p.rfind('/'));
  }
  return out;
}

CgroupDirs FindCgroups(const std::string& root) {
  CgroupDirs d;
  const std::optional<std::string> self = ReadFile(root + "/proc/self/cgroup");
  if (!self) return d;
  for (absl::string_view line : absl::StrSplit(*self, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {
      const std::vector<std::string> dirs = WithAncestors(root + "/sys/fs/cgroup", f[2]);
      d.v2.insert(d.v2.end(), dirs.begin(), dirs.end());
      continue;
    }
    for (absl::string_view c : absl::StrSplit(f[1], ',')) {
      if (c != "cpu") continue;
      for (const char* mount : {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"}) {
        const std::vector<std::string> dirs = WithAncestors(root + mount, f[2]);
        d.v1.insert(d.v1.end(), dirs.begin(), dirs.end());
      }
    }
  }
  return d;
}

int AffinityCpus(const std::string& root) {
  if (root.empty()) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

int CpuBudget::cpus() const {
  int n = affinity_cpus;
  if (quota_cpus) n = std::min(n, static_cast<int>(std::ceil(*quota_cpus - 1e-9)));
  return std::max(1, n);
}

std::optional<double> ParseCpuMax(std::string_view contents) {
  const std::vector<absl::string_view> f =
      absl::StrSplit(absl::StripAsciiWhitespace(Absl(contents)), ' ', absl::SkipEmpty());
  if (f.size() != 2 || f[0] == "max") return std::nullopt;
  double quota = 0, period = 0;
  if (!absl::SimpleAtod(f[0], &quota) || !absl::SimpleAtod(f[1], &period) || quota <= 0 ||
      period <= 0) {
    return std::nullopt;
  }
  return quota / period;
}

std::optional<double> ParseCfsQuota(std::string_view quota, std::string_view period) {
  double q = 0, p = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(Absl(quota)), &q) ||
      !absl::SimpleAtod(absl::StripAsciiWhitespace(Absl(period)), &p) || q <= 0 || p <= 0) {
    return std::nullopt;  // -1: unlimited
  }
  return q / p;
}

CpuBudget ReadCpuBudget(const std::string& root) {
  CpuBudget b;
  b.affinity_cpus = AffinityCpus(root);
  auto take = [&](std::optional<double> q, const std::string& source) {
    if (q && (!b.quota_cpus || *q < *b.quota_cpus)) {
      b.quota_cpus = q;
      b.quota_source = source;
    }
  };
  const CgroupDirs dirs = FindCgroups(root);
  for (const std::string& dir : dirs.v2) {
    if (auto c = ReadFile(dir + "/cpu.max")) take(ParseCpuMax(*c), dir + "/cpu.max");
  }
  for (const std::string& dir : dirs.v1) {
    const auto q = ReadFile(dir + "/cpu.cfs_quota_us"), p = ReadFile(dir + "/cpu.cfs_period_us");
    if (q && p) take(ParseCfsQuota(*q, *p), dir + "/cpu.cfs_quota_us");
  }
  return b;
}

}  // namespace kiln::backend
