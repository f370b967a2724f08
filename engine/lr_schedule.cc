#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kiln {

namespace {
constexpr const char* kKindNames[] = {"constant", "linear", "cosine"};
}  // namespace

double LearningRate(const LrSchedule& schedule, int64_t step) {
  KILN_CHECK(step >= 1, "LearningRate: steps are 1-based");
  // transformers' lr_lambda(current_step) with current_step = step - 1 (the LambdaLR count
  // of scheduler steps taken before this optimizer step).
  const double s = static_cast<double>(step - 1);
  const double w = static_cast<double>(schedule.warmup_steps);
  const double n = static_cast<double>(schedule.total_steps);
  double factor = 1;
  if (s < w) {
    factor = s / std::max(1.0, w);
  } else if (schedule.kind == LrScheduleKind::kLinear) {
    factor = std::max(0.0, (n - s) / std::max(1.0, n - w));
  } else if (schedule.kind == LrScheduleKind::kCosine) {
    const double progress = (s - w) / std::max(1.0, n - w);
    constexpr double kNumCycles = 0.5;
    factor = std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * kNumCycles * 2.0 * progress)));
  }
  return schedule.lr * factor;
}

StatusOr<LrScheduleKind> ParseLrScheduleKind(std::string_view name) {
  for (int i = 0; i < 3; ++i) {
    if (name == kKindNames[i]) return static_cast<LrScheduleKind>(i);
  }
  return InvalidArgument("unknown learning-rate schedule '", name,
                         "' (allowed: \"constant\", \"linear\", \"cosine\")");
}

const char* LrScheduleKindName(LrScheduleKind kind) { return kKindNames[static_cast<int>(kind)]; }

}  // namespace kiln
