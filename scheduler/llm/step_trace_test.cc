// The continuous batcher's spans (step_trace.h) with the fake model: a prompt longer than the
// step's token budget is prefilled in chunks, one prefill span each; the decode span counts
// the decode steps; every span chains to the request's root; step spans only while capturing.
#include "scheduler/llm/step_trace.h"

#include <future>
#include <map>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "scheduler/llm/continuous_batcher.h"
#include "scheduler/llm/testing/fake_llm.h"

namespace kiln {
namespace {

using nlohmann::json;

std::vector<json> CapturedSpans(TraceSink& sink, const std::function<void()>& work) {
  std::promise<std::string> doc;
  Status s = sink.Capture(absl::Seconds(2), [&doc](std::string j) { doc.set_value(std::move(j)); });
  EXPECT_TRUE(s.ok()) << s;
  work();
  std::vector<json> out;
  json parsed = json::parse(doc.get_future().get());
  for (json& e : parsed["traceEvents"]) {
    if (e["ph"] == "X") out.push_back(std::move(e));
  }
  return out;
}

TEST(StepTraceTest, PrefillChunksDecodeStepsAndTheParentChain) {
  config::LlmSchedulerConfig config;
  config.max_num_batched_tokens = 16;  // a 40-token prompt takes 3 prefill steps
  config.kv_cache_bytes = 4096 * 8 * config.block_size;
  TraceSink sink({.enabled = true}, nullptr);
  auto batcher = std::make_unique<ContinuousBatcher>(
      "fake", std::make_unique<llm_testing::FakeLlm>(llm_testing::FakeLlmOptions{}), config,
      /*prefix_seed=*/7, nullptr);
  batcher->set_trace_sink(&sink);
  ASSERT_TRUE(batcher->Start().ok());

  std::shared_ptr<RequestTrace> trace;
  const std::vector<json> spans = CapturedSpans(sink, [&] {
    auto req = std::make_unique<GenerateRequest>();
    req->model_name = "fake";
    for (int i = 0; i < 40; ++i) req->prompt.push_back(300 + i * 17);
    req->sampling.temperature = 0;
    req->sampling.ignore_eos = true;
    req->max_tokens = 5;
    trace = RequestTrace::Begin(&sink, "test", std::nullopt, std::nullopt, SteadyClock::now());
    req->trace = trace;
    std::promise<void> done;
    req->on_event = [&done, trace](GenerateEvent&& ev) {
      if (ev.finish == FinishReason::kNone) return;
      trace->End();
      done.set_value();
    };
    Status s = batcher->Enqueue(req);
    ASSERT_TRUE(s.ok()) << s;
    done.get_future().wait();
  });
  const std::string root = SpanIdHex(trace->root().span_id);
  std::map<std::string, std::vector<json>> by_name;
  int steps = 0;
  for (const json& e : spans) {
    if (e["cat"] == "step") {
      ++steps;
      EXPECT_GE(e["args"]["tokens"].get<int>(), 1);
      continue;
    }
    by_name[e["name"]].push_back(e);
    if (e["name"] != "test") {
      EXPECT_EQ(e["args"]["parent_id"], root) << e.dump();
    }
  }
  ASSERT_EQ(by_name["prefill"].size(), 3u);
  int prefilled = 0;
  for (const json& p : by_name["prefill"]) prefilled += p["args"]["kiln.tokens"].get<int>();
  EXPECT_EQ(prefilled, 40);
  ASSERT_EQ(by_name["decode"].size(), 1u);
  EXPECT_EQ(by_name["decode"][0]["args"]["kiln.decode_steps"],
            4);  // 5 tokens, the first from prefill
  ASSERT_EQ(by_name["queue"].size(), 1u);
  ASSERT_EQ(by_name["detokenize"].size(), 1u);
  EXPECT_EQ(by_name["detokenize"][0]["args"]["kiln.detokenize_calls"], 5);
  ASSERT_EQ(by_name["test"].size(), 1u);
  EXPECT_EQ(by_name["test"][0]["args"]["kiln.completion_tokens"], 5);
  EXPECT_EQ(steps, 3 + 4);
}

}  // namespace
}  // namespace kiln
