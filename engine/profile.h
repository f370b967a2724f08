// The launch profiler: `KILN_PROFILE=1` makes every Program::Run time each launch on its own
// (synchronising the stream after each one, so a profiled run is slower than a normal one and
// cross-launch overlap on device backends disappears) and adds the time to a per-process table
// keyed by (node name prefix, op, kernel, concrete shapes). At process exit the table is
// written to stderr, or to the file named by KILN_PROFILE_FILE (appended), sorted by total
// time: the share, total milliseconds, calls, mean microseconds and GFLOP/s where the op's
// FLOPs are known (matmul, linear). `kiln finetune`, `kiln generate` and kilnd all honour it.
//
// Per-block node names ("blk.7.attn_q") are folded to "blk.*" so one row covers all layers.
//
// Thread-safety: Add and Report may be called from any thread (one mutex).
#pragma once

#include <cstdint>
#include <string>

namespace kiln {

class LaunchProfile {
 public:
  // The process-wide profile when KILN_PROFILE is set to something other than "" or "0";
  // null otherwise (read once).
  static LaunchProfile* Get();

  // One launch of `key` took `seconds` and computed `flops` (0: unknown).
  void Add(const std::string& key, double seconds, double flops);
  // One profiled Program::Run with `launches` launches took `seconds` in all.
  void AddRun(int launches, double seconds);
  // The table, sorted by total time.
  std::string Report() const;

  LaunchProfile();
  ~LaunchProfile();
  LaunchProfile(const LaunchProfile&) = delete;
  LaunchProfile& operator=(const LaunchProfile&) = delete;

 private:
  struct Impl;
  Impl* impl_;
};

// "blk.12.attn_q.lora_a" -> "blk.*.attn_q.lora_a"; other names unchanged.
std::string FoldBlockIndex(const std::string& name);

}  // namespace kiln
