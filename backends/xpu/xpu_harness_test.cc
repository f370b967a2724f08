// The op harness (backends/harness) on the xpu backend: every forward case and every gradient
// case must pass on the OpenCL device against `ref` — unsupported counts as a failure, as for
// the built-in cpu backend. Kernels of all cases are declared first and built as one batch
// (building OpenCL programs dominates the run time on PoCL).
//
// Without an OpenCL device the tests skip (saying so). KILN_XPU_HARNESS_OP=<op> limits the run
// to one op (debugging).
#include <gtest/gtest.h>

#include <bit>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/builtin.h"
#include "backends/common/device_kernels.h"
#include "backends/xpu/xpu_device.h"
#include "engine/builder.h"
#include "engine/program.h"
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

// Builds `prog`'s pending kernels on `dev`, binds each of `inputs` (32-bit elements: value(name,
// dtype, i)), runs it and returns what its attention launches' block tables classified and
// visited (devk::LastBlockTableStats), in launch order.
StatusOr<std::vector<devk::BlockTableStats>> RunAndReadBlockTables(
    XpuDevice& dev, Program& prog, std::span<const std::string> inputs,
    const std::function<int32_t(const std::string&, DType, size_t)>& value) {
  KILN_RETURN_IF_ERROR(dev.BuildPending());
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Stream> stream, dev.CreateStream());
  std::vector<Tensor> bound;
  for (const std::string& name : inputs) {
    const ExternalInfo& e = prog.externals()[prog.FindExternal(name)];
    std::vector<int64_t> shape;
    for (const Dim& dim : e.shape) shape.push_back(*dim.TryConstant());
    KILN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(dev, e.dtype, shape));
    std::vector<int32_t> host(static_cast<size_t>(t.nbytes() / 4));
    for (size_t i = 0; i < host.size(); ++i) host[i] = value(name, e.dtype, i);
    KILN_RETURN_IF_ERROR(stream->CopyToDevice(*t.buffer(), 0, host.data(), t.nbytes()));
    KILN_RETURN_IF_ERROR(prog.Bind(name, t));
    bound.push_back(std::move(t));
  }
  KILN_RETURN_IF_ERROR(prog.Run(*stream));
  KILN_RETURN_IF_ERROR(stream->Synchronize());
  std::vector<devk::BlockTableStats> tables;
  for (const Launch& l : prog.launches()) {
    StatusOr<devk::BlockTableStats> st = devk::LastBlockTableStats(dev, l);
    if (st.ok()) tables.push_back(*st);
  }
  return tables;
}

// A mask with 90% empty blocks: ten documents of one tile each. The block table (attention.cl)
// marks the 90 off-diagonal tiles empty, and the forward, dq and dk/dv loops walk the diagonal
// blocks only: visited blocks are counted per work-group row. The harness checks the values
// of these masks; this checks that the empty blocks get no work.
TEST(XpuBlockTable, EmptyBlocksAreNeverVisited) {
  Devices& d = Get();
  if (!d.xpu) GTEST_SKIP() << "no OpenCL device: " << d.why_none;
  auto* dev = static_cast<XpuDevice*>(d.xpu->device(0));
  const int64_t wg = static_cast<int64_t>(dev->work_group()), kT = 10 * wg, kHq = 2, kD = 16;
  const Expr same_doc =
      Eq(Expr::Load(0, attn::QIdx(), DType::kI64), Expr::Load(0, attn::KvIdx(), DType::kI64));
  struct Case {
    const char* name;
    Expr mask;
    int64_t full, partial;  // diagonal tiles
  };
  for (const Case& c : {Case{"documents (causal within each)", attn::DocumentMask(0, kT), 0, 10},
                        Case{"same document (bidirectional)", same_doc, 10, 0}}) {
    SCOPED_TRACE(c.name);
    Graph g;
    Builder b(&g);
    const Value q = b.Input("q", DType::kF32, {1, kHq, kT, kD});
    const Value k = b.Input("k", DType::kF32, {1, 1, kT, kD});
    const Value v = b.Input("v", DType::kF32, {1, 1, kT, kD});
    const Value docs = b.Input("docs", DType::kI32, {kT});
    const Value aux[] = {docs};
    const AttentionParams p{0, c.mask, {}};
    const AttentionOutputs fwd = b.AttentionWithLse(q, k, v, p, aux);
    const AttentionGrads grads = b.AttentionBackward(q, k, v, fwd.out, fwd.out, fwd.lse, p, aux);
    auto prog = Compile(g, {fwd.out, grads.dq, grads.dk, grads.dv}, *dev);
    ASSERT_TRUE(prog.ok()) << prog.status();
    const std::string inputs[] = {"q", "k", "v", "docs"};
    const StatusOr<std::vector<devk::BlockTableStats>> read =
        RunAndReadBlockTables(*dev, **prog, inputs, [&](const std::string&, DType t, size_t i) {
          return t == DType::kI32 ? static_cast<int32_t>(static_cast<int64_t>(i) / wg)
                                  : std::bit_cast<int32_t>(0.01f * (i % 97));
        });
    ASSERT_TRUE(read.ok()) << read.status();
    const std::vector<devk::BlockTableStats>& tables = *read;
    ASSERT_EQ(tables.size(), 2u) << (*prog)->DebugString();  // the forward, then the backward
    for (const devk::BlockTableStats& t : tables) {
      EXPECT_EQ(t.empty, 90);
      EXPECT_EQ(t.full, c.full);
      EXPECT_EQ(t.partial, c.partial);
    }
    // Forward: each of Hq * T query rows walks its diagonal block. Backward: as many dq rows,
    // then T dk/dv rows, each walking one query block per query head.
    EXPECT_EQ(tables[0].visited, static_cast<uint64_t>(kHq * kT));
    EXPECT_EQ(tables[1].visited, static_cast<uint64_t>(kHq * kT + kT * kHq));
  }
}

// Paged attention (FlexDecoding) through block tables: a 10-tile prefill of one sequence and
// a decode row of another (its 5 newest keys in the tile after), in pages of 16 keys placed
// out of order. Tiles are query tokens x key positions; the mask is checked against `ref`
// and the table's classes and visits against what it hides.
TEST(XpuBlockTable, PagedEmptyBlocksAreNeverVisited) {
  Devices& d = Get();
  if (!d.xpu) GTEST_SKIP() << "no OpenCL device: " << d.why_none;
  auto* dev = static_cast<XpuDevice*>(d.xpu->device(0));
  const int64_t wg = static_cast<int64_t>(dev->work_group()), kBs = 16, kHq = 2, kD = 16;
  const int64_t len0 = 10 * wg, len1 = 10 * wg + 5, kT = len0 + 1;
  const int64_t mb = (len1 + kBs - 1) / kBs, nb = len0 / kBs + mb;
  std::vector<double> table(static_cast<size_t>(2 * mb), -1);  // seq 0 has a slot spare
  for (int64_t i = 0; i < len0 / kBs; ++i) table[static_cast<size_t>(i)] = len0 / kBs - 1 - i;
  for (int64_t i = 0; i < mb; ++i) table[static_cast<size_t>(mb + i)] = len0 / kBs + i;
  using harness::Init;
  harness::OpCase c;
  c.op = "paged_attention";
  c.inputs = {{.name = "q", .shape = {kT, kHq, kD}, .values = {}},
              {.name = "k_cache", .shape = {nb, kBs, 1, kD}, .values = {}},
              {.name = "v_cache", .shape = {nb, kBs, 1, kD}, .values = {}},
              {.name = "block_table",
               .dtype = DType::kI32,
               .shape = {2, mb},
               .init = Init::kCustom,
               .values = table},
              {.name = "seq_lens",
               .dtype = DType::kI32,
               .shape = {2},
               .init = Init::kCustom,
               .values = {static_cast<double>(len0), static_cast<double>(len1)}},
              {.name = "query_start",
               .dtype = DType::kI32,
               .shape = {3},
               .init = Init::kCustom,
               .values = {0, static_cast<double>(len0), static_cast<double>(kT)}}};
  // 11 token tiles x 11 key blocks (the table spans the mb * 16 keys a row addresses). Chunks
  // of one tile (Llama 4's local layers): each prefill tile keeps its diagonal block (causal
  // inside: partial), the decode row keeps the 5 keys of its chunk (full); 110 empty.
  // Per head (head 0 causal, head 1 chunked): head 0's prefill tiles find the blocks below the
  // diagonal full (45), the diagonal partial (10) and 55 empty; the decode row's tile keeps
  // all 11.
  const Expr per_head = Or(And(Eq(attn::Head(), Expr::Int(0)), attn::CausalMask()),
                           And(Ne(attn::Head(), Expr::Int(0)), attn::ChunkedMask(wg)));
  struct Case {
    const char* name;
    Expr mask;
    int64_t empty, full, partial;
    uint64_t visited;
  };
  const Case cases[] = {
      {"chunked", attn::ChunkedMask(wg), 110, 1, 10, static_cast<uint64_t>(kHq * kT)},
      {"head 0 causal, head 1 chunked", per_head, 165, 57, 20,
       static_cast<uint64_t>(55 * wg + 11 + kT)}};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    c.name = absl::StrCat("paged_attention ", k.name, " (block table)");
    c.build = [mask = k.mask](Builder& b, const std::vector<Value>& x) {
      return b.PagedAttention(x[0], x[1], x[2], x[3], x[4], x[5], {0, mask, {}});
    };
    const harness::Result r = harness::RunForward(c, *d.ref->device(0), *dev);
    EXPECT_EQ(r.outcome, harness::Result::Outcome::kPass) << r.message;

    auto prog = harness::CompileCase(c, /*gradient=*/false, *dev);
    ASSERT_TRUE(prog.ok()) << prog.status();
    std::vector<std::string> inputs;
    for (const harness::InputSpec& in : c.inputs) inputs.push_back(in.name);
    const StatusOr<std::vector<devk::BlockTableStats>> read =
        RunAndReadBlockTables(*dev, **prog, inputs, [&](const std::string& name, DType, size_t i) {
          for (const harness::InputSpec& in : c.inputs) {
            if (in.name == name && in.init == Init::kCustom) {
              return static_cast<int32_t>(in.values[i]);
            }
          }
          return std::bit_cast<int32_t>(0.01f * (i % 97));
        });
    ASSERT_TRUE(read.ok()) << read.status();
    const std::vector<devk::BlockTableStats>& tables = *read;
    ASSERT_EQ(tables.size(), 1u) << (*prog)->DebugString();
    EXPECT_EQ(tables[0].empty, k.empty);
    EXPECT_EQ(tables[0].full, k.full);
    EXPECT_EQ(tables[0].partial, k.partial);
    // Each row walks the blocks its head's mask keeps: without the table, every row of the
    // prefill would walk the blocks up to its own (5.5 on average for a tile-sized chunk).
    EXPECT_EQ(tables[0].visited, k.visited);
  }
}

}  // namespace
}  // namespace kiln::xpu
