#include "engine/program.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "engine/builder.h"
#include "engine/capture.h"
#include "engine/testing/devices.h"

namespace kiln {
namespace {

using ::testing::HasSubstr;

// A device that forwards to another but has no kernel for exp (compile errors name the node).
class NoExpDevice final : public backend::Device {
 public:
  explicit NoExpDevice(backend::Device& inner) : inner_(inner) {}
  std::string_view name() const override { return "noexp:0"; }
  bool host_visible() const override { return inner_.host_visible(); }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t bytes) override {
    return inner_.Allocate(bytes);
  }
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
    return inner_.CreateStream();
  }
  bool SupportsDType(DType t) const override { return inner_.SupportsDType(t); }
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& r) override {
    if (r.op == OpKind::kExp) return Unimplemented("no exp kernel here");
    return inner_.GetKernel(r);
  }

 private:
  backend::Device& inner_;
};

class ProgramTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    backend_ = kiln::MakeTestBackend(GetParam(), 2);
    dev_ = backend_->device(0);
    stream_ = *dev_->CreateStream();
  }
  Tensor Make(DType t, std::vector<int64_t> shape, std::vector<double> v) {
    auto r = Tensor::FromDoubles(*dev_, t, std::move(shape), v);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  }
  std::vector<double> Out(Program& p, int i) {
    auto t = p.Output(i);
    EXPECT_TRUE(t.ok()) << t.status();
    return *t->ToDoubles();
  }
  std::unique_ptr<backend::Backend> backend_;
  backend::Device* dev_ = nullptr;
  std::unique_ptr<backend::Stream> stream_;
};

TEST_P(ProgramTest, OneProgramServesEverySymbolValue) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 64);
  const Value x = b.Input("x", DType::kF32, {T, 4});
  const Value bias = b.Weight("bias", DType::kF32, {4});
  const Value y = b.Named(b.Add(b.Silu(x), bias), "y");
  const Value last = b.Slice(y, 0, T - 1, 1);  // the last token's row: a symbolic offset
  auto p = Compile(g, {y, last}, *dev_);
  ASSERT_TRUE(p.ok()) << p.status();
  Program& prog = **p;
  ASSERT_TRUE(prog.Bind("bias", Make(DType::kF32, {4}, {1, 2, 3, 4})).ok());
  for (int64_t t : {1, 37, 3}) {
    std::vector<double> xv(t * 4);
    for (size_t i = 0; i < xv.size(); ++i) xv[i] = 0.1 * static_cast<double>(i) - 1;
    ASSERT_TRUE(prog.SetSymbol("T", t).ok());
    ASSERT_TRUE(prog.Bind("x", Make(DType::kF32, {t, 4}, xv)).ok());
    ASSERT_TRUE(prog.Run(*stream_).ok());
    const std::vector<double> out = Out(prog, 0);
    ASSERT_EQ(out.size(), xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
      const double want = xv[i] / (1 + std::exp(-xv[i])) + static_cast<double>(1 + i % 4);
      EXPECT_NEAR(out[i], want, 1e-5) << "T=" << t << " i=" << i;
    }
    const std::vector<double> tail = Out(prog, 1);
    ASSERT_EQ(tail.size(), 4u);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(tail[j], out[(t - 1) * 4 + j]);
  }
}

TEST_P(ProgramTest, BindingErrorsSayWhatIsWrong) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 8);
  const Value x = b.Input("x", DType::kF32, {T, 4});
  auto p = Compile(g, {b.Exp(x)}, *dev_);
  ASSERT_TRUE(p.ok());
  Program& prog = **p;
  EXPECT_EQ(prog.Run(*stream_).code(), StatusCode::kFailedPrecondition);  // T not set
  EXPECT_EQ(prog.SetSymbol("T", 9).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(prog.SetSymbol("S", 1).code(), StatusCode::kNotFound);
  ASSERT_TRUE(prog.SetSymbol("T", 2).ok());
  Status unbound = prog.Run(*stream_);
  EXPECT_NE(std::string(StatusMessage(unbound)).find("input 'x' is not bound"), std::string::npos)
      << unbound;
  EXPECT_EQ(prog.Bind("x", Make(DType::kF16, {2, 4}, std::vector<double>(8))).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(prog.Bind("x", Make(DType::kF32, {3, 4}, std::vector<double>(12))).ok());
  Status shape = prog.Run(*stream_);
  EXPECT_NE(std::string(StatusMessage(shape)).find("needs [2,4] ([T,4])"), std::string::npos)
      << shape;
}

TEST_P(ProgramTest, PlannerReusesMemoryAndWorksInPlace) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 16);
  Value h = b.Input("x", DType::kF32, {T, 256});
  for (int i = 0; i < 8; ++i) h = b.Tanh(b.MulScalar(h, 0.9));
  auto p = Compile(g, {h}, *dev_);
  ASSERT_TRUE(p.ok()) << p.status();
  // 16 full-size buffers without reuse; a chain needs at most two at a time (plus scalars).
  const size_t full = 16 * 256 * 4;
  EXPECT_GE((*p)->unplanned_bytes(), 8 * full);
  EXPECT_LE((*p)->arena_bytes(), 2 * full + 4096);
  ASSERT_TRUE((*p)->SetSymbol("T", 2).ok());
  std::vector<double> xv(2 * 256, 0.5);
  ASSERT_TRUE((*p)->Bind("x", Make(DType::kF32, {2, 256}, xv)).ok());
  ASSERT_TRUE((*p)->Run(*stream_).ok());
  double want = 0.5;
  for (int i = 0; i < 8; ++i) want = std::tanh(want * 0.9);
  for (double v : Out(**p, 0)) EXPECT_NEAR(v, want, 1e-6);
}

TEST_P(ProgramTest, NonViewableReshapeGetsACopy) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {2, 3});
  const Value y = b.Reshape(b.Transpose(x, 0, 1), {6});
  auto p = Compile(g, {y}, *dev_);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NE((*p)->DebugString().find("contiguous"), std::string::npos) << (*p)->DebugString();
  ASSERT_TRUE((*p)->Bind("x", Make(DType::kF32, {2, 3}, {0, 1, 2, 3, 4, 5})).ok());
  ASSERT_TRUE((*p)->Run(*stream_).ok());
  EXPECT_EQ(Out(**p, 0), (std::vector<double>{0, 3, 1, 4, 2, 5}));
}

// A device whose exp kernel writes one element past its output: guards must catch it.
class BuggyDevice final : public backend::Device {
 public:
  explicit BuggyDevice(backend::Device* inner) : inner_(inner) {}
  std::string_view name() const override { return "buggy:0"; }
  bool host_visible() const override { return true; }
  StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t n) override {
    return inner_->Allocate(n);
  }
  StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
    return inner_->CreateStream();
  }
  bool SupportsDType(DType t) const override { return inner_->SupportsDType(t); }
  StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& r) override {
    if (r.op != OpKind::kExp) return inner_->GetKernel(r);
    return backend::Kernel{[](const LaunchArgs& a, const ExecCtx&) {
                             float* out = static_cast<float*>(a.output.data);
                             for (int64_t i = 0; i <= a.output.numel(); ++i)
                               out[i] = 1.0f;  // off by one
                           },
                           nullptr, "buggy.exp"};
  }

 private:
  backend::Device* inner_;
};

TEST_P(ProgramTest, BindRefusesTensorsOfAnotherDevice) {
  auto other = kiln::MakeTestBackend("ref");
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {2});
  auto p = Compile(g, {b.Exp(x)}, *dev_);
  ASSERT_TRUE(p.ok());
  auto xt = Tensor::FromDoubles(*other->device(0), DType::kF32, {2}, std::vector<double>{1, 2});
  const Status s = (*p)->Bind("x", *xt);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(StatusMessage(s)).find("but the program runs on"), std::string::npos) << s;
}

TEST_P(ProgramTest, GuardsReportTheNode) {
  // Allocate through a device wrapper so identities match, then run the buggy kernel.
  struct OwnBuffer final : backend::Buffer {
    OwnBuffer(backend::Device* d, size_t n)
        : Buffer(d, std::aligned_alloc(64, (n + 63) / 64 * 64 + 64), n) {}
    ~OwnBuffer() override { std::free(data()); }
  };
  // Allocates through itself so the arena and the input belong to this device.
  struct Wrapper final : backend::Device {
    explicit Wrapper(backend::Device* d) : buggy(d) {}
    BuggyDevice buggy;
    std::string_view name() const override { return "buggy:0"; }
    bool host_visible() const override { return true; }
    StatusOr<std::unique_ptr<backend::Buffer>> Allocate(size_t n) override {
      return std::unique_ptr<backend::Buffer>(new OwnBuffer(this, n));
    }
    StatusOr<std::unique_ptr<backend::Stream>> CreateStream() override {
      return buggy.CreateStream();
    }
    bool SupportsDType(DType t) const override { return buggy.SupportsDType(t); }
    StatusOr<backend::Kernel> GetKernel(const backend::KernelRequest& r) override {
      return buggy.GetKernel(r);
    }
  };
  Wrapper dev(dev_);
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {3, 5});
  const Value y = b.Named(b.Exp(x), "blk.0.exp");
  CompileOptions opts;
  opts.guard_bytes = 64;
  auto p = Compile(g, {b.Neg(y)}, dev, opts);
  ASSERT_TRUE(p.ok()) << p.status();
  auto buf = std::shared_ptr<backend::Buffer>(new OwnBuffer(&dev, 60));
  auto xt = Tensor::FromBuffer(buf, 0, DType::kF32, {3, 5});
  ASSERT_TRUE((*p)->Bind("x", *xt).ok());
  const Status s = (*p)->Run(*stream_);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  EXPECT_NE(std::string(StatusMessage(s)).find("'blk.0.exp'"), std::string::npos) << s;
  EXPECT_NE(std::string(StatusMessage(s)).find("outside its output buffer"), std::string::npos)
      << s;
}

TEST_P(ProgramTest, KvWriteUpdatesStateInPlaceBeforeAttentionReadsIt) {
  // One sequence, block size 2, 3 blocks; write 3 tokens at slots 2,3,4 and attend causally.
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 8);
  const int64_t H = 1, D = 2;
  const Value q = b.Input("q", DType::kF32, {T, H, D});
  const Value k = b.Input("k", DType::kF32, {T, H, D});
  const Value v = b.Input("v", DType::kF32, {T, H, D});
  const Value slots = b.Input("slots", DType::kI32, {T});
  const Value kc = b.State("k_cache", DType::kF32, {3, 2, H, D});
  const Value vc = b.State("v_cache", DType::kF32, {3, 2, H, D});
  const Value bt = b.Input("block_table", DType::kI32, {1, 3});
  const Value lens = b.Input("seq_lens", DType::kI32, {1});
  const Value qs = b.Input("query_start", DType::kI32, {2});
  const Value kc2 = b.KvWrite(kc, k, slots);
  const Value vc2 = b.KvWrite(vc, v, slots);
  AttentionParams ap;
  ap.mask_mod = attn::CausalMask();
  const Value o = b.PagedAttention(q, kc2, vc2, bt, lens, qs, ap);
  auto p = Compile(g, {o}, *dev_);
  ASSERT_TRUE(p.ok()) << p.status();
  Program& prog = **p;
  Tensor kcache = Make(DType::kF32, {3, 2, 1, 2}, std::vector<double>(12, 0));
  Tensor vcache = Make(DType::kF32, {3, 2, 1, 2}, std::vector<double>(12, 0));
  ASSERT_TRUE(prog.Bind("k_cache", kcache).ok());
  ASSERT_TRUE(prog.Bind("v_cache", vcache).ok());
  ASSERT_TRUE(prog.SetSymbol("T", 3).ok());
  ASSERT_TRUE(prog.Bind("q", Make(DType::kF32, {3, 1, 2}, {1, 0, 0, 1, 1, 1})).ok());
  ASSERT_TRUE(prog.Bind("k", Make(DType::kF32, {3, 1, 2}, {1, 0, 0, 1, 1, 1})).ok());
  ASSERT_TRUE(prog.Bind("v", Make(DType::kF32, {3, 1, 2}, {1, 2, 3, 4, 5, 6})).ok());
  ASSERT_TRUE(prog.Bind("slots", Make(DType::kI32, {3}, {0, 1, 2})).ok());
  ASSERT_TRUE(prog.Bind("block_table", Make(DType::kI32, {1, 3}, {0, 1, 2})).ok());
  ASSERT_TRUE(prog.Bind("seq_lens", Make(DType::kI32, {1}, {3})).ok());
  ASSERT_TRUE(prog.Bind("query_start", Make(DType::kI32, {2}, {0, 3})).ok());
  ASSERT_TRUE(prog.Run(*stream_).ok());
  // Slots are physical (block * 2 + offset); the block table maps logical positions.
  EXPECT_EQ(*kcache.ToDoubles(), (std::vector<double>{1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(*vcache.ToDoubles(), (std::vector<double>{1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0}));
  const std::vector<double> out = Out(prog, 0);
  const double r = 1 / std::sqrt(2.0);
  // Token 0 sees key 0 only; token 1 keys {0, 1}; token 2 all three (causal).
  EXPECT_NEAR(out[0], 1, 1e-6);
  EXPECT_NEAR(out[1], 2, 1e-6);
  const double p1 = std::exp(r) / (1 + std::exp(r));
  EXPECT_NEAR(out[2], (1 - p1) * 1 + p1 * 3, 1e-6);
  EXPECT_NEAR(out[3], (1 - p1) * 2 + p1 * 4, 1e-6);
  const double e1 = std::exp(r), e2 = std::exp(2 * r), z = 2 * e1 + e2;
  EXPECT_NEAR(out[4], (e1 * 1 + e1 * 3 + e2 * 5) / z, 1e-6);
  EXPECT_NEAR(out[5], (e1 * 2 + e1 * 4 + e2 * 6) / z, 1e-6);
}

TEST_P(ProgramTest, CaptureReplayEqualsDirectRun) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 16);
  const Value x = b.Input("x", DType::kF32, {T, 8});
  const Value w = b.Weight("w", DType::kF32, {4, 8});
  const Value y = b.Softmax(b.Linear(b.RmsNorm(x, 1e-6), w));
  auto p = Compile(g, {y}, *dev_);
  ASSERT_TRUE(p.ok()) << p.status();
  Program& prog = **p;
  std::vector<double> wv(32);
  for (int i = 0; i < 32; ++i) wv[i] = std::sin(i);
  ASSERT_TRUE(prog.Bind("w", Make(DType::kF32, {4, 8}, wv)).ok());
  auto inputs = [](int seed) {
    std::vector<double> v(4 * 8);
    for (int i = 0; i < 32; ++i) v[i] = std::cos(i * 0.7 + seed);
    return v;
  };
  // Direct runs for two different inputs.
  ASSERT_TRUE(prog.SetSymbol("T", 4).ok());
  ASSERT_TRUE(prog.Bind("x", Make(DType::kF32, {4, 8}, inputs(1))).ok());
  ASSERT_TRUE(prog.Run(*stream_).ok());
  const std::vector<double> direct1 = Out(prog, 0);
  ASSERT_TRUE(prog.Bind("x", Make(DType::kF32, {4, 8}, inputs(2))).ok());
  ASSERT_TRUE(prog.Run(*stream_).ok());
  const std::vector<double> direct2 = Out(prog, 0);
  ASSERT_NE(direct1, direct2);
  // Capture with a static input buffer, then feed it by copying.
  Tensor static_x = Make(DType::kF32, {4, 8}, std::vector<double>(32, 0));
  ASSERT_TRUE(prog.Bind("x", static_x).ok());
  auto cap = CapturedProgram::Capture(prog, *stream_);
  ASSERT_TRUE(cap.ok()) << cap.status();
  EXPECT_TRUE((*cap)->native());
  // Rebinding the program afterwards (another T) must not disturb the capture.
  ASSERT_TRUE(prog.SetSymbol("T", 2).ok());
  ASSERT_TRUE(prog.Bind("x", Make(DType::kF32, {2, 8}, std::vector<double>(16, 3))).ok());
  ASSERT_TRUE(prog.Run(*stream_).ok());
  for (int seed : {1, 2}) {
    const std::vector<double> v = inputs(seed);
    for (int i = 0; i < 32; ++i) StoreElement(static_x.data(), DType::kF32, i, v[i]);
    ASSERT_TRUE((*cap)->Replay(*stream_).ok());
    // The captured program writes the arena; read it through a 4-token view.
    ASSERT_TRUE(prog.SetSymbol("T", 4).ok());
    ASSERT_TRUE(prog.Bind("x", static_x).ok());
    ASSERT_TRUE(prog.Prepare().ok());
    EXPECT_EQ(Out(prog, 0), seed == 1 ? direct1 : direct2) << "seed " << seed;
  }
}

TEST_P(ProgramTest, DumpPrintsNamedPasses) {
  Graph g;
  Builder b(&g);
  const Dim T = b.Symbol("T", 4);
  const Value x = b.Input("x", DType::kF32, {T, 8});
  b.SetNameScope("blk.0");
  const Value y = b.Named(b.RmsNorm(x, 1e-5), "attn_norm");
  std::ostringstream os;
  CompileOptions opts;
  opts.dump.passes = "verify,plan,program";
  opts.dump.out = &os;
  ASSERT_TRUE(Compile(g, {y}, *dev_, opts).ok());
  const std::string s = os.str();
  EXPECT_NE(s.find("=== kiln dump after 'verify' ==="), std::string::npos) << s;
  EXPECT_NE(s.find("%1 blk.0.attn_norm: f32[T,8] = rms_norm(%0) eps=1e-05"), std::string::npos)
      << s;
  EXPECT_NE(s.find("arena:"), std::string::npos) << s;
  EXPECT_NE(s.find("program on"), std::string::npos) << s;
  EXPECT_EQ(s.find("after 'dce'"), std::string::npos) << s;
}

TEST_P(ProgramTest, DumpSwitchFromEnvironment) {
  const std::string file = ::testing::TempDir() + "kiln_dump_" + GetParam() + ".txt";
  std::remove(file.c_str());
  setenv("KILN_DUMP", "lower_views,program", 1);
  setenv("KILN_DUMP_FILE", file.c_str(), 1);
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {2, 3});
  const Value y = b.Named(b.Exp(b.Transpose(x, 0, 1)), "y");
  const bool ok = Compile(g, {y}, *dev_).ok();  // CompileOptions{} reads the environment
  unsetenv("KILN_DUMP");
  unsetenv("KILN_DUMP_FILE");
  ASSERT_TRUE(ok);
  std::ifstream in(file);
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(s.find("after 'lower_views'"), std::string::npos) << s;
  EXPECT_NE(s.find("# view of %0 strides=[1,3]"), std::string::npos) << s;
  EXPECT_NE(s.find("%2 y: exp -> f32[3,2]"), std::string::npos) << s;
  EXPECT_EQ(s.find("after 'verify'"), std::string::npos) << s;
}

TEST_P(ProgramTest, UnsupportedGraphsFailToCompileClearly) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {2});
  const Value bad = b.Exp(b.Input("y", DType::kF32, {3}));
  (void)x;
  b.Named(bad, "e");
  StatusOr<std::unique_ptr<Program>> p = Compile(g, {Value{99}}, *dev_);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("verify: an output is not a valid value"));
  // A builder error is caught by verify: the invalid value of a failed add.
  Graph g2;
  Builder b2(&g2);
  const Value z = b2.Add(b2.Input("a", DType::kF32, {2}), b2.Input("b", DType::kF32, {3}));
  EXPECT_FALSE(b2.status().ok());
  p = Compile(g2, {z}, *dev_);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("verify: an output is not a valid value"));
  // A device without a kernel for a node: the error names the node, its op and types, and
  // the device.
  Graph g3;
  Builder b3(&g3);
  const Value e = b3.Named(b3.Exp(b3.Input("u", DType::kF32, {4})), "blk.0.exp");
  NoExpDevice noexp(*dev_);
  p = Compile(g3, {e}, noexp);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnimplemented) << p.status();
  EXPECT_THAT(std::string(p.status().message()),
              HasSubstr("%1 'blk.0.exp' (exp f32[4]) cannot run on device noexp:0: no exp kernel"));
}

// An extra output (dlogits) is live from its producer's launch to its last reader: buffers
// of the ops in between must not reuse its memory. The planned program equals the guarded one
// (every buffer its own memory).
TEST_P(ProgramTest, ExtraOutputsLiveUntilTheirLastReader) {
  Graph g;
  Builder b(&g);
  const Value x = b.Input("x", DType::kF32, {8, 16});
  const Value t = b.Input("t", DType::kI32, {8});
  const CrossEntropyOutputs ce = b.FusedCrossEntropy(x, t, b.Full(0.5, DType::kF32, {}));
  Value h = x;
  for (int i = 0; i < 4; ++i) h = b.Tanh(b.AddScalar(h, 1.0));  // same-sized buffers in between
  const Value y = b.Add(h, ce.dlogits);  // (y may take h's memory, never dlogits')
  const Value z = b.Mul(ce.loss, ce.loss);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<double> xv(128), tv(8);
  for (int i = 0; i < 128; ++i) xv[i] = std::sin(0.37 * i);
  for (int i = 0; i < 8; ++i) tv[i] = (3 * i) % 16;
  std::vector<std::vector<double>> results;
  for (size_t guard : {size_t{64}, size_t{0}}) {
    CompileOptions o;
    o.guard_bytes = guard;
    auto p = Compile(g, {y, z}, *dev_, o);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE((*p)->Bind("x", Make(DType::kF32, {8, 16}, xv)).ok());
    ASSERT_TRUE((*p)->Bind("t", Make(DType::kI32, {8}, tv)).ok());
    ASSERT_TRUE((*p)->Run(*stream_).ok());
    results.push_back(Out(**p, 0));
    results.push_back(Out(**p, 1));
    if (guard == 0) {
      EXPECT_LT((*p)->arena_bytes(), (*p)->unplanned_bytes()) << "reuse happens elsewhere";
      EXPECT_THAT((*p)->DebugString(), HasSubstr(" +%")) << "extra outputs are listed";
    }
  }
  EXPECT_EQ(results[2], results[0]);
  EXPECT_EQ(results[3], results[1]);
}

// Outputs written in place take no arena space: they are the bound States.
TEST_P(ProgramTest, InPlaceOutputsAreTheStatesAndTakeNoArenaSpace) {
  Graph g;
  Builder b(&g);
  const Value w = b.State("w", DType::kF32, {4});
  const Value m = b.State("m", DType::kF32, {4});
  const Value v = b.State("v", DType::kF32, {4});
  const OptimizerOutputs o = b.OptimizerStep(w, b.Input("g", DType::kF32, {4}), {m, v},
                                             b.Input("hyper", DType::kF32, {3}), Value{}, {});
  ASSERT_TRUE(b.ok()) << b.status();
  auto p = Compile(g, {o.param, o.states[0], o.states[1]}, *dev_);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->arena_bytes(), 0u) << (*p)->DebugString();
  EXPECT_EQ((*p)->num_launches(), 1);
  const Tensor wt = Make(DType::kF32, {4}, {1, 2, 3, 4});
  const Tensor mt = Make(DType::kF32, {4}, {0, 0, 0, 0});
  const Tensor vt = Make(DType::kF32, {4}, {0, 0, 0, 0});
  ASSERT_TRUE((*p)->Bind("w", wt).ok() && (*p)->Bind("m", mt).ok() && (*p)->Bind("v", vt).ok());
  ASSERT_TRUE((*p)->Bind("g", Make(DType::kF32, {4}, {1, -1, 1, -1})).ok());
  ASSERT_TRUE((*p)->Bind("hyper", Make(DType::kF32, {3}, {1, 1e-3, 1})).ok());
  ASSERT_TRUE((*p)->Run(*stream_).ok());
  EXPECT_EQ((*p)->Output(0)->data(), wt.data());
  EXPECT_EQ((*p)->Output(1)->data(), mt.data());
  EXPECT_EQ((*p)->Output(2)->data(), vt.data());
  EXPECT_NE(*wt.ToDoubles(), (std::vector<double>{1, 2, 3, 4})) << "w was not updated in place";
  EXPECT_NEAR((*mt.ToDoubles())[0], 0.1, 1e-7);  // (1 - beta1) * g
}

INSTANTIATE_TEST_SUITE_P(Backends, ProgramTest, ::testing::Values("ref", "cpu"));

}  // namespace
}  // namespace kiln
