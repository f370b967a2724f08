#include "scheduler/dynamic_batcher.h"

#include <cstring>
#include <future>

#include "gtest/gtest.h"
#include "scheduler/model.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

std::string Int32Raw(const std::vector<int32_t>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}
std::vector<int32_t> Int32s(const std::string& s) {
  std::vector<int32_t> v(s.size() / 4);
  std::memcpy(v.data(), s.data(), s.size());
  return v;
}

// A request to `simple` whose result arrives on a future.
std::pair<std::unique_ptr<InferenceRequest>, std::future<InferenceResponse>> SimpleRequest(
    int32_t base, int64_t rows = 1) {
  auto r = std::make_unique<InferenceRequest>();
  r->model_name = "simple";
  std::vector<int32_t> a(16 * rows), b(16 * rows);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = base + static_cast<int32_t>(i);
    b[i] = 1;
  }
  r->inputs.push_back({"INPUT0", DataType::kInt32, {rows, 16}, Int32Raw(a)});
  r->inputs.push_back({"INPUT1", DataType::kInt32, {rows, 16}, Int32Raw(b)});
  auto promise = std::make_shared<std::promise<InferenceResponse>>();
  auto future = promise->get_future();
  r->on_complete = [promise](InferenceResponse&& resp) { promise->set_value(std::move(resp)); };
  return {std::move(r), std::move(future)};
}

config::ModelConfig SimpleConfig(uint64_t delay_us, int instances = 1) {
  config::ModelConfig c;
  c.name = "simple";
  c.kind = "builtin";
  c.builtin = "simple";
  c.max_batch_size = 8;
  c.instance_count = instances;
  c.dynamic_batching.emplace();
  c.dynamic_batching->max_queue_delay_microseconds = delay_us;
  return c;
}

TEST(DynamicBatcherTest, ConcurrentRequestsAreBatchedAndEachGetsItsOwnResult) {
  auto model = Model::Load(SimpleConfig(/*delay_us=*/20'000), {});
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::future<InferenceResponse>> futures;
  for (int i = 0; i < 16; ++i) {
    auto [req, fut] = SimpleRequest(i * 100, /*rows=*/1 + i % 2);
    ASSERT_TRUE((*model)->Infer(req).ok());
    futures.push_back(std::move(fut));
  }
  for (int i = 0; i < 16; ++i) {
    InferenceResponse resp = futures[i].get();
    ASSERT_TRUE(resp.status.ok()) << resp.status;
    ASSERT_EQ(resp.outputs.size(), 2u);
    const int64_t rows = 1 + i % 2;
    EXPECT_EQ(resp.outputs[0].shape, (std::vector<int64_t>{rows, 16}));
    auto sum = Int32s(resp.outputs[0].data);
    auto diff = Int32s(resp.outputs[1].data);
    ASSERT_EQ(sum.size(), static_cast<size_t>(16 * rows));
    for (size_t k = 0; k < sum.size(); ++k) {
      EXPECT_EQ(sum[k], i * 100 + static_cast<int32_t>(k) + 1);
      EXPECT_EQ(diff[k], i * 100 + static_cast<int32_t>(k) - 1);
    }
  }
  auto stats = (*model)->Stats();
  EXPECT_EQ(stats.inference_count, 24u);  // 8 requests of 1 row + 8 of 2
  EXPECT_LT(stats.execution_count, 16u) << "requests queued together were not batched";
  EXPECT_EQ(stats.success.count, 16u);
  uint64_t executions = 0;
  for (const auto& [size, b] : stats.batches) {
    EXPECT_LE(size, 8u);
    executions += b.compute_infer.count;
  }
  EXPECT_EQ(executions, stats.execution_count);
}

TEST(DynamicBatcherTest, RequestedOutputSubsetInRequestedOrder) {
  auto model = Model::Load(SimpleConfig(0), {});
  ASSERT_TRUE(model.ok());
  auto [req, fut] = SimpleRequest(5);
  req->requested_outputs = {"OUTPUT1"};
  ASSERT_TRUE((*model)->Infer(req).ok());
  auto resp = fut.get();
  ASSERT_TRUE(resp.status.ok());
  ASSERT_EQ(resp.outputs.size(), 1u);
  EXPECT_EQ(resp.outputs[0].name, "OUTPUT1");
  EXPECT_EQ(Int32s(resp.outputs[0].data)[0], 4);
}

config::ModelConfig SleepConfig(uint64_t delay_us) {
  config::ModelConfig c;
  c.name = "sleep";
  c.kind = "builtin";
  c.builtin = "sleep_us";
  c.max_batch_size = 1;
  c.dynamic_batching.emplace();
  c.dynamic_batching->max_queue_delay_microseconds = delay_us;
  return c;
}

std::pair<std::unique_ptr<InferenceRequest>, std::future<InferenceResponse>> SleepRequest(
    int32_t us) {
  auto r = std::make_unique<InferenceRequest>();
  r->model_name = "sleep";
  r->inputs.push_back({"SLEEP_US", DataType::kInt32, {1, 1}, Int32Raw({us})});
  auto promise = std::make_shared<std::promise<InferenceResponse>>();
  auto future = promise->get_future();
  r->on_complete = [promise](InferenceResponse&& resp) { promise->set_value(std::move(resp)); };
  return {std::move(r), std::move(future)};
}

TEST(DynamicBatcherTest, CancelledQueuedRequestLeavesPromptly) {
  auto model = Model::Load(SleepConfig(0), {});
  ASSERT_TRUE(model.ok());
  auto [busy, busy_fut] = SleepRequest(300'000);  // occupies the only instance
  ASSERT_TRUE((*model)->Infer(busy).ok());
  ASSERT_TRUE((*model)->AwaitExecuting(1, absl::Seconds(10)));
  auto [queued, queued_fut] = SleepRequest(1);
  auto flag = queued->cancel;
  ASSERT_TRUE((*model)->Infer(queued).ok());
  const auto start = SteadyClock::now();
  flag->Cancel();
  (*model)->WakeUp();
  ASSERT_EQ(queued_fut.wait_for(100ms), std::future_status::ready)
      << "cancelled request stayed queued behind the running one";
  EXPECT_EQ(queued_fut.get().status.code(), StatusCode::kCancelled);
  EXPECT_LT(SteadyClock::now() - start, 100ms);
  EXPECT_TRUE(busy_fut.get().status.ok());
}

TEST(DynamicBatcherTest, DrainFinishesInFlightWorkBeforeTheDeadline) {
  auto model = Model::Load(SleepConfig(0), {});
  ASSERT_TRUE(model.ok());
  auto [a, fa] = SleepRequest(50'000);
  auto [b, fb] = SleepRequest(50'000);
  ASSERT_TRUE((*model)->Infer(a).ok());
  ASSERT_TRUE((*model)->Infer(b).ok());
  EXPECT_EQ((*model)->Drain(SteadyClock::now() + 5s), 0);
  EXPECT_TRUE(fa.get().status.ok());
  EXPECT_TRUE(fb.get().status.ok());
  auto [c, fc] = SleepRequest(1);
  Status s = (*model)->Infer(c);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << "a draining model accepted new work";
}

TEST(DynamicBatcherTest, DrainCutsOffWhatIsLeftAtTheDeadline) {
  auto model = Model::Load(SleepConfig(0), {});
  ASSERT_TRUE(model.ok());
  auto [running, fr] = SleepRequest(400'000);
  auto [queued, fq] = SleepRequest(1);
  ASSERT_TRUE((*model)->Infer(running).ok());
  ASSERT_TRUE((*model)->AwaitExecuting(1, absl::Seconds(10)));
  ASSERT_TRUE((*model)->Infer(queued).ok());
  const auto start = SteadyClock::now();
  EXPECT_EQ((*model)->Drain(SteadyClock::now() + 50ms), 2);
  EXPECT_LT(SteadyClock::now() - start, 300ms);
  auto r1 = fr.get(), r2 = fq.get();
  EXPECT_EQ(r1.status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(r2.status.code(), StatusCode::kUnavailable);
  // The running request's late result must not complete it a second time (the promise
  // would throw): releasing the model joins its worker after that result.
  model->reset();
}

TEST(DynamicBatcherTest, TwoInstancesRunInParallel) {
  auto cfg = SleepConfig(0);
  cfg.instance_count = 2;
  auto model = Model::Load(cfg, {});
  ASSERT_TRUE(model.ok());
  const auto start = SteadyClock::now();
  auto [a, fa] = SleepRequest(200'000);
  auto [b, fb] = SleepRequest(200'000);
  ASSERT_TRUE((*model)->Infer(a).ok());
  ASSERT_TRUE((*model)->Infer(b).ok());
  fa.get();
  fb.get();
  EXPECT_LT(SteadyClock::now() - start, 380ms) << "instances did not overlap";
}

// ---- Request validation -------------------------------------------------------------------

ModelSignature SimpleSignature() {
  return {"simple",
          8,
          {{"INPUT0", DataType::kInt32, {16}}, {"INPUT1", DataType::kInt32, {16}}},
          {{"OUTPUT0", DataType::kInt32, {16}}, {"OUTPUT1", DataType::kInt32, {16}}}};
}

// Requests hold an atomic, so tests pass them around by pointer.
std::unique_ptr<InferenceRequest> ValidSimplePtr() {
  auto r = std::make_unique<InferenceRequest>();
  r->model_name = "simple";
  r->inputs.push_back({"INPUT1", DataType::kInt32, {2, 16}, std::string(128, '\0')});
  r->inputs.push_back({"INPUT0", DataType::kInt32, {2, 16}, std::string(128, '\0')});
  return r;
}

std::string Error(InferenceRequest& r) {
  Status s = PrepareRequest(SimpleSignature(), r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  return std::string(StatusMessage(s));
}

TEST(PrepareRequestTest, ReordersInputsAndSetsBatchSize) {
  auto holder = ValidSimplePtr();
  auto& r = *holder;
  ASSERT_TRUE(PrepareRequest(SimpleSignature(), r).ok());
  EXPECT_EQ(r.inputs[0].name, "INPUT0");
  EXPECT_EQ(r.batch_size, 2);
}

TEST(PrepareRequestTest, WrongDatatype) {
  auto holder = ValidSimplePtr();
  auto& r = *holder;
  r.inputs[0].datatype = DataType::kFp32;
  EXPECT_EQ(Error(r), "input 'INPUT1' has datatype FP32 but model 'simple' expects INT32");
}

TEST(PrepareRequestTest, ShapeMismatch) {
  auto holder = ValidSimplePtr();
  auto& r = *holder;
  r.inputs[0].shape = {2, 15};
  r.inputs[0].data.resize(120);
  EXPECT_NE(Error(r).find("has shape [2, 15] but model 'simple' expects [-1, 16]"),
            std::string::npos);
}

TEST(PrepareRequestTest, BatchTooLarge) {
  auto holder = ValidSimplePtr();
  auto& r = *holder;
  for (auto& t : r.inputs) {
    t.shape = {9, 16};
    t.data.resize(9 * 64);
  }
  EXPECT_NE(Error(r).find("batch size 9"), std::string::npos);
}

TEST(PrepareRequestTest, BatchSizesDisagree) {
  auto holder = ValidSimplePtr();
  auto& r = *holder;
  r.inputs[1].shape = {1, 16};
  r.inputs[1].data.resize(64);
  EXPECT_NE(Error(r).find("disagree on the batch size"), std::string::npos);
}

TEST(PrepareRequestTest, MissingUnknownAndDuplicateInputs) {
  auto r = ValidSimplePtr();
  r->inputs.pop_back();
  EXPECT_EQ(Error(*r), "missing input 'INPUT0': model 'simple' expects INPUT0, INPUT1");
  r = ValidSimplePtr();
  r->inputs[0].name = "INPUT9";
  EXPECT_EQ(Error(*r), "model 'simple' has no input 'INPUT9'; its inputs are INPUT0, INPUT1");
  r = ValidSimplePtr();
  r->inputs[0].name = "INPUT0";
  EXPECT_EQ(Error(*r), "input 'INPUT0' is given more than once");
}

TEST(PrepareRequestTest, RawContentsOfTheWrongByteSize) {
  auto holder = ValidSimplePtr();
  auto& r = *holder;
  r.inputs[0].data.resize(127);
  EXPECT_EQ(Error(r),
            "input 'INPUT1' has 127 bytes of contents but shape [2, 16] of INT32 needs 128");
}

TEST(PrepareRequestTest, HugeShapeDoesNotOverflow) {
  auto holder = ValidSimplePtr();
  auto& r = *holder;
  r.inputs[0].shape = {2, 16};
  ModelSignature sig = SimpleSignature();
  sig.inputs[1].dims = {-1};  // INPUT1 of any length
  r.inputs[0].shape = {1, 1ll << 62};
  Status s = PrepareRequest(sig, r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

TEST(PrepareRequestTest, UnknownAndDuplicateOutputs) {
  auto r = ValidSimplePtr();
  r->requested_outputs = {"OUTPUT3"};
  EXPECT_EQ(Error(*r), "model 'simple' has no output 'OUTPUT3'; its outputs are OUTPUT0, OUTPUT1");
  r = ValidSimplePtr();
  r->requested_outputs = {"OUTPUT0", "OUTPUT0"};
  EXPECT_EQ(Error(*r), "output 'OUTPUT0' is requested more than once");
}

TEST(PrepareRequestTest, BytesElementCountMustMatchShape) {
  ModelSignature sig{"s", 0, {{"IN", DataType::kBytes, {2}}}, {{"OUT", DataType::kBytes, {2}}}};
  auto holder = std::make_unique<InferenceRequest>();
  auto& r = *holder;
  std::string raw;
  uint32_t n = 1;
  raw.append(reinterpret_cast<const char*>(&n), 4);
  raw += "x";
  r.inputs.push_back({"IN", DataType::kBytes, {2}, raw});
  Status s = PrepareRequest(sig, r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(StatusMessage(s).find("holds 1 BYTES elements"), std::string_view::npos) << s;
}

}  // namespace
}  // namespace kiln
