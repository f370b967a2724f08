// Built-in models for sequence batching (scheduler/sequence_batcher.h).
#include <cstring>

#include "models/tensor/tensor_model.h"

namespace kiln {
namespace {

// Triton's QA model `simple_sequence` (qa/common/gen_qa_sequence_models.py and the example
// repository's model), which the example clients simple_{grpc,http}_sequence_*_client.py
// check against: it is not a true accumulator. Per row, OUTPUT = READY ? INPUT + START : 0,
// so a sequence [0, 11, 7] gives [1, 11, 7]. START and READY are control inputs that the
// sequence batcher fills (sequence_batching.control_input, int32_false_true [0, 1]).
class SimpleSequenceModel final : public TensorModel {
 public:
  SimpleSequenceModel()
      : inputs_{{"INPUT", DataType::kInt32, {1}},
                {"START", DataType::kInt32, {1}},
                {"READY", DataType::kInt32, {1}}},
        outputs_{{"OUTPUT", DataType::kInt32, {1}}} {}

  std::string_view platform() const override { return "kiln_builtin"; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    const HostTensor& input = in[0];
    HostTensor output{"OUTPUT", DataType::kInt32, input.shape,
                      std::string(input.data.size(), '\0')};
    for (size_t i = 0; i + 4 <= input.data.size(); i += 4) {
      int32_t x, start, ready;
      std::memcpy(&x, input.data.data() + i, 4);
      std::memcpy(&start, in[1].data.data() + i, 4);
      std::memcpy(&ready, in[2].data.data() + i, 4);
      // Wrapping add, without signed-overflow UB.
      const int32_t y =
          ready ? static_cast<int32_t>(static_cast<uint32_t>(x) + static_cast<uint32_t>(start)) : 0;
      std::memcpy(output.data.data() + i, &y, 4);
    }
    out->push_back(std::move(output));
    return OkStatus();
  }

 private:
  std::vector<TensorSpec> inputs_, outputs_;
};

}  // namespace

std::unique_ptr<TensorModel> CreateSimpleSequenceModel() {
  return std::make_unique<SimpleSequenceModel>();
}

}  // namespace kiln
