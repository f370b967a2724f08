// Test-only: runs prompts greedily through LlmModel::Step directly — no sampler, no batcher —
// so golden tests see the logits of every step. All prompts are prefilled together (in chunks
// of at most `max_step_tokens` tokens, a chunk may end inside a prompt), then decoded together
// one token per sequence per step (decode-only steps, which the model may replay from a
// captured program). Each sequence owns a fixed range of KV blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/base/status.h"
#include "models/llm/llm_model.h"

namespace kiln::models::testing {

struct GreedyOptions {
  int32_t max_new_tokens = 16;
  std::vector<int32_t> stop_ids;  // a sequence ends after emitting one of these
  int32_t block_size = 16;
  int32_t max_step_tokens = 512;
  // Called with each sequence's logits at each generation step (step 0: after its prompt).
  std::function<void(size_t seq, int32_t step, std::span<const float> logits)> on_logits;
};

struct GreedyResult {
  std::vector<std::vector<int32_t>> generated;  // per prompt
  int32_t steps = 0, replayed_steps = 0;
};

inline StatusOr<GreedyResult> RunGreedy(LlmModel& model,
                                        const std::vector<std::vector<int32_t>>& prompts,
                                        const GreedyOptions& opt) {
  const int32_t bs = opt.block_size, V = model.info().vocab_size;
  const size_t n = prompts.size();
  int32_t longest = 0;
  for (const auto& p : prompts)
    longest = std::max<int32_t>(longest, static_cast<int32_t>(p.size()));
  const int32_t per_seq = (longest + opt.max_new_tokens + bs - 1) / bs;
  KILN_RETURN_IF_ERROR(model.AllocateKvCache(static_cast<int32_t>(n) * per_seq, bs));

  struct Seq {
    std::vector<int32_t> tokens;
    int32_t computed = 0, prompt_len = 0;
    bool done = false;
  };
  std::vector<Seq> seqs(n);
  for (size_t i = 0; i < n; ++i) {
    seqs[i].tokens = prompts[i];
    seqs[i].prompt_len = static_cast<int32_t>(prompts[i].size());
  }
  GreedyResult result;
  result.generated.resize(n);
  std::vector<float> logits;
  while (true) {
    // Schedule: every unfinished sequence with known-but-uncomputed tokens, under the budget.
    std::vector<int32_t> tokens, positions, qs{0}, lens, table, slots;
    std::vector<size_t> who;
    int32_t budget = opt.max_step_tokens;
    bool decode_only = true;
    for (size_t i = 0; i < n && budget > 0; ++i) {
      Seq& s = seqs[i];
      if (s.done) continue;
      const int32_t todo =
          std::min<int32_t>(static_cast<int32_t>(s.tokens.size()) - s.computed, budget);
      for (int32_t k = 0; k < todo; ++k) {
        const int32_t pos = s.computed + k;
        tokens.push_back(s.tokens[pos]);
        positions.push_back(pos);
        slots.push_back((static_cast<int32_t>(i) * per_seq + pos / bs) * bs + pos % bs);
      }
      budget -= todo;
      decode_only = decode_only && todo == 1;
      qs.push_back(qs.back() + todo);
      lens.push_back(s.computed + todo);
      who.push_back(i);
    }
    if (who.empty()) break;
    const int32_t S = static_cast<int32_t>(who.size());
    int32_t mb = 0;
    for (int32_t l : lens) mb = std::max(mb, (l + bs - 1) / bs);
    table.assign(static_cast<size_t>(S) * mb, -1);
    for (int32_t j = 0; j < S; ++j) {
      for (int32_t b = 0; b < (lens[j] + bs - 1) / bs; ++b) {
        table[static_cast<size_t>(j) * mb + b] = static_cast<int32_t>(who[j]) * per_seq + b;
      }
    }
    StepBatch batch{tokens, positions, qs, lens, table, mb, slots, decode_only};
    logits.assign(static_cast<size_t>(S) * V, 0.0f);
    StepStats stats;
    KILN_RETURN_IF_ERROR(model.Step(batch, logits, &stats));
    ++result.steps;
    if (stats.replayed) ++result.replayed_steps;
    for (int32_t j = 0; j < S; ++j) {
      Seq& s = seqs[who[j]];
      s.computed = lens[j];
      if (s.computed < static_cast<int32_t>(s.tokens.size())) continue;  // prompt chunk
      const std::span<const float> row(logits.data() + static_cast<size_t>(j) * V, V);
      const int32_t step = static_cast<int32_t>(s.tokens.size()) - s.prompt_len;
      if (opt.on_logits) opt.on_logits(who[j], step, row);
      const int32_t next =
          static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
      s.tokens.push_back(next);
      result.generated[who[j]].push_back(next);
      const bool stop =
          std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end();
      if (stop || step + 1 >= opt.max_new_tokens) s.done = true;
    }
  }
  return result;
}

}  // namespace kiln::models::testing
