// Loading a generative model for serving: the entry point kilnd's repository calls for
// `kind: llm` models (scheduler/model.h's LlmLoader).
#pragma once

#include <memory>

#include "config/config.h"
#include "models/llm/llm_model.h"

namespace kiln::models {

// Opens `config.path` (a GGUF file, or a Hugging Face folder with config.json and
// safetensors), picks the architecture from its metadata, loads tokenizer and chat template,
// maps the weights (zero-copy where the dtype allows), and compiles the step program on
// `config.backend` with `config.threads` threads; `config.context_length` (if > 0) caps the
// context. Errors name the file and what is wrong or unsupported (unknown architecture,
// missing or mis-shaped tensors, unsupported tensor types).
StatusOr<std::unique_ptr<LlmModel>> LoadLlm(const config::ModelConfig& config);

}  // namespace kiln::models
