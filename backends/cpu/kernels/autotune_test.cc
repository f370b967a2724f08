// Autotuning: choices are timed once and then come from memory or the cache file; a second
// compile of the same shapes (in this process or, through the file, the next one) times
// nothing; the file survives concurrent writers and ignores malformed lines.
#include "backends/cpu/kernels/autotune.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "backends/builtin.h"
#include "backends/cpu/kernels/linear.h"
#include "backends/cpu/kernels/select.h"
#include "backends/ref/ref_kernels.h"
#include "engine/builder.h"
#include "engine/program.h"

namespace kiln::cpu {
namespace {

std::string TempDir() {
  static std::mt19937_64 rng(std::random_device{}());
  const auto dir =
      std::filesystem::temp_directory_path() / ("kiln_autotune_test_" + std::to_string(rng()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

// A clock the candidates advance (GemmTuner::Now): timings are exact and no test sleeps.
struct FakeClock {
  double t = 0;
  GemmTuner::Now now() {
    return [this] { return t; };
  }
  void Advance(double ms) { t += ms * 1e-3; }
};

// A candidate whose first run pays a one-time cost (oneDNN creating its primitive) is judged
// by its later runs: the warm-up is not counted.
TEST(GemmTuner, WarmUpRunIsNotCounted) {
  const std::string dir = TempDir();
  const std::vector<std::string> names = {"steady", "slow_start"};
  const std::vector<int64_t> ms = {1024};
  int slow_start_runs = 0;
  FakeClock clock;
  auto run = [&](int c, int64_t) -> Status {
    if (c == 1 && slow_start_runs++ == 0) {
      clock.Advance(60);
    } else {
      clock.Advance(c == 0 ? 4 : 0.2);
    }
    return OkStatus();
  };
  GemmTuner t(dir, true, clock.now());
  auto choice = t.Choose("matmul warm-up N=1 K=2", names, ms, run);
  ASSERT_TRUE(choice.ok()) << choice.status();
  ASSERT_TRUE(choice->has_value());
  EXPECT_EQ(**choice, (std::vector<int>{1}));
  EXPECT_GE(slow_start_runs, 3) << "a warm-up and at least two timed runs";
}

// Long runs are timed less: from a fastest warm-up of 50 ms one round suffices, and a
// candidate whose warm-up took over twice the fastest one's is not timed again.
TEST(GemmTuner, LongRunsTakeOneRoundAndClearLosersDropOut) {
  const std::string dir = TempDir();
  const std::vector<std::string> names = {"fast", "close", "slow"};
  const std::vector<int64_t> ms = {512};
  const double run_ms[3] = {60, 100, 300};
  int runs[3] = {};
  FakeClock clock;
  auto run = [&](int c, int64_t) -> Status {
    ++runs[c];
    clock.Advance(run_ms[c]);
    return OkStatus();
  };
  GemmTuner t(dir, true, clock.now());
  auto choice = t.Choose("linear long runs N=1 K=2", names, ms, run);
  ASSERT_TRUE(choice.ok()) << choice.status();
  ASSERT_TRUE(choice->has_value());
  EXPECT_EQ(**choice, (std::vector<int>{0}));
  EXPECT_EQ(runs[0], 2) << "a warm-up and one timed run";
  EXPECT_EQ(runs[1], 2) << "within twice the fastest warm-up: timed";
  EXPECT_EQ(runs[2], 1) << "over twice the fastest warm-up: the warm-up only";
  EXPECT_EQ(t.timed_runs(), 5);
  std::filesystem::remove_all(dir);
}

TEST(GemmTuner, TimesOnceThenRemembersInMemoryAndOnDisk) {
  const std::string dir = TempDir();
  const std::vector<std::string> names = {"slow", "fast"};
  const std::vector<int64_t> ms = {1, 16};
  int calls = 0;
  FakeClock clock;
  auto run = [&](int c, int64_t m) -> Status {
    ++calls;
    // "fast" is faster at M=16 only.
    clock.Advance(c == 1 && m == 16 ? 0.1 : 2);
    if (c == 1 && m == 1) clock.Advance(3);
    return OkStatus();
  };
  GemmTuner a(dir, true, clock.now());
  auto first = a.Choose("linear test N=1 K=2", names, ms, run);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(first->has_value());
  EXPECT_EQ(**first, (std::vector<int>{0, 1}));
  EXPECT_GT(a.timed_runs(), 0);
  const int after_first = calls;
  auto again = a.Choose("linear test N=1 K=2", names, ms, run);
  ASSERT_TRUE(again.ok() && again->has_value());
  EXPECT_EQ(**again, **first);
  EXPECT_EQ(calls, after_first) << "a cached shape was timed again";

  // A new tuner on the same directory (the next process) reads the file.
  GemmTuner b(dir, true, clock.now());
  auto third = b.Choose("linear test N=1 K=2", names, ms, run);
  ASSERT_TRUE(third.ok() && third->has_value());
  EXPECT_EQ(**third, **first);
  EXPECT_EQ(b.timed_runs(), 0);
  EXPECT_EQ(calls, after_first);

  // A new candidate name set that still contains the cached names reuses them (by name).
  const std::vector<std::string> more = {"other", "fast", "slow"};
  auto fourth = b.Choose("linear test N=1 K=2", more, ms, run);
  ASSERT_TRUE(fourth.ok() && fourth->has_value());
  EXPECT_EQ(**fourth, (std::vector<int>{2, 1}));
  // An M that was never timed makes it time the key again.
  const std::vector<int64_t> ms2 = {1, 16, 64};
  auto fifth = b.Choose("linear test N=1 K=2", names, ms2, run);
  ASSERT_TRUE(fifth.ok() && fifth->has_value());
  EXPECT_GT(calls, after_first);
  std::filesystem::remove_all(dir);
}

TEST(GemmTuner, TimingOffUsesTheCacheOnly) {
  const std::string dir = TempDir();
  const std::vector<std::string> names = {"a", "b"};
  const std::vector<int64_t> ms = {4};
  int calls = 0;
  auto run = [&](int, int64_t) -> Status {
    ++calls;
    return OkStatus();
  };
  GemmTuner off(dir, /*timing_enabled=*/false);
  auto r = off.Choose("k", names, ms, run);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
  EXPECT_EQ(calls, 0);
  GemmTuner on(dir);
  ASSERT_TRUE(on.Choose("k", names, ms, run).ok());
  GemmTuner off2(dir, /*timing_enabled=*/false);
  auto r2 = off2.Choose("k", names, ms, run);
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(r2->has_value());
  std::filesystem::remove_all(dir);
}

TEST(GemmTuner, KeepsOtherWritersEntriesAndSkipsMalformedLines) {
  const std::string dir = TempDir();
  const std::vector<std::string> names = {"a", "b"};
  const std::vector<int64_t> ms = {1};
  auto run = [](int, int64_t) { return OkStatus(); };
  GemmTuner one(dir), two(dir);
  ASSERT_TRUE(one.Choose("key one", names, ms, run).ok());
  ASSERT_TRUE(two.Choose("key two", names, ms, run).ok());  // merges with "key one"
  {
    std::ofstream f(two.file(), std::ios::app);
    f << "garbage without a tab\nkey three\t1=a x=b\n\tnothing\n";
  }
  int calls = 0;
  auto counting = [&](int, int64_t) -> Status {
    ++calls;
    return OkStatus();
  };
  GemmTuner three(dir);
  ASSERT_TRUE(three.Choose("key one", names, ms, counting).ok());
  ASSERT_TRUE(three.Choose("key two", names, ms, counting).ok());
  EXPECT_EQ(calls, 0) << "an entry written by another tuner was lost";
  ASSERT_TRUE(three.Choose("key three", names, ms, counting).ok());
  EXPECT_GT(calls, 0) << "a malformed line was trusted";
  std::filesystem::remove_all(dir);
}

TEST(GemmTuner, RunErrorsAreReturned) {
  GemmTuner t("");
  const std::vector<std::string> names = {"a"};
  const std::vector<int64_t> ms = {1};
  auto r = t.Choose("k", names, ms, [](int, int64_t) { return Internal("boom"); });
  EXPECT_FALSE(r.ok());
}

// Compiling a Linear on the cpu device: the first compile times the candidates at every
// representative M (symbolic T), a second compile of the same shape times nothing, and a
// fresh tuner on the same directory (the next start) times nothing either.
TEST(GemmTuner, SecondCompileOfTheSameShapesDoesNoTiming) {
  const std::string dir = TempDir();
  std::unique_ptr<backend::Backend> cpu = backend::MakeCpuBackend(2);
  backend::Device* dev = cpu->device(0);
  auto request_kernel = [&](GemmTuner& tuner) -> StatusOr<backend::Kernel> {
    Graph g;
    Builder b(&g);
    const Dim T = b.Symbol("T", 512);
    const Value x = b.Input("x", DType::kF32, {T, 256});
    const Value w = b.Weight("w", DType::kQ4_0, {384, 256});
    const Value y = b.Linear(x, w);
    KILN_RETURN_IF_ERROR(b.status());
    const Node& n = g.node(y.id);
    std::vector<TensorType> in = {{DType::kF32, {T, 256}}, {DType::kQ4_0, {384, 256}}};
    backend::KernelRequest req;
    req.op = n.op;
    req.attrs = &n.attrs;
    req.inputs = in;
    req.output = {n.dtype, n.shape};
    SelectContext c;
    c.device = dev;
    c.threads = 2;
    c.isa = ActiveIsa();
    c.tuner = &tuner;
    c.reference = ref::KernelFor;
    KILN_ASSIGN_OR_RETURN(std::optional<backend::Kernel> k, SelectKernel(req, c));
    if (!k) return Internal("no kernel selected");
    return *std::move(k);
  };
  GemmTuner first(dir);
  auto k1 = request_kernel(first);
  ASSERT_TRUE(k1.ok()) << k1.status();
  const int64_t timed = first.timed_runs();
  // Every candidate (gemv, gemm, onednn_dequant) at every representative M, at least once.
  EXPECT_GE(timed, 3 * static_cast<int64_t>(RepresentativeMs().size()));
  auto k2 = request_kernel(first);
  ASSERT_TRUE(k2.ok());
  EXPECT_EQ(first.timed_runs(), timed) << "the second compile timed again";
  EXPECT_EQ(DescribeGemmPlan(*k1), DescribeGemmPlan(*k2));
  GemmTuner restarted(dir);
  auto k3 = request_kernel(restarted);
  ASSERT_TRUE(k3.ok());
  EXPECT_EQ(restarted.timed_runs(), 0) << "the cache file was not used";
  EXPECT_EQ(DescribeGemmPlan(*k3), DescribeGemmPlan(*k1));
  EXPECT_TRUE(std::filesystem::exists(first.file()));

  // Timings disturbed by a busy machine cannot make decode rows (M <= 8) pack panels or
  // dequantize the whole weight: a cache that says "gemm" everywhere is overruled there.
  std::string text;
  {
    std::ifstream in(first.file());
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  for (const std::string from : {"=gemv", "=onednn_dequant"}) {
    for (size_t p = text.find(from); p != std::string::npos; p = text.find(from, p)) {
      text.replace(p, from.size(), "=gemm");
    }
  }
  std::ofstream(first.file()) << text;
  GemmTuner disturbed(dir);
  auto k4 = request_kernel(disturbed);
  ASSERT_TRUE(k4.ok());
  EXPECT_EQ(disturbed.timed_runs(), 0);
  EXPECT_EQ(DescribeGemmPlan(*k4).rfind("1-", 0), 0u) << DescribeGemmPlan(*k4);
  EXPECT_NE(DescribeGemmPlan(*k4).find(":gemv"), std::string::npos) << DescribeGemmPlan(*k4);
  std::filesystem::remove_all(dir);
}

// The same through the public path: Compile() twice on the cpu backend with the process'
// tuner pointed at a fresh KILN_CACHE_DIR (set by CMake for this binary).
TEST(GemmTuner, GlobalTunerIsUsedByCompile) {
  GemmTuner& g = GemmTuner::Global();
  if (g.file().empty()) GTEST_SKIP() << "no cache directory";
  std::filesystem::remove(g.file());  // before this process' first Choose reads it
  std::unique_ptr<backend::Backend> cpu = backend::MakeCpuBackend(2);
  auto compile = [&] {
    Graph graph;
    Builder b(&graph);
    const Dim T = b.Symbol("T", 64);
    const Value x = b.Input("x", DType::kF32, {T, 512});
    const Value w = b.Weight("w", DType::kQ8_0, {256, 512});
    const Value y = b.Linear(x, w);
    return Compile(graph, {y}, *cpu->device(0));
  };
  const int64_t before = g.timed_runs();
  ASSERT_TRUE(compile().ok());
  const int64_t after_first = g.timed_runs();
  EXPECT_GT(after_first, before);
  ASSERT_TRUE(compile().ok());
  EXPECT_EQ(g.timed_runs(), after_first);
}

}  // namespace
}  // namespace kiln::cpu
