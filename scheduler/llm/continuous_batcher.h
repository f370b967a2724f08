// The continuous batcher: one loop per model replica that runs generation requests together,
// a step at a time.
//
// Each step (vLLM-style "unified" scheduling):
//   1. drops requests whose client went away or whose deadline passed (their KV blocks are
//      freed at once);
//   2. schedules the running sequences first — one decode token each, or the next chunk of a
//      prompt still being prefilled — allocating KV blocks as they grow; when blocks run out
//      it preempts the lowest-priority, most recently arrived running sequence (its blocks
//      are freed; it goes back to the head of its queue and is recomputed later, partly from
//      the prefix cache);
//   3. admits waiting sequences in priority order (1 is highest; FIFO within a level) while
//      the step's token budget (max_num_batched_tokens), max_num_seqs and free blocks allow,
//      reusing cached prefix blocks and splitting long prompts into chunks (chunked prefill);
//      when the step also decodes running streams, its prompt tokens are capped at
//      max_prefill_tokens_with_decodes (a decode waits for the whole step);
//   4. runs the model once over all of it, samples a token for every sequence whose known
//      tokens are all computed, detokenizes (UTF-8-safe), applies stop tokens/strings,
//      max_tokens and the context limit, streams the new text, and publishes newly full
//      blocks to the prefix cache.
//
// Thread-safety: Enqueue, WakeUp, Drain and the accessors are thread-safe; everything else
// runs on the loop thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "models/llm/llm_model.h"
#include "scheduler/llm/generate_request.h"
#include "scheduler/llm/kv_block_manager.h"
#include "scheduler/llm/llm_metrics.h"

namespace kiln {

struct ContinuousBatcherOptions {
  int32_t max_num_seqs = 64;             // sequences in one step
  int32_t max_num_batched_tokens = 128;  // tokens in one step (decode + prefill chunks)
  // Prompt tokens at most in a step that also decodes (the decoding streams wait for the whole
  // step: this bounds their inter-token latency); 0: no cap beyond max_num_batched_tokens.
  int32_t max_prefill_tokens_with_decodes = 64;
  int32_t max_queue_size = 1024;  // waiting requests; more are refused at once
  int32_t block_size = 16;        // tokens per KV block
  // KV pool: num_blocks if > 0, else as many blocks as kv_cache_bytes holds.
  int32_t num_blocks = 0;
  int64_t kv_cache_bytes = 256ll << 20;
  bool enable_prefix_caching = true;
  uint32_t priority_levels = 0;         // 0: one level
  uint32_t default_priority_level = 0;  // in [1, priority_levels] when levels > 0
  uint64_t prefix_seed = 0;             // namespaces the prefix cache (model + adapter identity)
};

class ContinuousBatcher {
 public:
  // `metrics` may be null. Call Start before Enqueue.
  ContinuousBatcher(std::string model_name, std::unique_ptr<models::LlmModel> model,
                    ContinuousBatcherOptions options, std::unique_ptr<LlmMetrics> metrics);
  // Drains with an immediate deadline and stops the loop.
  ~ContinuousBatcher();

  // Sizes and allocates the KV cache, starts the loop thread.
  Status Start();

  // Checks the request against the model (prompt length vs context, max_tokens, sampling
  // parameters, priority) and queues it. On success the batcher owns it (`request` becomes
  // null); on error the caller keeps it: InvalidArgument (bad request, naming the numbers),
  // ResourceExhausted (queue full), Unavailable (draining).
  Status Enqueue(std::unique_ptr<GenerateRequest>& request);

  // Wakes the loop (e.g. after a CancelFlag was set) so it acts within one step.
  void WakeUp();

  // Stops accepting; runs until every request finished or `deadline`; then ends what is left
  // with UNAVAILABLE. Returns the number of requests cut off.
  int Drain(SteadyClock::time_point deadline);

  const models::LlmModel& model() const { return *model_; }
  const std::string& name() const { return name_; }
  const ContinuousBatcherOptions& options() const { return options_; }

  struct Snapshot {
    int32_t running = 0, waiting = 0;
    int32_t kv_blocks_total = 0, kv_blocks_used = 0;
    uint64_t steps = 0, replays = 0, preemptions = 0;
  };
  Snapshot snapshot() const;

 private:
  struct Sequence;
  void Loop();
  bool StepOnce();  // false when there was nothing to run
  void TakeInbox() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropCancelledAndExpired();
  void Preempt(Sequence* seq);
  void Finish(Sequence* seq, FinishReason reason, Status status, std::string stop = {});
  void Emit(Sequence* seq, std::vector<int32_t> ids, std::vector<models::SampledToken> lps,
            std::string text);
  void PublishFullBlocks(Sequence* seq);
  void UpdateGauges();
  std::deque<std::unique_ptr<Sequence>>& QueueFor(uint32_t level);

  const std::string name_;
  std::unique_ptr<models::LlmModel> model_;
  ContinuousBatcherOptions options_;
  std::unique_ptr<LlmMetrics> metrics_;
  std::unique_ptr<KvBlockManager> kv_;

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Sequence>> inbox_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool idle_ ABSL_GUARDED_BY(mu_) = true;    // loop has nothing queued or running
  int32_t queued_ ABSL_GUARDED_BY(mu_) = 0;  // inbox + waiting, for the queue bound
  Snapshot snapshot_ ABSL_GUARDED_BY(mu_);

  // Loop-thread state.
  std::vector<std::deque<std::unique_ptr<Sequence>>> waiting_;  // by level (index 0 = level 1)
  std::vector<std::unique_ptr<Sequence>> running_;
  uint64_t arrivals_ = 0;
  std::vector<float> logits_;
  std::thread thread_;
};

}  // namespace kiln
