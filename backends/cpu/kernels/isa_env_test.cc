// The cpu backend with the instruction-set variant forced by KILN_CPU_ISA (CMake runs this
// binary once per variant and once as detected): the variant is the one the kernels report,
// and the result matches the reference backend through the op harness.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/builtin.h"
#include "backends/cpu/kernels/isa.h"
#include "engine/builder.h"
#include "engine/testing/op_harness.h"

namespace kiln::cpu {
namespace {

using V = std::vector<Value>;

// One suite name per binary (CMake defines it), so CTest lists the variants apart.
#ifndef KILN_ISA_TEST_SUITE
#define KILN_ISA_TEST_SUITE CpuBackend
#endif

// The production path: the registered cpu backend with the variant from KILN_CPU_ISA (this
// binary runs once per variant, see CMakeLists.txt) and the kernel names it reports.
TEST(KILN_ISA_TEST_SUITE, UsesTheActiveVariant) {
  const char* want = std::getenv("KILN_CPU_ISA");
  if (want != nullptr) {
    const std::optional<Isa> isa = ParseIsa(want);
    ASSERT_TRUE(isa.has_value()) << want;
    if (!IsaSupported(*isa)) GTEST_SKIP() << want << " is not supported by this CPU";
    EXPECT_EQ(ActiveIsa(), *isa);
  }
  std::unique_ptr<backend::Backend> cpu = backend::MakeCpuBackend(2);
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 64);
  const Value x = b.Input("x", DType::kF32, {T, 96});
  const Value w = b.Weight("w", DType::kQ4_1, {40, 96});
  const Value y = b.Linear(x, w);
  ASSERT_TRUE(b.status().ok());
  backend::KernelRequest req;
  const Node& n = g.node(y.id);
  std::vector<TensorType> in = {{DType::kF32, {T, 96}}, {DType::kQ4_1, {40, 96}}};
  req.op = n.op;
  req.attrs = &n.attrs;
  req.inputs = in;
  req.output = {n.dtype, n.shape};
  StatusOr<backend::Kernel> k = cpu->device(0)->GetKernel(req);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_NE(k->name.find(absl::StrCat(".", IsaName(ActiveIsa()), "[")), std::string::npos)
      << k->name;
  // And it computes the right thing through the whole harness.
  harness::OpCase c;
  c.op = "linear";
  c.name = "linear q4_1 via the cpu backend";
  harness::InputSpec xs, ws;
  xs.name = "x";
  xs.shape = {3, 96};
  ws.name = "w";
  ws.dtype = DType::kQ4_1;
  ws.shape = {40, 96};
  ws.source = OpKind::kWeight;
  c.inputs = {xs, ws};
  c.build = [](Builder& bb, const V& v) { return bb.Linear(v[0], v[1]); };
  const harness::Result r = harness::RunForward(c, *ref->device(0), *cpu->device(0));
  EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << r.message;
}

}  // namespace
}  // namespace kiln::cpu
