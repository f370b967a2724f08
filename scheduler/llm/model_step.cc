#include "scheduler/llm/model_step.h"

#include <algorithm>

namespace kiln {

const models::StepBatch& StepBatchBuilder::Build(const SchedulerOutput& sched, int32_t block_size) {
  tokens_.clear();
  positions_.clear();
  slots_.clear();
  query_start_.assign(1, 0);
  seq_lens_.clear();
  adapter_slots_.clear();
  int32_t max_blocks = 0;
  for (const auto& [s, n, first] : sched.seqs) {
    for (int32_t k = 0; k < n; ++k) {
      const int32_t pos = s->num_computed + k;
      tokens_.push_back(s->tokens[pos]);
      positions_.push_back(pos);
      slots_.push_back(s->blocks[pos / block_size] * block_size + pos % block_size);
    }
    query_start_.push_back(query_start_.back() + n);
    seq_lens_.push_back(s->num_computed + n);
    adapter_slots_.push_back(s->adapter_slot);
    max_blocks = std::max(max_blocks, (s->num_computed + n + block_size - 1) / block_size);
  }
  const size_t S = sched.seqs.size();
  block_table_.assign(S * max_blocks, -1);
  for (size_t i = 0; i < S; ++i) {
    const auto& blocks = sched.seqs[i].seq->blocks;
    const int32_t used = (seq_lens_[i] + block_size - 1) / block_size;
    std::copy(blocks.begin(), blocks.begin() + used, block_table_.begin() + i * max_blocks);
  }
  batch_ = {tokens_,    positions_, query_start_,      seq_lens_,     block_table_,
            max_blocks, slots_,     sched.decode_only, adapter_slots_};
  return batch_;
}

models::SampledToken NextToken(const StepOutput& out, int32_t row, Sequence& seq) {
  if (out.model_sampled()) return out.sampled[row];
  return seq.sampler.Sample(
      out.Logits(row), seq.end_ids,
      seq.matcher ? std::span<const uint32_t>(seq.allowed) : std::span<const uint32_t>());
}

const models::StepSampling& StepSamplingBuilder::Build(const SchedulerOutput& sched) {
  table_.Clear();
  for (const auto& [s, n, first] : sched.seqs) {
    // Only a sequence whose known tokens are all computed after this step gets a token.
    if (s->uncomputed() == n) {
      table_.AddSampled(
          s->sampler, s->end_ids,
          s->matcher ? std::span<const uint32_t>(s->allowed) : std::span<const uint32_t>());
    } else {
      table_.AddIgnored();
    }
  }
  return table_.table();
}

}  // namespace kiln
