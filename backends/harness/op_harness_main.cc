// kiln_op_harness: the cross-backend op harness as a command-line tool.
//
//   kiln_op_harness [--mode=forward|gradient|perf|all] [--backend=NAME] [--op=NAME]
//                   [--full] [--iters=N] [--list]
//
// Prints one line per case and backend; exits 1 if any case fails.
#include <cstdio>
#include <cstring>
#include <string>

#include "backends/registry.h"
#include "engine/testing/op_harness.h"

namespace {

bool Flag(const char* arg, const char* name, std::string* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0) return false;
  if (arg[n] == '=') {
    value->assign(arg + n + 1);
    return true;
  }
  if (arg[n] == '\0') {
    value->assign(1, '1');  // (not `= "1"`: GCC 12 -Wrestrict false positive)
    return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kiln;
  using namespace kiln::harness;
  std::string mode = "forward", backend_name, op, full, iters = "20", list;
  for (int i = 1; i < argc; ++i) {
    if (Flag(argv[i], "--mode", &mode) || Flag(argv[i], "--backend", &backend_name) ||
        Flag(argv[i], "--op", &op) || Flag(argv[i], "--full", &full) ||
        Flag(argv[i], "--iters", &iters) || Flag(argv[i], "--list", &list)) {
      continue;
    }
    std::fprintf(stderr,
                 "usage: %s [--mode=forward|gradient|perf|all] [--backend=NAME] [--op=NAME] "
                 "[--full] [--iters=N] "
                 "[--list]\n",
                 argv[0]);
    return 2;
  }
  backend::Registry& reg = backend::Registry::Global();
  backend::Device* ref = *reg.GetDevice("ref");
  const bool is_full = !full.empty();
  int failed = 0, passed = 0, unsupported = 0;
  auto for_devices = [&](auto&& fn) {
    for (backend::Backend* be : reg.backends()) {
      if (!backend_name.empty() ? be->name() != backend_name : be->name() == "ref") continue;
      for (int d = 0; d < be->device_count(); ++d) fn(*be->device(d));
    }
  };
  auto report = [&](const char* m, backend::Device& dev, const OpCase& c, const Result& r) {
    const char* tag = r.outcome == Result::Outcome::kPass   ? "PASS"
                      : r.outcome == Result::Outcome::kFail ? "FAIL"
                                                            : "SKIP";
    std::printf("%-4s %-8s %-7s %-60s %s\n", tag, m, std::string(dev.name()).c_str(),
                c.name.c_str(), r.message.c_str());
    (r.outcome == Result::Outcome::kPass   ? passed
     : r.outcome == Result::Outcome::kFail ? failed
                                           : unsupported)++;
  };
  auto run_mode = [&](const char* m, const std::vector<OpCase>& cases, auto&& fn) {
    for (const OpCase& c : cases) {
      if (!op.empty() && c.op != op) continue;
      if (!list.empty()) {
        std::printf("%-8s %s\n", m, c.name.c_str());
        continue;
      }
      for_devices([&](backend::Device& dev) { report(m, dev, c, fn(c, dev)); });
    }
  };
  if (mode == "forward" || mode == "all") {
    run_mode("forward", ForwardCases(is_full),
             [&](const OpCase& c, backend::Device& d) { return RunForward(c, *ref, d); });
  }
  if (mode == "gradient" || mode == "all") {
    run_mode("gradient", GradientCases(is_full),
             [&](const OpCase& c, backend::Device& d) { return RunGradient(c, *ref, d); });
  }
  if (mode == "perf" || mode == "all") {
    const int n = std::max(1, std::atoi(iters.c_str()));
    run_mode("perf", PerfCases(is_full),
             [&](const OpCase& c, backend::Device& d) { return RunPerf(c, d, n); });
    if (list.empty()) {
      for_devices([&](backend::Device& dev) {
        auto ns = LaunchOverheadNs(dev, 1000, n);
        if (ns.ok())
          std::printf("perf     %-7s launch overhead: %.0f ns/launch\n",
                      std::string(dev.name()).c_str(), *ns);
      });
    }
  }
  if (list.empty())
    std::printf("%d passed, %d failed, %d unsupported\n", passed, failed, unsupported);
  return failed ? 1 : 0;
}
