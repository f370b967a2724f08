#include "engine/compiler/kernel_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>

#include "engine/compiler/hash.h"
#include "engine/compiler/host_services.h"

namespace kiln::compiler {
namespace {

std::mutex& DirMutex() {
  static std::mutex* m = new std::mutex();
  return *m;
}
std::string& ConfiguredDir() {
  static std::string* d = new std::string();
  return *d;
}

bool SafeName(std::string_view s) {
  if (s.empty() || s == "." || s == "..") return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

Status Errno(std::string_view what, const std::string& path) {
  return Internal(what, " '", path, "': ", std::strerror(errno));
}

std::string RandomSuffix() {
  static thread_local std::mt19937_64 rng(std::random_device{}() ^
                                          (static_cast<uint64_t>(getpid()) << 32));
  return StrCat(getpid(), "-", rng() % 1000000007ULL);
}

Status MakeDirs(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec && !std::filesystem::is_directory(dir)) {
    return Internal("cannot create the cache directory '", dir, "': ", ec.message());
  }
  return OkStatus();
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("no file '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string SidecarText(std::string_view bytes) {
  return StrCat(Sha256Hex(bytes), " ", bytes.size(), "\n");
}

}  // namespace

std::string CacheDir() {
  // In a plugin: the directory the host resolves (kilnd's SetCacheDir is the host's).
  if (const HostServices* host = AdoptedHostServices()) return host->cache_dir();
  if (const char* env = std::getenv("KILN_CACHE_DIR"); env != nullptr && *env != '\0') return env;
  {
    std::lock_guard<std::mutex> l(DirMutex());
    if (!ConfiguredDir().empty()) return ConfiguredDir();
  }
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    return StrCat(x, "/kiln");
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return StrCat(h, "/.cache/kiln");
  }
  return StrCat("/tmp/kiln-cache-", getuid());
}

void SetCacheDir(std::string dir) {
  std::lock_guard<std::mutex> l(DirMutex());
  ConfiguredDir() = std::move(dir);
}

DiskCache::DiskCache(std::string dir) : dir_(dir.empty() ? CacheDir() : std::move(dir)) {}

DiskCache::Lock::~Lock() {
  if (fd_ >= 0) close(fd_);  // releases the flock
}

std::string DiskCache::EntryPath(std::string_view ns, std::string_view key,
                                 std::string_view suffix) const {
  return StrCat(dir_, "/", ns, "/", key.substr(0, 2), "/", key, suffix);
}

Status DiskCache::WriteAtomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = StrCat(path, ".tmp.", RandomSuffix());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Errno("cannot write", tmp);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) {
      std::remove(tmp.c_str());
      return Errno("cannot write", tmp);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const Status s = Errno("cannot rename into", path);
    std::remove(tmp.c_str());
    return s;
  }
  return OkStatus();
}

StatusOr<std::string> DiskCache::ReadVerified(const std::string& path) {
  StatusOr<std::string> side = ReadFile(path + ".sha256");
  if (!side.ok()) return NotFound("cache miss");
  StatusOr<std::string> data = ReadFile(path);
  if (data.ok() && *side == SidecarText(*data)) return data;
  // Present but wrong (torn write, truncation, bit rot): drop it so it is rebuilt.
  corrupt_.fetch_add(1, std::memory_order_relaxed);
  std::remove(path.c_str());
  std::remove((path + ".sha256").c_str());
  return NotFound("corrupt cache entry '", path, "' removed");
}

StatusOr<std::string> DiskCache::Get(std::string_view ns, std::string_view key) {
  KILN_CHECK(SafeName(ns) && SafeName(key), "DiskCache: unsafe namespace or key");
  return ReadVerified(EntryPath(ns, key, ""));
}

Status DiskCache::Put(std::string_view ns, std::string_view key, std::string_view bytes) {
  KILN_CHECK(SafeName(ns) && SafeName(key), "DiskCache: unsafe namespace or key");
  const std::string path = EntryPath(ns, key, "");
  KILN_RETURN_IF_ERROR(MakeDirs(std::filesystem::path(path).parent_path().string()));
  KILN_RETURN_IF_ERROR(WriteAtomic(path, bytes));
  return WriteAtomic(path + ".sha256", SidecarText(bytes));
}

StatusOr<std::string> DiskCache::GetFile(std::string_view ns, std::string_view key,
                                         std::string_view suffix) {
  KILN_CHECK(SafeName(ns) && SafeName(key), "DiskCache: unsafe namespace or key");
  const std::string path = EntryPath(ns, key, suffix);
  KILN_RETURN_IF_ERROR(ReadVerified(path).status());
  return path;
}

Status DiskCache::PutFile(std::string_view ns, std::string_view key, std::string_view suffix,
                          const std::string& tmp_path) {
  KILN_CHECK(SafeName(ns) && SafeName(key), "DiskCache: unsafe namespace or key");
  const std::string path = EntryPath(ns, key, suffix);
  KILN_RETURN_IF_ERROR(MakeDirs(std::filesystem::path(path).parent_path().string()));
  KILN_ASSIGN_OR_RETURN(std::string bytes, ReadFile(tmp_path));
  // A copy next to the destination, then rename: atomic even if tmp_path is elsewhere.
  KILN_RETURN_IF_ERROR(WriteAtomic(path, bytes));
  return WriteAtomic(path + ".sha256", SidecarText(bytes));
}

StatusOr<std::string> DiskCache::MakeTempDir(std::string_view ns) {
  KILN_CHECK(SafeName(ns), "DiskCache: unsafe namespace");
  const std::string base = StrCat(dir_, "/", ns, "/tmp");
  KILN_RETURN_IF_ERROR(MakeDirs(base));
  std::string tmpl = base + "/build-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return Errno("cannot create a directory in", base);
  return tmpl;
}

StatusOr<DiskCache::Lock> DiskCache::LockKey(std::string_view ns, std::string_view key) {
  KILN_CHECK(SafeName(ns) && SafeName(key), "DiskCache: unsafe namespace or key");
  const std::string path = EntryPath(ns, key, ".lock");
  KILN_RETURN_IF_ERROR(MakeDirs(std::filesystem::path(path).parent_path().string()));
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot open the lock file", path);
  while (flock(fd, LOCK_EX) != 0) {
    if (errno == EINTR) continue;
    const Status s = Errno("cannot lock", path);
    close(fd);
    return s;
  }
  return Lock(fd);
}

}  // namespace kiln::compiler
