// safetensors reader (single files and sharded checkpoints, model.safetensors.index.json) and
// writer (SafetensorsWriter, below).
//
//   KILN_ASSIGN_OR_RETURN(auto st, SafetensorsModel::Open("/models/llama"));  // folder or file
//   const SafetensorsTensor* w = st->Find("model.embed_tokens.weight");
//
// Files are memory-mapped read-only; tensor `data` points into the mapping (zero-copy) and
// stays valid while the SafetensorsFile / SafetensorsModel lives. The header is validated the
// way the reference implementation does: 8-byte little-endian header size (at most 100 MB and
// inside the file), a JSON object whose entries have a known dtype, a shape of non-negative
// integers and `data_offsets` [begin, end] that match the shape's byte size, lie inside the
// data section, do not overlap and cover it without holes; an optional `__metadata__` object of
// strings. Errors name the file, the tensor and what is allowed.
//
// Thread-safety: immutable after construction; safe to use from several threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/base/status.h"
#include "models/io/mapped_file.h"

namespace kiln::models {

enum class SafetensorsDtype {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8_E4M3,
  kF8_E5M2,
};

// "F32", "BF16", ... as spelled in safetensors headers.
std::string_view SafetensorsDtypeName(SafetensorsDtype d);
size_t SafetensorsDtypeSize(SafetensorsDtype d);
std::optional<SafetensorsDtype> ParseSafetensorsDtype(std::string_view name);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;  // row-major (PyTorch order), outermost first
  const void* data = nullptr;  // into the mapping
  uint64_t n_bytes = 0;
  uint64_t n_elements = 0;
  const std::string* file = nullptr;  // path of the file holding it
};

class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  static StatusOr<std::unique_ptr<SafetensorsFile>> Parse(std::shared_ptr<const MappedFile> file);

  const std::string& path() const { return file_->name(); }
  // Sorted by data offset (file order).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(std::string_view name) const;
  // The header's `__metadata__` (empty if none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::shared_ptr<const MappedFile> file_;
  std::vector<SafetensorsTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint: one file, or the shards named by an index.
class SafetensorsModel {
 public:
  // `path` is a folder (uses model.safetensors.index.json if present, else
  // model.safetensors), an index JSON file, or a single .safetensors file. With an index,
  // every tensor of the weight map must be in the shard it names, and shard names must be plain
  // file names in the same folder.
  static StatusOr<std::unique_ptr<SafetensorsModel>> Open(const std::string& path);

  const SafetensorsTensor* Find(std::string_view name) const;
  StatusOr<const SafetensorsTensor*> Get(std::string_view name) const;
  // Every tensor, shard by shard.
  std::vector<const SafetensorsTensor*> tensors() const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }
  size_t size() const { return index_.size(); }

 private:
  SafetensorsModel() = default;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::unordered_map<std::string, const SafetensorsTensor*> index_;
};

// The elements of an F32, F64, F16 or BF16 tensor as f32 (PEFT saves adapters in the base
// model's dtype). InvalidArgument, naming the file and tensor, for any other dtype.
StatusOr<std::vector<float>> SafetensorsToFloats(const SafetensorsTensor& t);

// Builds a safetensors file the way the reference writer (safetensors' serialize) does:
// tensors sorted by element size (largest first), then by name, so each tensor starts at a
// multiple of its element size; the header JSON padded with spaces so the data section starts
// at a multiple of 8; `__metadata__` only when metadata was set. SafetensorsFile reads the
// result back unchanged.
//
//   SafetensorsWriter w;
//   KILN_RETURN_IF_ERROR(w.AddFloats("lora_A", {8, 512}, a.data(), a.size()));
//   KILN_RETURN_IF_ERROR(w.WriteFile(dir + "/adapter_model.safetensors"));
//
// The writer copies the data it is given. Thread-safety: not thread-safe; one writer per thread.
class SafetensorsWriter {
 public:
  // Adds a tensor from `n_bytes` of little-endian data. InvalidArgument for an empty, reserved
  // ("__metadata__") or duplicate name, a negative dimension, or a byte count that does not
  // match shape x dtype.
  Status Add(std::string name, SafetensorsDtype dtype, std::vector<int64_t> shape, const void* data,
             size_t n_bytes);
  // Adds `n` f32 values stored as `dtype`: kF32, or kF16 / kBF16 (rounded to nearest even).
  // InvalidArgument as Add, or for another dtype.
  Status AddFloats(std::string name, std::vector<int64_t> shape, const float* data, size_t n,
                   SafetensorsDtype dtype = SafetensorsDtype::kF32);
  // Sets a `__metadata__` entry (e.g. "format" = "pt", which PEFT and transformers write).
  void SetMetadata(std::string key, std::string value) {
    metadata_[std::move(key)] = std::move(value);
  }

  size_t size() const { return tensors_.size(); }
  // The whole file in memory.
  std::string Serialize() const;
  // Creates or truncates `path`, writes the file and fsyncs it (not its directory). Errors
  // name the path.
  Status WriteFile(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    SafetensorsDtype dtype;
    std::vector<int64_t> shape;
    std::string bytes;
  };
  // The padded header, and the entries in file order.
  std::string Header(std::vector<const Entry*>& order) const;

  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kiln::models
