#include "models/encoder/embedding_tensor_model.h"

#include <cstring>
#include <string>
#include <vector>

#include "models/encoder/encoder_model.h"
#include "models/tensor/datatype.h"

namespace kiln::models {
namespace {

class EmbeddingTensorModel final : public TensorModel {
 public:
  explicit EmbeddingTensorModel(std::unique_ptr<EncoderModel> model)
      : model_(std::move(model)),
        inputs_{{std::string(kEmbeddingInput), DataType::kBytes, {1}}},
        outputs_{{std::string(kEmbeddingOutput), DataType::kFp32, {model_->info().dimensions}},
                 {std::string(kEmbeddingTokenCount), DataType::kInt32, {1}},
                 {std::string(kEmbeddingTruncated), DataType::kBool, {1}}} {}

  std::string_view platform() const override { return kEmbeddingPlatform; }
  const std::vector<TensorSpec>& inputs() const override { return inputs_; }
  const std::vector<TensorSpec>& outputs() const override { return outputs_; }

  Status CheckRequest(std::span<const HostTensor> in) const override {
    const std::vector<std::string_view> texts = BytesElements(in[0].data);
    for (size_t i = 0; i < texts.size(); ++i) {
      // Execute tokenizes; this only refuses what Tokenize would (no tokenizing twice).
      const Status s = EncoderModel::CheckText(texts[i]);
      if (!s.ok()) return InvalidArgument(kEmbeddingInput, "[", i, "]: ", StatusMessage(s));
    }
    return OkStatus();
  }

  Status Execute(std::span<const HostTensor> in, std::vector<HostTensor>* out) override {
    const std::vector<std::string_view> texts = BytesElements(in[0].data);
    const int64_t rows = static_cast<int64_t>(texts.size());
    std::vector<std::vector<int32_t>> ids;
    ids.reserve(texts.size());
    HostTensor counts{std::string(kEmbeddingTokenCount), DataType::kInt32, {rows, 1}, {}};
    HostTensor truncated{std::string(kEmbeddingTruncated), DataType::kBool, {rows, 1}, {}};
    for (std::string_view text : texts) {
      KILN_ASSIGN_OR_RETURN(EncodedText t, model_->Tokenize(text));
      const int32_t n = static_cast<int32_t>(t.ids.size());
      counts.data.append(reinterpret_cast<const char*>(&n), sizeof(n));
      truncated.data.push_back(t.truncated ? 1 : 0);
      ids.push_back(std::move(t.ids));
    }
    KILN_ASSIGN_OR_RETURN(std::vector<float> vectors, model_->Embed(ids));
    HostTensor embedding{
        std::string(kEmbeddingOutput), DataType::kFp32, {rows, model_->info().dimensions}, {}};
    embedding.data.assign(reinterpret_cast<const char*>(vectors.data()),
                          vectors.size() * sizeof(float));
    out->push_back(std::move(embedding));
    out->push_back(std::move(counts));
    out->push_back(std::move(truncated));
    return OkStatus();
  }

 private:
  std::unique_ptr<EncoderModel> model_;
  std::vector<TensorSpec> inputs_, outputs_;
};

}  // namespace

StatusOr<std::unique_ptr<TensorModel>> LoadEmbeddingTensorModel(const config::ModelConfig& config) {
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<EncoderModel> model, EncoderModel::Load(config));
  return std::unique_ptr<TensorModel>(new EmbeddingTensorModel(std::move(model)));
}

}  // namespace kiln::models
