// Hyper-parameters of a decoder-only transformer, as the architecture files read them from
// GGUF metadata or a Hugging Face config.json. One struct for every architecture: the
// variants of the llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3), the Gemma
// family (Gemma 2, Gemma 3 text) and GPT-2 differ only in the flags below, not in copies of
// the model code.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/builder.h"

namespace kiln::models {

enum class LlmActivation { kSilu, kGeluTanh, kGeluErf };

struct LlmHParams {
  std::string architecture;    // canonical name: "llama", "mistral", "qwen2", "qwen3", "phi3",
                               // "gemma2", "gemma3", "gpt2"
  int64_t vocab_size = 0;      // V: rows of the embedding and of the logits
  int64_t hidden_size = 0;     // C
  int64_t num_layers = 0;      // L
  int64_t num_heads = 0;       // Hq
  int64_t num_kv_heads = 0;    // Hkv (grouped-query attention when < Hq)
  int64_t head_dim = 0;        // D (not always C / Hq: Qwen3 sets it)
  int64_t ffn_size = 0;        // F
  int64_t context_length = 0;  // positions the model was trained for
  double norm_eps = 1e-5;      // RMSNorm / LayerNorm epsilon
  LlmActivation activation = LlmActivation::kSilu;

  // Rotary embeddings (llama and Gemma families); GPT-2 has learned positions instead.
  bool use_rope = true;
  RopeParams rope;
  // Gemma 3: the RoPE of sliding-window layers (its local base frequency) where it differs
  // from `rope`, which the global layers use.
  std::optional<RopeParams> rope_sliding;

  // Per layer: 0 for full causal attention, else the sliding window in tokens (Mistral,
  // Qwen2 with use_sliding_window, Phi-3; Gemma's alternating pattern). Empty means full
  // attention everywhere.
  std::vector<int64_t> sliding_window;
  // Chunked (local) attention: a query sees the keys of its own chunk of this many positions
  // only (causally). 0: off. Set by a model's `attention:` config (mask: chunked).
  int64_t attention_chunk = 0;
  // The attention score scale; 0: 1 / sqrt(head_dim). Gemma: query_pre_attn_scalar^-1/2.
  double attn_scale = 0;
  // Score modifiers (attn:: in engine/expr.h), applied to the scaled scores before the mask:
  // Gemma 2's soft-capping, cap * tanh(s / cap) (0: off), and ALiBi biases (a model's
  // `attention:` config, score: alibi).
  double attn_softcap = 0;
  bool alibi = false;
  // Gemma 2: the logits soft-capped the same way (0: off).
  double final_softcap = 0;

  bool attn_qkv_bias = false;    // Qwen2; Llama with attention_bias
  bool attn_out_bias = false;    // Llama with attention_bias; GPT-2
  bool mlp_bias = false;         // Llama with mlp_bias; GPT-2
  bool qk_norm = false;          // Qwen3: RMSNorm over each head of q and k before RoPE
  bool tied_embeddings = false;  // the LM head is the token embedding
  bool fused_qkv = false;        // Phi-3: one attn_qkv weight, rows q then k then v
  bool fused_gate_up = false;    // Phi-3: ffn_up holds gate rows then up rows (2F)
  // Serving without LoRA: q|k|v and gate|up as one projection each, from the weights
  // concatenated at load (blk.N.attn_qkv.weight, blk.N.ffn_gate_up.weight; PagedLlm).
  bool fuse_projections = false;
  // Gemma: the embedding rows are multiplied by this (sqrt(hidden_size)).
  double embed_scale = 1;
  // Gemma's RMSNorm computes x_hat * (1 + w). Hugging Face checkpoints store w (offset 1);
  // llama.cpp's converter stores 1 + w in GGUF files (offset 0).
  double norm_weight_offset = 0;

  int64_t window(int64_t layer) const {
    return layer < static_cast<int64_t>(sliding_window.size()) ? sliding_window[layer] : 0;
  }
  // The RoPE of layer `layer` (rope_sliding on sliding-window layers where set).
  const RopeParams& rope_for(int64_t layer) const {
    return rope_sliding && window(layer) > 0 ? *rope_sliding : rope;
  }
};

}  // namespace kiln::models
