// The continuous batcher: one loop per model replica that runs generation requests together,
// a step at a time. Front ends reach it through the request path (scheduler/generation.h).
//
// Each step, in named stages (vLLM's shape):
//   0. drops requests whose client went away or whose deadline passed (their KV blocks are
//      freed at once);
//   1. schedule (StepScheduler::Schedule, step_scheduler.h): which sequences run, how many
//      tokens each, which are preempted -> a plain SchedulerOutput;
//   2. build batch (StepBatchBuilder, model_step.h): the model's StepBatch, with each
//      sequence's adapter slot;
//   3. run (Run): the model's step -> a StepOutput: sampled tokens from a model that samples
//      in its step program (StepSamplingBuilder gives it each sequence's parameters and
//      random draw), else logits for the host sampler;
//   4. process outputs (ProcessOutputs): for every sequence whose known tokens are all
//      computed, takes its next token (host sampler, or the model's), detokenizes it
//      (UTF-8-safe), applies stop tokens/strings, max_tokens and the context limit, streams
//      the new text; publishes newly full blocks to the prefix cache.
//
// Settings are the model's `scheduler:` section as parsed (config::LlmSchedulerConfig): one
// definition of each, documented in config/README.md.
//
// Multi-LoRA: the batcher keeps a table of LoRA adapters by name (AddAdapter). A request names
// one in GenerateRequest::adapter; sequences of different adapters and of the base model share
// steps. The model's adapter slots (LlmModel::max_adapters) are an LRU cache (AdapterSlots): at
// admission a sequence pins its adapter's slot, uploading the adapter (LlmModel::LoadAdapter,
// on the loop thread, between steps) into an empty or the least recently used unpinned slot;
// when every slot is pinned by other adapters' running sequences it waits, and the sequences
// behind it are admitted (no head-of-line blocking). Not yet: aging — while sequences of the
// resident adapters keep arriving, a waiting one of another adapter may wait long. The prefix
// cache is namespaced by the adapter (its name and the AddAdapter call that added it).
//
// Thread-safety: Enqueue, Check, WakeUp, Drain, the adapter table and the accessors are
// thread-safe; everything else runs on the loop thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "config/config.h"
#include "models/llm/llm_model.h"
#include "scheduler/flight_recorder.h"
#include "scheduler/llm/adapter_slots.h"
#include "scheduler/llm/generate_request.h"
#include "scheduler/llm/kv_block_manager.h"
#include "scheduler/llm/llm_metrics.h"
#include "scheduler/llm/model_step.h"
#include "scheduler/llm/step_cost.h"
#include "scheduler/llm/step_scheduler.h"
#include "scheduler/llm/step_trace.h"
#include "scheduler/llm/structured_output.h"

namespace kiln {

class ContinuousBatcher {
 public:
  // `prefix_seed` namespaces the prefix cache (the model's identity: a reload with other
  // weights must not match blocks of the old ones). `metrics` may be null. Call Start before
  // Enqueue.
  ContinuousBatcher(std::string model_name, std::unique_ptr<models::LlmModel> model,
                    config::LlmSchedulerConfig config, uint64_t prefix_seed,
                    std::unique_ptr<LlmMetrics> metrics);
  // Drains with an immediate deadline and stops the loop.
  ~ContinuousBatcher();

  // Records steps and request state changes into `recorder` (null: none), which must outlive
  // the batcher; work slot 0 is the step in progress. REQUIRES: before Start.
  void set_flight_recorder(FlightRecorder* recorder) { recorder_ = recorder; }

  // Sizes and allocates the KV cache (kv_cache_bytes; `auto`: kv_cache_memory_fraction of
  // the model's device's free memory, or the default 256 MiB where the device reports none,
  // logged), starts the loop thread.
  Status Start();
  // Per-request traces and, while a capture runs, step spans (llm/step_trace.h). `sink` may
  // be null and must outlive the batcher. REQUIRES: before Start.
  void set_trace_sink(TraceSink* sink) { trace_.set_sink(sink, name_); }

  // Checks the request against the model and resolves sampling.max_tokens: the adapter
  // (NotFound: not in the adapter table), the prompt (non-empty, in the vocabulary, leaving
  // room in the context and the KV cache), max_tokens, the sampling parameters and the
  // priority. Errors name the field as `request.fields` calls it (WithParam) and the numbers:
  // "the prompt is 9000 tokens but model 'smollm2' has a context of 8192 tokens".
  // REQUIRES: Start succeeded.
  Status Check(GenerateRequest& request) const;

  // Check, then queues the request. On success the batcher owns it (`request` becomes null);
  // on error the caller keeps it: Check's errors, ResourceExhausted (queue full), Unavailable
  // (draining).
  Status Enqueue(std::unique_ptr<GenerateRequest>& request);

  // ---- LoRA adapters (see the file comment) ----
  // Adds `adapter` under `name` for requests to name. FailedPrecondition: the model has no
  // adapter slots; the model's CheckAdapter errors (rank, shapes); AlreadyExists: the name is
  // in the table. REQUIRES: adapter != nullptr.
  Status AddAdapter(std::string name, std::shared_ptr<const models::LoraAdapter> adapter);
  // Removes `name` from the table: later requests naming it are refused (NotFound); requests
  // already queued or running keep it until they end. NotFound if absent.
  Status RemoveAdapter(std::string_view name);
  // The names in the table, sorted.
  std::vector<std::string> AdapterNames() const;

  // Wakes the loop (e.g. after a CancelFlag was set) so it acts within one step.
  void WakeUp();

  // Stops accepting; runs until every request finished or `deadline`; then ends what is left
  // with UNAVAILABLE. Returns the number of requests cut off.
  int Drain(SteadyClock::time_point deadline);

  // Speculative decoding with a draft model (speculative.h): a smaller model with the same
  // vocabulary, driven by the loop thread. InvalidArgument when its vocabulary differs (size
  // or any token's text). REQUIRES: before Start.
  Status SetDraftModel(std::unique_ptr<models::LlmModel> draft);

  const models::LlmModel& model() const { return *model_; }
  const std::string& name() const { return name_; }
  const config::LlmSchedulerConfig& config() const { return config_; }
  // Tokens the KV cache holds in all (one sequence can use at most this many).
  // REQUIRES: Start succeeded.
  int64_t kv_capacity_tokens() const;

  struct Snapshot {
    int32_t running = 0, waiting = 0;
    int32_t kv_blocks_total = 0, kv_blocks_used = 0;
    uint64_t steps = 0, replays = 0, preemptions = 0;
    uint64_t draft_tokens = 0, accepted_tokens = 0;  // speculative decoding
  };
  // Refreshed once a step is scheduled and again after its outputs were processed; the
  // gauges (metrics) are set before the snapshot, so a snapshot never runs ahead of them.
  Snapshot snapshot() const;
  // Blocks until `pred(snapshot())` holds or `timeout` passed; returns whether it holds.
  bool AwaitSnapshot(const std::function<bool(const Snapshot&)>& pred,
                     absl::Duration timeout) const;

 private:
  int64_t KvCacheBytes() const;  // kv_cache_bytes, `auto` resolved
  void Loop();
  void StepOnce();
  void TakeInbox() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropCancelledAndExpired();
  void CutOffEverything();
  // The stages after schedule; see the file comment.
  void Schedule();
  bool Run(const models::StepBatch& batch, StepOutput* out);
  void ProcessOutputs(const SchedulerOutput& sched, const StepOutput& out);
  // Output processing of one new token `t` of `s`: ends the sequence (grammar error, end
  // token, stop string, length, complete structured output) or streams it. Returns whether
  // the sequence goes on.
  bool TakeToken(Sequence* s, const models::SampledToken& t);
  // Speculative decoding: the drafts of the running sequences that decode next (a draft
  // model's: placeholders, after its catch-up step, CatchUpDrafts)...
  void ProposeDrafts();
  // ... which, after Schedule, its single-token steps fill (speculative.h).
  void CatchUpDrafts();
  void GenerateDrafts();
  // The draft model as the config names it (a model entry or a path; else the model's own
  // name for it); empty: none.
  std::string_view DraftName() const { return draft_name_; }
  // One step of the draft model over `rows` (logits into draft_logits_).
  Status RunDraft(std::span<const StepBatchBuilder::Row> rows);
  // Ends a sequence: frees its blocks, sends its final event.
  void Finish(Sequence* seq, FinishReason reason, Status status, std::string stop = {});
  void Emit(Sequence* seq, std::vector<int32_t> ids, std::vector<models::SampledToken> lps,
            std::string text);
  void UpdateGauges();
  // Flight recorder hooks (recorder_ set): the step's composition after Schedule, its end.
  struct FlightStepTimes {
    SteadyClock::time_point begin, scheduled, built, ran;
  };
  void FlightStepBegin(FlightStepTimes& t);
  void FlightStepEnd(const FlightStepTimes& t, const StepOutput& out, bool ok);
  // The scheduler's admission check: pins (and uploads if needed) the adapter slot of `seq`;
  // false when every slot is pinned by others (or the upload failed: `seq` is ended).
  bool AcquireAdapterSlot(Sequence* seq);

  struct AdapterEntry {
    std::shared_ptr<const models::LoraAdapter> adapter;
    uint64_t serial = 0;  // which AddAdapter added it (namespaces the prefix cache)
  };
  // The entry of `name`, or NotFound in Check's words.
  StatusOr<AdapterEntry> FindAdapter(std::string_view name) const;

  const std::string name_;
  std::unique_ptr<models::LlmModel> model_;
  std::unique_ptr<models::LlmModel> draft_;  // speculative "draft"; null: none
  std::string draft_name_;                   // DraftName()
  const config::LlmSchedulerConfig config_;
  const uint64_t prefix_seed_;
  std::unique_ptr<LlmMetrics> metrics_;
  std::unique_ptr<KvBlockManager> kv_;  // set by Start, then constant

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Sequence>> inbox_ ABSL_GUARDED_BY(mu_);
  bool accepting_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool idle_ ABSL_GUARDED_BY(mu_) = true;    // loop has nothing queued or running
  int32_t queued_ ABSL_GUARDED_BY(mu_) = 0;  // inbox + waiting, for the queue bound
  Snapshot snapshot_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex adapters_mu_;
  std::map<std::string, AdapterEntry, std::less<>> adapters_ ABSL_GUARDED_BY(adapters_mu_);
  uint64_t adapter_serial_ ABSL_GUARDED_BY(adapters_mu_) = 0;

  // Loop-thread state.
  std::unique_ptr<StepScheduler> scheduler_;
  SchedulerOutput sched_;              // this step's decision (reused: no allocation per step)
  StepCostModel step_cost_;            // step time by rows and prompt tokens (step_cost.h)
  double draft_step_seconds_ = 0;      // a draft model's step (EMA)
  double draft_catch_up_seconds_ = 0;  // ... and its catch-up, per token (EMA)
  StepBatchBuilder draft_builder_;     // the draft model's batches
  std::vector<StepBatchBuilder::Row> draft_rows_;  // its catch-up, then each draft step's rows
  std::vector<float> draft_logits_;
  std::vector<Sequence*> draft_seqs_;  // GenerateDrafts' sequences (reused step to step)
  StepBatchBuilder builder_;
  std::vector<float> logits_;                     // host sampling: [S, vocab]
  StepSamplingBuilder sampling_;                  // device sampling: the step's table
  std::vector<models::SampledToken> sampled_;     // device sampling: [S]
  std::unique_ptr<AdapterSlots> adapter_slots_;   // set by Start when the model has slots
  std::unique_ptr<StructuredOutput> structured_;  // grammars and masks (Bind: any thread)
  FlightRecorder* recorder_ = nullptr;            // set before Start; null: none
  uint64_t step_id_ = 0;                          // the flight recorder's step ids
  StepTrace trace_;                               // tracing hooks (set_trace_sink)
  std::thread thread_;
};

}  // namespace kiln
