#include "models/safetensors/safetensors.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/dtype.h"
#include "models/io/durable_file.h"
#include "models/io/errors.h"

namespace kiln::models {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderSize = 100'000'000;  // the reference implementation's limit

struct DtypeInfo {
  SafetensorsDtype dtype;
  std::string_view name;
  size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::kF64, "F64", 8},         {SafetensorsDtype::kF32, "F32", 4},
    {SafetensorsDtype::kF16, "F16", 2},         {SafetensorsDtype::kBF16, "BF16", 2},
    {SafetensorsDtype::kI64, "I64", 8},         {SafetensorsDtype::kI32, "I32", 4},
    {SafetensorsDtype::kI16, "I16", 2},         {SafetensorsDtype::kI8, "I8", 1},
    {SafetensorsDtype::kU8, "U8", 1},           {SafetensorsDtype::kBool, "BOOL", 1},
    {SafetensorsDtype::kF8_E4M3, "F8_E4M3", 1}, {SafetensorsDtype::kF8_E5M2, "F8_E5M2", 1},
};

constexpr std::string_view kDtypeList =
    "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2";

bool IsDir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool IsFile(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
std::string DirName(const std::string& p) {
  size_t slash = p.find_last_of('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

}  // namespace

std::string_view SafetensorsDtypeName(SafetensorsDtype d) {
  for (const auto& e : kDtypes) {
    if (e.dtype == d) return e.name;
  }
  return "?";
}

size_t SafetensorsDtypeSize(SafetensorsDtype d) {
  for (const auto& e : kDtypes) {
    if (e.dtype == d) return e.size;
  }
  return 0;
}

std::optional<SafetensorsDtype> ParseSafetensorsDtype(std::string_view name) {
  for (const auto& e : kDtypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  return Parse(std::move(file));
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Parse(
    std::shared_ptr<const MappedFile> file) {
  KILN_CHECK(file != nullptr, "SafetensorsFile::Parse needs a file");
  const std::string& name = file->name();
  if (file->size() < 8) {
    return InvalidArgument(name, ": truncated: ", file->size(),
                           " bytes, a safetensors file starts with an 8-byte header size");
  }
  uint64_t header_size;
  std::memcpy(&header_size, file->data(), 8);
  if (header_size > kMaxHeaderSize) {
    return InvalidArgument(name, ": header size ", header_size, " exceeds the limit of ",
                           kMaxHeaderSize, " bytes (not a safetensors file?)");
  }
  if (header_size > file->size() - 8) {
    return InvalidArgument(name, ": header size ", header_size, " runs past the end of the ",
                           file->size(), "-byte file (truncated?)");
  }
  const char* hbegin = reinterpret_cast<const char*>(file->data()) + 8;
  if (header_size == 0 || hbegin[0] != '{') {
    return InvalidArgument(name, ": header at offset 8 is not a JSON object");
  }
  json header;
  try {
    header = json::parse(hbegin, hbegin + header_size);
  } catch (const json::parse_error& e) {
    return InvalidArgument(name, ": header is not valid JSON (at header byte ", e.byte,
                           "): ", e.what());
  } catch (const json::exception& e) {
    return InvalidArgument(name, ": not valid JSON: ", e.what());
  }
  if (!header.is_object()) return InvalidArgument(name, ": header is not a JSON object");

  std::unique_ptr<SafetensorsFile> out(new SafetensorsFile());
  out->file_ = std::move(file);
  const uint64_t data_start = 8 + header_size;
  const uint64_t data_size = out->file_->size() - data_start;
  struct Range {
    uint64_t begin, end;
    size_t tensor;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object())
        return InvalidArgument(name, ": __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return InvalidArgument(name, ": __metadata__[\"", m.key(), "\"] must be a string");
        }
        out->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto where = [&] { return Cat(name, ": tensor \"", key, "\""); };
    if (!v.is_object()) return InvalidArgument(where(), ": entry must be an object");
    for (auto f = v.begin(); f != v.end(); ++f) {
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets") {
        return InvalidArgument(where(), ": unknown field \"", f.key(),
                               "\" (allowed: dtype, shape, data_offsets)");
      }
    }
    SafetensorsTensor t;
    t.name = key;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string())
      return InvalidArgument(where(), ": missing string \"dtype\"");
    auto dtype = ParseSafetensorsDtype(dt->get<std::string>());
    if (!dtype) {
      return InvalidArgument(where(), ": unknown dtype \"", dt->get<std::string>(),
                             "\" (supported: ", kDtypeList, ")");
    }
    t.dtype = *dtype;
    auto shape = v.find("shape");
    if (shape == v.end() || !shape->is_array())
      return InvalidArgument(where(), ": missing array \"shape\"");
    uint64_t n = 1;
    for (const json& d : *shape) {
      if (!d.is_number_unsigned()) {
        return InvalidArgument(where(), ": shape must be a list of non-negative integers");
      }
      uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          (dim != 0 && n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim)) {
        return InvalidArgument(where(), ": shape overflows 63 bits");
      }
      n *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    t.n_elements = n;
    const uint64_t esize = SafetensorsDtypeSize(t.dtype);
    if (n > std::numeric_limits<uint64_t>::max() / esize) {
      return InvalidArgument(where(), ": byte size overflows");
    }
    auto offs = v.find("data_offsets");
    if (offs == v.end() || !offs->is_array() || offs->size() != 2 ||
        !(*offs)[0].is_number_unsigned() || !(*offs)[1].is_number_unsigned()) {
      return InvalidArgument(where(),
                             ": \"data_offsets\" must be [begin, end] with non-negative integers");
    }
    uint64_t begin = (*offs)[0].get<uint64_t>();
    uint64_t end = (*offs)[1].get<uint64_t>();
    if (begin > end) {
      return InvalidArgument(where(), ": data_offsets [", begin, ", ", end, "] has begin > end");
    }
    if (end > data_size) {
      return InvalidArgument(where(), ": data_offsets [", begin, ", ", end,
                             "] run past the data section of ", data_size, " bytes (truncated?)");
    }
    t.n_bytes = end - begin;
    if (t.n_bytes != n * esize) {
      return InvalidArgument(where(), ": shape ", shape->dump(), " of ",
                             SafetensorsDtypeName(t.dtype), " needs ", n * esize,
                             " bytes but data_offsets [", begin, ", ", end, "] hold ", t.n_bytes);
    }
    t.data = out->file_->data() + data_start + begin;
    t.file = &out->file_->name();
    ranges.push_back({begin, end, out->tensors_.size()});
    out->tensors_.push_back(std::move(t));
  }
  // Sort by offset, then require the ranges to tile [0, data_size) exactly.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (const Range& r : ranges) {
    const std::string& tname = out->tensors_[r.tensor].name;
    if (r.begin < expected) {
      return InvalidArgument(name, ": tensor \"", tname, "\" data_offsets [", r.begin, ", ", r.end,
                             "] overlap the previous tensor, which ends at ", expected);
    }
    if (r.begin > expected) {
      return InvalidArgument(name, ": tensor \"", tname, "\" starts at ", r.begin,
                             " leaving a hole after offset ", expected,
                             " (tensors must cover the data section)");
    }
    expected = r.end;
  }
  if (expected != data_size) {
    return InvalidArgument(name, ": tensors cover ", expected, " bytes but the data section has ",
                           data_size, " (trailing bytes or truncated file)");
  }
  std::vector<SafetensorsTensor> sorted;
  sorted.reserve(ranges.size());
  for (const Range& r : ranges) sorted.push_back(std::move(out->tensors_[r.tensor]));
  out->tensors_ = std::move(sorted);
  for (size_t i = 0; i < out->tensors_.size(); ++i) out->index_[out->tensors_[i].name] = i;
  return out;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

StatusOr<std::unique_ptr<SafetensorsModel>> SafetensorsModel::Open(const std::string& path) {
  std::string index_path, single_path;
  if (IsDir(path)) {
    if (IsFile(path + "/model.safetensors.index.json")) {
      index_path = path + "/model.safetensors.index.json";
    } else if (IsFile(path + "/model.safetensors")) {
      single_path = path + "/model.safetensors";
    } else {
      return NotFound(path, ": no model.safetensors or model.safetensors.index.json");
    }
  } else if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    index_path = path;
  } else {
    single_path = path;
  }

  std::unique_ptr<SafetensorsModel> model(new SafetensorsModel());
  auto add_shard = [&](std::unique_ptr<SafetensorsFile> shard) -> Status {
    for (const SafetensorsTensor& t : shard->tensors()) {
      auto [it, inserted] = model->index_.emplace(t.name, &t);
      if (!inserted) {
        return InvalidArgument(shard->path(), ": tensor \"", t.name, "\" is also in ",
                               *it->second->file);
      }
    }
    model->shards_.push_back(std::move(shard));
    return OkStatus();
  };
  if (!single_path.empty()) {
    KILN_ASSIGN_OR_RETURN(auto shard, SafetensorsFile::Open(single_path));
    KILN_RETURN_IF_ERROR(add_shard(std::move(shard)));
    return model;
  }

  KILN_ASSIGN_OR_RETURN(auto index_file, MappedFile::Open(index_path));
  json index;
  try {
    index = json::parse(index_file->bytes());
  } catch (const json::parse_error& e) {
    return InvalidArgument(index_path, ": not valid JSON (byte ", e.byte, "): ", e.what());
  } catch (const json::exception& e) {
    return InvalidArgument(index_path, ": not valid JSON: ", e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return InvalidArgument(index_path, ": missing object \"weight_map\"");
  }
  const std::string dir = DirName(index_path);
  std::map<std::string, std::vector<std::string>> by_shard;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return InvalidArgument(index_path, ": weight_map[\"", it.key(), "\"] must be a file name");
    }
    std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return InvalidArgument(index_path, ": weight_map[\"", it.key(), "\"] = \"", shard,
                             "\" must be a plain file name in ", dir);
    }
    by_shard[shard].push_back(it.key());
  }
  if (by_shard.empty()) return InvalidArgument(index_path, ": weight_map is empty");
  for (const auto& [shard_name, names] : by_shard) {
    auto shard = SafetensorsFile::Open(dir + "/" + shard_name);
    if (!shard.ok()) return Annotate(shard.status(), Cat(index_path, ": shard"));
    for (const std::string& n : names) {
      if ((*shard)->Find(n) == nullptr) {
        return InvalidArgument(index_path, ": tensor \"", n, "\" is mapped to ", shard_name,
                               " but that shard does not contain it");
      }
    }
    KILN_RETURN_IF_ERROR(add_shard(std::move(*shard)));
  }
  return model;
}

const SafetensorsTensor* SafetensorsModel::Find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : it->second;
}

StatusOr<const SafetensorsTensor*> SafetensorsModel::Get(std::string_view name) const {
  const SafetensorsTensor* t = Find(name);
  if (t == nullptr) {
    return NotFound("tensor \"", name, "\" is not in the checkpoint (",
                    shards_.empty() ? std::string("no shards") : shards_[0]->path(),
                    shards_.size() > 1 ? Cat(" and ", shards_.size() - 1, " more shards") : "",
                    ")");
  }
  return t;
}

std::vector<const SafetensorsTensor*> SafetensorsModel::tensors() const {
  std::vector<const SafetensorsTensor*> out;
  for (const auto& s : shards_) {
    for (const auto& t : s->tensors()) out.push_back(&t);
  }
  return out;
}

StatusOr<std::vector<float>> SafetensorsToFloats(const SafetensorsTensor& t) {
  std::vector<float> out(t.n_elements);
  const auto* bytes = static_cast<const uint8_t*>(t.data);
  switch (t.dtype) {
    case SafetensorsDtype::kF32:
      if (t.n_bytes != 0) std::memcpy(out.data(), bytes, t.n_bytes);
      break;
    case SafetensorsDtype::kF64:
      for (uint64_t i = 0; i < t.n_elements; ++i) {
        double d;
        std::memcpy(&d, bytes + 8 * i, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case SafetensorsDtype::kF16:
    case SafetensorsDtype::kBF16:
      for (uint64_t i = 0; i < t.n_elements; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        out[i] = t.dtype == SafetensorsDtype::kF16 ? F16ToFloat(h) : BF16ToFloat(h);
      }
      break;
    default:
      return InvalidArgument(t.file != nullptr ? *t.file : std::string("safetensors"),
                             ": tensor \"", t.name, "\" is ", SafetensorsDtypeName(t.dtype),
                             "; expected a float tensor (F32, F16, BF16 or F64)");
  }
  return out;
}

Status SafetensorsWriter::Add(std::string name, SafetensorsDtype dtype, std::vector<int64_t> shape,
                              const void* data, size_t n_bytes) {
  if (name.empty() || name == "__metadata__") {
    return InvalidArgument("safetensors tensor name \"", name, "\" is not allowed");
  }
  for (const Entry& e : tensors_) {
    if (e.name == name) return InvalidArgument("safetensors tensor \"", name, "\" added twice");
  }
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("safetensors tensor \"", name, "\": negative dimension");
    n *= static_cast<uint64_t>(d);
  }
  if (n * SafetensorsDtypeSize(dtype) != n_bytes) {
    return InvalidArgument("safetensors tensor \"", name, "\": ", n, " elements of ",
                           SafetensorsDtypeName(dtype), " need ", n * SafetensorsDtypeSize(dtype),
                           " bytes, got ", n_bytes);
  }
  Entry e{std::move(name), dtype, std::move(shape), std::string(n_bytes, '\0')};
  if (n_bytes != 0) std::memcpy(e.bytes.data(), data, n_bytes);
  tensors_.push_back(std::move(e));
  return OkStatus();
}

Status SafetensorsWriter::AddFloats(std::string name, std::vector<int64_t> shape, const float* data,
                                    size_t n, SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return Add(std::move(name), dtype, std::move(shape), data, n * sizeof(float));
    case SafetensorsDtype::kF16:
    case SafetensorsDtype::kBF16: {
      std::vector<uint16_t> h(n);
      for (size_t i = 0; i < n; ++i) {
        h[i] = dtype == SafetensorsDtype::kF16 ? FloatToF16(data[i]) : FloatToBF16(data[i]);
      }
      return Add(std::move(name), dtype, std::move(shape), h.data(), n * 2);
    }
    default:
      return InvalidArgument("safetensors tensor \"", name, "\": cannot store floats as ",
                             SafetensorsDtypeName(dtype), " (allowed: F32, F16, BF16)");
  }
}

std::string SafetensorsWriter::Header(std::vector<const Entry*>& order) const {
  order.clear();
  for (const Entry& e : tensors_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    const size_t sa = SafetensorsDtypeSize(a->dtype), sb = SafetensorsDtypeSize(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  json header = json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const Entry* e : order) {
    header[e->name] = {{"dtype", SafetensorsDtypeName(e->dtype)},
                       {"shape", e->shape},
                       {"data_offsets", {offset, offset + e->bytes.size()}}};
    offset += e->bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  std::memcpy(out.data(), &n, 8);  // little-endian hosts only, like the reader
  return out + text;
}

std::string SafetensorsWriter::Serialize() const {
  std::vector<const Entry*> order;
  std::string out = Header(order);
  for (const Entry* e : order) out += e->bytes;
  return out;
}

Status SafetensorsWriter::WriteFile(const std::string& path) const {
  std::vector<const Entry*> order;
  const std::string header = Header(order);
  std::vector<std::string_view> pieces = {header};
  for (const Entry* e : order) pieces.push_back(e->bytes);
  return WriteFileDurably(path, pieces);
}

}  // namespace kiln::models
