// The xpu backend as a target of the engine's compiler: its generated kernels come from the
// engine's printer (OpenCL dialect) for every expression form, including on devices without
// f64; fused programs (compiler::Compile) match the reference; program binaries go through
// compiler::DiskCache (a second start builds nothing, a corrupt entry is rebuilt).
//
// The numerics of every form on the device are the op harness' (xpu_harness_test runs every
// forward case on xpu against ref). Without an OpenCL device the tests skip (saying so).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "backends/builtin.h"
#include "backends/xpu/xpu_device.h"
#include "engine/compiler/testing/llama_run.h"
#include "engine/program.h"
#include "engine/testing/op_harness.h"

namespace kiln::xpu {
namespace {

namespace fs = std::filesystem;

// A fresh xpu backend (its own devices, programs and cache object), or null with `why`.
std::unique_ptr<XpuBackend> MakeXpu(const XpuOptions& options, std::string* why) {
  StatusOr<std::unique_ptr<XpuBackend>> b = CreateXpuBackend(options);
  if (!b.ok()) {
    *why = std::string(StatusMessage(b.status()));
    return nullptr;
  }
  return *std::move(b);
}

#define XPU_OR_SKIP(var, options)                                 \
  std::string why_##var;                                          \
  std::unique_ptr<XpuBackend> var = MakeXpu(options, &why_##var); \
  if (var == nullptr) GTEST_SKIP() << "no OpenCL device: " << why_##var

// The kernel requests of a forward case's computing nodes.
struct CaseNodes {
  Graph graph;
  std::vector<std::vector<TensorType>> types;
  std::vector<int32_t> ids;
};
StatusOr<CaseNodes> NodesOf(const harness::OpCase& c) {
  CaseNodes r;
  Builder b(&r.graph);
  std::vector<Value> in;
  for (const harness::InputSpec& s : c.inputs) {
    const SymShape shape(s.shape.begin(), s.shape.end());
    in.push_back(s.source == OpKind::kState    ? b.State(s.name, s.dtype, shape)
                 : s.source == OpKind::kWeight ? b.Weight(s.name, s.dtype, shape)
                                               : b.Input(s.name, s.dtype, shape));
  }
  c.build(b, in);
  KILN_RETURN_IF_ERROR(b.status());
  for (int32_t id = 0; id < r.graph.size(); ++id) {
    const Node& n = r.graph.node(id);
    const OpClass cls = GetOpDef(n.op).cls;
    if (cls == OpClass::kSource || cls == OpClass::kView) continue;
    std::vector<TensorType> t;
    for (int32_t i : n.inputs) t.push_back({r.graph.node(i).dtype, r.graph.node(i).shape});
    r.types.push_back(std::move(t));
    r.ids.push_back(id);
  }
  return r;
}

// Every op with an expression form runs a kernel of the engine's printer on xpu (the op
// harness checks their numerics): only casts from quantized blocks take the library's copy.
TEST(XpuCodegenTest, EveryFormRunsTheEnginesOpenClKernels) {
  XPU_OR_SKIP(xpu, XpuOptions{});
  auto* dev = static_cast<XpuDevice*>(xpu->device(0));
  std::set<std::string> generated;
  for (const harness::OpCase& c : harness::ForwardCases(false)) {
    StatusOr<CaseNodes> nodes = NodesOf(c);
    ASSERT_TRUE(nodes.ok()) << c.name << ": " << nodes.status();
    for (size_t k = 0; k < nodes->ids.size(); ++k) {
      const Node& n = nodes->graph.node(nodes->ids[k]);
      const OpDef& def = GetOpDef(n.op);
      if (def.pointwise == nullptr && def.reduce == nullptr) continue;
      const backend::KernelRequest req{n.op, &n.attrs, nodes->types[k], {n.dtype, n.shape}, n.name};
      StatusOr<backend::Kernel> kernel = dev->GetKernel(req);
      ASSERT_TRUE(kernel.ok()) << c.name << ": " << kernel.status();
      if (n.op == OpKind::kCast && IsQuantized(nodes->types[k][0].dtype)) {
        EXPECT_EQ(kernel->name, "xpu.lib.copy_strided") << c.name;
        continue;
      }
      EXPECT_EQ(kernel->name, StrCat("xpu.gen.", def.name)) << c.name;
      generated.insert(def.name);
    }
  }
  for (int i = 0; i < static_cast<int>(OpKind::kNumOps); ++i) {
    const OpDef& def = GetOpDef(static_cast<OpKind>(i));
    if (def.pointwise == nullptr && def.reduce == nullptr) continue;
    EXPECT_TRUE(generated.count(def.name))
        << "no forward case runs " << def.name << "'s generated kernel on xpu";
  }
  // Everything declared builds as one OpenCL program with the engine's preamble.
  const Status built = dev->BuildPending();
  EXPECT_TRUE(built.ok()) << built;
}

// A device without f64 (as most Intel GPUs) prints no double: conversions that would go
// through it (float -> integer saturation, narrow-float stores, i64 -> float) take the
// float-only forms, checked on the device against ref.
TEST(XpuCodegenTest, DevicesWithoutF64RunTheFloatOnlyForms) {
  XpuOptions no_f64;
  no_f64.disable_fp64 = true;
  XPU_OR_SKIP(xpu, no_f64);
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  backend::Device& dev = *xpu->device(0);
  const std::set<std::string> ops = {"cast", "mean", "iota", "argmax", "sum", "softmax"};
  int passed = 0, unsupported = 0;
  for (const harness::OpCase& c : harness::ForwardCases(false)) {
    if (!ops.count(c.op)) continue;
    const harness::Result r = harness::RunForward(c, *ref->device(0), dev);
    if (r.outcome == harness::Result::Outcome::kUnsupported) {
      EXPECT_NE(c.name.find("f64"), std::string::npos) << c.name << ": " << r.message;
      ++unsupported;
      continue;
    }
    EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << c.name << ": " << r.message;
    ++passed;
  }
  EXPECT_GT(passed, 30);
  EXPECT_GT(unsupported, 0) << "f64 cases must be refused, not run";
}

// compiler::Compile fuses on xpu (pointwise chains, norms with their prologue and epilogue) and
// the fused program computes what the reference computes, at prefill and at decode.
TEST(XpuCompileTest, FusedLlamaMatchesTheReference) {
  XPU_OR_SKIP(xpu, XpuOptions{});
  std::unique_ptr<backend::Backend> ref = backend::MakeRefBackend();
  compiler::testing::LlamaConfig cfg;
  for (const auto& [seqs, new_tokens, context] :
       std::vector<std::tuple<int, int, int>>{{2, 5, 0}, {3, 1, 7}}) {
    SCOPED_TRACE(StrCat(seqs, " seqs x ", new_tokens, " tokens after ", context));
    const compiler::testing::LlamaRun step{
        .seqs = seqs, .new_tokens = new_tokens, .context = context};
    compiler::testing::LlamaRun plain = step;
    plain.compiler = false;
    auto want = compiler::testing::RunLlama(cfg, *ref->device(0), plain);
    ASSERT_TRUE(want.ok()) << want.status();
    compiler::CompileReport rep;
    compiler::testing::LlamaRun fused = step;
    fused.report = &rep;
    auto got = compiler::testing::RunLlama(cfg, *xpu->device(0), fused);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_GT(rep.fused_groups, 0) << rep.ToString();
    EXPECT_FALSE(rep.unfused_fallback) << rep.ToString();
    EXPECT_LT(rep.launches, rep.nodes) << rep.ToString();
    EXPECT_LE(compiler::testing::Nmse(*got, *want), 1e-9);
  }
}

// ---- The program-binary cache (compiler::DiskCache)
// ----------------------------------------------

class XpuCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           StrCat("kiln_xpu_cache_", getpid(), "_",
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // PoCL caches compiled code itself, so the backend stores binaries there only when told to.
  XpuOptions Options() const {
    XpuOptions o;
    o.cache_dir = dir_.string();
    o.force_binary_cache = true;
    return o;
  }

  // One "start": a fresh backend compiles and runs y = iota * 3 - 1 (pointwise kernels, no
  // barriers: quick to turn into binaries); returns the device's stats.
  StatusOr<XpuDevice::Stats> Start() {
    std::string why;
    std::unique_ptr<XpuBackend> xpu = MakeXpu(Options(), &why);
    if (xpu == nullptr) return Unavailable(why);
    auto* dev = static_cast<XpuDevice*>(xpu->device(0));
    Graph g;
    Builder b(&g);
    const Value x = b.Iota(DType::kF32, {5}, 0);
    const Value y = b.Sub(b.Mul(x, b.Full(3.0, DType::kF32, {5})), b.Full(1.0, DType::kF32, {5}));
    KILN_RETURN_IF_ERROR(b.status());
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<Program> p, kiln::Compile(g, {y}, *dev));
    KILN_ASSIGN_OR_RETURN(auto stream, dev->CreateStream());
    KILN_RETURN_IF_ERROR(p->Run(*stream));
    KILN_ASSIGN_OR_RETURN(Tensor out, p->Output(0));
    std::vector<float> v(5);
    KILN_RETURN_IF_ERROR(
        stream->CopyToHost(v.data(), *out.buffer(), DTypeBytes(DType::kF32, out.offset()), 20));
    if (v != std::vector<float>{-1, 2, 5, 8, 11}) return Internal("wrong result");
    return dev->stats();
  }

  // The cache's program entries (not sidecars or lock files).
  std::vector<fs::path> Entries() const {
    std::vector<fs::path> out;
    if (!fs::exists(dir_)) return out;
    for (const auto& e : fs::recursive_directory_iterator(dir_)) {
      const std::string rel = fs::relative(e.path(), dir_).string();
      if (e.is_regular_file() && rel.rfind("opencl-", 0) == 0 && !e.path().has_extension()) {
        out.push_back(e.path());
      }
    }
    return out;
  }

  fs::path dir_;
};

TEST_F(XpuCacheTest, SecondStartBuildsNothing) {
  StatusOr<XpuDevice::Stats> first = Start();
  if (absl::IsUnavailable(first.status())) GTEST_SKIP() << "no OpenCL device: " << first.status();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_GE(first->programs_built_from_source, 1);
  EXPECT_EQ(first->programs_loaded_from_cache, 0);
  ASSERT_FALSE(Entries().empty()) << "no binary in the kernel cache";
  StatusOr<XpuDevice::Stats> second = Start();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->programs_built_from_source, 0);
  EXPECT_EQ(second->programs_loaded_from_cache, first->programs_built_from_source);
  EXPECT_EQ(second->corrupt_cache_entries, 0);
}

TEST_F(XpuCacheTest, CorruptEntryIsDetectedAndRebuilt) {
  StatusOr<XpuDevice::Stats> first = Start();
  if (absl::IsUnavailable(first.status())) GTEST_SKIP() << "no OpenCL device: " << first.status();
  ASSERT_TRUE(first.ok()) << first.status();
  const std::vector<fs::path> entries = Entries();
  ASSERT_EQ(entries.size(), 1u);
  {
    // Flip one byte in the middle of the binary (bit rot, a torn copy).
    std::fstream f(entries[0], std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(fs::file_size(entries[0]));
    f.seekg(size / 2);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(size / 2);
    f.write(&c, 1);
  }
  StatusOr<XpuDevice::Stats> second = Start();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->corrupt_cache_entries, 1);
  EXPECT_EQ(second->programs_loaded_from_cache, 0);
  EXPECT_EQ(second->programs_built_from_source, first->programs_built_from_source);
  // Rebuilt and stored again: the next start loads it.
  StatusOr<XpuDevice::Stats> third = Start();
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->programs_built_from_source, 0);
  EXPECT_EQ(third->corrupt_cache_entries, 0);
}

}  // namespace
}  // namespace kiln::xpu
