#include "models/tensor/datatype.h"

#include <array>
#include <cstring>
#include <limits>

#include "absl/strings/str_join.h"

namespace kiln {
namespace {

struct TypeInfo {
  DataType type;
  std::string_view name;
  int64_t size;
};

constexpr std::array<TypeInfo, 14> kTypes = {{
    {DataType::kBool, "BOOL", 1},
    {DataType::kUint8, "UINT8", 1},
    {DataType::kUint16, "UINT16", 2},
    {DataType::kUint32, "UINT32", 4},
    {DataType::kUint64, "UINT64", 8},
    {DataType::kInt8, "INT8", 1},
    {DataType::kInt16, "INT16", 2},
    {DataType::kInt32, "INT32", 4},
    {DataType::kInt64, "INT64", 8},
    {DataType::kFp16, "FP16", 2},
    {DataType::kFp32, "FP32", 4},
    {DataType::kFp64, "FP64", 8},
    {DataType::kBytes, "BYTES", 0},
    {DataType::kBf16, "BF16", 2},
}};

}  // namespace

std::string_view DataTypeName(DataType t) {
  for (const auto& info : kTypes) {
    if (info.type == t) return info.name;
  }
  return "INVALID";
}

std::optional<DataType> ParseDataType(std::string_view name) {
  for (const auto& info : kTypes) {
    if (info.name == name) return info.type;
  }
  return std::nullopt;
}

int64_t DataTypeSize(DataType t) {
  for (const auto& info : kTypes) {
    if (info.type == t) return info.size;
  }
  return 0;
}

std::string_view AllDataTypeNames() {
  static const std::string all = [] {
    std::vector<std::string> names;
    for (const auto& info : kTypes) names.emplace_back(info.name);
    return absl::StrJoin(names, ", ");
  }();
  return all;
}

std::optional<int64_t> ElementCount(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return std::nullopt;
    n *= d;
  }
  return n;
}

std::string ShapeToString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::vector<std::string_view> BytesElements(std::string_view raw) {
  std::vector<std::string_view> out;
  size_t at = 0;
  while (at + 4 <= raw.size()) {
    uint32_t n;
    std::memcpy(&n, raw.data() + at, 4);
    if (raw.size() - at - 4 < n) break;
    out.push_back(raw.substr(at + 4, n));
    at += 4 + size_t{n};
  }
  return out;
}

void AppendBytesElement(std::string& raw, std::string_view element) {
  const uint32_t n = static_cast<uint32_t>(element.size());
  raw.append(reinterpret_cast<const char*>(&n), 4);
  raw.append(element);
}

StatusOr<int64_t> CountBytesElements(std::string_view raw) {
  int64_t count = 0;
  size_t pos = 0;
  while (pos < raw.size()) {
    if (raw.size() - pos < 4) {
      return InvalidArgument("BYTES contents end inside the 4-byte length of element ", count,
                             " (at byte ", pos, ")");
    }
    uint32_t len;
    std::memcpy(&len, raw.data() + pos, 4);  // little-endian hosts only (x86-64, aarch64)
    pos += 4;
    if (raw.size() - pos < len) {
      return InvalidArgument("BYTES element ", count, " declares ", len, " bytes but only ",
                             raw.size() - pos, " remain");
    }
    pos += len;
    ++count;
  }
  return count;
}

}  // namespace kiln
