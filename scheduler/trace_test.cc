#include "scheduler/trace.h"

#include <thread>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

using nlohmann::json;

constexpr std::string_view kValid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

TEST(TraceparentTest, ParsesAndFormatsTheW3cExample) {
  std::optional<TraceContext> c = ParseTraceparent(kValid);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->trace_hi, 0x4bf92f3577b34da6ull);
  EXPECT_EQ(c->trace_lo, 0xa3ce929d0e0e4736ull);
  EXPECT_EQ(c->span_id, 0x00f067aa0ba902b7ull);
  EXPECT_TRUE(c->sampled());
  EXPECT_EQ(FormatTraceparent(*c), kValid);
}

TEST(TraceparentTest, RejectsInvalidHeaders) {
  for (std::string_view bad : {
           "",
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",       // no flags
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",    // uppercase
           "00-00000000000000000000000000000000-00f067aa0ba902b7-01",    // zero trace id
           "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",    // zero span id
           "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    // version ff
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  // 00 with extra
           "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",    // not hex
           "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    // separator
           " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",   // leading space
       }) {
    EXPECT_FALSE(ParseTraceparent(bad).has_value()) << bad;
  }
  // A future version is read by its known fields.
  EXPECT_TRUE(ParseTraceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-later")
                  .has_value());
}

TEST(RequestTraceTest, ChildOfTheClientsSpanKeepsTheTraceId) {
  TraceSink sink({.enabled = true}, nullptr);
  auto t =
      RequestTrace::Begin(&sink, "POST /v1/chat/completions", kValid, "k=v", SteadyClock::now());
  ASSERT_NE(t, nullptr);
  std::optional<TraceContext> back = ParseTraceparent(t->traceparent());
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->trace_hi, 0x4bf92f3577b34da6ull);
  EXPECT_NE(back->span_id, 0x00f067aa0ba902b7ull);  // the server span, not the client's
  EXPECT_EQ(t->tracestate(), "k=v");
}

TEST(RequestTraceTest, InvalidHeaderStartsANewTrace) {
  TraceSink sink({.enabled = true}, nullptr);
  auto t = RequestTrace::Begin(&sink, "r", "garbage", "k=v", SteadyClock::now());
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(ParseTraceparent(t->traceparent()).has_value());
  EXPECT_EQ(t->tracestate(), "");  // belongs to the dropped parent
}

TEST(RequestTraceTest, DisabledMeansNoTrace) {
  TraceSink sink({.enabled = false}, nullptr);
  EXPECT_EQ(RequestTrace::Begin(&sink, "r", kValid, {}, SteadyClock::now()), nullptr);
  EXPECT_EQ(RequestTrace::Begin(nullptr, "r", kValid, {}, SteadyClock::now()), nullptr);
  EXPECT_EQ(sink.Capture(absl::Seconds(1), [](std::string) {}).code(),
            StatusCode::kFailedPrecondition);
}

TEST(TraceSinkTest, ExportQueueIsBoundedAndChainsToTheRoot) {
  metrics::Registry registry;
  TraceSink sink({.enabled = true, .export_spans = true, .export_capacity = 3}, &registry);
  {
    auto t = RequestTrace::Begin(&sink, "ModelInfer", kValid, {}, SteadyClock::now());
    for (int i = 0; i < 4; ++i) t->Span("queue", SteadyClock::now(), SteadyClock::now());
  }  // the root ends here, dropped too: the queue holds 3
  std::vector<SpanRecord> out;
  ASSERT_TRUE(sink.PopExport(&out, 10, absl::ZeroDuration()));
  ASSERT_EQ(out.size(), 3u);
  for (const SpanRecord& s : out) {
    EXPECT_EQ(s.trace_hi, 0x4bf92f3577b34da6ull);
    EXPECT_NE(s.parent_id, 0u);
  }
  EXPECT_NE(
      registry.Serialize().find("kiln_trace_spans_dropped_total{reason=\"export_queue_full\"} 2"),
      std::string::npos)
      << registry.Serialize();
  sink.CloseExport();
  out.clear();
  EXPECT_FALSE(sink.PopExport(&out, 10, absl::Seconds(5)));
}

TEST(TraceSinkTest, CaptureGivesChromeJsonWithStepAndRequestLanes) {
  TraceSink sink({.enabled = true}, nullptr);
  absl::Mutex mu;
  std::optional<std::string> doc;
  ASSERT_TRUE(sink.Capture(absl::Milliseconds(300),
                           [&](std::string j) {
                             absl::MutexLock lock(&mu);
                             doc = std::move(j);
                           })
                  .ok());
  EXPECT_EQ(sink.Capture(absl::Seconds(1), [](std::string) {}).code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(sink.capturing());
  uint64_t root = 0;
  {
    auto t = RequestTrace::Begin(&sink, "POST /v1/completions", {}, {}, SteadyClock::now());
    root = ParseTraceparent(t->traceparent())->span_id;
    t->Span("admission", SteadyClock::now(), SteadyClock::now(), {{"kiln.x", int64_t{1}}});
    SpanRecord step;
    step.name = "step";
    step.lane = "model m";
    step.start_ns = SteadyNanos(SteadyClock::now());
    step.end_ns = step.start_ns + 1000;
    sink.Record(std::move(step));
  }
  {
    absl::MutexLock lock(&mu);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return doc.has_value(); };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(10)));
  }
  EXPECT_FALSE(sink.capturing());
  json j = json::parse(*doc);
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  int steps = 0, requests = 0;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    EXPECT_TRUE(e["ts"].is_number());
    EXPECT_TRUE(e["dur"].is_number());
    if (e["pid"] == 1) {
      ++steps;
      EXPECT_EQ(e["name"], "step");
    } else {
      ++requests;
      if (e["name"] == "admission") {
        EXPECT_EQ(e["args"]["parent_id"], SpanIdHex(root));
        EXPECT_EQ(e["args"]["kiln.x"], 1);
      } else {
        EXPECT_EQ(e["args"]["span_id"], SpanIdHex(root));
        EXPECT_EQ(e["args"]["parent_id"], "");
      }
    }
  }
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(requests, 2);
  // A second capture may start once the first answered.
  EXPECT_TRUE(sink.Capture(absl::Milliseconds(10), [](std::string) {}).ok());
}

}  // namespace
}  // namespace kiln
