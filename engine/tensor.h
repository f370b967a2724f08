// Tensor: a typed, shaped, strided view of device memory.
//
// A Tensor shares ownership of its Buffer; views (Slice, Reshape, Permute, Transpose,
// Expand) make new Tensors over the same storage without copying. Shapes here are concrete;
// graphs use symbolic shapes (graph.h) and Programs hand out Tensors for their outputs.
//
// Strides and the offset are in elements. Block-quantized tensors may only be viewed along
// whole rows (their last axis stays contiguous and block-aligned).
//
// Thread-safety: a Tensor is a value (cheap to copy); the memory behind it is not
// synchronized.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/backend/kernel_abi.h"

namespace kiln {

class Tensor {
 public:
  Tensor() = default;

  // A new dense row-major tensor on `device` (uninitialized).
  static StatusOr<Tensor> Empty(backend::Device& device, DType dtype, std::vector<int64_t> shape);
  // A dense tensor over `buffer` starting at `offset_bytes`. REQUIRES the bytes fit.
  static StatusOr<Tensor> FromBuffer(std::shared_ptr<backend::Buffer> buffer, size_t offset_bytes,
                                     DType dtype, std::vector<int64_t> shape);
  // A dense tensor with the given strided layout (used by Programs for their outputs).
  static StatusOr<Tensor> FromParts(std::shared_ptr<backend::Buffer> buffer, DType dtype,
                                    std::vector<int64_t> shape, std::vector<int64_t> strides,
                                    int64_t offset_elems);

  // Host convenience for host-visible devices (tests, tools, loaders): converts from/to
  // doubles with the dtype's rounding. FailedPrecondition on other devices.
  static StatusOr<Tensor> FromDoubles(backend::Device& device, DType dtype,
                                      std::vector<int64_t> shape, std::span<const double> values);
  StatusOr<std::vector<double>> ToDoubles() const;

  bool defined() const { return buffer_ != nullptr; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t offset() const { return offset_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const;
  // Bytes of the elements (dense size), not of the buffer.
  int64_t nbytes() const { return DTypeBytes(dtype_, numel()); }
  bool IsContiguous() const;
  const std::shared_ptr<backend::Buffer>& buffer() const { return buffer_; }
  // The device address of element (0, ..., 0).
  void* data() const;

  // Views. Errors (InvalidArgument) say which axis or size is out of range.
  StatusOr<Tensor> Slice(int axis, int64_t start, int64_t size) const;
  StatusOr<Tensor> Reshape(std::vector<int64_t> shape) const;  // REQUIRES contiguous
  StatusOr<Tensor> Permute(std::vector<int> perm) const;
  StatusOr<Tensor> Transpose(int a, int b) const;
  StatusOr<Tensor> Expand(std::vector<int64_t> shape) const;

  TensorArg ToArg() const;
  // "f32[2,3] strides=[3,1] offset=0 on ref:0"
  std::string DebugString() const;

 private:
  std::shared_ptr<backend::Buffer> buffer_;
  DType dtype_ = DType::kInvalid;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  int64_t offset_ = 0;
};

// Row-major strides of `shape`.
std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape);

}  // namespace kiln
