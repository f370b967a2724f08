// The continuous batcher against a fake model that checks the paged-KV plumbing: it stores
// (token, position) at every slot it is told to write, reads each sequence's whole context
// back through its block table, and predicts the next token from that context. A wrong block
// table, slot mapping, prefix-cache share or preemption changes the generated tokens, which
// the tests compare with the same function applied to the true token sequence.
#include "scheduler/llm/continuous_batcher.h"

#include <fstream>
#include <future>
#include <sstream>

#include "gtest/gtest.h"
#include "models/tokenizer/tokenizer.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

constexpr int32_t kEos = 1;  // <|end_of_text|> in the fixture vocabulary

std::unique_ptr<models::Tokenizer> LoadTokenizer() {
  std::ifstream f(std::string(KILN_SOURCE_DIR) +
                  "/tests/fixtures/tokenizer/bpe_bytelevel.tokenizer.json");
  std::stringstream ss;
  ss << f.rdbuf();
  auto tok = models::Tokenizer::FromHfJson(ss.str(), nullptr, "bpe_bytelevel");
  KILN_CHECK(tok.ok(), "fixture tokenizer failed to load");
  return std::move(*tok);
}

// The "model": the next token is a hash of the whole context, mapped into ordinary tokens
// [300, 2900); when `eos_after` > 0, a context of that many tokens past `eos_base` yields EOS.
int32_t NextToken(std::span<const int32_t> context) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : context) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ull;
  return 300 + static_cast<int32_t>(h % 2600);
}

class FakeLlm final : public models::LlmModel {
 public:
  explicit FakeLlm(int32_t context = 512) {
    tokenizer_ = LoadTokenizer();
    info_.architecture = "fake";
    info_.vocab_size = tokenizer_->vocab_size();
    info_.context_length = context;
    info_.eos_token_ids = {kEos};
  }
  const models::LlmModelInfo& info() const override { return info_; }
  const models::Tokenizer& tokenizer() const override { return *tokenizer_; }
  int64_t KvBytesPerBlock(int32_t block_size) const override { return 8 * block_size; }
  Status AllocateKvCache(int32_t num_blocks, int32_t block_size) override {
    block_size_ = block_size;
    kv_.assign(static_cast<size_t>(num_blocks) * block_size, {-1, -1});
    return OkStatus();
  }
  Status Step(const models::StepBatch& b, std::span<float> logits,
              models::StepStats* stats) override {
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    ++steps_;
    const int32_t S = static_cast<int32_t>(b.seq_lens.size());
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      if (b.slot_mapping[i] < 0 || b.slot_mapping[i] >= static_cast<int32_t>(kv_.size())) {
        return Internal("slot out of range");
      }
      kv_[b.slot_mapping[i]] = {b.tokens[i], b.positions[i]};
    }
    std::fill(logits.begin(), logits.end(), 0.0f);
    for (int32_t s = 0; s < S; ++s) {
      std::vector<int32_t> context;
      for (int32_t p = 0; p < b.seq_lens[s]; ++p) {
        const int32_t block =
            b.block_table[static_cast<size_t>(s) * b.max_blocks_per_seq + p / block_size_];
        if (block < 0) return Internal("block table hole at position ", p);
        const auto [token, pos] = kv_[static_cast<size_t>(block) * block_size_ + p % block_size_];
        if (pos != p) {
          return Internal("sequence ", s, " position ", p, " reads the KV of position ", pos);
        }
        context.push_back(token);
      }
      int32_t next = NextToken(context);
      if (eos_at_ > 0 && static_cast<int32_t>(context.size()) >= eos_at_) next = kEos;
      logits[static_cast<size_t>(s) * info_.vocab_size + next] = 10.0f;
    }
    if (b.decode_only && S <= 8) {
      stats->replayed = true;
      stats->padded_seqs = S <= 1 ? 1 : S <= 2 ? 2 : S <= 4 ? 4 : 8;
    }
    // Prompt tokens (sequences with more than one new token) in steps that also decode.
    int32_t prefill = 0;
    bool decodes = false;
    for (int32_t i = 0; i < S; ++i) {
      const int32_t n = b.query_start[i + 1] - b.query_start[i];
      if (n == 1) {
        decodes = true;
      } else {
        prefill += n;
      }
    }
    if (decodes) max_prefill_with_decodes_ = std::max(max_prefill_with_decodes_, prefill);
    max_seqs_in_step_ = std::max(max_seqs_in_step_, S);
    max_tokens_in_step_ = std::max<int32_t>(max_tokens_in_step_, b.tokens.size());
    return OkStatus();
  }

  std::chrono::microseconds delay_{0};
  int32_t eos_at_ = 0;  // context length at which the model says EOS
  std::atomic<int64_t> steps_{0};
  int32_t max_seqs_in_step_ = 0, max_tokens_in_step_ = 0, max_prefill_with_decodes_ = 0;

 private:
  models::LlmModelInfo info_;
  std::unique_ptr<models::Tokenizer> tokenizer_;
  int32_t block_size_ = 0;
  std::vector<std::pair<int32_t, int32_t>> kv_;
};

// What the fake model generates after `prompt`, greedily.
std::vector<int32_t> Reference(std::vector<int32_t> tokens, int n, int32_t eos_at = 0) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int32_t next = NextToken(tokens);
    if (eos_at > 0 && static_cast<int32_t>(tokens.size()) >= eos_at) next = kEos;
    out.push_back(next);
    tokens.push_back(next);
    if (next == kEos) break;
  }
  return out;
}

struct Result {
  std::vector<int32_t> ids;
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
  req->sampling.max_tokens = max_tokens;
  req->priority = priority;
  auto promise = std::make_shared<std::promise<Result>>();
  auto acc = std::make_shared<Result>();
  req->on_event = [promise, acc](GenerateEvent&& ev) {
    acc->ids.insert(acc->ids.end(), ev.token_ids.begin(), ev.token_ids.end());
    acc->text += ev.text;
    if (!ev.text.empty()) acc->chunks.push_back(ev.text);
    if (ev.finish != FinishReason::kNone) {
      acc->last = std::move(ev);
      promise->set_value(std::move(*acc));
    }
  };
  return {std::move(req), promise->get_future()};
}

// Polls `cond` for up to a second: gauges are refreshed at the end of the step that sent a
// request's final event, a moment after the client saw it.
template <typename F>
bool Eventually(F cond) {
  for (int i = 0; i < 1000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return cond();
}

std::vector<int32_t> Prompt(int n, int32_t seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(300 + (seed * 131 + i * 17) % 2600);
  return p;
}

struct Fixture {
  explicit Fixture(ContinuousBatcherOptions opts = {}, int32_t context = 512)
      : registry(std::make_unique<metrics::Registry>()),
        families(std::make_unique<LlmMetricFamilies>(*registry)) {
    auto m = std::make_unique<FakeLlm>(context);
    model = m.get();
    batcher = std::make_unique<ContinuousBatcher>("fake", std::move(m), opts,
                                                  std::make_unique<LlmMetrics>(*families, "fake"));
    Status s = batcher->Start();
    KILN_CHECK(s.ok(), "batcher failed to start");
  }
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
  std::unique_ptr<metrics::Registry> registry;
  std::unique_ptr<LlmMetricFamilies> families;
  FakeLlm* model;
  std::unique_ptr<ContinuousBatcher> batcher;
};

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

TEST(ContinuousBatcherTest, ManyRequestsWithChunkedPrefillAllCorrect) {
  ContinuousBatcherOptions o;
  o.max_num_batched_tokens = 24;  // prompts of 40-90 tokens are split into chunks
  o.max_num_seqs = 8;
  o.num_blocks = 256;
  Fixture f(o);
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
  EXPECT_LE(f.model->max_tokens_in_step_, 24);
  EXPECT_LE(f.model->max_seqs_in_step_, 8);
  EXPECT_GT(f.model->max_seqs_in_step_, 1) << "requests were never batched together";
}

// Prompts arriving while streams decode are prefilled in chunks of at most
// max_prefill_tokens_with_decodes per step (a decode waits for its whole step); alone, a
// prompt gets the full max_num_batched_tokens.
TEST(ContinuousBatcherTest, PrefillBesideDecodesIsCapped) {
  for (int32_t cap : {16, 0}) {
    SCOPED_TRACE(cap);
    ContinuousBatcherOptions o;
    o.max_num_batched_tokens = 64;
    o.max_prefill_tokens_with_decodes = cap;
    o.num_blocks = 256;
    Fixture f(o);
    f.model->delay_ = 2ms;
    auto first = Prompt(100, 100);  // alone: chunks of 64 and 36
    auto c0 = MakeRequest(first, 60);
    auto r0 = f.Submit(c0);
    while (f.model->steps_ < 3) std::this_thread::sleep_for(1ms);  // now decoding
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::future<Result>> futures;
    for (int i = 0; i < 4; ++i) {
      prompts.push_back(Prompt(50, 200 + i));
      auto c = MakeRequest(prompts.back(), 8);
      futures.push_back(f.Submit(c));
    }
    for (int i = 0; i < 4; ++i) EXPECT_EQ(futures[i].get().ids, Reference(prompts[i], 8));
    EXPECT_EQ(r0.get().ids, Reference(first, 60));
    EXPECT_EQ(f.model->max_tokens_in_step_, 64) << "a step without decodes has the full budget";
    if (cap > 0) {
      EXPECT_LE(f.model->max_prefill_with_decodes_, cap);
      EXPECT_GT(f.model->max_prefill_with_decodes_, 0);
    } else {
      EXPECT_GT(f.model->max_prefill_with_decodes_, 16) << "uncapped: prompts fill the budget";
    }
  }
}

TEST(ContinuousBatcherTest, PrefixCacheServesASharedPrefix) {
  ContinuousBatcherOptions o;
  o.block_size = 8;
  Fixture f(o);
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
  ContinuousBatcherOptions o;
  o.block_size = 4;
  o.num_blocks = 24;  // 96 tokens of KV for 6 requests that each grow to 40
  o.max_num_seqs = 6;
  o.enable_prefix_caching = false;
  Fixture f(o);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(Prompt(10, 100 + i));
    auto c = MakeRequest(prompts.back(), 30);
    futures.push_back(f.Submit(c));
  }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(futures[i].get().ids, Reference(prompts[i], 30)) << i;
  EXPECT_GT(f.batcher->snapshot().preemptions, 0u) << "the test did not exercise preemption";
  EXPECT_TRUE(Eventually([&] { return f.batcher->snapshot().kv_blocks_used == 0; }))
      << f.batcher->snapshot().kv_blocks_used << " KV blocks still in use";
}

TEST(ContinuousBatcherTest, PreemptionWithPrefixCacheRecomputesFromTheCache) {
  ContinuousBatcherOptions o;
  o.block_size = 4;
  o.num_blocks = 24;
  o.max_num_seqs = 6;
  Fixture f(o);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::future<Result>> futures;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(Prompt(10, 200 + i));
    auto c = MakeRequest(prompts.back(), 30);
    futures.push_back(f.Submit(c));
  }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(futures[i].get().ids, Reference(prompts[i], 30)) << i;
  EXPECT_GT(f.batcher->snapshot().preemptions, 0u);
}

TEST(ContinuousBatcherTest, CancelEndsTheRequestAndFreesItsBlocks) {
  Fixture f;
  f.model->delay_ = 2ms;
  auto c = MakeRequest(Prompt(20, 3), 400);
  auto flag = c.req->cancel;
  auto fut = f.Submit(c);
  std::this_thread::sleep_for(30ms);
  flag->Cancel();
  f.batcher->WakeUp();
  ASSERT_EQ(fut.wait_for(500ms), std::future_status::ready);
  Result r = fut.get();
  EXPECT_EQ(r.last.finish, FinishReason::kCancelled);
  EXPECT_LT(r.ids.size(), 400u);
  EXPECT_TRUE(Eventually([&] { return f.batcher->snapshot().kv_blocks_used == 0; }));
  EXPECT_TRUE(
      Eventually([&] { return f.Metric("kiln_llm_kv_cache_usage_ratio{model=\"fake\"}") == 0; }));
}

TEST(ContinuousBatcherTest, EosStopsAndIsNotInTheText) {
  Fixture f;
  f.model->eos_at_ = 25;  // prompt of 20 -> EOS as the 6th token
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
  f.model->eos_at_ = 25;
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

TEST(ContinuousBatcherTest, RejectsWhatCannotRunNamingTheNumbers) {
  Fixture f({}, /*context=*/100);
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

TEST(ContinuousBatcherTest, FullQueueRefusesAtOnce) {
  ContinuousBatcherOptions o;
  o.max_num_seqs = 1;
  o.max_queue_size = 2;
  Fixture f(o);
  f.model->delay_ = 5ms;
  auto running = MakeRequest(Prompt(8, 1), 200);
  auto fr = f.Submit(running);
  std::this_thread::sleep_for(30ms);  // admitted: no longer queued
  auto q1 = MakeRequest(Prompt(8, 2), 2), q2 = MakeRequest(Prompt(8, 3), 2);
  auto f1 = f.Submit(q1), f2 = f.Submit(q2);
  auto over = MakeRequest(Prompt(8, 4), 2);
  Status s = f.batcher->Enqueue(over.req);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  running.req.reset();
  f.batcher->Drain(SteadyClock::now() + 10s);
  EXPECT_EQ(f1.get().last.finish, FinishReason::kLength);
  EXPECT_EQ(f2.get().last.finish, FinishReason::kLength);
  EXPECT_EQ(fr.get().last.finish, FinishReason::kLength);
}

TEST(ContinuousBatcherTest, HigherPriorityIsAdmittedFirst) {
  ContinuousBatcherOptions o;
  o.max_num_seqs = 1;
  o.priority_levels = 2;
  o.default_priority_level = 2;
  Fixture f(o);
  f.model->delay_ = 2ms;
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
  auto fb = f.Submit(blocker);
  std::this_thread::sleep_for(10ms);
  auto low = tracked("low", 2, 2);
  auto fl = f.Submit(low);
  auto high = tracked("high", 1, 2);
  auto fh = f.Submit(high);
  fb.get();
  fl.get();
  fh.get();
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order[1], "high");
  EXPECT_EQ(order[2], "low");
}

TEST(ContinuousBatcherTest, DeadlineEndsARequest) {
  Fixture f;
  f.model->delay_ = 2ms;
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
  f.model->delay_ = 5ms;
  auto c = MakeRequest(Prompt(8, 9), 400);
  auto fut = f.Submit(c);
  std::this_thread::sleep_for(20ms);
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

}  // namespace
}  // namespace kiln
