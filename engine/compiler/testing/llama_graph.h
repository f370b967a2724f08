// A Llama-style decoder built with the Builder, as serving runs it: token embedding, per block
// RMSNorm, q/k/v projections, RoPE, paged KV cache writes and paged attention (GQA), output
// projection + residual, RMSNorm, SwiGLU MLP + residual; final norm and LM head. Random
// weights are fine for what it is used for: compiler tests, the fusion/compile benchmarks and
// the AOT kernel set (aot_gen) — structurally it is what a Llama-family model compiles to.
//
// Thread-safety: pure functions.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "engine/builder.h"
#include "engine/tensor.h"

namespace kiln::compiler::testing {

struct LlamaConfig {
  int layers = 2;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 16;
  int64_t ffn = 128;
  int64_t vocab = 256;
  int64_t max_tokens = 64;  // symbol T (tokens in a step)
  int64_t max_seqs = 4;     // symbol S
  int64_t block_size = 16;  // KV cache block size
  int64_t num_blocks = 64;  // KV cache blocks
  int64_t max_blocks_per_seq = 16;
  DType dtype = DType::kF32;         // activations and norms
  DType weight_dtype = DType::kF32;  // projection weights (may be quantized)
  double eps = 1e-5;
  bool lm_head = true;
};

struct LlamaGraph {
  Graph graph;
  Value logits;  // [T, vocab] (or the final hidden state [T, dim] without lm_head)
};

// Inputs: tokens, positions, slot_mapping [T] i32; block_table [S, MB], seq_lens [S],
// query_start [S+1] i32. Weights: token_embd.weight, blk.L.{attn_norm,attn_q,attn_k,attn_v,
// attn_output,ffn_norm,ffn_gate,ffn_up,ffn_down}.weight, output_norm.weight, output.weight.
// States: blk.L.k_cache, blk.L.v_cache.
StatusOr<LlamaGraph> BuildLlama(const LlamaConfig& c);

// Random weights/states for every source of `g` (normal * scale, norms near 1) on `device`.
StatusOr<std::map<std::string, Tensor>> RandomWeights(const Graph& g, backend::Device& device,
                                                      uint64_t seed = 1);

// Step inputs for `seqs` sequences of `new_tokens` new tokens each, after `context` tokens
// already in the cache (decode: new_tokens = 1; prefill: context = 0). Blocks are assigned
// sequentially.
StatusOr<std::map<std::string, Tensor>> StepInputs(const LlamaConfig& c, backend::Device& device,
                                                   int64_t seqs, int64_t new_tokens,
                                                   int64_t context);

}  // namespace kiln::compiler::testing
