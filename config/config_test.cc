#include "config/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/testing/source_dir.h"

namespace kiln::config {
namespace {

std::string ConfigDir() { return std::string(TestSourceDir()) + "/config"; }

using ::testing::AllOf;
using ::testing::ContainsRegex;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// The error lines of a config that must not parse.
std::vector<std::string> Errors(std::string_view yaml,
                                const std::vector<std::string>& overrides = {},
                                std::string_view file = "f.yaml") {
  StatusOr<Config> c = ParseConfig(yaml, file, overrides);
  EXPECT_FALSE(c.ok()) << "parsed, but should not have:\n" << yaml;
  if (c.ok()) return {};
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::string> lines;
  std::istringstream in{std::string(StatusMessage(c.status()))};
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

Config Parse(std::string_view yaml, const std::vector<std::string>& overrides = {}) {
  StatusOr<Config> c = ParseConfig(yaml, "f.yaml", overrides);
  EXPECT_TRUE(c.ok()) << c.status() << "\nin:\n" << yaml;
  return c.ok() ? *std::move(c) : Config{};
}

// A valid model entry, as YAML lines indented for `models:`, with `extra` lines appended.
std::string Model(std::string_view name, std::string_view extra = "") {
  return absl::StrCat("  - name: ", ToAbsl(name), "\n    kind: builtin\n    builtin: simple\n",
                      ToAbsl(extra));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- The default configuration ---------------------------------------------------------------

// What config/README.md and the task promise: the struct defaults plus three builtin models.
Config DocumentedDefaults() {
  Config c;
  ModelConfig simple;
  simple.name = "simple";
  simple.kind = "builtin";
  simple.builtin = "simple";
  simple.max_batch_size = 8;
  simple.dynamic_batching.emplace().max_queue_delay_microseconds = 0;
  ModelConfig identity;
  identity.name = "identity_fp32";
  identity.kind = "builtin";
  identity.builtin = "identity_fp32";
  identity.max_batch_size = 0;
  ModelConfig sleep;
  sleep.name = "sleep_us";
  sleep.kind = "builtin";
  sleep.builtin = "sleep_us";
  sleep.max_batch_size = 16;
  DynamicBatchingConfig& db = sleep.dynamic_batching.emplace();
  db.max_queue_delay_microseconds = 1000;
  db.priority_levels = 2;
  db.default_priority_level = 2;
  db.default_queue_policy.allow_timeout_override = true;
  db.default_queue_policy.max_queue_size = 1024;
  ModelConfig smollm2;
  smollm2.name = "smollm2";
  smollm2.kind = "llm";
  smollm2.path = ".kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  smollm2.context_length = 8192;
  smollm2.scheduler.speculative.method = "ngram";
  ModelConfig minilm;
  minilm.name = "all-MiniLM-L6-v2";
  minilm.kind = "embedding";
  minilm.path = ".kiln/models/all-MiniLM-L6-v2";
  minilm.max_batch_size = 32;
  minilm.dynamic_batching.emplace().max_queue_delay_microseconds = 2000;
  c.models = {simple, identity, sleep, smollm2, minilm};
  return c;
}

TEST(DefaultConfigTest, ParsesToTheDocumentedDefaults) {
  StatusOr<Config> parsed = ParseConfig(DefaultConfigYaml(), "<default>");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, DocumentedDefaults());
  EXPECT_EQ(parsed->source, "<default>");
  EXPECT_EQ(DefaultConfig(), DocumentedDefaults());
  EXPECT_EQ(DefaultConfig().source, "<default>");
  // The struct defaults the header documents (a typo in the YAML that kept a wrong but valid
  // value would pass the comparison above only if the header agreed with it).
  const Config defaults;
  EXPECT_EQ(defaults.server.grpc.address, "0.0.0.0:8001");
  EXPECT_EQ(defaults.server.http.address, "0.0.0.0:8000");
  EXPECT_EQ(defaults.server.metrics.address, "0.0.0.0:8002");
  EXPECT_EQ(defaults.server.grpc.max_message_bytes, 64 << 20);
  EXPECT_EQ(defaults.logging.level, "info");
}

TEST(DefaultConfigTest, EmbeddedTextIsTheExampleFileByteForByte) {
  EXPECT_EQ(DefaultConfigYaml(), ReadFile(ConfigDir() + "/examples/default.yaml"));
}

TEST(DefaultConfigTest, EveryKeyIsCommented) {
  // Each `key:` line of the server, logging, fine_tuning and observability sections has a comment
  // on it or just above it; the model keys are documented in the comment block above `models:`.
  std::istringstream in{std::string(DefaultConfigYaml())};
  std::string previous;
  int keys = 0;
  for (std::string line; std::getline(in, line); previous = line) {
    if (line.rfind("models:", 0) == 0) break;
    size_t first = line.find_first_not_of(' ');
    if (first == std::string::npos || line[first] == '#') continue;
    bool section = line.back() == ':';
    size_t previous_first = previous.find_first_not_of(' ');
    bool commented = line.find(" # ") != std::string::npos ||
                     (previous_first != std::string::npos && previous[previous_first] == '#');
    if (!section) {
      ++keys;
      EXPECT_TRUE(commented) << "no comment for: " << line;
    }
  }
  EXPECT_EQ(keys, 40);  // every scalar key of server, logging, fine_tuning and observability
  for (std::string_view key : {"name",
                               "kind",
                               "builtin",
                               "path",
                               "backend",
                               "instance_count",
                               "max_batch_size",
                               "load_on_start",
                               "dynamic_batching",
                               "preferred_batch_size",
                               "max_queue_delay_microseconds",
                               "preserve_ordering",
                               "priority_levels",
                               "default_priority_level",
                               "default_queue_policy",
                               "priority_queue_policy",
                               "timeout_action",
                               "default_timeout_microseconds",
                               "allow_timeout_override",
                               "max_queue_size"}) {
    EXPECT_THAT(std::string(DefaultConfigYaml()),
                ContainsRegex(absl::StrCat("\n#[ ]+", ToAbsl(key), " ")))
        << key;
  }
}

TEST(DefaultConfigTest, ProductionExampleIsValid) {
  StatusOr<Config> c = LoadConfigFile(ConfigDir() + "/examples/production.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->models.empty());
  EXPECT_NE(c->server, ServerConfig());
}

// The text of the first fenced block of `language` after `heading` in config/README.md.
std::string ReadmeBlock(std::string_view heading, std::string_view language) {
  std::string readme = ReadFile(ConfigDir() + "/README.md");
  size_t at = readme.find(absl::StrCat("\n", ToAbsl(heading), "\n"));
  EXPECT_NE(at, std::string::npos) << heading;
  if (at == std::string::npos) return "";
  std::string fence = absl::StrCat("```", ToAbsl(language), "\n");
  size_t begin = readme.find(fence, at);
  size_t end = readme.find("```\n", begin + fence.size());
  EXPECT_NE(end, std::string::npos) << heading;
  if (begin == std::string::npos || end == std::string::npos) return "";
  return readme.substr(begin + fence.size(), end - begin - fence.size());
}

TEST(ReadmeTest, FullExampleIsValid) {
  std::string yaml = ReadmeBlock("## A full example", "yaml");
  Config c = Parse(yaml);
  EXPECT_EQ(c.models.size(), 2u) << yaml;
}

TEST(ReadmeTest, ErrorExampleShowsWhatKilndSays) {
  std::string yaml = ReadmeBlock("## Errors", "yaml");
  std::string shown = ReadmeBlock("## Errors", "text");
  std::vector<std::string> want;
  std::istringstream in(shown);
  for (std::string line; std::getline(in, line);) want.push_back(line);
  EXPECT_EQ(Errors(yaml, {}, "kiln.yaml"), want);
}

TEST(DefaultConfigTest, EmptyOrCommentOnlyFilesAreAllDefaults) {
  for (std::string_view text : {"", "\n\n", "# nothing here\n  # at all\n", "---\n", "~\n",
                                "models:\n", "server:\nlogging:\nmodels: []\n"}) {
    Config c = Parse(text);
    EXPECT_EQ(c, Config()) << text;
    EXPECT_THAT(c.models, IsEmpty());
  }
}

TEST(DefaultConfigTest, EmptyValuesTakeTheDefault) {
  Config c = Parse("server:\n  http:\n    threads:\n    address: ~\nlogging:\n  level: null\n");
  EXPECT_EQ(c, Config());
}

// ---- Parsing: the happy path ------------------------------------------------------------------

TEST(ParseConfigTest, ReadsEveryKey) {
  Config c = Parse(R"(server:
  grpc: {enabled: false, address: "[::1]:9001", max_message_bytes: 2147483647,
         max_concurrent_streams: 7}
  http: {enabled: true, address: localhost:0, max_body_bytes: 1, threads: 64,
         idle_timeout_seconds: 86400}
  metrics: {enabled: false, address: 10.0.0.1:9}
  max_inflight_requests: 1
  shutdown_grace_seconds: 0.25
  storage_dir: /var/lib/kiln
logging: {level: WARN, format: json}
models:
  - name: A-b_c.9
    kind: builtin
    builtin: sleep_us
    backend: cpu
    instance_count: 64
    max_batch_size: 1048576
    load_on_start: false
    dynamic_batching:
      preferred_batch_size: [1, 2, 1048576]
      max_queue_delay_microseconds: 86400000000
      preserve_ordering: true
      priority_levels: 3
      default_priority_level: 3
      default_queue_policy: {timeout_action: delay, default_timeout_microseconds: 5,
                             allow_timeout_override: true, max_queue_size: 4294967295}
      priority_queue_policy:
        1: {max_queue_size: 8}
        3: {timeout_action: REJECT}
)");
  EXPECT_FALSE(c.server.grpc.enabled);
  EXPECT_EQ(c.server.grpc.address, "[::1]:9001");
  EXPECT_EQ(c.server.grpc.max_message_bytes, 2147483647);
  EXPECT_EQ(c.server.grpc.max_concurrent_streams, 7);
  EXPECT_EQ(c.server.http.address, "localhost:0");
  EXPECT_EQ(c.server.http.max_body_bytes, 1);
  EXPECT_EQ(c.server.http.threads, 64);
  EXPECT_EQ(c.server.http.idle_timeout_seconds, 86400);
  EXPECT_FALSE(c.server.metrics.enabled);
  EXPECT_EQ(c.server.metrics.address, "10.0.0.1:9");
  EXPECT_EQ(c.server.max_inflight_requests, 1);
  EXPECT_EQ(c.server.shutdown_grace_seconds, 0.25);
  EXPECT_EQ(c.server.storage_dir, "/var/lib/kiln");
  EXPECT_EQ(c.logging.level, "warn");  // case-insensitive, stored as documented
  EXPECT_EQ(c.logging.format, "json");
  ASSERT_EQ(c.models.size(), 1u);
  const ModelConfig& m = c.models[0];
  EXPECT_EQ(m.name, "A-b_c.9");
  EXPECT_EQ(m.builtin, "sleep_us");
  EXPECT_EQ(m.instance_count, 64);
  EXPECT_EQ(m.max_batch_size, 1048576);
  EXPECT_FALSE(m.load_on_start);
  EXPECT_EQ(m.location.ToString(), "f.yaml:12:5");
  ASSERT_TRUE(m.dynamic_batching.has_value());
  const DynamicBatchingConfig& db = *m.dynamic_batching;
  EXPECT_THAT(db.preferred_batch_size, ElementsAre(1, 2, 1048576));
  EXPECT_EQ(db.max_queue_delay_microseconds, 86400000000u);
  EXPECT_TRUE(db.preserve_ordering);
  EXPECT_EQ(db.priority_levels, 3u);
  EXPECT_EQ(db.default_priority_level, 3u);
  EXPECT_EQ(db.default_queue_policy.timeout_action, QueuePolicy::TimeoutAction::kDelay);
  EXPECT_EQ(db.default_queue_policy.default_timeout_microseconds, 5u);
  EXPECT_TRUE(db.default_queue_policy.allow_timeout_override);
  EXPECT_EQ(db.default_queue_policy.max_queue_size, 4294967295u);
  ASSERT_EQ(db.priority_queue_policy.size(), 2u);
  EXPECT_EQ(db.priority_queue_policy.at(1).max_queue_size, 8u);
  EXPECT_EQ(db.priority_queue_policy.at(3).timeout_action, QueuePolicy::TimeoutAction::kReject);
  EXPECT_EQ(c.FindModel("A-b_c.9"), &c.models[0]);
  EXPECT_EQ(c.FindModel("nope"), nullptr);
}

TEST(ParseConfigTest, AnEmptyDynamicBatchingSectionTurnsItOn) {
  Config c = Parse("models:\n" + Model("a", "    dynamic_batching:\n") + Model("b") +
                   Model("c", "    dynamic_batching: {}\n"));
  ASSERT_EQ(c.models.size(), 3u);
  EXPECT_EQ(c.models[0].dynamic_batching, DynamicBatchingConfig());
  EXPECT_FALSE(c.models[1].dynamic_batching.has_value());
  EXPECT_EQ(c.models[2].dynamic_batching, DynamicBatchingConfig());
}

TEST(ParseConfigTest, MergeKeysAndExtensionKeysShareModelSettings) {
  // Top-level `x-` keys are ignored, as in Docker Compose: a place for anchors.
  Config c = Parse(R"(x-batching: &batching
  kind: builtin
  builtin: simple
  max_batch_size: 4
models:
  - <<: *batching
    name: a
  - <<: *batching
    name: b
    max_batch_size: 2
)");
  ASSERT_EQ(c.models.size(), 2u);
  EXPECT_EQ(c.models[0].builtin, "simple");
  EXPECT_EQ(c.models[0].max_batch_size, 4);
  EXPECT_EQ(c.models[1].name, "b");
  EXPECT_EQ(c.models[1].max_batch_size, 2);  // an explicit key wins over a merged one
}

TEST(ParseConfigTest, ModelLocationsPointAtEachEntry) {
  Config c = Parse("models:\n" + Model("a") + "\n" + Model("b"));
  ASSERT_EQ(c.models.size(), 2u);
  EXPECT_EQ(c.models[0].location, (SourceLocation{"f.yaml", 2, 5}));
  EXPECT_EQ(c.models[1].location, (SourceLocation{"f.yaml", 6, 5}));
  EXPECT_EQ(c.models[1].location.ToString(), "f.yaml:6:5");
  EXPECT_EQ((SourceLocation{"x", 0, 0}).ToString(), "x");
}

// ---- Errors: every class, with its exact place -------------------------------------------------

TEST(ConfigErrorsTest, UnknownKeySuggestsTheClosestKnownKey) {
  EXPECT_THAT(Errors("server:\n  grpc:\n    adress: 127.0.0.1:1\n"),
              ElementsAre("f.yaml:3:5: unknown key `adress` in `server.grpc` (did you mean "
                          "`address`?)"));
  // The example in config.h, at its line and column.
  EXPECT_THAT(
      Errors("# c\nmodels:\n" + Model("a") + Model("b") + "    max_batch: 4\n", {}, "config.yaml"),
      ElementsAre("config.yaml:9:5: unknown key `max_batch` in `models[1]` (did you mean "
                  "`max_batch_size`?)"));
  EXPECT_THAT(Errors("Logging: {Level: debug}\n"),
              ElementsAre("f.yaml:1:1: unknown key `Logging` at the top level (did you mean "
                          "`logging`?)"));
  EXPECT_THAT(Errors("logging: {log-level: debug}\n"),
              ElementsAre("f.yaml:1:11: unknown key `log-level` in `logging` (did you mean "
                          "`level`?)"));
}

TEST(ConfigErrorsTest, UnknownKeyWithNothingCloseListsTheAllowedKeys) {
  EXPECT_THAT(Errors("logging:\n  colour: true\n"),
              ElementsAre("f.yaml:2:3: unknown key `colour` in `logging` (allowed: level, "
                          "format)"));
}

TEST(ConfigErrorsTest, KeyOneLevelTooHighSuggestsItsPlace) {
  EXPECT_THAT(Errors("grpc: {}\n"),
              ElementsAre("f.yaml:1:1: unknown key `grpc` at the top level (did you mean "
                          "`server.grpc`?)"));
  EXPECT_THAT(Errors("models:\n" + Model("a",
                                         "    max_batch_size: 4\n    dynamic_batching:\n"
                                         "      max_queue_size: 4\n")),
              ElementsAre("f.yaml:7:7: unknown key `max_queue_size` in "
                          "`models[0].dynamic_batching` (did you mean "
                          "`default_queue_policy.max_queue_size`?)"));
  EXPECT_THAT(Errors("models:\n" + Model("a", "    preferred_batch_size: [4]\n")),
              ElementsAre("f.yaml:5:5: unknown key `preferred_batch_size` in `models[0]` (did "
                          "you mean `dynamic_batching.preferred_batch_size`?)"));
}

TEST(ConfigErrorsTest, DuplicateKeysNameBothPlaces) {
  EXPECT_THAT(Errors("server:\n  http:\n    threads: 2\n    threads: 3\n"),
              ElementsAre("f.yaml:4:5: duplicate key `threads` in `server.http` (first at "
                          "f.yaml:3:5)"));
  EXPECT_THAT(Errors("logging: {}\nlogging: {}\n"),
              ElementsAre("f.yaml:2:1: duplicate key `logging` at the top level (first at "
                          "f.yaml:1:1)"));
}

TEST(ConfigErrorsTest, WrongScalarTypes) {
  EXPECT_THAT(Errors("server:\n  http:\n    threads: abc\n"),
              ElementsAre("f.yaml:3:14: `server.http.threads`: expected an integer in [1, 64], "
                          "got `abc`"));
  EXPECT_THAT(Errors("server:\n  http:\n    threads: 2.5\n"),
              ElementsAre("f.yaml:3:14: `server.http.threads`: expected an integer in [1, 64], "
                          "got `2.5`"));
  EXPECT_THAT(Errors("server:\n  grpc:\n    enabled: yes\n"),
              ElementsAre("f.yaml:3:14: `server.grpc.enabled`: expected true or false, got "
                          "`yes`"));
  EXPECT_THAT(Errors("server:\n  shutdown_grace_seconds: soon\n"),
              ElementsAre("f.yaml:2:27: `server.shutdown_grace_seconds`: expected a number in "
                          "[0, 3600], got `soon`"));
  EXPECT_THAT(Errors("server:\n  storage_dir: [a, b]\n"),
              ElementsAre("f.yaml:2:16: `server.storage_dir`: expected a string, got a "
                          "sequence"));
  EXPECT_THAT(Errors("server:\n  http: 8000\n"),
              ElementsAre("f.yaml:2:9: `server.http`: expected a mapping (keys: enabled, "
                          "address, max_body_bytes, threads, idle_timeout_seconds), got `8000`"));
  EXPECT_THAT(Errors("models: {name: a}\n"),
              ElementsAre("f.yaml:1:9: `models`: expected a list of model entries (`- name: "
                          "...`), got a mapping"));
  EXPECT_THAT(Errors("models:\n  - 5\n  -\n"),
              ElementsAre("f.yaml:2:5: `models[0]`: expected a model entry (a mapping with "
                          "`name`, `kind`, ...), got `5`",
                          "f.yaml:3:3: `models[1]`: expected a model entry (a mapping with "
                          "`name`, `kind`, ...), got null"));
}

TEST(ConfigErrorsTest, OutOfRangeValues) {
  EXPECT_THAT(Errors("server:\n  http:\n    max_body_bytes: -1\n"),
              ElementsAre("f.yaml:3:21: `server.http.max_body_bytes`: expected an integer >= 1, "
                          "got `-1`"));
  EXPECT_THAT(Errors("server:\n  grpc:\n    max_message_bytes: 2147483648\n"),
              ElementsAre("f.yaml:3:24: `server.grpc.max_message_bytes`: expected an integer in "
                          "[1, 2147483647] (gRPC's limit is 2 GiB - 1), got `2147483648`"));
  EXPECT_THAT(Errors("server:\n  http: {threads: 65}\n  max_inflight_requests: 0\n"),
              ElementsAre("f.yaml:2:19: `server.http.threads`: expected an integer in [1, 64], "
                          "got `65`",
                          "f.yaml:3:26: `server.max_inflight_requests`: expected an integer in "
                          "[1, 2147483647], got `0`"));
  EXPECT_THAT(Errors("server:\n  shutdown_grace_seconds: 3600.5\n"),
              ElementsAre("f.yaml:2:27: `server.shutdown_grace_seconds`: expected a number in "
                          "[0, 3600], got `3600.5`"));
  // Past int64: still a range error, not a wrapped-around value.
  EXPECT_THAT(Errors("server:\n  max_inflight_requests: 99999999999999999999\n"),
              ElementsAre("f.yaml:2:26: `server.max_inflight_requests`: expected an integer in "
                          "[1, 2147483647], got `99999999999999999999`"));
  EXPECT_THAT(Errors("server:\n  http: {idle_timeout_seconds: 0}\n"),
              ElementsAre("f.yaml:2:32: `server.http.idle_timeout_seconds`: expected an integer "
                          "in [1, 86400], got `0`"));
}

TEST(ConfigErrorsTest, InvalidEnumsListWhatIsAllowed) {
  EXPECT_THAT(Errors("logging:\n  level: verbose\n  format: xml\n"),
              ElementsAre("f.yaml:2:10: `logging.level`: expected one of trace, debug, info, "
                          "warn, error, critical, off; got `verbose`",
                          "f.yaml:3:11: `logging.format`: expected one of text, json; got `xml`"));
  EXPECT_THAT(Errors("logging:\n  level: warning\n"),
              ElementsAre("f.yaml:2:10: `logging.level`: expected one of trace, debug, info, "
                          "warn, error, critical, off; got `warning` (did you mean `warn`?)"));
  EXPECT_THAT(
      Errors("models:\n" + Model("a",
                                 "    max_batch_size: 2\n    dynamic_batching:\n"
                                 "      default_queue_policy: {timeout_action: DROP}\n")),
      ElementsAre("f.yaml:7:46: `models[0].dynamic_batching.default_queue_policy.timeout_action`: "
                  "expected one of REJECT, DELAY; got `DROP`"));
}

TEST(ConfigErrorsTest, MalformedYamlIsOneError) {
  EXPECT_THAT(Errors("server:\n  grpc:\n    enabled: true\n   http: {}\nlogging: [\n"),
              ElementsAre("f.yaml:4:4: invalid YAML: end of map not found"));
  EXPECT_THAT(Errors("server: \"abc"),
              ElementsAre("f.yaml:1:13: invalid YAML: illegal EOF in scalar"));
  EXPECT_THAT(Errors("server: @x\n"), ElementsAre("f.yaml:1:9: invalid YAML: unknown token"));
  EXPECT_THAT(Errors("server: {}\n---\nlogging: {}\n"),
              ElementsAre("f.yaml:3:1: expected one YAML document, found a second one (after a "
                          "`---` line)"));
}

// yaml-cpp 0.7's LoadAll loops forever, allocating, on a `,` where a document should start
// (yaml-cpp issue #1040); found by fuzzing the config parser.
TEST(ConfigErrorsTest, RegressionStrayCommaDoesNotHangTheParser) {
  EXPECT_THAT(Errors(","), ElementsAre("f.yaml:1:1: invalid YAML: unexpected `,`"));
  EXPECT_THAT(Errors("server: {}\n---\n  , x\n"),
              ElementsAre("f.yaml:3:3: invalid YAML: unexpected `,`"));
  EXPECT_THAT(
      Errors("", {"logging.level=, x"}),
      ElementsAre("<set>:1:15: invalid YAML: unexpected `,` (in --set `logging.level=, x`)"));
  StatusOr<ModelConfig> m = ParseModelConfig(", {}", "api");
  EXPECT_EQ(StatusMessage(m.status()), "api:1:1: invalid YAML: unexpected `,`");
}

TEST(ConfigErrorsTest, ControlCharactersInMessagesAreEscaped) {
  EXPECT_THAT(Errors("logging: {\"\\bcolour\\n\": 1}\n"),
              ElementsAre("f.yaml:1:11: unknown key `\\x08colour\\x0a` in `logging` (allowed: "
                          "level, format)"));
}

TEST(ConfigErrorsTest, TopLevelMustBeAMapping) {
  EXPECT_THAT(Errors("- server\n"),
              ElementsAre("f.yaml:1:1: expected a mapping at the top level (keys: server, "
                          "logging, fine_tuning, observability, models), got a sequence"));
  EXPECT_THAT(Errors("just text\n"),
              ElementsAre("f.yaml:1:1: expected a mapping at the top level (keys: server, "
                          "logging, fine_tuning, observability, models), got `just text`"));
}

TEST(ConfigErrorsTest, HostileInputIsRefusedQuickly) {
  // "Billion laughs": nine levels of ten aliases each.
  std::string bomb = "x-a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    bomb += absl::StrCat("x-a", i, ": &a", i, " [");
    for (int j = 0; j < 10; ++j) bomb += absl::StrCat(j ? ", " : "", "*a", i - 1);
    bomb += "]\n";
  }
  auto start = std::chrono::steady_clock::now();
  std::vector<std::string> errors = Errors(bomb);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_THAT(errors[0], HasSubstr("the document is too large: more than 200000 values"));

  EXPECT_THAT(Errors("x-loop: &a [*a]\n"),
              ElementsAre("f.yaml:1:9: values are nested more than 64 levels deep (a recursive "
                          "alias?)"));
}

TEST(ConfigErrorsTest, AllErrorsAreReportedInFileOrder) {
  std::vector<std::string> errors =
      Errors("models:\n" + Model("a", "    instance_count: 0\n") +
             "server:\n  grpc: {address: nope, colour: 1}\n  http: {threads: x}\n"
             "logging: {level: loud}\n");
  EXPECT_THAT(errors,
              ElementsAre("f.yaml:5:21: `models[0].instance_count`: expected an integer in [1, "
                          "64], got `0`",
                          "f.yaml:7:19: `server.grpc.address`: expected HOST:PORT, got `nope`",
                          "f.yaml:7:25: unknown key `colour` in `server.grpc` (allowed: enabled, "
                          "address, max_message_bytes, max_concurrent_streams)",
                          "f.yaml:8:19: `server.http.threads`: expected an integer in [1, 64], "
                          "got `x`",
                          "f.yaml:9:18: `logging.level`: expected one of trace, debug, info, "
                          "warn, error, critical, off; got `loud`"));
}

// ---- Cross-field validation ---------------------------------------------------------------------

TEST(HostPortTest, AcceptsIPv4BracketedIPv6AndNames) {
  struct Case {
    std::string_view text;
    HostPort want;
  };
  for (const Case& c : {Case{"0.0.0.0:0", {"0.0.0.0", 0, false}},
                        Case{"127.0.0.1:65535", {"127.0.0.1", 65535, false}},
                        Case{"[::1]:8001", {"::1", 8001, true}}, Case{"[::]:80", {"::", 80, true}},
                        Case{"[2001:db8::1]:443", {"2001:db8::1", 443, true}},
                        Case{"localhost:8000", {"localhost", 8000, false}},
                        Case{"kiln-0.kiln.svc.cluster.local:8001",
                             {"kiln-0.kiln.svc.cluster.local", 8001, false}}}) {
    StatusOr<HostPort> hp = ParseHostPort(c.text);
    ASSERT_TRUE(hp.ok()) << c.text << ": " << hp.status();
    EXPECT_EQ(*hp, c.want) << c.text;
  }
}

TEST(HostPortTest, RejectsWhatCannotBeListenedOn) {
  struct Case {
    std::string_view text;
    std::string_view message;
  };
  for (const Case& c : {
           Case{"8001", "expected HOST:PORT, got `8001`"},
           Case{":8001",
                "expected HOST:PORT with a HOST (0.0.0.0 listens on every interface), "
                "got `:8001`"},
           Case{"host:", "expected HOST:PORT with PORT in [0, 65535], got `host:`"},
           Case{"host:65536", "expected HOST:PORT with PORT in [0, 65535], got `host:65536`"},
           Case{"host:-1", "expected HOST:PORT with PORT in [0, 65535], got `host:-1`"},
           Case{"host:80x", "expected HOST:PORT with PORT in [0, 65535], got `host:80x`"},
           Case{"::1:8001",
                "expected HOST:PORT with an IPv6 HOST in brackets, e.g. [::1]:8001, "
                "got `::1:8001`"},
           Case{"[::1]8001",
                "expected HOST:PORT with an IPv6 HOST in brackets, e.g. "
                "[::1]:8001, got `[::1]8001`"},
           Case{"[zz::1]:80",
                "expected HOST:PORT where [HOST] is an IPv6 address, got "
                "`[zz::1]:80`"},
           Case{"256.0.0.1:80",
                "expected HOST:PORT where HOST is an IPv4 address, [IPv6 "
                "address] or host name, got `256.0.0.1:80`"},
           Case{"1.2.3:80",
                "expected HOST:PORT where HOST is an IPv4 address, [IPv6 address] "
                "or host name, got `1.2.3:80`"},
           Case{"-bad.example:80",
                "expected HOST:PORT where HOST is an IPv4 address, [IPv6 "
                "address] or host name, got `-bad.example:80`"},
           Case{"a b:80",
                "expected HOST:PORT where HOST is an IPv4 address, [IPv6 address] or "
                "host name, got `a b:80`"},
       }) {
    StatusOr<HostPort> hp = ParseHostPort(c.text);
    ASSERT_FALSE(hp.ok()) << c.text;
    EXPECT_EQ(hp.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(StatusMessage(hp.status()), c.message);
  }
}

TEST(CrossFieldTest, AddressErrorsAreAtTheValue) {
  // The example in config.h.
  EXPECT_THAT(Errors("server:\n  grpc:\n    address: 8001\n", {}, "config.yaml"),
              ElementsAre("config.yaml:3:14: `server.grpc.address`: expected HOST:PORT, got "
                          "`8001`"));
  EXPECT_THAT(Errors("server:\n  metrics: {address: \"[::1]:70000\"}\n"),
              ElementsAre("f.yaml:2:22: `server.metrics.address`: expected HOST:PORT with PORT "
                          "in [0, 65535], got `[::1]:70000`"));
}

TEST(CrossFieldTest, TwoListenersOnOnePortConflict) {
  EXPECT_THAT(Errors("server:\n  grpc: {address: 0.0.0.0:9000}\n  http: {address: "
                     "127.0.0.1:9000}\n"),
              ElementsAre("f.yaml:3:19: `server.http.address`: port 9000 is also used by "
                          "`server.grpc.address` (0.0.0.0:9000, at f.yaml:2:19)"));
  // Different hosts, a disabled listener, or port 0 do not conflict.
  Parse("server:\n  grpc: {address: 10.0.0.1:9000}\n  http: {address: 10.0.0.2:9000}\n");
  Parse(
      "server:\n  grpc: {address: 0.0.0.0:9000}\n  http: {enabled: false, address: "
      "0.0.0.0:9000}\n");
  Parse(
      "server:\n  grpc: {address: 0.0.0.0:0}\n  http: {address: 0.0.0.0:0}\n"
      "  metrics: {address: 0.0.0.0:0}\n");
}

TEST(CrossFieldTest, ModelNames) {
  EXPECT_THAT(Errors("models:\n" + Model("my model")),
              ElementsAre("f.yaml:2:11: `models[0].name`: expected 1 to 128 characters from "
                          "[A-Za-z0-9_.-], got `my model`"));
  Parse("models:\n" + Model(std::string(128, 'n')));
  EXPECT_THAT(Errors("models:\n" + Model(std::string(129, 'n'))),
              ElementsAre(absl::StrCat("f.yaml:2:11: `models[0].name`: expected 1 to 128 "
                                       "characters from [A-Za-z0-9_.-], got `",
                                       std::string(129, 'n'), "`")));
  // A long value is quoted only in part: messages may go back to API clients.
  EXPECT_THAT(Errors("models:\n" + Model(std::string(1000, 'n'))),
              ElementsAre(absl::StrCat("f.yaml:2:11: `models[0].name`: expected 1 to 128 "
                                       "characters from [A-Za-z0-9_.-], got `",
                                       std::string(200, 'n'), "...` (1000 characters)")));
  EXPECT_THAT(Errors("models:\n  - kind: builtin\n    builtin: simple\n"),
              ElementsAre("f.yaml:2:5: `models[0].name`: missing; every model needs a name of 1 "
                          "to 128 characters from [A-Za-z0-9_.-]"));
}

TEST(CrossFieldTest, DuplicateModelNamesNameBothPlaces) {
  EXPECT_THAT(Errors("models:\n" + Model("a") + Model("b") + Model("a")),
              ElementsAre("f.yaml:8:11: `models[2].name`: duplicate model name `a` (first at "
                          "f.yaml:2:11, `models[0].name`)"));
}

TEST(CrossFieldTest, KindBuiltinPathAndBackend) {
  EXPECT_THAT(
      Errors("models:\n  - name: a\n"),
      ElementsAre(
          "f.yaml:2:5: `models[0].kind`: missing; expected one of builtin, llm, embedding"));
  EXPECT_THAT(Errors("models:\n  - name: a\n    kind: lm\n    path: /m\n"),
              ElementsAre("f.yaml:3:11: `models[0].kind`: unknown model kind `lm`; expected one "
                          "of builtin, llm, embedding (did you mean `llm`?)"));
  EXPECT_THAT(Errors("models:\n  - name: a\n    kind: builtin\n"),
              ElementsAre("f.yaml:2:5: `models[0].builtin`: missing; expected one of simple, "
                          "identity_fp32, sleep_us, simple_string, simple_int8, simple_identity, "
                          "custom_identity_int32, repeat_int32, simple_sequence"));
  EXPECT_THAT(Errors("models:\n  - name: a\n    kind: builtin\n    builtin: sleep\n"),
              ElementsAre("f.yaml:4:14: `models[0].builtin`: unknown built-in model `sleep`; "
                          "expected one of simple, identity_fp32, sleep_us, simple_string, "
                          "simple_int8, simple_identity, custom_identity_int32, repeat_int32, "
                          "simple_sequence "
                          "(did you mean `sleep_us`?)"));
  EXPECT_THAT(Errors("models:\n" + Model("a", "    path: /models/a\n    backend: cdua\n")),
              ElementsAre("f.yaml:5:11: `models[0].path`: not used by kind `builtin` (it loads "
                          "no weights)",
                          "f.yaml:6:14: `models[0].backend`: unknown backend `cdua`; expected "
                          "one of cpu, cuda, hip, xpu, ref (did you mean `cuda`?)"));
}

TEST(CrossFieldTest, InstanceCountAndMaxBatchSizeBounds) {
  Parse("models:\n" + Model("a", "    instance_count: 64\n    max_batch_size: 1048576\n"));
  EXPECT_THAT(Errors("models:\n" + Model("a", "    instance_count: 65\n    max_batch_size: -1\n")),
              ElementsAre("f.yaml:5:21: `models[0].instance_count`: expected an integer in [1, "
                          "64], got `65`",
                          "f.yaml:6:21: `models[0].max_batch_size`: expected an integer in [0, "
                          "1048576], got `-1`"));
}

TEST(CrossFieldTest, PreferredBatchSizes) {
  auto with = [](std::string_view max_batch_size, std::string_view sizes) {
    return "models:\n" + Model("a", absl::StrCat("    max_batch_size: ", ToAbsl(max_batch_size),
                                                 "\n    dynamic_batching:\n"
                                                 "      preferred_batch_size: ",
                                                 ToAbsl(sizes), "\n"));
  };
  Parse(with("8", "[1, 4, 8]"));
  EXPECT_THAT(Errors(with("8", "[2, 16, 4, 4, 0]")),
              ElementsAre("f.yaml:7:33: `models[0].dynamic_batching.preferred_batch_size[1]`: "
                          "expected a batch size in [1, 8] (max_batch_size), got `16`",
                          "f.yaml:7:40: `models[0].dynamic_batching.preferred_batch_size[3]`: "
                          "expected sizes in ascending order without repeats, got `4` after `4`",
                          "f.yaml:7:43: `models[0].dynamic_batching.preferred_batch_size[4]`: "
                          "expected an integer in [1, 1048576], got `0`"));
  // Indices stay those written when an earlier entry is not a number.
  EXPECT_THAT(Errors(with("8", "[x, 4, 2]")),
              ElementsAre("f.yaml:7:30: `models[0].dynamic_batching.preferred_batch_size[0]`: "
                          "expected an integer in [1, 1048576], got `x`",
                          "f.yaml:7:36: `models[0].dynamic_batching.preferred_batch_size[2]`: "
                          "expected sizes in ascending order without repeats, got `2` after `4`"));
  EXPECT_THAT(Errors(with("0", "[4]")),
              ElementsAre("f.yaml:7:29: `models[0].dynamic_batching.preferred_batch_size`: "
                          "needs max_batch_size > 0, but max_batch_size is 0 (the model does not "
                          "batch)"));
  EXPECT_THAT(Errors(with("8", "4")),
              ElementsAre("f.yaml:7:29: `models[0].dynamic_batching.preferred_batch_size`: "
                          "expected a list of batch sizes such as [4, 8], got `4`"));
  // A bad max_batch_size is reported once, not again through the sizes that depend on it.
  EXPECT_THAT(Errors(with("many", "[4]")),
              ElementsAre("f.yaml:5:21: `models[0].max_batch_size`: expected an integer in [0, "
                          "1048576], got `many`"));
}

TEST(CrossFieldTest, PriorityLevels) {
  auto with = [](std::string_view lines) {
    return "models:\n" + Model("a", absl::StrCat("    max_batch_size: 4\n    dynamic_batching:\n",
                                                 ToAbsl(lines)));
  };
  Parse(
      with("      priority_levels: 3\n      default_priority_level: 1\n"
           "      priority_queue_policy: {3: {max_queue_size: 1}}\n"));
  // Triton: with priority_levels 0 the default level must be 0 (or absent).
  EXPECT_THAT(Errors(with("      default_priority_level: 1\n")),
              ElementsAre("f.yaml:7:31: `models[0].dynamic_batching.default_priority_level`: "
                          "must be 0 or absent when priority_levels is 0 (a single level), got "
                          "`1`"));
  EXPECT_THAT(Errors(with("      priority_levels: 2\n      default_priority_level: 3\n")),
              ElementsAre("f.yaml:8:31: `models[0].dynamic_batching.default_priority_level`: "
                          "expected a level in [1, 2] (priority_levels), got `3`"));
  EXPECT_THAT(Errors(with("      priority_levels: 2\n")),
              ElementsAre("f.yaml:7:7: `models[0].dynamic_batching.default_priority_level`: "
                          "missing; required in [1, 2] when priority_levels is 2"));
  EXPECT_THAT(Errors(with("      priority_levels: 1025\n")),
              ElementsAre("f.yaml:7:24: `models[0].dynamic_batching.priority_levels`: expected "
                          "an integer in [0, 1024], got `1025`"));
  EXPECT_THAT(Errors(with("      priority_levels: 2\n      default_priority_level: 1\n"
                          "      priority_queue_policy:\n        3: {}\n        x: {}\n"
                          "        1: {}\n        01: {}\n")),
              ElementsAre("f.yaml:10:9: `models[0].dynamic_batching.priority_queue_policy.3`: "
                          "priority level 3 is not in [1, 2] (priority_levels)",
                          "f.yaml:11:9: `models[0].dynamic_batching.priority_queue_policy`: "
                          "expected a priority level (an integer in [1, 1024]) as key, got `x`",
                          "f.yaml:13:9: duplicate priority level 1 in "
                          "`models[0].dynamic_batching.priority_queue_policy` (first at "
                          "f.yaml:12:9)"));
  EXPECT_THAT(Errors(with("      priority_queue_policy: {1: {}}\n")),
              ElementsAre("f.yaml:7:30: `models[0].dynamic_batching.priority_queue_policy`: "
                          "needs priority_levels > 0, but priority_levels is 0"));
}

TEST(CrossFieldTest, QueuePolicies) {
  Config c = Parse("models:\n" + Model("a",
                                       "    max_batch_size: 4\n    dynamic_batching:\n"
                                       "      default_queue_policy: {timeout_action: "
                                       "Delay}\n"));
  EXPECT_EQ(c.models[0].dynamic_batching->default_queue_policy.timeout_action,
            QueuePolicy::TimeoutAction::kDelay);
  EXPECT_THAT(
      Errors("models:\n" + Model("a",
                                 "    dynamic_batching:\n      default_queue_policy:\n"
                                 "        default_timeout_microseconds: 86400000001\n"
                                 "        max_queue_size: -1\n")),
      ElementsAre("f.yaml:7:39: "
                  "`models[0].dynamic_batching.default_queue_policy.default_timeout_microseconds`"
                  ": expected an integer in [0, 86400000000] (at most 24 hours), got "
                  "`86400000001`",
                  "f.yaml:8:25: `models[0].dynamic_batching.default_queue_policy.max_queue_size`: "
                  "expected an integer in [0, 4294967295], got `-1`"));
}

// ---- --set overrides
// ------------------------------------------------------------------------------

TEST(OverridesTest, SetScalarsListEntriesAndWholeValues) {
  Config c =
      Parse(DefaultConfigYaml(),
            {"server.grpc.address=127.0.0.1:0", "models[1].max_batch_size=4", "logging.level=debug",
             "server.http.enabled=false", "models[2].dynamic_batching.preferred_batch_size=[4, 8]",
             "models[0].dynamic_batching.default_queue_policy={max_queue_size: 3}",
             " server.shutdown_grace_seconds = 2.5"});
  EXPECT_EQ(c.server.grpc.address, "127.0.0.1:0");
  EXPECT_EQ(c.models[1].max_batch_size, 4);
  EXPECT_EQ(c.logging.level, "debug");
  EXPECT_FALSE(c.server.http.enabled);
  EXPECT_THAT(c.models[2].dynamic_batching->preferred_batch_size, ElementsAre(4, 8));
  EXPECT_EQ(c.models[0].dynamic_batching->default_queue_policy.max_queue_size, 3u);
  EXPECT_EQ(c.server.shutdown_grace_seconds, 2.5);
  // Everything else is untouched.
  Config expected = DocumentedDefaults();
  expected.server.grpc.address = "127.0.0.1:0";
  expected.models[1].max_batch_size = 4;
  expected.logging.level = "debug";
  expected.server.http.enabled = false;
  expected.models[2].dynamic_batching->preferred_batch_size = {4, 8};
  expected.models[0].dynamic_batching->default_queue_policy.max_queue_size = 3;
  expected.server.shutdown_grace_seconds = 2.5;
  EXPECT_EQ(c, expected);
}

TEST(OverridesTest, AppendModelsAndBuildAnEmptyFile) {
  Config c = Parse("", {"models[0]={name: a, kind: builtin, builtin: simple}", "models[1].name=b",
                        "models[1].kind=builtin", "models[1].builtin=sleep_us",
                        "models[1].dynamic_batching.priority_queue_policy.1.max_queue_size=5",
                        "models[1].dynamic_batching.priority_levels=1",
                        "models[1].dynamic_batching.default_priority_level=1"});
  ASSERT_EQ(c.models.size(), 2u);
  EXPECT_EQ(c.models[0].name, "a");
  EXPECT_EQ(c.models[1].builtin, "sleep_us");
  EXPECT_EQ(c.models[1].dynamic_batching->priority_queue_policy.at(1).max_queue_size, 5u);
  EXPECT_EQ(c.models[1].location, (SourceLocation{"<set>", 2, 7}));  // at `[1]`
}

TEST(OverridesTest, AreAppliedBeforeValidation) {
  // The file alone is invalid; the override fixes it.
  Config c = Parse("server:\n  http:\n    threads: 100\n", {"server.http.threads=4"});
  EXPECT_EQ(c.server.http.threads, 4);
  // An empty value means "the default".
  EXPECT_EQ(Parse("server:\n  http:\n    threads: 100\n", {"server.http.threads="}), Config());
}

TEST(OverridesTest, ErrorsNameTheOverride) {
  EXPECT_THAT(Errors(DefaultConfigYaml(), {"models[1].max_batch_size=abc"}),
              ElementsAre("<set>:1:26: `models[1].max_batch_size`: expected an integer in [0, "
                          "1048576], got `abc` (in --set `models[1].max_batch_size=abc`)"));
  EXPECT_THAT(Errors("", {"logging.level=info", "server.grpc.adress=127.0.0.1:1"}),
              ElementsAre("<set>:2:13: unknown key `adress` in `server.grpc` (did you mean "
                          "`address`?) (in --set `server.grpc.adress=127.0.0.1:1`)"));
  EXPECT_THAT(Errors("", {"sever.grpc.address=127.0.0.1:1"}),
              ElementsAre("<set>:1:1: unknown key `sever` at the top level (did you mean "
                          "`server`?) (in --set `sever.grpc.address=127.0.0.1:1`)"));
  EXPECT_THAT(Errors(DefaultConfigYaml(), {"models[6].name=x"}),
              ElementsAre("<set>:1:7: index [6] is out of range: `models` has 5 entries (use [5] "
                          "to append one) (in --set `models[6].name=x`)"));
  EXPECT_THAT(Errors("", {"logging.level"}),
              ElementsAre("<set>:1:1: expected PATH=VALUE, e.g. "
                          "`server.grpc.address=127.0.0.1:0` (in --set `logging.level`)"));
  EXPECT_THAT(Errors("", {"models[x].name=a"}),
              ElementsAre("<set>:1:7: invalid PATH in PATH=VALUE: expected a list index such as "
                          "`[0]` (in --set `models[x].name=a`)"));
  EXPECT_THAT(Errors("", {"logging..level=info"}),
              ElementsAre("<set>:1:9: invalid PATH in PATH=VALUE: expected a key (in --set "
                          "`logging..level=info`)"));
  EXPECT_THAT(Errors(DefaultConfigYaml(), {"logging.level.x=1"}),
              ElementsAre("<set>:1:15: `logging.level` is `info`, not a mapping; it has no key "
                          "`x` (in --set `logging.level.x=1`)"));
  EXPECT_THAT(Errors("", {"server.grpc.address=[1"}),
              ElementsAre("<set>:1:21: invalid YAML: end of sequence flow not found (in --set "
                          "`server.grpc.address=[1`)"));
  EXPECT_THAT(
      Errors("", {"server=5"}),
      ElementsAre("<set>:1:8: `server`: expected a mapping (keys: grpc, http, metrics, "
                  "auth, tls, max_inflight_requests, shutdown_grace_seconds, storage_dir), got `5` "
                  "(in --set `server=5`)"));
}

TEST(OverridesTest, AFailedOverrideChangesNothing) {
  // The second override fails on `[3]`; its `models` list must not have been created.
  std::vector<std::string> errors = Errors("", {"models[3].name=a"});
  EXPECT_THAT(errors, ElementsAre("<set>:1:7: index [3] is out of range: `models` has 0 entries "
                                  "(use [0] to append one) (in --set `models[3].name=a`)"));
}

// ---- Round trip ---------------------------------------------------------------------------------

TEST(ToYamlTest, RoundTripsTheDefaults) {
  StatusOr<Config> back = ParseConfig(ToYaml(DefaultConfig()), "round-trip");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << ToYaml(DefaultConfig());
  EXPECT_EQ(*back, DefaultConfig());
  EXPECT_EQ(ToYaml(Config()), ToYaml(*ParseConfig("", "empty")));
}

TEST(ToYamlTest, RoundTripsEveryFieldAndAwkwardStrings) {
  Config c;
  c.server.grpc = {false, "[::1]:1", 5, 6};
  c.server.http = {false, "kiln.local:2", 7, 8, 9};
  c.server.metrics = {false, "1.2.3.4:3"};
  c.server.max_inflight_requests = 10;
  c.server.shutdown_grace_seconds = 0.1;
  c.server.storage_dir = "dir with spaces #not a comment: \"quoted\" \\ back\ttab é";
  c.logging = {"critical", "json"};
  for (std::string_view name : {"null", "true", "123", "-x", "a.b"}) {
    ModelConfig m;
    m.name = std::string(name);
    m.kind = "builtin";
    m.builtin = "identity_fp32";
    c.models.push_back(m);
  }
  ModelConfig& m = c.models[0];
  m.instance_count = 3;
  m.max_batch_size = 32;
  m.load_on_start = false;
  DynamicBatchingConfig& db = m.dynamic_batching.emplace();
  db.preferred_batch_size = {4, 16};
  db.max_queue_delay_microseconds = 77;
  db.preserve_ordering = true;
  db.priority_levels = 4;
  db.default_priority_level = 3;
  db.default_queue_policy = {QueuePolicy::TimeoutAction::kDelay, 11, true, 12};
  db.priority_queue_policy[2] = {QueuePolicy::TimeoutAction::kReject, 13, false, 14};
  db.priority_queue_policy[4] = {QueuePolicy::TimeoutAction::kDelay, 0, true, 0};
  ASSERT_TRUE(ValidateModel(m, "m").ok());

  std::string yaml = ToYaml(c);
  StatusOr<Config> back = ParseConfig(yaml, "round-trip");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << yaml;
  EXPECT_EQ(*back, c) << yaml;
  EXPECT_EQ(back->server.storage_dir, c.server.storage_dir);
  EXPECT_EQ(back->models[0].name, "null");
}

// ---- sequence_batching ----------------------------------------------------------------------

std::string SequenceModel(std::string_view section) {
  return absl::StrCat(
      "  - name: s\n    kind: builtin\n    builtin: simple_sequence\n"
      "    max_batch_size: 8\n    sequence_batching:\n",
      ToAbsl(section));
}

TEST(SequenceBatchingConfigTest, TritonShapeParsesAndRoundTrips) {
  Config c = Parse("models:\n" + SequenceModel(R"(      max_sequence_idle_microseconds: 5000000
      oldest: {max_candidate_sequences: 4, preferred_batch_size: [2, 4],
               max_queue_delay_microseconds: 100, preserve_ordering: true}
      control_input:
        - name: START
          control: [{kind: CONTROL_SEQUENCE_START, int32_false_true: [0, 1]}]
        - name: READY
          control: [{kind: CONTROL_SEQUENCE_READY, fp32_false_true: [0, 1.5]}]
        - name: END
          control: [{kind: CONTROL_SEQUENCE_END, bool_false_true: [false, true]}]
        - name: CORRID
          control: [{kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_STRING}]
)"));
  ASSERT_EQ(c.models.size(), 1u);
  const SequenceBatchingConfig& sb = *c.models[0].sequence_batching;
  EXPECT_EQ(sb.strategy, SequenceBatchingConfig::Strategy::kOldest);
  EXPECT_EQ(sb.max_sequence_idle_microseconds, 5000000u);
  EXPECT_EQ(sb.oldest_max_candidate_sequences, 4);
  EXPECT_THAT(sb.oldest_preferred_batch_size, ElementsAre(2, 4));
  EXPECT_TRUE(sb.oldest_preserve_ordering);
  ASSERT_EQ(sb.control_input.size(), 4u);
  EXPECT_EQ(sb.control_input[1].control[0].kind, SequenceControlConfig::Kind::kReady);
  EXPECT_THAT(sb.control_input[1].control[0].fp32_false_true, ElementsAre(0.0f, 1.5f));
  EXPECT_THAT(sb.control_input[2].control[0].bool_false_true, ElementsAre(false, true));
  EXPECT_EQ(sb.control_input[3].control[0].data_type, "TYPE_STRING");
  StatusOr<Config> back = ParseConfig(ToYaml(c), "round-trip");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << ToYaml(c);
  EXPECT_EQ(*back, c) << ToYaml(c);

  // Defaults: direct, 1 s idle; `direct: {}` and nothing at all are the same.
  Config d = Parse("models:\n" + SequenceModel("      direct: {}\n"));
  EXPECT_EQ(*d.models[0].sequence_batching, SequenceBatchingConfig());
  StatusOr<Config> d_back = ParseConfig(ToYaml(d), "round-trip");
  ASSERT_TRUE(d_back.ok()) << d_back.status();
  EXPECT_EQ(*d_back, d);
}

TEST(SequenceBatchingConfigTest, JsonAsTritonWritesIt) {
  StatusOr<ModelConfig> m = ParseModelConfig(
      R"({"name": "s", "kind": "builtin", "builtin": "simple_sequence", "max_batch_size": 8,
          "sequence_batching": {"max_sequence_idle_microseconds": "5000000", "direct": {},
            "control_input": [{"name": "START", "control": [
              {"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]}]}})",
      "api");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->sequence_batching->max_sequence_idle_microseconds, 5000000u);
  EXPECT_EQ(m->sequence_batching->control_input[0].name, "START");
}

TEST(SequenceBatchingConfigTest, ErrorsNameTheField) {
  EXPECT_THAT(
      Errors("models:\n" + SequenceModel(R"(      direct: {}
      oldest: {max_candidate_sequences: 0, preferred_batch_size: [16]}
      control_input:
        - name: START
          control: [{kind: CONTROL_SEQUENCE_BEGIN, int32_false_true: [0, 1]}]
        - name: START
          control: [{kind: CONTROL_SEQUENCE_READY, int32_false_true: [0, 1, 2]}]
        - name: C
          control: [{kind: CONTROL_SEQUENCE_CORRID}]
        - name: E
          control: [{kind: CONTROL_SEQUENCE_END, int32_false_true: [0, 1],
                     bool_false_true: [false, true]}]
        - name: R
          control: []
)")),
      ElementsAre(HasSubstr("`models[0].sequence_batching.oldest`: `direct` and `oldest` exclude "
                            "each other"),
                  HasSubstr("`models[0].sequence_batching.control_input[0].control[0].kind`: "
                            "expected one of CONTROL_SEQUENCE_START"),
                  HasSubstr("`models[0].sequence_batching.control_input[1].name`: input `START` "
                            "is already a control input (control_input[0])"),
                  HasSubstr("`models[0].sequence_batching.control_input[1].control[0]."
                            "int32_false_true`: expected two values [false, true], got 3"),
                  HasSubstr("`models[0].sequence_batching.control_input[2].control[0]."
                            "data_type`: missing; CONTROL_SEQUENCE_CORRID needs"),
                  HasSubstr("`models[0].sequence_batching.control_input[3].control[0]`: "
                            "`CONTROL_SEQUENCE_END` needs exactly one of"),
                  HasSubstr("`models[0].sequence_batching.control_input[4].control`: expected "
                            "exactly one control, got 0")));
  EXPECT_THAT(Errors("models:\n" + SequenceModel("      oldest: {max_candidate_sequences: 0, "
                                                 "preferred_batch_size: [16]}\n")),
              ElementsAre(HasSubstr("`models[0].sequence_batching.oldest.max_candidate_"
                                    "sequences`: expected an integer in [1, 65536]"),
                          HasSubstr("`models[0].sequence_batching.oldest.preferred_batch_size[0]`"
                                    ": expected a batch size in [1, 8] (max_batch_size), got "
                                    "`16`")));
  EXPECT_THAT(
      Errors("models:\n" + SequenceModel("      direct: {}\n") + "    dynamic_batching: {}\n"),
      ElementsAre(HasSubstr("`models[0].sequence_batching`: excludes `dynamic_batching`")));
}

TEST(ToYamlTest, EqualityIgnoresWhereTheConfigCameFrom) {
  Config a = Parse("models:\n" + Model("a"));
  Config b = Parse("\n\nmodels:\n" + Model("a"));
  EXPECT_NE(a.models[0].location, b.models[0].location);
  EXPECT_EQ(a, b);
  b.models[0].max_batch_size = 1;
  EXPECT_NE(a, b);
}

// ---- One model entry (the model-load API)
// ----------------------------------------------------------

TEST(ParseModelConfigTest, JsonEntry) {
  StatusOr<ModelConfig> m = ParseModelConfig(
      R"({"name": "m1", "kind": "builtin", "builtin": "simple", "max_batch_size": 8,
          "dynamic_batching": {"preferred_batch_size": [4, 8],
                               "max_queue_delay_microseconds": "100",
                               "default_queue_policy": {"timeout_action": "DELAY"}}})",
      "load(m1)");
  ASSERT_TRUE(m.ok()) << m.status();
  ModelConfig want;
  want.name = "m1";
  want.kind = "builtin";
  want.builtin = "simple";
  want.max_batch_size = 8;
  DynamicBatchingConfig& db = want.dynamic_batching.emplace();
  db.preferred_batch_size = {4, 8};
  db.max_queue_delay_microseconds = 100;  // protobuf JSON writes 64-bit integers as strings
  db.default_queue_policy.timeout_action = QueuePolicy::TimeoutAction::kDelay;
  EXPECT_EQ(*m, want);
  EXPECT_EQ(m->location, (SourceLocation{"load(m1)", 1, 1}));
}

TEST(ParseModelConfigTest, YamlEntry) {
  StatusOr<ModelConfig> m =
      ParseModelConfig("name: m\nkind: builtin\nbuiltin: sleep_us\ninstance_count: 2\n", "api");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->instance_count, 2);
}

TEST(ParseModelConfigTest, JsonThatYamlCppCannotReadStillParses) {
  // yaml-cpp rejects surrogate-pair escapes; nlohmann_json reads them (the name is then
  // invalid, which shows the value got through).
  StatusOr<ModelConfig> m = ParseModelConfig(
      R"({"name": "m\ud83d\ude00", "kind": "builtin", "builtin": "simple"})", "api");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(
      StatusMessage(m.status()),
      "api: `name`: expected 1 to 128 characters from [A-Za-z0-9_.-], got `m\xF0\x9F\x98\x80`");
}

TEST(ParseModelConfigTest, ErrorsHaveTheSameShapeAsInAFile) {
  auto message = [](std::string_view text) {
    StatusOr<ModelConfig> m = ParseModelConfig(text, "api");
    EXPECT_FALSE(m.ok()) << text;
    return m.ok() ? std::string() : std::string(StatusMessage(m.status()));
  };
  EXPECT_EQ(message("{\"name\": \"m\", \"kind\": \"builtin\", \"builtin\": \"simple\",\n"
                    " \"max_batch\": 4, \"instance_count\": 0}"),
            "api:2:2: unknown key `max_batch` in the model entry (did you mean "
            "`max_batch_size`?)\n"
            "api:2:36: `instance_count`: expected an integer in [1, 64], got `0`");
  EXPECT_EQ(message("{\"name\": \"m\",, }"),
            "api:1:14: invalid JSON: syntax error while parsing object key - unexpected ','; "
            "expected string literal");
  EXPECT_EQ(message("[1]"),
            "api:1:1: expected a model entry (a mapping with `name`, `kind`, ...), got a sequence");
  EXPECT_EQ(message(""),
            "api:1:1: empty model configuration; expected a mapping with at least `name` and "
            "`kind`");
  // yaml-cpp reports an unclosed flow sequence where the input ends.
  EXPECT_EQ(message("name: a\nkind: [x\n"),
            "api:3:1: invalid YAML: end of sequence flow not found");
}

// A tensor model with every batching setting written.
ModelConfig BatchingBase() {
  ModelConfig m;
  m.name = "m";
  m.kind = "builtin";
  m.builtin = "simple";
  m.max_batch_size = 8;
  m.instance_count = 2;
  DynamicBatchingConfig& db = m.dynamic_batching.emplace();
  db.preferred_batch_size = {4, 8};
  db.max_queue_delay_microseconds = 100;
  db.priority_levels = 2;
  db.default_priority_level = 2;
  db.default_queue_policy.max_queue_size = 16;
  db.priority_queue_policy[1].timeout_action = QueuePolicy::TimeoutAction::kDelay;
  return m;
}

ModelConfig LlmBase() {
  ModelConfig m;
  m.name = "llm";
  m.kind = "llm";
  m.path = "/models/m.gguf";
  m.context_length = 1024;
  m.scheduler.max_num_seqs = 16;
  m.scheduler.capture_batch_sizes = {1, 2, 4, 8, 16};  // the defaults up to max_num_seqs
  LoraAdapterConfig& a = m.adapters.emplace_back();
  a.name = "sql";
  a.path = "/adapters/sql";
  a.runtime = true;
  return m;
}

TEST(MergeModelConfigTest, AnEmptyPatchKeepsEverything) {
  for (const ModelConfig& base : {BatchingBase(), LlmBase()}) {
    StatusOr<ModelConfig> m = MergeModelConfig(base, "{}", "load");
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(*m, base) << base.name;
  }
}

TEST(MergeModelConfigTest, KeysGivenReplaceTheRestIsKept) {
  // Triton's load_model(name, config='{"max_batch_size": 16}'): regression, it was refused
  // with "`kind`: missing".
  StatusOr<ModelConfig> m = MergeModelConfig(BatchingBase(), R"({"max_batch_size": 16})", "load");
  ASSERT_TRUE(m.ok()) << m.status();
  ModelConfig want = BatchingBase();
  want.max_batch_size = 16;
  EXPECT_EQ(*m, want);
}

TEST(MergeModelConfigTest, MappingsMergeListsReplaceNullResets) {
  StatusOr<ModelConfig> m = MergeModelConfig(
      BatchingBase(),
      R"({"dynamic_batching": {"max_queue_delay_microseconds": 500, "preferred_batch_size": [2],
                               "default_queue_policy": {"allow_timeout_override": true}},
          "instance_count": null})",
      "load");
  ASSERT_TRUE(m.ok()) << m.status();
  ModelConfig want = BatchingBase();
  want.instance_count = 1;  // the default
  want.dynamic_batching->max_queue_delay_microseconds = 500;
  want.dynamic_batching->preferred_batch_size = {2};
  want.dynamic_batching->default_queue_policy.allow_timeout_override = true;
  EXPECT_EQ(*m, want);

  m = MergeModelConfig(BatchingBase(), "dynamic_batching: null\n", "load");  // YAML as well
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->dynamic_batching.has_value());
}

TEST(MergeModelConfigTest, TheMergedEntryIsValidatedAsAWhole) {
  auto message = [](const ModelConfig& base, std::string_view text) {
    StatusOr<ModelConfig> m = MergeModelConfig(base, text, "load");
    EXPECT_FALSE(m.ok()) << text;
    return m.ok() ? std::string() : std::string(StatusMessage(m.status()));
  };
  // A value kept from the base conflicts with the new one: named by its path.
  EXPECT_EQ(message(BatchingBase(), R"({"max_batch_size": 4})"),
            "load: `dynamic_batching.preferred_batch_size[1]`: expected a batch size in [1, 4] "
            "(max_batch_size), got `8`");
  // Problems in the patch have its line and column.
  EXPECT_EQ(message(BatchingBase(), "{\"max_batch\": 4}"),
            "load:1:2: unknown key `max_batch` in the model entry (did you mean "
            "`max_batch_size`?)");
  EXPECT_EQ(message(BatchingBase(), R"({"instance_count": 3, "instance_count": 4})"),
            "load:1:23: duplicate key `instance_count` in the model entry (first at load:1:2)");
  EXPECT_EQ(message(BatchingBase(), ""),
            "load:1:1: empty model configuration; expected a mapping with the keys to change "
            "(`{}` for none)");
  EXPECT_EQ(message(BatchingBase(), "[1]"),
            "load:1:1: expected a model entry (a mapping with `name`, `kind`, ...), got a "
            "sequence");
}

TEST(MergeModelConfigTest, DefaultCaptureSizesFollowANewMaxNumSeqs) {
  StatusOr<ModelConfig> m =
      MergeModelConfig(LlmBase(), R"({"scheduler": {"max_num_seqs": 4}})", "load");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->scheduler.max_num_seqs, 4);
  EXPECT_EQ(m->scheduler.capture_batch_sizes, (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(m->context_length, 1024);
  // Sizes that were written stay, and are checked against the new limit.
  ModelConfig written = LlmBase();
  written.scheduler.capture_batch_sizes = {1, 16};
  EXPECT_FALSE(MergeModelConfig(written, R"({"scheduler": {"max_num_seqs": 4}})", "load").ok());
}

TEST(MergeModelConfigTest, AdaptersAddedWhileServingStaySo) {
  StatusOr<ModelConfig> m = MergeModelConfig(LlmBase(), R"({"context_length": 512})", "load");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->adapters.size(), 1u);
  EXPECT_TRUE(m->adapters[0].runtime);
  EXPECT_EQ(m->context_length, 512);
}

TEST(ValidateModelTest, ChecksStructsBuiltInCode) {
  ModelConfig m;
  m.name = "ok";
  m.kind = "builtin";
  m.builtin = "simple";
  EXPECT_TRUE(ValidateModel(m, "api").ok());

  m.name = "bad name";
  m.instance_count = 0;
  m.max_batch_size = 2;
  m.dynamic_batching.emplace().preferred_batch_size = {4};
  m.dynamic_batching->priority_levels = 2;
  Status s = ValidateModel(m, "RepositoryModelLoad(x)");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StatusMessage(s),
            "RepositoryModelLoad(x): `name`: expected 1 to 128 characters from [A-Za-z0-9_.-], "
            "got `bad name`\n"
            "RepositoryModelLoad(x): `instance_count`: expected an integer in [1, 64], got `0`\n"
            "RepositoryModelLoad(x): `dynamic_batching.preferred_batch_size[0]`: expected a "
            "batch size in [1, 2] (max_batch_size), got `4`\n"
            "RepositoryModelLoad(x): `dynamic_batching.default_priority_level`: missing; "
            "required in [1, 2] when priority_levels is 2");
}

// ---- Files
// ----------------------------------------------------------------------------------------

class LoadConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kiln_config_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    for (const std::string& f : files_) std::remove(f.c_str());
    rmdir(dir_.c_str());
  }
  std::string Write(std::string_view name, std::string_view text) {
    std::string path = absl::StrCat(dir_, "/", ToAbsl(name));
    std::ofstream(path, std::ios::binary) << text;
    files_.push_back(path);
    return path;
  }
  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(LoadConfigFileTest, ReadsAFileAndNamesItInErrors) {
  std::string good = Write("good.yaml", "logging: {level: debug}\n");
  StatusOr<Config> c = LoadConfigFile(good, {"logging.format=json"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->logging.level, "debug");
  EXPECT_EQ(c->logging.format, "json");
  EXPECT_EQ(c->source, good);

  std::string bad = Write("bad.yaml", "\nlogging: {level: loud}\n");
  StatusOr<Config> b = LoadConfigFile(bad);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(StatusMessage(b.status()),
            absl::StrCat(bad,
                         ":2:18: `logging.level`: expected one of trace, debug, info, "
                         "warn, error, critical, off; got `loud`"));
}

TEST_F(LoadConfigFileTest, MissingFileAndDirectory) {
  StatusOr<Config> missing = LoadConfigFile(dir_ + "/nope.yaml");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(StatusMessage(missing.status()), HasSubstr(dir_ + "/nope.yaml"));

  StatusOr<Config> directory = LoadConfigFile(dir_);
  EXPECT_EQ(directory.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StatusMessage(directory.status()),
            absl::StrCat("config file `", dir_, "` is a directory"));
}

TEST_F(LoadConfigFileTest, UnreadableFile) {
  if (geteuid() == 0) GTEST_SKIP() << "root reads files whatever their mode";
  std::string locked = Write("locked.yaml", "{}\n");
  ASSERT_EQ(chmod(locked.c_str(), 0), 0);
  StatusOr<Config> denied = LoadConfigFile(locked);
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(StatusMessage(denied.status()), HasSubstr(locked));
}

// ---- kind llm ---------------------------------------------------------------------------------

TEST(LlmModelTest, DefaultsAndScheduler) {
  Config c = Parse(
      "models:\n"
      "  - name: chat\n"
      "    kind: llm\n"
      "    path: /models/smollm2.gguf\n"
      "    threads: 2\n"
      "    activations: q8\n"
      "    kv_cache_dtype: f16\n"
      "    sampling: host\n"
      "    scheduler:\n"
      "      max_num_seqs: 32\n"
      "      kv_cache_bytes: 134217728\n"
      "      priority_levels: 2\n"
      "      default_priority_level: 2\n"
      "      capture_batch_sizes: [1, 2, 4, 8]\n");
  ASSERT_EQ(c.models.size(), 1u);
  const ModelConfig& m = c.models[0];
  EXPECT_EQ(m.kind, "llm");
  EXPECT_EQ(m.path, "/models/smollm2.gguf");
  EXPECT_EQ(m.threads, 2);
  EXPECT_EQ(m.activations, "q8");
  EXPECT_EQ(m.kv_cache_dtype, "f16");
  EXPECT_EQ(m.sampling, "host");
  EXPECT_EQ(m.scheduler.max_num_seqs, 32);
  EXPECT_EQ(m.scheduler.max_num_batched_tokens, 128);  // default
  EXPECT_EQ(m.scheduler.kv_cache_bytes, 134217728);
  EXPECT_EQ(m.scheduler.kv_cache_memory_fraction, 0.9);  // default
  EXPECT_EQ(m.scheduler.capture_batch_sizes, (std::vector<int>{1, 2, 4, 8}));
  EXPECT_TRUE(m.scheduler.enable_prefix_caching);
  // Round trip through ToYaml.
  Config again = Parse(ToYaml(c));
  EXPECT_EQ(again, c);
}

TEST(LlmModelTest, SpeculativeDecoding) {
  const std::string head = "models:\n  - name: m\n    kind: llm\n    path: /m\n    scheduler:\n";
  Config c = Parse(head +
                   "      speculative: {method: ngram, num_tokens: 5, prompt_lookup_min: 3,"
                   " adaptive: false}\n");
  const SpeculativeConfig& s = c.models[0].scheduler.speculative;
  EXPECT_EQ(s.method, "ngram");
  EXPECT_EQ(s.num_tokens, 5);
  EXPECT_EQ(s.prompt_lookup_min, 3);
  EXPECT_EQ(s.prompt_lookup_max, 4);  // default
  EXPECT_FALSE(s.adaptive);
  EXPECT_EQ(Parse(ToYaml(c)), c);
  EXPECT_EQ(Parse("models:\n  - name: m\n    kind: llm\n    path: /m\n")
                .models[0]
                .scheduler.speculative.method,
            "none");
  EXPECT_THAT(Errors(head + "      speculative: {method: medusa}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].scheduler.speculative.method`"),
                                HasSubstr("ngram"))));
  EXPECT_THAT(Errors(head + "      speculative: {method: ngram, num_tokens: 17}\n"),
              ElementsAre(HasSubstr("`models[0].scheduler.speculative.num_tokens`")));
  EXPECT_THAT(Errors(head + "      speculative: {method: ngram, prompt_lookup_min: 5}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].scheduler.speculative.prompt_lookup_min`"),
                                HasSubstr("at most prompt_lookup_max (4)"))));
  EXPECT_THAT(Errors(head + "      speculative: {mehtod: ngram}\n"),
              ElementsAre(HasSubstr("did you mean `method`")));
  // A draft model: method draft needs one; a path with spaces survives the round trip.
  c = Parse(head + "      speculative: {method: draft, draft_model: '/m/small draft.gguf'}\n");
  EXPECT_EQ(c.models[0].scheduler.speculative.method, "draft");
  EXPECT_EQ(c.models[0].scheduler.speculative.draft_model, "/m/small draft.gguf");
  EXPECT_EQ(Parse(ToYaml(c)), c);
  EXPECT_THAT(Errors(head + "      speculative: {method: draft}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].scheduler.speculative.draft_model`"),
                                HasSubstr("needs a draft model"))));
}

TEST(LlmModelTest, KvCacheBytesAutoTakesAFractionOfFreeDeviceMemory) {
  const Config c = Parse(
      "models:\n  - name: m\n    kind: llm\n    path: /m\n    scheduler:\n"
      "      kv_cache_bytes: AUTO\n      kv_cache_memory_fraction: 0.5\n");
  EXPECT_EQ(c.models[0].scheduler.kv_cache_bytes, kKvCacheAuto);
  EXPECT_EQ(c.models[0].scheduler.kv_cache_memory_fraction, 0.5);
  EXPECT_NE(ToYaml(c).find("kv_cache_bytes: auto"), std::string::npos);
  EXPECT_EQ(Parse(ToYaml(c)), c);
}

TEST(LlmModelTest, TargetItlIsOptionalAndMustBeANumberOfMilliseconds) {
  const std::string head = "models:\n  - name: m\n    kind: llm\n    path: /m\n    scheduler:\n";
  Config c = Parse("models:\n  - name: m\n    kind: llm\n    path: /m\n");
  EXPECT_EQ(c.models[0].scheduler.target_itl_ms, 0) << "default: no target";
  c = Parse(head + "      target_itl_ms: 37.5\n");
  EXPECT_EQ(c.models[0].scheduler.target_itl_ms, 37.5);
  EXPECT_EQ(Parse(ToYaml(c)), c);
  for (const char* bad : {"-1", "fast", "1e9", "nan", "[40]"}) {
    EXPECT_THAT(Errors(head + "      target_itl_ms: " + bad + "\n"),
                ElementsAre(AllOf(HasSubstr("`models[0].scheduler.target_itl_ms`"),
                                  HasSubstr("expected a number in [0, 60000]"))))
        << bad;
  }
}

TEST(LlmModelTest, NumericsDefaultToExactAndListWhatIsAllowed) {
  Config c = Parse("models:\n  - name: m\n    kind: llm\n    path: /m\n");
  EXPECT_EQ(c.models[0].activations, "f32");
  EXPECT_EQ(c.models[0].kv_cache_dtype, "f32");
  const std::string head = "models:\n  - name: a\n    kind: llm\n    path: /m\n";
  EXPECT_THAT(Errors(head + "    activations: int8\n"),
              ElementsAre(AllOf(HasSubstr("f.yaml:5:18: `models[0].activations`"), HasSubstr("f32"),
                                HasSubstr("q8"), HasSubstr("bf16"))));
  EXPECT_EQ(Parse(head + "    activations: bf16\n").models[0].activations, "bf16");
  EXPECT_THAT(Errors(head + "    kv_cache_dtype: fp8\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].kv_cache_dtype`"), HasSubstr("bf16"))));
  EXPECT_THAT(Errors("models:\n" + Model("a", "    activations: q8\n")),
              ElementsAre(HasSubstr("`models[0].activations`: only used by kind `llm`")));
  EXPECT_THAT(Errors("models:\n" + Model("a", "    kv_cache_dtype: f16\n")),
              ElementsAre(HasSubstr("`models[0].kv_cache_dtype`: only used by kind `llm`")));
}

TEST(LlmModelTest, AttentionModifiersByNameWithTheirNumbers) {
  const std::string head = "models:\n  - name: a\n    kind: llm\n    path: /m\n";
  EXPECT_TRUE(Parse(head).models[0].attention.empty());
  const Config c = Parse(head +
                         "    attention: {mask: sliding_window, window: 4096, score: softcap, "
                         "softcap: 50}\n");
  const AttentionConfig& a = c.models[0].attention;
  EXPECT_EQ(a.mask, "sliding_window");
  EXPECT_EQ(a.window, 4096);
  EXPECT_EQ(a.score, "softcap");
  EXPECT_EQ(a.softcap, 50);
  EXPECT_EQ(Parse(ToYaml(c)), c);  // round trip
  const Config chunked = Parse(head + "    attention:\n      mask: chunked\n      chunk: 8192\n");
  EXPECT_EQ(chunked.models[0].attention.chunk, 8192);
  EXPECT_EQ(chunked.models[0].attention.score, "");  // the model's own
  EXPECT_EQ(Parse(ToYaml(chunked)), chunked);
  EXPECT_EQ(Parse(head + "    attention: {score: alibi}\n").models[0].attention.score, "alibi");

  // Unknown names list the known ones.
  EXPECT_THAT(Errors(head + "    attention: {mask: diagonal}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].attention.mask`"),
                                HasSubstr("unknown attention mask `diagonal`"), HasSubstr("causal"),
                                HasSubstr("sliding_window"), HasSubstr("chunked"))));
  EXPECT_THAT(Errors(head + "    attention: {score: cosine}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].attention.score`"), HasSubstr("softcap"),
                                HasSubstr("alibi"), HasSubstr("none"))));
  // Windows, chunks and caps must be positive, and are required by their modifier.
  EXPECT_THAT(Errors(head + "    attention: {mask: sliding_window, window: 0}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].attention.window`"),
                                HasSubstr("mask: sliding_window"))));
  EXPECT_THAT(Errors(head + "    attention: {mask: sliding_window, window: -4}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].attention.window`: is -4"))));
  EXPECT_THAT(Errors(head + "    attention: {mask: chunked}\n"),
              ElementsAre(HasSubstr("`models[0].attention.chunk`: missing")));
  EXPECT_THAT(Errors(head + "    attention: {score: softcap, softcap: 0}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].attention.softcap`"), HasSubstr("missing"))));
  EXPECT_THAT(Errors(head + "    attention: {score: softcap, softcap: -30}\n"),
              ElementsAre(AllOf(HasSubstr("`models[0].attention.softcap`: is -30"),
                                HasSubstr("positive"))));
  EXPECT_THAT(Errors(head + "    attention: {mask: causal, window: 128}\n"),
              ElementsAre(HasSubstr("`models[0].attention.window`: only used with mask: "
                                    "sliding_window")));
  EXPECT_THAT(Errors(head + "    attention: {softcap: 30}\n"),
              ElementsAre(HasSubstr("`models[0].attention.softcap`: only used with `score: "
                                    "softcap`")));
  EXPECT_THAT(Errors(head + "    attention: {mask: causal, windw: 3}\n"),
              ElementsAre(AllOf(HasSubstr("windw"), HasSubstr("window"))));
  EXPECT_THAT(Errors("models:\n" + Model("a", "    attention: {mask: causal}\n")),
              ElementsAre(HasSubstr("`models[0].attention`: only used by kind `llm`")));
}

TEST(LlmModelTest, SamplingIsOnTheDeviceByDefaultOrOnTheHost) {
  Config c = Parse("models:\n  - name: m\n    kind: llm\n    path: /m\n");
  EXPECT_EQ(c.models[0].sampling, "device");
  const std::string head = "models:\n  - name: a\n    kind: llm\n    path: /m\n";
  EXPECT_EQ(Parse(head + "    sampling: host\n").models[0].sampling, "host");
  EXPECT_THAT(Errors(head + "    sampling: gpu\n"),
              ElementsAre(AllOf(HasSubstr("f.yaml:5:15: `models[0].sampling`"), HasSubstr("device"),
                                HasSubstr("host"))));
  EXPECT_THAT(Errors("models:\n" + Model("a", "    sampling: host\n")),
              ElementsAre(HasSubstr("`models[0].sampling`: only used by kind `llm`")));
}

TEST(LlmModelTest, DefaultCaptureSizesStopAtMaxNumSeqs) {
  Config c = Parse(
      "models:\n"
      "  - name: m\n"
      "    kind: llm\n"
      "    path: /models/smollm2.gguf\n"
      "    scheduler: {max_num_seqs: 12}\n");
  EXPECT_EQ(c.models[0].scheduler.capture_batch_sizes, (std::vector<int>{1, 2, 4, 8}));
}

TEST(LlmModelTest, NeedsAPath) {
  EXPECT_THAT(Errors("models:\n  - name: a\n    kind: llm\n"),
              ElementsAre("f.yaml:2:5: `models[0].path`: missing; kind `llm` loads its weights "
                          "from `path`"));
}

TEST(LlmModelTest, TensorModelSettingsAreRefused) {
  EXPECT_THAT(Errors("models:\n  - name: a\n    kind: llm\n    path: /m\n    max_batch_size: 4\n"),
              ElementsAre("f.yaml:5:21: `models[0].max_batch_size`: not used by kind `llm` (set "
                          "scheduler.max_num_seqs instead)"));
  EXPECT_THAT(Errors("models:\n  - name: a\n    kind: llm\n    path: /m\n"
                     "    dynamic_batching: {}\n"),
              ElementsAre(HasSubstr("`models[0].dynamic_batching`: not used by kind `llm`")));
}

TEST(LlmModelTest, SchedulerOnATensorModelIsRefused) {
  EXPECT_THAT(Errors("models:\n" + Model("a", "    scheduler: {max_num_seqs: 4}\n")),
              ElementsAre(HasSubstr("`models[0].scheduler`: not used by kind `builtin`")));
  EXPECT_THAT(
      Errors("models:\n" + Model("a", "    threads: 4\n")),
      ElementsAre(HasSubstr("`models[0].threads`: only used by kinds `llm` and `embedding`")));
}

TEST(EmbeddingModelTest, NeedsAPathAndABatchAndTakesThreadsAndContextLength) {
  const std::string head = "models:\n  - name: e\n    kind: embedding\n";
  const Config c = Parse(head +
                         "    path: /m\n    max_batch_size: 16\n    threads: 2\n"
                         "    context_length: 128\n");
  EXPECT_EQ(c.models[0].kind, "embedding");
  EXPECT_EQ(c.models[0].threads, 2);
  EXPECT_EQ(c.models[0].context_length, 128);
  EXPECT_THAT(Errors(head + "    max_batch_size: 16\n"),
              ElementsAre(HasSubstr("`models[0].path`: missing; kind `embedding` loads its "
                                    "weights from `path`")));
  EXPECT_THAT(Errors(head + "    path: /m\n"),
              ElementsAre(HasSubstr("`models[0].max_batch_size`: must be at least 1 for kind "
                                    "`embedding`")));
  EXPECT_THAT(Errors(head + "    path: /m\n    max_batch_size: 4\n    kv_cache_dtype: f16\n"),
              ElementsAre(HasSubstr("`models[0].kv_cache_dtype`: only used by kind `llm`")));
}

TEST(LlmModelTest, SchedulerRangesAndTypos) {
  const std::string head = "models:\n  - name: a\n    kind: llm\n    path: /m\n    scheduler:\n";
  EXPECT_THAT(Errors(head + "      max_num_seqs: 0\n"),
              ElementsAre(HasSubstr("f.yaml:6:21: `models[0].scheduler.max_num_seqs`")));
  EXPECT_THAT(Errors(head + "      kv_cache_bytes: 1000\n"),
              ElementsAre(HasSubstr("1 MiB to 1 TiB, or auto")));
  EXPECT_THAT(Errors(head + "      kv_cache_bytes: automatic\n"),
              ElementsAre(HasSubstr("or auto")));
  EXPECT_THAT(Errors(head + "      kv_cache_bytes: auto\n      kv_cache_memory_fraction: 1.5\n"),
              ElementsAre(HasSubstr("expected a number in [0.01, 0.99], got `1.5`")));
  EXPECT_THAT(Errors(head + "      max_num_seq: 8\n"),
              ElementsAre(HasSubstr("did you mean `max_num_seqs`?")));
  EXPECT_THAT(Errors(head + "      capture_batch_sizes: [1, 4, 2]\n"),
              ElementsAre(HasSubstr("ascending order")));
  EXPECT_THAT(Errors(head + "      max_num_seqs: 4\n      capture_batch_sizes: [1, 8]\n"),
              ElementsAre(HasSubstr("expected a batch size in [1, 4] (max_num_seqs), got `8`")));
  EXPECT_THAT(Errors(head + "      priority_levels: 2\n"),
              ElementsAre(HasSubstr("`models[0].scheduler.default_priority_level`")));
}

TEST(FineTuningConfigTest, ParsesAndChecksRanges) {
  StatusOr<Config> c = ParseConfig(
      "fine_tuning:\n  max_concurrent_jobs: 2\n  checkpoint_every_steps: 0\n"
      "  checkpoint_every_seconds: 30.5\n  yield_to_serving: false\n  max_file_bytes: 1024\n",
      "f.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->fine_tuning.max_concurrent_jobs, 2);
  EXPECT_EQ(c->fine_tuning.checkpoint_every_steps, 0);
  EXPECT_EQ(c->fine_tuning.checkpoint_every_seconds, 30.5);
  EXPECT_FALSE(c->fine_tuning.yield_to_serving);
  EXPECT_EQ(c->fine_tuning.max_file_bytes, 1024);
  EXPECT_TRUE(c->fine_tuning.enabled);
  // Round trip through ToYaml.
  StatusOr<Config> again = ParseConfig(ToYaml(*c), "again.yaml");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *c);

  EXPECT_THAT(Errors("fine_tuning:\n  max_concurrent_jobs: 0\n"),
              ElementsAre(HasSubstr("f.yaml:2:24: `fine_tuning.max_concurrent_jobs`")));
  EXPECT_THAT(Errors("fine_tuning:\n  checkpoint_every_secs: 5\n"),
              ElementsAre(HasSubstr("unknown key `checkpoint_every_secs` in `fine_tuning`")));
  EXPECT_THAT(Errors("fine_tuning:\n  backend: tpu\n"), ElementsAre(HasSubstr("tpu")));
}

TEST(AuthConfigTest, KeysTurnAuthOnAndRoundTrip) {
  Config c = Parse("");
  EXPECT_FALSE(c.server.auth.enabled);
  EXPECT_THAT(c.server.auth.open, ElementsAre("health", "metrics"));
  const std::string hash(64, 'A');
  c = Parse("server:\n  auth:\n    api_keys:\n      - name: ci\n        key_sha256: " + hash +
            "\n        scopes: [inference, admin]\n      - {name: ft, key_file: /k, scopes: "
            "[fine_tuning]}\n    open: [health]\n");
  EXPECT_TRUE(c.server.auth.enabled);  // written keys turn it on
  ASSERT_EQ(c.server.auth.api_keys.size(), 2u);
  EXPECT_EQ(c.server.auth.api_keys[0].key_sha256, std::string(64, 'a'));  // lower-cased
  EXPECT_THAT(c.server.auth.api_keys[0].scopes, ElementsAre("inference", "admin"));
  EXPECT_EQ(c.server.auth.api_keys[1].key_file, "/k");
  EXPECT_EQ(c.server.auth.api_keys[1].location.line, 7);
  EXPECT_THAT(c.server.auth.open, ElementsAre("health"));
  StatusOr<Config> back = ParseConfig(ToYaml(c), "round-trip");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << ToYaml(c);
  EXPECT_EQ(*back, c);
  // Keys written but auth explicitly off.
  c = Parse(
      "server:\n  auth:\n    enabled: false\n    api_keys: [{name: a, key_file: /k, "
      "scopes: [admin]}]\n");
  EXPECT_FALSE(c.server.auth.enabled);
}

TEST(AuthConfigTest, ErrorsNameTheLine) {
  // Auth on with no key would refuse everything: refused, at the line that turned it on.
  EXPECT_THAT(Errors("server:\n  auth:\n    enabled: true\n"),
              ElementsAre(HasSubstr("f.yaml:3:14: `server.auth.enabled`: auth is on but")));
  EXPECT_THAT(Errors("server:\n  auth:\n    api_keys: []\n"),
              ElementsAre(HasSubstr("f.yaml:3:15: `server.auth.api_keys`: auth is on but")));
  EXPECT_THAT(Errors("server:\n  auth:\n    api_keys: [{name: a, scopes: [admin]}]\n"),
              ElementsAre(HasSubstr("needs `key_sha256`")));
  EXPECT_THAT(Errors("server:\n  auth:\n    api_keys: [{name: a, key_sha256: abc, scopes: "
                     "[admin]}]\n"),
              ElementsAre(HasSubstr("expected 64 hex digits")));
  EXPECT_THAT(Errors("server:\n  auth:\n    api_keys: [{name: a, key_file: /k, scopes: "
                     "[admn]}]\n"),
              ElementsAre(HasSubstr("did you mean `admin`")));
  EXPECT_THAT(Errors("server:\n  auth:\n    api_keys: [{name: a, key_file: /k}]\n"),
              ElementsAre(HasSubstr("a key needs `scopes`")));
  EXPECT_THAT(Errors("server:\n  auth:\n    api_keys:\n      - {name: a, key_file: /k, scopes: "
                     "[admin]}\n      - {name: a, key_file: /j, scopes: [admin]}\n"),
              ElementsAre(HasSubstr("duplicate key name `a` (first at f.yaml:4:9)")));
  EXPECT_THAT(Errors("server:\n  auth:\n    open: [health, health]\n"),
              ElementsAre(HasSubstr("`health` is listed twice")));
  EXPECT_THAT(Errors("server:\n  auth:\n    api_keys: [{name: a b, key_file: /k, scopes: "
                     "[admin]}]\n"),
              ElementsAre(HasSubstr("`server.auth.api_keys[0].name`")));
}

TEST(TlsConfigTest, FilesComeInPairs) {
  Config c = Parse("server:\n  tls:\n    cert_file: /c.pem\n    key_file: /k.pem\n");
  EXPECT_TRUE(c.server.tls.enabled());
  EXPECT_FALSE(Parse("").server.tls.enabled());
  StatusOr<Config> back = ParseConfig(ToYaml(c), "round-trip");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, c);
  EXPECT_THAT(Errors("server:\n  tls:\n    cert_file: /c.pem\n"),
              ElementsAre(HasSubstr("`cert_file` is set but `key_file` is not")));
  EXPECT_THAT(Errors("server:\n  tls:\n    key_file: /k.pem\n"),
              ElementsAre(HasSubstr("`key_file` is set but `cert_file` is not")));
  EXPECT_THAT(Errors("server:\n  tls:\n    client_ca_file: /ca.pem\n"),
              ElementsAre(HasSubstr("mTLS")));
  EXPECT_THAT(Errors("server:\n  tls:\n    metrics: true\n"),
              ElementsAre(HasSubstr("TLS on the metrics port needs")));
}

TEST(ObservabilityConfigTest, DefaultsRangesAndRoundTrip) {
  Config c = Parse("");
  EXPECT_TRUE(c.observability.flight_recorder.enabled);
  EXPECT_EQ(c.observability.flight_recorder.entries, 4096);
  EXPECT_EQ(c.observability.watchdog_seconds, 60);
  EXPECT_TRUE(c.observability.tracing.enabled);
  EXPECT_TRUE(c.observability.otlp.endpoint.empty());
  c = Parse(
      "observability:\n  flight_recorder: {entries: 64}\n  watchdog_seconds: 0.5\n"
      "  otlp: {endpoint: 'http://c:4318/v1/traces', timeout_seconds: 2}\n");
  EXPECT_EQ(c.observability.flight_recorder.entries, 64);
  EXPECT_EQ(c.observability.watchdog_seconds, 0.5);
  EXPECT_EQ(c.observability.otlp.endpoint, "http://c:4318/v1/traces");
  StatusOr<Config> back = ParseConfig(ToYaml(c), "round-trip");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, c);
  EXPECT_THAT(Errors("observability:\n  flight_recorder: {entries: 8}\n"),
              ElementsAre(HasSubstr("`observability.flight_recorder.entries`")));
  EXPECT_THAT(Errors("observability:\n  watchdog_seconds: -1\n"),
              ElementsAre(HasSubstr("`observability.watchdog_seconds`")));
  EXPECT_THAT(Errors("observability:\n  otlp: {endpoint: 'collector:4318'}\n"),
              ElementsAre(HasSubstr("expected an http:// or https:// URL")));
  EXPECT_THAT(Errors("observability:\n  watchdog: 5\n"),
              ElementsAre(HasSubstr("did you mean `watchdog_seconds`")));
}

TEST(LlmModelTest, LoraAdaptersDefaultsListAndRoundTrip) {
  Config c = Parse("models:\n  - name: m\n    kind: llm\n    path: /m\n");
  EXPECT_EQ(c.models[0].max_loaded_adapters, 4);
  EXPECT_EQ(c.models[0].max_lora_rank, 16);
  EXPECT_TRUE(c.models[0].adapters.empty());
  c = Parse(
      "models:\n  - name: m\n    kind: llm\n    path: /m\n    max_loaded_adapters: 2\n"
      "    max_lora_rank: 64\n    adapters:\n      - {name: sql-v1:a, path: /adapters/sql}\n"
      "      - name: chat.2\n        path: /adapters/chat\n");
  EXPECT_EQ(c.models[0].max_loaded_adapters, 2);
  EXPECT_EQ(c.models[0].max_lora_rank, 64);
  ASSERT_EQ(c.models[0].adapters.size(), 2u);
  EXPECT_EQ(c.models[0].adapters[0].name, "sql-v1:a");
  EXPECT_EQ(c.models[0].adapters[1].path, "/adapters/chat");
  StatusOr<Config> back = ParseConfig(ToYaml(c), "round-trip");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << ToYaml(c);
  EXPECT_EQ(*back, c);
}

TEST(LlmModelTest, LoraAdapterErrorsNameThePlace) {
  const std::string head = "models:\n  - name: a\n    kind: llm\n    path: /m\n";
  EXPECT_THAT(Errors(head + "    max_lora_rank: 0\n"),
              ElementsAre(HasSubstr("f.yaml:5:20: `models[0].max_lora_rank`")));
  EXPECT_THAT(Errors(head + "    max_loaded_adapters: -1\n"),
              ElementsAre(HasSubstr("`models[0].max_loaded_adapters`")));
  EXPECT_THAT(Errors(head + "    adapters:\n      - {name: 'bad name', path: /x}\n"),
              ElementsAre(AllOf(HasSubstr("f.yaml:6:16: `models[0].adapters[0].name`"),
                                HasSubstr("A-Z a-z 0-9 _ . : -"))));
  EXPECT_THAT(Errors(head + "    adapters:\n      - {name: x}\n"),
              ElementsAre(HasSubstr("`models[0].adapters[0].path`: missing")));
  EXPECT_THAT(Errors(head + "    adapters:\n      - {name: x, path: /x, rank: 4}\n"),
              ElementsAre(HasSubstr("rank")));
  EXPECT_THAT(Errors(head + "    adapters: /x\n"),
              ElementsAre(HasSubstr("expected a list of adapters")));
  EXPECT_THAT(
      Errors(head + "    max_loaded_adapters: 0\n    adapters:\n      - {name: x, path: /x}\n"),
      ElementsAre(HasSubstr("max_loaded_adapters is 0")));
  EXPECT_THAT(
      Errors(head + "    adapters:\n      - {name: x, path: /x}\n      - {name: x, path: /y}\n"),
      ElementsAre(HasSubstr("`models[0].adapters[1].name`: duplicate adapter name `x` "
                            "(first at f.yaml:6:16")));
  EXPECT_THAT(Errors(head + "    adapters:\n      - {name: a, path: /x}\n"),
              ElementsAre(HasSubstr("adapter name `a` is the name of a model")));
  EXPECT_THAT(Errors("models:\n" + Model("t", "    adapters:\n      - {name: x, path: /x}\n")),
              ElementsAre(HasSubstr("`models[0].adapters`: only used by kind `llm`")));
}

}  // namespace
}  // namespace kiln::config
