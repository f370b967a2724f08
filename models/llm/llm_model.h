// The interface between the continuous batcher (scheduler/llm/) and a generative model: one
// forward step over a batch of sequences whose keys and values live in a paged KV cache.
//
// The batcher owns the *allocation* of KV blocks (which block holds which tokens of which
// sequence); the model owns the KV *memory* (per layer, num_blocks blocks of block_size
// tokens). Each step the batcher says, per new token, which cache slot it goes to
// (slot_mapping) and, per sequence, which blocks hold its context (block_table).
//
// Thread-safety: a model instance is driven by one batcher thread; Step is not reentrant.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/base/status.h"
#include "engine/sampling.h"
#include "models/chat/chat_template.h"
#include "models/lora/lora_config.h"
#include "models/sampling/sampler.h"
#include "models/tokenizer/tokenizer.h"

namespace kiln::models {

struct LlmModelInfo {
  std::string architecture;    // "llama", "qwen2", "gpt2", ...
  std::string name;            // e.g. the GGUF general.name
  int32_t vocab_size = 0;      // rows of the logits
  int32_t context_length = 0;  // positions the model supports
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  // Tokens that end generation by default (EOS, end-of-turn), from the model's metadata.
  std::vector<int32_t> eos_token_ids;
  // The model's own chat template (Jinja), empty if it has none.
  std::string chat_template;
};

// One step, described on the host. S sequences, T new tokens in total.
struct StepBatch {
  std::span<const int32_t> tokens;       // [T] new tokens, sequence by sequence
  std::span<const int32_t> positions;    // [T] position of each new token in its sequence
  std::span<const int32_t> query_start;  // [S+1] new tokens of sequence s: [qs[s], qs[s+1])
  std::span<const int32_t> seq_lens;     // [S] tokens in the cache after this step
  std::span<const int32_t> block_table;  // [S, max_blocks_per_seq] row-major, -1 padded
  int32_t max_blocks_per_seq = 0;
  std::span<const int32_t> slot_mapping;  // [T] block * block_size + offset of each new token
  // True when every sequence has exactly one new token (a decode-only step): the model may
  // replay a captured program padded to a captured batch size.
  bool decode_only = false;
  // [S] the adapter (LoRA) slot of each sequence, -1 = the base model; empty = all -1. A model
  // without adapters refuses any other slot (InvalidArgument).
  std::span<const int32_t> adapter_slots = {};
};

struct StepStats {
  bool replayed = false;    // a captured program ran (graph replay)
  int32_t padded_seqs = 0;  // batch size the step was padded to (== S when not padded)
  int32_t launches = -1;    // kernel launches the step ran (or replayed); -1: not counted
};

class LlmModel {
 public:
  virtual ~LlmModel() = default;

  virtual const LlmModelInfo& info() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  // The model's chat template, parsed; nullptr when the model has none (chat requests are
  // then refused with a clear error).
  virtual const ChatTemplate* chat_template() const { return nullptr; }

  // Bytes of KV cache one block of `block_size` tokens takes, all layers (K and V).
  virtual int64_t KvBytesPerBlock(int32_t block_size) const = 0;
  // Total and free memory of the device the model runs on, its weights loaded: what
  // `kv_cache_bytes: auto` takes a fraction of. Default: Unimplemented (no such figure).
  virtual StatusOr<backend::DeviceMemoryInfo> DeviceMemory() {
    return Unimplemented("the model's device does not report its memory");
  }
  // Allocates the KV cache. Called once, before the first Step. ResourceExhausted if the
  // memory cannot be had.
  virtual Status AllocateKvCache(int32_t num_blocks, int32_t block_size) = 0;

  // Runs the model on the batch: writes the new tokens' keys and values into their slots and
  // fills `logits` [S, vocab_size] (f32, row-major) with the logits of each sequence's last
  // new token. REQUIRES: AllocateKvCache succeeded; every slot and block id is in range.
  virtual Status Step(const StepBatch& batch, std::span<float> logits, StepStats* stats) = 0;

  // Whether StepAndSample works: the model's step program ends in a sampling stage, so only
  // token ids and the asked-for logprobs cross to the host. Default: no.
  virtual bool samples_on_device() const { return false; }
  // Runs the step like Step, then samples each sequence's next token in the step program:
  // `sampled` [S] gets the token and, where the row's params ask (logprobs >= 0), its logprob
  // and the top alternatives of the raw distribution — what SequenceSampler::Sample gives for
  // the same row, parameters and uniform. REQUIRES: samples_on_device(); as Step.
  virtual Status StepAndSample(const StepBatch& batch, const StepSampling& sampling,
                               std::span<SampledToken> sampled, StepStats* stats) {
    (void)batch, (void)sampling, (void)sampled, (void)stats;
    return Unimplemented("this model does not sample in its step program");
  }

  // ---- LoRA adapters (multi-LoRA serving). Defaults: a model without adapter slots. ----
  // Adapter slots a step can use at once (StepBatch::adapter_slots in [0, max_adapters()));
  // 0: none, and every slot but -1 is refused.
  virtual int32_t max_adapters() const { return 0; }
  // Whether `adapter` fits the model: every layer exists and is one LoRA can adapt, its in
  // and out features match, its rank is within the model's limit. InvalidArgument naming the
  // layer, the shapes or the limit; FailedPrecondition for a model without adapter slots.
  virtual Status CheckAdapter(const LoraAdapter& adapter) const {
    (void)adapter;
    return FailedPrecondition("this model serves no LoRA adapters");
  }
  // Reads a PEFT adapter folder (models/lora/peft_io.h) for this model, then CheckAdapter.
  // Errors name the folder. Thread-safe (reads only what never changes).
  virtual StatusOr<std::shared_ptr<const LoraAdapter>> ReadAdapter(const std::string& dir) const {
    (void)dir;
    return FailedPrecondition("this model serves no LoRA adapters");
  }
  // Puts `adapter` (which passed CheckAdapter) into `slot`, replacing what was there; null
  // empties the slot. Steps after it see the new weights. REQUIRES: 0 <= slot <
  // max_adapters(); called between steps on the thread that steps.
  virtual Status LoadAdapter(int32_t slot, std::shared_ptr<const LoraAdapter> adapter) {
    (void)slot, (void)adapter;
    return FailedPrecondition("this model serves no LoRA adapters");
  }
};

}  // namespace kiln::models
