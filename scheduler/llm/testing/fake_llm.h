// Test-only: a deterministic fake LLM over a real paged KV cache, for the tests of the
// continuous batcher, the request path and the front ends (no model weights needed).
//
// The fake uses the byte-level BPE fixture tokenizer (ChatML control tokens: 0
// <|begin_of_text|>, 1 <|end_of_text|> = EOS, 2 <|im_start|>, 3 <|im_end|>) and, unless told
// otherwise, the SmolLM2 chat template. It stores (token, position) at every slot a step
// writes, reads each sequence's whole context back through its block table, and predicts the
// next token from that context: a hash mapped into ordinary tokens [300, 2900). A wrong block
// table, slot mapping, prefix-cache share or preemption changes the generated tokens, and
// FakeLlm::Continue predicts every greedy generation.
//
// Ordering without sleeps: a StepGate lets a test hold the model's steps and wait until a
// given number of steps arrived (so "the request is running now" is an observed fact).
//
// Thread-safety: the model is driven by one batcher thread; the shared knobs (StepGate,
// step_delay_us, prompt_token_delay_us, eos_at) and FakeLlmStats may be used from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "models/llm/llm_model.h"

namespace kiln::llm_testing {

inline constexpr int32_t kFakeEos = 1;  // <|end_of_text|> in the fixture vocabulary

// Holds model steps while closed. Open by default: steps pass and are only counted.
class StepGate {
 public:
  // Steps arriving from now on wait until Allow or Open lets them pass.
  void Close();
  // Every waiting and future step passes.
  void Open();
  // Lets `n` more steps pass while the gate is closed.
  void Allow(int64_t n);
  // Blocks until `n` steps in all have arrived at the gate (passed or waiting there).
  void AwaitArrivals(int64_t n);
  int64_t arrivals() const;

  // Called by the model at the start of every step.
  void Pass();

 private:
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t allowed_ ABSL_GUARDED_BY(mu_) = 0;  // steps that may still pass while closed
  int64_t arrivals_ ABSL_GUARDED_BY(mu_) = 0;
};

// What the fake saw, over all its steps.
struct FakeLlmStats {
  std::atomic<int64_t> steps{0};
  std::atomic<int32_t> max_seqs_in_step{0};
  std::atomic<int32_t> max_tokens_in_step{0};
  // Prompt tokens (sequences with more than one new token) in steps that also decode.
  std::atomic<int32_t> max_prefill_with_decodes{0};
  absl::Mutex mu;
  // The prompt tokens of every step that also decoded (and had some), in order.
  std::vector<int32_t> prefill_beside_decodes ABSL_GUARDED_BY(mu);
  std::atomic<int64_t> adapter_loads{0};  // LoadAdapter calls with an adapter
};

struct FakeLlmOptions {
  int32_t context_length = 256;
  bool chat_template = true;
  // Shared with the test, read at every step (tests change them while a server runs).
  std::shared_ptr<std::atomic<int>> step_delay_us = std::make_shared<std::atomic<int>>(0);
  // ... and this much more per prompt token in the step (a step whose time grows with its
  // prompt tokens, for the ITL target).
  std::shared_ptr<std::atomic<int>> prompt_token_delay_us = std::make_shared<std::atomic<int>>(0);
  // The context length at which the model says EOS (0: never).
  std::shared_ptr<std::atomic<int>> eos_at = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<StepGate> gate = std::make_shared<StepGate>();
  std::shared_ptr<FakeLlmStats> stats = std::make_shared<FakeLlmStats>();
  // Emulate a model whose step program samples (samples_on_device(), StepAndSample): each
  // row's logits go through engine/sampling.h with the table the batcher sends, as the sample
  // op does on a device.
  bool sample_on_device = false;
  // Adapter slots (max_adapters()). An adapter of rank r shifts the predicted token (see
  // Continue), so a sequence served with the wrong slot's adapter generates other tokens.
  // Adapters of rank > 16 are refused (CheckAdapter).
  int32_t max_adapters = 0;
  // Predict the token `repeat_period` back (context[size - period]) once the context is that
  // long, instead of the hash: a model that repeats its input, for speculative decoding's
  // prompt-lookup drafts (0: off).
  int32_t repeat_period = 0;
  // Predict another token (the next id) where the context's length is a multiple of this: a
  // draft model that is right except there (0: off).
  int32_t wrong_every = 0;
  // Rows of the logits, at least the tokenizer's vocabulary (0: that), for a draft model whose
  // vocabulary differs.
  int32_t vocab_size = 0;
  // What DeviceMemory() reports (kv_cache_bytes: auto); unset: Unimplemented, as on the cpu.
  std::optional<backend::DeviceMemoryInfo> device_memory = std::nullopt;
};

class FakeLlm final : public models::LlmModel {
 public:
  explicit FakeLlm(FakeLlmOptions options = {});
  ~FakeLlm() override;

  const models::LlmModelInfo& info() const override { return info_; }
  const models::Tokenizer& tokenizer() const override { return *tokenizer_; }
  const models::ChatTemplate* chat_template() const override { return template_.get(); }
  int64_t KvBytesPerBlock(int32_t block_size) const override { return 8 * block_size; }
  StatusOr<backend::DeviceMemoryInfo> DeviceMemory() override {
    if (options_.device_memory) return *options_.device_memory;
    return models::LlmModel::DeviceMemory();
  }
  Status AllocateKvCache(int32_t num_blocks, int32_t block_size) override;
  // KV blocks AllocateKvCache made.
  int64_t kv_blocks() const { return block_size_ > 0 ? kv_.size() / block_size_ : 0; }
  // Checks the batch as PagedLlm does (slots and blocks in range, adapter slots loaded), then
  // predicts. A decode-only step of at most 8 sequences reports itself
  // as replayed, padded to 1, 2, 4 or 8.
  Status Step(const models::StepBatch& batch, std::span<float> logits,
              models::StepStats* stats) override;
  bool samples_on_device() const override { return options_.sample_on_device; }
  Status StepAndSample(const models::StepBatch& batch, const models::StepSampling& sampling,
                       std::span<models::SampledToken> sampled, models::StepStats* stats) override;

  int32_t max_adapters() const override { return options_.max_adapters; }
  Status CheckAdapter(const models::LoraAdapter& adapter) const override;
  // Takes only `r` from <dir>/adapter_config.json (a PEFT folder, e.g. a fixture's); NotFound
  // naming the file when it is missing.
  StatusOr<std::shared_ptr<const models::LoraAdapter>> ReadAdapter(
      const std::string& dir) const override;
  Status LoadAdapter(int32_t slot, std::shared_ptr<const models::LoraAdapter> adapter) override;

  // The greedy continuation of `context` (at most `n` tokens; stops after EOS), by the base
  // model (adapter_rank 0) or with an adapter of that rank.
  static std::vector<int32_t> Continue(std::vector<int32_t> context, int n, int eos_at = 0,
                                       int64_t adapter_rank = 0, int32_t repeat_period = 0);

 private:
  FakeLlmOptions options_;
  models::LlmModelInfo info_;
  std::unique_ptr<models::Tokenizer> tokenizer_;
  std::unique_ptr<models::ChatTemplate> template_;
  int32_t block_size_ = 0;
  std::vector<std::pair<int32_t, int32_t>> kv_;                    // (token, position) per slot
  std::vector<float> logits_;                                      // StepAndSample's rows
  std::vector<std::shared_ptr<const models::LoraAdapter>> slots_;  // [max_adapters]
};

// The fixture tokenizer alone.
std::unique_ptr<models::Tokenizer> LoadFixtureTokenizer();

}  // namespace kiln::llm_testing
