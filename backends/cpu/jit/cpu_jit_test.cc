// The cpu backend's kernel compiler across processes: a second start compiles nothing, two
// processes compiling the same program at once compile it once, corrupt cache entries are
// rebuilt, and without a compiler (or with the JIT off) programs still run (interpreter).
//
// Each "start" is a child process (this binary, running the disabled ChildTest) with its own
// environment; it prints one RESULT line with its compile counters and a checksum.
#include "backends/cpu/jit/cpu_jit.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "backends/builtin.h"
#include "backends/cpu/jit/aot.h"
#include "backends/cpu/jit/toolchain.h"
#include "backends/host/host_device.h"
#include "engine/compiler/compile.h"
#include "engine/compiler/testing/llama_graph.h"

namespace kiln::cpu::jit {
namespace {

struct ChildResult {
  bool ok = false;
  int64_t runs = -1, compiled = -1, cached = -1, reused = -1;
  int available = -1;
  double checksum = 0;
  std::string output;
};

std::string SelfPath() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return std::string(buf, n > 0 ? n : 0);
}

// Starts a child with `env` ("A=1 B=2"); returns its stdout stream.
FILE* StartChild(const std::string& env) {
  // KILN_CPU_AOT=0: these tests are about the compiler and the disk cache.
  const std::string cmd = StrCat("env KILN_CPU_AOT=0 ", env, " ", SelfPath(),
                                 " --gtest_filter=ChildTest.DISABLED_CompileAndRun"
                                 " --gtest_also_run_disabled_tests 2>&1");
  return popen(cmd.c_str(), "r");
}

ChildResult Finish(FILE* f) {
  ChildResult r;
  std::string out;
  char buf[4096];
  while (fgets(buf, sizeof(buf), f) != nullptr) out += buf;
  const int status = pclose(f);
  r.output = out;
  const size_t at = out.find("RESULT ");
  if (at == std::string::npos || status != 0) return r;
  long long runs, compiled, cached, reused;
  int available;
  double checksum;
  if (std::sscanf(
          out.c_str() + at,
          "RESULT runs=%lld compiled=%lld cached=%lld reused=%lld available=%d checksum=%lf", &runs,
          &compiled, &cached, &reused, &available, &checksum) == 6) {
    r.ok = true;
    r.runs = runs, r.compiled = compiled, r.cached = cached, r.reused = reused;
    r.available = available;
    r.checksum = checksum;
  }
  return r;
}

ChildResult RunChild(const std::string& env) { return Finish(StartChild(env)); }

std::string FreshCacheDir(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "/kiln_jit_test_" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

std::vector<std::filesystem::path> CacheFiles(const std::string& dir, const std::string& ext) {
  std::vector<std::filesystem::path> out;
  if (!std::filesystem::exists(dir)) return out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension() == ext) out.push_back(e.path());
  }
  return out;
}

// The Llama test model with `layers` blocks compiled for `dev`, random weights bound, and the
// inputs of one prefill step (2 sequences of 3 tokens).
StatusOr<std::unique_ptr<Program>> CompiledLlama(backend::Device& dev, int layers) {
  compiler::testing::LlamaConfig cfg;
  cfg.layers = layers;
  KILN_ASSIGN_OR_RETURN(auto m, compiler::testing::BuildLlama(cfg));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Program> p, compiler::Compile(m.graph, {m.logits}, dev));
  KILN_ASSIGN_OR_RETURN(auto weights, compiler::testing::RandomWeights(m.graph, dev, 3));
  for (auto& [name, t] : weights) KILN_RETURN_IF_ERROR(p->Bind(name, t));
  KILN_RETURN_IF_ERROR(p->SetSymbol("T", 6));
  KILN_RETURN_IF_ERROR(p->SetSymbol("S", 2));
  KILN_ASSIGN_OR_RETURN(auto in, compiler::testing::StepInputs(cfg, dev, 2, 3, 0));
  for (auto& [name, t] : in) KILN_RETURN_IF_ERROR(p->Bind(name, t));
  return p;
}

// What a child runs: a 4-block model through compiler::Compile, one prefill step.
TEST(ChildTest, DISABLED_CompileAndRun) {
  auto backend = backend::MakeCpuBackend(2);
  backend::Device& dev = *backend->device(0);
  auto p = CompiledLlama(dev, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  auto stream = dev.CreateStream();
  ASSERT_TRUE((*p)->Run(**stream).ok());
  auto out = (*p)->Output(0);
  ASSERT_TRUE(out.ok());
  double sum = 0;
  auto values = out->ToDoubles();
  ASSERT_TRUE(values.ok());
  for (double v : *values) sum += v * v;
  auto* target = static_cast<compiler::Target*>(dev.GetExtension(compiler::kTargetExtension));
  ASSERT_NE(target, nullptr);
  const compiler::CompileCounters c = target->counters();
  std::printf(
      "RESULT runs=%lld compiled=%lld cached=%lld reused=%lld available=%d checksum=%.17g\n",
      static_cast<long long>(c.compiler_runs), static_cast<long long>(c.compiled),
      static_cast<long long>(c.cached), static_cast<long long>(c.reused),
      static_cast<CpuJit*>(target)->available() ? 1 : 0, sum);
}

// The straggler fallback (backends/host/host_device.h) runs each launch's shares one after
// another on the calling thread: a fused program (GEMM epilogues included) must give the
// pool's logits bit for bit.
TEST(CpuJitTest, SharesRunInSequenceGiveThePoolsResults) {
  auto backend = backend::MakeCpuBackend(2);
  backend::Device& dev = *backend->device(0);
  auto p = CompiledLlama(dev, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  auto logits = [&](backend::Stream& stream) {
    EXPECT_TRUE((*p)->Run(stream).ok());
    auto out = (*p)->Output(0);
    EXPECT_TRUE(out.ok());
    auto values = out->ToDoubles();
    EXPECT_TRUE(values.ok());
    return values.ok() ? *values : std::vector<double>();
  };
  backend::HostStream pool(&dev, 2, backend::StragglerPolicy{.enabled = false});
  const std::vector<double> want = logits(pool);
  ASSERT_FALSE(want.empty());
  // Any wait counts as a straggler: after the first run, every run is in sequence.
  backend::HostStream sequence(
      &dev, 2,
      backend::StragglerPolicy{.max_wait_share = -1, .min_run_seconds = 0, .backoff_seconds = 1e6});
  EXPECT_EQ(logits(sequence), want);  // the first run, on the pool
  EXPECT_EQ(logits(sequence), want);
  EXPECT_EQ(sequence.single_thread_runs(), 1);
}

TEST(CpuJitTest, SecondStartCompilesNothing) {
  const std::string dir = FreshCacheDir("second_start");
  const ChildResult first = RunChild("KILN_CACHE_DIR=" + dir);
  ASSERT_TRUE(first.ok) << first.output;
  EXPECT_EQ(first.available, 1);
  EXPECT_EQ(first.runs, 1) << "one program, one compiler run";
  EXPECT_GT(first.compiled, 0);
  const ChildResult second = RunChild("KILN_CACHE_DIR=" + dir);
  ASSERT_TRUE(second.ok) << second.output;
  EXPECT_EQ(second.runs, 0) << second.output;
  EXPECT_EQ(second.compiled, 0);
  EXPECT_EQ(second.cached, first.compiled);
  EXPECT_EQ(second.checksum, first.checksum);
  std::filesystem::remove_all(dir);
}

TEST(CpuJitTest, TwoProcessesCompilingTheSameProgramCompileOnce) {
  const std::string dir = FreshCacheDir("concurrent");
  FILE* a = StartChild("KILN_CACHE_DIR=" + dir);
  FILE* b = StartChild("KILN_CACHE_DIR=" + dir);
  const ChildResult ra = Finish(a), rb = Finish(b);
  ASSERT_TRUE(ra.ok) << ra.output;
  ASSERT_TRUE(rb.ok) << rb.output;
  EXPECT_EQ(ra.runs + rb.runs, 1) << "the second process waits for the first and loads its result";
  EXPECT_EQ(ra.checksum, rb.checksum);
  EXPECT_EQ(CacheFiles(dir, ".so").size(), 1u);
  // No temporary files are left behind.
  EXPECT_TRUE(CacheFiles(dir, ".cc").empty());
  std::filesystem::remove_all(dir);
}

TEST(CpuJitTest, CorruptEntriesAreDetectedAndRebuilt) {
  const std::string dir = FreshCacheDir("corrupt");
  const ChildResult first = RunChild("KILN_CACHE_DIR=" + dir);
  ASSERT_TRUE(first.ok) << first.output;
  const auto sos = CacheFiles(dir, ".so");
  ASSERT_EQ(sos.size(), 1u);
  // Truncate the shared object (a torn write, a full disk): loading it could crash.
  std::filesystem::resize_file(sos[0], std::filesystem::file_size(sos[0]) / 2);
  const ChildResult second = RunChild("KILN_CACHE_DIR=" + dir);
  ASSERT_TRUE(second.ok) << second.output;
  EXPECT_EQ(second.runs, 1) << "the corrupt entry is rebuilt";
  EXPECT_EQ(second.checksum, first.checksum);
  // Flip a byte in the middle (bit rot): same story.
  {
    std::fstream f(sos[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(sos[0]) / 2));
    f.put('\x5a');
  }
  const ChildResult third = RunChild("KILN_CACHE_DIR=" + dir);
  ASSERT_TRUE(third.ok) << third.output;
  EXPECT_EQ(third.runs, 1);
  EXPECT_EQ(third.checksum, first.checksum);
  // And a healthy cache again: nothing to compile.
  const ChildResult fourth = RunChild("KILN_CACHE_DIR=" + dir);
  ASSERT_TRUE(fourth.ok) << fourth.output;
  EXPECT_EQ(fourth.runs, 0);
  std::filesystem::remove_all(dir);
}

TEST(CpuJitTest, AotKernelsMakeAFirstStartRunNoCompiler) {
  if (AotKernels().empty()) GTEST_SKIP() << "built without AOT kernels (KILN_AOT_KERNELS=OFF)";
  const std::string dir = FreshCacheDir("aot");
  const ChildResult jit = RunChild("KILN_CACHE_DIR=" + dir + "_jit");
  ASSERT_TRUE(jit.ok) << jit.output;
  const ChildResult aot = RunChild("KILN_CACHE_DIR=" + dir + " KILN_CPU_AOT=1");
  ASSERT_TRUE(aot.ok) << aot.output;
  EXPECT_EQ(aot.runs, 0) << "every kernel of the model is built in";
  EXPECT_EQ(aot.compiled, 0);
  EXPECT_GT(aot.cached, 0);
  EXPECT_TRUE(CacheFiles(dir, ".so").empty());
  // The AOT kernels are cloned for x86-64-v4, v3 and a baseline (aot_gen.cc); the JIT builds
  // for this CPU's level (toolchain.h). At the same level the math is the same; below v3 the
  // vector widths may differ, so sums may round differently (~1e-7 relative).
  const std::string level = CpuFeatureLevel();
  const bool same_level = level == "x86-64-v4" || level == "x86-64-v3";
  const double tolerance = same_level ? 1e-9 : 1e-6;
  EXPECT_NEAR(aot.checksum, jit.checksum, tolerance * std::abs(jit.checksum))
      << "CPU level " << level;
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir + "_jit");
}

TEST(CpuJitTest, WithoutACompilerProgramsRunOnTheInterpreter) {
  const std::string dir = FreshCacheDir("no_compiler");
  const ChildResult with = RunChild("KILN_CACHE_DIR=" + dir);
  ASSERT_TRUE(with.ok) << with.output;
  for (const std::string env : {"KILN_CXX=/nonexistent/c++", "KILN_CPU_JIT=0"}) {
    SCOPED_TRACE(env);
    const ChildResult r = RunChild(StrCat("KILN_CACHE_DIR=", dir, "_empty ", env));
    ASSERT_TRUE(r.ok) << r.output;
    EXPECT_EQ(r.available, 0);
    EXPECT_EQ(r.runs, 0);
    EXPECT_NEAR(r.checksum, with.checksum, 1e-5 * std::abs(with.checksum));
  }
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir + "_empty");
}

}  // namespace
}  // namespace kiln::cpu::jit
