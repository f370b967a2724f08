#include "engine/tensor.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kiln {

std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape) {
  std::vector<int64_t> s(shape.size());
  int64_t acc = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    s[i] = acc;
    acc *= shape[i];
  }
  return s;
}

namespace {

Status CheckShape(DType dtype, std::span<const int64_t> shape) {
  if (dtype == DType::kInvalid) return InvalidArgument("tensor: invalid dtype");
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    return InvalidArgument("tensor: rank ", shape.size(), " exceeds the maximum ", kMaxRank);
  }
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("tensor: negative dimension ", d);
  }
  if (IsQuantized(dtype)) {
    if (shape.empty() || shape.back() % DTypeBlockElems(dtype) != 0) {
      return InvalidArgument("tensor: a ", DTypeName(dtype),
                             " tensor's last axis must be a multiple of ", DTypeBlockElems(dtype));
    }
  }
  return OkStatus();
}

int64_t Product(std::span<const int64_t> s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

}  // namespace

StatusOr<Tensor> Tensor::Empty(backend::Device& device, DType dtype, std::vector<int64_t> shape) {
  KILN_RETURN_IF_ERROR(CheckShape(dtype, shape));
  const int64_t bytes = DTypeBytes(dtype, Product(shape));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Buffer> buf,
                        device.Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 1))));
  return FromBuffer(std::shared_ptr<backend::Buffer>(std::move(buf)), 0, dtype, std::move(shape));
}

StatusOr<Tensor> Tensor::FromBuffer(std::shared_ptr<backend::Buffer> buffer, size_t offset_bytes,
                                    DType dtype, std::vector<int64_t> shape) {
  KILN_RETURN_IF_ERROR(CheckShape(dtype, shape));
  if (buffer == nullptr) return InvalidArgument("tensor: null buffer");
  const int64_t bytes = DTypeBytes(dtype, Product(shape));
  if (offset_bytes + static_cast<size_t>(bytes) > buffer->size()) {
    return InvalidArgument("tensor: ", bytes, " bytes at offset ", offset_bytes,
                           " do not fit a buffer of ", buffer->size());
  }
  const int64_t elem_bytes = DTypeBlockBytes(dtype);
  if (static_cast<int64_t>(offset_bytes) % elem_bytes != 0) {
    return InvalidArgument("tensor: offset ", offset_bytes, " is not a multiple of the ",
                           DTypeName(dtype), " element/block size");
  }
  Tensor t;
  t.buffer_ = std::move(buffer);
  t.dtype_ = dtype;
  t.strides_ = ContiguousStrides(shape);
  t.shape_ = std::move(shape);
  t.offset_ = static_cast<int64_t>(offset_bytes) / elem_bytes * DTypeBlockElems(dtype);
  return t;
}

StatusOr<Tensor> Tensor::FromParts(std::shared_ptr<backend::Buffer> buffer, DType dtype,
                                   std::vector<int64_t> shape, std::vector<int64_t> strides,
                                   int64_t offset_elems) {
  KILN_RETURN_IF_ERROR(CheckShape(dtype, shape));
  if (strides.size() != shape.size())
    return InvalidArgument("tensor: strides do not match the rank");
  Tensor t;
  t.buffer_ = std::move(buffer);
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  t.offset_ = offset_elems;
  return t;
}

StatusOr<Tensor> Tensor::FromDoubles(backend::Device& device, DType dtype,
                                     std::vector<int64_t> shape, std::span<const double> values) {
  if (!device.host_visible()) {
    return FailedPrecondition("Tensor::FromDoubles needs a host-visible device; ",
                              std::string(device.name()), " is not");
  }
  KILN_ASSIGN_OR_RETURN(Tensor t, Empty(device, dtype, std::move(shape)));
  if (static_cast<int64_t>(values.size()) != t.numel()) {
    return InvalidArgument("Tensor::FromDoubles: ", values.size(), " values for ", t.numel(),
                           " elements");
  }
  if (IsQuantized(dtype)) {
    std::vector<float> f(values.begin(), values.end());
    KILN_RETURN_IF_ERROR(QuantizeRow(dtype, f.data(), t.data(), t.numel()));
    return t;
  }
  for (int64_t i = 0; i < t.numel(); ++i) StoreElement(t.data(), dtype, i, values[i]);
  return t;
}

StatusOr<std::vector<double>> Tensor::ToDoubles() const {
  if (!defined()) return FailedPrecondition("Tensor::ToDoubles on an undefined tensor");
  if (!buffer_->device().host_visible()) {
    return FailedPrecondition("Tensor::ToDoubles needs a host-visible device");
  }
  std::vector<double> out(numel());
  std::vector<int64_t> idx(shape_.size(), 0);
  for (int64_t n = 0; n < numel(); ++n) {
    int64_t off = 0;
    for (size_t i = 0; i < idx.size(); ++i) off += idx[i] * strides_[i];
    if (IsQuantized(dtype_)) {
      // Rows are contiguous: address the block that holds element `off`.
      const int64_t be = DTypeBlockElems(dtype_);
      const int64_t row_start = off - off % be;
      out[n] =
          LoadElement(static_cast<char*>(data()) + ByteOffset(dtype_, row_start), dtype_, off % be);
    } else {
      out[n] = LoadElement(data(), dtype_, off);
    }
    for (int i = static_cast<int>(idx.size()) - 1; i >= 0; --i) {
      if (++idx[i] < shape_[i]) break;
      idx[i] = 0;
    }
  }
  return out;
}

int64_t Tensor::numel() const { return Product(shape_); }

bool Tensor::IsContiguous() const { return ToArg().IsContiguous(); }

void* Tensor::data() const {
  if (!buffer_) return nullptr;
  return static_cast<char*>(buffer_->data()) + ByteOffset(dtype_, offset_);
}

StatusOr<Tensor> Tensor::Slice(int axis, int64_t start, int64_t size) const {
  if (axis < 0) axis += rank();
  if (axis < 0 || axis >= rank())
    return InvalidArgument("slice: axis out of range for rank ", rank());
  if (start < 0 || size < 0 || start + size > shape_[axis]) {
    return InvalidArgument("slice: [", start, ", ", start + size, ") is outside axis ", axis,
                           " of size ", shape_[axis]);
  }
  if (IsQuantized(dtype_) && axis == rank() - 1) {
    return InvalidArgument("slice: a quantized tensor can only be sliced along rows");
  }
  Tensor t = *this;
  t.shape_[axis] = size;
  t.offset_ += start * strides_[axis];
  return t;
}

StatusOr<Tensor> Tensor::Reshape(std::vector<int64_t> shape) const {
  KILN_RETURN_IF_ERROR(CheckShape(dtype_, shape));
  if (Product(shape) != numel()) {
    return InvalidArgument("reshape: ", numel(), " elements cannot take shape [",
                           absl::StrJoin(shape, ","), "]");
  }
  if (!IsContiguous())
    return InvalidArgument("reshape: the tensor is not contiguous; copy it first");
  Tensor t = *this;
  t.strides_ = ContiguousStrides(shape);
  t.shape_ = std::move(shape);
  return t;
}

StatusOr<Tensor> Tensor::Permute(std::vector<int> perm) const {
  if (static_cast<int>(perm.size()) != rank())
    return InvalidArgument("permute: wrong number of axes");
  std::vector<bool> seen(rank(), false);
  Tensor t = *this;
  for (int i = 0; i < rank(); ++i) {
    const int p = perm[i] < 0 ? perm[i] + rank() : perm[i];
    if (p < 0 || p >= rank() || seen[p]) return InvalidArgument("permute: not a permutation");
    seen[p] = true;
    t.shape_[i] = shape_[p];
    t.strides_[i] = strides_[p];
  }
  if (IsQuantized(dtype_) && perm.back() != rank() - 1) {
    return InvalidArgument("permute: a quantized tensor must keep its last axis");
  }
  return t;
}

StatusOr<Tensor> Tensor::Transpose(int a, int b) const {
  std::vector<int> perm(rank());
  for (int i = 0; i < rank(); ++i) perm[i] = i;
  if (a < 0) a += rank();
  if (b < 0) b += rank();
  if (a < 0 || b < 0 || a >= rank() || b >= rank())
    return InvalidArgument("transpose: axis out of range");
  std::swap(perm[a], perm[b]);
  return Permute(perm);
}

StatusOr<Tensor> Tensor::Expand(std::vector<int64_t> shape) const {
  if (shape.size() < shape_.size()) return InvalidArgument("expand: cannot lower the rank");
  if (IsQuantized(dtype_)) return InvalidArgument("expand: cannot broadcast a quantized tensor");
  Tensor t = *this;
  const size_t lead = shape.size() - shape_.size();
  t.strides_.assign(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) continue;
    const int64_t have = shape_[i - lead];
    if (have == shape[i]) {
      t.strides_[i] = strides_[i - lead];
    } else if (have != 1) {
      return InvalidArgument("expand: axis ", i - lead, " has size ", have, ", not 1 or ",
                             shape[i]);
    }
  }
  t.shape_ = std::move(shape);
  return t;
}

TensorArg Tensor::ToArg() const {
  TensorArg a;
  a.data = data();
  a.dtype = dtype_;
  a.rank = rank();
  for (int i = 0; i < rank(); ++i) {
    a.shape[i] = shape_[i];
    a.strides[i] = strides_[i];
  }
  return a;
}

std::string Tensor::DebugString() const {
  if (!defined()) return "<undefined tensor>";
  return absl::StrCat(DTypeName(dtype_), "[", absl::StrJoin(shape_, ","), "] strides=[",
                      absl::StrJoin(strides_, ","), "] offset=", offset_, " on ",
                      ToAbsl(buffer_->device().name()));
}

}  // namespace kiln
