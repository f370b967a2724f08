// PagedLlm: the LlmModel every architecture runs as — one compiled step program over a paged
// KV cache, plus captured programs for padded decode steps.
//
// The step graph is built once (by the architecture's `build`, see models/arch/arch.h) with
// symbols T (tokens in the step, <= max(max_num_batched_tokens, largest capture size)),
// S (sequences, <= max_num_seqs), MB (blocks per sequence, <= ceil(context / block_size))
// and NB (cache blocks), compiled for the device, and its weights bound once (zero-copy from
// the file mapping where possible). The memory planner sizes the arena at those bounds; the
// LM head runs on S rows only (the last token of each sequence), so no T x vocab buffer
// exists.
//
// KV cache: per layer a K and a V State tensor [NB, block_size, Hkv, D] of `kv_dtype`,
// allocated by AllocateKvCache with one extra *scratch* block (index num_blocks) that only
// padding rows of captured steps write to and read from.
//
// Sampling stage: with options.sample_on_device and a device that has the sample kernel, the
// program also ends in engine's sample op over the logits, fed per step with each sequence's
// parameters, uniform, penalty list (symbol P <= context_length) and banned tokens (symbol
// E <= kMaxBannedTokens); StepAndSample reads back only tokens and asked-for logprobs. Step
// still returns logits (its sampling rows are greedy and discarded).
//
// LoRA (options.max_adapters K > 0): every linear layer LoRA can adapt gets K slots of rank R
// (ForwardContext::SetMultiLora), f32 States zeroed at creation, and the program one more
// step input, lora_scale [T, K*R] f32, built on the host from StepBatch::adapter_slots and the
// rank and scale of the adapter in each slot. LoadAdapter writes an adapter's A and B^T into
// its slot's rows (zeros for the modules and ranks it lacks), so a sequence's result does not
// depend on which adapters share its step. Memory: K*R*(in+out)*4 bytes per adapted layer.
// A second program without the LoRA branch runs the steps in which no sequence has an adapter
// (its own captures, its own arena), so base-model traffic costs no LoRA compute.
//
// Graph capture: a decode-only step (every sequence one new token) with S <= the largest
// capture size <= max_num_seqs is padded to the next capture size P (token 0 at position 0,
// its slot in the scratch block, seq_len 1), and a CapturedProgram recorded for P (on first
// use) is replayed with the step's data copied into its static input buffers. On a host
// (cpu) device, where a padded row costs as much as a real one, only P == S is replayed.
// Other steps run the program directly. StepStats reports which, and P.
//
// Thread-safety: as LlmModel (one batcher thread drives it; Step is not reentrant).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "engine/backend/backend.h"
#include "engine/base/metrics.h"
#include "engine/builder.h"
#include "engine/capture.h"
#include "engine/program.h"
#include "models/arch/arch.h"
#include "models/chat/chat_template.h"
#include "models/llm/forward.h"
#include "models/llm/hparams.h"
#include "models/llm/llm_model.h"
#include "models/llm/model_files.h"
#include "models/lora/lora_config.h"
#include "models/tokenizer/tokenizer.h"

namespace kiln::models {

struct PagedLlmOptions {
  int32_t max_num_seqs = 64;             // S bound
  int32_t max_num_batched_tokens = 128;  // T bound
  int32_t block_size = 16;               // tokens per KV block the program is compiled for
  // Decode batch sizes to capture; sizes above max_num_seqs are ignored.
  std::vector<int> capture_batch_sizes;
  DType kv_dtype = DType::kF32;  // f32, f16 or bf16
  // End the step program in a sampling stage (engine's sample op) when the device has the
  // kernel, so StepAndSample returns token ids instead of logits (config: `sampling: device`).
  bool sample_on_device = true;
  metrics::Registry* metrics = nullptr;  // compile metrics go here; not owned; may be null
  // Multi-LoRA: adapter slots the step program holds (K; 0 = none: no LoRA in the graph) and
  // the largest rank a slot takes (R). See "LoRA" above.
  int32_t max_adapters = 0;
  int32_t max_lora_rank = 16;
  // An adapter applied to every sequence whose adapter slot is -1 (kiln generate --adapter;
  // PEFT's semantics, rows in the model's order, see models/lora/peft_io.h); null: none. It
  // is slot 0 of the same mechanism, on a program with max(max_adapters, 1) slots and a rank
  // of at least its own; max_adapters() then reports 0 (no slot is left to a batcher).
  std::shared_ptr<const LoraAdapter> adapter;
};

// Everything a PagedLlm is made of, loaded by models/llm/loader.cc.
struct PagedLlmParts {
  std::shared_ptr<const ModelFiles> files;
  const Architecture* arch = nullptr;
  LlmHParams hparams;
  LlmModelInfo info;  // context_length already capped
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatTemplate> chat_template;  // may be null
  // The device, and the backend that owns it when the model has its own (a cpu backend
  // with the configured thread count); null when the device belongs to the registry.
  std::unique_ptr<backend::Backend> backend;
  backend::Device* device = nullptr;
  // FuseProjections joined the projections: the programs without LoRA read them so.
  bool fused_projections = false;
};

// For the step programs without LoRA: joins each layer's q|k|v and gate|up weights into one
// (blk.N.attn_qkv.weight, blk.N.ffn_gate_up.weight; ModelFiles::AddConcatenatedRows) where
// the architecture can read them so (llama family, no biases, one stored type per layer's
// group). A decode step then runs two longer GEMVs per layer instead of five, and longer ones
// read memory faster (docs/performance.md). Programs with LoRA keep the separate weights
// (adapters name them). Sets parts.fused_projections; KILN_FUSE_PROJECTIONS=0 turns it off.
// REQUIRES: nothing else holds parts.files yet (it is changed).
Status FuseProjections(PagedLlmParts& parts);

class PagedLlm final : public LlmModel {
 public:
  // Builds the step graph, compiles it and binds the weights. Errors: the architecture's
  // (missing or mis-shaped tensors, unsupported types) and the compiler's.
  static StatusOr<std::unique_ptr<PagedLlm>> Create(PagedLlmParts parts,
                                                    const PagedLlmOptions& options);
  ~PagedLlm() override;

  const LlmModelInfo& info() const override { return parts_.info; }
  const Tokenizer& tokenizer() const override { return *parts_.tokenizer; }
  const ChatTemplate* chat_template() const override { return parts_.chat_template.get(); }
  int64_t KvBytesPerBlock(int32_t block_size) const override;
  // The device's MemoryInfo; Unimplemented on host memory (cpu, ref), whose free figure
  // ignores container limits.
  StatusOr<backend::DeviceMemoryInfo> DeviceMemory() override;
  // A block_size other than options.block_size rebuilds and recompiles the program.
  Status AllocateKvCache(int32_t num_blocks, int32_t block_size) override;
  Status Step(const StepBatch& batch, std::span<float> logits, StepStats* stats) override;
  bool samples_on_device() const override { return sample_stage_; }
  Status StepAndSample(const StepBatch& batch, const StepSampling& sampling,
                       std::span<SampledToken> sampled, StepStats* stats) override;
  int32_t max_adapters() const override { return options_.adapter ? 0 : options_.max_adapters; }
  int32_t max_lora_rank() const { return lora_rank_; }
  Status CheckAdapter(const LoraAdapter& adapter) const override;
  StatusOr<std::shared_ptr<const LoraAdapter>> ReadAdapter(const std::string& dir) const override;
  Status LoadAdapter(int32_t slot, std::shared_ptr<const LoraAdapter> adapter) override;

  // Banned tokens per sequence a sampling step takes (EOS ids + up to 64 stop token ids).
  static constexpr int32_t kMaxBannedTokens = 128;

  // ---- Introspection (tools, tests, metrics) ----
  const LlmHParams& hparams() const { return parts_.hparams; }
  const Program& program() const { return *program_; }
  backend::Device& device() const { return *parts_.device; }
  // Bytes of the bound weights (as loaded; a joined projection that is a view of its parts
  // counts once) and how many of them point into the file mapping.
  int64_t weight_bytes() const { return weight_bytes_; }
  int64_t mapped_weight_bytes() const { return mapped_weight_bytes_; }
  // The programs without LoRA read joined q|k|v and gate|up weights (FuseProjections).
  bool fused_projections() const { return parts_.fused_projections; }
  // The capture sizes in use (ascending) and how many captures were recorded so far.
  const std::vector<int32_t>& capture_sizes() const { return capture_sizes_; }
  int num_captured() const { return static_cast<int>(captures_.size()); }

 private:
  // Device buffers for the step inputs, sized for `tokens` tokens and `seqs` sequences.
  struct StepBuffers {
    std::shared_ptr<backend::Buffer> tokens, positions, slots, block_table, seq_lens, query_start;
    // The sampling stage's inputs (when the program has one), for P and E penalty/ban columns.
    std::shared_ptr<backend::Buffer> params, uniforms, penalty_tokens, penalty_counts, banned,
        penalty_bias;
    std::shared_ptr<backend::Buffer> allowed;     // [seqs, AllowedWords(vocab)]: grammar masks
    std::shared_ptr<backend::Buffer> lora_scale;  // [tokens, K*R] f32 (when K > 0)
  };
  // Where a step's results go: logits (Step) or sampled tokens (StepAndSample).
  struct StepResult {
    std::span<float> logits;
    const StepSampling* sampling = nullptr;
    std::span<SampledToken> sampled;
  };
  struct Capture;

  PagedLlm(PagedLlmParts parts, const PagedLlmOptions& options);
  Status Build(int32_t block_size);

  // Validates the batch against what the program was compiled for.
  Status CheckBatch(const StepBatch& batch) const;
  Status RunStep(const StepBatch& batch, const StepResult& result, StepStats* stats);
  Status LoadWeights(const std::vector<std::string>& names);
  // Allocates (zeroed) the LoRA States the program uses that do not exist yet.
  Status AllocateLoraStates(const std::vector<ForwardContext::LoraState>& states);
  // h_lora_scale_ [rows, K*R] for the first S sequences of `batch` (rows past them: zeros).
  void StageLoraScale(const StepBatch& batch, int32_t rows);
  // Sampling columns (P, E) 0: buffers for captures, which sample without penalties or bans.
  StatusOr<StepBuffers> AllocateStepBuffers(int64_t tokens, int64_t seqs, int64_t penalty_cols,
                                            int64_t banned_cols);
  // Binds T/S/MB (and P/E) and the buffers to the program.
  Status BindStep(const StepBuffers& buf, int32_t T, int32_t S, int32_t MB, int32_t P, int32_t E);
  // Uploads the host arrays into `buf`.
  Status Upload(const StepBuffers& buf, int32_t S, int32_t MB);
  // Lays out the sampling stage's inputs for `rows` rows (real ones from `sampling`, or greedy
  // rows without it) in the host staging arrays; returns P and E.
  std::pair<int32_t, int32_t> StageSampling(const StepSampling* sampling, int32_t S, int32_t rows);
  Status UploadSampling(const StepBuffers& buf, int32_t rows, int32_t P, int32_t E);
  Status RunDirect(const StepBatch& batch, const StepResult& result, StepStats* stats);
  Status RunCaptured(const StepBatch& batch, int32_t padded, const StepResult& result,
                     StepStats* stats);
  // Copies the step's results (logits or sampled tokens) of the first `rows` rows out of the
  // program's outputs `outs` (logits, then token, logprob, top ids, top logprobs).
  Status ReadResult(const std::vector<Tensor>& outs, int32_t rows, const StepResult& result);

  PagedLlmParts parts_;
  PagedLlmOptions options_;
  int32_t block_size_ = 0;  // what the program is compiled for
  int64_t t_max_ = 0, s_max_ = 0, mb_max_ = 0;
  std::vector<int32_t> capture_sizes_;

  std::unique_ptr<Program> program_;       // with the LoRA branch when lora_slots_ > 0
  std::unique_ptr<Program> base_program_;  // without it (lora_slots_ > 0 only), for steps
                                           // without adapter rows
  Program* run_ = nullptr;                 // the program of the step being run
  std::vector<Program*> programs() const {
    std::vector<Program*> p = {program_.get()};
    if (base_program_) p.push_back(base_program_.get());
    return p;
  }
  bool sample_stage_ = false;  // the program ends in the sample op
  int64_t p_max_ = 0;          // penalty columns the sampling stage was compiled for
  std::unique_ptr<backend::Stream> stream_;
  std::map<std::string, Tensor> weights_;  // by GGUF name, loaded once
  int64_t weight_bytes_ = 0, mapped_weight_bytes_ = 0;

  int32_t num_blocks_ = 0;  // allocated (without the scratch block); 0 before AllocateKvCache
  std::vector<Tensor> k_cache_, v_cache_;

  StepBuffers direct_;
  // Host staging for the inputs of one step (padded rows included).
  std::vector<int32_t> h_tokens_, h_positions_, h_slots_, h_block_table_, h_seq_lens_,
      h_query_start_;
  std::vector<float> h_params_;  // [rows, sampling::kNumParams]
  std::vector<double> h_uniforms_;
  std::vector<int32_t> h_penalty_tokens_, h_penalty_counts_, h_banned_;
  std::vector<float> h_penalty_bias_;
  std::vector<uint32_t> h_allowed_;  // [rows, AllowedWords(vocab)]
  bool step_constrained_ = false;    // some row of this step has a grammar mask
  // Step buffers whose allowed-token masks are all ones (nothing to upload for them).
  absl::flat_hash_set<const backend::Buffer*> allowed_all_ones_;
  std::vector<int32_t> h_token_, h_top_ids_;  // results read back
  std::vector<float> h_logprob_, h_top_logprobs_;
  // By padded size; negative: of base_program_.
  std::map<int32_t, std::unique_ptr<Capture>> captures_;

  // LoRA (see the file comment): slots K and rank R of the program (0: none), the States by
  // name, and each slot's adapter (null: empty), rank and scale.
  int32_t lora_slots_ = 0, lora_rank_ = 0;
  std::map<std::string, Tensor> lora_;
  std::vector<std::shared_ptr<const LoraAdapter>> slot_adapter_;
  std::vector<float> h_lora_scale_;
};

// The sampling stage over `logits` [S, vocab]: the engine's sample op and its inputs
// (sample.params, .uniforms, .penalty_tokens/.penalty_counts/.penalty_bias [S, P],
// .banned [S, E], .allowed [S, AllowedWords(vocab)]).
SampleOutputs AddSamplingStage(Builder& b, Value logits, Dim S, Dim P, Dim E, int64_t vocab);

// OK when `device` has a kernel for the sampling stage; Unimplemented with the device's reason
// when it has none or declines it (cuda: the host samples faster; a device without f64). Asks
// the device for that one kernel, compiling nothing else.
Status HasSamplingKernel(backend::Device& device, int64_t vocab);

}  // namespace kiln::models
