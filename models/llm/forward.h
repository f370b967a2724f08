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
// The training forward (the training constructor) runs whole sequences instead: S rows of L tokens
// packed row-major into T = S * L, with
//   tokens [T], positions [T] (restarting at 0 per packed example), doc_ids [T] (the example
//   each token belongs to; attention is causal within an example and never crosses one)
// and no KV cache; the architecture then returns the logits of every token, [T, V]. Linear
// layers built with ForwardContext::Linear get a LoRA branch when the adapter targets their
// weight, and full fine-tuning turns every weight into an f32 State (trainable()).
//
// Errors (a missing tensor, a shape that does not match the hyper-parameters) are recorded:
// the first one is kept, later ones are counted, and the failing call returns an invalid
// Value, which the builder propagates. Check status() after building.
//
// Thread-safety: none (used on one thread while a graph is built).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/builder.h"
#include "models/llm/hparams.h"
#include "models/llm/model_files.h"
#include "models/lora/lora_config.h"

namespace kiln::models {

// The step inputs (graph sources) and their symbols.
struct StepInputs {
  Dim T, S, MB, NB;  // tokens, sequences, blocks per sequence, cache blocks
  Value tokens, positions, slot_mapping, block_table, seq_lens, query_start;
  // Training only: L tokens per row (T = S * L) and each token's example, [T] i32.
  Dim L;
  Value doc_ids;
};

// What the training forward makes trainable.
struct TrainGraphOptions {
  // LoRA: adapted layers get f32 States "<weight stem>.lora_A" (r, in) and ".lora_B"
  // (out, r), e.g. "blk.3.attn_q.lora_A"; base weights stay frozen in their stored dtype.
  const LoraConfig* lora = nullptr;  // not owned; null: no adapter
  // Full fine-tuning: every weight is an f32 State under its own name (master weights).
  bool full = false;
  // LoRA with lora->dropout > 0: an i64 [1] graph input holding the step's
  // LoraDropoutStepSeed (models/lora/lora_dropout.h); each adapted layer's branch input is
  // multiplied by its mask. Invalid: no dropout (evaluation, as PEFT in eval mode).
  Value dropout_seed;
  // Attention as one fused op whose backward is attention_backward (flash-attention style:
  // no [rows, heads, L, L] probabilities kept between forward and backward). Only where the
  // device has a native attention_backward kernel (FusedTrainingAttention, trainer.h);
  // otherwise matmul, mask and softmax whose backward keeps the probabilities.
  bool fused_attention = false;
};

// A trainable tensor of the training graph.
struct TrainableTensor {
  std::string name;  // the State's name
  Value value;
  std::vector<int64_t> shape;
};

class ForwardContext {
 public:
  // A serving step over the paged KV cache.
  ForwardContext(Builder& b, const ModelFiles& files, const LlmHParams& hp, const StepInputs& in,
                 int64_t block_size, DType kv_dtype);
  // The training forward (see the header comment); `in` has T, S, L, tokens, positions and
  // doc_ids.
  ForwardContext(Builder& b, const ModelFiles& files, const LlmHParams& hp, const StepInputs& in,
                 const TrainGraphOptions& train);

  bool training() const { return training_; }
  // Serving with up to `slots` LoRA adapters of rank <= `rank` at once (multi-LoRA): every
  // linear layer LoRA can adapt (LoraModules of the architecture, "all-linear") gets two f32
  // States, "<weight stem>.lora_A" [slots*rank, in] and ".lora_BT" [slots*rank, out] (B
  // transposed, so that slot k's rows k*rank .. k*rank+rank-1 are contiguous), and adds
  //   ((x A^T) * scale) BT,   scale = `lora_scale` [T, slots*rank] f32 (a step input)
  // where the caller fills scale's row of a token with its adapter's LoRA scale in the
  // columns of the adapter's slot and rank, and zeros elsewhere (base-model tokens: all
  // zeros). Zero rows and columns contribute exact zeros. REQUIRES: serving; called before
  // the architecture builds.
  void SetMultiLora(int64_t slots, int64_t rank, Value lora_scale) {
    lora_slots_ = slots;
    lora_rank_ = rank;
    lora_scale_ = lora_scale;
  }
  // Multi-LoRA: the States SetMultiLora's layers got, in creation order.
  struct LoraState {
    std::string stem;  // "blk.3.attn_q": the States are stem + ".lora_A" / ".lora_BT"
    int64_t in = 0, out = 0;
  };
  const std::vector<LoraState>& lora_states() const { return lora_states_; }

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

  // x [..., K] W^T (+ bias) for a weight from Weight(): a projection layer. Training with an
  // adapter that targets the weight adds PEFT's LoRA branch, scale * (x A^T) B^T; serving
  // with SetMultiLora, the per-token branch described there.
  Value Linear(Value x, Value w, Value bias = {});

  // Causal self-attention of layer `layer` of q [T, Hq, D] over k, v [T, Hkv, D] with the
  // modifiers of AttentionFor(layer); returns [T, Hq, D]. Serving: writes k and v into the
  // layer's cache slots (slot_mapping), then attends over each sequence's cached keys.
  // Training: dense attention within each row, masked to the token's own example as well.
  Value Attend(int64_t layer, Value q, Value k, Value v);
  // Layer `layer`'s attention from the hyper-parameters: the scale (attn_scale, else
  // 1/sqrt(head_dim)); mask_mod causal, or a sliding window (window(layer)), and chunked
  // (attention_chunk); score_mod ALiBi (alibi) then soft-capping (attn_softcap).
  AttentionParams AttentionFor(int64_t layer) const;

  // h [T, C] -> [S, C]: the row of each sequence's last new token (query_start[s+1] - 1), so
  // that the final norm and the LM head run on S rows, not T. Training: h itself (every
  // token is scored).
  Value LastTokens(Value h);

  // Token embedding lookup as f32: table [V, C] (any weight dtype) -> [T, C].
  Value Embed(Value table, Value ids);

  // The names of the weights the graph uses (to bind after compiling).
  const std::vector<std::string>& weight_names() const { return weight_names_; }
  // Training: the trainable tensors, in creation order (LoRA A/B pairs, or every weight).
  const std::vector<TrainableTensor>& trainable() const { return trainable_; }
  Status status() const;

 private:
  Value Source(std::string_view name, std::vector<int64_t> shape, bool required);
  Value AttendTrain(int64_t layer, Value q, Value k, Value v);
  void Fail(Status s);

  Builder& b_;
  const ModelFiles& files_;
  const LlmHParams& hp_;
  StepInputs in_;
  int64_t block_size_ = 0;
  DType kv_dtype_ = DType::kF32;
  bool training_ = false;
  TrainGraphOptions train_;
  int64_t lora_slots_ = 0, lora_rank_ = 0;  // serving: SetMultiLora's; 0 = no LoRA
  Value lora_scale_;                        // [T, slots * rank]
  std::vector<LoraState> lora_states_;
  std::vector<std::string> adapted_;          // GGUF weight names the adapter targets
  std::map<int32_t, std::string> weight_of_;  // Value id -> weight name
  std::vector<std::string> weight_names_;
  std::vector<TrainableTensor> trainable_;
  Status status_;
  int more_errors_ = 0;
};

}  // namespace kiln::models
