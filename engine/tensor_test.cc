#include "engine/tensor.h"

#include <gtest/gtest.h>

#include "engine/testing/devices.h"

namespace kiln {
namespace {

class TensorTest : public ::testing::Test {
 protected:
  std::unique_ptr<backend::Backend> backend_ = kiln::MakeTestBackend("ref");
  backend::Device& dev_ = *backend_->device(0);
  Tensor Iota(std::vector<int64_t> shape, DType t = DType::kF32) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<double>(i);
    return *Tensor::FromDoubles(dev_, t, std::move(shape), v);
  }
};

TEST_F(TensorTest, DenseLayoutAndRoundTrip) {
  Tensor t = Iota({2, 3});
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(t.IsContiguous());
  EXPECT_EQ(t.nbytes(), 24);
  EXPECT_EQ(*t.ToDoubles(), (std::vector<double>{0, 1, 2, 3, 4, 5}));
  EXPECT_NE(t.DebugString().find("f32[2,3]"), std::string::npos);
}

TEST_F(TensorTest, ViewsShareStorageWithoutCopies) {
  Tensor t = Iota({2, 3});
  Tensor tt = *t.Transpose(0, 1);
  EXPECT_EQ(tt.shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_FALSE(tt.IsContiguous());
  EXPECT_EQ(tt.buffer(), t.buffer());
  EXPECT_EQ(*tt.ToDoubles(), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  Tensor s = *t.Slice(1, 1, 2);
  EXPECT_EQ(*s.ToDoubles(), (std::vector<double>{1, 2, 4, 5}));
  EXPECT_EQ(s.offset(), 1);
  Tensor r = *t.Reshape({3, 2});
  EXPECT_EQ(*r.ToDoubles(), (std::vector<double>{0, 1, 2, 3, 4, 5}));
  Tensor row = *Iota({3}).Expand({2, 3});
  EXPECT_EQ(row.strides(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(*row.ToDoubles(), (std::vector<double>{0, 1, 2, 0, 1, 2}));
  // Writes through a view are visible in the original.
  StoreElement(s.data(), DType::kF32, 0, 42.0);
  EXPECT_EQ((*t.ToDoubles())[1], 42.0);
}

// Each refusal names the operation and what was wrong (not just !ok()).
void ExpectError(const Status& s, std::string_view needle) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(ToAbsl(needle)), absl::string_view::npos)
      << "message: " << s.message() << "\nexpected to contain: " << needle;
}

TEST_F(TensorTest, ViewErrors) {
  Tensor t = Iota({2, 3});
  ExpectError(t.Slice(1, 2, 2).status(), "slice: [2, 4) is outside axis 1");
  ExpectError(t.Slice(2, 0, 1).status(), "slice: axis out of range for rank 2");
  ExpectError(t.Reshape({4, 2}).status(), "reshape: 6 elements cannot take shape [4");
  ExpectError(t.Transpose(0, 1)->Reshape({6}).status(), "reshape: the tensor is not contiguous");
  ExpectError(t.Expand({2, 4}).status(), "expand: axis 1 has size 3");
  ExpectError(t.Permute({0, 0}).status(), "permute: not a permutation");
  ExpectError(t.Expand({3}).status(), "expand: cannot lower the rank");
}

TEST_F(TensorTest, QuantizedTensorsViewByRows) {
  std::vector<double> v(2 * 64);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i % 17) - 8;
  Tensor q = *Tensor::FromDoubles(dev_, DType::kQ8_0, {2, 64}, v);
  EXPECT_EQ(q.nbytes(), 2 * 2 * 34);
  Tensor row1 = *q.Slice(0, 1, 1);
  const std::vector<double> back = *row1.ToDoubles();
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(back[i], v[64 + i], 0.04) << i;
  ExpectError(q.Slice(1, 0, 32).status(),
              "slice: a quantized tensor can only be sliced along rows");
  ExpectError(Tensor::Empty(dev_, DType::kQ4_0, {2, 33}).status(), "tensor: a q4_0");
}

}  // namespace
}  // namespace kiln
