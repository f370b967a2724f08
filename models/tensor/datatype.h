// KServe v2 tensor datatypes (the wire names: BOOL, UINT8, ..., FP16, FP32, FP64, BYTES,
// BF16) and the raw byte layout Kiln uses for tensors at its API boundary.
//
// Raw layout: little-endian, row-major, no padding. BOOL is one byte per element (0 or 1).
// BYTES is a sequence of elements, each a 4-byte little-endian length then that many bytes
// (Triton's serialization of string tensors).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln {

enum class DataType : uint8_t {
  kInvalid = 0,
  kBool,
  kUint8,
  kUint16,
  kUint32,
  kUint64,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kFp16,
  kFp32,
  kFp64,
  kBytes,
  kBf16,
};

// "INT32" etc.; "INVALID" for kInvalid.
std::string_view DataTypeName(DataType t);
// Parses a wire name (exact, upper case). nullopt if unknown.
std::optional<DataType> ParseDataType(std::string_view name);
// Bytes per element; 0 for kBytes (variable) and kInvalid.
int64_t DataTypeSize(DataType t);
// Comma-separated list of every valid wire name, for error messages.
std::string_view AllDataTypeNames();

// Number of elements of `shape` (1 for a scalar); nullopt if a dim is negative or the product
// overflows int64.
std::optional<int64_t> ElementCount(std::span<const int64_t> shape);

// "[2, 16]"
std::string ShapeToString(std::span<const int64_t> shape);

// Validates a BYTES tensor's raw contents and returns the number of elements it holds.
// InvalidArgument if an element's length runs past the end.
StatusOr<int64_t> CountBytesElements(std::string_view raw);
// The elements of BYTES contents, as views into `raw`. REQUIRES: CountBytesElements(raw)
// accepted it (a truncated tail is dropped).
std::vector<std::string_view> BytesElements(std::string_view raw);
// Appends one element: its 4-byte little-endian length, then its bytes.
void AppendBytesElement(std::string& raw, std::string_view element);

}  // namespace kiln
