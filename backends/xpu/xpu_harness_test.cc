// The op harness (backends/harness) on the xpu backend: every forward case and every gradient
// case must pass on the OpenCL device against `ref` — unsupported counts as a failure, as for
// the built-in cpu backend. Kernels of all cases are declared first and built as one batch
// (building OpenCL programs dominates the run time on PoCL).
//
// Without an OpenCL device the tests skip (saying so). KILN_XPU_HARNESS_OP=<op> limits the run
// to one op (debugging).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <set>

#include "backends/builtin.h"
#include "backends/xpu/xpu_device.h"
#include "engine/testing/op_harness.h"

namespace kiln::xpu {
namespace {

struct Devices {
  std::unique_ptr<backend::Backend> ref;
  std::unique_ptr<XpuBackend> xpu;
  std::string why_none;
};

Devices& Get() {
  static Devices* d = [] {
    auto* r = new Devices();
    r->ref = backend::MakeRefBackend();
    auto b = CreateXpuBackend();
    if (b.ok()) {
      r->xpu = *std::move(b);
    } else {
      r->why_none = std::string(StatusMessage(b.status()));
    }
    return r;
  }();
  return *d;
}

// Destroys the OpenCL devices before static destruction (so their cached binaries are
// refreshed while the OpenCL runtime is still up).
class Teardown : public ::testing::Environment {
 public:
  void TearDown() override { Get().xpu.reset(); }
};
const auto* const kTeardown = ::testing::AddGlobalTestEnvironment(new Teardown());

std::string OnlyOp() {
  const char* v = std::getenv("KILN_XPU_HARNESS_OP");
  return v ? v : "";
}

void RunCases(bool gradient) {
  Devices& d = Get();
  if (!d.xpu) GTEST_SKIP() << "no OpenCL device: " << d.why_none;
  const std::vector<harness::OpCase> cases =
      gradient ? harness::GradientCases(false) : harness::ForwardCases(false);
  const std::string only = OnlyOp();
  for (int i = 0; i < d.xpu->device_count(); ++i) {
    auto* dev = static_cast<XpuDevice*>(d.xpu->device(i));
    const auto t0 = std::chrono::steady_clock::now();
    // Declare every case's kernels, then build them together.
    for (const harness::OpCase& c : cases) {
      if (!only.empty() && c.op != only) continue;
      (void)harness::CompileCase(c, gradient, *dev);  // only declares kernels; the run below checks
    }
    const Status built = dev->BuildPending();
    ASSERT_TRUE(built.ok()) << built;
    const auto t1 = std::chrono::steady_clock::now();
    int ran = 0, passed = 0;
    std::set<std::string> ops;
    for (const harness::OpCase& c : cases) {
      if (!only.empty() && c.op != only) continue;
      const harness::Result r = gradient ? harness::RunGradient(c, *d.ref->device(0), *dev)
                                         : harness::RunForward(c, *d.ref->device(0), *dev);
      ++ran;
      ops.insert(c.op);
      if (r.outcome == harness::Result::Outcome::kPass) ++passed;
      EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass)
          << dev->name() << ": " << c.name << ": " << r.message;
    }
    const auto t2 = std::chrono::steady_clock::now();
    const XpuDevice::Stats st = dev->stats();
    std::printf(
        "%s %s: %d/%d cases passed over %zu ops; compile+build %.1f s, run %.1f s; programs: "
        "%d built, %d from the cache (%.1f s building)\n",
        std::string(dev->name()).c_str(), gradient ? "gradient" : "forward", passed, ran,
        ops.size(), std::chrono::duration<double>(t1 - t0).count(),
        std::chrono::duration<double>(t2 - t1).count(), st.programs_built_from_source,
        st.programs_loaded_from_cache, st.build_seconds);
    EXPECT_GT(ran, 0);
  }
}

TEST(XpuHarnessTest, EveryForwardCasePasses) { RunCases(/*gradient=*/false); }
TEST(XpuHarnessTest, EveryGradientCasePasses) { RunCases(/*gradient=*/true); }

}  // namespace
}  // namespace kiln::xpu
