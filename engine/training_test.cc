// The training ops end to end, on every device the build has (ref, cpu, xpu when an OpenCL
// device exists): the fused cross-entropy equals cross-entropy and its autograd gradient;
// AdamW equals PyTorch's update step by step; and a captured training step (forward, fused
// loss/gradient, backward, AdamW updating its States in place) replays exactly like direct
// runs — with the native capture of the stream and with the engine's own recording.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "engine/autograd.h"
#include "engine/builder.h"
#include "engine/capture.h"
#include "engine/program.h"
#include "engine/testing/devices.h"

namespace kiln {
namespace {

// A stream that runs another stream's work but cannot capture: CapturedProgram then records
// the launch list itself.
class NoCaptureStream final : public backend::Stream {
 public:
  explicit NoCaptureStream(std::unique_ptr<backend::Stream> inner) : inner_(std::move(inner)) {}
  backend::Device& device() override { return inner_->device(); }
  Status Run(std::span<const Launch> launches) override { return inner_->Run(launches); }
  Status CopyToDevice(const backend::Buffer& dst, size_t off, const void* src,
                      size_t bytes) override {
    return inner_->CopyToDevice(dst, off, src, bytes);
  }
  Status CopyToHost(void* dst, const backend::Buffer& src, size_t off, size_t bytes) override {
    return inner_->CopyToHost(dst, src, off, bytes);
  }
  Status CopyOnDevice(const backend::Buffer& dst, size_t dst_off, const backend::Buffer& src,
                      size_t src_off, size_t bytes) override {
    return inner_->CopyOnDevice(dst, dst_off, src, src_off, bytes);
  }
  Status Synchronize() override { return inner_->Synchronize(); }

 private:
  std::unique_ptr<backend::Stream> inner_;
};

class TrainingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    backend_ = MakeTestBackend(GetParam(), 2);
    if (backend_ == nullptr) GTEST_SKIP() << "no " << GetParam() << " device in this build/machine";
    dev_ = backend_->device(0);
    stream_ = *dev_->CreateStream();
  }

  // A dense tensor on the device under test.
  Tensor Upload(DType t, std::vector<int64_t> shape, const std::vector<double>& v) {
    Tensor host = *Tensor::FromDoubles(*host_->device(0), t, shape, v);
    Tensor dev = *Tensor::Empty(*dev_, t, shape);
    EXPECT_TRUE(stream_->CopyToDevice(*dev.buffer(), 0, host.data(), host.nbytes()).ok());
    return dev;
  }
  // Overwrites a dense device tensor (the static inputs of a capture).
  void Write(const Tensor& t, const std::vector<double>& v) {
    Tensor host = *Tensor::FromDoubles(*host_->device(0), t.dtype(), t.shape(), v);
    EXPECT_TRUE(stream_->CopyToDevice(*t.buffer(), 0, host.data(), host.nbytes()).ok());
  }
  // Any device tensor (a view of a buffer), as doubles.
  std::vector<double> Download(const Tensor& t) {
    EXPECT_TRUE(stream_->Synchronize().ok());
    Tensor all =
        *Tensor::Empty(*host_->device(0), DType::kU8, {static_cast<int64_t>(t.buffer()->size())});
    EXPECT_TRUE(stream_->CopyToHost(all.data(), *t.buffer(), 0, t.buffer()->size()).ok());
    return *Tensor::FromParts(all.buffer(), t.dtype(), t.shape(), t.strides(), t.offset())
                ->ToDoubles();
  }
  std::vector<double> Out(const Program& p, int i) { return Download(*p.Output(i)); }

  std::unique_ptr<backend::Backend> host_ = MakeTestBackend("ref");
  std::unique_ptr<backend::Backend> backend_;
  backend::Device* dev_ = nullptr;
  std::unique_ptr<backend::Stream> stream_;
};

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double tol,
                const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::fabs(want[i])))
        << what << "[" << i << "]";
  }
}

TEST_P(TrainingTest, FusedCrossEntropyEqualsCrossEntropyAndItsGradient) {
  Graph g;
  Builder b(&g);
  const Value logits = b.Input("logits", DType::kF32, {5, 7});
  const Value targets = b.Input("targets", DType::kI32, {5});
  const Value dloss = b.Input("dloss", DType::kF32, {});  // d mean / d loss_n, as for a mean
  const CrossEntropyOutputs fused = b.FusedCrossEntropy(logits, targets, dloss);
  // The unfused reference: cross_entropy, then autograd of sum(loss * dloss).
  const Value loss = b.CrossEntropy(logits, targets);
  const Value total = b.Sum(b.Mul(loss, b.Expand(dloss, {5})), {0});
  auto grads = Gradients(b, total, std::vector<Value>{logits});
  ASSERT_TRUE(grads.ok()) << grads.status();
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<double> x(35);
  for (int i = 0; i < 35; ++i) x[i] = 3 * std::sin(1.7 * i);
  const std::vector<double> t = {3, -100, 6, 0, 2};  // one ignored row

  // In one kernel: the fused program is one launch.
  auto only = Compile(g, {fused.loss, fused.dlogits}, *dev_);
  ASSERT_TRUE(only.ok()) << only.status();
  EXPECT_EQ((*only)->num_launches(), 1) << (*only)->DebugString();

  auto p = Compile(g, {fused.loss, fused.dlogits, loss, (*grads)[0]}, *dev_);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE((*p)->Bind("logits", Upload(DType::kF32, {5, 7}, x)).ok());
  ASSERT_TRUE((*p)->Bind("targets", Upload(DType::kI32, {5}, t)).ok());
  ASSERT_TRUE((*p)->Bind("dloss", Upload(DType::kF32, {}, {0.25})).ok());
  ASSERT_TRUE((*p)->Run(*stream_).ok());
  const std::vector<double> loss_f = Out(**p, 0), dlogits_f = Out(**p, 1);
  ExpectNear(loss_f, Out(**p, 2), 1e-6, "loss");
  ExpectNear(dlogits_f, Out(**p, 3), 1e-6, "dlogits");
  EXPECT_EQ(loss_f[1], 0);
  for (int j = 0; j < 7; ++j) EXPECT_EQ(dlogits_f[7 + j], 0) << "ignored row, class " << j;
}

// PyTorch's torch.optim.AdamW step (_single_tensor_adamw) for one element, as PyTorch computes
// it: f32 tensor arithmetic, Python floats (double) for the scalars.
void TorchAdamWStep(float& p, float& m, float& v, float g, int step, const AdamWParams& h) {
  p *= static_cast<float>(1 - h.lr * h.weight_decay);                             // param.mul_
  m += (g - m) * static_cast<float>(1 - h.beta1);                                 // exp_avg.lerp_
  v = v * static_cast<float>(h.beta2) + g * g * static_cast<float>(1 - h.beta2);  // addcmul_
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  const double step_size = h.lr / bias_correction1;
  const float denom =
      std::sqrt(v) / static_cast<float>(std::sqrt(bias_correction2)) + static_cast<float>(h.eps);
  p += static_cast<float>(-step_size) * (m / denom);  // param.addcdiv_
}

struct AdamWGraph {
  Graph g;
  AdamWOutputs out;
};
AdamWGraph BuildAdamW(const AdamWParams& h) {
  AdamWGraph r;
  Builder b(&r.g);
  const Value p = b.State("w", DType::kF32, {2, 3});
  const Value m = b.State("w.m", DType::kF32, {2, 3});
  const Value v = b.State("w.v", DType::kF32, {2, 3});
  const Value grad = b.Input("grad", DType::kF32, {2, 3});
  const Value step = b.Input("step", DType::kI32, {});
  r.out = b.AdamW(p, grad, m, v, step, h);
  EXPECT_TRUE(b.ok()) << b.status();
  return r;
}

std::vector<double> GradAt(int step) {
  std::vector<double> g(6);
  for (int i = 0; i < 6; ++i) g[i] = std::sin(1.3 * i + 0.7 * step) * (i % 2 ? 1 : 0.01);
  return g;
}

TEST_P(TrainingTest, AdamWMatchesPyTorchStepByStepDirectAndCaptured) {
  const AdamWParams h{0.01, 0.9, 0.999, 1e-8, 0.1};
  const std::vector<double> p0 = {0.5, -1, 0.25, 2, -0.125, 0};
  for (bool captured : {false, true}) {
    SCOPED_TRACE(captured ? "captured" : "direct");
    AdamWGraph ag = BuildAdamW(h);
    auto prog = Compile(ag.g, {ag.out.param, ag.out.m, ag.out.v}, *dev_);
    ASSERT_TRUE(prog.ok()) << prog.status();
    Program& p = **prog;
    const Tensor w = Upload(DType::kF32, {2, 3}, p0);
    const Tensor m = Upload(DType::kF32, {2, 3}, std::vector<double>(6, 0));
    const Tensor v = Upload(DType::kF32, {2, 3}, std::vector<double>(6, 0));
    const Tensor grad = Upload(DType::kF32, {2, 3}, GradAt(1));
    const Tensor step = Upload(DType::kI32, {}, {1});
    for (const auto& [name, t] :
         {std::pair{"w", w}, {"w.m", m}, {"w.v", v}, {"grad", grad}, {"step", step}}) {
      ASSERT_TRUE(p.Bind(name, t).ok()) << name;
    }
    std::unique_ptr<CapturedProgram> graph;
    if (captured) {
      auto c = CapturedProgram::Capture(p, *stream_);
      ASSERT_TRUE(c.ok()) << c.status();
      graph = *std::move(c);
    }
    std::vector<float> tp(p0.begin(), p0.end()), tm(6, 0), tv(6, 0);
    for (int s = 1; s <= 5; ++s) {
      const std::vector<double> gs = GradAt(s);
      Write(grad, gs);
      Write(step, {static_cast<double>(s)});
      ASSERT_TRUE((captured ? graph->Replay(*stream_) : p.Run(*stream_)).ok());
      const std::vector<double> got = Download(w);
      if (s == 1) {
        // Step 1 by hand: m^ = g, v^ = g^2, so w1 = w0 (1 - lr wd) - lr g / (|g| + eps).
        for (int i = 0; i < 6; ++i) {
          const double want =
              p0[i] * (1 - h.lr * h.weight_decay) - h.lr * gs[i] / (std::fabs(gs[i]) + h.eps);
          EXPECT_NEAR(got[i], want, 1e-6) << "w[" << i << "] after step 1";
        }
      }
      for (int i = 0; i < 6; ++i) {
        TorchAdamWStep(tp[i], tm[i], tv[i], static_cast<float>(gs[i]), s, h);
      }
      ExpectNear(got, std::vector<double>(tp.begin(), tp.end()), 2e-6, "param");
      ExpectNear(Download(m), std::vector<double>(tm.begin(), tm.end()), 2e-6, "m");
      ExpectNear(Download(v), std::vector<double>(tv.begin(), tv.end()), 2e-6, "v");
    }
    // The program's outputs are the States themselves (in place).
    EXPECT_EQ(p.Output(0)->data(), w.data());
    EXPECT_EQ(p.Output(1)->data(), m.data());
    EXPECT_EQ(p.Output(2)->data(), v.data());
  }
}

// A linear classifier's training step: logits = x W^T, fused loss and dlogits, dW = dlogits^T x,
// AdamW on W (read by the forward before the update, in builder order).
struct TrainStep {
  Graph g;
  Value loss;
};
TrainStep BuildTrainStep() {
  TrainStep r;
  Builder b(&r.g);
  const Value x = b.Input("x", DType::kF32, {6, 5});
  const Value targets = b.Input("targets", DType::kI32, {6});
  const Value step = b.Input("step", DType::kI64, {});
  const Value w = b.State("w", DType::kF32, {4, 5});
  const Value m = b.State("w.m", DType::kF32, {4, 5});
  const Value v = b.State("w.v", DType::kF32, {4, 5});
  const Value logits = b.Linear(x, w);
  const CrossEntropyOutputs ce =
      b.FusedCrossEntropy(logits, targets, b.Full(1.0 / 5, DType::kF32, {}));  // mean of 5 rows
  const Value dw = b.MatMul(b.Transpose(ce.dlogits, 0, 1), x);
  b.AdamW(w, dw, m, v, step, {0.1, 0.9, 0.99, 1e-8, 0.01});
  r.loss = b.Sum(ce.loss, {0});
  EXPECT_TRUE(b.ok()) << b.status();
  return r;
}

TEST_P(TrainingTest, CapturedTrainingStepReplaysLikeDirectRuns) {
  constexpr int kSteps = 4;
  std::vector<double> x(30), w0(20);
  for (int i = 0; i < 30; ++i) x[i] = std::cos(0.9 * i);
  for (int i = 0; i < 20; ++i) w0[i] = 0.1 * std::sin(2.1 * i);
  const std::vector<double> targets = {0, 3, 1, -100, 2, 3};
  struct Run {
    std::vector<double> losses, w, m, v;
  };
  // mode 0: direct runs; 1: the stream's native capture; 2: the engine's recording.
  auto run = [&](int mode) -> Run {
    TrainStep ts = BuildTrainStep();
    auto prog = Compile(ts.g, {ts.loss}, *dev_);
    EXPECT_TRUE(prog.ok()) << prog.status();
    Program& p = **prog;
    const Tensor w = Upload(DType::kF32, {4, 5}, w0);
    const Tensor m = Upload(DType::kF32, {4, 5}, std::vector<double>(20, 0));
    const Tensor v = Upload(DType::kF32, {4, 5}, std::vector<double>(20, 0));
    const Tensor step = Upload(DType::kI64, {}, {1});
    EXPECT_TRUE(p.Bind("x", Upload(DType::kF32, {6, 5}, x)).ok());
    EXPECT_TRUE(p.Bind("targets", Upload(DType::kI32, {6}, targets)).ok());
    EXPECT_TRUE(p.Bind("step", step).ok());
    EXPECT_TRUE(p.Bind("w", w).ok() && p.Bind("w.m", m).ok() && p.Bind("w.v", v).ok());
    const Tensor decoy_m = Upload(DType::kF32, {4, 5}, std::vector<double>(20, 0));
    const Tensor decoy_v = Upload(DType::kF32, {4, 5}, std::vector<double>(20, 0));
    NoCaptureStream recording_stream(*dev_->CreateStream());
    backend::Stream& s = mode == 2 ? recording_stream : *stream_;
    std::unique_ptr<CapturedProgram> graph;
    if (mode > 0) {
      auto c = CapturedProgram::Capture(p, s);
      EXPECT_TRUE(c.ok()) << c.status();
      graph = *std::move(c);
      EXPECT_EQ(graph->native(), mode == 1 && s.SupportsCapture());
      // Rebinding the program afterwards must not change the capture: it keeps updating the
      // moments it captured (the extra outputs of adamw), never these.
      EXPECT_TRUE(p.Bind("w.m", decoy_m).ok() && p.Bind("w.v", decoy_v).ok());
      EXPECT_TRUE(p.Prepare().ok());
    }
    Run r;
    for (int k = 1; k <= kSteps; ++k) {
      Write(step, {static_cast<double>(k)});
      EXPECT_TRUE((graph ? graph->Replay(s) : p.Run(s)).ok());
      EXPECT_TRUE(s.Synchronize().ok());
      r.losses.push_back(Out(p, 0)[0]);
    }
    r.w = Download(w);
    r.m = Download(m);
    r.v = Download(v);
    EXPECT_EQ(Download(decoy_m), std::vector<double>(20, 0));
    EXPECT_EQ(Download(decoy_v), std::vector<double>(20, 0));
    return r;
  };
  const Run direct = run(0);
  // Training does something: the loss falls, W moves.
  EXPECT_LT(direct.losses.back(), direct.losses.front());
  EXPECT_NE(direct.w, w0);
  for (int mode : {1, 2}) {
    SCOPED_TRACE(mode == 1 ? "native capture" : "engine recording");
    const Run replayed = run(mode);
    EXPECT_EQ(replayed.losses, direct.losses);
    EXPECT_EQ(replayed.w, direct.w);
    EXPECT_EQ(replayed.m, direct.m);
    EXPECT_EQ(replayed.v, direct.v);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, TrainingTest, ::testing::Values("ref", "cpu", "xpu"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kiln
