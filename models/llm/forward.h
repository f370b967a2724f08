// What an architecture's graph builder works with: the step's inputs (symbolic in T tokens
// and S sequences), the model's weights by GGUF name with their expected shapes, and the two
// pieces every architecture shares — paged self-attention over the KV cache and the
// last-token gather before the LM head.
//
// The step graph (all i32 inputs; see models/llm/llm_model.h for their meaning):
//   tokens [T], positions [T], slot_mapping [T], block_table [S, MB], seq_lens [S],
//   query_start [S+1]
// and per layer two State tensors, "blk.<l>.k_cache" / "blk.<l>.v_cache"
// [NB, block_size, Hkv, D] (NB, the number of cache blocks, is a symbol bound once the cache
// is allocated). The architecture returns the logits [S, V] (f32).
//
// Errors (a missing tensor, a shape that does not match the hyper-parameters) are recorded:
// the first one is kept, later ones are counted, and the failing call returns an invalid
// Value, which the builder propagates. Check status() after building.
//
// Thread-safety: none (used on one thread while a graph is built).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/builder.h"
#include "models/llm/hparams.h"
#include "models/llm/model_files.h"

namespace kiln::models {

// The step inputs (graph sources) and their symbols.
struct StepInputs {
  Dim T, S, MB, NB;  // tokens, sequences, blocks per sequence, cache blocks
  Value tokens, positions, slot_mapping, block_table, seq_lens, query_start;
};

class ForwardContext {
 public:
  ForwardContext(Builder& b, const ModelFiles& files, const LlmHParams& hp, const StepInputs& in,
                 int64_t block_size, DType kv_dtype);

  Builder& b() { return b_; }
  const LlmHParams& hp() const { return hp_; }
  const StepInputs& in() const { return in_; }

  // The weight `name` (GGUF naming) as a Weight source of the shape the hyper-parameters
  // require (outermost first, e.g. {N, K} for a Linear). Records "missing tensor" or "shape
  // mismatch" (naming the tensor, the expected and the stored shape) and returns an invalid
  // Value on failure. Names are not affected by the builder's name scope.
  Value Weight(std::string_view name, std::vector<int64_t> shape);
  // Like Weight, but an absent tensor gives an invalid Value and no error.
  Value OptionalWeight(std::string_view name, std::vector<int64_t> shape);
  bool HasWeight(std::string_view name) const { return files_.Find(name) != nullptr; }

  // Paged causal self-attention of layer `layer`: writes k, v [T, Hkv, D] into the layer's
  // cache slots (slot_mapping), then attends q [T, Hq, D] over each sequence's cached keys
  // (causal, or a sliding window when hp().window(layer) > 0). Returns [T, Hq, D].
  Value Attend(int64_t layer, Value q, Value k, Value v);

  // h [T, C] -> [S, C]: the row of each sequence's last new token (query_start[s+1] - 1), so
  // that the final norm and the LM head run on S rows, not T.
  Value LastTokens(Value h);

  // Token embedding lookup as f32: table [V, C] (any weight dtype) -> [T, C].
  Value Embed(Value table, Value ids);

  // The names of the weights the graph uses (to bind after compiling).
  const std::vector<std::string>& weight_names() const { return weight_names_; }
  Status status() const;

 private:
  Value Source(std::string_view name, std::vector<int64_t> shape, bool required);
  void Fail(Status s);

  Builder& b_;
  const ModelFiles& files_;
  const LlmHParams& hp_;
  StepInputs in_;
  int64_t block_size_;
  DType kv_dtype_;
  std::vector<std::string> weight_names_;
  Status status_;
  int more_errors_ = 0;
};

}  // namespace kiln::models
