// GGUF v2/v3 reader: metadata, tensor infos and zero-copy tensor data.
//
//   KILN_ASSIGN_OR_RETURN(auto gguf, GgufFile::Open("model.gguf"));
//   KILN_ASSIGN_OR_RETURN(uint32_t n_layer, gguf->GetU32("llama.block_count"));
//   const GgufTensor* t = gguf->FindTensor("token_embd.weight");
//
// The file is memory-mapped read-only; tensor `data` pointers and every string_view handed
// out (keys, string values, tensor names) point into the mapping and stay valid as long as
// the GgufFile lives. Everything is validated at Open/Parse time (magic, version, counts and
// lengths against the file size, value types, nesting depth, dims overflow, tensor types and
// block sizes, alignment, data ranges inside the file and not overlapping, duplicate keys and
// tensor names); errors name the file, what was being read and the byte offset, e.g.
//   model.gguf: truncated at offset 1234 while reading tensor info 17 of 272
//   ("blk.3.ffn_up.weight")
//
// Thread-safety: immutable after construction; all methods are const and safe to call
// concurrently.
#pragma once

#include <bit>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/base/status.h"
#include "models/gguf/ggml_type.h"
#include "models/io/mapped_file.h"

namespace kiln::models {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader hands out little-endian data zero-copy");

enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "UINT32", "ARRAY", ... (the gguf Python package's names).
std::string_view GgufValueTypeName(GgufValueType t);

// One metadata value. Scalars are decoded; arrays of numbers stay in the file (raw
// little-endian elements, decoded on access); arrays of strings and arrays of arrays are
// decoded into `items`.
class GgufValue {
 public:
  GgufValueType type() const { return type_; }
  bool is_array() const { return type_ == GgufValueType::kArray; }
  bool is_integer() const;  // any of the eight integer types (not bool)
  bool is_float() const {
    return type_ == GgufValueType::kFloat32 || type_ == GgufValueType::kFloat64;
  }

  // Scalar views (REQUIRES: the matching kind; use the GgufFile getters for checked access).
  uint64_t as_u64() const { return u64_; }  // integers whose value is >= 0
  int64_t as_i64() const { return i64_; }   // any integer, as signed
  double as_f64() const { return f64_; }    // floats
  bool as_bool() const { return u64_ != 0; }
  std::string_view as_string() const { return str_; }

  // Arrays.
  GgufValueType element_type() const { return elem_type_; }
  uint64_t array_size() const { return count_; }
  // REQUIRES: is_array() and element_type() is STRING or ARRAY; size() == array_size().
  const std::vector<GgufValue>& items() const { return items_; }
  // REQUIRES: is_array() and element_type() is a number or BOOL: element i as a scalar value.
  GgufValue element(uint64_t i) const;

  // A short human-readable rendering ("UINT32 30", "ARRAY[STRING; 49152]").
  std::string DebugString() const;

 private:
  friend class GgufParser;
  GgufValueType type_ = GgufValueType::kUint8;
  uint64_t u64_ = 0;
  int64_t i64_ = 0;
  double f64_ = 0;
  bool negative_ = false;
  std::string_view str_;
  GgufValueType elem_type_ = GgufValueType::kUint8;
  uint64_t count_ = 0;
  const uint8_t* raw_ = nullptr;  // numeric array elements, in the file
  std::vector<GgufValue> items_;
};

struct GgufTensor {
  std::string_view name;
  GgmlType type;
  // ggml order: dims[0] is the innermost (contiguous) dimension. 1 to 4 entries.
  std::vector<int64_t> dims;
  uint64_t offset = 0;         // relative to the start of the data section
  uint64_t file_offset = 0;    // absolute offset in the file
  const void* data = nullptr;  // into the mapping; `n_bytes` bytes
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
};

class GgufFile {
 public:
  // Maps and parses `path`.
  static StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an already-mapped file (or in-memory bytes, see MappedFile::FromBytes).
  static StatusOr<std::unique_ptr<GgufFile>> Parse(std::shared_ptr<const MappedFile> file);

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  const std::string& path() const { return file_->name(); }
  const std::shared_ptr<const MappedFile>& file() const { return file_; }

  // ---- Metadata ----
  // Keys in file order.
  const std::vector<std::string_view>& keys() const { return keys_; }
  // nullptr when absent.
  const GgufValue* Find(std::string_view key) const;
  bool Has(std::string_view key) const { return Find(key) != nullptr; }

  // Typed getters. NotFound when the key is absent; InvalidArgument when its type does not
  // fit: integers of any width are accepted when the value fits the requested type, FLOAT32
  // and FLOAT64 are accepted for floats. Messages name the file, key, stored type and value.
  StatusOr<uint32_t> GetU32(std::string_view key) const;
  StatusOr<uint64_t> GetU64(std::string_view key) const;
  StatusOr<int32_t> GetI32(std::string_view key) const;
  StatusOr<int64_t> GetI64(std::string_view key) const;
  StatusOr<float> GetF32(std::string_view key) const;
  StatusOr<bool> GetBool(std::string_view key) const;
  StatusOr<std::string_view> GetString(std::string_view key) const;
  StatusOr<std::vector<std::string_view>> GetStringArray(std::string_view key) const;
  StatusOr<std::vector<float>> GetF32Array(std::string_view key) const;
  StatusOr<std::vector<int32_t>> GetI32Array(std::string_view key) const;
  StatusOr<std::vector<int64_t>> GetI64Array(std::string_view key) const;

  // Optional variants: `fallback` when absent, an error only when present with a wrong type.
  StatusOr<uint32_t> GetU32Or(std::string_view key, uint32_t fallback) const;
  StatusOr<float> GetF32Or(std::string_view key, float fallback) const;
  StatusOr<bool> GetBoolOr(std::string_view key, bool fallback) const;
  StatusOr<std::string_view> GetStringOr(std::string_view key, std::string_view fallback) const;

  // ---- Tensors ----
  // In file order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const GgufTensor* FindTensor(std::string_view name) const;
  // NotFound naming the file and tensor when absent.
  StatusOr<const GgufTensor*> GetTensor(std::string_view name) const;

 private:
  friend class GgufParser;
  GgufFile() = default;

  std::shared_ptr<const MappedFile> file_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::string_view> keys_;
  std::vector<GgufValue> values_;  // parallel to keys_
  std::unordered_map<std::string_view, size_t> key_index_;
  std::vector<GgufTensor> tensors_;
  std::unordered_map<std::string_view, size_t> tensor_index_;
};

}  // namespace kiln::models
