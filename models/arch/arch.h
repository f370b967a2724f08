// Generative model architectures: one file each (llama.cc for the llama family, gemma.cc for
// Gemma 2 and 3, gpt2.cc),
// llama.cpp `src/models/` style — read the hyper-parameters, name the tensors, build the
// forward graph of one serving step.
//
// An Architecture is plain data plus three functions. The loader (models/llm/loader.cc)
// looks the model's GGUF `general.architecture` or config.json `model_type` up with
// FindArchitecture, reads the hyper-parameters, indexes Hugging Face tensors with `hf_naming`,
// and calls `build` inside a ForwardContext (models/llm/forward.h).
//
// Adding an architecture: a new file defining a `const Architecture& FooArchitecture()`, an
// entry in arch.cc's table, golden fixtures (scripts/fixtures/make_llm_fixtures.py) and a
// line in docs/models.md.
//
// Thread-safety: Architectures are immutable; every function here is thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "engine/base/status.h"
#include "engine/builder.h"
#include "models/gguf/gguf.h"
#include "models/hf/hf_folder.h"
#include "models/llm/forward.h"
#include "models/llm/hparams.h"
#include "models/llm/model_files.h"

namespace kiln::models {

struct Architecture {
  std::string_view family;  // "llama", "gemma", "gpt2"
  // GGUF general.architecture values and config.json model_type values this family reads;
  // each is also the variant name passed to the readers ("qwen2" turns on q/k/v biases).
  std::vector<std::string_view> gguf_names;
  std::vector<std::string_view> hf_model_types;

  // Hyper-parameters from GGUF metadata (`variant` = general.architecture; keys are
  // "<variant>.block_count", ...) or from config.json (`variant` = model_type). Errors name
  // the file and key.
  StatusOr<LlmHParams> (*from_gguf)(const GgufFile& gguf, std::string_view variant);
  StatusOr<LlmHParams> (*from_hf)(const HfModelConfig& config, std::string_view variant);
  // Hugging Face tensor names -> GGUF names.
  const HfNaming& (*hf_naming)();
  // The forward graph of one step; returns the logits [S, V] (f32). Errors go to the
  // context (missing or mis-shaped tensors) and the builder.
  Value (*build)(ForwardContext& ctx);
};

const Architecture& LlamaArchitecture();
const Architecture& GemmaArchitecture();
const Architecture& Gpt2Architecture();

// Every architecture, in the order the docs list them.
const std::vector<const Architecture*>& Architectures();

// The architecture for a GGUF `general.architecture` (gguf = true) or a config.json
// `model_type`; nullptr if none supports it.
const Architecture* FindArchitecture(std::string_view name, bool gguf);

// "gpt2, llama, mistral, qwen2, qwen3" (the names FindArchitecture accepts for that format).
std::string SupportedArchitectures(bool gguf);

// ---- Helpers for the readers ----
// Optional keys: `fallback` when absent (or null in JSON); InvalidArgument naming the file and
// key when present with the wrong type.
StatusOr<int64_t> HfIntOr(const HfModelConfig& c, const std::string& key, int64_t fallback);
StatusOr<double> HfFloatOr(const HfModelConfig& c, const std::string& key, double fallback);
StatusOr<bool> HfBoolOr(const HfModelConfig& c, const std::string& key, bool fallback);
StatusOr<int64_t> GgufInt(const GgufFile& g, const std::string& key);
StatusOr<int64_t> GgufIntOr(const GgufFile& g, const std::string& key, int64_t fallback);

// The sizes every RMSNorm decoder's GGUF metadata holds under "<variant>.": block_count,
// embedding_length, feed_forward_length, attention.head_count(_kv), context_length,
// attention.layer_norm_rms_epsilon (`default_eps` when absent), attention.key_length (hidden /
// heads when absent; value_length must equal it) and vocab_size (else the rows of
// token_embd.weight). Also sets hp.architecture = variant. Errors name the file and key.
Status DecoderSizesFromGguf(const GgufFile& g, std::string_view variant, float default_eps,
                            LlmHParams& hp);
// The same from config.json: vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads (= heads), intermediate_size, max_position_embeddings
// (`default_context`), rms_norm_eps (1e-6), head_dim (`default_head_dim`; 0: hidden / heads).
Status DecoderSizesFromHf(const HfModelConfig& c, int64_t default_context, int64_t default_head_dim,
                          LlmHParams& hp);

// RoPE from config.json: transformers 5's "rope_parameters" or 4's "rope_theta" +
// "rope_scaling" (default, linear, llama3) and "partial_rotary_factor"; sets hp.rope. With
// `two_ropes.enabled` (Gemma 3) also hp.rope_sliding, the sliding layers' RoPE: rope_parameters
// keyed by layer type ("full_attention", "sliding_attention"), or 4's rope_local_base_freq.
// REQUIRES: hp.head_dim and hp.context_length are set.
struct HfRopeDefaults {
  bool enabled = false;
  double global_theta = 10000, local_theta = 10000;
};
Status RopeFromHf(const HfModelConfig& c, LlmHParams& hp, const HfRopeDefaults& two_ropes = {});
// Per-layer sliding windows (hp.sliding_window): transformers' "layer_types" when present
// (sliding_attention / full_attention, one per layer); else "sliding_window" on every layer
// for Mistral and Phi-3, or Qwen2/3's use_sliding_window from max_window_layers on.
// REQUIRES: hp.num_layers is set.
Status SlidingWindowFromHf(const HfModelConfig& c, std::string_view variant, LlmHParams& hp);

// Replaces the model's attention modifiers with a config's `attention:` section (on every
// layer; fields left empty keep the model's): mask causal / sliding_window (window) / chunked
// (chunk) set sliding_window and attention_chunk; score none / softcap (softcap) / alibi set
// attn_softcap and alibi. REQUIRES: `a` passed config validation.
void ApplyAttentionConfig(const config::AttentionConfig& a, LlmHParams& hp);

// Checks sizes common to every architecture (positive, heads divisible by KV heads, even
// rotary dim, ...). `source` names the file for messages.
Status ValidateHParams(const LlmHParams& hp, std::string_view source);

}  // namespace kiln::models
