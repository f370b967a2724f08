// The op harness (backends/harness) on the xpu backend: every forward case and every gradient
// case must pass on the OpenCL device against `ref` — unsupported counts as a failure, as for
// the built-in cpu backend. Kernels of all cases are declared first and built as one batch
// (building OpenCL programs dominates the run time on PoCL).
//
// Without an OpenCL device the tests skip (saying so). KILN_XPU_HARNESS_OP=<op> limits the run
// to one op (debugging).
#include <gtest/gtest.h>

#include <cstdlib>

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
  for (int i = 0; i < d.xpu->device_count(); ++i) {
    auto* dev = static_cast<XpuDevice*>(d.xpu->device(i));
    const harness::SuiteResult r = harness::RunBatchBuilt(
        gradient, *d.ref->device(0), *dev, [&] { return dev->BuildPending(); }, OnlyOp());
    ASSERT_TRUE(r.build.ok()) << r.build;
    for (const std::string& f : r.failures) ADD_FAILURE() << dev->name() << ": " << f;
    const XpuDevice::Stats st = dev->stats();
    std::printf("%s %s: %s; programs: %d built, %d from the cache (%.1f s building)\n",
                std::string(dev->name()).c_str(), gradient ? "gradient" : "forward",
                r.Summary().c_str(), st.programs_built_from_source, st.programs_loaded_from_cache,
                st.build_seconds);
    EXPECT_GT(r.ran, 0);
  }
}

TEST(XpuHarnessTest, EveryForwardCasePasses) { RunCases(/*gradient=*/false); }
TEST(XpuHarnessTest, EveryGradientCasePasses) { RunCases(/*gradient=*/true); }

}  // namespace
}  // namespace kiln::xpu
