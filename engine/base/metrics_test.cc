#include "engine/base/metrics.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kiln::metrics {
namespace {

using ::testing::HasSubstr;

// Value of the first sample line `name ...` (exact sample name, no labels) in `text`.
double SampleValue(const std::string& text, const std::string& name) {
  size_t pos = 0;
  while ((pos = text.find(name + " ", pos)) != std::string::npos) {
    if (pos == 0 || text[pos - 1] == '\n') {
      return std::strtod(text.c_str() + pos + name.size() + 1, nullptr);
    }
    pos += name.size();
  }
  ADD_FAILURE() << "no sample " << name << " in:\n" << text;
  return -1;
}

TEST(MetricsTest, SerializesExactText) {
  Registry r;
  auto& plain = r.AddCounter("app_events_total", "Events seen.");
  plain.WithLabels({})->Increment(3);
  auto& req = r.AddCounter("app_requests_total", "Requests by model.\nSecond line \\ end.",
                           {"model", "code"});
  req.WithLabels({"b", "200"})->Increment();
  req.WithLabels({"a \"quoted\"\nline\\x", "500"})->Increment(2.5);
  r.AddGauge("app_temperature", "A gauge.").WithLabels({})->Set(-1.25);
  r.AddGauge("app_empty", "Labelled, no children yet.", {"model"});
  auto& h = r.AddHistogram("app_latency_seconds", "Latency.", {"model"}, {0.005, 0.1, 1});
  Histogram* hm = h.WithLabels({"m"});
  hm->Observe(0.001);
  hm->Observe(0.005);  // le is inclusive
  hm->Observe(0.5);
  hm->Observe(7);

  EXPECT_EQ(r.Serialize(),
            "# HELP app_events_total Events seen.\n"
            "# TYPE app_events_total counter\n"
            "app_events_total 3\n"
            "# HELP app_requests_total Requests by model.\\nSecond line \\\\ end.\n"
            "# TYPE app_requests_total counter\n"
            "app_requests_total{model=\"a \\\"quoted\\\"\\nline\\\\x\",code=\"500\"} 2.5\n"
            "app_requests_total{model=\"b\",code=\"200\"} 1\n"
            "# HELP app_temperature A gauge.\n"
            "# TYPE app_temperature gauge\n"
            "app_temperature -1.25\n"
            "# HELP app_empty Labelled, no children yet.\n"
            "# TYPE app_empty gauge\n"
            "# HELP app_latency_seconds Latency.\n"
            "# TYPE app_latency_seconds histogram\n"
            "app_latency_seconds_bucket{model=\"m\",le=\"0.005\"} 2\n"
            "app_latency_seconds_bucket{model=\"m\",le=\"0.1\"} 2\n"
            "app_latency_seconds_bucket{model=\"m\",le=\"1\"} 3\n"
            "app_latency_seconds_bucket{model=\"m\",le=\"+Inf\"} 4\n"
            "app_latency_seconds_sum{model=\"m\"} 7.506\n"
            "app_latency_seconds_count{model=\"m\"} 4\n");
}

TEST(MetricsTest, LabelLessFamiliesStartAtZero) {
  Registry r;
  r.AddCounter("c_total", "c");
  r.AddGauge("g", "g");
  r.AddHistogram("h", "h", {}, {1});
  EXPECT_EQ(r.Serialize(),
            "# HELP c_total c\n# TYPE c_total counter\nc_total 0\n"
            "# HELP g g\n# TYPE g gauge\ng 0\n"
            "# HELP h h\n# TYPE h histogram\n"
            "h_bucket{le=\"1\"} 0\nh_bucket{le=\"+Inf\"} 0\nh_sum 0\nh_count 0\n");
}

TEST(MetricsTest, NumberFormatting) {
  Registry r;
  auto& g = r.AddGauge("v", "v", {"k"});
  const std::vector<std::pair<double, std::string>> cases = {
      {0, "0"},
      {42, "42"},
      {-7, "-7"},
      {0.1, "0.1"},
      {1.0 / 3, "0.3333333333333333"},
      {123456789012, "123456789012"},
      {9007199254740993.0, "9007199254740992"},  // 2^53+1 rounds to 2^53: exact integer
      {1e20, "100000000000000000000"},
      {1e21, "1e+21"},
      {0.0001, "0.0001"},
      {1.5e-7, "1.5e-07"},
      {std::numeric_limits<double>::infinity(), "+Inf"},
      {-std::numeric_limits<double>::infinity(), "-Inf"},
      {std::numeric_limits<double>::quiet_NaN(), "NaN"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    g.WithLabels({std::string(1, static_cast<char>('a' + i))})->Set(cases[i].first);
  }
  std::string text = r.Serialize();
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string line =
        "v{k=\"" + std::string(1, static_cast<char>('a' + i)) + "\"} " + cases[i].second + "\n";
    EXPECT_THAT(text, HasSubstr(line)) << "value #" << i;
  }
}

TEST(MetricsTest, ConcurrentIncrementsSum) {
  Registry r;
  auto& fam = r.AddCounter("hits_total", "hits", {"worker"});
  Counter* shared = r.AddCounter("shared_total", "shared").WithLabels({});
  Gauge* gauge = r.AddGauge("level", "level").WithLabels({});
  Histogram* hist = r.AddHistogram("obs", "obs", {}, {0.5}).WithLabels({});
  constexpr int kThreads = 8, kIters = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Everyone also races on WithLabels for the same and for distinct children.
      Counter* mine = fam.WithLabels({std::to_string(t % 3)});
      for (int i = 0; i < kIters; ++i) {
        shared->Increment();
        mine->Increment(0.5);
        gauge->Increment(2);
        gauge->Decrement();
        hist->Observe(i % 2 == 0 ? 0.25 : 1.0);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(shared->Value(), kThreads * kIters);
  EXPECT_EQ(gauge->Value(), kThreads * kIters);
  double per_label = 0;
  for (int l = 0; l < 3; ++l) per_label += fam.WithLabels({std::to_string(l)})->Value();
  EXPECT_EQ(per_label, kThreads * kIters * 0.5);
  Histogram::Snapshot s = hist->Snap();
  EXPECT_EQ(s.count, uint64_t{kThreads * kIters});
  EXPECT_EQ(s.cumulative[0], uint64_t{kThreads * kIters / 2});
  EXPECT_DOUBLE_EQ(s.sum, kThreads * kIters / 2 * 1.25);
}

TEST(MetricsTest, HistogramSnapshotIsCumulative) {
  Histogram h({1, 2, 4});
  for (double v : {0.5, 1.0, 1.5, 3.0, 3.5, 100.0, -1.0}) h.Observe(v);
  h.Observe(std::numeric_limits<double>::quiet_NaN());  // counted in +Inf only
  Histogram::Snapshot s = h.Snap();
  EXPECT_EQ(s.upper_bounds, (std::vector<double>{1, 2, 4}));
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{3, 4, 6, 8}));
  EXPECT_EQ(s.count, 8u);
  EXPECT_TRUE(std::isnan(s.sum));
}

TEST(MetricsTest, HistogramAcceptsExplicitInf) {
  Histogram h({1, std::numeric_limits<double>::infinity()});
  h.Observe(5);
  Histogram::Snapshot s = h.Snap();
  EXPECT_EQ(s.upper_bounds, std::vector<double>{1});
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(s.sum, 5);
}

TEST(MetricsTest, BucketHelpers) {
  EXPECT_EQ(ExponentialBuckets(0.001, 2, 4), (std::vector<double>{0.001, 0.002, 0.004, 0.008}));
  EXPECT_EQ(ExponentialBuckets(1, 10, 3), (std::vector<double>{1, 10, 100}));
  EXPECT_EQ(LinearBuckets(0, 5, 4), (std::vector<double>{0, 5, 10, 15}));
  std::vector<double> tenths = LinearBuckets(0.1, 0.1, 10);
  ASSERT_EQ(tenths.size(), 10u);
  EXPECT_DOUBLE_EQ(tenths[9], 1.0);
  EXPECT_EQ(tenths[2], 0.1 + 2 * 0.1);
}

TEST(MetricsTest, ReRegisteringReturnsSameFamily) {
  Registry r;
  auto& a = r.AddCounter("x_total", "x", {"l"});
  auto& b = r.AddCounter("x_total", "x again", {"l"});
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(a.WithLabels({"v"}), b.WithLabels({"v"}));
  auto& h1 = r.AddHistogram("lat", "l", {}, {1, 2});
  auto& h2 = r.AddHistogram("lat", "l", {}, {1, 2});
  EXPECT_EQ(&h1, &h2);
  // Only one family is serialized.
  std::string text = r.Serialize();
  EXPECT_EQ(text.find("# TYPE x_total"), text.rfind("# TYPE x_total"));
}

TEST(MetricsTest, RemoveDropsChild) {
  Registry r;
  auto& g = r.AddGauge("loaded", "loaded", {"model"});
  g.WithLabels({"a"})->Set(1);
  g.WithLabels({"b"})->Set(2);
  g.Remove({"a"});
  std::string text = r.Serialize();
  EXPECT_THAT(text, HasSubstr("loaded{model=\"b\"} 2\n"));
  EXPECT_EQ(text.find("model=\"a\""), std::string::npos);
  // Re-creating starts from zero.
  EXPECT_EQ(g.WithLabels({"a"})->Value(), 0);
}

TEST(MetricsTest, CollectorsRunBeforeSerialize) {
  Registry r;
  Gauge* g = r.AddGauge("scrapes", "scrapes").WithLabels({});
  r.AddCollector([g] { g->Increment(); });
  EXPECT_THAT(r.Serialize(), HasSubstr("scrapes 1\n"));
  EXPECT_THAT(r.Serialize(), HasSubstr("scrapes 2\n"));
}

using MetricsDeathTest = ::testing::Test;

TEST_F(MetricsDeathTest, ProgrammerErrorsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Registry r;
  EXPECT_DEATH(r.AddGauge("1bad", "x"), "must match");
  EXPECT_DEATH(r.AddGauge("bad-name", "x"), "must match");
  EXPECT_DEATH(r.AddGauge("ok", "x", {"__reserved"}), "not start with `__`");
  EXPECT_DEATH(r.AddGauge("ok", "x", {"a:b"}), "must match");
  EXPECT_DEATH(r.AddGauge("ok", "x", {"a", "a"}), "duplicate label");
  EXPECT_DEATH(r.AddCounter("requests", "x"), "must end in `_total`");
  EXPECT_DEATH(r.AddHistogram("h", "x", {"le"}, {1}), "reserved");
  EXPECT_DEATH(r.AddHistogram("h", "x", {}, {2, 1}), "strictly increasing");
  r.AddGauge("dup", "x", {"a"});
  EXPECT_DEATH(r.AddGauge("dup", "x", {"b"}), "different type or labels");
  EXPECT_DEATH(r.AddCounter("dup", "x"), "must end in");
  EXPECT_DEATH(r.AddCounter("dup_total", "x").WithLabels({"extra"}), "label values");
  r.AddHistogram("lat", "x", {}, {1});
  EXPECT_DEATH(r.AddGauge("lat_count", "x"), "collides");
  EXPECT_DEATH(r.AddHistogram("lat", "x", {}, {2}), "different buckets");
}

TEST(ProcessMetricsTest, ValuesArePositiveAndRssGrows) {
  Registry r;
  RegisterProcessMetrics(r);
  std::string before = r.Serialize();
  for (const char* name : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                           "process_open_fds", "process_max_fds", "process_threads"}) {
    EXPECT_GT(SampleValue(before, name), 0) << name;
  }
  EXPECT_GE(SampleValue(before, "process_cpu_seconds_total"), 0);
  // The start time is within the last hour (this test binary just started).
  double start = SampleValue(before, "process_start_time_seconds");
  double now = static_cast<double>(time(nullptr));
  EXPECT_LE(start, now + 1);
  EXPECT_GT(start, now - 3600);

  // Touch 64 MiB: every page is written, so it must become resident.
  constexpr size_t kBytes = 64 << 20;
  std::vector<char> block(kBytes);
  for (size_t i = 0; i < kBytes; i += 4096) block[i] = static_cast<char>(i >> 12);
  std::string after = r.Serialize();
  EXPECT_GE(SampleValue(after, "process_resident_memory_bytes") -
                SampleValue(before, "process_resident_memory_bytes"),
            60.0 * (1 << 20));
  // Keep `block` observable so the writes cannot be elided.
  EXPECT_EQ(block[4096 * 3], 3);

  // A thread started now is counted, and CPU time never goes backwards.
  std::thread t([&] { after = r.Serialize(); });
  t.join();
  EXPECT_GE(SampleValue(after, "process_threads"), 2);
  EXPECT_GE(SampleValue(after, "process_cpu_seconds_total"),
            SampleValue(before, "process_cpu_seconds_total"));
}

// Runs `promtool check metrics` on `text`; returns its exit code and combined output.
std::pair<int, std::string> PromtoolCheck(const std::string& text) {
  char path[] = "/tmp/kiln_metrics_XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  close(fd);
  std::string cmd = std::string("/usr/bin/promtool check metrics < ") + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (p != nullptr && fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  int status = p != nullptr ? pclose(p) : -1;
  unlink(path);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(MetricsPromtoolTest, ExpositionPassesPromtoolLint) {
  if (access("/usr/bin/promtool", X_OK) != 0) GTEST_SKIP() << "promtool not installed";
  Registry r;
  RegisterProcessMetrics(r);
  auto& req = r.AddCounter("kiln_requests_total", "Requests handled, by \"model\".\nPer model.",
                           {"model", "outcome"});
  req.WithLabels({"llama \"3\"", "success"})->Increment(5);
  req.WithLabels({"back\\slash\nnewline", "error"})->Increment();
  r.AddGauge("kiln_queue_size", "Requests waiting.", {"model"}).WithLabels({"m"})->Set(3);
  r.AddGauge("kiln_temperature_celsius", "Odd values.")
      .WithLabels({})
      ->Set(-std::numeric_limits<double>::infinity());
  auto& h = r.AddHistogram("kiln_request_duration_seconds", "Request latency.", {"model"},
                           ExponentialBuckets(0.0001, 10, 6));
  for (double v : {0.00005, 0.002, 0.3, 20.0, 1e6}) h.WithLabels({"m"})->Observe(v);
  r.AddHistogram("kiln_step_seconds", "Unlabelled histogram.", {}, LinearBuckets(0.5, 0.5, 3));

  auto [code, out] = PromtoolCheck(r.Serialize());
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(out, "") << "promtool lint output for:\n" << r.Serialize();

  // The check itself can fail: a counter without `_total` written by hand is flagged.
  auto [bad_code, bad_out] = PromtoolCheck("# HELP c x\n# TYPE c counter\nc 1\n");
  EXPECT_NE(bad_code == 0 && bad_out.empty(), true) << "promtool accepted a bad counter name";
}

}  // namespace
}  // namespace kiln::metrics
