#include "backends/cpu/kernels/autotune.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/compiler/kernel_cache.h"
#include "spdlog/spdlog.h"

namespace kiln::cpu {
namespace {

constexpr char kFileName[] = "cpu_gemm_tuning.v3.txt";
// Runs this long are timed less (Choose).
constexpr double kLongRunS = 0.05;

// Parses "key\tm=name m=name" lines into `out` (malformed lines are skipped).
void ParseInto(std::istream& in,
               std::map<std::string, std::map<int64_t, std::string>, std::less<>>* out) {
  std::string line;
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t');
    if (tab == std::string::npos || tab == 0) continue;
    std::map<int64_t, std::string> e;
    std::istringstream fields(line.substr(tab + 1));
    std::string f;
    bool ok = true;
    while (fields >> f) {
      const size_t eq = f.find('=');
      char* end = nullptr;
      const long long m = eq == std::string::npos ? 0 : std::strtoll(f.c_str(), &end, 10);
      if (eq == std::string::npos || end != f.c_str() + eq || m <= 0 || eq + 1 == f.size()) {
        ok = false;
        break;
      }
      e[m] = f.substr(eq + 1);
    }
    if (ok && !e.empty()) (*out)[line.substr(0, tab)] = std::move(e);
  }
}

}  // namespace

bool AutotuneEnabled() {
  const char* v = std::getenv("KILN_CPU_AUTOTUNE");
  return v == nullptr || std::string_view(v) != "0";
}

GemmTuner::GemmTuner(std::string dir, bool timing_enabled, Now now)
    : file_(dir.empty() ? "" : (std::filesystem::path(dir) / kFileName).string()),
      timing_enabled_(timing_enabled),
      now_(now != nullptr ? std::move(now) : Now([] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
      })) {}

GemmTuner& GemmTuner::Global() {
  static GemmTuner* t = new GemmTuner(compiler::CacheDir(), AutotuneEnabled());
  return *t;
}

int64_t GemmTuner::timed_runs() const {
  std::lock_guard<std::mutex> l(mu_);
  return timed_runs_;
}

void GemmTuner::LoadLocked() {
  if (loaded_) return;
  loaded_ = true;
  if (file_.empty()) return;
  std::ifstream in(file_);
  if (in) ParseInto(in, &entries_);
}

Status GemmTuner::SaveLocked(const std::string& key, const Entry& e) {
  if (file_.empty()) return OkStatus();
  const std::filesystem::path path(file_);
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) {
    return Unavailable("cannot create the cache directory ", path.parent_path().string(), ": ",
                       ec.message());
  }
  // Merge with what other processes wrote meanwhile; this process's entry wins for `key`.
  std::map<std::string, Entry, std::less<>> merged;
  if (std::ifstream in(file_); in) ParseInto(in, &merged);
  merged[key] = e;
  std::ostringstream tid;
  tid << std::this_thread::get_id();
  const std::string tmp = file_ + ".tmp." + std::to_string(::getpid()) + "." + tid.str();
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& [k, entry] : merged) {
      out << k << '\t';
      bool first = true;
      for (const auto& [m, name] : entry) {
        out << (first ? "" : " ") << m << '=' << name;
        first = false;
      }
      out << '\n';
    }
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return Unavailable("cannot write ", tmp);
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return Unavailable("cannot replace ", file_, ": ", ec.message());
  }
  for (const auto& [k, entry] : merged) entries_[k] = entry;
  return OkStatus();
}

StatusOr<std::optional<std::vector<int>>> GemmTuner::Choose(std::string_view key,
                                                            std::span<const std::string> names,
                                                            std::span<const int64_t> ms,
                                                            const RunFn& run) {
  KILN_CHECK(!names.empty(), "GemmTuner::Choose needs candidates");
  std::lock_guard<std::mutex> l(mu_);
  LoadLocked();
  auto index_of = [&](const std::string& n) {
    return static_cast<int>(std::find(names.begin(), names.end(), n) - names.begin());
  };
  if (auto it = entries_.find(key); it != entries_.end()) {
    std::vector<int> out;
    for (int64_t m : ms) {
      auto e = it->second.find(m);
      if (e == it->second.end() || index_of(e->second) == static_cast<int>(names.size())) break;
      out.push_back(index_of(e->second));
    }
    if (out.size() == ms.size()) return std::optional<std::vector<int>>(std::move(out));
  }
  if (!timing_enabled_) return std::optional<std::vector<int>>();

  const double started = now_();
  Entry entry;
  std::vector<int> out;
  for (int64_t m : ms) {
    // One warm-up run per candidate (not counted: it includes one-time costs such as
    // oneDNN's primitive creation), then rounds that run every candidate once (so load from
    // other processes hits all of them alike): at least 2, and up to 5 while they take less
    // than ~30 ms; the minimum per candidate counts. A later candidate must beat the earlier
    // best by 3%: the list is ordered from the default choice on, and a tie is noise.
    // Long runs are timed less (a first start pays for all of them; SmolLM2's LM head at
    // M = 512 runs ~0.3 s a candidate): where the fastest warm-up took kLongRunS or more, one
    // round suffices, and a candidate whose warm-up took over twice the fastest one's is out
    // (a one-time cost that large is not expected; it could not win by timing noise).
    const int nc = static_cast<int>(names.size());
    std::vector<double> warm_s(nc), best_s(nc, 1e30);
    double round_total = 0;
    for (int c = 0; c < nc; ++c) {
      const double t0 = now_();
      KILN_RETURN_IF_ERROR(run(c, m));
      warm_s[c] = now_() - t0;
      round_total += warm_s[c];
      ++timed_runs_;
    }
    const double fastest_warm = *std::min_element(warm_s.begin(), warm_s.end());
    const bool long_runs = fastest_warm >= kLongRunS;
    std::vector<bool> timed(nc);
    for (int c = 0; c < nc; ++c) timed[c] = !long_runs || warm_s[c] <= 2 * fastest_warm;
    const int min_rounds = long_runs ? 1 : 2;
    for (int round = 0; round < 5 && (round < min_rounds || round_total * (round + 1) < 0.03);
         ++round) {
      for (int c = 0; c < nc; ++c) {
        if (!timed[c]) continue;
        const double t0 = now_();
        KILN_RETURN_IF_ERROR(run(c, m));
        best_s[c] = std::min(best_s[c], now_() - t0);
        ++timed_runs_;
      }
    }
    int best = static_cast<int>(std::find(timed.begin(), timed.end(), true) - timed.begin());
    for (int c = best + 1; c < nc; ++c) {
      if (timed[c] && best_s[c] < 0.97 * best_s[best]) best = c;
    }
    if (spdlog::should_log(spdlog::level::debug)) {
      std::string times;
      for (int c = 0; c < nc; ++c) {
        absl::StrAppend(&times, " ", names[c], " ",
                        timed[c] ? absl::StrFormat("%.2f", best_s[c] * 1e3)
                                 : absl::StrFormat("out (warm-up %.2f)", warm_s[c] * 1e3),
                        " ms");
      }
      spdlog::debug("cpu autotune: {} M={}:{}", key, m, times);
    }
    out.push_back(best);
    entry[m] = names[best];
  }
  std::string summary;
  for (const auto& [m, name] : entry) absl::StrAppend(&summary, " ", m, "=", name);
  spdlog::info("cpu autotune: {}:{} ({:.0f} ms)", key, summary, (now_() - started) * 1e3);
  const std::string k(key);
  if (Status s = SaveLocked(k, entry); !s.ok()) {
    spdlog::warn("cpu autotune: choice kept in memory only: {}", StatusMessage(s));
  }
  entries_[k] = std::move(entry);
  return std::optional<std::vector<int>>(std::move(out));
}

}  // namespace kiln::cpu
