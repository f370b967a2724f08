// The model side of a continuous-batching step (see step_scheduler.h for all four stages):
//   build batch  StepBatchBuilder::Build: the model's StepBatch for a SchedulerOutput;
//   run          the model's Step, whose result reaches output processing as a StepOutput.
//
// The run -> process-outputs boundary is StepOutput. Today the model returns logits and the
// batcher's host sampler picks each sequence's token from its row. A model whose step
// program samples on the device fills `sampled` instead (one token per sequence, with the
// logprobs the sequence asked for); output processing takes those as they are and keeps the
// host sampler as the reference and the fallback.
//
// Thread-safety: none; used by the batcher's loop thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/llm/llm_model.h"
#include "models/sampling/sampler.h"
#include "scheduler/llm/step_scheduler.h"

namespace kiln {

// Lays a SchedulerOutput out as the model's StepBatch: a row per sequence, except that a
// sequence with drafts gets a row per new token (speculative.h), so the batch has
// sched.num_rows rows. Its buffers are reused from step to step, so building allocates only
// when a step is larger than every one before it.
class StepBatchBuilder {
 public:
  // The batch is valid until the next Build. REQUIRES: !sched.empty(); every entry's blocks
  // hold its tokens up to num_computed + num_tokens.
  const models::StepBatch& Build(const SchedulerOutput& sched, int32_t block_size);

  // `n` new tokens of `seq` from position `from` (Sequence::TokenAt: known tokens, then drafts).
  struct Row {
    Sequence* seq;  // read only; not const so that the batcher can keep its rows' state
    int32_t from, n;
  };
  // A batch of these rows, for a draft model (speculative.h): no adapter slots, decode-only
  // when every row has one token. REQUIRES: rows not empty; each row's blocks hold its
  // positions.
  const models::StepBatch& BuildRows(std::span<const Row> rows, int32_t block_size);

 private:
  const models::StepBatch& Lay(std::span<const Row> rows, int32_t block_size, bool adapters,
                               bool decode_only);
  std::vector<Row> rows_;
  std::vector<int32_t> tokens_, positions_, query_start_, seq_lens_, block_table_, slots_,
      adapter_slots_;
  std::vector<const Sequence*> row_seqs_;
  models::StepBatch batch_;
};

// What one model step produced for the S rows of its batch, in batch order.
struct StepOutput {
  // [S, vocab_size] f32 row-major: the logits of each row's last new token. The host
  // sampler uses a row as scratch. Empty when the model sampled.
  std::span<float> logits;
  int32_t vocab_size = 0;
  // [S] the tokens the model sampled itself (with logprobs where asked). Empty when it
  // returned logits.
  std::span<const models::SampledToken> sampled;
  models::StepStats stats;

  bool model_sampled() const { return !sampled.empty(); }
  // Row `i` of the logits. REQUIRES: !model_sampled().
  std::span<float> Logits(int32_t i) const {
    return logits.subspan(static_cast<size_t>(i) * vocab_size, vocab_size);
  }
};

// The next token of `seq`, row `row` of the step: the model's pick when it sampled, else the
// host sampler's from the row's logits (EOS and stop tokens masked before min_tokens; a
// structured-output sequence's tokens masked by seq.allowed, which the batcher prepared).
// `ahead`: the row's place among the sequence's verification rows (speculative.h); the
// tokens of rows before it must have been accepted (SequenceSampler::Accept) first.
models::SampledToken NextToken(const StepOutput& out, int32_t row, Sequence& seq,
                               int32_t ahead = 0);

// The sampling table of a step for a model that samples in its step program: each sequence
// that gets a token this step samples with its own parameters, penalty list, banned end ids
// (before min_tokens) and the next uniform of its own random stream (so its tokens are those
// its host sampler would pick), and a structured-output sequence its mask (seq.allowed, which
// the batcher prepared); a sequence with drafts a row per draft plus one, each as if the
// drafts before it were accepted; a sequence still prefilling its prompt gets a greedy row.
// Its buffers are reused from step to step.
class StepSamplingBuilder {
 public:
  // The table is valid until the next Build. Advances the random streams of the sequences
  // that sample.
  const models::StepSampling& Build(const SchedulerOutput& sched);

 private:
  models::StepSamplingTable table_;
};

}  // namespace kiln
