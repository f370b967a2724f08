// The stages of a step on their own, without a loop thread or a model: what Schedule decides
// (SchedulerOutput), how StepBatchBuilder lays it out for the model (StepBatch, adapter slots
// included), and how output processing takes a sequence's next token (StepOutput).
#include "scheduler/llm/step_scheduler.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/llm/model_step.h"
#include "scheduler/llm/testing/fake_llm.h"

namespace kiln {
namespace {

using ::testing::ElementsAre;

const models::Tokenizer& Tok() {
  static const auto* tok = llm_testing::LoadFixtureTokenizer().release();
  return *tok;
}

std::unique_ptr<Sequence> Seq(int32_t prompt_len, int32_t first_token = 300, uint32_t level = 0) {
  auto r = std::make_unique<GenerateRequest>();
  for (int32_t i = 0; i < prompt_len; ++i) r->prompt.push_back(first_token + i);
  r->sampling.temperature = 0;
  auto s = std::make_unique<Sequence>(std::move(r), Tok(), /*seed=*/1);
  s->level = level;
  return s;
}

// Runs the step the output describes, as far as the scheduler is concerned: the scheduled
// tokens are computed, and a sequence that finished its known tokens gets one more.
void Computed(StepScheduler& sched, const SchedulerOutput& out) {
  for (const auto& e : out.seqs) {
    e.seq->num_computed += e.num_tokens;
    sched.PublishFullBlocks(e.seq);
    if (e.seq->uncomputed() == 0) e.seq->tokens.push_back(500);
  }
}

struct Stage {
  explicit Stage(config::LlmSchedulerConfig c, int32_t blocks)
      : config(c), kv(blocks, c.block_size, c.enable_prefix_caching), sched(config, &kv) {}
  config::LlmSchedulerConfig config;
  KvBlockManager kv;
  StepScheduler sched;
  SchedulerOutput out;
};

TEST(StepSchedulerTest, RunningDecodesFirstThenCappedPrefillChunks) {
  config::LlmSchedulerConfig c;
  c.block_size = 4;
  c.max_num_batched_tokens = 16;
  c.max_prefill_tokens_with_decodes = 6;
  Stage t(c, 64);
  Sequence* a = nullptr;
  {
    auto s = Seq(10);
    a = s.get();
    t.sched.Add(std::move(s));
  }
  t.sched.Schedule(&t.out);
  ASSERT_EQ(t.out.seqs.size(), 1u);
  EXPECT_EQ(t.out.seqs[0].seq, a);
  EXPECT_EQ(t.out.seqs[0].num_tokens, 10) << "alone, a prompt gets the full budget";
  EXPECT_TRUE(t.out.seqs[0].first_time);
  EXPECT_FALSE(t.out.decode_only);
  EXPECT_EQ(t.out.admitted, 1);
  EXPECT_EQ(a->blocks.size(), 3u);
  Computed(t.sched, t.out);

  auto b = Seq(20, 900);
  Sequence* bp = b.get();
  t.sched.Add(std::move(b));
  t.sched.Schedule(&t.out);
  ASSERT_EQ(t.out.seqs.size(), 2u);
  EXPECT_EQ(t.out.seqs[0].seq, a) << "running sequences come first";
  EXPECT_EQ(t.out.seqs[0].num_tokens, 1);
  EXPECT_FALSE(t.out.seqs[0].first_time);
  EXPECT_EQ(t.out.seqs[1].seq, bp);
  EXPECT_EQ(t.out.seqs[1].num_tokens, 6) << "beside a decode, prompt tokens are capped";
  EXPECT_EQ(t.out.num_tokens, 7);
  EXPECT_EQ(t.out.admitted, 1);
  EXPECT_EQ(t.sched.num_running(), 2);
  EXPECT_EQ(t.sched.num_waiting(), 0);
  Computed(t.sched, t.out);

  t.sched.Schedule(&t.out);  // b continues its prompt, still capped
  ASSERT_EQ(t.out.seqs.size(), 2u);
  EXPECT_EQ(t.out.seqs[1].num_tokens, 6);
  EXPECT_EQ(t.out.admitted, 0);
}

TEST(StepSchedulerTest, APrefillLimitReplacesTheStaticCapOnceKnown) {
  config::LlmSchedulerConfig c;
  c.block_size = 4;
  c.max_num_batched_tokens = 64;
  c.max_prefill_tokens_with_decodes = 6;
  Stage t(c, 64);
  int32_t limit = -1, asked_rows = 0;
  t.sched.set_prefill_limit([&](int32_t decode_rows) {
    asked_rows = decode_rows;
    return limit;
  });
  t.sched.Add(Seq(3));
  t.sched.Add(Seq(3, 400));
  t.sched.Schedule(&t.out);  // nothing decodes yet: the limit is not asked
  EXPECT_EQ(asked_rows, 0);
  EXPECT_EQ(t.out.prompt_tokens, 6);
  EXPECT_EQ(t.out.decode_rows, 0);
  Computed(t.sched, t.out);

  t.sched.Add(Seq(40, 900));
  t.sched.Schedule(&t.out);  // not known (-1): the static cap
  EXPECT_EQ(asked_rows, 2);
  EXPECT_EQ(t.out.decode_rows, 2);
  EXPECT_EQ(t.out.prompt_tokens, 6);
  Computed(t.sched, t.out);

  limit = 20;  // known: it replaces the cap, above it as well as below
  t.sched.Schedule(&t.out);
  EXPECT_EQ(t.out.prompt_tokens, 20);
  EXPECT_EQ(t.out.num_tokens, 22);
  Computed(t.sched, t.out);
  limit = 3;
  t.sched.Schedule(&t.out);
  EXPECT_EQ(t.out.prompt_tokens, 3);
  EXPECT_FALSE(t.out.decode_only);
}

TEST(StepSchedulerTest, DecodeOnlyStepsAndMaxNumSeqs) {
  config::LlmSchedulerConfig c;
  c.block_size = 4;
  c.max_num_seqs = 2;
  Stage t(c, 64);
  for (int i = 0; i < 3; ++i) t.sched.Add(Seq(3, 300 + 10 * i));
  t.sched.Schedule(&t.out);
  EXPECT_EQ(t.out.seqs.size(), 2u) << "max_num_seqs";
  EXPECT_EQ(t.sched.num_waiting(), 1);
  Computed(t.sched, t.out);
  t.sched.Schedule(&t.out);
  EXPECT_EQ(t.out.seqs.size(), 2u);
  EXPECT_TRUE(t.out.decode_only);
}

TEST(StepSchedulerTest, PreemptsTheYoungestWhenBlocksRunOut) {
  config::LlmSchedulerConfig c;
  c.block_size = 4;
  c.enable_prefix_caching = false;
  Stage t(c, 4);  // 16 tokens of KV
  auto old_seq = Seq(8), young = Seq(8, 800);
  Sequence *o = old_seq.get(), *y = young.get();
  t.sched.Add(std::move(old_seq));
  t.sched.Add(std::move(young));
  t.sched.Schedule(&t.out);  // 2 blocks each: the pool is full
  ASSERT_EQ(t.out.seqs.size(), 2u);
  Computed(t.sched, t.out);  // 9 tokens each: the 9th needs a third block
  t.sched.Schedule(&t.out);
  EXPECT_EQ(t.out.preempted, 1);
  ASSERT_EQ(t.out.seqs.size(), 1u);
  EXPECT_EQ(t.out.seqs[0].seq, o) << "the oldest keeps running";
  EXPECT_EQ(y->num_computed, 0) << "the preempted one is recomputed later";
  EXPECT_TRUE(y->blocks.empty());
  EXPECT_EQ(t.out.admitted, 0) << "a step that preempts admits nothing";
  EXPECT_EQ(t.sched.num_waiting(), 1);
}

TEST(StepSchedulerTest, PrefixCacheIsNamespacedByModelAndAdapter) {
  config::LlmSchedulerConfig c;
  c.block_size = 4;
  Stage t(c, 64);
  auto first = Seq(12);
  first->prefix_seed = 1;
  Sequence* f = first.get();
  t.sched.Add(std::move(first));
  t.sched.Schedule(&t.out);
  Computed(t.sched, t.out);
  f->done = true;
  t.sched.Free(f);
  t.sched.EraseDone();

  auto same = Seq(12);
  same->prefix_seed = 1;
  Sequence* s = same.get();
  auto other = Seq(12);
  other->prefix_seed = 2;  // another adapter of the same model
  Sequence* o = other.get();
  t.sched.Add(std::move(same));
  t.sched.Add(std::move(other));
  t.sched.Schedule(&t.out);
  EXPECT_EQ(s->cached_tokens, 8) << "two full blocks reused; the last token always runs";
  EXPECT_EQ(o->cached_tokens, 0) << "another namespace shares nothing";
  ASSERT_EQ(t.out.seqs.size(), 2u);
  EXPECT_EQ(t.out.seqs[0].num_tokens, 4);
  EXPECT_EQ(t.out.seqs[1].num_tokens, 12);
}

TEST(StepBatchBuilderTest, LaysOutTokensSlotsBlockTablesAndAdapterSlots) {
  config::LlmSchedulerConfig c;
  c.block_size = 4;
  Stage t(c, 64);
  auto a = Seq(6), b = Seq(2, 700);
  Sequence *ap = a.get(), *bp = b.get();
  bp->adapter_slot = 3;
  t.sched.Add(std::move(a));
  t.sched.Add(std::move(b));
  t.sched.Schedule(&t.out);
  StepBatchBuilder builder;
  const models::StepBatch& batch = builder.Build(t.out, c.block_size);
  EXPECT_THAT(batch.tokens, ElementsAre(300, 301, 302, 303, 304, 305, 700, 701));
  EXPECT_THAT(batch.positions, ElementsAre(0, 1, 2, 3, 4, 5, 0, 1));
  EXPECT_THAT(batch.query_start, ElementsAre(0, 6, 8));
  EXPECT_THAT(batch.seq_lens, ElementsAre(6, 2));
  EXPECT_EQ(batch.max_blocks_per_seq, 2);
  const int32_t a0 = ap->blocks[0], a1 = ap->blocks[1], b0 = bp->blocks[0];
  EXPECT_THAT(batch.block_table, ElementsAre(a0, a1, b0, -1));
  EXPECT_THAT(batch.slot_mapping, ElementsAre(a0 * 4, a0 * 4 + 1, a0 * 4 + 2, a0 * 4 + 3, a1 * 4,
                                              a1 * 4 + 1, b0 * 4, b0 * 4 + 1));
  EXPECT_THAT(batch.adapter_slots, ElementsAre(-1, 3)) << "-1: the base model";
  EXPECT_FALSE(batch.decode_only);
}

TEST(StepOutputTest, TheNextTokenIsTheModelsPickOrTheHostSamplers) {
  auto seq = Seq(3);
  const int32_t vocab = Tok().vocab_size();
  std::vector<float> logits(2 * static_cast<size_t>(vocab), 0.0f);
  logits[static_cast<size_t>(vocab) + 42] = 5.0f;  // row 1: greedy picks 42
  StepOutput host;
  host.logits = logits;
  host.vocab_size = vocab;
  EXPECT_FALSE(host.model_sampled());
  EXPECT_EQ(NextToken(host, 1, *seq).token, 42);
  std::vector<models::SampledToken> picked(2);
  picked[0].token = 7;
  picked[1].token = 9;
  picked[1].logprob = -0.5f;
  StepOutput device;
  device.vocab_size = vocab;
  device.sampled = picked;
  EXPECT_TRUE(device.model_sampled());
  EXPECT_EQ(NextToken(device, 1, *seq).token, 9);
  EXPECT_EQ(NextToken(device, 1, *seq).logprob, -0.5f);
}

}  // namespace
}  // namespace kiln
