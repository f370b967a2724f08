// Learning-rate schedules against transformers' lr_lambda functions, evaluated by hand.
#include "engine/lr_schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <numbers>

#include "engine/testing/source_dir.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// transformers: LambdaLR's lr for the step-th optimizer step is lr * lr_lambda(step - 1).
TEST(LrScheduleTest, WarmupRampsLinearlyFromZeroForEveryKind) {
  for (LrScheduleKind k :
       {LrScheduleKind::kConstant, LrScheduleKind::kLinear, LrScheduleKind::kCosine}) {
    const LrSchedule s{k, 0.1, 4, 20};
    EXPECT_DOUBLE_EQ(LearningRate(s, 1), 0.0) << LrScheduleKindName(k);  // lr_lambda(0) = 0
    EXPECT_DOUBLE_EQ(LearningRate(s, 2), 0.1 * 1 / 4);
    EXPECT_DOUBLE_EQ(LearningRate(s, 4), 0.1 * 3 / 4);
    EXPECT_DOUBLE_EQ(LearningRate(s, 5), 0.1);  // warmup done: the peak
  }
}

TEST(LrScheduleTest, ConstantStaysAtThePeak) {
  const LrSchedule s{LrScheduleKind::kConstant, 3e-4, 0, 10};
  for (int64_t step : {1, 2, 10, 1000}) EXPECT_DOUBLE_EQ(LearningRate(s, step), 3e-4);
}

TEST(LrScheduleTest, LinearDecaysToZeroAtTheLastStep) {
  const LrSchedule s{LrScheduleKind::kLinear, 1.0, 2, 12};
  // max(0, (n - s) / max(1, n - w)) with s = step - 1
  EXPECT_DOUBLE_EQ(LearningRate(s, 3), 10.0 / 10);
  EXPECT_DOUBLE_EQ(LearningRate(s, 8), 5.0 / 10);
  EXPECT_DOUBLE_EQ(LearningRate(s, 12), 1.0 / 10);
  EXPECT_DOUBLE_EQ(LearningRate(s, 13), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(s, 50), 0.0);  // clamped
  // No warmup: the first step is the peak.
  EXPECT_DOUBLE_EQ(LearningRate({LrScheduleKind::kLinear, 2.0, 0, 4}, 1), 2.0);
}

TEST(LrScheduleTest, CosineFollowsHalfACosineWave) {
  const LrSchedule s{LrScheduleKind::kCosine, 1.0, 10, 110};
  EXPECT_DOUBLE_EQ(LearningRate(s, 11), 1.0);
  EXPECT_NEAR(LearningRate(s, 61), 0.5, 1e-15);  // half way: cos(pi / 2) = 0
  const double progress = 25.0 / 100;
  EXPECT_DOUBLE_EQ(LearningRate(s, 36),
                   0.5 * (1 + std::cos(std::numbers::pi * 0.5 * 2.0 * progress)));
  EXPECT_NEAR(LearningRate(s, 111), 0.0, 1e-15);
}

TEST(LrScheduleTest, ParsesTheNamesAndRejectsOthers) {
  EXPECT_EQ(*ParseLrScheduleKind("constant"), LrScheduleKind::kConstant);
  EXPECT_EQ(*ParseLrScheduleKind("linear"), LrScheduleKind::kLinear);
  EXPECT_EQ(*ParseLrScheduleKind("cosine"), LrScheduleKind::kCosine);
  for (LrScheduleKind k :
       {LrScheduleKind::kConstant, LrScheduleKind::kLinear, LrScheduleKind::kCosine}) {
    EXPECT_EQ(*ParseLrScheduleKind(LrScheduleKindName(k)), k);
  }
  const auto bad = ParseLrScheduleKind("cosine_with_restarts");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              AllOf(HasSubstr("'cosine_with_restarts'"), HasSubstr("\"constant\""),
                    HasSubstr("\"linear\""), HasSubstr("\"cosine\"")));
}

// transformers' real schedulers stepped as its Trainer steps them
// (scripts/fixtures/make_optimizer_fixtures.py).
TEST(LrScheduleTest, MatchesTransformersSchedulers) {
  std::ifstream f(std::string(TestSourceDir()) + "/tests/fixtures/training/optimizers.json");
  ASSERT_TRUE(f.good()) << "tests/fixtures/training/optimizers.json is missing";
  const nlohmann::json d = nlohmann::json::parse(f);
  ASSERT_GE(d["schedules"].size(), 3u);
  for (const nlohmann::json& c : d["schedules"]) {
    const LrSchedule s{*ParseLrScheduleKind(c["kind"].get<std::string>()), c["lr"].get<double>(),
                       c["warmup_steps"].get<int64_t>(), c["total_steps"].get<int64_t>()};
    const std::vector<double> lrs = c["lrs"].get<std::vector<double>>();
    for (size_t i = 0; i < lrs.size(); ++i) {
      EXPECT_NEAR(LearningRate(s, static_cast<int64_t>(i) + 1), lrs[i], 1e-15)
          << c["kind"] << " warmup " << s.warmup_steps << " step " << i + 1;
    }
  }
}

}  // namespace
}  // namespace kiln
