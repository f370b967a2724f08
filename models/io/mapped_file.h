// Read-only views of model files: a memory-mapped file, or an in-memory buffer with a name.
//
// Loaders (GGUF, safetensors) parse a MappedFile and hand out pointers into it, so tensor
// data is never copied. Whoever holds a pointer into the bytes must also hold the
// shared_ptr<const MappedFile> that owns them (loaders keep one for you).
//
// Thread-safety: immutable after construction; safe to share across threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "engine/base/status.h"

namespace kiln::models {

class MappedFile {
 public:
  // Maps `path` read-only and shared (PROT_READ, MAP_SHARED). An empty file is allowed (it
  // has size 0 and a null data pointer). Errors: NotFound if the file does not exist,
  // InvalidArgument for a directory, Internal for other OS errors; messages name the path.
  static StatusOr<std::shared_ptr<const MappedFile>> Open(const std::string& path);

  // Wraps a copy of `bytes` (tests, fuzzers, files received over the network). `name` is used
  // in error messages in place of a path.
  static std::shared_ptr<const MappedFile> FromBytes(std::string bytes, std::string name);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::string_view bytes() const { return {reinterpret_cast<const char*>(data_), size_}; }
  // The path given to Open (or the name given to FromBytes).
  const std::string& name() const { return name_; }

 private:
  MappedFile() = default;

  std::string name_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;  // non-null when data_ comes from mmap
  std::string owned_;        // backing store for FromBytes
};

}  // namespace kiln::models
