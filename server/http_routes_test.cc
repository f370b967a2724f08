#include "server/http_routes.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

TEST(HttpRoutesTest, TemplatesMatchWholeSegments) {
  EXPECT_TRUE(MatchRoutePath("/v2/models/{model}/infer", "/v2/models/simple/infer"));
  EXPECT_TRUE(MatchRoutePath("/v2", "/v2"));
  EXPECT_FALSE(MatchRoutePath("/v2", "/v2/"));
  EXPECT_FALSE(MatchRoutePath("/v2/models/{model}/infer", "/v2/models//infer"));
  EXPECT_FALSE(MatchRoutePath("/v2/models/{model}/infer", "/v2/models/simple/infer/x"));
  EXPECT_FALSE(MatchRoutePath("/v2/models/{model}/infer", "/v2/models/simple"));
  EXPECT_FALSE(MatchRoutePath("/v1/files", "/v1/filesx"));
  EXPECT_FALSE(MatchRoutePath("/v1/files", "v1/files"));
}

TEST(HttpRoutesTest, FindsTheRouteAndItsClass) {
  const HttpRoute* r = FindHttpRoute(RoutePort::kHttp, "POST", "/v2/repository/models/m/load");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->access, RouteClass::kAdmin);
  r = FindHttpRoute(RoutePort::kHttp, "HEAD", "/v2/health/ready");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->access, RouteClass::kHealth);
  r = FindHttpRoute(RoutePort::kHttp, "GET", "/v2/models/m/versions/1/ready");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->access, RouteClass::kHealth);
  // The literal `stats` wins over the `{model}` metadata route listed after it.
  r = FindHttpRoute(RoutePort::kHttp, "GET", "/v2/models/stats");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->path, "/v2/models/stats");
  EXPECT_EQ(FindHttpRoute(RoutePort::kHttp, "GET", "/v1/chat/completions"), nullptr);
  ASSERT_NE(FindHttpRoutePath(RoutePort::kHttp, "/v1/chat/completions"), nullptr);
  EXPECT_EQ(FindHttpRoutePath(RoutePort::kHttp, "/nope"), nullptr);
  EXPECT_EQ(FindHttpRoute(RoutePort::kHttp, "GET", "/metrics"), nullptr);
  ASSERT_NE(FindHttpRoute(RoutePort::kMetrics, "GET", "/metrics"), nullptr);
  EXPECT_EQ(FindHttpRoute(RoutePort::kHttp, "GET", "/debug/trace")->access, RouteClass::kAdmin);
}

TEST(HttpRoutesTest, AllowedMethodsListWhatThePathTakes) {
  EXPECT_EQ(AllowedMethods(RoutePort::kHttp, "/v2/models/m/infer"), "POST");
  EXPECT_EQ(AllowedMethods(RoutePort::kHttp, "/v2"), "GET, HEAD");
  EXPECT_EQ(AllowedMethods(RoutePort::kHttp, "/v1/files"), "POST, GET, HEAD");
  EXPECT_EQ(AllowedMethods(RoutePort::kHttp, "/v1/files/f"), "GET, DELETE, HEAD");
  // The literal `stats` and the `{model}` route share a path and a method: listed once.
  EXPECT_EQ(AllowedMethods(RoutePort::kHttp, "/v2/models/stats"), "GET, HEAD");
  EXPECT_EQ(AllowedMethods(RoutePort::kMetrics, "/metrics"), "GET, HEAD");
  EXPECT_EQ(AllowedMethods(RoutePort::kHttp, "/metrics"), "");
  EXPECT_EQ(AllowedMethods(RoutePort::kHttp, "/nope"), "");
}

TEST(HttpRoutesTest, EntriesAreUniqueAndWellFormed) {
  std::set<std::string> seen;
  for (const HttpRoute& r : HttpRoutes()) {
    EXPECT_TRUE(seen.insert(std::string(r.method) + " " + std::string(r.path)).second)
        << r.method << " " << r.path << " is listed twice";
    EXPECT_THAT(std::string(r.method), testing::AnyOf("GET", "POST", "DELETE"));
    EXPECT_EQ(r.path.front(), '/');
    EXPECT_NE(r.path.back(), '/');
    // Every route is found as itself (no earlier entry shadows it), with `{x}` filled in.
    std::string concrete;
    for (size_t i = 0; i < r.path.size(); ++i) {
      if (r.path[i] == '{') {
        i = r.path.find('}', i);
        concrete += "x";
      } else {
        concrete += r.path[i];
      }
    }
    EXPECT_EQ(FindHttpRoute(r.port, r.method, concrete), &r) << r.method << " " << r.path;
  }
}

}  // namespace
}  // namespace kiln
