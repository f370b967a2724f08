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
// architectures use; PEFT module names (q_proj, ..., down_proj; GPT-2's c_attn, c_proj, c_fc)
// map to them per architecture with LoraModules / ResolveLoraModules. Rows of B are stored in the
// order the model computes in: for a llama-variant GGUF that is llama.cpp's permuted q/k row order
// (see peft_io.h, which converts to and from Hugging Face's order at the file boundary).
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
  // PEFT target names of the architecture's modules (LoraModules: q_proj ... down_proj for
  // the llama family, c_attn c_proj c_fc for GPT-2; module paths such as "mlp.c_proj" select
  // one of several of a name) or "all-linear" (every one the architecture has; never the LM
  // head). Resolved per architecture by ResolveLoraModules.
  std::vector<std::string> target_modules = {"all-linear"};

  double scale() const;  // alpha / r, or alpha / sqrt(r) with use_rslora
  // InvalidArgument for r <= 0, alpha <= 0, dropout outside [0, 1), an empty target list or a
  // target no architecture has (naming it and listing the allowed ones). Whether the targets
  // fit a given architecture is ResolveLoraModules's check.
  Status Validate() const;
};

// One linear layer of a transformer block that LoRA can adapt.
struct LoraModule {
  std::string_view name;  // PEFT's target name, the path's last component: "q_proj", "c_proj"
  std::string_view path;  // inside a block, as Hugging Face names it: "self_attn.q_proj",
                          // "attn.c_proj" (GPT-2's c_proj names two modules; this tells them
                          // apart)
  std::string_view gguf;  // the GGUF weight suffix: layer l's weight is "blk.<l>.<gguf>.weight"
};

// The modules of an architecture (LlmHParams::architecture), in canonical order:
//   gpt2:          c_attn (attn.c_attn, attn_qkv: fused q/k/v), c_proj (attn.c_proj,
//                  attn_output), c_fc (mlp.c_fc, ffn_up), c_proj (mlp.c_proj, ffn_down)
//   phi3:          qkv_proj (self_attn.qkv_proj, attn_qkv: fused q/k/v), o_proj
//                  (attn_output), gate_up_proj (mlp.gate_up_proj, ffn_up: fused gate/up),
//                  down_proj (ffn_down)
//   anything else (the llama and Gemma families): q_proj k_proj v_proj (self_attn.*,
//                  attn_q/k/v), o_proj (attn_output), gate_proj up_proj down_proj (mlp.*,
//                  ffn_gate/up/down)
// The list names what the architecture's file could adapt; a model without one of them
// simply has no such weight.
const std::vector<LoraModule>& LoraModules(std::string_view architecture);
// How messages and adapter_config.json name module `m`: its name, or its path where another
// module of the architecture shares the name ("attn.c_proj").
std::string_view LoraModuleLabel(std::string_view architecture, const LoraModule& m);
// The labels of the architecture's modules joined by spaces, for error messages.
std::string LoraModuleList(std::string_view architecture);
// The module of `architecture` whose GGUF suffix is `gguf` ("attn_output"); null if none.
const LoraModule* LoraModuleForGguf(std::string_view architecture, std::string_view gguf);
// Expands `targets` (LoraConfig::target_modules) for `architecture`, in canonical order. A
// target selects the modules whose path it names as PEFT matches names: the path itself, a
// suffix of it at a dot ("c_proj" selects both of GPT-2's, "mlp.c_proj" one), or a longer
// module path ending in it ("model.layers.1.mlp.gate_proj", as PEFT saves "all-linear").
// "all-linear" selects every module. InvalidArgument for an empty list or a target that
// selects nothing, listing what the architecture allows.
StatusOr<std::vector<LoraModule>> ResolveLoraModules(std::string_view architecture,
                                                     const std::vector<std::string>& targets);

// Shorthands for the llama family (LoraModules("llama")), which PEFT files use today
// (models/lora/peft_io.h):
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
