// Decoupled tensor models through Model and the dynamic batcher: responses through
// on_response before on_complete, the policy enforced, cancellation and shutdown.
#include <atomic>
#include <cstring>
#include <future>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "scheduler/model.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

template <typename T>
std::string Raw(const std::vector<T>& v) {
  std::string s(v.size() * sizeof(T), '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

config::ModelConfig RepeatConfig(int max_batch_size = 0) {
  config::ModelConfig c;
  c.name = "repeat_int32";
  c.kind = "builtin";
  c.builtin = "repeat_int32";
  c.max_batch_size = max_batch_size;
  return c;
}

// What a request to repeat_int32 got: its responses and, once it ended, its final status.
struct Received {
  absl::Mutex mu;
  std::vector<InferenceResponse> responses ABSL_GUARDED_BY(mu);
  bool response_after_completion ABSL_GUARDED_BY(mu) = false;
  bool completed ABSL_GUARDED_BY(mu) = false;
  std::promise<InferenceResponse> done;

  size_t count() {
    absl::MutexLock lock(&mu);
    return responses.size();
  }
};

std::unique_ptr<InferenceRequest> RepeatRequest(const std::vector<int32_t>& values,
                                                const std::vector<uint32_t>& delays, uint32_t wait,
                                                const std::shared_ptr<Received>& got) {
  auto r = std::make_unique<InferenceRequest>();
  r->model_name = "repeat_int32";
  const int64_t n = static_cast<int64_t>(values.size());
  r->inputs.push_back({"IN", DataType::kInt32, {n}, Raw(values)});
  r->inputs.push_back({"DELAY", DataType::kUint32, {n}, Raw(delays)});
  r->inputs.push_back({"WAIT", DataType::kUint32, {1}, Raw<uint32_t>({wait})});
  if (got) {
    r->on_response = [got](InferenceResponse&& resp) {
      absl::MutexLock lock(&got->mu);
      if (got->completed) got->response_after_completion = true;
      got->responses.push_back(std::move(resp));
    };
    r->on_complete = [got](InferenceResponse&& resp) {
      {
        absl::MutexLock lock(&got->mu);
        got->completed = true;
      }
      got->done.set_value(std::move(resp));
    };
  }
  return r;
}

TEST(DecoupledTest, ResponsesArriveInOrderThenTheRequestEnds) {
  auto model = Model::Load(RepeatConfig(), {});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE((*model)->signature().decoupled);
  auto got = std::make_shared<Received>();
  auto req = RepeatRequest({7, 8, 9}, {0, 10, 0}, 0, got);
  req->requested_outputs = {"OUT"};  // IDX left out
  ASSERT_TRUE((*model)->Infer(req).ok());
  InferenceResponse end = got->done.get_future().get();
  EXPECT_TRUE(end.status.ok()) << end.status;
  EXPECT_TRUE(end.outputs.empty());
  absl::MutexLock lock(&got->mu);
  ASSERT_EQ(got->responses.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const InferenceResponse& r = got->responses[i];
    ASSERT_EQ(r.outputs.size(), 1u);
    EXPECT_EQ(r.outputs[0].name, "OUT");
    int32_t v;
    std::memcpy(&v, r.outputs[0].data.data(), 4);
    EXPECT_EQ(v, 7 + i);
    EXPECT_FALSE(r.final);
  }
  EXPECT_FALSE(got->response_after_completion);
  EXPECT_EQ((*model)->Stats().success.count, 1u);
}

TEST(DecoupledTest, RequestWithoutAResponseSinkIsRefused) {
  auto model = Model::Load(RepeatConfig(), {});
  ASSERT_TRUE(model.ok());
  auto req = RepeatRequest({1}, {0}, 0, nullptr);
  req->on_complete = [](InferenceResponse&&) {};
  Status s = (*model)->Infer(req);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(StatusMessage(s).find("decoupled"), std::string_view::npos) << s;
  ASSERT_NE(req, nullptr) << "a refused request stays the caller's";
}

TEST(DecoupledTest, ValuesTheModelRefusesFailAtAdmission) {
  auto model = Model::Load(RepeatConfig(), {});
  ASSERT_TRUE(model.ok());
  auto got = std::make_shared<Received>();
  auto req = RepeatRequest({1}, {60'000}, 0, got);
  Status s = (*model)->Infer(req);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(StatusMessage(s).find("input 'DELAY' element 0 is 60000 ms"), std::string_view::npos)
      << s;
}

TEST(DecoupledTest, BatchingADecoupledModelIsAConfigError) {
  auto model = Model::Load(RepeatConfig(/*max_batch_size=*/4), {});
  ASSERT_FALSE(model.ok());
  EXPECT_NE(StatusMessage(model.status()).find("set max_batch_size: 0"), std::string_view::npos)
      << model.status();
}

TEST(DecoupledTest, CancellingStopsTheModelAndItKeepsServing) {
  auto model = Model::Load(RepeatConfig(), {});
  ASSERT_TRUE(model.ok());
  auto got = std::make_shared<Received>();
  auto req = RepeatRequest({1, 2, 3}, {0, 5000, 5000}, 0, got);
  auto flag = req->cancel;
  const auto start = SteadyClock::now();
  ASSERT_TRUE((*model)->Infer(req).ok());
  while (got->count() < 1) std::this_thread::sleep_for(1ms);
  flag->Cancel();
  (*model)->WakeUp();
  InferenceResponse end = got->done.get_future().get();
  EXPECT_EQ(end.status.code(), StatusCode::kCancelled) << end.status;
  EXPECT_LT(SteadyClock::now() - start, 2s) << "the model did not stop on cancellation";
  EXPECT_EQ(got->count(), 1u);

  auto next = std::make_shared<Received>();
  auto req2 = RepeatRequest({4}, {0}, 0, next);
  ASSERT_TRUE((*model)->Infer(req2).ok());
  EXPECT_TRUE(next->done.get_future().get().status.ok());
  EXPECT_EQ(next->count(), 1u);
}

TEST(DecoupledTest, DrainCutsOffARunningRequestAndNoResponseFollows) {
  auto model = Model::Load(RepeatConfig(), {});
  ASSERT_TRUE(model.ok());
  auto got = std::make_shared<Received>();
  // Responses every few ms for a long while: Drain lands between two of them.
  std::vector<int32_t> values(400, 5);
  std::vector<uint32_t> delays(400, 5);
  auto req = RepeatRequest(values, delays, 0, got);
  ASSERT_TRUE((*model)->Infer(req).ok());
  while (got->count() < 3) std::this_thread::sleep_for(1ms);
  EXPECT_EQ((*model)->Drain(SteadyClock::now()), 1);
  InferenceResponse end = got->done.get_future().get();
  EXPECT_EQ(end.status.code(), StatusCode::kUnavailable) << end.status;
  const size_t at_drain = got->count();
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(got->count(), at_drain);
  absl::MutexLock lock(&got->mu);
  EXPECT_FALSE(got->response_after_completion);
  EXPECT_LT(got->responses.size(), 400u);
}

}  // namespace
}  // namespace kiln
