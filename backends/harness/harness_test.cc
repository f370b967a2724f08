// The op harness in `make test`: forward and gradient mode for every op on every registered
// backend (builtins plus plugins from KILN_BACKEND_PATH), coverage of the op table, and a
// perf smoke run. One CTest test per op and mode.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>

#include "backends/builtin.h"
#include "backends/registry.h"
#include "engine/program.h"
#include "engine/testing/op_harness.h"

namespace kiln::harness {
namespace {

bool Full() {
  const char* v = std::getenv("KILN_HARNESS_FULL");
  return v != nullptr && std::string_view(v) == "1";
}

backend::Registry& Backends() {
  static backend::Registry* r = [] {
    auto* reg = new backend::Registry();
    // Two pool threads: exercises the split/barrier path on any machine, cheaply.
    (void)reg->Register(backend::MakeRefBackend());
    (void)reg->Register(backend::MakeCpuBackend(2));
    reg->Autoload();
    return reg;
  }();
  return *r;
}

const std::vector<OpCase>& Forward() {
  static const auto* c = new std::vector<OpCase>(ForwardCases(Full()));
  return *c;
}
const std::vector<OpCase>& Gradient() {
  static const auto* c = new std::vector<OpCase>(GradientCases(Full()));
  return *c;
}

std::vector<std::string> OpNames(const std::vector<OpCase>& cases) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const OpCase& c : cases) {
    if (seen.insert(c.op).second) names.push_back(c.op);
  }
  return names;
}

// Runs `run` for every case of `op` on every device except the reference; builtin
// backends must support every case, plugins may decline (counted, not failed).
void RunAll(const std::vector<OpCase>& cases, const std::string& op,
            Result (*run)(const OpCase&, backend::Device&, backend::Device&)) {
  backend::Device* ref = *Backends().GetDevice("ref");
  int ran = 0;
  for (backend::Backend* be : Backends().backends()) {
    if (be->name() == "ref") continue;
    const bool builtin = be->name() == "cpu";
    for (int d = 0; d < be->device_count(); ++d) {
      backend::Device* dev = be->device(d);
      for (const OpCase& c : cases) {
        if (c.op != op) continue;
        const Result r = run(c, *ref, *dev);
        if (r.outcome == Result::Outcome::kUnsupported && !builtin) continue;
        ++ran;
        EXPECT_EQ(r.outcome, Result::Outcome::kPass)
            << dev->name() << ": " << c.name << ": " << r.message;
      }
    }
  }
  EXPECT_GT(ran, 0) << "no backend ran any case of " << op;
}

class ForwardTest : public ::testing::TestWithParam<std::string> {};
TEST_P(ForwardTest, MatchesReference) { RunAll(Forward(), GetParam(), RunForward); }
INSTANTIATE_TEST_SUITE_P(Ops, ForwardTest, ::testing::ValuesIn(OpNames(ForwardCases(false))),
                         [](const auto& info) { return info.param; });

class GradientTest : public ::testing::TestWithParam<std::string> {};
TEST_P(GradientTest, MatchesFiniteDifferences) { RunAll(Gradient(), GetParam(), RunGradient); }
INSTANTIATE_TEST_SUITE_P(Ops, GradientTest, ::testing::ValuesIn(OpNames(GradientCases(false))),
                         [](const auto& info) { return info.param; });

std::set<OpKind> Covered(const std::vector<OpCase>& cases) {
  std::set<OpKind> ops;
  for (const OpCase& c : cases) {
    auto o = OpsOf(c);
    EXPECT_TRUE(o.ok()) << c.name << ": " << o.status();
    if (o.ok()) ops.insert(o->begin(), o->end());
  }
  return ops;
}

TEST(CoverageTest, EveryOpHasForwardCases) {
  const std::set<OpKind> covered = Covered(Forward());
  for (int i = 0; i < static_cast<int>(OpKind::kNumOps); ++i) {
    const OpDef& def = GetOpDef(static_cast<OpKind>(i));
    if (def.cls == OpClass::kSource) continue;
    EXPECT_TRUE(covered.count(def.op)) << "op '" << def.name << "' has no forward harness case";
  }
}

TEST(CoverageTest, EveryBackwardRuleHasGradientCases) {
  const std::set<OpKind> covered = Covered(Gradient());
  for (int i = 0; i < static_cast<int>(OpKind::kNumOps); ++i) {
    const OpDef& def = GetOpDef(static_cast<OpKind>(i));
    if (def.backward == nullptr) continue;
    EXPECT_TRUE(covered.count(def.op))
        << "op '" << def.name << "' has a backward rule but no gradient case";
  }
}

// The cpu backend runs every op that has an expression form by interpreting it, so the
// forward cases above prove the forms against the reference loops.
TEST(CoverageTest, CpuInterpretsEveryExpressionForm) {
  backend::Device* cpu = *Backends().GetDevice("cpu");
  for (int i = 0; i < static_cast<int>(OpKind::kNumOps); ++i) {
    const OpDef& def = GetOpDef(static_cast<OpKind>(i));
    if (def.pointwise == nullptr && def.reduce == nullptr) continue;
    bool interpreted = false;
    for (const OpCase& c : Forward()) {
      if (c.op != def.name) continue;
      Graph g;
      Builder b(&g);
      std::vector<Value> in;
      for (const InputSpec& s : c.inputs) {
        in.push_back(b.Input(s.name, s.dtype, SymShape(s.shape.begin(), s.shape.end())));
      }
      const Value out = c.build(b, in);
      auto p = Compile(g, {out}, *cpu);
      ASSERT_TRUE(p.ok()) << c.name << ": " << p.status();
      const std::string prefix = def.pointwise ? "[cpu.expr." : "[cpu.reduce.";
      interpreted |= (*p)->DebugString().find(prefix + def.name + "]") != std::string::npos;
    }
    EXPECT_TRUE(interpreted) << "no case runs '" << def.name
                             << "' through its expression form on cpu";
  }
}

TEST(PerfTest, SmokeRunAndLaunchOverhead) {
  backend::Device* cpu = *Backends().GetDevice("cpu");
  for (const OpCase& c : PerfCases(false)) {
    const Result r = RunPerf(c, *cpu, 2);
    EXPECT_EQ(r.outcome, Result::Outcome::kPass) << c.name << ": " << r.message;
    std::printf("perf cpu:0 %-40s %s\n", c.name.c_str(), r.message.c_str());
  }
  auto single = backend::MakeCpuBackend(1);
  auto ns = LaunchOverheadNs(*single->device(0), 1000, 20);
  ASSERT_TRUE(ns.ok()) << ns.status();
  std::printf("launch overhead (incl. a 1-element interpreted kernel): %.0f ns/launch\n", *ns);
  RecordProperty("launch_overhead_ns", static_cast<int>(*ns));
  // Budget: well under 1 us per launch; 5 us leaves room for a loaded CI machine.
  EXPECT_LT(*ns, 5000);
}

}  // namespace
}  // namespace kiln::harness

namespace kiln::harness {
namespace {

// A device that breaks one op in a chosen way: the harness must notice every kind.
class MutantDevice final : public backend::Device {
 public:
  enum class Bug { kWrongValue, kOutOfBounds, kWritesInput, kNaN };
  MutantDevice(backend::Device* inner, OpKind op, Bug bug) : inner_(inner), op_(op), bug_(bug) {}
  std::string_view name() const override { return "mutant:0"; }
  bool host_visible() const override { return true; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t n) override;
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
    return inner_->CreateStream();
  }
  bool SupportsDType(DType t) const override { return inner_->SupportsDType(t); }
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& r) override {
    KILN_ASSIGN_OR_RETURN(backend::Kernel k, inner_->GetKernel(r));
    if (r.op != op_) return k;
    auto state = std::make_shared<State>(State{k, bug_});
    return backend::Kernel{Run, state, "mutant"};
  }

 private:
  struct State {
    backend::Kernel real;
    Bug bug;
  };
  static void Run(const LaunchArgs& a, const ExecCtx& c) {
    const State& s = *static_cast<const State*>(a.kernel_data);
    LaunchArgs real = a;
    real.kernel_data = s.real.data.get();
    s.real.fn(real, c);
    if (c.thread_index != 0) return;
    const int64_t n = a.output.numel();
    switch (s.bug) {
      case Bug::kWrongValue:
        // Element 0 is thread 0's share: no race with the other threads of the real kernel.
        StoreElement(a.output.data, a.output.dtype, 0,
                     LoadElement(a.output.data, a.output.dtype, 0) * 1.01 + 0.1);
        break;
      case Bug::kOutOfBounds:
        StoreElement(a.output.data, a.output.dtype, n, 1.0);
        break;
      case Bug::kWritesInput:
        StoreElement(a.inputs[0].data, a.inputs[0].dtype, 0, 123.0);
        break;
      case Bug::kNaN:
        StoreElement(a.output.data, a.output.dtype, 0, std::nan(""));
        break;
    }
  }
  backend::Device* inner_;
  OpKind op_;
  Bug bug_;
};

struct MutantBuffer final : backend::Buffer {
  MutantBuffer(backend::Device* d, size_t n)
      : Buffer(d, std::aligned_alloc(64, (n + 63) / 64 * 64 + 64), n) {}
  ~MutantBuffer() override { std::free(data()); }
};
StatusOr<std::unique_ptr<backend::Buffer>> MutantDevice::Allocate(size_t n) {
  return std::unique_ptr<backend::Buffer>(new MutantBuffer(this, n));
}

const OpCase& FirstCase(const std::vector<OpCase>& cases, const std::string& op) {
  for (const OpCase& c : cases) {
    if (c.op == op) return c;
  }
  static OpCase none;
  return none;
}

TEST(HarnessSelfTest, DetectsEveryKindOfBrokenKernel) {
  backend::Device* ref = *Backends().GetDevice("ref");
  backend::Device* cpu = *Backends().GetDevice("cpu");
  struct Probe {
    OpKind op;
    const char* name;
    MutantDevice::Bug bug;
    const char* expect;
  };
  const Probe probes[] = {
      {OpKind::kExp, "exp", MutantDevice::Bug::kWrongValue, "NMSE"},
      {OpKind::kTanh, "tanh", MutantDevice::Bug::kOutOfBounds, "guard"},
      {OpKind::kSigmoid, "sigmoid", MutantDevice::Bug::kWritesInput, "was modified"},
      {OpKind::kSilu, "silu", MutantDevice::Bug::kNaN, "NaN/Inf mismatch"},
  };
  for (const Probe& p : probes) {
    MutantDevice dev(cpu, p.op, p.bug);
    const Result r = RunForward(FirstCase(Forward(), p.name), *ref, dev);
    EXPECT_EQ(r.outcome, Result::Outcome::kFail) << p.name;
    EXPECT_NE(r.message.find(p.expect), std::string::npos) << p.name << ": " << r.message;
  }
  // A wrong kernel used only by a backward graph is caught by gradient mode.
  MutantDevice bad_neg(cpu, OpKind::kMul, MutantDevice::Bug::kWrongValue);
  const Result g = RunGradient(FirstCase(Gradient(), "exp"), *ref, bad_neg);
  EXPECT_EQ(g.outcome, Result::Outcome::kFail) << g.message;
}

}  // namespace
}  // namespace kiln::harness
