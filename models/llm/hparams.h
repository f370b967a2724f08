// Hyper-parameters of a decoder-only transformer, as the architecture files read them from
// GGUF metadata or a Hugging Face config.json. One struct for every architecture: the
// variants of the llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) and GPT-2 differ
// only in the flags below, not in copies of the model code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/builder.h"

namespace kiln::models {

enum class LlmActivation { kSilu, kGeluTanh, kGeluErf };

struct LlmHParams {
  std::string architecture;    // canonical name: "llama", "mistral", "qwen2", "qwen3", "gpt2"
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

  // Rotary embeddings (llama family); GPT-2 has learned positions instead.
  bool use_rope = true;
  RopeParams rope;

  // Per layer: 0 for full causal attention, else the sliding window in tokens (Mistral,
  // Qwen2 with use_sliding_window). Empty means full attention everywhere.
  std::vector<int64_t> sliding_window;

  bool attn_qkv_bias = false;    // Qwen2; Llama with attention_bias
  bool attn_out_bias = false;    // Llama with attention_bias; GPT-2
  bool mlp_bias = false;         // Llama with mlp_bias; GPT-2
  bool qk_norm = false;          // Qwen3: RMSNorm over each head of q and k before RoPE
  bool tied_embeddings = false;  // the LM head is the token embedding

  int64_t window(int64_t layer) const {
    return layer < static_cast<int64_t>(sliding_window.size()) ? sliding_window[layer] : 0;
  }
};

}  // namespace kiln::models
