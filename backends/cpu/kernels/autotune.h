// Max-autotune for the cpu backend: when a program is compiled, each GEMM shape's candidate
// implementations are timed at representative M values and the fastest per M is kept —
// in memory and in a small text file in the cache directory, so that a later compile of
// the same shape (in this process or the next) times nothing. A first start times every
// shape, so long runs are timed less: one round where the fastest warm-up took 50 ms or
// more, without the candidates that took over twice as long (Choose), and weights of more
// than 8,192 rows on their first 8,192 (linear.cc kMaxTimedN).
//
// Cache: `<dir>/cpu_gemm_tuning.v3.txt`, one line per key: `<key>\t<m>=<name> ...` (older
// files are not read: v1 timings counted the warm-up run, v2 ones timed a GEMV that decoded
// each weight strip again for every four rows of x). The key
// names the op, types, shape, instruction-set variant, thread count and CPU model, so a
// file copied to another machine is never trusted for this one. Writers merge with the
// file's current contents and replace it by atomic rename, so concurrent processes lose
// nothing but a race on the same key (either result is valid).
//
// Directory: the kernel cache's (compiler::CacheDir(): $KILN_CACHE_DIR, else kilnd's
// <storage_dir>/cache, else ~/.cache/kiln), read when the process-wide tuner is first used.
// KILN_CPU_AUTOTUNE=0 turns timing off: cached choices are still used, others fall back to
// the caller's heuristic.
//
// Thread-safety: GemmTuner is thread-safe; Choose serializes timing runs (they need the
// whole machine to be meaningful).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::cpu {

// False when KILN_CPU_AUTOTUNE=0.
bool AutotuneEnabled();

class GemmTuner {
 public:
  // Seconds on a monotonic clock: std::chrono::steady_clock by default; tests pass one their
  // candidates advance, so that timings are exact and no test sleeps.
  using Now = std::function<double()>;

  // Persists to `dir` (created when first written); an empty `dir` keeps choices in memory.
  explicit GemmTuner(std::string dir, bool timing_enabled = true, Now now = nullptr);
  // The process-wide tuner: compiler::CacheDir(), AutotuneEnabled().
  static GemmTuner& Global();

  // Runs candidate `c` once at M = `m` and returns when it is done.
  using RunFn = std::function<Status(int c, int64_t m)>;

  // For every m in `ms`, the index into `names` of the fastest candidate: cached if `key`
  // was tuned before with every m of `ms` and candidates of these names, else timed with
  // `run` (min over a few runs after a warm-up) and stored. Nullopt when timing is off and
  // nothing is cached. Errors from `run` are returned.
  // REQUIRES: names is not empty; names and key contain no tab, newline or '='/' '.
  StatusOr<std::optional<std::vector<int>>> Choose(std::string_view key,
                                                   std::span<const std::string> names,
                                                   std::span<const int64_t> ms, const RunFn& run);

  // Timing runs made by this tuner so far (a warm cache makes none).
  int64_t timed_runs() const;
  // The cache file ("" when memory-only).
  const std::string& file() const { return file_; }

 private:
  using Entry = std::map<int64_t, std::string>;  // m -> candidate name
  void LoadLocked();
  Status SaveLocked(const std::string& key, const Entry& e);

  const std::string file_;
  const bool timing_enabled_;
  const Now now_;
  mutable std::mutex mu_;
  bool loaded_ = false;
  std::map<std::string, Entry, std::less<>> entries_;
  int64_t timed_runs_ = 0;
};

}  // namespace kiln::cpu
