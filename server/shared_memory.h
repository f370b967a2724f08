// Triton's system shared memory extension: the registry of POSIX shared-memory regions that
// clients register by name, and the views of them that inference requests read inputs from
// and write outputs to. One registry per server (ServerCore::shared_memory); the gRPC and HTTP
// front ends are adapters over it (SystemSharedMemoryRegister/Unregister/Status and
// /v2/systemsharedmemory/...).
//
// A region is `byte_size` bytes at `offset` of the shared-memory object `key` (the name a
// client passed to shm_open, e.g. "/input_simple"). Register opens it read-write and keeps the
// descriptor until the region is unregistered AND no request still holds a SharedMemoryBlock
// of it, so unregistering while a request is in flight is safe: that request finishes with the
// old descriptor. Blocks are read and written with pread/pwrite, not through a mapping: a
// client that shrinks its object after registering gets an error on its next request instead
// of killing the server with SIGBUS.
//
// Inputs read from shared memory count against a per-request budget (max_input_bytes: the
// server's largest inline request), so a client cannot make the server copy tens of gigabytes
// by registering a large sparse object.
//
// Errors name the region: InvalidArgument for bad arguments (empty name or key, zero size, a
// key that does not exist or cannot be opened read-write, offset + byte_size past the end of
// the object, a block outside its region), AlreadyExists for a name registered twice, NotFound
// for the status of a name not registered.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/base/status.h"

namespace kiln {

// Triton's CUDA shared memory extension, which Kiln does not implement (it maps no CUDA IPC
// handles): registering answers CudaSharedMemoryUnsupported (FailedPrecondition); as none can
// be registered, unregistering is a no-op and the status of all regions an empty list.
Status CudaSharedMemoryUnsupported();
// OkStatus for "" (all: none), else NotFound naming the region.
Status CudaSharedMemoryStatus(const std::string& name);

// `size` bytes of a registered region, valid while this object (or a copy) lives.
struct SharedMemoryBlock {
  std::shared_ptr<const void> mapping;  // keeps the region's descriptor open
  int fd = -1;
  uint64_t size = 0;
  std::string region;       // the region's name
  uint64_t offset = 0;      // within the region
  std::string key;          // the shared-memory object and the block's position in it, for
  uint64_t key_offset = 0;  // overlap checks across regions that map the same object

  // The block's bytes. InvalidArgument naming the region if the object shrank since it was
  // registered (a short read).
  StatusOr<std::string> Read() const;
  // Writes `bytes` (at most `size`) at the block's start.
  Status Write(std::string_view bytes) const;
};

// InvalidArgument naming both blocks if any two of `blocks` share a byte of the same
// shared-memory object (outputs of one request must not overwrite each other). `what[i]`
// names blocks[i] in the message ("output 'OUTPUT0'").
Status CheckDisjoint(std::span<const SharedMemoryBlock> blocks, std::span<const std::string> what);

class SharedMemoryManager {
 public:
  struct RegionStatus {
    std::string name;
    std::string key;
    uint64_t offset = 0;
    uint64_t byte_size = 0;
  };

  // `max_input_bytes`: the most bytes one request may read from shared memory, all its
  // inputs together.
  explicit SharedMemoryManager(uint64_t max_input_bytes = 64ull << 20)
      : max_input_bytes_(max_input_bytes) {}
  // Unregisters everything (mappings still held by blocks stay until those go).
  ~SharedMemoryManager();
  SharedMemoryManager(const SharedMemoryManager&) = delete;
  SharedMemoryManager& operator=(const SharedMemoryManager&) = delete;

  // Opens `key` read-write, checks offset + byte_size fits in it, maps that range.
  Status Register(const std::string& name, const std::string& key, uint64_t offset,
                  uint64_t byte_size);
  // Forgets `name`; a name not registered is not an error (as in Triton).
  void Unregister(const std::string& name);
  void UnregisterAll();

  // The region `name`, or every region (sorted by name) when `name` is empty.
  StatusOr<std::vector<RegionStatus>> GetStatus(const std::string& name) const;

  // `byte_size` bytes at `offset` of region `name`, for the tensor `what` ("input 'INPUT0'").
  // InvalidArgument if the region is not registered or the range is outside it.
  StatusOr<SharedMemoryBlock> Block(const std::string& name, uint64_t offset, uint64_t byte_size,
                                    std::string_view what) const;

  size_t size() const;
  uint64_t max_input_bytes() const { return max_input_bytes_; }

 private:
  struct Region;

  const uint64_t max_input_bytes_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Region>> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
