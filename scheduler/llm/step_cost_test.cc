#include "scheduler/llm/step_cost.h"

#include <climits>

#include "gtest/gtest.h"

namespace kiln {
namespace {

TEST(StepCostModelTest, DecodeSecondsAreMeasuredInterpolatedOrExtrapolatedByThePrior) {
  StepCostModel m;
  EXPECT_EQ(m.DecodeSeconds(4), 0) << "nothing measured";
  m.Observe(4, 0.012);
  m.Observe(8, 0.020);
  EXPECT_DOUBLE_EQ(m.DecodeSeconds(4), 0.012);
  EXPECT_DOUBLE_EQ(m.DecodeSeconds(6), 0.016);
  // Below the smallest and above the largest measured count: a quarter of a one-row step per
  // row, the one-row step inferred from the nearest measured count by the same prior.
  EXPECT_NEAR(m.DecodeSeconds(2), 0.012 - 0.5 * (0.012 / 1.75), 1e-12);
  EXPECT_NEAR(m.DecodeSeconds(10), 0.020 + 0.5 * (0.020 / 2.75), 1e-12);
  m.Observe(1, 0.008);  // measured, the one-row step is used instead
  EXPECT_NEAR(m.DecodeSeconds(10), 0.020 + 0.5 * 0.008, 1e-12);
  EXPECT_DOUBLE_EQ(m.DecodeSeconds(1000), m.DecodeSeconds(64)) << "rows are tracked to 64";
  // Moving average: a new reading moves the estimate a tenth of the way.
  m.Observe(8, 0.030);
  EXPECT_DOUBLE_EQ(m.DecodeSeconds(8), 0.021);
}

TEST(StepCostModelTest, PromptTokensWithinATargetFromMixedSteps) {
  StepCostModel m;
  m.ObserveMixed(4, 40, 0.050);
  EXPECT_EQ(m.PromptTokensWithin(4, 0.030, 16), -1) << "no decode-only step to subtract";
  m.Observe(4, 0.010);
  EXPECT_EQ(m.PromptTokensWithin(4, 0.030, 16), -1) << "no mixed step measured";
  m.ObserveMixed(4, 2, 0.5);   // too few prompt tokens to tell: ignored
  m.ObserveMixed(0, 40, 0.5);  // no decodes: ignored
  EXPECT_EQ(m.PromptTokensWithin(4, 0.030, 16), -1);
  m.ObserveMixed(4, 40, 0.050);  // (0.050 - 0.010) / 40 = 1 ms per prompt token
  EXPECT_NEAR(m.PromptTokenSeconds(), 0.001, 1e-12);
  EXPECT_EQ(m.PromptTokensWithin(4, 0.030, 4), 20);
  EXPECT_EQ(m.PromptTokensWithin(4, 0.0105, 0), 5) << "at least half the decodes' 10 ms";
  EXPECT_EQ(m.PromptTokensWithin(4, 0.002, 6), 6) << "the floor: prompts always advance";
  // The decodes alone take the target or longer: prompt tokens for half their time, so the
  // step takes 1.5x its decodes and prompts keep pace with the streams they replace.
  EXPECT_EQ(m.PromptTokensWithin(4, 0.010, 4), 5);
  EXPECT_EQ(m.PromptTokensWithin(4, 0.005, 4), 5);
  m.Observe(16, 0.050);
  EXPECT_EQ(m.PromptTokensWithin(16, 0.030, 4), 25) << "16 decodes take 50 ms of a 30 ms target";
  // A row count never decoded alone (8: only 4 and 16 were) gets a decode-only step, which
  // measures it, instead of a guess between its neighbours.
  EXPECT_EQ(m.PromptTokensWithin(8, 0.030, 4), 0);
  m.Observe(8, 0.020);
  EXPECT_EQ(m.PromptTokensWithin(8, 0.030, 4), 10);
  // Held back once per row count at most: asked again with no measurement in between (the
  // probe step failed, or carried drafted rows), the guess between 8 and 16 rows is used.
  EXPECT_EQ(m.PromptTokensWithin(12, 0.030, 4), 0);
  EXPECT_EQ(m.PromptTokensWithin(12, 0.030, 4), 17) << "guess: 35 ms, half of it for prompts";
  // A faster average for mixed steps: a fifth of the way.
  m.ObserveMixed(4, 10, 0.030);  // 2 ms per token
  EXPECT_NEAR(m.PromptTokenSeconds(), 0.0012, 1e-12);
  // Prompt tokens that cost nothing measurable (a step no slower than a decode): no limit.
  StepCostModel free;
  free.Observe(2, 0.010);
  free.ObserveMixed(2, 64, 0.009);
  EXPECT_EQ(free.PromptTokensWithin(2, 0.030, 16), INT32_MAX);
}

}  // namespace
}  // namespace kiln
