// An embedding model served as a KServe tensor model (kind `embedding`), batched by the
// dynamic batcher. Per batch row:
//   text_input  BYTES [1]   the text (UTF-8, not empty)
//   -> embedding  FP32 [D]   pooled (and normalised where the model says so)
//      token_count INT32 [1] tokens the encoder read ([CLS] and [SEP] included)
//      truncated   BOOL [1]  the text was cut to the model's length; front ends that must not
//                            truncate refuse the request when it is set
//
// Thread-safety: as TensorModel (one Execute at a time per instance).
#pragma once

#include <memory>

#include "config/config.h"
#include "engine/base/status.h"
#include "models/tensor/tensor_model.h"

namespace kiln::models {

class EncoderModel;

// Output names, for front ends.
inline constexpr std::string_view kEmbeddingInput = "text_input";
inline constexpr std::string_view kEmbeddingOutput = "embedding";
inline constexpr std::string_view kEmbeddingTokenCount = "token_count";
inline constexpr std::string_view kEmbeddingTruncated = "truncated";
// The platform string in model metadata; front ends recognise embedding models by it.
inline constexpr std::string_view kEmbeddingPlatform = "kiln_embedding";

// Loads the encoder of a `kind: embedding` entry (EncoderModel::Load) as a tensor model.
StatusOr<std::unique_ptr<TensorModel>> LoadEmbeddingTensorModel(const config::ModelConfig& config);

}  // namespace kiln::models
