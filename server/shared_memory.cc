#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kiln {

Status CudaSharedMemoryUnsupported() {
  // FAILED_PRECONDITION, not UNAVAILABLE: gRPC clients retry UNAVAILABLE, and this never
  // changes while the server runs.
  return FailedPrecondition(
      "CUDA shared memory is not supported: no CUDA device (Kiln maps no CUDA IPC handles); "
      "use system shared memory (/v2/systemsharedmemory, SystemSharedMemoryRegister)");
}

Status CudaSharedMemoryStatus(const std::string& name) {
  if (name.empty()) return OkStatus();
  return NotFound("Unable to find cuda shared memory region: '", name,
                  "' (CUDA shared memory is not supported: no CUDA device)");
}

struct SharedMemoryManager::Region {
  std::string name;
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  int fd = -1;

  ~Region() {
    if (fd >= 0) close(fd);
  }
};

namespace {

// shm_open ignores leading slashes ("/k", "k" and "//k" are one object): the form overlap
// checks compare.
std::string CanonicalKey(std::string_view key) {
  while (key.starts_with('/')) key.remove_prefix(1);
  return std::string(key);
}

}  // namespace

StatusOr<std::string> SharedMemoryBlock::Read() const {
  std::string out(size, '\0');
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n =
        pread(fd, out.data() + done, size - done, static_cast<off_t>(key_offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return InvalidArgument(
          "shared memory region '", region, "': read ", done, " of ", size, " bytes at offset ",
          key_offset, " of key '", key, "' (",
          n < 0 ? std::strerror(errno) : "the object is smaller than when it was registered", ")");
    }
    done += static_cast<uint64_t>(n);
  }
  return out;
}

Status SharedMemoryBlock::Write(std::string_view bytes) const {
  if (bytes.size() > size) {
    return Internal("shared memory region '", region, "': ", bytes.size(),
                    " bytes into a block of ", size);
  }
  uint64_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n =
        pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(key_offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return InvalidArgument("shared memory region '", region, "': wrote ", done, " of ",
                             bytes.size(), " bytes to key '", key, "' (",
                             n < 0 ? std::strerror(errno) : "no progress", ")");
    }
    done += static_cast<uint64_t>(n);
  }
  return OkStatus();
}

SharedMemoryManager::~SharedMemoryManager() { UnregisterAll(); }

Status SharedMemoryManager::Register(const std::string& name, const std::string& key,
                                     uint64_t offset, uint64_t byte_size) {
  if (name.empty()) return InvalidArgument("a shared memory region needs a name");
  if (key.empty()) {
    return InvalidArgument("shared memory region '", name,
                           "': `key` is empty; give the name the client passed to shm_open");
  }
  if (byte_size == 0) {
    return InvalidArgument("shared memory region '", name, "': byte_size must be positive");
  }
  {
    absl::MutexLock lock(&mu_);
    if (regions_.contains(name)) {
      return AlreadyExists("shared memory region '", name,
                           "' is already registered; unregister it first");
    }
  }
  // Opened outside the lock: other requests keep using the registry meanwhile.
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    return InvalidArgument("shared memory region '", name, "': cannot open key '", key,
                           "' read-write (shm_open: ", std::strerror(err), ")",
                           err == ENOENT ? "; create it before registering" : "");
  }
  struct stat st {};
  const bool stat_ok = fstat(fd, &st) == 0;
  const uint64_t object_size = stat_ok && st.st_size > 0 ? static_cast<uint64_t>(st.st_size) : 0;
  if (offset > object_size || byte_size > object_size - offset) {
    close(fd);
    return InvalidArgument("shared memory region '", name, "': offset ", offset, " + byte_size ",
                           byte_size, " is past the end of key '", key, "', which has ",
                           object_size, " bytes");
  }
  auto region = std::make_shared<Region>();
  region->name = name;
  region->key = key;
  region->offset = offset;
  region->byte_size = byte_size;
  region->fd = fd;  // closed with the region
  absl::MutexLock lock(&mu_);
  // Another Register of the same name may have won meanwhile; `region` then closes itself.
  if (!regions_.emplace(name, std::move(region)).second) {
    return AlreadyExists("shared memory region '", name,
                         "' is already registered; unregister it first");
  }
  return OkStatus();
}

void SharedMemoryManager::Unregister(const std::string& name) {
  std::shared_ptr<const Region> gone;  // unmapped (if no block holds it) outside the lock
  absl::MutexLock lock(&mu_);
  if (auto it = regions_.find(name); it != regions_.end()) {
    gone = std::move(it->second);
    regions_.erase(it);
  }
}

void SharedMemoryManager::UnregisterAll() {
  std::map<std::string, std::shared_ptr<const Region>> gone;
  absl::MutexLock lock(&mu_);
  gone.swap(regions_);
}

StatusOr<std::vector<SharedMemoryManager::RegionStatus>> SharedMemoryManager::GetStatus(
    const std::string& name) const {
  std::vector<RegionStatus> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [n, r] : regions_) {
    if (name.empty() || n == name) out.push_back({r->name, r->key, r->offset, r->byte_size});
  }
  if (!name.empty() && out.empty()) {
    return NotFound("Unable to find system shared memory region: '", name, "'");
  }
  return out;
}

StatusOr<SharedMemoryBlock> SharedMemoryManager::Block(const std::string& name, uint64_t offset,
                                                       uint64_t byte_size,
                                                       std::string_view what) const {
  std::shared_ptr<const Region> region;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = regions_.find(name); it != regions_.end()) region = it->second;
  }
  if (!region) {
    return InvalidArgument(what, ": shared memory region '", name,
                           "' is not registered (register it with "
                           "/v2/systemsharedmemory/region/",
                           name, "/register or SystemSharedMemoryRegister)");
  }
  if (offset > region->byte_size || byte_size > region->byte_size - offset) {
    return InvalidArgument(what, ": shared_memory_offset ", offset, " + shared_memory_byte_size ",
                           byte_size, " is past the end of shared memory region '", name,
                           "', which has ", region->byte_size, " bytes");
  }
  SharedMemoryBlock b;
  b.fd = region->fd;
  b.size = byte_size;
  b.region = name;
  b.offset = offset;
  b.key = CanonicalKey(region->key);
  b.key_offset = region->offset + offset;
  b.mapping = std::move(region);
  return b;
}

size_t SharedMemoryManager::size() const {
  absl::MutexLock lock(&mu_);
  return regions_.size();
}

Status CheckDisjoint(std::span<const SharedMemoryBlock> blocks, std::span<const std::string> what) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (size_t j = i + 1; j < blocks.size(); ++j) {
      const SharedMemoryBlock &a = blocks[i], &b = blocks[j];
      if (a.key != b.key || a.size == 0 || b.size == 0) continue;
      if (a.key_offset < b.key_offset + b.size && b.key_offset < a.key_offset + a.size) {
        return InvalidArgument(what[i], " (shared memory region '", a.region, "', bytes ", a.offset,
                               "..", a.offset + a.size, ") and ", what[j],
                               " (shared memory region '", b.region, "', bytes ", b.offset, "..",
                               b.offset + b.size, ") overlap in key '", a.key,
                               "'; outputs of one request need separate memory");
      }
    }
  }
  return OkStatus();
}

}  // namespace kiln
