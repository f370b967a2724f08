// PEFT's LoRA adapter files, in and out: what Python PEFT (`save_pretrained` /
// `PeftModel.from_pretrained`) reads and writes is what Kiln reads and writes.
//
//   <dir>/adapter_config.json        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, ...}
//   <dir>/adapter_model.safetensors  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
//                                    (r, in) and ...lora_B.weight (out, r); mlp.gate_proj, ...
//                                    GPT-2: base_model.model.transformer.h.3.attn.c_attn.lora_A
//                                    .weight, attn.c_proj, mlp.c_fc, mlp.c_proj
//
// The model's architecture (PeftBaseModel::hparams.architecture) picks the module table
// (LoraModules in lora_config.h). GPT-2's Conv1D layers make PEFT write fan_in_fan_out true;
// that describes the base weights only (lora_A is (r, in), lora_B (out, r) as for Linear), so
// the writer sets it for GPT-2 and the reader accepts it there.
//
//   auto base = PeftBaseModel::FromHParams(hparams, "HuggingFaceTB/SmolLM2-135M-Instruct");
//   KILN_RETURN_IF_ERROR(WritePeftAdapter("/out/adapter", adapter, base));
//   KILN_ASSIGN_OR_RETURN(LoraAdapter back, ReadPeftAdapter("/out/adapter", base));
//
// Row order: llama.cpp's converter permutes the q/k weight rows of `llama` GGUF files so that
// RoPE rotates interleaved pairs; a model loaded from such a file computes in that order, and
// LoraAdapter keeps lora_B of q_proj/k_proj in it (lora_config.h). PEFT files are in Hugging
// Face order, so with `qk_rows_permuted` the writer un-permutes those rows and the reader
// permutes them back (GgufToHfQkRows / HfToGgufQkRows). lora_A and every other module are
// unaffected.
//
// Thread-safety: free functions over plain data.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"
#include "models/llm/hparams.h"
#include "models/lora/lora_config.h"

namespace kiln::models {

// What the adapter files need to know about the model they adapt.
struct PeftBaseModel {
  LlmHParams hparams;  // num_layers, hidden_size, num_heads, num_kv_heads, head_dim, ffn_size
  // The model's q/k weight rows are in llama.cpp's permuted order: a `llama` GGUF file, whose
  // hparams have rope.layout == kInterleaved. False for Hugging Face checkpoints, Qwen2/3 GGUF.
  bool qk_rows_permuted = false;
  std::string name_or_path;  // adapter_config.json's base_model_name_or_path (may be empty)

  // qk_rows_permuted from the RoPE layout, as models/arch/llama.cc sets it.
  static PeftBaseModel FromHParams(const LlmHParams& hparams, std::string name_or_path);
};

// The (in, out) features of a PEFT module's weight in `hp`'s model: q_proj (C, Hq*D), k_proj
// and v_proj (C, Hkv*D), o_proj (Hq*D, C), gate_proj and up_proj (C, F), down_proj (F, C);
// GPT-2: c_attn (C, 3C), attn.c_proj (C, C), c_fc (C, F), mlp.c_proj (F, C). `module` is a
// name or a path of LoraModules(hp.architecture). InvalidArgument for a module the
// architecture lacks, or a name that is several modules' (GPT-2's c_proj).
struct LoraLayerShape {
  int64_t in = 0, out = 0;
};
StatusOr<LoraLayerShape> PeftModuleShape(const LlmHParams& hp, std::string_view module);

// PEFT's tensor name for llama-family module `module` of layer `layer`, `ab` 'A' or 'B':
// "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
std::string PeftTensorName(int64_t layer, std::string_view module, char ab);

// llama.cpp's convert_hf_to_gguf.py `permute(w, n_head, n_head)`:
//   w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).reshape(rows, cols)
// on a row-major (rows, cols) matrix, i.e. within each head the rows of the first half and of
// the second half are interleaved. For k pass n_head = num_kv_heads. REQUIRES: rows is a
// multiple of 2 * n_head and w.size() == rows * cols.
std::vector<float> HfToGgufQkRows(const std::vector<float>& w, int64_t rows, int64_t cols,
                                  int64_t n_head);
// The inverse: GgufToHfQkRows(HfToGgufQkRows(w)) == w.
std::vector<float> GgufToHfQkRows(const std::vector<float>& w, int64_t rows, int64_t cols,
                                  int64_t n_head);

// Creates `dir` if needed and writes adapter_config.json and adapter_model.safetensors (f32)
// into it, each fsync'ed (and `dir` fsync'ed), replacing files of those names. Not atomic as a
// pair: checkpoints (models/train/checkpoint.h) write into a temporary directory and rename.
// InvalidArgument if the config does not validate, or a layer's key, layer index or shapes do
// not fit the base model or the config's rank, naming the layer.
Status WritePeftAdapter(const std::string& dir, const LoraAdapter& adapter,
                        const PeftBaseModel& base);

// Reads an adapter written by WritePeftAdapter or by Python PEFT (tensors in F32, F16, BF16 or
// F64; converted to f32). Layers come back keyed by GGUF weight name with lora_B rows in the
// model's order. Errors name the file and what was expected:
//   NotFound: a missing adapter_config.json or adapter_model.safetensors (a pickled
//     adapter_model.bin is named as such and not read);
//   InvalidArgument: bad JSON, peft_type other than LORA, r or lora_alpha not positive,
//     unknown target modules, a tensor that is not a LoRA weight of a known module, lora_A
//     without lora_B or the reverse, shapes that disagree with r or with the base model
//     ("adapter layer blk.3.attn_q: lora_A is (8, 576) but the model's q_proj takes 512
//     inputs"), a layer index past the model's layers, no tensors at all;
//   Unimplemented: PEFT features Kiln does not apply (DoRA, bias other than "none",
//     rank_pattern/alpha_pattern, modules_to_save, fan_in_fan_out on a model other than
//     GPT-2).
StatusOr<LoraAdapter> ReadPeftAdapter(const std::string& dir, const PeftBaseModel& base);

}  // namespace kiln::models
