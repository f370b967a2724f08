#include "models/gguf/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "models/io/errors.h"

namespace kiln::models {
namespace {

constexpr uint32_t kMaxDims = 4;     // GGML_MAX_DIMS
constexpr int kMaxArrayNesting = 8;  // arrays of arrays; real files use at most 2
constexpr uint32_t kDefaultAlignment = 32;

size_t ScalarSize(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

bool IsKnownValueType(uint32_t t) { return t <= 12; }

// Decodes a little-endian scalar of type `t` at `p` into `v`.
void DecodeScalar(GgufValueType t, const uint8_t* p, GgufValue* v, uint64_t* u, int64_t* i,
                  double* f, bool* neg) {
  (void)v;
  auto load = [p](auto x) {
    std::memcpy(&x, p, sizeof(x));
    return x;
  };
  *u = 0;
  *i = 0;
  *f = 0;
  *neg = false;
  switch (t) {
    case GgufValueType::kUint8:
      *u = load(uint8_t{});
      *i = static_cast<int64_t>(*u);
      break;
    case GgufValueType::kUint16:
      *u = load(uint16_t{});
      *i = static_cast<int64_t>(*u);
      break;
    case GgufValueType::kUint32:
      *u = load(uint32_t{});
      *i = static_cast<int64_t>(*u);
      break;
    case GgufValueType::kUint64:
      *u = load(uint64_t{});
      *i = static_cast<int64_t>(*u);
      break;
    case GgufValueType::kBool:
      *u = load(uint8_t{}) != 0;
      *i = static_cast<int64_t>(*u);
      break;
    case GgufValueType::kInt8:
      *i = load(int8_t{});
      break;
    case GgufValueType::kInt16:
      *i = load(int16_t{});
      break;
    case GgufValueType::kInt32:
      *i = load(int32_t{});
      break;
    case GgufValueType::kInt64:
      *i = load(int64_t{});
      break;
    case GgufValueType::kFloat32:
      *f = load(float{});
      break;
    case GgufValueType::kFloat64:
      *f = load(double{});
      break;
    default:
      break;
  }
  bool is_signed = t == GgufValueType::kInt8 || t == GgufValueType::kInt16 ||
                   t == GgufValueType::kInt32 || t == GgufValueType::kInt64;
  if (is_signed) {
    *neg = *i < 0;
    *u = static_cast<uint64_t>(*i);
  }
}

}  // namespace

std::string_view GgufValueTypeName(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
      return "UINT8";
    case GgufValueType::kInt8:
      return "INT8";
    case GgufValueType::kUint16:
      return "UINT16";
    case GgufValueType::kInt16:
      return "INT16";
    case GgufValueType::kUint32:
      return "UINT32";
    case GgufValueType::kInt32:
      return "INT32";
    case GgufValueType::kFloat32:
      return "FLOAT32";
    case GgufValueType::kBool:
      return "BOOL";
    case GgufValueType::kString:
      return "STRING";
    case GgufValueType::kArray:
      return "ARRAY";
    case GgufValueType::kUint64:
      return "UINT64";
    case GgufValueType::kInt64:
      return "INT64";
    case GgufValueType::kFloat64:
      return "FLOAT64";
  }
  return "?";
}

bool GgufValue::is_integer() const {
  switch (type_) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

GgufValue GgufValue::element(uint64_t i) const {
  KILN_CHECK(is_array() && raw_ != nullptr && i < count_,
             "GgufValue::element on a non-numeric array or out of range");
  GgufValue v;
  v.type_ = elem_type_;
  DecodeScalar(elem_type_, raw_ + i * ScalarSize(elem_type_), &v, &v.u64_, &v.i64_, &v.f64_,
               &v.negative_);
  return v;
}

std::string GgufValue::DebugString() const {
  switch (type_) {
    case GgufValueType::kString: {
      std::string s(str_.substr(0, 64));
      return Cat("STRING \"", s, str_.size() > 64 ? "...\"" : "\"");
    }
    case GgufValueType::kArray:
      return Cat("ARRAY[", GgufValueTypeName(elem_type_), "; ", count_, "]");
    case GgufValueType::kFloat32:
    case GgufValueType::kFloat64:
      return Cat(GgufValueTypeName(type_), " ", f64_);
    case GgufValueType::kBool:
      return Cat("BOOL ", u64_ ? "true" : "false");
    default:
      if (negative_) return Cat(GgufValueTypeName(type_), " ", i64_);
      return Cat(GgufValueTypeName(type_), " ", u64_);
  }
}

// Reads the file front to back; every read is bounds-checked against the file size and
// reports where it was when it failed.
class GgufParser {
 public:
  explicit GgufParser(GgufFile* out) : out_(out), file_(*out->file_) {}

  Status Run() {
    KILN_RETURN_IF_ERROR(ParseHeader());
    KILN_RETURN_IF_ERROR(ParseMetadata());
    KILN_RETURN_IF_ERROR(ParseTensorInfos());
    return ValidateTensorData();
  }

 private:
  Status Error(std::string_view what) const { return InvalidArgument(file_.name(), ": ", what); }
  Status Truncated(uint64_t at) const {
    return InvalidArgument(file_.name(), ": truncated at offset ", at, " while reading ", context_,
                           " (file size ", file_.size(), ")");
  }
  Status Need(uint64_t n) const {
    if (n > file_.size() - pos_) return Truncated(pos_);
    return OkStatus();
  }
  uint64_t Remaining() const { return file_.size() - pos_; }

  template <typename T>
  Status Read(T* v) {
    KILN_RETURN_IF_ERROR(Need(sizeof(T)));
    std::memcpy(v, file_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return OkStatus();
  }

  Status ReadString(std::string_view* s) {
    uint64_t start = pos_;
    uint64_t len;
    KILN_RETURN_IF_ERROR(Read(&len));
    if (len > Remaining()) {
      return InvalidArgument(file_.name(), ": string at offset ", start, " has length ", len,
                             " but only ", Remaining(), " bytes remain, while reading ", context_);
    }
    *s = std::string_view(reinterpret_cast<const char*>(file_.data()) + pos_, len);
    pos_ += len;
    return OkStatus();
  }

  Status ParseHeader() {
    context_ = "the header";
    char magic[4];
    if (file_.size() < 4) return Truncated(file_.size());
    std::memcpy(magic, file_.data(), 4);
    pos_ = 4;
    if (std::memcmp(magic, "GGUF", 4) != 0) {
      std::string shown;
      for (char c : magic) {
        shown += (c >= 0x20 && c < 0x7f) ? c : '?';
      }
      return Error(Cat("not a GGUF file: magic at offset 0 is \"", shown, "\", expected \"GGUF\""));
    }
    uint32_t version;
    KILN_RETURN_IF_ERROR(Read(&version));
    if (version != 2 && version != 3) {
      uint32_t swapped = __builtin_bswap32(version);
      if (swapped == 2 || swapped == 3) {
        return Error(Cat("big-endian GGUF v", swapped,
                         " is not supported (convert it with gguf-convert-endian)"));
      }
      return Error(Cat("unsupported GGUF version ", version, " at offset 4 (supported: 2, 3)"));
    }
    out_->version_ = version;
    KILN_RETURN_IF_ERROR(Read(&n_tensors_));
    KILN_RETURN_IF_ERROR(Read(&n_kv_));
    // Cheapest possible entries: a kv is a length (8) + 1-byte key... + type (4) + 1-byte value;
    // a tensor info is a length (8) + n_dims (4) + type (4) + offset (8).
    if (n_kv_ > Remaining() / 13) {
      return Error(Cat("metadata count ", n_kv_, " at offset 16 cannot fit in the ", file_.size(),
                       "-byte file"));
    }
    if (n_tensors_ > Remaining() / 24) {
      return Error(Cat("tensor count ", n_tensors_, " at offset 8 cannot fit in the ", file_.size(),
                       "-byte file"));
    }
    return OkStatus();
  }

  Status ParseValue(GgufValueType type, GgufValue* v, int depth) {
    v->type_ = type;
    if (type == GgufValueType::kString) return ReadString(&v->str_);
    if (type != GgufValueType::kArray) {
      size_t n = ScalarSize(type);
      KILN_RETURN_IF_ERROR(Need(n));
      DecodeScalar(type, file_.data() + pos_, v, &v->u64_, &v->i64_, &v->f64_, &v->negative_);
      pos_ += n;
      return OkStatus();
    }
    if (depth >= kMaxArrayNesting) {
      return Error(Cat("arrays nested deeper than ", kMaxArrayNesting, " at offset ", pos_,
                       " while reading ", context_));
    }
    uint64_t at = pos_;
    uint32_t elem;
    KILN_RETURN_IF_ERROR(Read(&elem));
    if (!IsKnownValueType(elem)) {
      return Error(Cat("unknown array element type ", elem, " at offset ", at, " while reading ",
                       context_, " (valid: 0..12)"));
    }
    v->elem_type_ = static_cast<GgufValueType>(elem);
    KILN_RETURN_IF_ERROR(Read(&v->count_));
    size_t esize = ScalarSize(v->elem_type_);
    uint64_t min_size = esize ? esize : (v->elem_type_ == GgufValueType::kString ? 8 : 12);
    if (v->count_ > Remaining() / min_size) {
      return InvalidArgument(file_.name(), ": array at offset ", at, " has ", v->count_,
                             " elements of type ", GgufValueTypeName(v->elem_type_), " but only ",
                             Remaining(), " bytes remain, while reading ", context_);
    }
    if (esize) {
      v->raw_ = file_.data() + pos_;
      pos_ += v->count_ * esize;
      return OkStatus();
    }
    v->items_.resize(v->count_);
    for (uint64_t i = 0; i < v->count_; ++i) {
      KILN_RETURN_IF_ERROR(ParseValue(v->elem_type_, &v->items_[i], depth + 1));
    }
    return OkStatus();
  }

  Status ParseMetadata() {
    out_->keys_.reserve(n_kv_);
    out_->values_.reserve(n_kv_);
    for (uint64_t i = 0; i < n_kv_; ++i) {
      context_ = Cat("metadata key ", i, " of ", n_kv_);
      std::string_view key;
      KILN_RETURN_IF_ERROR(ReadString(&key));
      context_ += Cat(" (\"", key, "\")");
      uint64_t at = pos_;
      uint32_t type;
      KILN_RETURN_IF_ERROR(Read(&type));
      if (!IsKnownValueType(type)) {
        return Error(Cat("unknown value type ", type, " at offset ", at, " while reading ",
                         context_, " (valid: 0..12)"));
      }
      GgufValue value;
      KILN_RETURN_IF_ERROR(ParseValue(static_cast<GgufValueType>(type), &value, 0));
      if (!out_->key_index_.emplace(key, out_->keys_.size()).second) {
        return Error(Cat("duplicate metadata key \"", key, "\" (", context_, ")"));
      }
      out_->keys_.push_back(key);
      out_->values_.push_back(std::move(value));
    }
    if (const GgufValue* a = out_->Find("general.alignment")) {
      if (a->type() != GgufValueType::kUint32) {
        return Error(Cat("general.alignment must be UINT32, got ", a->DebugString()));
      }
      uint64_t al = a->as_u64();
      if (al == 0 || (al & (al - 1)) != 0) {
        return Error(Cat("general.alignment is ", al, ", must be a power of two"));
      }
      out_->alignment_ = static_cast<uint32_t>(al);
    } else {
      out_->alignment_ = kDefaultAlignment;
    }
    return OkStatus();
  }

  Status ParseTensorInfos() {
    out_->tensors_.reserve(n_tensors_);
    for (uint64_t i = 0; i < n_tensors_; ++i) {
      context_ = Cat("tensor info ", i, " of ", n_tensors_);
      GgufTensor t;
      KILN_RETURN_IF_ERROR(ReadString(&t.name));
      context_ += Cat(" (\"", t.name, "\")");
      uint64_t at = pos_;
      uint32_t n_dims;
      KILN_RETURN_IF_ERROR(Read(&n_dims));
      if (n_dims == 0 || n_dims > kMaxDims) {
        return Error(Cat("tensor \"", t.name, "\" has ", n_dims, " dimensions at offset ", at,
                         " (allowed: 1 to ", kMaxDims, ")"));
      }
      uint64_t n_elements = 1;
      bool overflow = false;
      for (uint32_t d = 0; d < n_dims; ++d) {
        uint64_t dim;
        KILN_RETURN_IF_ERROR(Read(&dim));
        if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
        t.dims.push_back(static_cast<int64_t>(dim));
        if (dim != 0 &&
            n_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim) {
          overflow = true;
        }
        n_elements *= dim;
      }
      if (overflow) {
        std::string shape;
        for (int64_t d : t.dims) shape += Cat(shape.empty() ? "" : ", ", static_cast<uint64_t>(d));
        return Error(Cat("tensor \"", t.name, "\" has dims [", shape,
                         "] whose element count overflows 63 bits (", context_, ")"));
      }
      t.n_elements = n_elements;
      at = pos_;
      uint32_t type;
      KILN_RETURN_IF_ERROR(Read(&type));
      auto traits = GetGgmlTypeTraits(type);
      if (!traits) {
        return Error(Cat("unknown tensor type ", type, " in tensor \"", t.name, "\" at offset ", at,
                         " (supported: ", SupportedGgmlTypeList(), ")"));
      }
      if (!traits->supported) {
        return Error(Cat("unsupported tensor type ", traits->name, " in tensor \"", t.name,
                         "\" (supported: ", SupportedGgmlTypeList(), ")"));
      }
      t.type = static_cast<GgmlType>(type);
      if (t.dims[0] % traits->block_size != 0) {
        return Error(Cat("tensor \"", t.name, "\" of type ", traits->name,
                         " has a first dimension of ", t.dims[0],
                         ", not a multiple of the block size ", traits->block_size));
      }
      uint64_t blocks = n_elements / traits->block_size;
      if (blocks > std::numeric_limits<uint64_t>::max() / traits->type_size) {
        return Error(Cat("tensor \"", t.name, "\" byte size overflows"));
      }
      t.n_bytes = blocks * traits->type_size;
      KILN_RETURN_IF_ERROR(Read(&t.offset));
      if (!out_->tensor_index_.emplace(t.name, out_->tensors_.size()).second) {
        return Error(Cat("duplicate tensor name \"", t.name, "\" (", context_, ")"));
      }
      out_->tensors_.push_back(std::move(t));
    }
    uint64_t al = out_->alignment_;
    out_->data_offset_ = (pos_ + al - 1) / al * al;
    return OkStatus();
  }

  Status ValidateTensorData() {
    const uint64_t data_offset = out_->data_offset_;
    const uint64_t size = file_.size();
    if (!out_->tensors_.empty() && data_offset > size) {
      return Error(Cat("truncated: the tensor data section starts at offset ", data_offset,
                       " past the end of the ", size, "-byte file"));
    }
    const uint64_t data_size = data_offset <= size ? size - data_offset : 0;
    std::vector<const GgufTensor*> by_offset;
    by_offset.reserve(out_->tensors_.size());
    for (GgufTensor& t : out_->tensors_) {
      if (t.offset % out_->alignment_ != 0) {
        return Error(Cat("tensor \"", t.name, "\" data offset ", t.offset,
                         " is not a multiple of the alignment ", out_->alignment_));
      }
      if (t.offset > data_size || t.n_bytes > data_size - t.offset) {
        return Error(Cat("tensor \"", t.name, "\" data [", t.offset, ", +", t.n_bytes,
                         ") is out of range: the data section has ", data_size,
                         " bytes (file truncated or offset corrupt)"));
      }
      t.file_offset = data_offset + t.offset;
      t.data = file_.data() + t.file_offset;
      by_offset.push_back(&t);
    }
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
      const GgufTensor* prev = by_offset[i - 1];
      const GgufTensor* cur = by_offset[i];
      if (prev->n_bytes > 0 && cur->n_bytes > 0 && prev->offset + prev->n_bytes > cur->offset) {
        return Error(Cat("tensor \"", cur->name, "\" data at offset ", cur->offset,
                         " overlaps tensor \"", prev->name, "\" [", prev->offset, ", ",
                         prev->offset + prev->n_bytes, ")"));
      }
    }
    return OkStatus();
  }

  GgufFile* out_;
  const MappedFile& file_;
  uint64_t pos_ = 0;
  uint64_t n_tensors_ = 0;
  uint64_t n_kv_ = 0;
  std::string context_;
};

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  return Parse(std::move(file));
}

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(std::shared_ptr<const MappedFile> file) {
  KILN_CHECK(file != nullptr, "GgufFile::Parse needs a file");
  std::unique_ptr<GgufFile> out(new GgufFile());
  out->file_ = std::move(file);
  GgufParser parser(out.get());
  KILN_RETURN_IF_ERROR(parser.Run());
  return out;
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &values_[it->second];
}

namespace {

Status Missing(const GgufFile& f, std::string_view key) {
  return NotFound(f.path(), ": metadata key \"", key, "\" is missing");
}

Status WrongType(const GgufFile& f, std::string_view key, const GgufValue& v,
                 std::string_view want) {
  return InvalidArgument(f.path(), ": metadata key \"", key, "\" is ", v.DebugString(),
                         ", expected ", want);
}

// Integer value as (negative, magnitude-as-u64 or signed) with a range check into [lo, hi].
template <typename T>
StatusOr<T> IntValue(const GgufFile& f, std::string_view key, const GgufValue& v,
                     std::string_view want) {
  if (!v.is_integer()) return WrongType(f, key, v, want);
  bool negative = v.type() == GgufValueType::kInt8 || v.type() == GgufValueType::kInt16 ||
                          v.type() == GgufValueType::kInt32 || v.type() == GgufValueType::kInt64
                      ? v.as_i64() < 0
                      : false;
  if (negative) {
    if (!std::numeric_limits<T>::is_signed ||
        v.as_i64() < static_cast<int64_t>(std::numeric_limits<T>::min())) {
      return WrongType(f, key, v, want);
    }
    return static_cast<T>(v.as_i64());
  }
  if (v.as_u64() > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
    return WrongType(f, key, v, want);
  }
  return static_cast<T>(v.as_u64());
}

template <typename T>
StatusOr<std::vector<T>> IntArray(const GgufFile& f, std::string_view key, const GgufValue* v,
                                  std::string_view want) {
  if (v == nullptr) return Missing(f, key);
  if (!v->is_array() || v->element_type() == GgufValueType::kString ||
      v->element_type() == GgufValueType::kArray || v->element_type() == GgufValueType::kBool ||
      v->element_type() == GgufValueType::kFloat32 ||
      v->element_type() == GgufValueType::kFloat64) {
    return WrongType(f, key, *v, want);
  }
  std::vector<T> out;
  out.reserve(v->array_size());
  for (uint64_t i = 0; i < v->array_size(); ++i) {
    GgufValue e = v->element(i);
    auto x = IntValue<T>(f, key, e, want);
    if (!x.ok()) {
      return InvalidArgument(f.path(), ": metadata key \"", key, "\" element ", i, " is ",
                             e.DebugString(), ", out of range for ", want);
    }
    out.push_back(*x);
  }
  return out;
}

}  // namespace

#define KILN_GGUF_INT_GETTER(Name, T, want)                \
  StatusOr<T> GgufFile::Name(std::string_view key) const { \
    const GgufValue* v = Find(key);                        \
    if (v == nullptr) return Missing(*this, key);          \
    return IntValue<T>(*this, key, *v, want);              \
  }
KILN_GGUF_INT_GETTER(GetU32, uint32_t, "an integer in [0, 2^32)")
KILN_GGUF_INT_GETTER(GetU64, uint64_t, "a non-negative integer")
KILN_GGUF_INT_GETTER(GetI32, int32_t, "a 32-bit integer")
KILN_GGUF_INT_GETTER(GetI64, int64_t, "a 64-bit integer")
#undef KILN_GGUF_INT_GETTER

StatusOr<float> GgufFile::GetF32(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(*this, key);
  if (!v->is_float()) return WrongType(*this, key, *v, "FLOAT32 or FLOAT64");
  return static_cast<float>(v->as_f64());
}

StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(*this, key);
  if (v->type() != GgufValueType::kBool) return WrongType(*this, key, *v, "BOOL");
  return v->as_bool();
}

StatusOr<std::string_view> GgufFile::GetString(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(*this, key);
  if (v->type() != GgufValueType::kString) return WrongType(*this, key, *v, "STRING");
  return v->as_string();
}

StatusOr<std::vector<std::string_view>> GgufFile::GetStringArray(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(*this, key);
  if (!v->is_array() || v->element_type() != GgufValueType::kString) {
    return WrongType(*this, key, *v, "ARRAY[STRING]");
  }
  std::vector<std::string_view> out;
  out.reserve(v->items().size());
  for (const GgufValue& e : v->items()) out.push_back(e.as_string());
  return out;
}

StatusOr<std::vector<float>> GgufFile::GetF32Array(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(*this, key);
  if (!v->is_array() || (v->element_type() != GgufValueType::kFloat32 &&
                         v->element_type() != GgufValueType::kFloat64)) {
    return WrongType(*this, key, *v, "ARRAY[FLOAT32]");
  }
  std::vector<float> out;
  out.reserve(v->array_size());
  for (uint64_t i = 0; i < v->array_size(); ++i) {
    out.push_back(static_cast<float>(v->element(i).as_f64()));
  }
  return out;
}

StatusOr<std::vector<int32_t>> GgufFile::GetI32Array(std::string_view key) const {
  return IntArray<int32_t>(*this, key, Find(key), "ARRAY[INT32]");
}

StatusOr<std::vector<int64_t>> GgufFile::GetI64Array(std::string_view key) const {
  return IntArray<int64_t>(*this, key, Find(key), "ARRAY[INT64]");
}

StatusOr<uint32_t> GgufFile::GetU32Or(std::string_view key, uint32_t fallback) const {
  return Has(key) ? GetU32(key) : StatusOr<uint32_t>(fallback);
}
StatusOr<float> GgufFile::GetF32Or(std::string_view key, float fallback) const {
  return Has(key) ? GetF32(key) : StatusOr<float>(fallback);
}
StatusOr<bool> GgufFile::GetBoolOr(std::string_view key, bool fallback) const {
  return Has(key) ? GetBool(key) : StatusOr<bool>(fallback);
}
StatusOr<std::string_view> GgufFile::GetStringOr(std::string_view key,
                                                 std::string_view fallback) const {
  return Has(key) ? GetString(key) : StatusOr<std::string_view>(fallback);
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

StatusOr<const GgufTensor*> GgufFile::GetTensor(std::string_view name) const {
  const GgufTensor* t = FindTensor(name);
  if (t == nullptr) return NotFound(path(), ": tensor \"", name, "\" is missing");
  return t;
}

}  // namespace kiln::models
