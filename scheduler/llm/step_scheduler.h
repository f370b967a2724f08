// The first stage of a continuous-batching step: deciding what runs (vLLM's `schedule()`).
//
// A step is four stages, each a function a reader can find by name:
//   schedule        StepScheduler::Schedule  -> SchedulerOutput (this file)
//   build batch     StepBatchBuilder::Build  -> models::StepBatch (model_step.h)
//   run             ContinuousBatcher::Run   -> StepOutput (model_step.h)
//   process outputs ContinuousBatcher::ProcessOutputs: sample, detokenize, stop, emit, publish
//
// Schedule decides, under the step's token budget (max_num_batched_tokens), max_num_seqs and
// the free KV blocks:
//   1. running sequences first, highest priority and oldest first: one decode token each
//      (plus its drafted tokens, speculative.h, while no request waits and the step's rows
//      and tokens allow; drafts never preempt), or the next chunk of a prompt still being
//      prefilled, allocating KV blocks as they grow;
//      when blocks run out it preempts the lowest-priority, most recently arrived running
//      sequence (its blocks are freed; it goes back to the head of its queue and is recomputed
//      later, partly from the prefix cache);
//   2. then, unless it had to preempt, waiting sequences in priority order (1 is highest; FIFO
//      within a level), reusing cached prefix blocks and splitting long prompts into chunks;
//      when the step also decodes, its prompt tokens are capped at
//      max_prefill_tokens_with_decodes (a decode waits for the whole step), or by the prefill
//      limit (set_prefill_limit: the batcher's ITL target) once it knows one. An admission
//      check (set_admission_check; the batcher's adapter slots) may say "not now" for a
//      sequence: it keeps its place and those behind it are tried (no head-of-line blocking
//      by a sequence that waits for an adapter slot).
//
// Thread-safety: none; the batcher's loop thread owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "config/config.h"
#include "scheduler/llm/kv_block_manager.h"
#include "scheduler/llm/sequence.h"

namespace kiln {

// What one step runs: a plain value, filled by Schedule and read by the later stages.
struct SchedulerOutput {
  struct Entry {
    Sequence* seq = nullptr;  // owned by the StepScheduler
    // New tokens this step: [seq->num_computed, + num_tokens), the last seq->draft.size() of
    // them drafted (speculative.h: each its own row of the batch).
    int32_t num_tokens = 0;
    bool first_time = false;  // scheduled for the first time (queue and prefix metrics)
  };
  std::vector<Entry> seqs;    // running sequences first, then those admitted this step
  int32_t num_tokens = 0;     // sum of seqs[i].num_tokens
  int32_t num_rows = 0;       // rows of the batch: sequences plus drafted tokens
  int32_t decode_rows = 0;    // rows that decode (a sequence's next token or its drafts)
  int32_t prompt_tokens = 0;  // prompt tokens (prefill chunks)
  bool decode_only = true;    // every row has exactly one new token
  int32_t preempted = 0;      // running sequences sent back to their queue by this step
  int32_t admitted = 0;       // sequences taken from the waiting queues by this step
  // The `preempted` sequences, now waiting again (owned by the scheduler).
  std::vector<Sequence*> preempted_seqs;

  bool empty() const { return seqs.empty(); }
  void Clear();  // keeps the capacity (no allocation per step)
};

class StepScheduler {
 public:
  // `config` and `kv` must outlive this. Levels: max(1, config.priority_levels).
  StepScheduler(const config::LlmSchedulerConfig& config, KvBlockManager* kv);

  // A new sequence joins the back of its level's queue (FIFO within a level).
  void Add(std::unique_ptr<Sequence> seq);

  // Called for a waiting sequence before it is admitted (also after a preemption): false =
  // not this step, try those behind it (it may also have ended the sequence: seq->done).
  // Default: admit.
  using AdmissionCheck = std::function<bool(Sequence*)>;
  void set_admission_check(AdmissionCheck check) { admission_check_ = std::move(check); }

  // The prompt tokens a step that decodes `decode_rows` rows may carry, or -1 for "not known":
  // then max_prefill_tokens_with_decodes caps them. Default: none (always the static cap).
  using PrefillLimit = std::function<int32_t(int32_t decode_rows)>;
  void set_prefill_limit(PrefillLimit limit) { prefill_limit_ = std::move(limit); }

  // Decides the next step (see the file comment) into `out`, allocating its KV blocks.
  void Schedule(SchedulerOutput* out);

  // Publishes the newly full blocks of `seq` to the prefix cache (after its KV was computed).
  void PublishFullBlocks(Sequence* seq);
  // Gives back the KV blocks of `seq` (finished).
  void Free(Sequence* seq);
  // Removes every sequence marked done; returns how many of them were waiting.
  int32_t EraseDone();
  // Every sequence, running and waiting; the scheduler is empty afterwards.
  std::vector<std::unique_ptr<Sequence>> TakeAll();

  // Calls f(Sequence*) for every running, then every waiting sequence.
  template <typename F>
  void ForEach(F&& f) {
    for (auto& s : running_) f(s.get());
    for (auto& q : waiting_) {
      for (auto& s : q) f(s.get());
    }
  }

  // Calls f(Sequence*) for every running sequence.
  template <typename F>
  void ForEachRunning(F&& f) {
    for (auto& s : running_) f(s.get());
  }
  bool has_work() const { return num_running() > 0 || num_waiting() > 0; }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const;
  const KvBlockManager& kv() const { return *kv_; }

 private:
  // Frees everything of a running sequence but its tokens and puts it at the head of its queue.
  void Preempt(Sequence* seq);
  // Tries to admit queue[index] with up to `budget` tokens: reuses cached prefix blocks and
  // allocates the rest. Returns the tokens scheduled, or 0 (nothing taken) if its blocks do
  // not fit.
  int32_t Admit(std::deque<std::unique_ptr<Sequence>>& queue, size_t index, int32_t budget);
  bool Allocate(Sequence* seq, int32_t tokens);

  const config::LlmSchedulerConfig& config_;
  KvBlockManager* const kv_;
  std::vector<std::deque<std::unique_ptr<Sequence>>> waiting_;  // by level (0 = level 1)
  std::vector<std::unique_ptr<Sequence>> running_;              // ordered by (level, arrival)
  uint64_t arrivals_ = 0;
  AdmissionCheck admission_check_;
  PrefillLimit prefill_limit_;
};

}  // namespace kiln
