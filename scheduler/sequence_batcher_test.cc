// The sequence batcher's rules, driven with a fake clock (SequenceQueue), and end to end
// through Model::Load with the built-in simple_sequence and a stateful test model.
#include "scheduler/sequence_batcher.h"

#include <cstring>
#include <future>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/dynamic_batcher.h"
#include "scheduler/model.h"

namespace kiln {
namespace {

using std::chrono::microseconds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Strategy = config::SequenceBatchingConfig::Strategy;
using Kind = config::SequenceControlConfig::Kind;

SteadyClock::time_point T0() { return SteadyClock::time_point(std::chrono::hours(1)); }

config::SequenceControlInput Control(std::string name, Kind kind) {
  config::SequenceControlConfig c;
  c.kind = kind;
  if (kind == Kind::kCorrid) {
    c.data_type = "TYPE_UINT64";
  } else {
    c.int32_false_true = {0, 1};
  }
  return {std::move(name), {c}};
}

// A model with INPUT plus every control, so the controls each request gets are visible.
std::vector<TensorSpec> ModelInputs() {
  return {{"INPUT", DataType::kInt32, {1}},
          {"START", DataType::kInt32, {1}},
          {"END", DataType::kInt32, {1}},
          {"READY", DataType::kInt32, {1}},
          {"CORRID", DataType::kUint64, {1}}};
}

config::SequenceBatchingConfig Config(Strategy strategy = Strategy::kDirect) {
  config::SequenceBatchingConfig c;
  c.strategy = strategy;
  c.max_sequence_idle_microseconds = 1000;
  c.control_input = {Control("START", Kind::kStart), Control("END", Kind::kEnd),
                     Control("READY", Kind::kReady), Control("CORRID", Kind::kCorrid)};
  return c;
}

std::unique_ptr<SequenceQueue> Queue(config::SequenceBatchingConfig c, int max_batch_size = 2,
                                     int instances = 1) {
  auto q = SequenceQueue::Create({"m", std::move(c), max_batch_size, instances, ModelInputs()});
  KILN_CHECK(q.ok(), "test queue");
  return *std::move(q);
}

std::unique_ptr<InferenceRequest> Req(uint64_t seq, int32_t value, bool start = false,
                                      bool end = false) {
  auto r = std::make_unique<InferenceRequest>();
  r->model_name = "m";
  r->id = std::to_string(seq) + ":" + std::to_string(value);
  r->sequence.id = seq;
  r->sequence.start = start;
  r->sequence.end = end;
  std::string data(4, '\0');
  std::memcpy(data.data(), &value, 4);
  r->inputs.push_back(HostTensor{"INPUT", DataType::kInt32, {1, 1}, data});
  return r;
}

Status Push(SequenceQueue& q, std::unique_ptr<InferenceRequest> r,
            SteadyClock::time_point now = T0()) {
  return q.Enqueue(r, now);
}

std::vector<std::string> Ids(const std::vector<std::unique_ptr<InferenceRequest>>& batch) {
  std::vector<std::string> ids;
  for (const auto& r : batch) ids.push_back(r->id);
  return ids;
}

template <typename T>
T Scalar(const InferenceRequest& r, const std::string& name) {
  for (const HostTensor& t : r.inputs) {
    if (t.name == name) {
      T v;
      std::memcpy(&v, t.data.data(), sizeof(T));
      return v;
    }
  }
  ADD_FAILURE() << "no input " << name;
  return T{};
}

TEST(SequenceQueueTest, ControlsAreAddedInDeclaredOrder) {
  auto q = Queue(Config());
  ASSERT_TRUE(Push(*q, Req(7, 5, /*start=*/true)).ok());
  auto d = q->Next(T0(), 0);
  ASSERT_EQ(d.batch.size(), 1u);
  const InferenceRequest& r = *d.batch[0];
  std::vector<std::string> names;
  for (const HostTensor& t : r.inputs) names.push_back(t.name);
  EXPECT_THAT(names, ElementsAre("INPUT", "START", "END", "READY", "CORRID"));
  EXPECT_EQ(Scalar<int32_t>(r, "START"), 1);
  EXPECT_EQ(Scalar<int32_t>(r, "END"), 0);
  EXPECT_EQ(Scalar<int32_t>(r, "READY"), 1);
  EXPECT_EQ(Scalar<uint64_t>(r, "CORRID"), 7u);
  EXPECT_EQ(r.inputs[1].shape, (std::vector<int64_t>{1, 1}));
}

TEST(SequenceQueueTest, OneRequestOfASequenceAtATimeInOrder) {
  auto q = Queue(Config());
  ASSERT_TRUE(Push(*q, Req(1, 10, true)).ok());
  ASSERT_TRUE(Push(*q, Req(1, 11)).ok());
  ASSERT_TRUE(Push(*q, Req(1, 12, false, true)).ok());
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("1:10"));
  // The next request waits for the running one, even though the instance asks again.
  EXPECT_TRUE(q->Next(T0(), 0).batch.empty());
  q->Finished(0, T0());
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("1:11"));
  q->Finished(0, T0());
  auto last = q->Next(T0(), 0);
  ASSERT_THAT(Ids(last.batch), ElementsAre("1:12"));
  EXPECT_EQ(Scalar<int32_t>(*last.batch[0], "END"), 1);
  EXPECT_EQ(q->active_sequences(), 1u);  // until its END has run
  q->Finished(0, T0());
  EXPECT_EQ(q->active_sequences(), 0u);
  EXPECT_EQ(q->size(), 0u);
}

TEST(SequenceQueueTest, DirectBatchesOneRequestPerSlotAndQueuesSequencesBeyondTheSlots) {
  auto q = Queue(Config(), /*max_batch_size=*/2);
  ASSERT_TRUE(Push(*q, Req(1, 1, true)).ok());
  ASSERT_TRUE(Push(*q, Req(2, 2, true)).ok());
  ASSERT_TRUE(Push(*q, Req(3, 3, true)).ok());  // both slots taken: waits for one
  ASSERT_TRUE(Push(*q, Req(1, 4, false, true)).ok());
  EXPECT_EQ(q->SlotOf(Req(1, 0)->sequence), 0);
  EXPECT_EQ(q->SlotOf(Req(2, 0)->sequence), 1);
  EXPECT_EQ(q->SlotOf(Req(3, 0)->sequence), -1);
  EXPECT_EQ(q->waiting_sequences(), 1u);
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("1:1", "2:2"));
  q->Finished(0, T0());
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("1:4"));
  q->Finished(0, T0());  // sequence 1 ended: its slot goes to sequence 3
  EXPECT_EQ(q->SlotOf(Req(3, 0)->sequence), 0);
  EXPECT_EQ(q->waiting_sequences(), 0u);
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("3:3"));
}

TEST(SequenceQueueTest, DirectSlotsBelongToInstances) {
  auto q = Queue(Config(), /*max_batch_size=*/1, /*instances=*/2);
  ASSERT_TRUE(Push(*q, Req(1, 1, true)).ok());
  ASSERT_TRUE(Push(*q, Req(2, 2, true)).ok());
  EXPECT_THAT(Ids(q->Next(T0(), 1).batch), ElementsAre("2:2"));
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("1:1"));
  ASSERT_TRUE(Push(*q, Req(1, 3)).ok());
  EXPECT_TRUE(q->Next(T0(), 1).batch.empty());  // sequence 1 lives on instance 0
  q->Finished(0, T0());
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("1:3"));
}

TEST(SequenceQueueTest, StartAndEndRules) {
  auto q = Queue(Config());
  Status s = Push(*q, Req(5, 1));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(s), HasSubstr("sequence 5 to model 'm' must specify the START flag"));
  auto no_id = Req(0, 1, true);
  s = q->Enqueue(no_id, T0());
  EXPECT_THAT(StatusMessage(s), HasSubstr("non-zero or non-empty correlation ID"));
  EXPECT_NE(no_id, nullptr);  // the caller keeps a refused request
  auto rows = Req(6, 1, true);
  rows->batch_size = 2;
  EXPECT_THAT(StatusMessage(q->Enqueue(rows, T0())), HasSubstr("batch size 2"));
  auto text = Req(0, 1, true);
  text->sequence.string_id = "abc";
  EXPECT_THAT(StatusMessage(q->Enqueue(text, T0())),
              HasSubstr("takes integer sequence ids (its CORRID control input 'CORRID' is UINT64"));

  // After END is queued, the sequence takes only a new START.
  ASSERT_TRUE(Push(*q, Req(5, 1, true, true)).ok());
  EXPECT_THAT(StatusMessage(Push(*q, Req(5, 2))), HasSubstr("must specify the START flag"));
  ASSERT_TRUE(Push(*q, Req(5, 3, true)).ok());  // restarts it, in the same slot
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("5:1"));
  q->Finished(0, T0());
  EXPECT_EQ(q->active_sequences(), 1u);
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("5:3"));
}

TEST(SequenceQueueTest, IdleSequenceIsReleasedAndItsSlotReused) {
  auto q = Queue(Config(), /*max_batch_size=*/1);  // one slot
  ASSERT_TRUE(Push(*q, Req(1, 1, true)).ok());
  ASSERT_TRUE(q->Next(T0(), 0).batch.size() == 1);
  q->Finished(0, T0());
  ASSERT_TRUE(Push(*q, Req(2, 2, true), T0() + microseconds(10)).ok());  // waits for the slot
  EXPECT_EQ(q->NextDeadline(), T0() + microseconds(1000));
  EXPECT_TRUE(q->Expire(T0() + microseconds(999)).empty());
  EXPECT_EQ(q->active_sequences(), 2u);
  q->Expire(T0() + microseconds(1000));
  EXPECT_EQ(q->active_sequences(), 1u);
  EXPECT_EQ(q->SlotOf(Req(2, 0)->sequence), 0);
  EXPECT_THAT(StatusMessage(Push(*q, Req(1, 3), T0() + microseconds(1001))),
              HasSubstr("released after 1000 us without requests"));
  EXPECT_THAT(Ids(q->Next(T0() + microseconds(1001), 0).batch), ElementsAre("2:2"));
}

TEST(SequenceQueueTest, RunningSequenceIsNotIdle) {
  auto q = Queue(Config());
  ASSERT_TRUE(Push(*q, Req(1, 1, true)).ok());
  ASSERT_EQ(q->Next(T0(), 0).batch.size(), 1u);
  EXPECT_EQ(q->NextDeadline(), std::nullopt);
  q->Expire(T0() + microseconds(5000));
  EXPECT_EQ(q->active_sequences(), 1u);
  q->Finished(0, T0() + microseconds(5000));  // the idle clock starts when it finished
  EXPECT_EQ(q->NextDeadline(), T0() + microseconds(6000));
}

TEST(SequenceQueueTest, CancelledRequestLeavesTheQueue) {
  auto q = Queue(Config());
  auto r = Req(1, 1, true);
  auto cancel = r->cancel;
  ASSERT_TRUE(Push(*q, std::move(r)).ok());
  cancel->Cancel();
  auto expired = q->Expire(T0());
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].second.code(), StatusCode::kCancelled);
  EXPECT_EQ(q->size(), 0u);
}

TEST(SequenceQueueTest, OldestBatchesAcrossSequencesOldestFirst) {
  config::SequenceBatchingConfig c = Config(Strategy::kOldest);
  c.oldest_max_candidate_sequences = 3;
  c.oldest_max_queue_delay_microseconds = 100;
  auto q = Queue(c, /*max_batch_size=*/2);
  ASSERT_TRUE(Push(*q, Req(1, 1, true), T0() + microseconds(2)).ok());
  ASSERT_TRUE(Push(*q, Req(2, 2, true), T0() + microseconds(1)).ok());
  // Two of three candidates ready but the batch (2) is full: sent, oldest first.
  EXPECT_THAT(Ids(q->Next(T0() + microseconds(3), 0).batch), ElementsAre("2:2", "1:1"));
  q->Finished(0, T0() + microseconds(3));
  ASSERT_TRUE(Push(*q, Req(3, 3, true), T0() + microseconds(10)).ok());
  // One request, room for more and another candidate may come: wait for the delay.
  auto d = q->Next(T0() + microseconds(20), 0);
  EXPECT_TRUE(d.batch.empty());
  EXPECT_EQ(d.retry_at, T0() + microseconds(110));
  EXPECT_THAT(Ids(q->Next(T0() + microseconds(110), 0).batch), ElementsAre("3:3"));
}

TEST(SequenceQueueTest, OldestSendsAtAPreferredSize) {
  config::SequenceBatchingConfig c = Config(Strategy::kOldest);
  c.oldest_max_candidate_sequences = 4;
  c.oldest_max_queue_delay_microseconds = 1'000'000;
  c.oldest_preferred_batch_size = {2};
  auto q = Queue(c, /*max_batch_size=*/4);
  ASSERT_TRUE(Push(*q, Req(1, 1, true)).ok());
  EXPECT_TRUE(q->Next(T0(), 0).batch.empty());
  ASSERT_TRUE(Push(*q, Req(2, 2, true)).ok());
  EXPECT_THAT(Ids(q->Next(T0(), 0).batch), ElementsAre("1:1", "2:2"));
}

TEST(SequenceQueueTest, CreateChecksControlsAgainstTheModel) {
  config::SequenceBatchingConfig c = Config();
  c.control_input.push_back(Control("NOPE", Kind::kStart));
  auto q = SequenceQueue::Create({"m", c, 2, 1, ModelInputs()});
  EXPECT_THAT(StatusMessage(q.status()), HasSubstr("control_input[4] (`NOPE`, "
                                                   "CONTROL_SEQUENCE_START): model 'm' has no "
                                                   "input 'NOPE'"));
  c = Config();
  c.control_input[0].control[0].int32_false_true.clear();
  c.control_input[0].control[0].fp32_false_true = {0, 1};
  q = SequenceQueue::Create({"m", c, 2, 1, ModelInputs()});
  EXPECT_THAT(StatusMessage(q.status()),
              HasSubstr("the control gives FP32 values but input 'START' is INT32"));
  EXPECT_EQ(SequenceQueue::ClientInputs(Config(), ModelInputs()).size(), 1u);
}

// ---- End to end: Model::Load with simple_sequence ---------------------------------------

config::ModelConfig SimpleSequenceConfig(Strategy strategy) {
  config::ModelConfig m;
  m.name = "simple_sequence";
  m.kind = "builtin";
  m.builtin = "simple_sequence";
  m.max_batch_size = 8;
  config::SequenceBatchingConfig& sb = m.sequence_batching.emplace();
  sb.strategy = strategy;
  sb.oldest_max_candidate_sequences = 4;
  sb.max_sequence_idle_microseconds = 5'000'000;
  sb.control_input = {Control("START", Kind::kStart), Control("READY", Kind::kReady)};
  return m;
}

// Sends a request and returns a future for its response (or the refusal).
std::future<InferenceResponse> Send(Model& model, uint64_t seq, int32_t value, bool start,
                                    bool end) {
  auto promise = std::make_shared<std::promise<InferenceResponse>>();
  std::future<InferenceResponse> f = promise->get_future();
  auto r = Req(seq, value, start, end);
  r->model_name = model.name();
  r->on_complete = [promise](InferenceResponse&& resp) { promise->set_value(std::move(resp)); };
  Status s = model.Infer(r);
  if (!s.ok()) promise->set_value(InferenceResponse{s, {}});
  return f;
}

int32_t Output(InferenceResponse resp) {
  KILN_CHECK(resp.status.ok(), "response failed");
  int32_t v;
  std::memcpy(&v, resp.outputs.at(0).data.data(), 4);
  return v;
}

// Waits (up to 10 s) until the model's active-sequence count is `n`; returns whether it is.
bool AwaitSequencesActive(Model& model, uint64_t n) {
  const auto deadline = SteadyClock::now() + std::chrono::seconds(10);
  while (model.stats().sequences_active() != n) {
    if (SteadyClock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// The example clients' two integer sequences, interleaved and all sent before any answer:
// each sequence's responses come back in order with Triton's expected values.
void RunExampleSequences(Strategy strategy) {
  auto model = Model::Load(SimpleSequenceConfig(strategy), ModelDeps{});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<int32_t> values = {0, 11, 7, 5, 3, 2, 0, 1};
  std::vector<std::future<InferenceResponse>> a, b;
  for (size_t i = 0; i < values.size(); ++i) {
    const bool start = i == 0, end = i + 1 == values.size();
    a.push_back(Send(**model, 1000, values[i], start, end));
    b.push_back(Send(**model, 1001, i == 0 ? 100 : -values[i], start, end));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(Output(a[i].get()), i == 0 ? 1 : values[i]) << i;
    EXPECT_EQ(Output(b[i].get()), i == 0 ? 101 : -values[i]) << i;
  }
  // Both ended; the batcher releases a sequence just after answering its END request.
  EXPECT_TRUE(AwaitSequencesActive(**model, 0));
  EXPECT_EQ((*model)->signature().inputs.size(), 1u);  // clients send INPUT only
}

TEST(SequenceBatcherTest, ExampleSequencesDirect) { RunExampleSequences(Strategy::kDirect); }
TEST(SequenceBatcherTest, ExampleSequencesOldest) { RunExampleSequences(Strategy::kOldest); }

TEST(SequenceBatcherTest, ErrorsComeBackFromInfer) {
  auto model = Model::Load(SimpleSequenceConfig(Strategy::kDirect), ModelDeps{});
  ASSERT_TRUE(model.ok()) << model.status();
  InferenceResponse resp = Send(**model, 0, 1, true, false).get();
  EXPECT_THAT(StatusMessage(resp.status), HasSubstr("correlation ID"));
  resp = Send(**model, 42, 1, false, false).get();
  EXPECT_THAT(StatusMessage(resp.status), HasSubstr("must specify the START flag"));
  EXPECT_EQ(Output(Send(**model, 42, 1, true, false).get()), 2);
  EXPECT_EQ((*model)->stats().sequences_active(), 1u);
}

TEST(SequenceBatcherTest, ControlInputMustBeAModelInput) {
  config::ModelConfig m = SimpleSequenceConfig(Strategy::kDirect);
  m.sequence_batching->control_input[1].name = "READY_";
  auto model = Model::Load(m, ModelDeps{});
  EXPECT_THAT(StatusMessage(model.status()),
              HasSubstr("model 'simple_sequence': sequence_batching.control_input[1] (`READY_`"));
}

}  // namespace
}  // namespace kiln
