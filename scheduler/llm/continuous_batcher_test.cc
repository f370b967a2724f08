// The continuous batcher against the fake model of testing/fake_llm.h, which checks the
// paged-KV plumbing: it stores (token, position) at every slot it is told to write, reads each
// sequence's whole context back through its block table, and predicts the next token from
// that context. A wrong block table, slot mapping, prefix-cache share or preemption changes
// the generated tokens, which the tests compare with the same function applied to the true
// token sequence. Ordering comes from what the tests observe (the fake's StepGate, the
// batcher's snapshot, the events), never from sleeping.
#include "scheduler/llm/continuous_batcher.h"

#include <future>
#include <mutex>
#include <optional>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/grammar/grammar.h"
#include "nlohmann/json.hpp"
#include "scheduler/llm/testing/fake_llm.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;
using llm_testing::FakeLlm;
using llm_testing::FakeLlmOptions;
using llm_testing::kFakeEos;
using ::testing::HasSubstr;

constexpr int32_t kEos = kFakeEos;

// What the fake model generates after `prompt`, greedily.
std::vector<int32_t> Reference(std::vector<int32_t> tokens, int n, int32_t eos_at = 0) {
  return FakeLlm::Continue(std::move(tokens), n, eos_at);
}

struct Result {
  std::vector<int32_t> ids;
  std::vector<models::SampledToken> logprobs;
  std::string text;
  std::vector<std::string> chunks;
  GenerateEvent last;
};

struct Call {
  std::unique_ptr<GenerateRequest> req;
  std::future<Result> result;
};

Call MakeRequest(std::vector<int32_t> prompt, int max_tokens, uint32_t priority = 0) {
  auto req = std::make_unique<GenerateRequest>();
  req->model_name = "fake";
  req->prompt = std::move(prompt);
  req->sampling.temperature = 0;
  req->max_tokens = max_tokens;
  req->priority = priority;
  auto promise = std::make_shared<std::promise<Result>>();
  auto acc = std::make_shared<Result>();
  req->on_event = [promise, acc](GenerateEvent&& ev) {
    acc->ids.insert(acc->ids.end(), ev.token_ids.begin(), ev.token_ids.end());
    acc->logprobs.insert(acc->logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
    acc->text += ev.text;
    if (!ev.text.empty()) acc->chunks.push_back(ev.text);
    if (ev.finish != FinishReason::kNone) {
      acc->last = std::move(ev);
      promise->set_value(std::move(*acc));
    }
  };
  return {std::move(req), promise->get_future()};
}

std::vector<int32_t> Prompt(int n, int32_t seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(300 + (seed * 131 + i * 17) % 2600);
  return p;
}

// A scheduler section whose KV cache holds `blocks` blocks of the fake (8 bytes per token).
config::LlmSchedulerConfig WithBlocks(config::LlmSchedulerConfig c, int64_t blocks) {
  c.kv_cache_bytes = blocks * 8 * c.block_size;
  return c;
}

struct Fixture {
  // `draft`: options of a second fake, the batcher's draft model (speculative "draft").
  explicit Fixture(config::LlmSchedulerConfig config = WithBlocks({}, 4096), int32_t context = 512,
                   bool sample_on_device = false, int32_t max_adapters = 0,
                   FlightRecorder* recorder = nullptr, int32_t repeat_period = 0,
                   std::optional<FakeLlmOptions> draft = std::nullopt)
      : registry(std::make_unique<metrics::Registry>()),
        families(std::make_unique<LlmMetricFamilies>(*registry)) {
    FakeLlmOptions opts;
    opts.repeat_period = repeat_period;
    opts.context_length = context;
    opts.sample_on_device = sample_on_device;
    opts.max_adapters = max_adapters;
    gate = opts.gate;
    seen = opts.stats;
    delay_us = opts.step_delay_us;
    prompt_delay_us = opts.prompt_token_delay_us;
    eos_at = opts.eos_at;
    auto m = std::make_unique<FakeLlm>(opts);
    model = m.get();
    batcher = std::make_unique<ContinuousBatcher>("fake", std::move(m), config, /*prefix_seed=*/7,
                                                  std::make_unique<LlmMetrics>(*families, "fake"));
    batcher->set_flight_recorder(recorder);
    if (draft) {
      draft->context_length = context;
      draft_seen = draft->stats;
      Status d = batcher->SetDraftModel(std::make_unique<FakeLlm>(*draft));
      KILN_CHECK(d.ok(), "the draft model was refused");
    }
    Status s = batcher->Start();
    KILN_CHECK(s.ok(), "batcher failed to start");
  }
  ~Fixture() { gate->Open(); }  // a held step must finish for the batcher to stop
  std::future<Result> Submit(Call& c) {
    Status s = batcher->Enqueue(c.req);
    EXPECT_TRUE(s.ok()) << s;
    return std::move(c.result);
  }
  double Metric(const std::string& line_prefix) {
    std::istringstream in(registry->Serialize());
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(line_prefix + " ", 0) == 0) return std::stod(line.substr(line_prefix.size()));
    }
    return -1;
  }
  // Waits (without polling) until the batcher's snapshot satisfies `pred`.
  bool Await(const std::function<bool(const ContinuousBatcher::Snapshot&)>& pred) {
    return batcher->AwaitSnapshot(pred, absl::Seconds(10));
  }
  std::unique_ptr<metrics::Registry> registry;
  std::unique_ptr<LlmMetricFamilies> families;
  std::shared_ptr<llm_testing::StepGate> gate;
  std::shared_ptr<llm_testing::FakeLlmStats> seen, draft_seen;
  std::shared_ptr<std::atomic<int>> delay_us, prompt_delay_us, eos_at;
  FakeLlm* model;
  std::unique_ptr<ContinuousBatcher> batcher;
};

bool NoBlocksUsed(const ContinuousBatcher::Snapshot& s) { return s.kv_blocks_used == 0; }

// `n` prompts of `len` tokens (Prompt(len, 200 + i)), each submitted for `max_tokens` tokens.
struct Submitted {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::future<Result>> futures;
  int max_tokens = 0;
  // Each request's tokens are the reference continuation of its prompt.
  void ExpectReferences() {
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(futures[i].get().ids, Reference(prompts[i], max_tokens)) << "request " << i;
    }
  }
};
Submitted SubmitPrompts(Fixture& f, int n, int len, int max_tokens) {
  Submitted s;
  s.max_tokens = max_tokens;
  for (int i = 0; i < n; ++i) {
    s.prompts.push_back(Prompt(len, 200 + i));
    auto c = MakeRequest(s.prompts.back(), max_tokens);
    s.futures.push_back(f.Submit(c));
  }
  return s;
}

TEST(ContinuousBatcherTest, GreedyGenerationMatchesTheModel) {
  Fixture f;
  auto prompt = Prompt(37, 1);
  auto c = MakeRequest(prompt, 20);
  Result r = f.Submit(c).get();
  auto want = Reference(prompt, 20);
  EXPECT_EQ(r.ids, want);
  EXPECT_EQ(r.last.finish, FinishReason::kLength);
  EXPECT_EQ(r.last.usage.prompt_tokens, 37);
  EXPECT_EQ(r.last.usage.completion_tokens, 20);
  EXPECT_EQ(r.text, f.model->tokenizer().Decode(want, {.strip_leading_space = false}));
}

// A model that samples in its step program gets, per step, each sequence's parameters, penalty
// list, end-id bans and next random draw (a greedy row while a prompt is still prefilling):
// seeded requests give exactly the tokens and logprobs the host sampler gives.
TEST(ContinuousBatcherTest, SamplingOnTheDeviceGivesTheHostSamplersTokens) {
  config::LlmSchedulerConfig o;
  o.max_num_batched_tokens = 24;  // prompts of 30-60 tokens are prefilled in chunks
  o.max_num_seqs = 8;
  std::vector<Result> runs[2];
  for (bool device : {false, true}) {
    Fixture f(WithBlocks(o, 512), 512, device);
    EXPECT_EQ(f.model->samples_on_device(), device);
    std::vector<std::future<Result>> futures;
    for (int i = 0; i < 12; ++i) {
      auto c = MakeRequest(Prompt(30 + 3 * i, i), 16);
      models::SamplingParams& p = c.req->sampling;
      p.temperature = 0.8f + 0.1f * (i % 5);
      p.top_p = i % 3 == 0 ? 1.0f : 0.9f;
      p.top_k = i % 4 == 1 ? 5 : 0;
      p.repetition_penalty = i % 2 ? 1.2f : 1.0f;
      p.frequency_penalty = i % 3 == 2 ? 0.5f : 0.0f;
      p.min_tokens = i % 4 == 0 ? 6 : 0;
      p.logprobs = i % 3 == 1 ? 3 : -1;
      p.seed = 100 + i;
      futures.push_back(f.Submit(c));
    }
    for (auto& fu : futures) runs[device].push_back(fu.get());
  }
  for (size_t i = 0; i < runs[0].size(); ++i) {
    EXPECT_EQ(runs[1][i].ids, runs[0][i].ids) << "request " << i;
    EXPECT_EQ(runs[1][i].text, runs[0][i].text) << "request " << i;
    EXPECT_EQ(runs[1][i].last.finish, runs[0][i].last.finish) << "request " << i;
  }
  // The draws were not all greedy: sampling picked tokens the greedy model would not.
  int differ = 0;
  for (int i = 0; i < 12; ++i) differ += runs[0][i].ids != Reference(Prompt(30 + 3 * i, i), 16);
  EXPECT_GT(differ, 0);
}

TEST(ContinuousBatcherTest, ManyRequestsWithChunkedPrefillAllCorrect) {
  config::LlmSchedulerConfig o;
  o.max_num_batched_tokens = 24;  // prompts of 40-90 tokens are split into chunks
  o.max_num_seqs = 8;
  Fixture f(WithBlocks(o, 256));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 20; ++i) {
    prompts.push_back(Prompt(40 + 3 * i, i));
    auto c = MakeRequest(prompts.back(), 12);
    futures.push_back(f.Submit(c));
  }
  for (int i = 0; i < 20; ++i) {
    Result r = futures[i].get();
    EXPECT_EQ(r.ids, Reference(prompts[i], 12)) << "request " << i;
  }
  EXPECT_LE(f.seen->max_tokens_in_step, 24);
  EXPECT_LE(f.seen->max_seqs_in_step, 8);
  EXPECT_GT(f.seen->max_seqs_in_step, 1) << "requests were never batched together";
}

// Prompts arriving while streams decode are prefilled in chunks of at most
// max_prefill_tokens_with_decodes per step (a decode waits for its whole step); alone, a
// prompt gets the full max_num_batched_tokens.
TEST(ContinuousBatcherTest, PrefillBesideDecodesIsCapped) {
  for (int32_t cap : {16, 0}) {
    SCOPED_TRACE(cap);
    config::LlmSchedulerConfig o;
    o.max_num_batched_tokens = 64;
    o.max_prefill_tokens_with_decodes = cap;
    Fixture f(WithBlocks(o, 256));
    auto first = Prompt(100, 100);  // alone: chunks of 64 and 36, then decodes
    auto c0 = MakeRequest(first, 60);
    f.gate->Close();
    f.gate->Allow(3);
    auto r0 = f.Submit(c0);
    f.gate->AwaitArrivals(4);  // the 4th step (a decode of the first alone) waits at the gate
    Submitted later = SubmitPrompts(f, 4, 50, 8);
    f.gate->Open();
    later.ExpectReferences();
    EXPECT_EQ(r0.get().ids, Reference(first, 60));
    EXPECT_EQ(f.seen->max_tokens_in_step, 64) << "a step without decodes has the full budget";
    if (cap > 0) {
      EXPECT_LE(f.seen->max_prefill_with_decodes, cap);
      EXPECT_GT(f.seen->max_prefill_with_decodes, 0);
    } else {
      EXPECT_GT(f.seen->max_prefill_with_decodes, 16) << "uncapped: prompts fill the budget";
    }
  }
}

// With target_itl_ms, the prompt tokens of a step that decodes come from the measured step
// costs. The fake's steps take 3 ms plus 1 ms per prompt token, so a 30 ms target leaves room
// for ~27 prompt tokens beside the decodes (at least kTargetItlMinPromptTokens). Before any
// step with both was measured, the static cap applies (here none: the whole budget).
TEST(ContinuousBatcherTest, ItlTargetSizesPrefillChunksFromMeasuredStepCosts) {
  config::LlmSchedulerConfig o;
  o.max_num_batched_tokens = 128;
  o.max_prefill_tokens_with_decodes = 0;
  o.target_itl_ms = 30;
  Fixture f(WithBlocks(o, 256));
  f.delay_us->store(3000);
  f.prompt_delay_us->store(1000);
  auto first = Prompt(20, 100);
  auto c0 = MakeRequest(first, 120);
  f.gate->Close();
  f.gate->Allow(6);
  auto r0 = f.Submit(c0);
  f.gate->AwaitArrivals(7);  // a prefill, then decode-only steps of the first alone
  Submitted later = SubmitPrompts(f, 3, 100, 4);
  f.gate->Open();
  later.ExpectReferences();
  EXPECT_EQ(r0.get().ids, Reference(first, 120));
  std::vector<int32_t> chunks;
  {
    absl::MutexLock lock(&f.seen->mu);
    chunks = f.seen->prefill_beside_decodes;
  }
  ASSERT_GE(chunks.size(), 4u) << "300 prompt tokens beside decodes";
  EXPECT_GT(chunks[0], 64) << "unmeasured: the static cap (none) lets the first take the budget";
  // Measured: well below the budget however this machine's sleeps overshoot (they only make
  // decode steps look dearer, which leaves fewer prompt tokens, never fewer than the floor).
  int32_t largest_after = 0;
  for (size_t i = 1; i < chunks.size(); ++i) {
    EXPECT_LE(chunks[i], 64) << "mixed step " << i;
    largest_after = std::max(largest_after, chunks[i]);
  }
  EXPECT_GE(largest_after, config::kTargetItlMinPromptTokens) << "prompts still advance";
}

TEST(ContinuousBatcherTest, PrefixCacheServesASharedPrefix) {
  config::LlmSchedulerConfig o;
  o.block_size = 8;
  Fixture f(WithBlocks(o, 1024));
  auto prefix = Prompt(64, 7);
  auto p1 = prefix, p2 = prefix;
  p1.push_back(1000);
  p2.push_back(2000);
  auto c1 = MakeRequest(p1, 5);
  Result r1 = f.Submit(c1).get();
  auto c2 = MakeRequest(p2, 5);
  Result r2 = f.Submit(c2).get();
  EXPECT_EQ(r1.ids, Reference(p1, 5));
  EXPECT_EQ(r2.ids, Reference(p2, 5));
  EXPECT_EQ(r1.last.usage.cached_tokens, 0);
  EXPECT_EQ(r2.last.usage.cached_tokens, 64);
  EXPECT_EQ(f.Metric("kiln_llm_prefix_cache_hit_tokens_total{model=\"fake\"}"), 64);
  // The same prompt again: all but the last block is reused (one token must run).
  auto c3 = MakeRequest(p2, 5);
  Result r3 = f.Submit(c3).get();
  EXPECT_EQ(r3.ids, r2.ids);
  EXPECT_EQ(r3.last.usage.cached_tokens, 64);
}

TEST(ContinuousBatcherTest, PreemptionUnderKvPressureKeepsOutputsCorrect) {
  config::LlmSchedulerConfig o;
  o.block_size = 4;
  o.max_num_seqs = 6;
  o.enable_prefix_caching = false;
  Fixture f(WithBlocks(o, 24));  // 96 tokens of KV for 6 requests that each grow to 40
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::future<Result>> futures;
  // All six queued before a step runs (a busy machine must not finish the first ones before
  // the last arrive): the gate holds the steps until then.
  f.gate->Close();
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(Prompt(10, 100 + i));
    auto c = MakeRequest(prompts.back(), 30);
    futures.push_back(f.Submit(c));
  }
  f.gate->Open();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(futures[i].get().ids, Reference(prompts[i], 30)) << i;
  EXPECT_GT(f.batcher->snapshot().preemptions, 0u) << "the test did not exercise preemption";
  EXPECT_TRUE(f.Await(NoBlocksUsed))
      << f.batcher->snapshot().kv_blocks_used << " KV blocks still in use";
}

TEST(ContinuousBatcherTest, PreemptionWithPrefixCacheRecomputesFromTheCache) {
  config::LlmSchedulerConfig o;
  o.block_size = 4;
  o.max_num_seqs = 6;
  Fixture f(WithBlocks(o, 24));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::future<Result>> futures;
  // All six queued before a step runs (a busy machine must not finish the first ones before
  // the last arrive): the gate holds the steps until then.
  f.gate->Close();
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(Prompt(10, 200 + i));
    auto c = MakeRequest(prompts.back(), 30);
    futures.push_back(f.Submit(c));
  }
  f.gate->Open();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(futures[i].get().ids, Reference(prompts[i], 30)) << i;
  EXPECT_GT(f.batcher->snapshot().preemptions, 0u);
}

// ---- The flight recorder's hooks (scheduler/flight_recorder.h) ----

// The request events of `id`, as "state" or "state:detail".
std::vector<std::string> RequestStates(const nlohmann::json& ring, const std::string& id) {
  std::vector<std::string> out;
  for (const auto& e : ring["events"]) {
    if (e["kind"] != "request" || e["request"] != id) continue;
    out.push_back(e["state"].get<std::string>() +
                  (e.contains("detail") ? ":" + e["detail"].get<std::string>() : ""));
  }
  return out;
}

TEST(ContinuousBatcherTest, FlightRecorderSeesStepsAndRequestStates) {
  FlightRecorder rec("fake", "llm", {.entries = 256, .work_slots = 1, .max_work_requests = 64});
  Fixture f(WithBlocks({}, 4096), 512, false, 0, &rec);
  auto c = MakeRequest(Prompt(20, 5), 3);
  c.req->id = "req-a";
  EXPECT_EQ(f.Submit(c).get().ids.size(), 3u);
  EXPECT_TRUE(f.Await(NoBlocksUsed));
  const nlohmann::json ring = rec.ToJson();
  EXPECT_THAT(RequestStates(ring, "req-a"),
              ::testing::ElementsAre("queued", "admitted", "finished:length"));
  std::vector<nlohmann::json> begins, ends;
  for (const auto& e : ring["events"]) {
    if (e["kind"] == "step_begin") begins.push_back(e);
    if (e["kind"] == "step_end") ends.push_back(e);
  }
  // A prefill of the 20-token prompt, then two decodes (the third token ends it).
  ASSERT_EQ(begins.size(), 3u);
  ASSERT_EQ(ends.size(), 3u);
  EXPECT_EQ(begins[0]["prefill_tokens"], 20);
  EXPECT_EQ(begins[0]["decode_tokens"], 0);
  EXPECT_EQ(begins[0]["admitted"], 1);
  EXPECT_EQ(begins[1]["prefill_tokens"], 0);
  EXPECT_EQ(begins[1]["decode_tokens"], 1);
  EXPECT_GT(begins[0]["kv_blocks_used"].get<int>(), 0);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(begins[i]["id"], ends[i]["id"]);
    EXPECT_TRUE(ends[i]["ok"].get<bool>());
    EXPECT_EQ(ends[i]["seqs"], 1);
  }
  EXPECT_TRUE(ring["in_progress"].empty());
}

TEST(ContinuousBatcherTest, FlightRecorderSeesPreemptions) {
  FlightRecorder rec("fake", "llm", {.entries = 4096, .work_slots = 1, .max_work_requests = 6});
  config::LlmSchedulerConfig o;
  o.block_size = 4;
  o.max_num_seqs = 6;
  o.enable_prefix_caching = false;
  Fixture f(WithBlocks(o, 24), 512, false, 0, &rec);
  std::vector<std::future<Result>> futures;
  f.gate->Close();
  for (int i = 0; i < 6; ++i) {
    auto c = MakeRequest(Prompt(10, 100 + i), 30);
    c.req->id = StrCat("p", i);
    futures.push_back(f.Submit(c));
  }
  f.gate->Open();
  for (auto& fut : futures) fut.get();
  ASSERT_GT(f.batcher->snapshot().preemptions, 0u);
  const nlohmann::json ring = rec.ToJson();
  int preempted = 0;
  for (int i = 0; i < 6; ++i) {
    const std::vector<std::string> states = RequestStates(ring, StrCat("p", i));
    // Every preemption is followed by a resumption; the request ends normally.
    const auto n = std::count(states.begin(), states.end(), "preempted");
    EXPECT_EQ(n, std::count(states.begin(), states.end(), "resumed")) << i;
    EXPECT_EQ(states.back(), "finished:length") << i;
    preempted += static_cast<int>(n);
  }
  EXPECT_EQ(preempted, static_cast<int>(f.batcher->snapshot().preemptions));
}

TEST(ContinuousBatcherTest, FlightRecorderNamesTheStuckStepAndItsRequests) {
  FlightRecorder rec("fake", "llm", {.entries = 64, .work_slots = 1, .max_work_requests = 8});
  Fixture f(WithBlocks({}, 4096), 512, false, 0, &rec);
  f.gate->Close();
  auto c = MakeRequest(Prompt(8, 9), 4);
  c.req->id = "held";
  auto fut = f.Submit(c);
  f.gate->AwaitArrivals(1);  // the step is inside the model, held
  const auto later = SteadyClock::now() + 10s;
  std::vector<FlightStuckWork> stuck = rec.FindStuck(later, 5s);
  ASSERT_EQ(stuck.size(), 1u);
  EXPECT_EQ(stuck[0].kind, "step");
  EXPECT_EQ(stuck[0].requests, std::vector<std::string>{"held"});
  EXPECT_TRUE(rec.FindStuck(later, 5s).empty()) << "reported once per step";
  f.gate->Open();
  EXPECT_EQ(fut.get().last.finish, FinishReason::kLength);
  EXPECT_TRUE(f.Await(NoBlocksUsed));
  EXPECT_TRUE(rec.FindStuck(later + 10s, 5s).empty()) << "nothing in progress any more";
}

// A running sequence that steps leave out (a higher-priority prompt takes the whole token
// budget for many steps) is reported once as making no progress, and then finishes normally.
TEST(ContinuousBatcherTest, FlightRecorderReportsARunningRequestLeftOutOfSteps) {
  FlightRecorder rec(
      "fake", "llm",
      {.entries = 4096, .work_slots = 1, .max_work_requests = 8, .watchdog_seconds = 0.05});
  config::LlmSchedulerConfig o;
  o.max_num_batched_tokens = 8;
  o.max_prefill_tokens_with_decodes = 0;  // a prefill may take the whole budget
  o.priority_levels = 2;
  o.default_priority_level = 2;
  Fixture f(WithBlocks(o, 4096), 512, false, 0, &rec);
  *f.delay_us = 2000;  // >= 60 steps of the long prompt: >= 120 ms without the starved one
  auto low = MakeRequest(Prompt(4, 1), 200, /*priority=*/2);
  low.req->id = "low";
  auto low_done = f.Submit(low);
  ASSERT_TRUE(f.Await([](const auto& s) { return s.running == 1; }));
  auto high = MakeRequest(Prompt(480, 2), 2, /*priority=*/1);
  high.req->id = "high";
  auto high_done = f.Submit(high);
  EXPECT_EQ(high_done.get().last.finish, FinishReason::kLength);
  std::vector<FlightStuckWork> stuck = rec.FindStuck(SteadyClock::now(), 1h);
  ASSERT_EQ(stuck.size(), 1u);
  EXPECT_EQ(stuck[0].kind, "request");
  EXPECT_EQ(stuck[0].requests, std::vector<std::string>{"low"});
  EXPECT_GE(stuck[0].seconds, 0.05);
  *f.delay_us = 0;
  EXPECT_EQ(low_done.get().last.finish, FinishReason::kLength);
  EXPECT_TRUE(rec.FindStuck(SteadyClock::now(), 1h).empty()) << "reported once";
}

TEST(ContinuousBatcherTest, CancelEndsTheRequestAndFreesItsBlocks) {
  Fixture f;
  auto c = MakeRequest(Prompt(20, 3), 400);
  auto flag = c.req->cancel;
  f.gate->Close();
  f.gate->Allow(5);
  auto fut = f.Submit(c);
  f.gate->AwaitArrivals(6);  // five steps ran (a prefill and four decodes); the sixth waits
  EXPECT_GT(f.batcher->snapshot().kv_blocks_used, 0);
  flag->Cancel();
  f.batcher->WakeUp();
  f.gate->Allow(1);  // the held step finishes; the next one drops the request
  Result r = fut.get();
  EXPECT_EQ(r.last.finish, FinishReason::kCancelled);
  EXPECT_EQ(r.ids.size(), 6u) << "the request left at the first step after the cancel";
  EXPECT_EQ(f.gate->arrivals(), 6) << "no step ran after the cancel";
  EXPECT_TRUE(f.Await(NoBlocksUsed));
  EXPECT_EQ(f.Metric("kiln_llm_kv_cache_usage_ratio{model=\"fake\"}"), 0)
      << "the gauges are set before the snapshot";
}

TEST(ContinuousBatcherTest, EosStopsAndIsNotInTheText) {
  Fixture f;
  f.eos_at->store(25);  // prompt of 20 -> EOS as the 6th token
  auto prompt = Prompt(20, 4);
  auto c = MakeRequest(prompt, 50);
  Result r = f.Submit(c).get();
  auto want = Reference(prompt, 50, 25);
  EXPECT_EQ(r.ids, want);
  EXPECT_EQ(r.ids.back(), kEos);
  EXPECT_EQ(r.last.finish, FinishReason::kStop);
  want.pop_back();
  EXPECT_EQ(r.text, f.model->tokenizer().Decode(want, {.strip_leading_space = false}));
}

TEST(ContinuousBatcherTest, IgnoreEosKeepsGoing) {
  Fixture f;
  f.eos_at->store(25);
  auto c = MakeRequest(Prompt(20, 4), 10);
  c.req->sampling.ignore_eos = true;
  Result r = f.Submit(c).get();
  EXPECT_EQ(r.ids.size(), 10u);
  EXPECT_EQ(r.last.finish, FinishReason::kLength);
}

TEST(ContinuousBatcherTest, StopStringEndsTheTextAndIsNeverPartlySent) {
  Fixture f;
  auto prompt = Prompt(12, 5);
  auto ref = Reference(prompt, 30);
  const auto& tok = f.model->tokenizer();
  const std::string full = tok.Decode(ref, {.strip_leading_space = false});
  // A stop string made of the 3 characters that start at the text of token 10.
  const size_t at = tok.Decode(std::span(ref).first(10), {.strip_leading_space = false}).size();
  ASSERT_GT(full.size(), at + 3);
  const std::string stop = full.substr(at, 3);
  auto c = MakeRequest(prompt, 30);
  c.req->sampling.stop = {stop};
  Result r = f.Submit(c).get();
  EXPECT_EQ(r.last.finish, FinishReason::kStop);
  EXPECT_EQ(r.last.stop, stop);
  EXPECT_EQ(r.text, full.substr(0, full.find(stop)));
  for (const auto& chunk : r.chunks) EXPECT_EQ(chunk.find(stop), std::string::npos);
}

// Structured output: every request's text is in its grammar's language, on the host sampler
// and through the sample op's mask alike (the same tokens), greedy or sampled; a finished
// output ends the sequence without waiting for EOS, and a grammar that may go on is cut at
// max_tokens like any other.
TEST(ContinuousBatcherTest, GrammarConstrainsEveryToken) {
  const char* kGrammars[] = {
      R"(root ::= "{\"answer\": " ("yes" | "no" | [0-9]{1,4}) "}")",
      R"(root ::= "[" ([a-z]{1,5} ("," [a-z]{1,5}){0,3})? "]")",
      R"(root ::= [A-Z] [a-z ]* ".")",
  };
  std::vector<Result> runs[2];
  for (bool device : {false, true}) {
    Fixture f(WithBlocks({}, 4096), 512, device);
    std::vector<std::future<Result>> futures;
    for (int i = 0; i < 9; ++i) {
      auto c = MakeRequest(Prompt(20 + i, i), 40);
      auto g = grammar::Grammar::ParseGbnf(kGrammars[i % 3]);
      ASSERT_TRUE(g.ok()) << g.status();
      c.req->sampling.grammar = std::make_shared<const grammar::Grammar>(*std::move(g));
      if (i >= 3) {
        c.req->sampling.temperature = 1.5f;
        c.req->sampling.seed = 50 + i;
      }
      futures.push_back(f.Submit(c));
    }
    for (auto& fu : futures) runs[device].push_back(fu.get());
  }
  for (int i = 0; i < 9; ++i) {
    const Result& r = runs[0][i];
    auto g = grammar::Grammar::ParseGbnf(kGrammars[i % 3]);
    ASSERT_TRUE(g.ok());
    EXPECT_EQ(runs[1][i].ids, r.ids) << "request " << i;
    ASSERT_TRUE(r.last.status.ok()) << r.last.status;
    if (r.last.finish == FinishReason::kStop) {
      EXPECT_TRUE(g->Matches(r.text)) << "request " << i << ": " << r.text;
      EXPECT_NE(r.ids.back(), kEos);  // complete: ended without sampling EOS
    } else {
      // Only the open-ended grammar can run into max_tokens; what came is a prefix of it.
      EXPECT_EQ(i % 3, 2) << r.text;
      EXPECT_EQ(r.last.finish, FinishReason::kLength);
      EXPECT_EQ(r.ids.size(), 40u);
    }
  }
}

// Review of issue 17: EOS reaches a constrained sequence only through its own end ids, so
// ignore_eos holds under a grammar (the output still ends when the grammar is complete).
TEST(ContinuousBatcherTest, GrammarHonoursIgnoreEosAndEndsOnItsOwn) {
  Fixture f;
  f.eos_at->store(22);  // the fake says EOS after 2 tokens
  auto g = grammar::Grammar::ParseGbnf(R"(root ::= [a-z]{3,6} "!")");
  ASSERT_TRUE(g.ok());
  auto grammar = std::make_shared<const grammar::Grammar>(*std::move(g));
  for (bool ignore_eos : {false, true}) {
    SCOPED_TRACE(ignore_eos);
    auto c = MakeRequest(Prompt(20, 9), 30);
    c.req->sampling.grammar = grammar;
    c.req->sampling.ignore_eos = ignore_eos;
    Result r = f.Submit(c).get();
    ASSERT_EQ(r.last.finish, FinishReason::kStop) << r.last.status;
    EXPECT_TRUE(grammar->Matches(r.text)) << r.text;  // EOS was never allowed before the end
    EXPECT_EQ(std::count(r.ids.begin(), r.ids.end(), kEos), 0);
  }
}

TEST(ContinuousBatcherTest, RejectsWhatCannotRunNamingTheNumbers) {
  Fixture f(WithBlocks({}, 4096), /*context=*/100);
  auto c = MakeRequest(Prompt(120, 1), 5);
  Status s = f.batcher->Enqueue(c.req);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(StatusMessage(s).find("the prompt is 120 tokens"), std::string_view::npos) << s;
  EXPECT_NE(StatusMessage(s).find("context of 100 tokens"), std::string_view::npos) << s;
  ASSERT_NE(c.req, nullptr) << "a refused request stays with the caller";

  auto big = MakeRequest(Prompt(60, 1), 50);
  s = f.batcher->Enqueue(big.req);
  EXPECT_NE(StatusMessage(s).find("leaves room for at most 40"), std::string_view::npos) << s;

  auto nan = MakeRequest(Prompt(10, 1), 5);
  nan.req->sampling.temperature = std::nanf("");
  EXPECT_EQ(f.batcher->Enqueue(nan.req).code(), StatusCode::kInvalidArgument);

  auto empty = MakeRequest({}, 5);
  EXPECT_NE(StatusMessage(f.batcher->Enqueue(empty.req)).find("empty"), std::string_view::npos);

  auto bad_token = MakeRequest({5, 99999}, 5);
  EXPECT_NE(StatusMessage(f.batcher->Enqueue(bad_token.req)).find("99999"), std::string_view::npos);
}

// kv_cache_bytes: auto takes kv_cache_memory_fraction of the device's free memory; a device
// that reports none gets the default 256 MiB.
TEST(ContinuousBatcherTest, KvCacheAutoSizesFromFreeDeviceMemory) {
  config::LlmSchedulerConfig c;
  c.kv_cache_bytes = config::kKvCacheAuto;
  c.kv_cache_memory_fraction = 0.5;
  for (const bool reports : {true, false}) {
    metrics::Registry registry;
    LlmMetricFamilies fam(registry);
    FakeLlmOptions opts;
    if (reports) opts.device_memory = backend::DeviceMemoryInfo{1 << 30, 64 << 20};
    auto m = std::make_unique<FakeLlm>(opts);
    FakeLlm* model = m.get();
    ContinuousBatcher b("fake", std::move(m), c, /*prefix_seed=*/7,
                        std::make_unique<LlmMetrics>(fam, "fake"));
    ASSERT_TRUE(b.Start().ok());
    // The fake's blocks are 8 bytes a token: half of 64 MiB free, or 256 MiB.
    const int64_t bytes = reports ? 32 << 20 : 256 << 20;
    EXPECT_EQ(model->kv_blocks(), std::min<int64_t>(bytes / (8 * c.block_size), 1 << 24));
  }
}

TEST(ContinuousBatcherTest, FullQueueRefusesAtOnce) {
  config::LlmSchedulerConfig o;
  o.max_num_seqs = 1;
  o.max_queue_size = 2;
  Fixture f(WithBlocks(o, 1024));
  auto running = MakeRequest(Prompt(8, 1), 200);
  f.gate->Close();
  auto fr = f.Submit(running);
  f.gate->AwaitArrivals(1);  // its first step runs: admitted, no longer queued
  auto q1 = MakeRequest(Prompt(8, 2), 2), q2 = MakeRequest(Prompt(8, 3), 2);
  auto f1 = f.Submit(q1), f2 = f.Submit(q2);
  auto over = MakeRequest(Prompt(8, 4), 2);
  Status s = f.batcher->Enqueue(over.req);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(StatusMessage(s), HasSubstr("scheduler.max_queue_size"));
  f.gate->Open();
  f.batcher->Drain(SteadyClock::now() + 10s);
  EXPECT_EQ(f1.get().last.finish, FinishReason::kLength);
  EXPECT_EQ(f2.get().last.finish, FinishReason::kLength);
  EXPECT_EQ(fr.get().last.finish, FinishReason::kLength);
}

TEST(ContinuousBatcherTest, HigherPriorityIsAdmittedFirst) {
  config::LlmSchedulerConfig o;
  o.max_num_seqs = 1;
  o.priority_levels = 2;
  o.default_priority_level = 2;
  Fixture f(WithBlocks(o, 1024));
  std::vector<std::string> order;
  std::mutex mu;
  auto tracked = [&](std::string name, uint32_t prio, int max_tokens) {
    auto c = MakeRequest(Prompt(8, static_cast<int32_t>(name.size())), max_tokens, prio);
    auto inner = std::move(c.req->on_event);
    c.req->on_event = [&, name, inner](GenerateEvent&& ev) {
      if (ev.finish != FinishReason::kNone) {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(name);
      }
      inner(std::move(ev));
    };
    return c;
  };
  auto blocker = tracked("blocker", 0, 20);
  f.gate->Close();
  auto fb = f.Submit(blocker);
  f.gate->AwaitArrivals(1);  // the blocker runs (max_num_seqs 1): the others must wait
  auto low = tracked("low", 2, 2);
  auto fl = f.Submit(low);
  auto high = tracked("high", 1, 2);
  auto fh = f.Submit(high);
  f.gate->Open();
  fb.get();
  fl.get();
  fh.get();
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order[0], "blocker");
  EXPECT_EQ(order[1], "high");
  EXPECT_EQ(order[2], "low");
}

TEST(ContinuousBatcherTest, DeadlineEndsARequest) {
  Fixture f;
  f.delay_us->store(2000);
  auto c = MakeRequest(Prompt(8, 9), 400);
  c.req->deadline = SteadyClock::now() + 40ms;
  Result r = f.Submit(c).get();
  EXPECT_EQ(r.last.finish, FinishReason::kError);
  EXPECT_EQ(r.last.status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_GT(r.ids.size(), 0u);
}

TEST(ContinuousBatcherTest, DrainFinishesWorkThenRefuses) {
  Fixture f;
  auto c = MakeRequest(Prompt(8, 9), 30);
  auto fut = f.Submit(c);
  EXPECT_EQ(f.batcher->Drain(SteadyClock::now() + 10s), 0);
  EXPECT_EQ(fut.get().ids.size(), 30u);
  auto late = MakeRequest(Prompt(8, 9), 3);
  EXPECT_EQ(f.batcher->Enqueue(late.req).code(), StatusCode::kUnavailable);
}

TEST(ContinuousBatcherTest, DrainCutsOffAtTheDeadline) {
  Fixture f;
  f.delay_us->store(5000);  // 400 tokens take 2 s: far past Drain's deadline
  auto c = MakeRequest(Prompt(8, 9), 400);
  auto fut = f.Submit(c);
  f.gate->AwaitArrivals(1);  // running
  EXPECT_EQ(f.batcher->Drain(SteadyClock::now() + 30ms), 1);
  Result r = fut.get();
  EXPECT_EQ(r.last.finish, FinishReason::kError);
  EXPECT_EQ(r.last.status.code(), StatusCode::kUnavailable);
}

TEST(ContinuousBatcherTest, DecodeStepsAreFlaggedAndCounted) {
  Fixture f;
  auto c = MakeRequest(Prompt(8, 2), 10);
  f.Submit(c).get();
  EXPECT_EQ(f.Metric("kiln_llm_steps_total{model=\"fake\",mode=\"replay\"}"), 9);
  EXPECT_EQ(f.Metric("kiln_llm_steps_total{model=\"fake\",mode=\"direct\"}"), 1);
  EXPECT_EQ(f.Metric("kiln_llm_generation_tokens_total{model=\"fake\"}"), 10);
}

// ---- Speculative decoding (speculative.h) ---------------------------------------------------

// Prompt lookup drafting k tokens every step (not adaptive: the fake's step times are noise).
config::LlmSchedulerConfig Ngram(config::LlmSchedulerConfig c, int k) {
  c.speculative.method = "ngram";
  c.speculative.num_tokens = k;
  c.speculative.prompt_lookup_min = 1;  // the hashing fake repeats single tokens only
  c.speculative.adaptive = false;
  return c;
}

config::LlmSchedulerConfig WithDraftModel(config::LlmSchedulerConfig c, int k) {
  c.speculative.method = "draft";
  c.speculative.draft_model = "fake-draft";  // what Model::Load would load; here the fixture's
  c.speculative.num_tokens = k;
  c.speculative.adaptive = false;
  return c;
}

// A prompt that repeats a pattern of `period` tokens, so prompt lookup finds its suffixes.
std::vector<int32_t> Periodic(int n, int period, int32_t seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(300 + (seed * 131 + (i % period) * 17) % 2600);
  return p;
}

// Greedy output with drafts equals the model's own, whether the drafts are mostly right (a
// model that repeats its input) or mostly wrong (the hashing fake): verification rows read
// the KV the step wrote, rejected drafts' KV is overwritten later (the fake checks every
// position it reads), and max_tokens is exact at any remainder.
TEST(ContinuousBatcherSpeculativeTest, GreedyOutputIsIdenticalAndStepsFewer) {
  for (int period : {0, 7}) {
    SCOPED_TRACE(period);
    config::LlmSchedulerConfig o;
    o.max_num_batched_tokens = 32;
    o.max_num_seqs = 16;
    o.block_size = 4;  // drafts cross block boundaries
    Fixture f(WithBlocks(Ngram(o, 5), 512), 512, false, 0, nullptr, period);
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::future<Result>> futures;
    for (int i = 0; i < 6; ++i) {
      // Two requests share each prompt: the prefix cache must hold only accepted tokens.
      prompts.push_back(i % 3 == 2 ? prompts[i - 1] : Periodic(20 + 3 * i, 7, i));
      auto c = MakeRequest(prompts.back(), 23 + i);
      futures.push_back(f.Submit(c));
    }
    int64_t tokens = 0;
    for (int i = 0; i < 6; ++i) {
      Result r = futures[i].get();
      EXPECT_EQ(r.ids, FakeLlm::Continue(prompts[i], 23 + i, 0, 0, period)) << "request " << i;
      EXPECT_EQ(r.last.finish, FinishReason::kLength);
      tokens += static_cast<int64_t>(r.ids.size());
    }
    // The last step's counts: in the snapshot once its blocks are freed (a final event can
    // reach the client before the step's counters are updated).
    ASSERT_TRUE(f.Await(NoBlocksUsed));
    const ContinuousBatcher::Snapshot snap = f.batcher->snapshot();
    EXPECT_GT(snap.draft_tokens, 0u);
    EXPECT_EQ(f.Metric("kiln_llm_spec_draft_tokens_total{model=\"fake\"}"),
              static_cast<double>(snap.draft_tokens));
    EXPECT_EQ(f.Metric("kiln_llm_spec_accepted_tokens_total{model=\"fake\"}"),
              static_cast<double>(snap.accepted_tokens));
    EXPECT_LE(f.seen->max_seqs_in_step, 16) << "rows beyond max_num_seqs";
    if (period > 0) {
      // Every draft of a repeating model is right: each step yields up to six tokens.
      EXPECT_EQ(snap.accepted_tokens, snap.draft_tokens);
      EXPECT_LT(f.seen->steps, tokens / 2);
    }
  }
}

// The random draw of each token depends on its index alone (counter-based streams), and a
// verification row samples with the penalties, min_tokens bans and logprobs of the tokens
// before it: seeded sampling gives the same tokens and logprobs with and without drafts
// (prompt lookup's, or a draft model's that repeats as the target does), sampled on the host
// or in the step program.
TEST(ContinuousBatcherSpeculativeTest, SeededSamplingIsIdenticalWithAndWithoutDrafts) {
  config::LlmSchedulerConfig o;
  o.max_num_seqs = 32;
  FakeLlmOptions repeating;
  repeating.repeat_period = 5;
  for (bool device : {false, true}) {
    SCOPED_TRACE(device);
    std::vector<Result> runs[3];
    for (int spec : {0, 1, 2}) {
      const config::LlmSchedulerConfig c = spec == 0   ? o
                                           : spec == 1 ? Ngram(o, 4)
                                                       : WithDraftModel(o, 4);
      Fixture f(WithBlocks(c, 512), 512, device, 0, nullptr, 5,
                spec == 2 ? std::optional<FakeLlmOptions>(repeating) : std::nullopt);
      std::vector<std::future<Result>> futures;
      for (int i = 0; i < 8; ++i) {
        auto c = MakeRequest(Periodic(18 + i, 5, i), 30);
        models::SamplingParams& p = c.req->sampling;
        p.temperature = 0.5f + 0.1f * i;
        p.top_k = i % 2 ? 0 : 2;
        p.repetition_penalty = i % 3 == 0 ? 1.3f : 1.0f;
        p.presence_penalty = i % 3 == 1 ? 0.4f : 0.0f;
        p.frequency_penalty = i % 4 == 2 ? 0.3f : 0.0f;
        p.min_tokens = i % 4 == 0 ? 9 : 0;
        p.logprobs = i % 2 ? 2 : -1;
        p.seed = 500 + i;
        futures.push_back(f.Submit(c));
      }
      for (auto& fu : futures) runs[spec].push_back(fu.get());
      if (spec) {
        ASSERT_TRUE(f.Await(NoBlocksUsed));  // the last step's counts are in the snapshot
        EXPECT_GT(f.batcher->snapshot().accepted_tokens, 0u) << "no draft was ever accepted";
      }
    }
    int differ = 0;
    for (size_t i = 0; i < runs[0].size(); ++i) {
      for (int spec : {1, 2}) {
        EXPECT_EQ(runs[spec][i].ids, runs[0][i].ids) << "request " << i << " spec " << spec;
        ASSERT_EQ(runs[spec][i].logprobs.size(), runs[0][i].logprobs.size()) << "request " << i;
        for (size_t t = 0; t < runs[0][i].logprobs.size(); ++t) {
          EXPECT_EQ(runs[spec][i].logprobs[t].logprob, runs[0][i].logprobs[t].logprob);
          EXPECT_EQ(runs[spec][i].logprobs[t].top.size(), runs[0][i].logprobs[t].top.size());
        }
      }
      differ += runs[0][i].ids !=
                FakeLlm::Continue(Periodic(18 + static_cast<int>(i), 5, static_cast<int32_t>(i)),
                                  30, 0, 0, 5);
    }
    EXPECT_GT(differ, 0) << "every request decoded greedily: the test samples nothing";
  }
}

// Unseeded, the tokens keep the model's distribution. The repeating fake puts logits 10 on the
// repeated token and 5 on the next id; at temperature 5 with top_k 2 each token is the
// repeated one with probability 1 / (1 + e^-1) = 0.7311 whatever came before, drafted or not.
// A verifier that favoured its drafts would push the share up. Chi-squared, 1 degree of
// freedom, over ~2,000 tokens: a bias of 0.05 gives ~25, the limit 15.1 is p = 1e-4.
// (A draft model that repeats as the target does drafts what prompt lookup would.)
void SamplingKeepsTheDistribution(bool model_draft) {
  config::LlmSchedulerConfig o;
  o.max_num_seqs = 32;
  const int period = 3, n = 40, requests = 50;
  FakeLlmOptions repeating;
  repeating.repeat_period = period;
  Fixture f(WithBlocks(model_draft ? WithDraftModel(o, 4) : Ngram(o, 4), 1024), 512,
            /*sample_on_device=*/true, 0, nullptr, period,
            model_draft ? std::optional<FakeLlmOptions>(repeating) : std::nullopt);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < requests; ++i) {
    prompts.push_back(Periodic(12, period, i));
    auto c = MakeRequest(prompts.back(), n);
    c.req->sampling.temperature = 5.0f;
    c.req->sampling.top_k = 2;
    futures.push_back(f.Submit(c));
  }
  double repeated = 0, total = 0;
  for (int i = 0; i < requests; ++i) {
    Result r = futures[i].get();
    std::vector<int32_t> context = prompts[i];
    for (int32_t t : r.ids) {
      repeated += t == context[context.size() - period];
      total += 1;
      context.push_back(t);
    }
  }
  const double p = 1.0 / (1.0 + std::exp(-1.0));
  const double chi2 = (repeated - total * p) * (repeated - total * p) / (total * p) +
                      (repeated - total * p) * (repeated - total * p) / (total * (1 - p));
  EXPECT_LT(chi2, 15.1) << repeated << " of " << total << " tokens repeated; expected " << p;
  ASSERT_TRUE(f.Await(NoBlocksUsed));  // the last step's counts are in the snapshot
  const ContinuousBatcher::Snapshot snap = f.batcher->snapshot();
  EXPECT_GT(snap.accepted_tokens, 0u);
  EXPECT_LT(snap.accepted_tokens, snap.draft_tokens)
      << "drafts are wrong about a quarter of the time";
}

TEST(ContinuousBatcherSpeculativeTest, SamplingKeepsTheModelsDistribution) {
  for (bool model_draft : {false, true}) {
    SCOPED_TRACE(model_draft);
    SamplingKeepsTheDistribution(model_draft);
  }
}

// Drafts only use rows no request waits for, never preempt, and a request's own `speculative`
// turns speculation on or off.
TEST(ContinuousBatcherSpeculativeTest, DraftsYieldToWaitingRequestsAndFollowTheRequest) {
  config::LlmSchedulerConfig o;
  o.max_num_seqs = 4;
  o.speculative.adaptive = false;  // method none: only requests that ask draft
  Fixture f(WithBlocks(o, 512), 512, false, 0, nullptr, 6);
  std::vector<std::future<Result>> futures;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(Periodic(14, 6, i));
    auto c = MakeRequest(prompts.back(), 20);
    c.req->sampling.speculative = models::SpeculativeParams{.method = "ngram", .num_tokens = 3};
    futures.push_back(f.Submit(c));
  }
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(futures[i].get().ids, FakeLlm::Continue(prompts[i], 20, 0, 0, 6)) << i;
  }
  EXPECT_LE(f.seen->max_seqs_in_step, 4);
  ASSERT_TRUE(f.Await(NoBlocksUsed));  // the last step's counts are in the snapshot
  const uint64_t drafted = f.batcher->snapshot().draft_tokens;
  EXPECT_GT(drafted, 0u) << "the request's speculative was ignored";
  auto off = MakeRequest(Periodic(14, 6, 9), 20);
  off.req->sampling.speculative = models::SpeculativeParams{.method = "none"};
  EXPECT_EQ(f.Submit(off).get().ids, FakeLlm::Continue(Periodic(14, 6, 9), 20, 0, 0, 6));
  EXPECT_EQ(f.batcher->snapshot().draft_tokens, drafted);
}

// A draft model identical to the target proposes exactly the target's greedy tokens when its
// own paged KV cache is right: after catch-up over prompts longer than a step's budget (the
// prefix cache sharing some), after steps that accepted every draft (the last draft was never
// fed to it), after rejections, and after preemption (scarce blocks) it starts over. So every
// draft is accepted, and the output is the model's. The fake checks the position of every
// slot it reads, in the draft's cache too.
TEST(ContinuousBatcherDraftModelTest, AnIdenticalDraftModelIsAlwaysRight) {
  for (int64_t blocks : {512, 40}) {
    SCOPED_TRACE(blocks);
    config::LlmSchedulerConfig o;
    o.max_num_batched_tokens = 16;
    o.max_prefill_tokens_with_decodes = 8;
    o.max_num_seqs = 16;
    o.block_size = 4;
    // Scarce: without the prefix cache a preempted sequence comes back in other blocks.
    o.enable_prefix_caching = blocks > 40;
    Fixture f(WithBlocks(WithDraftModel(o, 4), blocks), 512, false, 0, nullptr, 0,
              FakeLlmOptions{});
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::future<Result>> futures;
    // Scarce: short prompts all admitted at once, then decoding outgrows the cache, so
    // sequences that drafted are preempted.
    const int base = blocks > 40 ? 21 : 9, n = blocks > 40 ? 22 : 40;
    for (int i = 0; i < 6; ++i) {
      prompts.push_back(i % 3 == 2 ? prompts[i - 1] : Prompt(base + 5 * (i % 2), i));
      auto c = MakeRequest(prompts.back(), n + i);
      futures.push_back(f.Submit(c));
    }
    int64_t tokens = 0;
    for (int i = 0; i < 6; ++i) {
      Result r = futures[i].get();
      EXPECT_EQ(r.ids, Reference(prompts[i], n + i)) << "request " << i;
      tokens += static_cast<int64_t>(r.ids.size());
    }
    ASSERT_TRUE(f.Await(NoBlocksUsed));
    const ContinuousBatcher::Snapshot snap = f.batcher->snapshot();
    EXPECT_GT(snap.draft_tokens, 0u);
    EXPECT_EQ(snap.accepted_tokens, snap.draft_tokens) << "a draft from a stale KV cache";
    if (blocks == 40) {
      EXPECT_GT(snap.preemptions, 0u) << "the scarce cache preempted nothing";
    }
    EXPECT_LT(f.seen->steps, tokens) << "the target ran a step per token";
    EXPECT_GT(f.draft_seen->steps, 0);
  }
}

// A draft model that is mostly wrong (it repeats its input where the target hashes) changes
// nothing in the output, greedy or seeded; a request may turn it off or pick prompt lookup.
TEST(ContinuousBatcherDraftModelTest, AWrongDraftModelChangesNothing) {
  config::LlmSchedulerConfig o;
  o.max_num_seqs = 16;
  o.block_size = 4;
  FakeLlmOptions wrong;
  wrong.repeat_period = 3;
  Fixture f(WithBlocks(WithDraftModel(o, 3), 512), 512, false, 0, nullptr, 0, wrong);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 4; ++i) {
    auto c = MakeRequest(Prompt(15 + i, i), 25);
    futures.push_back(f.Submit(c));
  }
  for (int i = 0; i < 4; ++i) EXPECT_EQ(futures[i].get().ids, Reference(Prompt(15 + i, i), 25));
  ASSERT_TRUE(f.Await(NoBlocksUsed));
  ContinuousBatcher::Snapshot snap = f.batcher->snapshot();
  EXPECT_GT(snap.draft_tokens, 0u);
  EXPECT_LT(snap.accepted_tokens, snap.draft_tokens);
  const int64_t draft_steps = f.draft_seen->steps;
  for (const char* method : {"none", "ngram"}) {
    auto c = MakeRequest(Prompt(19, 9), 12);
    c.req->sampling.speculative = models::SpeculativeParams{.method = method};
    EXPECT_EQ(f.Submit(c).get().ids, Reference(Prompt(19, 9), 12)) << method;
  }
  EXPECT_EQ(f.draft_seen->steps, draft_steps) << "the draft model ran for a request without it";
}

// A draft model wrong at every 7th position: after a rejection the rejected draft's keys and
// values in its cache are overwritten by the token that replaced it, so the drafts after it are
// right again. Kept, the wrong token would make every later draft of the hashing fake wrong.
TEST(ContinuousBatcherDraftModelTest, RejectedDraftsLeaveTheDraftModelsCache) {
  config::LlmSchedulerConfig o;
  o.block_size = 4;
  FakeLlmOptions sometimes;
  sometimes.wrong_every = 7;
  Fixture f(WithBlocks(WithDraftModel(o, 4), 512), 512, false, 0, nullptr, 0, sometimes);
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 4; ++i) {
    auto c = MakeRequest(Prompt(16 + i, i), 60);
    futures.push_back(f.Submit(c));
  }
  for (int i = 0; i < 4; ++i) EXPECT_EQ(futures[i].get().ids, Reference(Prompt(16 + i, i), 60));
  ASSERT_TRUE(f.Await(NoBlocksUsed));
  const ContinuousBatcher::Snapshot snap = f.batcher->snapshot();
  EXPECT_LT(snap.accepted_tokens, snap.draft_tokens);
  EXPECT_GT(snap.accepted_tokens, snap.draft_tokens / 2)
      << snap.accepted_tokens << " of " << snap.draft_tokens << " drafts accepted";
}

TEST(ContinuousBatcherDraftModelTest, DraftModelsMustShareTheVocabularyAndBeLoaded) {
  config::LlmSchedulerConfig o = WithBlocks(WithDraftModel({}, 4), 64);
  auto target = std::make_unique<FakeLlm>();
  ContinuousBatcher b("fake", std::move(target), o, 1, nullptr);
  FakeLlmOptions bigger;
  bigger.vocab_size = 100000;
  Status s = b.SetDraftModel(std::make_unique<FakeLlm>(bigger));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(StatusMessage(s)), HasSubstr("vocabulary of 100000 tokens"));
  s = b.Start();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(StatusMessage(s)), HasSubstr("no draft model was loaded"));
  // A request may ask for "draft" only where there is one.
  Fixture none(WithBlocks(Ngram({}, 4), 64));
  auto c = MakeRequest(Prompt(5, 1), 4);
  c.req->sampling.speculative = models::SpeculativeParams{.method = "draft"};
  EXPECT_THAT(std::string(StatusMessage(none.batcher->Check(*c.req))),
              HasSubstr("has no draft model"));
  Fixture with(WithBlocks(Ngram({}, 4), 64), 512, false, 0, nullptr, 0, FakeLlmOptions{});
  EXPECT_TRUE(with.batcher->Check(*c.req).ok());
  EXPECT_EQ(with.Submit(c).get().ids, Reference(Prompt(5, 1), 4));
  EXPECT_GT(with.draft_seen->steps, 0);
}

TEST(ContinuousBatcherSpeculativeTest, StopStringsAndEndTokensInsideAVerifiedRun) {
  Fixture f(WithBlocks(Ngram({}, 8), 512), 512, false, 0, nullptr, 4);
  const std::vector<int32_t> prompt = Periodic(12, 4, 3);
  const std::vector<int32_t> want = FakeLlm::Continue(prompt, 30, 0, 0, 4);
  const std::string text = f.model->tokenizer().Decode(want, {.strip_leading_space = false});
  // A stop string that ends inside a step's accepted run: the text stops before it.
  const std::string stop = text.substr(text.size() / 2, 3);
  auto c = MakeRequest(prompt, 30);
  c.req->sampling.stop = {stop};
  Result r = f.Submit(c).get();
  EXPECT_EQ(r.last.finish, FinishReason::kStop);
  EXPECT_EQ(r.text, text.substr(0, text.find(stop)));
  // The model's EOS at a context length inside a run ends it there.
  f.eos_at->store(static_cast<int>(prompt.size()) + 10);
  auto e = MakeRequest(prompt, 30);
  Result er = f.Submit(e).get();
  EXPECT_EQ(er.last.finish, FinishReason::kStop);
  EXPECT_EQ(er.ids, FakeLlm::Continue(prompt, 30, static_cast<int>(prompt.size()) + 10, 0, 4));
  EXPECT_TRUE(f.Await(NoBlocksUsed));
}

// ---- Check: every request check, made once, naming the client's fields ----------------------

GenerateRequest Req(int prompt_len, std::optional<int64_t> max_tokens = std::nullopt) {
  GenerateRequest r;
  r.prompt = Prompt(prompt_len, 1);
  r.max_tokens = max_tokens;
  return r;
}

TEST(ContinuousBatcherCheckTest, PromptLongerThanTheContextNamesBothNumbers) {
  Fixture f(WithBlocks({}, 512), /*context=*/128);
  GenerateRequest r = Req(300, 10);
  r.fields.prompt = "messages";
  Status s = f.batcher->Check(r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(s),
              HasSubstr("the prompt is 300 tokens but model 'fake' has a context of 128 tokens"));
  EXPECT_EQ(ParamOf(s), "messages");
  GenerateRequest full = Req(128);
  EXPECT_FALSE(f.batcher->Check(full).ok()) << "a prompt filling the context leaves no room";
}

TEST(ContinuousBatcherCheckTest, MaxTokensZeroNegativeOrTooLarge) {
  Fixture f(WithBlocks({}, 512), /*context=*/128);
  for (int64_t bad : {0LL, -5LL}) {
    GenerateRequest r = Req(10, bad);
    r.fields.max_tokens = "max_completion_tokens";
    Status s = f.batcher->Check(r);
    EXPECT_THAT(StatusMessage(s), HasSubstr("it must be at least 1"));
    EXPECT_EQ(ParamOf(s), "max_completion_tokens");
  }
  GenerateRequest huge = Req(10, 1LL << 40);
  EXPECT_THAT(StatusMessage(f.batcher->Check(huge)),
              HasSubstr("`max_tokens` is 1099511627776 but the prompt (10 tokens) leaves room "
                        "for at most 118 in the context of model 'fake' (128 tokens)"));
  GenerateRequest fits = Req(10, 118);
  ASSERT_TRUE(f.batcher->Check(fits).ok());
  EXPECT_EQ(fits.sampling.max_tokens, 118);
}

TEST(ContinuousBatcherCheckTest, DefaultMaxTokensIsTheRestOfTheContextCapped) {
  Fixture small(WithBlocks({}, 512), /*context=*/128);
  GenerateRequest r = Req(28);
  ASSERT_TRUE(small.batcher->Check(r).ok());
  EXPECT_EQ(r.sampling.max_tokens, 100);
  GenerateRequest completions = Req(28);
  completions.default_max_tokens = 16;
  ASSERT_TRUE(small.batcher->Check(completions).ok());
  EXPECT_EQ(completions.sampling.max_tokens, 16);
  Fixture large(WithBlocks({}, 12500), /*context=*/100000);
  GenerateRequest l = Req(10);
  ASSERT_TRUE(large.batcher->Check(l).ok());
  EXPECT_EQ(l.sampling.max_tokens, kDefaultMaxTokens);
}

TEST(ContinuousBatcherCheckTest, TheKvCacheBoundsOneSequence) {
  Fixture f(WithBlocks({}, 16), /*context=*/4096);  // 16 blocks of 16 tokens
  EXPECT_EQ(f.batcher->kv_capacity_tokens(), 256);
  GenerateRequest r = Req(56);
  ASSERT_TRUE(f.batcher->Check(r).ok());
  EXPECT_EQ(r.sampling.max_tokens, 200);
  GenerateRequest big = Req(56, 1000);
  EXPECT_THAT(StatusMessage(f.batcher->Check(big)),
              HasSubstr("`max_tokens` is 1000 but the prompt (56 tokens) leaves room for at most "
                        "200 in the KV cache of model 'fake' (256 tokens)"));
  GenerateRequest prompt = Req(300, 1);
  EXPECT_THAT(StatusMessage(f.batcher->Check(prompt)),
              HasSubstr("the prompt is 300 tokens but the KV cache of model 'fake' holds 256 "
                        "tokens"));
  GenerateRequest one = Req(1, 5000);
  EXPECT_THAT(StatusMessage(f.batcher->Check(one)), HasSubstr("the prompt (1 token) leaves"));
}

TEST(ContinuousBatcherCheckTest, SamplingErrorsNameTheFieldUnderTheClientsPrefix) {
  Fixture f;
  GenerateRequest top = Req(5, 4);
  top.sampling.top_p = 1.5f;
  Status s = f.batcher->Check(top);
  EXPECT_THAT(StatusMessage(s), ::testing::StartsWith("`top_p` is 1.5"));
  EXPECT_EQ(ParamOf(s), "top_p");
  top.fields.sampling = "sampling";
  s = f.batcher->Check(top);
  EXPECT_THAT(StatusMessage(s), ::testing::StartsWith("sampling: `top_p` is 1.5"));
  EXPECT_EQ(ParamOf(s), "top_p") << "the param stays the key itself";
  GenerateRequest min = Req(5, 2);
  min.sampling.min_tokens = 5;
  EXPECT_EQ(ParamOf(f.batcher->Check(min)), "min_tokens") << "checked against max_tokens";
}

TEST(ContinuousBatcherCheckTest, SpeculativeSettingsAreChecked) {
  Fixture f;
  auto bad = [&](models::SpeculativeParams p) {
    GenerateRequest r = Req(4, 4);
    r.sampling.speculative = std::move(p);
    return f.batcher->Check(r);
  };
  Status s = bad({.method = "draft"});
  EXPECT_EQ(ParamOf(s), "speculative.method");
  EXPECT_THAT(std::string(StatusMessage(s)), HasSubstr("no draft model"));
  EXPECT_EQ(ParamOf(bad({.method = "medusa"})), "speculative.method");
  s = bad({.method = "ngram", .num_tokens = 17});
  EXPECT_EQ(ParamOf(s), "speculative.num_tokens");
  EXPECT_THAT(std::string(StatusMessage(s)), HasSubstr("[1, 16]"));
  EXPECT_EQ(ParamOf(bad({.method = "ngram", .prompt_lookup_min = 3, .prompt_lookup_max = 2})),
            "speculative.prompt_lookup_min");
  EXPECT_TRUE(bad({.method = "ngram", .num_tokens = 16}).ok());
}

TEST(ContinuousBatcherCheckTest, PriorityAndAdapter) {
  Fixture plain;
  GenerateRequest p = Req(5, 2);
  p.priority = 3;
  EXPECT_THAT(StatusMessage(plain.batcher->Check(p)), HasSubstr("has no priority levels"));
  p.priority = -1;
  Status s = plain.batcher->Check(p);
  EXPECT_THAT(StatusMessage(s), HasSubstr("`priority` is -1; it must be >= 0"));
  EXPECT_EQ(ParamOf(s), "priority");

  config::LlmSchedulerConfig levels;
  levels.priority_levels = 2;
  levels.default_priority_level = 2;
  Fixture f(WithBlocks(levels, 1024));
  p.priority = 3;
  EXPECT_THAT(StatusMessage(f.batcher->Check(p)), HasSubstr("priority levels 1 (highest) to 2"));
  p.priority = 2;
  EXPECT_TRUE(f.batcher->Check(p).ok());

  GenerateRequest a = Req(5, 2);
  a.adapter = "sql-lora";
  s = plain.batcher->Check(a);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << "as an unknown model is";
  EXPECT_THAT(StatusMessage(s), HasSubstr("model 'fake' has no adapter 'sql-lora'"));
  EXPECT_EQ(ParamOf(s), "model");
}

// A model without adapters refuses any slot but -1; a batch from the batcher only carries -1
// today, so the refusal is the model's own (the fake checks as PagedLlm does).
TEST(ContinuousBatcherTest, EveryBatchCarriesTheBaseModelsAdapterSlot) {
  FakeLlm model;
  ASSERT_TRUE(model.AllocateKvCache(4, 16).ok());
  std::vector<int32_t> tok = {300}, pos = {0}, qs = {0, 1}, lens = {1}, table = {0};
  std::vector<float> logits(model.info().vocab_size);
  std::vector<int32_t> base = {-1}, lora = {2};
  models::StepStats stats;
  EXPECT_TRUE(model.Step({tok, pos, qs, lens, table, 1, pos, false, base}, logits, &stats).ok());
  Status s = model.Step({tok, pos, qs, lens, table, 1, pos, false, lora}, logits, &stats);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(s), HasSubstr("adapter slot 2"));

  Fixture f;  // end to end the batcher's batches pass the fake's check
  auto c = MakeRequest(Prompt(20, 5), 5);
  Result r = f.Submit(c).get();
  EXPECT_EQ(r.last.finish, FinishReason::kLength) << r.last.status;
}

// ---- Multi-LoRA: the adapter table and the LRU adapter slots ----

// A fake adapter: the fake model shifts its prediction by the rank (FakeLlm::Continue).
std::shared_ptr<const models::LoraAdapter> FakeAdapter(int64_t rank) {
  auto a = std::make_shared<models::LoraAdapter>();
  a->config.r = rank;
  return a;
}

Call AdapterRequest(std::string adapter, std::vector<int32_t> prompt, int max_tokens) {
  Call c = MakeRequest(std::move(prompt), max_tokens);
  c.req->adapter = std::move(adapter);
  return c;
}

TEST(ContinuousBatcherAdapterTest, TableAddsRemovesAndChecks) {
  Fixture f(WithBlocks({}, 1024), 512, false, /*max_adapters=*/2);
  EXPECT_TRUE(f.batcher->AddAdapter("sql", FakeAdapter(2)).ok());
  Status s = f.batcher->AddAdapter("sql", FakeAdapter(3));
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s;
  s = f.batcher->AddAdapter("big", FakeAdapter(17));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(s), HasSubstr("rank r is 17 but model 'fake' takes ranks 1 to 16"));
  EXPECT_TRUE(f.batcher->AddAdapter("chat", FakeAdapter(3)).ok());
  EXPECT_THAT(f.batcher->AdapterNames(), ::testing::ElementsAre("chat", "sql"));

  GenerateRequest r;
  r.prompt = Prompt(5, 1);
  r.adapter = "nope";
  s = f.batcher->Check(r);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(StatusMessage(s), HasSubstr("has no adapter 'nope'; its adapters are chat, sql"));
  EXPECT_EQ(ParamOf(s), "model");
  r.adapter = "sql";
  EXPECT_TRUE(f.batcher->Check(r).ok());

  // Removing an adapter refuses new requests; one already running keeps it to the end.
  f.gate->Close();
  auto running = AdapterRequest("sql", Prompt(10, 2), 6);
  auto result = f.Submit(running);
  f.gate->AwaitArrivals(1);
  EXPECT_TRUE(f.batcher->RemoveAdapter("sql").ok());
  EXPECT_EQ(f.batcher->RemoveAdapter("sql").code(), StatusCode::kNotFound);
  EXPECT_EQ(f.batcher->Check(r).code(), StatusCode::kNotFound);
  f.gate->Open();
  Result done = result.get();
  EXPECT_EQ(done.last.finish, FinishReason::kLength) << done.last.status;
  EXPECT_EQ(done.ids, FakeLlm::Continue(Prompt(10, 2), 6, 0, 2));

  Fixture none;  // a model without adapter slots
  s = none.batcher->AddAdapter("sql", FakeAdapter(2));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(StatusMessage(s), HasSubstr("max_loaded_adapters is 0"));
}

// Regression guard for the slot cache: more adapters than slots, all at once, with base-model
// requests among them. Every request gets its own adapter's tokens (a sequence run with
// another slot's adapter would not), and all complete although the slots must be reused.
TEST(ContinuousBatcherAdapterTest, MoreAdaptersThanSlotsAllComplete) {
  Fixture f(WithBlocks({}, 4096), 512, false, /*max_adapters=*/2);
  constexpr int kAdapters = 5;
  for (int a = 1; a <= kAdapters; ++a) {
    ASSERT_TRUE(f.batcher->AddAdapter(StrCat("lora-", a), FakeAdapter(a)).ok());
  }
  struct Pending {
    std::vector<int32_t> want;
    std::future<Result> result;
  };
  std::vector<Pending> pending;
  for (int i = 0; i < 3 * kAdapters + 2; ++i) {
    const int a = i < 3 * kAdapters ? i % kAdapters + 1 : 0;  // 0: the base model
    std::vector<int32_t> prompt = Prompt(8 + i, i);
    auto c = a == 0 ? MakeRequest(prompt, 12) : AdapterRequest(StrCat("lora-", a), prompt, 12);
    pending.push_back({FakeLlm::Continue(prompt, 12, 0, a), f.Submit(c)});
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    Result r = pending[i].result.get();
    EXPECT_EQ(r.last.finish, FinishReason::kLength) << i << ": " << r.last.status;
    EXPECT_EQ(r.ids, pending[i].want) << "request " << i;
  }
  EXPECT_GE(f.seen->adapter_loads.load(), kAdapters);
  EXPECT_EQ(f.Metric("kiln_lora_adapters_loaded{model=\"fake\"}"), 2);
  EXPECT_EQ(f.Metric("kiln_lora_adapter_loads_total{model=\"fake\"}"),
            f.seen->adapter_loads.load());
}

// One slot, pinned by a running sequence: a sequence of another adapter waits (it is not
// admitted) until the first ends; a base-model sequence is not held up.
TEST(ContinuousBatcherAdapterTest, PinnedSlotMakesOtherAdaptersWait) {
  Fixture f(WithBlocks({}, 1024), 512, false, /*max_adapters=*/1);
  ASSERT_TRUE(f.batcher->AddAdapter("a", FakeAdapter(1)).ok());
  ASSERT_TRUE(f.batcher->AddAdapter("b", FakeAdapter(2)).ok());
  f.gate->Close();
  auto ca = AdapterRequest("a", Prompt(6, 1), 8);
  auto ra = f.Submit(ca);
  f.gate->AwaitArrivals(1);  // a runs
  auto cb = AdapterRequest("b", Prompt(6, 2), 8);
  auto rb = f.Submit(cb);
  auto cbase = MakeRequest(Prompt(6, 3), 8);
  auto rbase = f.Submit(cbase);
  f.gate->Allow(3);
  f.gate->AwaitArrivals(4);
  EXPECT_TRUE(f.batcher->AwaitSnapshot(
      [](const ContinuousBatcher::Snapshot& s) { return s.running == 2 && s.waiting == 1; },
      absl::Seconds(5)))
      << "b waits for the slot; the base-model request runs beside a";
  f.gate->Open();
  EXPECT_EQ(ra.get().ids, FakeLlm::Continue(Prompt(6, 1), 8, 0, 1));
  EXPECT_EQ(rb.get().ids, FakeLlm::Continue(Prompt(6, 2), 8, 0, 2));
  EXPECT_EQ(rbase.get().ids, FakeLlm::Continue(Prompt(6, 3), 8, 0, 0));
  EXPECT_EQ(f.seen->adapter_loads.load(), 2);
}

// Least recently used: a resident adapter is not uploaded again; a new one replaces the slot
// used longest ago.
TEST(ContinuousBatcherAdapterTest, SlotsAreReusedLeastRecentlyUsedFirst) {
  Fixture f(WithBlocks({}, 1024), 512, false, /*max_adapters=*/2);
  for (int a = 1; a <= 3; ++a) {
    ASSERT_TRUE(f.batcher->AddAdapter(StrCat("l", a), FakeAdapter(a)).ok());
  }
  auto run = [&](int a) {
    auto c = AdapterRequest(StrCat("l", a), Prompt(5, a), 3);
    EXPECT_EQ(f.Submit(c).get().ids, FakeLlm::Continue(Prompt(5, a), 3, 0, a));
    return f.seen->adapter_loads.load();
  };
  EXPECT_EQ(run(1), 1);
  EXPECT_EQ(run(2), 2);
  EXPECT_EQ(run(1), 2) << "resident";
  EXPECT_EQ(run(3), 3) << "replaces l2, the least recently used";
  EXPECT_EQ(run(1), 3) << "still resident";
  EXPECT_EQ(run(2), 4) << "was replaced";
}

TEST(AdapterSlotsTest, PinsAndLru) {
  AdapterSlots slots(2);
  auto a = FakeAdapter(1), b = FakeAdapter(2), c = FakeAdapter(3);
  auto ga = slots.Acquire(a);
  ASSERT_TRUE(ga && ga->load);
  auto gb = slots.Acquire(b);
  ASSERT_TRUE(gb && gb->load && gb->slot != ga->slot);
  EXPECT_FALSE(slots.Acquire(c)) << "both slots pinned";
  auto ga2 = slots.Acquire(a);
  ASSERT_TRUE(ga2 && !ga2->load && ga2->slot == ga->slot);
  slots.Release(gb->slot);
  auto gc = slots.Acquire(c);
  ASSERT_TRUE(gc && gc->load && gc->slot == gb->slot);
  EXPECT_EQ(slots.num_loaded(), 2);
  slots.Clear(gc->slot);
  EXPECT_EQ(slots.num_loaded(), 1);
}

}  // namespace
}  // namespace kiln
