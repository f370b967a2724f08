#include "engine/profile.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"

namespace kiln {

struct LaunchProfile::Impl {
  struct Row {
    double seconds = 0, flops = 0;
    int64_t calls = 0;
  };
  mutable std::mutex mu;
  absl::flat_hash_map<std::string, Row> rows;
  int64_t runs = 0, launches = 0;
  double run_seconds = 0;
};

LaunchProfile::LaunchProfile() : impl_(new Impl) {}
LaunchProfile::~LaunchProfile() { delete impl_; }

void LaunchProfile::Add(const std::string& key, double seconds, double flops) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl::Row& r = impl_->rows[key];
  r.seconds += seconds;
  r.flops += flops;
  ++r.calls;
}

void LaunchProfile::AddRun(int launches, double seconds) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ++impl_->runs;
  impl_->launches += launches;
  impl_->run_seconds += seconds;
}

std::string LaunchProfile::Report() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::pair<std::string, Impl::Row>> rows(impl_->rows.begin(), impl_->rows.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double total = 0;
  for (const auto& [key, r] : rows) total += r.seconds;
  std::string out = absl::StrFormat(
      "=== kiln launch profile: %d runs, %d launches (%.1f per run), %.3f s in runs, %.3f s in "
      "launches ===\n%6s %10s %8s %10s %8s  %s\n",
      impl_->runs, impl_->launches,
      impl_->runs ? static_cast<double>(impl_->launches) / static_cast<double>(impl_->runs) : 0.0,
      impl_->run_seconds, total, "share", "total ms", "calls", "mean us", "GFLOP/s", "launch");
  for (const auto& [key, r] : rows) {
    const std::string rate =
        r.flops > 0 && r.seconds > 0 ? absl::StrFormat("%.1f", r.flops / r.seconds * 1e-9) : "";
    absl::StrAppendFormat(&out, "%5.1f%% %10.2f %8d %10.1f %8s  %s\n",
                          total > 0 ? 100 * r.seconds / total : 0.0, r.seconds * 1e3, r.calls,
                          r.seconds * 1e6 / static_cast<double>(r.calls), rate, key);
  }
  return out;
}

namespace {

void WriteReportAtExit() {
  const std::string text = LaunchProfile::Get()->Report();
  if (const char* file = std::getenv("KILN_PROFILE_FILE"); file != nullptr && *file) {
    if (FILE* f = std::fopen(file, "a")) {
      std::fwrite(text.data(), 1, text.size(), f);
      std::fclose(f);
      return;
    }
  }
  std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace

LaunchProfile* LaunchProfile::Get() {
  static LaunchProfile* profile = []() -> LaunchProfile* {
    const char* v = std::getenv("KILN_PROFILE");
    if (v == nullptr || *v == '\0' || std::string_view(v) == "0") return nullptr;
    auto* p = new LaunchProfile;  // leaked: reported by the atexit handler
    std::atexit(WriteReportAtExit);
    return p;
  }();
  return profile;
}

std::string FoldBlockIndex(const std::string& name) {
  static constexpr std::string_view kBlock = "blk.";
  std::string out;
  size_t i = 0;
  while (i < name.size()) {
    const size_t at = name.find(kBlock, i);
    if (at == std::string::npos) break;
    size_t j = at + kBlock.size();
    size_t k = j;
    while (k < name.size() && std::isdigit(static_cast<unsigned char>(name[k]))) ++k;
    out.append(name, i, j - i);
    if (k > j) {
      out += '*';
    }
    i = k;
  }
  out.append(name, i, std::string::npos);
  return out;
}

}  // namespace kiln
