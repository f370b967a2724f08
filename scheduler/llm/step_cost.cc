#include "scheduler/llm/step_cost.h"

#include <algorithm>
#include <climits>

namespace kiln {
namespace {
constexpr double kPriorPerRow = 0.25;  // an unmeasured row: a quarter of a one-row step
}  // namespace

void StepCostModel::Observe(int32_t rows, double seconds) {
  if (rows < 1 || rows > kRows || !(seconds > 0)) return;
  double& t = seconds_[static_cast<size_t>(rows)];
  t = t == 0 ? seconds : 0.9 * t + 0.1 * seconds;
}

void StepCostModel::ObserveMixed(int32_t decode_rows, int32_t prompt_tokens, double seconds) {
  if (decode_rows < 1 || prompt_tokens < kMinPromptTokens || !(seconds > 0)) return;
  const double base = DecodeSeconds(decode_rows);
  if (base <= 0) return;
  const double per_token = std::max(0.0, seconds - base) / prompt_tokens;
  // Mixed steps are rarer than decode-only ones: a faster average.
  prompt_token_seconds_ = mixed_seen_ ? 0.8 * prompt_token_seconds_ + 0.2 * per_token : per_token;
  mixed_seen_ = true;
}

double StepCostModel::Relative(int32_t rows) const {
  const double one = seconds_[1];
  // Unmeasured one-row step: the prior alone. Otherwise DecodeSeconds' interpolation, in
  // one-row steps (never below one).
  if (one <= 0) return 1 + kPriorPerRow * (std::clamp(rows, 1, kRows) - 1);
  return std::max(1.0, DecodeSeconds(rows) / one);
}

double StepCostModel::DecodeSeconds(int32_t rows) const {
  rows = std::clamp(rows, 1, kRows);
  auto t = [&](int32_t r) { return seconds_[static_cast<size_t>(r)]; };
  if (t(rows) > 0) return t(rows);
  int32_t lo = rows - 1, hi = rows + 1;
  while (lo >= 1 && t(lo) <= 0) --lo;
  while (hi <= kRows && t(hi) <= 0) ++hi;
  if (lo >= 1 && hi <= kRows) return t(lo) + (t(hi) - t(lo)) * (rows - lo) / (hi - lo);
  if (lo < 1 && hi > kRows) return 0;
  // One side only: the prior per row from the nearest measured count (in one-row steps, as
  // Relative counts them; the one-row step itself inferred by the prior if never measured).
  const int32_t r = lo >= 1 ? lo : hi;
  const double one = t(1) > 0 ? t(1) : t(r) / (1 + kPriorPerRow * (r - 1));
  return std::max(t(r) + kPriorPerRow * one * (rows - r), 0.0);
}

int32_t StepCostModel::PromptTokensWithin(int32_t decode_rows, double target_seconds,
                                          int32_t floor) {
  const double decode = DecodeSeconds(decode_rows);
  if (!mixed_seen_ || decode <= 0) return -1;  // unmeasured: no limit from the target
  // A row count never decoded alone: one decode-only step measures it (the header says why).
  const auto r = static_cast<size_t>(std::clamp(decode_rows, 1, kRows));
  if (seconds_[r] <= 0 && !probed_[r]) {
    probed_[r] = true;
    return 0;
  }
  if (prompt_token_seconds_ <= 0) return INT32_MAX;  // prompt tokens measured as free
  const double prompt_seconds = std::max(target_seconds - decode, kPromptShare * decode);
  const double room = prompt_seconds / prompt_token_seconds_;
  if (room >= static_cast<double>(INT32_MAX)) return INT32_MAX;
  return std::max(floor, static_cast<int32_t>(room + 1e-6));  // 19.999... is 20
}

}  // namespace kiln
