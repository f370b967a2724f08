// Process metrics in the names every Prometheus client library uses (process_*), read from
// /proc/self at each scrape. Linux only: elsewhere the gauges stay at 0 and a warning is
// logged once.
#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "engine/base/metrics.h"
#include "spdlog/spdlog.h"

namespace kiln::metrics {
namespace {

struct ProcStat {
  double cpu_seconds = 0;     // utime + stime
  double threads = 0;         // num_threads
  double start_ticks = 0;     // starttime, clock ticks after boot
  double virtual_bytes = 0;   // vsize
  double resident_pages = 0;  // rss
};

std::string ReadFile(const char* path) {
  std::ifstream in(path);
  if (!in) return {};
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Parses /proc/self/stat. The second field (comm) is in parentheses and may itself contain
// spaces and ')', so fields are counted from the last ')'.
bool ReadProcStat(ProcStat& out) {
  std::string text = ReadFile("/proc/self/stat");
  size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream in(text.substr(close + 1));
  std::vector<std::string> f;  // f[0] is field 3 (state) of proc(5)
  for (std::string tok; in >> tok;) f.push_back(tok);
  if (f.size() < 22) return false;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  auto num = [&](int field) { return std::strtod(f[field - 3].c_str(), nullptr); };
  out.cpu_seconds = (num(14) + num(15)) / ticks;
  out.threads = num(20);
  out.start_ticks = num(22);
  out.virtual_bytes = num(23);
  out.resident_pages = num(24);
  return true;
}

// Boot time (seconds since the epoch) from the `btime` line of /proc/stat.
bool ReadBootTime(double& out) {
  std::istringstream in(ReadFile("/proc/stat"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("btime ", 0) == 0) {
      out = std::strtod(line.c_str() + 6, nullptr);
      return true;
    }
  }
  return false;
}

// Counts the entries of /proc/self/fd, not counting the descriptor used to read it.
bool CountOpenFds(double& out) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return false;
  const int own = dirfd(dir);
  int count = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    if (std::atoi(e->d_name) == own) continue;
    ++count;
  }
  closedir(dir);
  out = count;
  return true;
}

struct ProcessCollector {
  Counter* cpu;
  Gauge* resident;
  Gauge* virtual_memory;
  Gauge* open_fds;
  Gauge* max_fds;
  Gauge* start_time;
  Gauge* threads;
  std::mutex mu;  // serializes concurrent scrapes (the CPU counter advances by a delta)
  bool warned = false;

  void Collect() {
    std::lock_guard<std::mutex> lock(mu);
    ProcStat st;
    double fds = 0;
    if (!ReadProcStat(st) || !CountOpenFds(fds)) {
      if (!warned) spdlog::warn("metrics: cannot read /proc/self; process_* metrics stay at 0");
      warned = true;
      return;
    }
    // A counter only moves forward: add what accrued since the last scrape.
    double delta = st.cpu_seconds - cpu->Value();
    if (delta > 0) cpu->Increment(delta);
    resident->Set(st.resident_pages * static_cast<double>(sysconf(_SC_PAGESIZE)));
    virtual_memory->Set(st.virtual_bytes);
    threads->Set(st.threads);
    open_fds->Set(fds);
    rlimit lim{};
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
      max_fds->Set(lim.rlim_cur == RLIM_INFINITY ? static_cast<double>(INT64_MAX)
                                                 : static_cast<double>(lim.rlim_cur));
    }
    double boot = 0;
    if (start_time->Value() == 0 && ReadBootTime(boot)) {
      start_time->Set(boot + st.start_ticks / static_cast<double>(sysconf(_SC_CLK_TCK)));
    }
  }
};

}  // namespace

void RegisterProcessMetrics(Registry& registry) {
  auto c = std::make_shared<ProcessCollector>();
  c->cpu = registry
               .AddCounter("process_cpu_seconds_total",
                           "Total user and system CPU time spent in seconds.")
               .WithLabels({});
  c->resident = registry.AddGauge("process_resident_memory_bytes", "Resident memory size in bytes.")
                    .WithLabels({});
  c->virtual_memory =
      registry.AddGauge("process_virtual_memory_bytes", "Virtual memory size in bytes.")
          .WithLabels({});
  c->open_fds =
      registry.AddGauge("process_open_fds", "Number of open file descriptors.").WithLabels({});
  c->max_fds = registry.AddGauge("process_max_fds", "Maximum number of open file descriptors.")
                   .WithLabels({});
  c->start_time = registry
                      .AddGauge("process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.")
                      .WithLabels({});
  c->threads =
      registry.AddGauge("process_threads", "Number of OS threads in the process.").WithLabels({});
  c->Collect();
  registry.AddCollector([c] { c->Collect(); });
}

}  // namespace kiln::metrics
