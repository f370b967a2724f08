#include "scheduler/llm/model_step.h"

#include <algorithm>

namespace kiln {

const models::StepBatch& StepBatchBuilder::Build(const SchedulerOutput& sched, int32_t block_size) {
  rows_.clear();
  for (const auto& [s, n, first] : sched.seqs) {
    if (s->draft.empty()) {
      rows_.push_back({s, s->num_computed, n});
    } else {
      // Verification (speculative.h): the pending token and each draft, a row each.
      for (int32_t k = 0; k < n; ++k) rows_.push_back({s, s->num_computed + k, 1});
    }
  }
  return Lay(rows_, block_size, /*adapters=*/true, sched.decode_only);
}

const models::StepBatch& StepBatchBuilder::BuildRows(std::span<const Row> rows,
                                                     int32_t block_size) {
  const bool decode_only =
      std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.n == 1; });
  return Lay(rows, block_size, /*adapters=*/false, decode_only);
}

const models::StepBatch& StepBatchBuilder::Lay(std::span<const Row> rows, int32_t block_size,
                                               bool adapters, bool decode_only) {
  tokens_.clear();
  positions_.clear();
  slots_.clear();
  query_start_.assign(1, 0);
  seq_lens_.clear();
  adapter_slots_.clear();
  row_seqs_.clear();
  int32_t max_blocks = 0;
  for (const auto& [s, from, n] : rows) {
    for (int32_t pos = from; pos < from + n; ++pos) {
      tokens_.push_back(s->TokenAt(pos));
      positions_.push_back(pos);
      slots_.push_back(s->blocks[pos / block_size] * block_size + pos % block_size);
    }
    query_start_.push_back(query_start_.back() + n);
    seq_lens_.push_back(from + n);
    adapter_slots_.push_back(adapters ? s->adapter_slot : -1);
    row_seqs_.push_back(s);
    max_blocks = std::max(max_blocks, (from + n + block_size - 1) / block_size);
  }
  const size_t n_rows = row_seqs_.size();
  block_table_.assign(n_rows * max_blocks, -1);
  for (size_t i = 0; i < n_rows; ++i) {
    const auto& blocks = row_seqs_[i]->blocks;
    const int32_t used = (seq_lens_[i] + block_size - 1) / block_size;
    std::copy(blocks.begin(), blocks.begin() + used, block_table_.begin() + i * max_blocks);
  }
  batch_ = {tokens_,    positions_, query_start_, seq_lens_,     block_table_,
            max_blocks, slots_,     decode_only,  adapter_slots_};
  return batch_;
}

models::SampledToken NextToken(const StepOutput& out, int32_t row, Sequence& seq, int32_t ahead) {
  if (out.model_sampled()) {
    // Row 0 of a sequence advanced its stream when the table was built; a verification row
    // took the draw `ahead` past it, consumed now.
    if (ahead > 0) seq.sampler.SkipUniform();
    return out.sampled[row];
  }
  return seq.sampler.Sample(
      out.Logits(row), seq.end_ids,
      seq.matcher ? std::span<const uint32_t>(seq.allowed) : std::span<const uint32_t>());
}

const models::StepSampling& StepSamplingBuilder::Build(const SchedulerOutput& sched) {
  table_.Clear();
  for (const auto& [s, n, first] : sched.seqs) {
    // Only a sequence whose known tokens are all computed after this step gets a token.
    if (!s->draft.empty()) {
      // Verification rows: row j samples as if drafts 0..j-1 were accepted.
      for (size_t j = 0; j <= s->draft.size(); ++j) {
        table_.AddSampled(s->sampler, s->end_ids, {}, std::span<const int32_t>(s->draft).first(j));
      }
    } else if (s->uncomputed() == n) {
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
