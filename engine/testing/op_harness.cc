#include "engine/testing/op_harness.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/autograd.h"
#include "engine/program.h"

namespace kiln::harness {
namespace {

// Sentinels are whole elements/blocks of the input's dtype (so the data stays addressable).
size_t SentinelBytes(DType t) {
  const size_t bb = static_cast<size_t>(DTypeBlockBytes(t));
  return (64 + bb - 1) / bb * bb;
}
constexpr uint8_t kSentinel = 0x5A;

uint64_t Hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  double Uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(gen_() >> 11) * 0x1.0p-53;
  }
  double Normal() {  // Box-Muller: portable across standard libraries
    const double u1 = Uniform(1e-12, 1.0), u2 = Uniform(0.0, 1.0);
    return std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2);
  }
  uint64_t Bits() { return gen_(); }

 private:
  std::mt19937_64 gen_;
};

int64_t NumElems(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Random bytes with valid, modest scales in every block.
void FillRandomBlocks(DType t, uint8_t* p, int64_t bytes, Rng& rng) {
  for (int64_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(rng.Bits());
  const int64_t bb = DTypeBlockBytes(t);
  auto scale = [&](uint8_t* at) {
    const uint16_t h = FloatToF16(static_cast<float>(rng.Uniform(0.01, 0.1)));
    std::memcpy(at, &h, 2);
  };
  for (int64_t b = 0; b < bytes / bb; ++b) {
    uint8_t* blk = p + b * bb;
    switch (t) {
      case DType::kQ4_0:
      case DType::kQ8_0:
        scale(blk);
        break;
      case DType::kQ4_1:
      case DType::kQ4_K:
      case DType::kQ5_K:
        scale(blk);
        scale(blk + 2);
        break;
      case DType::kQ6_K:
        scale(blk + 208);
        break;
      case DType::kMXFP4:
        blk[0] = static_cast<uint8_t>(120 + rng.Bits() % 8);
        break;
      default:
        break;
    }
  }
}

// The case input as a dense tensor on the reference device.
StatusOr<Tensor> MakeHostTensor(const InputSpec& in, backend::Device& ref, uint64_t seed) {
  Rng rng(seed);
  if (in.init == Init::kRandomBlocks) {
    KILN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(ref, in.dtype, in.shape));
    FillRandomBlocks(in.dtype, static_cast<uint8_t*>(t.data()), t.nbytes(), rng);
    return t;
  }
  const int64_t n = NumElems(in.shape);
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (in.init) {
      case Init::kNormal:
        v[i] = rng.Normal() * in.hi;
        break;
      case Init::kUniform:
        v[i] = rng.Uniform(in.lo, in.hi);
        break;
      case Init::kIndex:
        v[i] = std::floor(rng.Uniform(in.lo, in.hi));
        break;
      case Init::kBool:
        v[i] = (rng.Bits() & 1) ? 1 : 0;
        break;
      case Init::kCustom:
        v[i] = in.values.at(i);
        break;
      default:
        break;
    }
  }
  return Tensor::FromDoubles(ref, in.dtype, in.shape, v);
}

// A device copy of a dense host tensor, with sentinel bytes before and after it.
struct Guarded {
  Tensor tensor;
  std::shared_ptr<backend::Buffer> buffer;
  size_t bytes = 0;
  size_t sentinel = 0;
};

StatusOr<Guarded> Upload(const Tensor& host, backend::Device& dev, backend::Stream& s) {
  Guarded g;
  g.bytes = static_cast<size_t>(host.nbytes());
  g.sentinel = SentinelBytes(host.dtype());
  const size_t kSentinelBytes = g.sentinel;
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Buffer> buf,
                        dev.Allocate(g.bytes + 2 * kSentinelBytes));
  g.buffer = std::move(buf);
  const std::vector<uint8_t> sentinel(kSentinelBytes, kSentinel);
  KILN_RETURN_IF_ERROR(s.CopyToDevice(*g.buffer, 0, sentinel.data(), kSentinelBytes));
  KILN_RETURN_IF_ERROR(s.CopyToDevice(*g.buffer, kSentinelBytes, host.data(), g.bytes));
  KILN_RETURN_IF_ERROR(
      s.CopyToDevice(*g.buffer, kSentinelBytes + g.bytes, sentinel.data(), kSentinelBytes));
  KILN_ASSIGN_OR_RETURN(g.tensor,
                        Tensor::FromBuffer(g.buffer, kSentinelBytes, host.dtype(), host.shape()));
  return g;
}

Status CheckGuarded(const Guarded& g, const Tensor& host, bool may_change, const std::string& name,
                    backend::Stream& s) {
  const size_t kSentinelBytes = g.sentinel;
  std::vector<uint8_t> all(g.bytes + 2 * kSentinelBytes);
  KILN_RETURN_IF_ERROR(s.CopyToHost(all.data(), *g.buffer, 0, all.size()));
  for (size_t i = 0; i < kSentinelBytes; ++i) {
    if (all[i] != kSentinel || all[kSentinelBytes + g.bytes + i] != kSentinel) {
      return Internal("sentinel around input '", name, "' was overwritten (out-of-bounds write)");
    }
  }
  if (!may_change && std::memcmp(all.data() + kSentinelBytes, host.data(), g.bytes) != 0) {
    return Internal("input '", name, "' was modified by the program");
  }
  return OkStatus();
}

// Any (strided) device tensor, read as doubles.
StatusOr<std::vector<double>> Download(const Tensor& t, backend::Device& ref, backend::Stream& s) {
  if (t.buffer()->device().host_visible()) return t.ToDoubles();
  KILN_ASSIGN_OR_RETURN(Tensor host,
                        Tensor::Empty(ref, DType::kU8, {static_cast<int64_t>(t.buffer()->size())}));
  KILN_RETURN_IF_ERROR(s.CopyToHost(host.data(), *t.buffer(), 0, t.buffer()->size()));
  KILN_RETURN_IF_ERROR(s.Synchronize());
  KILN_ASSIGN_OR_RETURN(
      Tensor view, Tensor::FromParts(host.buffer(), t.dtype(), t.shape(), t.strides(), t.offset()));
  return view.ToDoubles();
}

struct Built {
  Graph graph;
  std::vector<Value> inputs;
  Value out;
  std::vector<Value> outs;  // `out` and, for a multi-output node, its other outputs
};

StatusOr<Built> BuildCase(const OpCase& c, const std::vector<InputSpec>& specs) {
  Built r;
  Builder b(&r.graph);
  for (const InputSpec& in : specs) {
    SymShape shape(in.shape.begin(), in.shape.end());
    Value v;
    switch (in.source) {
      case OpKind::kWeight:
        v = b.Weight(in.name, in.dtype, shape);
        break;
      case OpKind::kState:
        v = b.State(in.name, in.dtype, shape);
        break;
      default:
        v = b.Input(in.name, in.dtype, shape);
        break;
    }
    r.inputs.push_back(v);
  }
  r.out = c.build(b, r.inputs);
  KILN_RETURN_IF_ERROR(Annotate(b.status(), absl::StrCat("building case '", c.name, "'")));
  r.outs = {r.out};
  for (int o = 1; o < r.graph.NumOutputs(r.out.id); ++o) r.outs.push_back(Value{r.out.id + o});
  return r;
}

std::vector<Tensor> MakeInputs(const OpCase& c, backend::Device& ref, Status* status) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    StatusOr<Tensor> t = MakeHostTensor(c.inputs[i], ref, Hash(c.name) + i * 7919);
    if (!t.ok()) {
      *status = t.status();
      return {};
    }
    out.push_back(*std::move(t));
  }
  return out;
}

// Every output of a case's result node (in place: the updated State), as doubles.
struct Output {
  std::vector<std::vector<double>> values;
  std::vector<DType> dtypes;
  int launches = 0;
};

// Compiles and runs the case on `dev` with guarded inputs; kUnimplemented if unsupported.
StatusOr<Output> RunOnDevice(const OpCase& c, const std::vector<Tensor>& host, backend::Device& dev,
                             backend::Device& ref, bool guards) {
  KILN_ASSIGN_OR_RETURN(Built built, BuildCase(c, c.inputs));
  CompileOptions opts;
  opts.guard_bytes = guards ? 64 : 0;
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Program> p, Compile(built.graph, built.outs, dev, opts));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Stream> s, dev.CreateStream());
  std::vector<Guarded> guarded;
  for (size_t i = 0; i < host.size(); ++i) {
    KILN_ASSIGN_OR_RETURN(Guarded g, Upload(host[i], dev, *s));
    KILN_RETURN_IF_ERROR(p->Bind(c.inputs[i].name, g.tensor));
    guarded.push_back(std::move(g));
  }
  KILN_RETURN_IF_ERROR(p->Run(*s));
  KILN_RETURN_IF_ERROR(s->Synchronize());
  for (size_t i = 0; i < host.size(); ++i) {
    KILN_RETURN_IF_ERROR(CheckGuarded(guarded[i], host[i], c.inputs[i].source == OpKind::kState,
                                      c.inputs[i].name, *s));
  }
  Output o;
  for (int k = 0; k < p->num_outputs(); ++k) {
    KILN_ASSIGN_OR_RETURN(Tensor out, p->Output(k));
    KILN_ASSIGN_OR_RETURN(std::vector<double> v, Download(out, ref, *s));
    o.values.push_back(std::move(v));
    o.dtypes.push_back(out.dtype());
  }
  o.launches = p->num_launches();
  return o;
}

bool IsExactType(DType t) { return IsInteger(t) || t == DType::kBool; }

// Compares `got` with the reference `want`: NaN/Inf positions must agree, the finite
// values must be within the NMSE tolerance (or equal, for integer types).
Result Compare(const std::vector<double>& want, const std::vector<double>& got, DType dtype,
               double tol) {
  Result r;
  if (want.size() != got.size()) {
    r.outcome = Result::Outcome::kFail;
    r.message = absl::StrCat("element count ", got.size(), " vs reference ", want.size());
    return r;
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double a = want[i], b = got[i];
    if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b)) {
      const bool same = (std::isnan(a) && std::isnan(b)) || (std::isinf(a) && a == b);
      if (!same) {
        r.outcome = Result::Outcome::kFail;
        r.message =
            absl::StrFormat("element %d: %g but the reference has %g (NaN/Inf mismatch)", i, b, a);
        return r;
      }
      continue;
    }
    if (IsExactType(dtype) && a != b) {
      r.outcome = Result::Outcome::kFail;
      r.message =
          absl::StrFormat("element %d: %g but the reference has %g (must be exact)", i, b, a);
      return r;
    }
    num += (a - b) * (a - b);
    den += a * a;
  }
  r.error = den > 0 ? num / den : num;
  if (r.error > tol) {
    r.outcome = Result::Outcome::kFail;
    r.message =
        absl::StrFormat("NMSE %.3g exceeds the %s tolerance %.3g", r.error, DTypeName(dtype), tol);
  } else {
    r.message = absl::StrFormat("NMSE %.3g", r.error);
  }
  return r;
}

Result Fail(const Status& s) {
  Result r;
  r.outcome = s.code() == StatusCode::kUnimplemented ? Result::Outcome::kUnsupported
                                                     : Result::Outcome::kFail;
  r.message = std::string(StatusMessage(s));
  return r;
}

}  // namespace

StatusOr<std::vector<OpKind>> OpsOf(const OpCase& c) {
  KILN_ASSIGN_OR_RETURN(Built built, BuildCase(c, c.inputs));
  std::vector<OpKind> ops;
  for (const Node& n : built.graph.nodes()) {
    if (GetOpDef(n.op).cls != OpClass::kSource) ops.push_back(n.op);
  }
  return ops;
}

double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return 1e-20;
    case DType::kF32:
      return 1e-10;
    case DType::kF16:
      return 1e-5;
    case DType::kBF16:
      return 1e-3;
    case DType::kF8E4M3:
      return 2e-2;
    case DType::kF8E5M2:
      return 5e-2;
    default:
      return 0;
  }
}

Result RunForward(const OpCase& c, backend::Device& ref, backend::Device& dev) {
  Status st = OkStatus();
  const std::vector<Tensor> host = MakeInputs(c, ref, &st);
  if (!st.ok()) return Fail(st);
  StatusOr<Output> want = RunOnDevice(c, host, ref, ref, /*guards=*/true);
  if (!want.ok()) return Fail(Annotate(want.status(), "reference run"));
  // Once with guards around every buffer (out-of-bounds writes), once as in production
  // (memory reuse and in-place updates).
  Result r;
  for (bool guards : {true, false}) {
    StatusOr<Output> got = RunOnDevice(c, host, dev, ref, guards);
    if (!got.ok()) return Fail(got.status());
    std::string errors;
    for (size_t k = 0; k < got->values.size(); ++k) {
      const DType t = got->dtypes[k];
      r = Compare(want->values[k], got->values[k], t, c.tol >= 0 ? c.tol : Tolerance(t));
      r.launches = got->launches;
      if (r.outcome != Result::Outcome::kPass) {
        if (got->values.size() > 1) r.message = absl::StrCat("output ", k, ": ", r.message);
        r.message += guards ? " (guarded run)" : " (planned run)";
        return r;
      }
      absl::StrAppend(&errors, k ? ", " : "", r.message);
    }
    r.message = errors;
  }
  return r;
}

Result RunGradient(const OpCase& c, backend::Device& ref, backend::Device& dev) {
  // loss = sum(op(inputs) * R) with a fixed random R.
  auto build = [&](Graph& g, std::vector<Value>* wrt, Value* loss) -> Status {
    Builder b(&g);
    std::vector<Value> in;
    for (const InputSpec& s : c.inputs) {
      in.push_back(b.Input(s.name, s.dtype, SymShape(s.shape.begin(), s.shape.end())));
      if (s.differentiable && IsFloat(s.dtype)) wrt->push_back(in.back());
    }
    const Value out = c.build(b, in);
    KILN_RETURN_IF_ERROR(b.status());
    const Value r = b.Input("harness.r", b.dtype(out), b.shape(out));
    std::vector<int> axes(b.rank(out));
    for (int i = 0; i < b.rank(out); ++i) axes[i] = i;
    *loss = b.Sum(b.Mul(out, r), axes);
    return b.status();
  };
  Graph g;
  std::vector<Value> wrt;
  Value loss;
  Status st = build(g, &wrt, &loss);
  if (!st.ok()) return Fail(st);
  Builder b(&g);
  StatusOr<std::vector<Value>> grads = Gradients(b, loss, wrt);
  if (!grads.ok()) return Fail(grads.status());

  std::vector<Tensor> host = MakeInputs(c, ref, &st);
  if (!st.ok()) return Fail(st);
  InputSpec rspec;
  rspec.name = "harness.r";
  rspec.dtype = g.node(loss.id).dtype;
  {
    const Node& mul = g.node(g.node(loss.id).inputs[0]);
    rspec.shape = EvalShape(mul.shape, {});
  }
  StatusOr<Tensor> rt = MakeHostTensor(rspec, ref, Hash(c.name) ^ 0xABCDEF);
  if (!rt.ok()) return Fail(rt.status());

  // Analytic gradients on the device under test.
  StatusOr<std::unique_ptr<Program>> ap = Compile(g, *grads, dev);
  if (!ap.ok()) return Fail(ap.status());
  StatusOr<std::unique_ptr<backend::Stream>> ds = dev.CreateStream();
  if (!ds.ok()) return Fail(ds.status());
  std::vector<Guarded> keep;
  for (size_t i = 0; i <= host.size(); ++i) {
    const Tensor& h = i < host.size() ? host[i] : *rt;
    StatusOr<Guarded> gt = Upload(h, dev, **ds);
    if (!gt.ok()) return Fail(gt.status());
    const Status bs = (*ap)->Bind(i < host.size() ? c.inputs[i].name : "harness.r", gt->tensor);
    if (!bs.ok()) return Fail(bs);
    keep.push_back(*std::move(gt));
  }
  if (Status rs = (*ap)->Run(**ds); !rs.ok()) return Fail(rs);
  std::vector<std::vector<double>> analytic;
  for (size_t k = 0; k < grads->size(); ++k) {
    StatusOr<Tensor> o = (*ap)->Output(static_cast<int>(k));
    if (!o.ok()) return Fail(o.status());
    StatusOr<std::vector<double>> v = Download(*o, ref, **ds);
    if (!v.ok()) return Fail(v.status());
    analytic.push_back(*std::move(v));
  }

  // Central differences of the loss on the reference backend.
  StatusOr<std::unique_ptr<Program>> lp = Compile(g, {loss}, ref);
  if (!lp.ok()) return Fail(lp.status());
  StatusOr<std::unique_ptr<backend::Stream>> rs = ref.CreateStream();
  if (!rs.ok()) return Fail(rs.status());
  for (size_t i = 0; i < host.size(); ++i) {
    if (Status b = (*lp)->Bind(c.inputs[i].name, host[i]); !b.ok()) return Fail(b);
  }
  if (Status b = (*lp)->Bind("harness.r", *rt); !b.ok()) return Fail(b);
  auto eval = [&]() -> double {
    if (!(*lp)->Run(**rs).ok()) return std::nan("");
    return (*(*lp)->Output(0)->ToDoubles())[0];
  };
  Result r;
  double num = 0, den = 0;
  size_t k = 0;
  std::string worst;
  double worst_err = -1;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const InputSpec& s = c.inputs[i];
    if (!(s.differentiable && IsFloat(s.dtype))) continue;
    const Tensor& t = host[i];
    for (int64_t e = 0; e < t.numel(); ++e) {
      const double x = LoadElement(t.data(), t.dtype(), e);
      const double h = c.grad_eps * std::max(1.0, std::fabs(x));
      StoreElement(t.data(), t.dtype(), e, x + h);
      const double up = eval();
      StoreElement(t.data(), t.dtype(), e, x - h);
      const double down = eval();
      StoreElement(t.data(), t.dtype(), e, x);
      const double fd = (up - down) / (2 * h);
      const double an = analytic[k][e];
      const double err = (an - fd) * (an - fd);
      num += err;
      den += fd * fd;
      if (err > worst_err) {
        worst_err = err;
        worst = absl::StrFormat("d/d%s[%d]: analytic %.9g, numeric %.9g", s.name, e, an, fd);
      }
      if (std::isnan(an) != std::isnan(fd)) {
        r.outcome = Result::Outcome::kFail;
        r.message = absl::StrCat("NaN mismatch at ", worst);
        return r;
      }
    }
    ++k;
  }
  r.error = den > 0 ? num / den : num;
  if (!(r.error <= c.grad_tol)) {
    r.outcome = Result::Outcome::kFail;
    r.message =
        absl::StrFormat("gradient NMSE %.3g exceeds %.3g; worst %s", r.error, c.grad_tol, worst);
  } else {
    r.message = absl::StrFormat("gradient NMSE %.3g", r.error);
  }
  r.launches = (*ap)->num_launches();
  return r;
}

Result RunPerf(const OpCase& c, backend::Device& dev, int iterations) {
  StatusOr<Built> built = BuildCase(c, c.inputs);
  if (!built.ok()) return Fail(built.status());
  StatusOr<std::unique_ptr<Program>> p = Compile(built->graph, {built->out}, dev);
  if (!p.ok()) return Fail(p.status());
  StatusOr<std::unique_ptr<backend::Stream>> s = dev.CreateStream();
  if (!s.ok()) return Fail(s.status());
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    StatusOr<Tensor> t = Tensor::Empty(dev, c.inputs[i].dtype, c.inputs[i].shape);
    if (!t.ok()) return Fail(t.status());
    // Zeros keep every op well defined (indices valid, no NaNs) without host-side setup.
    std::vector<uint8_t> zero(static_cast<size_t>(t->nbytes()), 0);
    if (Status z = (*s)->CopyToDevice(*t->buffer(), 0, zero.data(), zero.size()); !z.ok()) {
      return Fail(z);
    }
    if (Status b = (*p)->Bind(c.inputs[i].name, *t); !b.ok()) return Fail(b);
  }
  if (Status w = (*p)->Run(**s); !w.ok()) return Fail(w);
  if (Status w = (*s)->Synchronize(); !w.ok()) return Fail(w);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) {
    if (Status w = (*p)->Run(**s); !w.ok()) return Fail(w);
  }
  if (Status w = (*s)->Synchronize(); !w.ok()) return Fail(w);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Result r;
  r.seconds = secs / std::max(iterations, 1);
  r.launches = (*p)->num_launches();
  r.message = absl::StrFormat("%.1f us/run, %d launches", r.seconds * 1e6, r.launches);
  return r;
}

StatusOr<std::unique_ptr<Program>> CompileCase(const OpCase& c, bool gradient,
                                               backend::Device& dev) {
  Graph g;
  Builder b(&g);
  std::vector<Value> in, wrt;
  for (const InputSpec& s : c.inputs) {
    const SymShape shape(s.shape.begin(), s.shape.end());
    if (gradient) {
      in.push_back(b.Input(s.name, s.dtype, shape));
      if (s.differentiable && IsFloat(s.dtype)) wrt.push_back(in.back());
    } else if (s.source == OpKind::kWeight) {
      in.push_back(b.Weight(s.name, s.dtype, shape));
    } else if (s.source == OpKind::kState) {
      in.push_back(b.State(s.name, s.dtype, shape));
    } else {
      in.push_back(b.Input(s.name, s.dtype, shape));
    }
  }
  const Value out = c.build(b, in);
  KILN_RETURN_IF_ERROR(b.status());
  if (!gradient) return Compile(g, {out}, dev);
  const Value r = b.Input("harness.r", b.dtype(out), b.shape(out));
  std::vector<int> axes(b.rank(out));
  for (int i = 0; i < b.rank(out); ++i) axes[i] = i;
  const Value loss = b.Sum(b.Mul(out, r), axes);
  KILN_RETURN_IF_ERROR(b.status());
  KILN_ASSIGN_OR_RETURN(std::vector<Value> grads, Gradients(b, loss, wrt));
  return Compile(g, grads, dev);
}

std::string SuiteResult::Summary() const {
  std::string failed;
  for (const std::string& op : failed_ops) absl::StrAppend(&failed, " ", op);
  return absl::StrFormat(
      "%d/%d cases passed over %zu ops (failing ops:%s); declare+build %.1f s, run %.1f s", passed,
      ran, ops.size(), failed.empty() ? " none" : failed, build_seconds, run_seconds);
}

SuiteResult RunBatchBuilt(bool gradient, backend::Device& ref, backend::Device& dev,
                          const std::function<Status()>& build, const std::string& only_op) {
  using Clock = std::chrono::steady_clock;
  SuiteResult r;
  const std::vector<OpCase> cases = gradient ? GradientCases(false) : ForwardCases(false);
  const auto t0 = Clock::now();
  for (const OpCase& c : cases) {
    if (!only_op.empty() && c.op != only_op) continue;
    (void)CompileCase(c, gradient, dev);  // only declares kernels; the runs below check
  }
  r.build = build();
  const auto t1 = Clock::now();
  r.build_seconds = std::chrono::duration<double>(t1 - t0).count();
  if (!r.build.ok()) return r;
  std::set<std::string> ops, failed;
  for (const OpCase& c : cases) {
    if (!only_op.empty() && c.op != only_op) continue;
    const Result res = gradient ? RunGradient(c, ref, dev) : RunForward(c, ref, dev);
    ++r.ran;
    ops.insert(c.op);
    if (res.outcome == Result::Outcome::kPass) {
      ++r.passed;
    } else {
      failed.insert(c.op);
      r.failures.push_back(absl::StrCat(c.name, ": ", res.message));
    }
  }
  r.run_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  r.ops.assign(ops.begin(), ops.end());
  r.failed_ops.assign(failed.begin(), failed.end());
  return r;
}

StatusOr<double> LaunchOverheadNs(backend::Device& dev, int launches, int iterations) {
  Graph g;
  Builder b(&g);
  Value x = b.Input("x", DType::kF32, {1});
  for (int i = 0; i < launches; ++i) x = b.Neg(x);
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Program> p, Compile(g, {x}, dev));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Stream> s, dev.CreateStream());
  KILN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(dev, DType::kF32, {1}));
  KILN_RETURN_IF_ERROR(p->Bind("x", t));
  KILN_RETURN_IF_ERROR(p->Run(*s));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) KILN_RETURN_IF_ERROR(p->Run(*s));
  KILN_RETURN_IF_ERROR(s->Synchronize());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return secs * 1e9 / (static_cast<double>(iterations) * p->num_launches());
}

}  // namespace kiln::harness
