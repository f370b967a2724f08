#include "scheduler/llm/speculative.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::vector<int32_t> Draft(const std::vector<int32_t>& tokens, int32_t max_draft,
                           SpeculationSettings s = {.num_tokens = 4}) {
  std::vector<int32_t> d = {99};  // cleared first
  ProposeNgram(tokens, s, max_draft, &d);
  return d;
}

TEST(ProposeNgramTest, CopiesWhatFollowedTheLongestEarlierSuffix) {
  // Suffix [2 3] occurred at 1; [3] alone also at 2 and 6: the longer match wins.
  EXPECT_THAT(Draft({1, 2, 3, 4, 5, 3, 9, 2, 3}, 3), ElementsAre(4, 5, 3));
  // The most recent earlier occurrence: [7] at 0 (then 1) and at 3 (then 2).
  EXPECT_THAT(Draft({7, 1, 0, 7, 2, 0, 7}, 1, {.num_tokens = 4, .lookup_min = 1, .lookup_max = 1}),
              ElementsAre(2));
  // The draft stops at the end of the sequence, and at max_draft.
  EXPECT_THAT(Draft({5, 6, 5}, 4), ElementsAre(6, 5));
  EXPECT_THAT(Draft({1, 2, 3, 1, 2, 3, 1, 2}, 2), ElementsAre(3, 1));
}

TEST(ProposeNgramTest, NothingWithoutAMatchOrRoom) {
  EXPECT_THAT(Draft({1, 2, 3, 4}, 4), IsEmpty());
  EXPECT_THAT(Draft({1}, 4), IsEmpty());
  EXPECT_THAT(Draft({}, 4), IsEmpty());
  EXPECT_THAT(Draft({1, 2, 1}, 0), IsEmpty());
  // Suffixes shorter than lookup_min are not tried.
  EXPECT_THAT(Draft({1, 2, 9, 2}, 4, {.num_tokens = 4, .lookup_min = 2, .lookup_max = 3}),
              IsEmpty());
}

TEST(ResolveSpeculationTest, TheRequestOverridesTheModel) {
  config::SpeculativeConfig model;  // none
  StatusOr<SpeculationSettings> s = ResolveSpeculation(model, std::nullopt, "m");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_tokens, 0);
  s = ResolveSpeculation(model, models::SpeculativeParams{.method = "ngram"}, "m");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_tokens, 8);  // the model's figures fill what the request leaves out
  EXPECT_EQ(s->lookup_max, 4);
  model.method = "ngram";
  model.num_tokens = 6;
  s = ResolveSpeculation(model, models::SpeculativeParams{.method = "none"}, "m");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_tokens, 0);
  s = ResolveSpeculation(model,
                         models::SpeculativeParams{.method = "ngram", .prompt_lookup_max = 2}, "m");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_tokens, 6);
  EXPECT_EQ(s->lookup_max, 2);
  EXPECT_EQ(ParamOf(ResolveSpeculation(
                        model, models::SpeculativeParams{.method = "ngram", .num_tokens = -1}, "m")
                        .status()),
            "speculative.num_tokens");
}

TEST(ResolveSpeculationTest, DraftNeedsTheModelsDraftModel) {
  config::SpeculativeConfig model;
  model.method = "ngram";
  const models::SpeculativeParams draft{.method = "draft"};
  StatusOr<SpeculationSettings> s = ResolveSpeculation(model, draft, "m");
  EXPECT_EQ(ParamOf(s.status()), "speculative.method");
  EXPECT_THAT(std::string(StatusMessage(s.status())), HasSubstr("model 'm' has no draft model"));
  s = ResolveSpeculation(model, draft, "m", "small");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->method, SpeculationSettings::Method::kDraft);
  EXPECT_EQ(s->num_tokens, 8);
  s = ResolveSpeculation(model, std::nullopt, "m", "small");  // the model's method
  EXPECT_EQ(s->method, SpeculationSettings::Method::kNgram);
  // `model` names the draft model as configured, and only with method draft.
  EXPECT_TRUE(ResolveSpeculation(model,
                                 models::SpeculativeParams{.method = "draft", .model = "small"},
                                 "m", "small")
                  .ok());
  s = ResolveSpeculation(model, models::SpeculativeParams{.method = "draft", .model = "big"}, "m",
                         "small");
  EXPECT_EQ(ParamOf(s.status()), "speculative.model");
  EXPECT_THAT(std::string(StatusMessage(s.status())), HasSubstr("drafts with \"small\""));
  s = ResolveSpeculation(model, models::SpeculativeParams{.method = "ngram", .model = "small"}, "m",
                         "small");
  EXPECT_EQ(ParamOf(s.status()), "speculative.model");
}

TEST(AdaptiveDraftingTest, DraftsWhatPaysOnTheMeasuredDevice) {
  StepCostModel gpu, cpu;
  for (int i = 0; i < 20; ++i) {
    // A GPU-like device: rows are nearly free. A CPU-like one: this machine's SmolLM2 steps.
    for (int r = 1; r <= 16; ++r) gpu.Observe(r, 0.010 + 0.0001 * r);
    cpu.Observe(1, 0.0069);
    cpu.Observe(2, 0.0081);
    cpu.Observe(4, 0.0107);
    cpu.Observe(8, 0.0210);
  }
  EXPECT_NEAR(cpu.Relative(4), 0.0107 / 0.0069, 1e-9);
  // Unseen: interpolated between measured row counts, then the prior per row past them.
  EXPECT_NEAR(cpu.Relative(3), (0.0081 + 0.0107) / 2 / 0.0069, 1e-9);
  EXPECT_NEAR(cpu.Relative(10), 0.0210 / 0.0069 + 0.5, 1e-9);
  // Copying (most drafts right): long drafts on the GPU; on the CPU up to the cheap 4 rows.
  EXPECT_EQ(ChooseDraftLength(0.9, 8, gpu), 8);
  EXPECT_EQ(ChooseDraftLength(0.9, 8, cpu), 3);
  // Ordinary chat (most drafts wrong): the GPU still drafts a little, the CPU not at all.
  EXPECT_GE(ChooseDraftLength(0.15, 8, gpu), 1);
  EXPECT_EQ(ChooseDraftLength(0.15, 8, cpu), 0);
  EXPECT_EQ(ChooseDraftLength(0.9, 0, gpu), 0);
  // Unmeasured: the prior (a quarter of a step per row) drafts modestly.
  EXPECT_EQ(ChooseDraftLength(0.5, 8, StepCostModel{}), 1);
  // In a batch of 8 one-row decodes on the CPU (8 -> 16 rows doubles the step), a copying
  // sequence's drafts cost everyone more than they give; on the GPU they still pay.
  for (int i = 0; i < 20; ++i) {
    cpu.Observe(12, 0.033);
    cpu.Observe(16, 0.044);
  }
  EXPECT_EQ(ChooseDraftLength(0.9, 8, cpu, 8, 8.0), 0);
  EXPECT_EQ(ChooseDraftLength(0.9, 8, gpu, 8, 8.0), 8);
  // A draft model: its steps (a tenth of the target's each) make long drafts dearer; one it
  // must first catch up on 40 tokens (at a fiftieth of a step each) drafts only when most of
  // its drafts are right, and one that would take longer to catch up than it saves not at all.
  EXPECT_EQ(ChooseDraftLength(0.9, 8, gpu, 1, 1.0, 0.1), 8);
  EXPECT_LT(ChooseDraftLength(0.6, 8, gpu, 1, 1.0, 0.1), ChooseDraftLength(0.6, 8, gpu));
  EXPECT_GE(ChooseDraftLength(0.9, 8, gpu, 1, 1.0, 0.1, 40 * 0.02), 1);
  EXPECT_EQ(ChooseDraftLength(0.3, 8, gpu, 1, 1.0, 0.1, 40 * 0.02), 0);
  EXPECT_EQ(ChooseDraftLength(0.9, 8, gpu, 1, 1.0, 0.1, 8.0), 0);
}

TEST(AdaptiveDraftingTest, AcceptanceFollowsRecentVerifications) {
  AcceptanceEstimate a;
  EXPECT_DOUBLE_EQ(a.rate(), 0.5);
  for (int i = 0; i < 10; ++i) a.Observe(4, 4);
  EXPECT_GT(a.rate(), 0.9);
  for (int i = 0; i < 10; ++i) a.Observe(3, 0);
  EXPECT_LT(a.rate(), 0.4);
  // Without drafts it forgets, towards the prior, so the sequence tries again.
  for (int i = 0; i < 200; ++i) a.Idle();
  EXPECT_NEAR(a.rate(), 0.5, 0.1);
}

}  // namespace
}  // namespace kiln
