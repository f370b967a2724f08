// The dynamic batcher's rules, driven with a fake clock (explicit time points).
#include "scheduler/batch_queue.h"

#include "gtest/gtest.h"

namespace kiln {
namespace {

using std::chrono::microseconds;

class FakeClock {
 public:
  SteadyClock::time_point now() const { return now_; }
  void Advance(microseconds d) { now_ += d; }

 private:
  SteadyClock::time_point now_ = SteadyClock::time_point(std::chrono::hours(1));
};

std::unique_ptr<InferenceRequest> Req(int64_t rows, std::string id = "", int64_t width = 16) {
  auto r = std::make_unique<InferenceRequest>();
  r->model_name = "m";
  r->id = std::move(id);
  r->batch_size = rows;
  r->inputs.push_back(HostTensor{"INPUT0", DataType::kInt32, {rows, width}, {}});
  return r;
}

config::DynamicBatchingConfig Batching(uint64_t delay_us, std::vector<int> preferred = {}) {
  config::DynamicBatchingConfig b;
  b.max_queue_delay_microseconds = delay_us;
  b.preferred_batch_size = std::move(preferred);
  return b;
}

std::vector<std::string> Ids(const std::vector<std::unique_ptr<InferenceRequest>>& batch) {
  std::vector<std::string> ids;
  for (const auto& r : batch) ids.push_back(r->id);
  return ids;
}

void Push(BatchQueue& q, std::unique_ptr<InferenceRequest> r, const FakeClock& clock) {
  ASSERT_TRUE(q.Enqueue(r, clock.now()).ok());
  ASSERT_EQ(r, nullptr);
}

TEST(BatchQueueTest, WithoutDynamicBatchingEachRequestRunsAlone) {
  FakeClock clock;
  BatchQueue q({8, std::nullopt});
  Push(q, Req(1, "a"), clock);
  Push(q, Req(1, "b"), clock);
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"a"}));
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"b"}));
  EXPECT_TRUE(q.Next(clock.now()).batch.empty());
}

TEST(BatchQueueTest, ZeroDelayTakesWhatIsQueued) {
  FakeClock clock;
  BatchQueue q({8, Batching(0)});
  Push(q, Req(1, "a"), clock);
  Push(q, Req(2, "b"), clock);
  auto d = q.Next(clock.now());
  EXPECT_EQ(Ids(d.batch), (std::vector<std::string>{"a", "b"}));
  EXPECT_FALSE(d.retry_at.has_value());
}

TEST(BatchQueueTest, PartialBatchWaitsForTheDelayOfItsOldestRequest) {
  FakeClock clock;
  BatchQueue q({8, Batching(100)});
  Push(q, Req(1, "a"), clock);
  clock.Advance(microseconds(40));
  Push(q, Req(1, "b"), clock);
  auto d = q.Next(clock.now());
  EXPECT_TRUE(d.batch.empty());
  ASSERT_TRUE(d.retry_at.has_value());
  EXPECT_EQ(*d.retry_at - clock.now(), microseconds(60));  // 100 us after "a"
  clock.Advance(microseconds(59));
  EXPECT_TRUE(q.Next(clock.now()).batch.empty());
  clock.Advance(microseconds(1));
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"a", "b"}));
}

TEST(BatchQueueTest, FullBatchGoesAtOnceAndNeverExceedsMax) {
  FakeClock clock;
  BatchQueue q({4, Batching(1'000'000)});
  Push(q, Req(2, "a"), clock);
  Push(q, Req(1, "b"), clock);
  Push(q, Req(2, "c"), clock);  // would make 5 > 4
  auto d = q.Next(clock.now());
  EXPECT_EQ(Ids(d.batch), (std::vector<std::string>{"a", "b"}));  // blocked by "c": send now
  d = q.Next(clock.now());
  EXPECT_TRUE(d.batch.empty());  // "c" alone (2 of 4) waits for the delay
  Push(q, Req(2, "d"), clock);
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"c", "d"}));  // full
}

TEST(BatchQueueTest, PreferredSizeSendsTheLargestReachableAtOnce) {
  FakeClock clock;
  BatchQueue q({16, Batching(1'000'000, {2, 4})});
  Push(q, Req(1, "a"), clock);
  EXPECT_TRUE(q.Next(clock.now()).batch.empty());
  Push(q, Req(1, "b"), clock);
  Push(q, Req(1, "c"), clock);
  // 3 queued: preferred 2 is reachable (a, b); 4 is not.
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"a", "b"}));
  Push(q, Req(1, "d"), clock);
  Push(q, Req(1, "e"), clock);
  Push(q, Req(1, "f"), clock);
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"c", "d", "e", "f"}));
}

TEST(BatchQueueTest, IncompatibleShapesEndTheBatch) {
  FakeClock clock;
  BatchQueue q({8, Batching(1'000'000)});
  Push(q, Req(1, "a", 16), clock);
  Push(q, Req(1, "b", 8), clock);
  Push(q, Req(1, "c", 16), clock);
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"a"}));
}

TEST(BatchQueueTest, HigherPriorityLevelGoesFirst) {
  FakeClock clock;
  auto b = Batching(0);
  b.priority_levels = 3;
  b.default_priority_level = 2;
  BatchQueue q({1, b});
  auto low = Req(1, "low");
  low->priority = 3;
  auto dflt = Req(1, "default");
  auto high = Req(1, "high");
  high->priority = 1;
  Push(q, std::move(low), clock);
  Push(q, std::move(dflt), clock);
  Push(q, std::move(high), clock);
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"high"}));
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"default"}));
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"low"}));
}

TEST(BatchQueueTest, PriorityOutOfRangeIsRejectedWithTheRange) {
  FakeClock clock;
  auto b = Batching(0);
  b.priority_levels = 2;
  b.default_priority_level = 1;
  BatchQueue q({8, b});
  auto r = Req(1);
  r->priority = 7;
  Status s = q.Enqueue(r, clock.now());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(StatusMessage(s).find("1 (highest) to 2"), std::string_view::npos) << s;
  EXPECT_NE(r, nullptr);  // the caller keeps a refused request
  EXPECT_EQ(q.size(), 0u);
}

TEST(BatchQueueTest, PriorityWithoutLevelsIsRejected) {
  FakeClock clock;
  BatchQueue q({8, Batching(0)});
  auto r = Req(1);
  r->priority = 1;
  EXPECT_EQ(q.Enqueue(r, clock.now()).code(), StatusCode::kInvalidArgument);
}

TEST(BatchQueueTest, FullQueueRefusesAtOnce) {
  FakeClock clock;
  auto b = Batching(1000);
  b.default_queue_policy.max_queue_size = 2;
  BatchQueue q({8, b});
  Push(q, Req(1), clock);
  Push(q, Req(1), clock);
  auto r = Req(1);
  Status s = q.Enqueue(r, clock.now());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(StatusMessage(s).find("max_queue_size 2"), std::string_view::npos);
}

TEST(BatchQueueTest, RejectPolicyTimesOutQueuedRequests) {
  FakeClock clock;
  auto b = Batching(0);
  b.default_queue_policy.default_timeout_microseconds = 500;
  BatchQueue q({8, b});
  Push(q, Req(1, "a"), clock);
  EXPECT_EQ(q.NextDeadline(), clock.now() + microseconds(500));
  clock.Advance(microseconds(499));
  EXPECT_TRUE(q.Expire(clock.now()).empty());
  clock.Advance(microseconds(1));
  auto expired = q.Expire(clock.now());
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].second.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(q.size(), 0u);
}

TEST(BatchQueueTest, TimeoutOverrideOnlyWhenAllowed) {
  FakeClock clock;
  auto b = Batching(0);
  b.default_queue_policy.default_timeout_microseconds = 0;
  BatchQueue strict({8, b});
  auto r = Req(1);
  r->timeout_us = 10;
  Push(strict, std::move(r), clock);
  EXPECT_FALSE(strict.NextDeadline().has_value());  // override ignored, as in Triton

  b.default_queue_policy.allow_timeout_override = true;
  BatchQueue lenient({8, b});
  r = Req(1);
  r->timeout_us = 10;
  Push(lenient, std::move(r), clock);
  EXPECT_EQ(lenient.NextDeadline(), clock.now() + microseconds(10));
}

TEST(BatchQueueTest, DelayPolicyDemotesExpiredRequestsBehindOthers) {
  FakeClock clock;
  auto b = Batching(0);
  b.default_queue_policy.timeout_action = config::QueuePolicy::TimeoutAction::kDelay;
  b.default_queue_policy.default_timeout_microseconds = 100;
  BatchQueue q({1, b});
  Push(q, Req(1, "old"), clock);
  clock.Advance(microseconds(150));
  Push(q, Req(1, "new"), clock);
  EXPECT_TRUE(q.Expire(clock.now()).empty());  // demoted, not rejected
  EXPECT_EQ(q.size(), 2u);
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"new"}));
  EXPECT_EQ(Ids(q.Next(clock.now()).batch), (std::vector<std::string>{"old"}));
}

TEST(BatchQueueTest, CancelledRequestsLeaveTheQueue) {
  FakeClock clock;
  BatchQueue q({8, Batching(1000)});
  auto r = Req(1, "gone");
  auto flag = r->cancel;
  Push(q, std::move(r), clock);
  Push(q, Req(1, "stays"), clock);
  flag->Cancel();
  auto expired = q.Expire(clock.now());
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first->id, "gone");
  EXPECT_EQ(expired[0].second.code(), StatusCode::kCancelled);
  EXPECT_EQ(q.size(), 1u);
}

}  // namespace
}  // namespace kiln
