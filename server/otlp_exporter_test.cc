#include "server/otlp_exporter.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kiln {
namespace {

TEST(OtlpEndpointTest, ParsesHttpUrls) {
  StatusOr<OtlpEndpoint> e = ParseOtlpEndpoint("http://collector:4318/v1/traces");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->host, "collector");
  EXPECT_EQ(e->port, "4318");
  EXPECT_EQ(e->target, "/v1/traces");
  e = ParseOtlpEndpoint("http://127.0.0.1");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->port, "80");
  EXPECT_EQ(e->target, "/v1/traces");
  e = ParseOtlpEndpoint("http://[::1]:4318/x");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->host, "::1");
  EXPECT_EQ(e->port, "4318");
  EXPECT_EQ(e->target, "/x");
}

TEST(OtlpEndpointTest, RefusesHttpsAndNonsenseNamingTheKey) {
  for (std::string_view bad : {"https://collector:4318/v1/traces", "collector:4318",
                               "http://:4318/", "http://host:port/"}) {
    StatusOr<OtlpEndpoint> e = ParseOtlpEndpoint(bad);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.status().message().find("observability.otlp.endpoint"), std::string::npos);
  }
  EXPECT_NE(ParseOtlpEndpoint("https://c/").status().message().find("https is not supported"),
            std::string::npos);
}

TEST(OtlpJsonTest, HexIdsStringNanosAndTheParentChain) {
  TraceSink sink({.enabled = true}, nullptr);
  SpanRecord root;
  root.trace_hi = 0x4bf92f3577b34da6ull;
  root.trace_lo = 0xa3ce929d0e0e4736ull;
  root.span_id = 0x1111;
  root.parent_id = 0x00f067aa0ba902b7ull;
  root.name = "POST /v1/chat/completions";
  root.kind = SpanKind::kServer;
  root.start_ns = 1000;
  root.end_ns = 5000;
  root.attrs = {{"kiln.model", std::string("m")}, {"kiln.prompt_tokens", int64_t{7}}};
  SpanRecord child = root;
  child.span_id = 0x2222;
  child.parent_id = 0x1111;
  child.name = "queue";
  child.kind = SpanKind::kInternal;
  child.error = true;
  child.status_message = "boom";
  child.attrs.clear();
  const nlohmann::json j = nlohmann::json::parse(OtlpJson({root, child}, sink, "kilnd"));
  const nlohmann::json& rs = j["resourceSpans"][0];
  EXPECT_EQ(rs["resource"]["attributes"][0]["key"], "service.name");
  EXPECT_EQ(rs["resource"]["attributes"][0]["value"]["stringValue"], "kilnd");
  EXPECT_EQ(rs["scopeSpans"][0]["scope"]["name"], "kiln");
  const nlohmann::json& spans = rs["scopeSpans"][0]["spans"];
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0]["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(spans[0]["spanId"], "0000000000001111");
  EXPECT_EQ(spans[0]["parentSpanId"], "00f067aa0ba902b7");
  EXPECT_EQ(spans[0]["kind"], 2);
  EXPECT_EQ(spans[0]["startTimeUnixNano"], std::to_string(sink.UnixNanos(1000)));
  EXPECT_TRUE(spans[0]["endTimeUnixNano"].is_string());
  EXPECT_EQ(spans[0]["status"]["code"], 1);
  EXPECT_EQ(spans[0]["attributes"][1]["value"]["intValue"], "7");
  EXPECT_EQ(spans[1]["parentSpanId"], "0000000000001111");
  EXPECT_EQ(spans[1]["kind"], 1);
  EXPECT_EQ(spans[1]["status"]["code"], 2);
  EXPECT_EQ(spans[1]["status"]["message"], "boom");
}

}  // namespace
}  // namespace kiln
