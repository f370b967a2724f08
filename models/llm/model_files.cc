#include "models/llm/model_files.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/str_join.h"
#include "models/io/errors.h"
#include "spdlog/spdlog.h"

namespace kiln::models {
namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

bool HasGgufMagic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  return in.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::optional<DType> SafetensorsToDType(SafetensorsDtype d) {
  switch (d) {
    case SafetensorsDtype::kF32:
      return DType::kF32;
    case SafetensorsDtype::kF16:
      return DType::kF16;
    case SafetensorsDtype::kBF16:
      return DType::kBF16;
    case SafetensorsDtype::kF64:
      return DType::kF64;
    case SafetensorsDtype::kI64:
      return DType::kI64;
    case SafetensorsDtype::kI32:
      return DType::kI32;
    case SafetensorsDtype::kI16:
      return DType::kI16;
    case SafetensorsDtype::kI8:
      return DType::kI8;
    case SafetensorsDtype::kU8:
      return DType::kU8;
    case SafetensorsDtype::kBool:
      return DType::kBool;
    case SafetensorsDtype::kF8_E4M3:
      return DType::kF8E4M3;
    case SafetensorsDtype::kF8_E5M2:
      return DType::kF8E5M2;
  }
  return std::nullopt;
}

// Types the engine's Linear/Gather take as they are stored.
bool IsNativeWeightType(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ8_0:
    case DType::kMXFP4:
      return true;
    default:
      return false;
  }
}

// Stored types loaded as Q8_0: the nearest type the engine runs natively.
bool LoadsAsQ8_0(DType t) {
  return t == DType::kQ4_K || t == DType::kQ5_K || t == DType::kQ6_K || t == DType::kQ5_0 ||
         t == DType::kQ5_1;
}

// Q5_0 -> Q8_0 without loss: the same f16 scale, and the 5-bit values less 16 as int8
// (block layout: f16 d; u8 qh[4], bit j the 5th bit of element j; u8 qs[16], element j in the
// low nibble of qs[j], element j + 16 in the high one).
void Q5_0RowToQ8_0(const uint8_t* src, uint8_t* dst, int64_t K) {
  for (int64_t b = 0; b < K / 32; ++b, src += 22, dst += 34) {
    std::memcpy(dst, src, 2);
    const uint8_t* qh = src + 2;
    const uint8_t* qs = src + 6;
    const uint32_t h = qh[0] | uint32_t{qh[1]} << 8 | uint32_t{qh[2]} << 16 | uint32_t{qh[3]} << 24;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0F) | ((h >> j) & 1) << 4;
      const int hi = (qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4;
      dst[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(lo - 16));
      dst[2 + 16 + j] = static_cast<uint8_t>(static_cast<int8_t>(hi - 16));
    }
  }
}

// What a kernel may assume about a tensor's address: scalar types their size; GGML blocks
// only the alignment of their half-precision scale fields (blocks of 34 or 17 bytes follow one
// another unpadded).
uintptr_t RequiredAlignment(DType t) {
  if (!IsQuantized(t)) return static_cast<uintptr_t>(DTypeBlockBytes(t));
  return t == DType::kMXFP4 ? 1 : 2;
}

}  // namespace

std::string ShapeString(const std::vector<int64_t>& shape) {
  return Cat("[", absl::StrJoin(shape, ", "), "]");
}

std::vector<int64_t> WeightInfo::LoadedShape() const {
  std::vector<int64_t> s = shape;
  if (transpose && s.size() == 2) std::swap(s[0], s[1]);
  return s;
}

std::string WeightInfo::DisplayName() const {
  return stored_name == name ? name : Cat(stored_name, " (", name, ")");
}

StatusOr<DType> LoadedDType(const WeightInfo& w) {
  const bool vector = w.shape.size() == 1;
  if (IsNativeWeightType(w.dtype) || LoadsAsQ8_0(w.dtype)) {
    // Norm weights and biases are added to / multiplied with f32 activations.
    if (vector) return DType::kF32;
    // Q5_0/Q5_1 and the K-quants: Q8_0 is the nearest type the engine runs natively (8.5 bits
    // per weight, more than their 4.5-6.6 bits: Q5_0 converts exactly, the others add Q8_0's
    // rounding; docs/models.md).
    if (LoadsAsQ8_0(w.dtype)) return DType::kQ8_0;
    return w.dtype;
  }
  return InvalidArgument(w.file, ": tensor '", w.DisplayName(), "' has type ", DTypeName(w.dtype),
                         "; model weights may be f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, "
                         "mxfp4, q4_k, q5_k or q6_k");
}

StatusOr<std::unique_ptr<ModelFiles>> ModelFiles::Open(const std::string& path) {
  if (!Exists(path)) return NotFound("model path '", path, "' does not exist");
  std::unique_ptr<ModelFiles> f(new ModelFiles());
  f->path_ = path;
  if (IsDirectory(path)) {
    if (!Exists(path + "/config.json")) {
      return InvalidArgument(
          "model folder '", path,
          "' has no config.json: expected a Hugging Face folder (config.json, model.safetensors "
          "or model.safetensors.index.json, tokenizer.json) or a GGUF file");
    }
    KILN_ASSIGN_OR_RETURN(HfFolder hf, HfFolder::Open(path));
    f->hf_ = std::move(hf);
    f->architecture_ = f->hf_->config.model_type;
    if (f->hf_->weights_path.empty()) {
      return InvalidArgument("model folder '", path,
                             "' has no model.safetensors or model.safetensors.index.json");
    }
    f->weights_path_ = f->hf_->weights_path;
    return f;
  }
  if (!HasGgufMagic(path)) {
    if (EndsWith(path, ".safetensors")) {
      return InvalidArgument("model path '", path,
                             "' is a safetensors file: pass the Hugging Face folder that holds it "
                             "(config.json and tokenizer.json are needed too)");
    }
    return InvalidArgument("model path '", path,
                           "' is neither a GGUF file (no 'GGUF' magic) nor a Hugging Face folder");
  }
  KILN_ASSIGN_OR_RETURN(f->gguf_, GgufFile::Open(path));
  KILN_ASSIGN_OR_RETURN(std::string_view arch, f->gguf_->GetString("general.architecture"));
  f->architecture_ = std::string(arch);
  f->weights_path_ = path;
  f->IndexGguf();
  return f;
}

void ModelFiles::IndexGguf() {
  for (const GgufTensor& t : gguf_->tensors()) {
    WeightInfo w;
    w.name = std::string(t.name);
    w.stored_name = w.name;
    w.file = path_;
    // The reader only accepts supported types; those without an engine dtype (F64/ints are
    // mapped) stay kInvalid and are refused by LoadedDType if a model asks for them.
    w.dtype = ToDType(t.type).value_or(DType::kInvalid);
    w.shape.assign(t.dims.rbegin(), t.dims.rend());
    w.data = t.data;
    w.bytes = t.n_bytes;
    weights_.emplace(w.name, std::move(w));
  }
}

std::string ModelFiles::DisplayModelName() const {
  if (gguf_) {
    auto name = gguf_->GetStringOr("general.name", "");
    if (name.ok() && !name->empty()) return std::string(*name);
  }
  std::string p = path_;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::optional<std::string> ModelFiles::MapHfName(const HfNaming& naming, std::string_view stored,
                                                 int64_t num_layers, bool* transpose,
                                                 Status* error) const {
  for (std::string_view p : naming.strip_prefixes) {
    if (stored.substr(0, p.size()) == p) {
      stored.remove_prefix(p.size());
      break;
    }
  }
  for (const HfTensorName& n : naming.global) {
    if (stored == n.hf) {
      *transpose = n.transpose;
      return std::string(n.gguf);
    }
  }
  for (std::string_view prefix : naming.layer_prefixes) {
    if (stored.substr(0, prefix.size()) != prefix) continue;
    std::string_view rest = stored.substr(prefix.size());
    size_t digits = 0;
    while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') ++digits;
    if (digits == 0 || digits > 6 || digits >= rest.size() || rest[digits] != '.') continue;
    const int64_t layer = std::stoll(std::string(rest.substr(0, digits)));
    const std::string_view suffix = rest.substr(digits + 1);
    for (const HfTensorName& n : naming.per_layer) {
      if (suffix != n.hf) continue;
      if (layer >= num_layers) {
        *error = InvalidArgument(weights_path_, ": tensor '", stored, "' is for layer ", layer,
                                 " but config.json says the model has ", num_layers, " layers");
        return std::nullopt;
      }
      *transpose = n.transpose;
      return Cat("blk.", layer, ".", n.gguf);
    }
  }
  return std::nullopt;
}

Status ModelFiles::IndexSafetensors(const HfNaming& naming, int64_t num_layers) {
  KILN_CHECK(hf_.has_value(), "IndexSafetensors on a GGUF model");
  naming_ = naming;
  KILN_ASSIGN_OR_RETURN(safetensors_, SafetensorsModel::Open(hf_->weights_path));
  std::vector<std::string> unused;
  for (const SafetensorsTensor* t : safetensors_->tensors()) {
    bool transpose = false;
    Status error;
    std::optional<std::string> name = MapHfName(naming, t->name, num_layers, &transpose, &error);
    if (!error.ok()) return error;
    if (!name) {
      const bool ignored =
          std::any_of(naming.ignored_suffixes.begin(), naming.ignored_suffixes.end(),
                      [&](std::string_view s) { return EndsWith(t->name, s); });
      if (!ignored) unused.push_back(t->name);
      continue;
    }
    WeightInfo w;
    w.name = *name;
    w.stored_name = t->name;
    w.file = *t->file;
    w.dtype = SafetensorsToDType(t->dtype).value_or(DType::kInvalid);
    w.shape = t->shape;
    w.data = t->data;
    w.bytes = t->n_bytes;
    w.transpose = transpose;
    if (transpose && w.shape.size() != 2) {
      return InvalidArgument(w.file, ": tensor '", w.stored_name, "' has shape ",
                             ShapeString(w.shape), "; a 2-D [in, out] matrix is expected");
    }
    const std::string key = w.name;
    if (!weights_.emplace(key, std::move(w)).second) {
      return InvalidArgument(weights_path_, ": two stored tensors map to '", key,
                             "' (the second is '", t->name, "')");
    }
  }
  if (!unused.empty()) {
    spdlog::warn(
        "{}: {} tensor(s) not used by architecture '{}': {}{}", weights_path_, unused.size(),
        architecture_,
        absl::StrJoin(unused.begin(), unused.begin() + std::min<size_t>(unused.size(), 8), ", "),
        unused.size() > 8 ? ", ..." : "");
  }
  return OkStatus();
}

const WeightInfo* ModelFiles::Find(std::string_view name) const {
  auto it = weights_.find(name);
  return it == weights_.end() ? nullptr : &it->second;
}

bool ModelFiles::CanConcatenateRows(std::span<const std::string> parts) const {
  const WeightInfo* first = nullptr;
  for (const std::string& part : parts) {
    const WeightInfo* w = Find(part);
    if (w == nullptr || w->transpose || w->shape.size() != 2) return false;
    const StatusOr<DType> loaded = LoadedDType(*w);
    if (!loaded.ok() || *loaded != w->dtype ||
        w->bytes != static_cast<uint64_t>(DTypeBytes(w->dtype, w->shape[0] * w->shape[1]))) {
      return false;
    }
    if (first != nullptr && (w->dtype != first->dtype || w->shape[1] != first->shape[1])) {
      return false;
    }
    if (first == nullptr) first = w;
  }
  return first != nullptr;
}

Status ModelFiles::AddConcatenatedRows(const std::string& name,
                                       std::span<const std::string> parts) {
  if (Find(name) != nullptr) return OkStatus();
  KILN_CHECK(CanConcatenateRows(parts), "AddConcatenatedRows: parts that cannot be joined");
  std::vector<const WeightInfo*> ws;
  std::vector<std::string> stored;
  int64_t rows = 0;
  uint64_t bytes = 0;
  // Parts that follow one another in the file (llama.cpp writes ffn_gate, then ffn_up) are
  // one range of the mapping already: no copy.
  bool adjacent = true;
  for (const std::string& part : parts) {
    const WeightInfo* w = Find(part);
    if (!ws.empty()) {
      adjacent =
          adjacent && w->data == static_cast<const char*>(ws.back()->data) + ws.back()->bytes;
    }
    ws.push_back(w);
    stored.push_back(w->stored_name);
    rows += w->shape[0];
    bytes += w->bytes;
  }
  WeightInfo info = *ws[0];
  info.name = name;
  info.stored_name = absl::StrJoin(stored, " | ");
  info.shape = {rows, info.shape[1]};
  info.bytes = bytes;
  if (!adjacent) {
    std::shared_ptr<void> data(std::aligned_alloc(64, (bytes + 63) / 64 * 64), std::free);
    if (data == nullptr) {
      return ResourceExhausted("cannot allocate ", bytes, " bytes for the weight ", name, " (",
                               absl::StrJoin(parts, " | "), ")");
    }
    auto* dst = static_cast<uint8_t*>(data.get());
    for (const WeightInfo* w : ws) {
      std::memcpy(dst, w->data, w->bytes);
      dst += w->bytes;
    }
    info.data = data.get();
    info.copied = true;
    owned_.push_back(std::move(data));
  }
  weights_.emplace(name, std::move(info));
  return OkStatus();
}

std::string ModelFiles::MissingName(std::string_view name) const {
  if (!naming_) return std::string(name);
  for (const HfTensorName& n : naming_->global) {
    if (n.gguf == name) return Cat(n.hf, " (", name, ")");
  }
  // "blk.<layer>.<suffix>"
  if (name.substr(0, 4) == "blk." && !naming_->layer_prefixes.empty()) {
    const size_t dot = name.find('.', 4);
    if (dot != std::string_view::npos) {
      const std::string_view layer = name.substr(4, dot - 4), suffix = name.substr(dot + 1);
      for (const HfTensorName& n : naming_->per_layer) {
        if (n.gguf == suffix) {
          return Cat(naming_->layer_prefixes.front(), layer, ".", n.hf, " (", name, ")");
        }
      }
    }
  }
  return std::string(name);
}

StatusOr<Tensor> ModelFiles::Load(const WeightInfo& w, backend::Device& device,
                                  std::shared_ptr<void> keepalive) const {
  KILN_ASSIGN_OR_RETURN(const DType dtype, LoadedDType(w));
  const std::vector<int64_t> shape = w.LoadedShape();
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t bytes = DTypeBytes(dtype, numel);
  const bool aligned = reinterpret_cast<uintptr_t>(w.data) % RequiredAlignment(w.dtype) == 0;
  if (dtype == w.dtype && !w.transpose && aligned && device.host_visible() &&
      static_cast<uint64_t>(bytes) == w.bytes) {
    auto wrapped = device.WrapHostMemory(const_cast<void*>(w.data), w.bytes, keepalive);
    if (wrapped.ok()) {
      return Tensor::FromBuffer(std::shared_ptr<backend::Buffer>(std::move(*wrapped)), 0, dtype,
                                shape);
    }
  }
  // Convert (or copy) on the host, then upload.
  std::vector<uint8_t> host(static_cast<size_t>(bytes));
  if (w.transpose) {
    // Element-wise [K, N] -> [N, K] in the stored type (a float type; the same as `dtype`).
    const int64_t K = w.shape[0], N = w.shape[1], es = DTypeBlockBytes(w.dtype);
    if (dtype != w.dtype || DTypeBlockElems(w.dtype) != 1) {
      return InvalidArgument(w.file, ": tensor '", w.DisplayName(), "' of type ",
                             DTypeName(w.dtype), " cannot be transposed at load");
    }
    const auto* src = static_cast<const uint8_t*>(w.data);
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t n = 0; n < N; ++n) {
        std::memcpy(&host[static_cast<size_t>((n * K + k) * es)], src + (k * N + n) * es,
                    static_cast<size_t>(es));
      }
    }
  } else if (dtype == w.dtype) {
    std::memcpy(host.data(), w.data, host.size());
  } else if (shape.size() == 1 || !IsQuantized(dtype)) {
    KILN_RETURN_IF_ERROR(ConvertElements(w.dtype, w.data, dtype, host.data(), numel));
  } else {
    // Requantize row by row (Q5_0, Q5_1, K-quant -> Q8_0).
    const int64_t K = shape.back(), rows = numel / K;
    const int64_t src_row = DTypeBytes(w.dtype, K), dst_row = DTypeBytes(dtype, K);
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t r = 0; r < rows; ++r) {
      if (w.dtype == DType::kQ5_0 && dtype == DType::kQ8_0) {
        Q5_0RowToQ8_0(static_cast<const uint8_t*>(w.data) + r * src_row, host.data() + r * dst_row,
                      K);
        continue;
      }
      KILN_RETURN_IF_ERROR(
          DequantizeRow(w.dtype, static_cast<const uint8_t*>(w.data) + r * src_row, row.data(), K));
      KILN_RETURN_IF_ERROR(QuantizeRow(dtype, row.data(), host.data() + r * dst_row, K));
    }
  }
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Buffer> buf,
                        device.Allocate(static_cast<size_t>(bytes)));
  std::shared_ptr<backend::Buffer> shared(std::move(buf));
  if (device.host_visible()) {
    std::memcpy(shared->data(), host.data(), host.size());
  } else {
    KILN_ASSIGN_OR_RETURN(auto stream, device.CreateStream());
    KILN_RETURN_IF_ERROR(stream->CopyToDevice(*shared, 0, host.data(), host.size()));
    KILN_RETURN_IF_ERROR(stream->Synchronize());
  }
  return Tensor::FromBuffer(std::move(shared), 0, dtype, shape);
}

}  // namespace kiln::models
