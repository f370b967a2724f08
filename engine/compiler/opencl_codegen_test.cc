// Device codegen, end to end on an OpenCL device (PoCL on CI machines): every op harness
// forward case whose op has an expression form runs on the `ref` backend; each of its launches
// with a form is then generated as OpenCL C, built (all kernels in one program), run on the
// device on copies of the same inputs, and compared with ref's output. The OpenCL, CUDA and
// HIP printers share the device skeleton and helpers, so this checks their numerics too
// (cuda_codegen_test / rocm_codegen_test only compile, having no device here).
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string_view>

#include "engine/compiler/codegen.h"
#include "engine/program.h"
#include "engine/testing/devices.h"
#include "engine/testing/op_harness.h"

namespace kiln::compiler {
namespace {

#define CL_OK(call)                                                           \
  do {                                                                        \
    const cl_int e_ = (call);                                                 \
    ASSERT_EQ(e_, CL_SUCCESS) << #call << " failed with OpenCL error " << e_; \
  } while (0)

struct Cl {
  cl_device_id device = nullptr;
  cl_context context = nullptr;
  cl_command_queue queue = nullptr;
  bool fp64 = false;
  std::string name;
};

// The first OpenCL device, or null.
Cl* Device() {
  static Cl* cl = []() -> Cl* {
    cl_uint n = 0;
    if (clGetPlatformIDs(0, nullptr, &n) != CL_SUCCESS || n == 0) return nullptr;
    std::vector<cl_platform_id> ps(n);
    clGetPlatformIDs(n, ps.data(), nullptr);
    for (cl_platform_id p : ps) {
      cl_device_id d;
      if (clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 1, &d, nullptr) != CL_SUCCESS) continue;
      auto* c = new Cl();
      c->device = d;
      cl_int err = 0;
      c->context = clCreateContext(nullptr, 1, &d, nullptr, nullptr, &err);
      if (err != CL_SUCCESS) continue;
      c->queue = clCreateCommandQueue(c->context, d, 0, &err);
      if (err != CL_SUCCESS) continue;
      char buf[1024] = {};
      clGetDeviceInfo(d, CL_DEVICE_NAME, sizeof(buf), buf, nullptr);
      c->name = buf;
      clGetDeviceInfo(d, CL_DEVICE_EXTENSIONS, sizeof(buf), buf, nullptr);
      c->fp64 = std::strstr(buf, "cl_khr_fp64") != nullptr;
      return c;
    }
    return nullptr;
  }();
  return cl;
}

// Inputs like the harness' (same kinds; its own random stream).
StatusOr<Tensor> MakeInput(const harness::InputSpec& in, backend::Device& ref, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0, 1);
  std::uniform_real_distribution<double> uni(in.lo, in.hi);
  int64_t n = 1;
  for (int64_t d : in.shape) n *= d;
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (in.init) {
      case harness::Init::kNormal:
        v[i] = normal(rng) * in.hi;
        break;
      case harness::Init::kUniform:
        v[i] = uni(rng);
        break;
      case harness::Init::kIndex:
        v[i] = std::floor(uni(rng));
        break;
      case harness::Init::kBool:
        v[i] = rng() & 1;
        break;
      case harness::Init::kCustom:
        v[i] = in.values.at(i);
        break;
      default:
        return Unimplemented("block-quantized input");
    }
  }
  return Tensor::FromDoubles(ref, in.dtype, in.shape, v);
}

// Elements a strided view spans (from its first element).
int64_t Extent(const TensorArg& t) {
  int64_t e = 1;
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[d] == 0) return 0;
    e += (t.shape[d] - 1) * t.strides[d];
  }
  return e;
}

struct Job {
  std::string label;
  KernelSpec spec;
  GeneratedKernel kernel;
  LaunchArgs args;                // copy; inputs below
  std::vector<TensorArg> inputs;  // host views (ref memory)
  std::vector<double> expected;   // ref's output, dense
};

double ToDouble(const TensorArg& t, int64_t off) { return LoadElement(t.data, t.dtype, off); }

std::vector<double> DenseValues(const TensorArg& t) {
  std::vector<double> v;
  const int64_t n = t.numel();
  std::vector<int64_t> idx(t.rank, 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t off = 0;
    for (int d = 0; d < t.rank; ++d) off += idx[d] * t.strides[d];
    v.push_back(ToDouble(t, off));
    for (int d = t.rank - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return v;
}

TEST(OpenClCodegenTest, EveryFormMatchesTheReferenceOnTheDevice) {
  Cl* cl = Device();
  if (cl == nullptr) GTEST_SKIP() << "no OpenCL device";
  auto ref_backend = kiln::MakeTestBackend("ref");
  backend::Device& ref = *ref_backend->device(0);
  auto stream = *ref.CreateStream();

  // 1. Run every case on ref, keep each form launch's inputs and output.
  std::vector<std::unique_ptr<Program>> programs;
  std::vector<std::vector<Tensor>> keep;
  std::vector<Job> jobs;
  // PoCL compiles each kernel the first time it runs (~0.15 s, cached in ~/.cache/pocl): by
  // default one case per op, every case with KILN_HARNESS_FULL=1.
  const char* full_env = std::getenv("KILN_HARNESS_FULL");
  const bool full = full_env != nullptr && std::string_view(full_env) == "1";
  std::set<std::string> ops_seen;
  for (const harness::OpCase& c : harness::ForwardCases(false)) {
    if (!full && !ops_seen.insert(c.op).second) continue;
    Graph g;
    Builder b(&g);
    std::vector<Value> in;
    std::vector<Tensor> tensors;
    bool ok = true;
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      const harness::InputSpec& s = c.inputs[i];
      SymShape shape(s.shape.begin(), s.shape.end());
      in.push_back(s.source == OpKind::kWeight  ? b.Weight(s.name, s.dtype, shape)
                   : s.source == OpKind::kState ? b.State(s.name, s.dtype, shape)
                                                : b.Input(s.name, s.dtype, shape));
      StatusOr<Tensor> t = MakeInput(s, ref, 1000 + i);
      if (!t.ok()) ok = false;
      if (ok) tensors.push_back(*t);
    }
    if (!ok) continue;
    const Value out = c.build(b, in);
    ASSERT_TRUE(b.ok()) << c.name;
    CompileOptions opts;
    opts.guard_bytes = 64;  // every buffer its own memory: launch outputs stay readable
    auto p = Compile(g, {out}, ref, opts);
    ASSERT_TRUE(p.ok()) << c.name << ": " << p.status();
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      ASSERT_TRUE((*p)->Bind(c.inputs[i].name, tensors[i]).ok());
    }
    ASSERT_TRUE((*p)->Run(*stream).ok()) << c.name;
    const Graph& pg = (*p)->graph();
    int launch = 0;
    for (int32_t id = 0; id < pg.size(); ++id) {
      const Node& n = pg.node(id);
      const OpDef& def = GetOpDef(n.op);
      if (def.cls == OpClass::kSource || def.cls == OpClass::kView) continue;
      const Launch& l = (*p)->launches()[launch++];
      if (def.pointwise == nullptr && def.reduce == nullptr) continue;
      std::vector<TensorType> types;
      for (int32_t i : n.inputs) types.push_back({pg.node(i).dtype, pg.node(i).shape});
      backend::KernelRequest req{n.op, &n.attrs, types, {n.dtype, n.shape}, n.name};
      StatusOr<KernelSpec> spec = SpecFromRequest(req);
      if (!spec.ok()) continue;
      const bool f64 = n.dtype == DType::kF64 ||
                       std::any_of(types.begin(), types.end(),
                                   [](const TensorType& t) { return t.dtype == DType::kF64; });
      if (f64 && !cl->fp64) continue;
      Job j;
      j.label = StrCat(c.name, " / ", def.name);
      j.spec = *spec;
      j.kernel = *GenerateKernel(j.spec, Dialect::kOpenCL);
      j.args = *l.args;
      j.inputs.assign(l.args->inputs, l.args->inputs + l.args->num_inputs);
      j.expected = DenseValues(l.args->output);
      jobs.push_back(std::move(j));
    }
    keep.push_back(std::move(tensors));
    programs.push_back(*std::move(p));
  }
  ASSERT_GT(jobs.size(), 40u);

  // 2. One program with every kernel.
  std::vector<GeneratedKernel> ks;
  for (const Job& j : jobs) ks.push_back(j.kernel);
  const std::string src = ModuleSource(Dialect::kOpenCL, ks);
  const char* srcp = src.c_str();
  cl_int err = 0;
  cl_program prog = clCreateProgramWithSource(cl->context, 1, &srcp, nullptr, &err);
  CL_OK(err);
  if (clBuildProgram(prog, 1, &cl->device, "", nullptr, nullptr) != CL_SUCCESS) {
    size_t n = 0;
    clGetProgramBuildInfo(prog, cl->device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
    std::string log(n, '\0');
    clGetProgramBuildInfo(prog, cl->device, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr);
    FAIL() << "OpenCL build failed on " << cl->name << ":\n" << log.substr(0, 20000);
  }

  // 3. Run each launch on the device and compare.
  int checked = 0;
  for (Job& j : jobs) {
    SCOPED_TRACE(j.label);
    cl_kernel k = clCreateKernel(prog, j.kernel.entry.c_str(), &err);
    CL_OK(err);
    std::vector<cl_mem> mems;
    auto upload = [&](const TensorArg& t, bool out) {
      const size_t bytes = std::max<size_t>(16, DTypeBytes(t.dtype, Extent(t)));
      cl_mem m = clCreateBuffer(cl->context, CL_MEM_READ_WRITE, bytes, nullptr, &err);
      if (!out && Extent(t) > 0) {
        clEnqueueWriteBuffer(cl->queue, m, CL_TRUE, 0, DTypeBytes(t.dtype, Extent(t)), t.data, 0,
                             nullptr, nullptr);
      }
      mems.push_back(m);
      return m;
    };
    cl_mem out = upload(j.args.output, true);
    CL_OK(clSetKernelArg(k, 0, sizeof(cl_mem), &out));
    for (size_t i = 0; i < j.inputs.size(); ++i) {
      cl_mem m = upload(j.inputs[i], false);
      CL_OK(clSetKernelArg(k, static_cast<cl_uint>(i + 1), sizeof(cl_mem), &m));
    }
    LaunchArgs a = j.args;
    a.inputs = j.inputs.data();
    const DeviceLaunch launch(j.spec);
    std::vector<int64_t> meta(launch.meta_size());
    launch.PackMeta(a, {}, meta);
    CL_OK(
        clSetKernelArg(k, static_cast<cl_uint>(j.inputs.size() + 1), meta.size() * 8, meta.data()));
    const DeviceGeometry geo = launch.Geometry(a);
    const size_t global = static_cast<size_t>(geo.global_size);
    const size_t local = static_cast<size_t>(geo.local_size);
    CL_OK(clEnqueueNDRangeKernel(cl->queue, k, 1, nullptr, &global, &local, 0, nullptr, nullptr));
    // Read back into a host copy of the output view, then compare densely.
    std::vector<uint8_t> host(std::max<size_t>(16, DTypeBytes(a.output.dtype, Extent(a.output))));
    CL_OK(clEnqueueReadBuffer(cl->queue, out, CL_TRUE, 0,
                              DTypeBytes(a.output.dtype, Extent(a.output)), host.data(), 0, nullptr,
                              nullptr));
    TensorArg got_view = a.output;
    got_view.data = host.data();
    const std::vector<double> got = DenseValues(got_view);
    ASSERT_EQ(got.size(), j.expected.size());
    const DType t = a.output.dtype;
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double e = j.expected[i], g = got[i];
      ASSERT_EQ(std::isnan(e), std::isnan(g)) << "element " << i << ": want " << e << " got " << g;
      if (std::isnan(e)) continue;
      ASSERT_EQ(std::isinf(e), std::isinf(g)) << "element " << i << ": want " << e << " got " << g;
      if (std::isinf(e)) {
        ASSERT_EQ(e, g) << "element " << i;
        continue;
      }
      if (!IsFloat(t)) {
        ASSERT_EQ(e, g) << "element " << i;
        continue;
      }
      num += (e - g) * (e - g);
      den += e * e;
    }
    const double tol = harness::Tolerance(t);
    EXPECT_LE(num / std::max(den, 1e-30), std::max(tol, 1e-12)) << j.kernel.code.substr(0, 4000);
    ++checked;
    for (cl_mem m : mems) clReleaseMemObject(m);
    clReleaseKernel(k);
  }
  clReleaseProgram(prog);
  std::set<std::string> ran;
  for (const Job& j : jobs) ran.insert(j.spec.name);
  for (int i = 0; i < static_cast<int>(OpKind::kNumOps); ++i) {
    const OpDef& def = GetOpDef(static_cast<OpKind>(i));
    if (def.pointwise == nullptr && def.reduce == nullptr) continue;
    EXPECT_TRUE(ran.count(def.name)) << "no device check of " << def.name << "'s form";
  }
  std::printf("checked %d generated OpenCL kernels on %s\n", checked, cl->name.c_str());
}

}  // namespace
}  // namespace kiln::compiler
