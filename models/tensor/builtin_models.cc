#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_join.h"
#include "models/tensor/tensor_model.h"
#include "models/tensor/triton_qa_models.h"

namespace kiln {
namespace {

constexpr std::string_view kPlatform = "kiln_builtin";

class SimpleModel final : public TensorModel {
 public:
  SimpleModel()
      : inputs_{{"INPUT0", DataType::kInt32, {16}}, {"INPUT1", DataType::kInt32, {16}}},
        outputs_{{"OUTPUT0", DataType::kInt32, {16}}, {"OUTPUT1", DataType::kInt32, {16}}} {}

  std::string_view platform() const override { return kPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    const HostTensor& a = in[0];
    const HostTensor& b = in[1];
    const size_t n = a.data.size() / sizeof(int32_t);
    HostTensor sum{"OUTPUT0", DataType::kInt32, a.shape, std::string(a.data.size(), '\0')};
    HostTensor diff{"OUTPUT1", DataType::kInt32, a.shape, std::string(a.data.size(), '\0')};
    for (size_t i = 0; i < n; ++i) {
      int32_t x, y;
      std::memcpy(&x, a.data.data() + 4 * i, 4);
      std::memcpy(&y, b.data.data() + 4 * i, 4);
      // Two's-complement wrap-around, without signed-overflow UB.
      const int32_t s = static_cast<int32_t>(static_cast<uint32_t>(x) + static_cast<uint32_t>(y));
      const int32_t d = static_cast<int32_t>(static_cast<uint32_t>(x) - static_cast<uint32_t>(y));
      std::memcpy(sum.data.data() + 4 * i, &s, 4);
      std::memcpy(diff.data.data() + 4 * i, &d, 4);
    }
    out->push_back(std::move(sum));
    out->push_back(std::move(diff));
    return OkStatus();
  }

 private:
  std::vector<TensorSpec> inputs_, outputs_;
};

class IdentityFp32Model final : public TensorModel {
 public:
  IdentityFp32Model()
      : inputs_{{"INPUT0", DataType::kFp32, {-1}, /*any_rank=*/true}},
        outputs_{{"OUTPUT0", DataType::kFp32, {-1}, /*any_rank=*/true}} {}

  std::string_view platform() const override { return kPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    out->push_back(HostTensor{"OUTPUT0", DataType::kFp32, in[0].shape, in[0].data});
    return OkStatus();
  }

 private:
  std::vector<TensorSpec> inputs_, outputs_;
};

class SleepUsModel final : public TensorModel {
 public:
  static constexpr int32_t kMaxSleepUs = 10'000'000;

  SleepUsModel()
      : inputs_{{"SLEEP_US", DataType::kInt32, {1}}},
        outputs_{{"OUTPUT0", DataType::kInt32, {1}}} {}

  std::string_view platform() const override { return kPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    const std::string& raw = in[0].data;
    int32_t longest = 0;
    for (size_t i = 0; i + 4 <= raw.size(); i += 4) {
      int32_t v;
      std::memcpy(&v, raw.data() + i, 4);
      longest = std::max(longest, std::clamp(v, 0, kMaxSleepUs));
    }
    if (longest > 0) std::this_thread::sleep_for(std::chrono::microseconds(longest));
    out->push_back(HostTensor{"OUTPUT0", DataType::kInt32, in[0].shape, raw});
    return OkStatus();
  }

 private:
  std::vector<TensorSpec> inputs_, outputs_;
};

// Then Triton's QA models (triton_qa_models.h), in TritonQaModelNames' order, and its
// sequence model (sequence_models.cc).
constexpr std::array<std::string_view, 9> kNames = {
    "simple",          "identity_fp32",         "sleep_us",     "simple_string",  "simple_int8",
    "simple_identity", "custom_identity_int32", "repeat_int32", "simple_sequence"};

}  // namespace

std::span<const std::string_view> BuiltinModelNames() { return kNames; }

StatusOr<std::unique_ptr<TensorModel>> CreateBuiltinModel(std::string_view name) {
  if (name == "simple") return std::unique_ptr<TensorModel>(new SimpleModel());
  if (name == "identity_fp32") return std::unique_ptr<TensorModel>(new IdentityFp32Model());
  if (name == "sleep_us") return std::unique_ptr<TensorModel>(new SleepUsModel());
  if (std::ranges::find(TritonQaModelNames(), name) != TritonQaModelNames().end()) {
    return CreateTritonQaModel(name);
  }
  if (name == "simple_sequence") return CreateSimpleSequenceModel();
  std::vector<std::string> names(kNames.begin(), kNames.end());
  return NotFound("unknown built-in model `", ToAbsl(name),
                  "`; built-in models are: ", absl::StrJoin(names, ", "));
}

}  // namespace kiln
