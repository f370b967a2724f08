#include "engine/compiler/codegen.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>

#include "engine/compiler/testing/samples.h"
#include "engine/ops.h"

namespace kiln::compiler {
namespace {

const std::vector<testing::Sample>& Samples() {
  static const auto* s = new std::vector<testing::Sample>(testing::SampleSpecs());
  return *s;
}

TEST(CodegenTest, EveryOpFormIsSampled) {
  std::set<std::string> names;
  for (const testing::Sample& s : Samples()) names.insert(s.spec.name);
  for (int i = 0; i < static_cast<int>(OpKind::kNumOps); ++i) {
    const OpDef& def = GetOpDef(static_cast<OpKind>(i));
    if (def.pointwise == nullptr && def.reduce == nullptr) continue;
    EXPECT_TRUE(names.count(def.name)) << "no sample kernel for " << def.name;
  }
  EXPECT_GT(Samples().size(), 100u);
  int fused = 0, epilogues = 0;
  for (const testing::Sample& s : Samples()) {
    fused += s.label.rfind("fused", 0) == 0;
    epilogues += s.spec.kind == KernelKind::kGemmEpilogue;
  }
  EXPECT_GT(fused, 10);
  EXPECT_GT(epilogues, 2);
}

TEST(CodegenTest, EverySampleGeneratesInEveryDialect) {
  for (const testing::Sample& s : Samples()) {
    for (Dialect d : {Dialect::kCpp, Dialect::kOpenCL, Dialect::kCuda, Dialect::kHip}) {
      if (d != Dialect::kCpp && s.spec.kind == KernelKind::kGemmEpilogue) {
        EXPECT_EQ(GenerateKernel(s.spec, d).status().code(), StatusCode::kUnimplemented);
        continue;
      }
      StatusOr<GeneratedKernel> k = GenerateKernel(s.spec, d);
      ASSERT_TRUE(k.ok()) << s.label << " (" << DialectName(d) << "): " << k.status();
      EXPECT_NE(k->code.find(k->entry), std::string::npos);
      EXPECT_EQ(k->code.find("kiln_KERNEL_NAME"), std::string::npos);
    }
  }
}

TEST(CodegenTest, KeysAreDeterministicAndDistinguishSpecs) {
  ASSERT_GE(Samples().size(), 2u);
  const KernelSpec& a = Samples()[0].spec;
  const KernelSpec& b = Samples()[1].spec;
  auto ka = GenerateKernel(a, Dialect::kCpp), ka2 = GenerateKernel(a, Dialect::kCpp);
  auto kb = GenerateKernel(b, Dialect::kCpp), kc = GenerateKernel(a, Dialect::kOpenCL);
  ASSERT_TRUE(ka.ok() && ka2.ok() && kb.ok() && kc.ok());
  EXPECT_EQ(ka->key, ka2->key);
  EXPECT_EQ(ka->entry, ka2->entry);
  EXPECT_NE(ka->key, kb->key);
  EXPECT_NE(ka->key, kc->key);  // the dialect is part of the key
  EXPECT_EQ(ka->key.size(), 64u);
}

TEST(CodegenTest, InvalidSpecsAreRefused) {
  KernelSpec s;
  s.name = "bad";
  s.rank = 1;
  s.out_rank = 1;
  s.out_dtype = DType::kF32;
  s.args = {{DType::kF32, ArgRole::kFull, 1}};
  s.value = Expr::Input(1);  // no such arg
  EXPECT_FALSE(GenerateKernel(s, Dialect::kCpp).ok());
  s.value = Expr::Input(0, DType::kF64);  // wrong leaf type for an f32 arg
  EXPECT_FALSE(GenerateKernel(s, Dialect::kCpp).ok());
  s.value = Expr::Input(0) + Expr::Acc(0);  // reduction leaf in a pointwise kernel
  EXPECT_FALSE(GenerateKernel(s, Dialect::kCpp).ok());
  s.args[0].dtype = DType::kQ4_0;
  s.value = Expr::Input(0);
  EXPECT_EQ(GenerateKernel(s, Dialect::kCpp).status().code(), StatusCode::kUnimplemented);
}

TEST(CodegenTest, DeviceLaunchPacksTheLayout) {
  KernelSpec s;
  s.name = "add";
  s.kind = KernelKind::kPointwise;
  s.rank = s.out_rank = 2;
  s.out_dtype = DType::kF32;
  s.args = {{DType::kF32, ArgRole::kFull, 2}, {DType::kF32, ArgRole::kFull, 2}};
  s.value = Expr::Input(0) + Expr::Input(1);
  TensorArg in[2];
  LaunchArgs a;
  a.inputs = in;
  a.num_inputs = 2;
  a.output.rank = 2;
  a.output.shape[0] = 3, a.output.shape[1] = 5;
  a.output.strides[0] = 5, a.output.strides[1] = 1;
  in[0] = a.output;
  in[1] = a.output;
  in[1].strides[0] = 0;  // broadcast rows
  const int64_t offs[] = {7, 8, 9};
  const DeviceLaunch launch(s);
  ASSERT_EQ(launch.meta_size(), 12);
  std::vector<int64_t> m(12, -1);
  launch.PackMeta(a, offs, m);
  // shape; out offset, strides; arg 0; arg 1; dense (no: arg 1 broadcasts).
  EXPECT_EQ(m, (std::vector<int64_t>{3, 5, 7, 5, 1, 8, 5, 1, 9, 0, 1, 0}));
  in[1] = a.output;
  launch.PackMeta(a, offs, m);
  EXPECT_EQ(m.back(), 1) << "every tensor row-major: the dense path";
  const DeviceGeometry g = launch.Geometry(a);
  EXPECT_EQ(g.local_size, 128);
  EXPECT_EQ(g.global_size, 128);
  const DeviceGeometry g16 = DeviceLaunch(s, CodegenOptions{.work_group_size = 16}).Geometry(a);
  EXPECT_EQ(g16.local_size, 16);
  EXPECT_EQ(g16.global_size, 16);
}

// Device reduce kernels run in a canonical axis order (kept, then reduced): sum(x, 1),
// sum(x, 1, keepdim) and sum(x, 2) of a rank-3 x are one kernel, launched with the shapes and
// strides permuted.
TEST(CodegenTest, DeviceReduceKernelsAreCanonical) {
  KernelSpec s;
  s.name = "sum";
  s.kind = KernelKind::kReduce;
  s.rank = 3;
  s.out_dtype = DType::kF32;
  s.args = {{DType::kF32, ArgRole::kFull, 3}};
  s.stages = {{ReduceKind::kSum, Expr::Input(0)}};
  s.output = Expr::Acc(0);
  s.reduce_axes = {1};
  s.shape_arg = 0;
  KernelSpec kept = s;
  s.out_rank = 2;
  kept.keepdim = true;
  kept.out_rank = 3;
  const StatusOr<GeneratedKernel> a = GenerateKernel(s, Dialect::kOpenCL);
  const StatusOr<GeneratedKernel> b = GenerateKernel(kept, Dialect::kOpenCL);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->entry, b->entry);
  // x [2, 5, 4] dense; out [2, 4] or [2, 1, 4] dense: strides per kept axis (0 and 2).
  TensorArg x;
  x.rank = 3;
  x.shape[0] = 2, x.shape[1] = 5, x.shape[2] = 4;
  x.strides[0] = 20, x.strides[1] = 4, x.strides[2] = 1;
  LaunchArgs args;
  args.inputs = &x;
  args.num_inputs = 1;
  args.output.rank = 2;
  args.output.shape[0] = 2, args.output.shape[1] = 4;
  args.output.strides[0] = 4, args.output.strides[1] = 1;
  std::vector<int64_t> ma(DeviceLaunch(s).meta_size()), mb(DeviceLaunch(kept).meta_size());
  DeviceLaunch(s).PackMeta(args, {}, ma);
  args.output.rank = 3;
  args.output.shape[1] = 1, args.output.shape[2] = 4;
  args.output.strides[0] = 4, args.output.strides[1] = 4, args.output.strides[2] = 1;
  DeviceLaunch(kept).PackMeta(args, {}, mb);
  EXPECT_EQ(ma, mb);
  // Canonical shape [2, 4 | 5]; out strides of the kept axes; x strides permuted alike.
  EXPECT_EQ(ma, (std::vector<int64_t>{2, 4, 5, 0, 4, 1, 0, 20, 1, 4}));
  KernelSpec last = s;
  last.reduce_axes = {2};
  const StatusOr<GeneratedKernel> c = GenerateKernel(last, Dialect::kOpenCL);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(a->entry, c->entry);
  // The C++ kernels keep the spec's own axes.
  EXPECT_NE(GenerateKernel(s, Dialect::kCpp)->entry, GenerateKernel(last, Dialect::kCpp)->entry);
}

TEST(CodegenTest, ExpressionFunctionsPrintInEveryDialect) {
  ExprFunction f;
  f.name = "kiln_test_mask";
  // A prefix-LM style mask: kv <= q, or kv inside the prefix read from aux 0.
  f.value = Or(Le(Expr::Index(1), Expr::Index(0)),
               Lt(Expr::Index(1), Expr::Load(0, Expr::Index(2), DType::kI64)));
  f.num_indices = 3;
  f.aux = {DType::kI32};
  for (Dialect d : {Dialect::kCpp, Dialect::kOpenCL, Dialect::kCuda, Dialect::kHip}) {
    StatusOr<std::string> code = GenerateExprFunction(f, d);
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_NE(code->find("KFN bool kiln_test_mask(ki64 idx0, ki64 idx1, ki64 idx2, GLOBAL const "
                         "ku8* x0, ki64 xn0, ki64 xs0)"),
              std::string::npos)
        << *code;
    EXPECT_NE(code->find("(GLOBAL const ki32*)x0"), std::string::npos) << *code;
  }
  ExprFunction bad = f;
  bad.num_indices = 1;  // reads Index(1) and Index(2)
  EXPECT_EQ(GenerateExprFunction(bad, Dialect::kOpenCL).status().code(),
            StatusCode::kInvalidArgument);
  bad = f;
  bad.value = Expr::Acc(0);
  EXPECT_FALSE(GenerateExprFunction(bad, Dialect::kOpenCL).ok());
}

// Kernels without f64 tensors print no double arithmetic: devices without cl_khr_fp64 (the
// xpu backend's) run them. Checked on the text: the sample set's non-f64 kernels, as OpenCL.
TEST(CodegenTest, KernelsWithoutF64UseNoDouble) {
  int checked = 0;
  for (const testing::Sample& s : Samples()) {
    if (UsesF64(s.spec) || s.spec.kind == KernelKind::kGemmEpilogue) continue;
    StatusOr<GeneratedKernel> k = GenerateKernel(s.spec, Dialect::kOpenCL);
    ASSERT_TRUE(k.ok()) << s.label;
    for (const char* dbl : {"double", "ksat(", "kd2mini(", "kmaxd(", "kmind(", "KINF)", "KNAN "}) {
      EXPECT_EQ(k->code.find(dbl), std::string::npos) << s.label << " uses " << dbl << ":\n"
                                                      << k->code;
    }
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

// All samples in one C++ module must compile with the system compiler (the CPU JIT's tests
// run them; this catches printer errors early and cheaply).
TEST(CodegenTest, CppModuleCompiles) {
  if (std::system("c++ --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "no c++ compiler";
  std::vector<GeneratedKernel> ks;
  for (const testing::Sample& s : Samples()) ks.push_back(*GenerateKernel(s.spec, Dialect::kCpp));
  const std::string path =
      ::testing::TempDir() + "/kiln_codegen_test_" + std::to_string(getpid()) + ".cc";
  std::ofstream(path) << ModuleSource(Dialect::kCpp, ks);
  const std::string cmd = "c++ -std=c++17 -fsyntax-only -Wall -Werror -Wno-unknown-pragmas " + path;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

}  // namespace
}  // namespace kiln::compiler
