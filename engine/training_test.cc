// The training ops end to end, on every device the build has (ref, cpu, xpu when an OpenCL
// device exists): the fused cross-entropy equals cross-entropy and its autograd gradient;
// every optimizer (AdamW, Adam, SGD, Adagrad) equals PyTorch's update step by step, with a
// learning rate and gradient scale read at run time; global-norm clipping computed in the
// graph feeds the optimizer; and a captured training step (forward, fused loss/gradient,
// backward, AdamW updating its States in place) replays exactly like direct runs — with the native
// capture of the stream and with the engine's own recording.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "engine/autograd.h"
#include "engine/builder.h"
#include "engine/capture.h"
#include "engine/program.h"
#include "engine/testing/devices.h"
#include "engine/testing/source_dir.h"
#include "nlohmann/json.hpp"

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

// torch.optim's single-tensor steps for one element, as PyTorch computes them: f32 tensor
// arithmetic, Python floats (double) for the scalars. `g` is the gradient after clipping
// (clip_grad_norm_ multiplies it in place by its coefficient); `st` the element's states
// (empty at step 1, as torch's state starts).
void TorchStep(const OptimizerParams& h, float& p, std::vector<float>& st, float g, int step,
               double lr) {
  const bool first = st.empty();
  switch (h.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      // _single_tensor_adam / _single_tensor_adamw
      if (first) st = {0, 0};
      float &m = st[0], &v = st[1];
      if (h.kind == OptimizerKind::kAdamW) {
        p *= static_cast<float>(1 - lr * h.weight_decay);  // param.mul_
      } else if (h.weight_decay != 0) {
        g += p * static_cast<float>(h.weight_decay);  // grad.add(param, alpha=weight_decay)
      }
      m += (g - m) * static_cast<float>(1 - h.beta1);                                 // lerp_
      v = v * static_cast<float>(h.beta2) + g * g * static_cast<float>(1 - h.beta2);  // addcmul_
      const double bias_correction1 = 1 - std::pow(h.beta1, step);
      const double bias_correction2 = 1 - std::pow(h.beta2, step);
      const double step_size = lr / bias_correction1;
      const float denom = std::sqrt(v) / static_cast<float>(std::sqrt(bias_correction2)) +
                          static_cast<float>(h.eps);
      p += static_cast<float>(-step_size) * (m / denom);  // param.addcdiv_
      break;
    }
    case OptimizerKind::kSgd: {
      // _single_tensor_sgd
      if (h.weight_decay != 0) g += p * static_cast<float>(h.weight_decay);
      if (h.momentum != 0) {
        if (first) {
          st = {g};  // buf = torch.clone(grad)
        } else {     // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
          st[0] = st[0] * static_cast<float>(h.momentum) + g * static_cast<float>(1 - h.dampening);
        }
        g = h.nesterov ? g + st[0] * static_cast<float>(h.momentum) : st[0];
      }
      p += g * static_cast<float>(-lr);  // param.add_(grad, alpha=-lr)
      break;
    }
    case OptimizerKind::kAdagrad: {
      // _single_tensor_adagrad
      if (first) st = {static_cast<float>(h.initial_accumulator_value)};
      if (h.weight_decay != 0) g += p * static_cast<float>(h.weight_decay);
      const double clr = lr / (1 + (step - 1) * h.lr_decay);
      st[0] += g * g;                                                   // addcmul_
      const float std_ = std::sqrt(st[0]) + static_cast<float>(h.eps);  // sqrt().add_(eps)
      p += static_cast<float>(-clr) * (g / std_);                       // addcdiv_
      break;
    }
  }
}

struct OptimizerGraph {
  Graph g;
  OptimizerOutputs out;
};
// w [2,3] and its states (States), grad and hyper (Inputs), and with `graph_scale` a rank-0
// grad_scale Input standing for a coefficient computed in the graph.
OptimizerGraph BuildOptimizer(const OptimizerParams& h, bool graph_scale) {
  OptimizerGraph r;
  Builder b(&r.g);
  const Value p = b.State("w", DType::kF32, {2, 3});
  std::vector<Value> states;
  for (const std::string& s : OptimizerStateNames(h)) {
    states.push_back(b.State(absl::StrCat("w.", s), DType::kF32, {2, 3}));
  }
  const Value grad = b.Input("grad", DType::kF32, {2, 3});
  const Value hyper = b.Input("hyper", DType::kF32, {3});
  const Value scale = graph_scale ? b.Input("scale", DType::kF32, {}) : Value{};
  r.out = b.OptimizerStep(p, grad, states, hyper, scale, h);
  EXPECT_TRUE(b.ok()) << b.status();
  return r;
}

std::vector<double> GradAt(int step) {
  std::vector<double> g(6);
  for (int i = 0; i < 6; ++i) g[i] = std::sin(1.3 * i + 0.7 * step) * (i % 2 ? 1 : 0.01);
  return g;
}

struct OptimizerCase {
  const char* name;
  OptimizerParams h;
};
std::vector<OptimizerCase> OptimizerCases() {
  std::vector<OptimizerCase> cases;
  OptimizerParams p = DefaultOptimizerParams(OptimizerKind::kAdamW);
  p.weight_decay = 0.1;
  cases.push_back({"adamw", p});
  p = DefaultOptimizerParams(OptimizerKind::kAdam);
  p.beta1 = 0.8;
  p.weight_decay = 0.05;
  cases.push_back({"adam, L2 weight decay", p});
  p = DefaultOptimizerParams(OptimizerKind::kSgd);
  p.momentum = 0.9;
  p.dampening = 0.1;
  p.weight_decay = 0.01;
  cases.push_back({"sgd, momentum and dampening", p});
  p = DefaultOptimizerParams(OptimizerKind::kSgd);
  p.momentum = 0.8;
  p.nesterov = true;
  p.weight_decay = 0.1;
  cases.push_back({"sgd, nesterov", p});
  p = DefaultOptimizerParams(OptimizerKind::kSgd);
  p.weight_decay = 0.1;
  cases.push_back({"sgd, no momentum", p});
  p = DefaultOptimizerParams(OptimizerKind::kAdagrad);
  p.lr_decay = 0.05;
  p.weight_decay = 0.1;
  p.initial_accumulator_value = 0.2;
  cases.push_back({"adagrad, lr_decay and initial accumulator", p});
  return cases;
}

// Every optimizer, five steps, with a learning rate and a gradient scale that change every
// step (read at run time: the captured step replays with them), against torch's equations.
TEST_P(TrainingTest, OptimizersMatchPyTorchStepByStepDirectAndCaptured) {
  const std::vector<double> p0 = {0.5, -1, 0.25, 2, -0.125, 0};
  for (const OptimizerCase& oc : OptimizerCases()) {
    for (bool captured : {false, true}) {
      for (bool graph_scale : {false, true}) {
        SCOPED_TRACE(absl::StrCat(oc.name, captured ? ", captured" : ", direct",
                                  graph_scale ? ", graph grad_scale" : ""));
        const OptimizerParams& h = oc.h;
        OptimizerGraph og = BuildOptimizer(h, graph_scale);
        std::vector<Value> outs = {og.out.param};
        outs.insert(outs.end(), og.out.states.begin(), og.out.states.end());
        auto prog = Compile(og.g, outs, *dev_);
        ASSERT_TRUE(prog.ok()) << prog.status();
        Program& p = **prog;
        EXPECT_EQ(p.num_launches(), 1) << p.DebugString();
        const Tensor w = Upload(DType::kF32, {2, 3}, p0);
        std::vector<Tensor> states;
        for (const std::string& s : OptimizerStateNames(h)) {
          // Garbage on purpose: step 1 must not read it (torch's state starts fresh).
          states.push_back(Upload(DType::kF32, {2, 3}, std::vector<double>(6, 7.5)));
          ASSERT_TRUE(p.Bind(absl::StrCat("w.", s), states.back()).ok());
        }
        const Tensor grad = Upload(DType::kF32, {2, 3}, GradAt(1));
        const Tensor hyper = Upload(DType::kF32, {3}, {1, 0.01, 1});
        const Tensor scale = Upload(DType::kF32, {}, {1});
        ASSERT_TRUE(p.Bind("w", w).ok() && p.Bind("grad", grad).ok() &&
                    p.Bind("hyper", hyper).ok());
        if (graph_scale) {
          ASSERT_TRUE(p.Bind("scale", scale).ok());
        }
        std::unique_ptr<CapturedProgram> graph;
        if (captured) {
          auto c = CapturedProgram::Capture(p, *stream_);
          ASSERT_TRUE(c.ok()) << c.status();
          graph = *std::move(c);
        }
        std::vector<float> tp(p0.begin(), p0.end());
        std::vector<std::vector<float>> tst(6);
        for (int s = 1; s <= 5; ++s) {
          const std::vector<double> gs = GradAt(s);
          // lr falls by step (a schedule); the gradient scale changes too.
          const double lr = 0.01 / s, host_scale = s == 3 ? 0.5 : 1.0;
          const double graph_coef = graph_scale ? 0.25 * s : 1.0;
          Write(grad, gs);
          Write(hyper, {static_cast<double>(s), lr, host_scale});
          if (graph_scale) Write(scale, {graph_coef});
          ASSERT_TRUE((captured ? graph->Replay(*stream_) : p.Run(*stream_)).ok());
          const float coef = static_cast<float>(host_scale) * static_cast<float>(graph_coef);
          for (int i = 0; i < 6; ++i) {
            TorchStep(h, tp[i], tst[i], static_cast<float>(gs[i]) * coef, s,
                      static_cast<float>(lr));
          }
          ExpectNear(Download(w), std::vector<double>(tp.begin(), tp.end()), 2e-6, "param");
          for (size_t k = 0; k < states.size(); ++k) {
            std::vector<double> want(6);
            for (int i = 0; i < 6; ++i) want[i] = tst[i][k];
            ExpectNear(Download(states[k]), want, 2e-6, "state");
          }
        }
        // The program's outputs are the States themselves (in place).
        EXPECT_EQ(p.Output(0)->data(), w.data());
        for (size_t k = 0; k < states.size(); ++k) {
          EXPECT_EQ(p.Output(1 + k)->data(), states[k].data());
        }
      }
    }
  }
}

// Step 1 of AdamW by hand: m^ = g, v^ = g^2, so w1 = w0 (1 - lr wd) - lr g / (|g| + eps).
TEST_P(TrainingTest, AdamWFirstStepByHand) {
  OptimizerParams h = DefaultOptimizerParams(OptimizerKind::kAdamW);
  h.weight_decay = 0.1;
  OptimizerGraph og = BuildOptimizer(h, false);
  auto prog = Compile(og.g, {og.out.param}, *dev_);
  ASSERT_TRUE(prog.ok()) << prog.status();
  Program& p = **prog;
  const std::vector<double> p0 = {0.5, -1, 0.25, 2, -0.125, 0}, gs = GradAt(1);
  const Tensor w = Upload(DType::kF32, {2, 3}, p0);
  ASSERT_TRUE(p.Bind("w", w).ok() && p.Bind("grad", Upload(DType::kF32, {2, 3}, gs)).ok() &&
              p.Bind("hyper", Upload(DType::kF32, {3}, {1, 0.01, 1})).ok());
  for (const char* s : {"w.m", "w.v"}) {
    ASSERT_TRUE(p.Bind(s, Upload(DType::kF32, {2, 3}, std::vector<double>(6, 0))).ok());
  }
  ASSERT_TRUE(p.Run(*stream_).ok());
  const std::vector<double> got = Download(w);
  for (int i = 0; i < 6; ++i) {
    const double want = p0[i] * (1 - 0.01 * 0.1) - 0.01 * gs[i] / (std::fabs(gs[i]) + 1e-8);
    EXPECT_NEAR(got[i], want, 1e-6) << "w[" << i << "]";
  }
}

// clip_grad_norm_'s total norm and coefficient computed in the graph and fed to the
// optimizer's grad_scale: SGD then moves w by -lr * coef * g.
TEST_P(TrainingTest, ClipGradNormFeedsTheOptimizer) {
  for (double max_norm : {0.5, 100.0}) {
    SCOPED_TRACE(absl::StrCat("max_norm ", max_norm));
    Graph g;
    Builder b(&g);
    const Value g1 = b.Input("g1", DType::kF32, {2, 3});
    const Value g2 = b.Input("g2", DType::kF16, {4});
    const Value g3 = b.Input("g3", DType::kF32, {});
    const Value w = b.State("w", DType::kF32, {2, 3});
    const Value grads[] = {g1, g2, g3};
    const ClipGradNormOutputs clip = ClipGradNorm(b, grads, max_norm);
    const OptimizerOutputs o =
        b.OptimizerStep(w, g1, {}, b.Input("hyper", DType::kF32, {3}), clip.coef,
                        DefaultOptimizerParams(OptimizerKind::kSgd));
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b.dtype(clip.total_norm), DType::kF32);
    EXPECT_TRUE(b.shape(clip.coef).empty());
    auto prog = Compile(g, {clip.total_norm, clip.coef, o.param}, *dev_);
    ASSERT_TRUE(prog.ok()) << prog.status();
    Program& p = **prog;
    const std::vector<double> v1 = {0.5, -1, 0.25, 2, -0.125, 0}, v2 = {1, -2, 0.5, 0.25},
                              v3 = {-3};
    const std::vector<double> w0 = {1, 1, 1, 1, 1, 1};
    const Tensor wt = Upload(DType::kF32, {2, 3}, w0);
    ASSERT_TRUE(p.Bind("g1", Upload(DType::kF32, {2, 3}, v1)).ok() &&
                p.Bind("g2", Upload(DType::kF16, {4}, v2)).ok() &&
                p.Bind("g3", Upload(DType::kF32, {}, v3)).ok() && p.Bind("w", wt).ok() &&
                p.Bind("hyper", Upload(DType::kF32, {3}, {1, 0.1, 1})).ok());
    ASSERT_TRUE(p.Run(*stream_).ok());
    // torch: norms per tensor, then the norm of the norms.
    double total = 0;
    for (const auto* v : {&v1, &v2, &v3}) {
      double sq = 0;
      for (double x : *v) sq += x * x;
      total += sq;  // (sqrt(sq))^2
    }
    total = std::sqrt(total);
    const double coef = std::min(1.0, max_norm / (total + 1e-6));
    EXPECT_NEAR(Out(p, 0)[0], total, 1e-5 * total);
    EXPECT_NEAR(Out(p, 1)[0], coef, 1e-6);
    std::vector<double> want(6);
    for (int i = 0; i < 6; ++i) want[i] = w0[i] - 0.1 * coef * v1[i];
    ExpectNear(Download(wt), want, 1e-6, "w");
  }
}

// A model's worth of gradients (more than a fused kernel takes inputs): the sum of the
// per-tensor norms still compiles and is right.
TEST_P(TrainingTest, ClipGradNormOverManyTensors) {
  constexpr int kTensors = 40;
  Graph g;
  Builder b(&g);
  std::vector<Value> grads;
  for (int i = 0; i < kTensors; ++i) {
    grads.push_back(b.Input(absl::StrCat("g", i), DType::kF32, {i % 3 + 1, 2}));
  }
  const ClipGradNormOutputs clip = ClipGradNorm(b, grads, 1.0);
  ASSERT_TRUE(b.ok()) << b.status();
  auto prog = Compile(g, {clip.total_norm, clip.coef}, *dev_);
  ASSERT_TRUE(prog.ok()) << prog.status();
  double total = 0;
  for (int i = 0; i < kTensors; ++i) {
    std::vector<double> v(2 * (i % 3 + 1));
    for (size_t j = 0; j < v.size(); ++j) v[j] = 0.1 * std::sin(i + 0.3 * j);
    for (double x : v) total += x * x;
    ASSERT_TRUE((*prog)->Bind(absl::StrCat("g", i), Upload(DType::kF32, {i % 3 + 1, 2}, v)).ok());
  }
  total = std::sqrt(total);
  ASSERT_TRUE((*prog)->Run(*stream_).ok());
  EXPECT_NEAR(Out(**prog, 0)[0], total, 1e-5 * total);
  EXPECT_NEAR(Out(**prog, 1)[0], std::min(1.0, 1.0 / (total + 1e-6)), 1e-5);
}

// Real torch.optim (foreach=False) and clip_grad_norm_ outputs
// (scripts/fixtures/make_optimizer_fixtures.py): the same five steps with a changing lr and
// gradient scale, the parameter and every state after each step.
nlohmann::json LoadOptimizerFixture() {
  std::ifstream f(std::string(TestSourceDir()) + "/tests/fixtures/training/optimizers.json");
  EXPECT_TRUE(f.good()) << "tests/fixtures/training/optimizers.json is missing";
  return f.good() ? nlohmann::json::parse(f) : nlohmann::json::object();
}

TEST_P(TrainingTest, OptimizersMatchTorchOptimFixture) {
  const nlohmann::json d = LoadOptimizerFixture();
  ASSERT_TRUE(d.contains("optimizers"));
  ASSERT_GE(d["optimizers"].size(), 4u);
  const std::vector<double> p0 = d["p0"].get<std::vector<double>>();
  for (const nlohmann::json& c : d["optimizers"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    OptimizerParams h = DefaultOptimizerParams(*ParseOptimizerKind(c["kind"].get<std::string>()));
    const nlohmann::json& a = c["params"];
    for (auto [field, key] : {std::pair{&h.beta1, "beta1"},
                              {&h.beta2, "beta2"},
                              {&h.eps, "eps"},
                              {&h.weight_decay, "weight_decay"},
                              {&h.momentum, "momentum"},
                              {&h.dampening, "dampening"},
                              {&h.lr_decay, "lr_decay"},
                              {&h.initial_accumulator_value, "initial_accumulator_value"}}) {
      if (a.contains(key)) *field = a[key].get<double>();
    }
    h.nesterov = a.value("nesterov", false);
    OptimizerGraph og = BuildOptimizer(h, false);
    auto prog = Compile(og.g, {og.out.param}, *dev_);
    ASSERT_TRUE(prog.ok()) << prog.status();
    Program& p = **prog;
    const Tensor w = Upload(DType::kF32, {2, 3}, p0);
    std::vector<Tensor> states;
    for (const std::string& s : OptimizerStateNames(h)) {
      states.push_back(Upload(DType::kF32, {2, 3}, std::vector<double>(6, -1)));
      ASSERT_TRUE(p.Bind(absl::StrCat("w.", s), states.back()).ok());
    }
    const Tensor grad = Upload(DType::kF32, {2, 3}, std::vector<double>(6, 0));
    const Tensor hyper = Upload(DType::kF32, {3}, {1, 0, 1});
    ASSERT_TRUE(p.Bind("w", w).ok() && p.Bind("grad", grad).ok() && p.Bind("hyper", hyper).ok());
    for (size_t k = 0; k < c["steps"].size(); ++k) {
      const nlohmann::json& want = c["steps"][k];
      Write(grad, d["grads"][k].get<std::vector<double>>());
      Write(hyper, {static_cast<double>(k + 1), d["lrs"][k].get<double>(),
                    d["grad_scales"][k].get<double>()});
      ASSERT_TRUE(p.Run(*stream_).ok());
      ExpectNear(Download(w), want["param"].get<std::vector<double>>(), 2e-6, "param");
      ASSERT_EQ(want["states"].size(), states.size());
      for (size_t i = 0; i < states.size(); ++i) {
        ExpectNear(Download(states[i]), want["states"][i].get<std::vector<double>>(), 2e-6,
                   "state");
      }
    }
  }
}

TEST_P(TrainingTest, ClipGradNormMatchesTorchFixture) {
  const nlohmann::json d = LoadOptimizerFixture();
  ASSERT_TRUE(d.contains("clip_grad_norm"));
  for (const nlohmann::json& c : d["clip_grad_norm"]) {
    Graph g;
    Builder b(&g);
    std::vector<Value> grads;
    for (size_t i = 0; i < c["grads"].size(); ++i) {
      const std::vector<int64_t> shape = c["shapes"][i].get<std::vector<int64_t>>();
      grads.push_back(
          b.Input(absl::StrCat("g", i), DType::kF32, SymShape(shape.begin(), shape.end())));
    }
    const ClipGradNormOutputs clip = ClipGradNorm(b, grads, c["max_norm"].get<double>());
    ASSERT_TRUE(b.ok()) << b.status();
    auto prog = Compile(g, {clip.total_norm, clip.coef}, *dev_);
    ASSERT_TRUE(prog.ok()) << prog.status();
    for (size_t i = 0; i < grads.size(); ++i) {
      const std::vector<int64_t> shape = c["shapes"][i].get<std::vector<int64_t>>();
      ASSERT_TRUE((*prog)
                      ->Bind(absl::StrCat("g", i),
                             Upload(DType::kF32, shape, c["grads"][i].get<std::vector<double>>()))
                      .ok());
    }
    ASSERT_TRUE((*prog)->Run(*stream_).ok());
    const double total = c["total_norm"].get<double>(), coef = c["coef"].get<double>();
    EXPECT_NEAR(Out(**prog, 0)[0], total, 1e-6 * total);
    EXPECT_NEAR(Out(**prog, 1)[0], coef, 1e-6 * coef);
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
  const Value hyper = b.Input("hyper", DType::kF64, {3});
  const Value w = b.State("w", DType::kF32, {4, 5});
  const Value m = b.State("w.m", DType::kF32, {4, 5});
  const Value v = b.State("w.v", DType::kF32, {4, 5});
  const Value logits = b.Linear(x, w);
  const CrossEntropyOutputs ce =
      b.FusedCrossEntropy(logits, targets, b.Full(1.0 / 5, DType::kF32, {}));  // mean of 5 rows
  const Value dw = b.MatMul(b.Transpose(ce.dlogits, 0, 1), x);
  OptimizerParams adamw = DefaultOptimizerParams(OptimizerKind::kAdamW);
  adamw.beta2 = 0.99;
  b.OptimizerStep(w, dw, {m, v}, hyper, Value{}, adamw);
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
    const Tensor hyper = Upload(DType::kF64, {3}, {1, 0.1, 1});
    EXPECT_TRUE(p.Bind("x", Upload(DType::kF32, {6, 5}, x)).ok());
    EXPECT_TRUE(p.Bind("targets", Upload(DType::kI32, {6}, targets)).ok());
    EXPECT_TRUE(p.Bind("hyper", hyper).ok());
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
      Write(hyper, {static_cast<double>(k), 0.1 / k, 1});  // a decaying lr
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
