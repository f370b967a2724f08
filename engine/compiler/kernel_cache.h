// The on-disk cache of compiled kernels (and of other derived artifacts, e.g. GEMM autotuning
// choices): immutable files keyed by a content hash, safe to share between processes.
//
// Where it lives (CacheDir()): $KILN_CACHE_DIR if set; else the directory given to
// SetCacheDir() — kilnd passes `<server.storage_dir>/cache` at start-up; else
// $XDG_CACHE_HOME/kiln or $HOME/.cache/kiln; else /tmp/kiln-cache-<uid>.
//
// Layout: <dir>/<namespace>/<key[0:2]>/<key>[.suffix] plus a `.sha256` sidecar holding the
// entry's length and SHA-256. Writers write a temporary file in the same directory and
// rename() it into place (atomic on POSIX), data first, sidecar last; readers verify the
// sidecar before trusting the data, so a torn, truncated or bit-flipped entry reads as a miss
// (and is counted in corrupt_entries()) and gets rebuilt by whoever needs it. Namespaces name
// everything the key does not cover (for kernels: compiler identity, flags, CPU features).
//
// Concurrency: any number of processes and threads may Get/Put the same keys at once; the
// last rename wins and every reader sees a complete entry. LockKey() serializes work on one
// key across processes (flock on a lock file), so two processes compiling the same program
// compile once: the second waits, then finds the entry.
//
// Thread-safety: all methods are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "engine/base/status.h"

namespace kiln::compiler {

// The process' default cache directory (see above). Thread-safe.
std::string CacheDir();
// Sets the directory used when KILN_CACHE_DIR is unset (kilnd: <storage_dir>/cache). Call at
// start-up, before compiling; thread-safe.
void SetCacheDir(std::string dir);

class DiskCache {
 public:
  // `dir` is created on first write. Empty: CacheDir().
  explicit DiskCache(std::string dir = "");

  const std::string& dir() const { return dir_; }

  // The bytes stored under (ns, key). NotFound when absent or corrupt (a corrupt entry is
  // removed). REQUIRES: ns and key are non-empty file-name-safe strings ([A-Za-z0-9._-]).
  StatusOr<std::string> Get(std::string_view ns, std::string_view key);
  // Stores `bytes` atomically (see above).
  Status Put(std::string_view ns, std::string_view key, std::string_view bytes);

  // Files that must keep their own name and format (shared objects to dlopen): the path of
  // the verified entry `<key><suffix>`, or NotFound.
  StatusOr<std::string> GetFile(std::string_view ns, std::string_view key, std::string_view suffix);
  // Moves `tmp_path` (a file on any filesystem) into the cache as `<key><suffix>`.
  Status PutFile(std::string_view ns, std::string_view key, std::string_view suffix,
                 const std::string& tmp_path);

  // A private scratch directory under <dir>/<ns>/tmp (same filesystem as the entries).
  StatusOr<std::string> MakeTempDir(std::string_view ns);

  // An exclusive cross-process lock on (ns, key), held until the Lock is destroyed.
  class Lock {
   public:
    Lock(Lock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
    Lock& operator=(Lock&&) = delete;
    ~Lock();

   private:
    friend class DiskCache;
    explicit Lock(int fd) : fd_(fd) {}
    int fd_;
  };
  StatusOr<Lock> LockKey(std::string_view ns, std::string_view key);

  // Entries found corrupt (and removed) by this object so far.
  int64_t corrupt_entries() const { return corrupt_.load(std::memory_order_relaxed); }

 private:
  std::string EntryPath(std::string_view ns, std::string_view key, std::string_view suffix) const;
  StatusOr<std::string> ReadVerified(const std::string& path);
  Status WriteAtomic(const std::string& path, std::string_view bytes);

  std::string dir_;
  std::atomic<int64_t> corrupt_{0};
};

}  // namespace kiln::compiler
