// Writing a model in Hugging Face's layout: the result of full fine-tuning, and
// `kiln export --merge` (a LoRA adapter folded into its base model's weights).
//
// GGUF names map back to the architecture's Hugging Face names (its HfNaming), the q/k rows of
// a `llama` GGUF go back to Hugging Face's order (models/lora/peft_io.h), and config.json is the
// folder's own or, for a GGUF, one made from the hyper-parameters. Weights are written in f32.
//
// Thread-safety: plain functions; a run shares nothing.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "engine/base/status.h"
#include "models/llm/paged_llm.h"
#include "nlohmann/json.hpp"

namespace kiln::models {

struct HfLayout {
  std::map<std::string, std::string> hf_of;  // GGUF name -> Hugging Face name
  bool qk_permuted = false;                  // q/k rows are in llama.cpp's order
  nlohmann::json config;                     // config.json
};

HfLayout MakeHfLayout(const PagedLlmParts& parts);

// Whether WriteHfModel can write this model: Unimplemented (naming the file) for a GGUF of an
// architecture other than `llama`, whose config.json MakeHfLayout cannot make. Callers that
// train before writing check it first.
Status CheckHfWritable(const PagedLlmParts& parts);

// The rows of weight `gguf_name` (f32, `shape`, the model's row order) in Hugging Face's order:
// unchanged except the q/k projections of a `llama` GGUF. ModelRowOrder is the inverse (for
// weights read back from a Hugging Face layout).
std::vector<float> HfRowOrder(const std::string& gguf_name, std::vector<float> v,
                              const std::vector<int64_t>& shape, const LlmHParams& hp,
                              const HfLayout& layout);
std::vector<float> ModelRowOrder(const std::string& gguf_name, std::vector<float> v,
                                 const std::vector<int64_t>& shape, const LlmHParams& hp,
                                 const HfLayout& layout);

// Writes `tensors` (by GGUF name, f32, rows in the model's order) as `out_dir`/model.safetensors
// under Hugging Face names with config.json, plus the tokenizer files of a model folder
// (`model_path`). Errors name a tensor without a Hugging Face name, or the file that failed.
Status WriteHfModel(const std::string& out_dir, const std::string& model_path,
                    const PagedLlmParts& parts, const HfLayout& layout,
                    const std::map<std::string, std::vector<float>>& tensors);

// `kiln export --merge`: W + scale * B A for every layer of the PEFT adapter in `adapter_dir`,
// every other weight as stored (dequantized to f32), written with WriteHfModel. The result
// computes what the base model with the adapter computes.
Status ExportMerged(const std::string& model_path, const std::string& adapter_dir,
                    const std::string& out_dir);

}  // namespace kiln::models
