// LoRA adapters with PEFT's semantics, shared by training (models/train/), checkpoints and
// PEFT files (models/lora/peft_io.h) and, later, serving.
//
// An adapted linear layer y = x W^T (+ bias) becomes
//   y = x W^T (+ bias) + scale * dropout(x) A^T B^T,   A (r, in), B (out, r)
// with scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (PEFT's LoraConfig).
// PEFT initialises A Kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))) and B to
// zeros, so a fresh adapter changes nothing.
//
// Layers are keyed by the model's GGUF weight name ("blk.3.attn_q.weight"), the name the
// architectures use; PEFT module names (q_proj, ..., down_proj) map to them with
// GgufSuffixForPeftModule. Rows of B are stored in the order the model computes in: for a
// llama-variant GGUF that is llama.cpp's permuted q/k row order (see peft_io.h, which converts
// to and from Hugging Face's order at the file boundary).
//
// Thread-safety: plain data.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/base/status.h"

namespace kiln::models {

struct LoraConfig {
  int64_t r = 8;
  double alpha = 16;  // PEFT's lora_alpha
  double dropout = 0;
  bool use_rslora = false;
  // PEFT module names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj) or the single
  // entry "all-linear" (every one of those the architecture has; never the LM head).
  std::vector<std::string> target_modules = {"all-linear"};

  double scale() const;  // alpha / r, or alpha / sqrt(r) with use_rslora
  // InvalidArgument for r <= 0, alpha <= 0, dropout outside [0, 1), an empty or unknown
  // target module name (naming it and listing the allowed ones).
  Status Validate() const;
};

// The PEFT module names in canonical order: q_proj k_proj v_proj o_proj gate_proj up_proj
// down_proj.
const std::vector<std::string_view>& PeftModuleNames();
// The same names joined by spaces, for error messages.
const std::string& PeftModuleNameList();
// "q_proj" -> "attn_q", "o_proj" -> "attn_output", "gate_proj" -> "ffn_gate", ...; empty for
// an unknown name. The GGUF weight of module m in layer l is "blk.<l>.<suffix>.weight".
std::string_view GgufSuffixForPeftModule(std::string_view module);
// The inverse ("attn_q" -> "q_proj"); empty for a weight no PEFT module names.
std::string_view PeftModuleForGgufSuffix(std::string_view suffix);
// Expands "all-linear" and checks every name; the result is in canonical order.
StatusOr<std::vector<std::string>> ResolveTargetModules(const std::vector<std::string>& targets);

// One adapted linear layer; f32, row-major.
struct LoraLayer {
  int64_t in = 0, out = 0;
  std::vector<float> a;  // (r, in): PEFT's lora_A.weight
  std::vector<float> b;  // (out, r): PEFT's lora_B.weight, rows in the model's order
};

struct LoraAdapter {
  LoraConfig config;
  std::map<std::string, LoraLayer> layers;  // by GGUF weight name, "blk.3.attn_q.weight"
};

}  // namespace kiln::models
