#include "server/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace kiln {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr std::string_view kInferenceKey = "sk-infer-0123456789";
// printf %s sk-infer-0123456789 | sha256sum
constexpr std::string_view kInferenceSha =
    "c595a4b63413fbdeaa7b0675c554527bdfc42c144750d56fd18f8fc09f2cd65b";

// Per test and process: ctest runs the cases of this file in parallel, each in a process of
// its own, and they must not rewrite each other's key files.
std::string TempPath(std::string_view name) {
  return StrCat(::testing::TempDir(), "kiln_auth_test_",
                ::testing::UnitTest::GetInstance()->current_test_info()->name(), "_", getpid(), "_",
                name);
}

void WriteFile(const std::string& path, std::string_view content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
}

config::ApiKeyConfig KeyFromFile(std::string name, std::string path,
                                 std::vector<std::string> scopes, int line = 7) {
  config::ApiKeyConfig k;
  k.name = std::move(name);
  k.key_file = std::move(path);
  k.scopes = std::move(scopes);
  k.location = {"kiln.yaml", line, 7};
  return k;
}

// A config with two keys from files: `app` (inference) and `ops` (admin, fine_tuning).
struct Fixture {
  std::string app_path = TempPath("app.key");
  std::string ops_path = TempPath("ops.key");
  config::AuthConfig config;
  Fixture() {
    WriteFile(app_path, StrCat(kInferenceKey, "\n"));
    WriteFile(ops_path, "sk-ops-abcdef\r\n");
    config.enabled = true;
    config.api_keys = {KeyFromFile("app", app_path, {"inference"}, 5),
                       KeyFromFile("ops", ops_path, {"admin", "fine_tuning"}, 9)};
  }
};

std::unique_ptr<Authenticator> Make(const config::AuthConfig& c, metrics::Registry* r = nullptr) {
  auto a = Authenticator::Create(c, r);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? *std::move(a) : nullptr;
}

std::string Bearer(std::string_view key) { return StrCat("Bearer ", key); }

TEST(AuthenticatorTest, OffLetsEverythingThrough) {
  auto a = Make(config::AuthConfig{});
  ASSERT_NE(a, nullptr);
  EXPECT_FALSE(a->enabled());
  for (RouteClass c : {RouteClass::kInference, RouteClass::kAdmin, RouteClass::kFineTuning}) {
    auto r = a->Authorize(std::nullopt, c);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, "");
  }
}

TEST(AuthenticatorTest, OpenClassesNeedNoKey) {
  Fixture f;
  auto a = Make(f.config);
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(a->Authorize(std::nullopt, RouteClass::kHealth).ok());
  EXPECT_TRUE(a->Authorize(std::nullopt, RouteClass::kMetrics).ok());
  EXPECT_FALSE(a->IsOpen(RouteClass::kOpenApi));
  EXPECT_EQ(a->Authorize(std::nullopt, RouteClass::kInference).status().code(),
            StatusCode::kUnauthenticated);
}

TEST(AuthenticatorTest, KeyFromFileWithItsScopes) {
  Fixture f;
  auto a = Make(f.config);
  ASSERT_NE(a, nullptr);
  auto r = a->Authorize(Bearer(kInferenceKey), RouteClass::kInference);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "app");
  // CRLF stripped from ops.key; ops holds admin and fine_tuning but not inference.
  EXPECT_EQ(*a->Authorize("Bearer sk-ops-abcdef", RouteClass::kAdmin), "ops");
  EXPECT_EQ(*a->Authorize("Bearer sk-ops-abcdef", RouteClass::kFineTuning), "ops");
  auto denied = a->Authorize("Bearer sk-ops-abcdef", RouteClass::kInference);
  EXPECT_EQ(denied.status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(StatusMessage(denied.status()),
            "key `ops` lacks the `inference` scope this route needs");
}

TEST(AuthenticatorTest, WrongScopeIsPermissionDenied) {
  Fixture f;
  auto a = Make(f.config);
  ASSERT_NE(a, nullptr);
  auto r = a->Authorize(Bearer(kInferenceKey), RouteClass::kAdmin);
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(StatusMessage(r.status())),
              HasSubstr("key `app` lacks the `admin` scope this route needs"));
}

TEST(AuthenticatorTest, ClassesWithoutScopeTakeAnyValidKey) {
  Fixture f;
  f.config.open = {};  // health and metrics closed too
  auto a = Make(f.config);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->Authorize(std::nullopt, RouteClass::kHealth).status().code(),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(*a->Authorize(Bearer(kInferenceKey), RouteClass::kMetrics), "app");
  EXPECT_EQ(*a->Authorize("Bearer sk-ops-abcdef", RouteClass::kHealth), "ops");
}

TEST(AuthenticatorTest, ParsesStrictly) {
  Fixture f;
  auto a = Make(f.config);
  ASSERT_NE(a, nullptr);
  // The scheme in any case.
  EXPECT_TRUE(a->Authorize(StrCat("bearer ", kInferenceKey), RouteClass::kInference).ok());
  EXPECT_TRUE(a->Authorize(StrCat("BEARER ", kInferenceKey), RouteClass::kInference).ok());
  const std::string key(kInferenceKey);
  for (const std::string& bad : {
           key,                           // no scheme
           StrCat("Basic ", key),         // another scheme
           StrCat("Bearer  ", key),       // two spaces
           StrCat("Bearer\t", key),       // a tab
           StrCat(" Bearer ", key),       // leading space
           StrCat("Bearer ", key, " "),   // trailing space: another key
           StrCat("Bearer ", key, "\t"),  // trailing tab
           StrCat("Bearer ", key, "\n"),  // trailing newline (a key file read raw)
           StrCat("Bearer ", key, " x"),  // two words
           StrCat("Bearer:", key),
           std::string("Bearer "),
           std::string("Bearer"),
           std::string(""),
       }) {
    auto r = a->Authorize(bad, RouteClass::kInference);
    EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated) << "`" << bad << "`";
  }
}

TEST(AuthenticatorTest, MessagesSayWhatIsExpectedAndNeverEchoTheValue) {
  Fixture f;
  auto a = Make(f.config);
  ASSERT_NE(a, nullptr);
  auto missing = a->Authorize(std::nullopt, RouteClass::kInference);
  EXPECT_THAT(std::string(StatusMessage(missing.status())),
              HasSubstr("this route needs an API key: send `Authorization: Bearer <key>`"));
  auto unknown = a->Authorize("Bearer sk-near-miss-0123456789", RouteClass::kInference);
  EXPECT_EQ(unknown.status().code(), StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(StatusMessage(unknown.status())), HasSubstr("not valid"));
  EXPECT_THAT(std::string(StatusMessage(unknown.status())), Not(HasSubstr("near-miss")));
  auto malformed = a->Authorize("Token sk-secret-value", RouteClass::kInference);
  EXPECT_THAT(std::string(StatusMessage(malformed.status())), HasSubstr("`Bearer <key>`"));
  EXPECT_THAT(std::string(StatusMessage(malformed.status())), Not(HasSubstr("sk-secret")));
}

TEST(AuthenticatorTest, KeySha256) {
  config::AuthConfig c;
  c.enabled = true;
  config::ApiKeyConfig k;
  k.name = "hashed";
  // printf %s hello | sha256sum
  k.key_sha256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";
  k.scopes = {"inference"};
  c.api_keys = {k};
  auto a = Make(c);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(*a->Authorize("Bearer hello", RouteClass::kInference), "hashed");
  EXPECT_EQ(a->Authorize("Bearer hello2", RouteClass::kInference).status().code(),
            StatusCode::kUnauthenticated);
  // The digest itself is not a key.
  EXPECT_EQ(a->Authorize(StrCat("Bearer ", k.key_sha256), RouteClass::kInference).status().code(),
            StatusCode::kUnauthenticated);
}

TEST(AuthenticatorTest, KeyFileErrorsNameTheLineAndPathButNotTheKey) {
  config::AuthConfig c;
  c.enabled = true;
  const std::string missing = TempPath("does-not-exist.key");
  std::remove(missing.c_str());
  c.api_keys = {KeyFromFile("ci-bot", missing, {"inference"}, 12)};
  auto a = Authenticator::Create(c, nullptr);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(StatusMessage(a.status())),
              HasSubstr("kiln.yaml:12:7: server.auth.api_keys `ci-bot`: cannot read key_file `" +
                        missing + "`: No such file or directory"));

  const std::string empty = TempPath("empty.key");
  WriteFile(empty, "\n");
  c.api_keys = {KeyFromFile("ci-bot", empty, {"inference"}, 3)};
  a = Authenticator::Create(c, nullptr);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(
      std::string(StatusMessage(a.status())),
      HasSubstr("kiln.yaml:3:7: server.auth.api_keys `ci-bot`: key_file `" + empty + "` is empty"));

  const std::string spaced = TempPath("spaced.key");
  WriteFile(spaced, "sk-has a-space\n");
  c.api_keys = {KeyFromFile("ci-bot", spaced, {"inference"}, 3)};
  a = Authenticator::Create(c, nullptr);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(StatusMessage(a.status())), HasSubstr("holds spaces"));
  EXPECT_THAT(std::string(StatusMessage(a.status())), Not(HasSubstr("sk-has")));
}

TEST(AuthenticatorTest, TheSameKeyTwiceIsRefused) {
  Fixture f;
  WriteFile(f.ops_path, StrCat(kInferenceKey, "\n"));
  auto a = Authenticator::Create(f.config, nullptr);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(StatusMessage(a.status())),
              HasSubstr("kiln.yaml:9:7: server.auth.api_keys `ops` holds the same key as `app` "
                        "(kiln.yaml:5:7)"));
  EXPECT_THAT(std::string(StatusMessage(a.status())), Not(HasSubstr(kInferenceKey)));
}

TEST(AuthenticatorTest, ReloadSwapsKeysAndKeepsThemOnError) {
  Fixture f;
  auto a = Make(f.config);
  ASSERT_NE(a, nullptr);
  WriteFile(f.app_path, "sk-rotated\n");
  ASSERT_TRUE(a->ReloadKeyFiles().ok());
  EXPECT_EQ(*a->Authorize("Bearer sk-rotated", RouteClass::kInference), "app");
  EXPECT_EQ(a->Authorize(Bearer(kInferenceKey), RouteClass::kInference).status().code(),
            StatusCode::kUnauthenticated);
  // A broken file: the reload fails and what was in force stays.
  WriteFile(f.app_path, "");
  Status s = a->ReloadKeyFiles();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(StatusMessage(s)), HasSubstr("kiln.yaml:5:7"));
  EXPECT_EQ(*a->Authorize("Bearer sk-rotated", RouteClass::kInference), "app");
  EXPECT_EQ(*a->Authorize("Bearer sk-ops-abcdef", RouteClass::kAdmin), "ops");
}

TEST(AuthenticatorTest, CheckCountsByKeyNameAndLogsNoKey) {
  Fixture f;
  metrics::Registry registry;
  auto a = Make(f.config, &registry);
  ASSERT_NE(a, nullptr);
  std::ostringstream log;
  auto logger = std::make_shared<spdlog::logger>(
      "auth_test", std::make_shared<spdlog::sinks::ostream_sink_mt>(log));
  logger->set_level(spdlog::level::trace);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(logger);

  const std::string good = Bearer(kInferenceKey);
  const std::string near = StrCat(good, "x");
  EXPECT_TRUE(
      a->Check(AuthProtocol::kHttp, good, RouteClass::kInference, "1.2.3.4:5", "GET /v2").ok());
  EXPECT_TRUE(
      a->Check(AuthProtocol::kGrpc, good, RouteClass::kInference, "ipv4:1.2.3.4:5", "ModelInfer")
          .ok());
  EXPECT_FALSE(a->Check(AuthProtocol::kHttp, good, RouteClass::kAdmin, "1.2.3.4:5",
                        "POST /v2/repository/models/m/load")
                   .ok());
  EXPECT_FALSE(
      a->Check(AuthProtocol::kHttp, near, RouteClass::kInference, "1.2.3.4:5", "GET /v2").ok());
  EXPECT_FALSE(a->Check(AuthProtocol::kGrpc, std::nullopt, RouteClass::kInference, "ipv4:1.2.3.4:5",
                        "ModelInfer")
                   .ok());
  // Open classes are not counted.
  EXPECT_TRUE(a->Check(AuthProtocol::kHttp, std::nullopt, RouteClass::kHealth, "1.2.3.4:5",
                       "GET /v2/health/ready")
                  .ok());
  logger->flush();
  spdlog::set_default_logger(previous);

  const std::string text = registry.Serialize();
  EXPECT_THAT(text,
              HasSubstr(R"(kiln_auth_requests_total{key="app",protocol="http",result="ok"} 1)"));
  EXPECT_THAT(text,
              HasSubstr(R"(kiln_auth_requests_total{key="app",protocol="grpc",result="ok"} 1)"));
  EXPECT_THAT(
      text,
      HasSubstr(
          R"(kiln_auth_requests_total{key="app",protocol="http",result="permission_denied"} 1)"));
  EXPECT_THAT(
      text,
      HasSubstr(R"(kiln_auth_requests_total{key="",protocol="http",result="unauthenticated"} 1)"));
  EXPECT_THAT(
      text,
      HasSubstr(R"(kiln_auth_requests_total{key="",protocol="grpc",result="unauthenticated"} 1)"));
  EXPECT_THAT(text,
              HasSubstr(R"(kiln_auth_requests_total{key="ops",protocol="http",result="ok"} 0)"));

  const std::string logged = log.str();
  EXPECT_THAT(logged, HasSubstr("POST /v2/repository/models/m/load from 1.2.3.4:5 refused"));
  EXPECT_THAT(logged, HasSubstr("lacks the `admin` scope"));
  for (const std::string& out : {text, logged}) {
    EXPECT_THAT(out, Not(HasSubstr(kInferenceKey)));
    EXPECT_THAT(out, Not(HasSubstr(kInferenceSha)));
    EXPECT_THAT(out, Not(HasSubstr("sk-ops")));
  }
}

}  // namespace
}  // namespace kiln
