// The device kernel layer (device_kernels.h): KernelHost::GetKernel and the launchers.
#include "backends/common/device_kernels.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numbers>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "backends/common/cl_sources.h"
#include "engine/compiler/hash.h"
#include "engine/ops.h"
#include "spdlog/spdlog.h"

namespace kiln::devk {
namespace {

size_t Groups(int64_t items, size_t wg) {
  return std::min<size_t>((static_cast<size_t>(items) + wg - 1) / wg, 65536);
}

std::string Lower(DType t) { return DTypeName(t); }

// Template instantiation: `#define`s, the template, `#undef`s (several instantiations share
// one program).
class Defines {
 public:
  void Add(std::string name, std::string value) {
    d_.emplace_back(std::move(name), std::move(value));
  }
  std::string Wrap(std::string_view body, std::string_view before = "") const {
    std::string s;
    for (const auto& [n, v] : d_) absl::StrAppend(&s, "#define ", n, " ", v, "\n");
    absl::StrAppend(&s, ToAbsl(before), ToAbsl(body), "\n");
    for (const auto& [n, v] : d_) {
      const size_t paren = n.find('(');
      absl::StrAppend(&s, "#undef ", paren == std::string::npos ? n : n.substr(0, paren), "\n");
    }
    return s;
  }

 private:
  std::vector<std::pair<std::string, std::string>> d_;
};

// Loader macro body for an element of `t` as `acc` (float or double).
std::string LoadAs(DType t, DType acc) {
  if (acc == DType::kF64) {
    if (t == DType::kF64) return "ldd_f64(p, i)";
    return absl::StrCat("(double)ldf_", Lower(t), "(p, i)");
  }
  return absl::StrCat("ldf_", Lower(t), "(p, i)");
}
std::string StoreFrom(DType t, DType acc) {
  return absl::StrCat(acc == DType::kF64 ? "std_" : "stf_", Lower(t), "(p, i, v)");
}

// ---- Generated: pointwise, reductions, fused groups ---------------------------------------------

// A kernel from the engine's printer: typed buffers plus its KMeta (compiler::DeviceLaunch).
// Tensors reach it as buffer + element offset; device addresses resolve to a byte
// offset, which is a whole number of elements for every tensor the engine makes.
struct GenData {
  KernelSlot* slot = nullptr;
  compiler::DeviceLaunch launch;
  std::vector<int64_t> elem_bytes;  // output, then each input
};

void GenFn(const LaunchArgs& a, const ExecCtx& c) {
  const GenData& d = *static_cast<const GenData*>(a.kernel_data);
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  if (a.output.numel() == 0) return;
  Args args;
  int64_t offsets[Args::kMaxMems];
  const int n = std::min(a.num_inputs + 1, Args::kMaxMems);  // Generated() checked the count
  for (int i = 0; i < n; ++i) {
    const int64_t bytes = args.Mem(dev, i == 0 ? a.output.data : a.inputs[i - 1].data);
    if (bytes % d.elem_bytes[i] != 0) {
      ex.Fail(Internal(ex.host->kernel_prefix(), " kernel ", d.slot->name(), ": tensor ", i,
                       " starts at byte ", bytes, ", not at an element boundary"));
      return;
    }
    offsets[i] = bytes / d.elem_bytes[i];
  }
  const std::span<int64_t> meta = args.Reserve(d.launch.meta_size());
  if (!meta.empty()) d.launch.PackMeta(a, std::span<const int64_t>(offsets, n), meta);
  const compiler::DeviceGeometry g = d.launch.Geometry(a);
  const size_t global = static_cast<size_t>(g.global_size),
               local = static_cast<size_t>(g.local_size);
  ex.Enqueue(d.slot, args, 1, &global, &local, d.launch.meta_size());
}

StatusOr<backend::Kernel> Generated(KernelHost& dev, const compiler::KernelSpec& spec,
                                    std::string name) {
  if (!dev.fp64() && compiler::UsesF64(spec)) {
    return Unimplemented(dev.name(), " has no f64 support (", dev.no_fp64_reason(), ")");
  }
  auto d = std::make_shared<GenData>();
  d->launch = compiler::DeviceLaunch(spec, dev.codegen_options());
  const size_t nargs = spec.args.size() + 1;
  if (nargs > static_cast<size_t>(Args::kMaxMems) || d->launch.meta_size() > Args::kMaxMeta ||
      (d->launch.meta_size() + nargs) * 8 > dev.max_param_bytes()) {
    return Unimplemented("too many inputs for one device kernel (", spec.args.size(), ")");
  }
  KILN_ASSIGN_OR_RETURN(compiler::GeneratedKernel g,
                        compiler::GenerateKernel(spec, dev.dialect(), dev.codegen_options()));
  d->slot = dev.DeclareGenerated(g);
  d->elem_bytes.push_back(DTypeBytes(spec.out_dtype, 1));
  for (const compiler::KernelArg& arg : spec.args)
    d->elem_bytes.push_back(DTypeBytes(arg.dtype, 1));
  return backend::Kernel{GenFn, std::move(d), std::move(name)};
}

std::string Label(const backend::KernelRequest& req) {
  std::string s = OpName(req.op);
  for (const TensorType& t : req.inputs) absl::StrAppend(&s, " ", DTypeName(t.dtype));
  absl::StrAppend(&s, " -> ", DTypeName(req.output.dtype));
  return s;
}

// ---- Library kernels
// ------------------------------------------------------------------------------

struct LibData {
  KernelSlot* slot = nullptr;
  int64_t extra = 0;  // op-specific (concat axis)
};
const LibData& Lib(const LaunchArgs& a) { return *static_cast<const LibData*>(a.kernel_data); }

void DimValueFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  Args args;
  args.Long(args.Mem(*ex.host, a.output.data));
  args.Long(static_cast<int64_t>(a.output.dtype));
  args.Long(a.params[0]);
  const size_t wg = ex.host->work_group();
  ex.Enqueue(Lib(a).slot, args, 1, &wg, &wg, 8);
}

// out (a view) = x, elementwise with conversion.
void EnqueueCopy(Queue& ex, KernelSlot* k, const TensorArg& out, int64_t out_byte_offset_delta,
                 const TensorArg& x) {
  const KernelHost& dev = *ex.host;
  const int64_t n = x.numel();
  if (n == 0) return;
  Args args;
  const int64_t oo = args.Mem(dev, out.data) + out_byte_offset_delta;
  const int64_t xo = args.Mem(dev, x.data);
  TensorArg view = out;
  for (int d = 0; d < x.rank; ++d) view.shape[d] = x.shape[d];
  args.Desc(view, oo);
  args.Desc(x, xo);
  args.Long(static_cast<int64_t>(out.dtype));
  args.Long(static_cast<int64_t>(x.dtype));
  args.Long(n);
  const size_t wg = dev.work_group(), global = Groups(n, wg) * wg;
  ex.Enqueue(k, args, 1, &global, &wg, 48);
}

void ContiguousFn(const LaunchArgs& a, const ExecCtx& c) {
  EnqueueCopy(QueueOf(c), Lib(a).slot, a.output, 0, a.inputs[0]);
}

void ConcatFn(const LaunchArgs& a, const ExecCtx& c) {
  const int axis = static_cast<int>(Lib(a).extra);
  int64_t start = 0;
  for (int j = 0; j < a.num_inputs; ++j) {
    EnqueueCopy(QueueOf(c), Lib(a).slot, a.output,
                ByteOffset(a.output.dtype, start * a.output.strides[axis]), a.inputs[j]);
    start += a.inputs[j].shape[axis];
  }
}

int64_t RowElems(const TensorArg& t, int from) {
  int64_t n = 1;
  for (int d = from; d < t.rank; ++d) n *= t.shape[d];
  return n;
}

void GatherFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &table = a.inputs[0], &idx = a.inputs[1], &o = a.output;
  const int64_t row = RowElems(table, 1), count = idx.numel();
  Args args;
  const int64_t oo = args.Mem(dev, o.data), to = args.Mem(dev, table.data),
                io = args.Mem(dev, idx.data);
  args.Desc(table, to);
  args.Desc(idx, io);
  args.Desc(o, oo);
  for (DType t : {table.dtype, idx.dtype, o.dtype}) args.Long(static_cast<int64_t>(t));
  args.Long(row);
  args.Long(count);
  const size_t wg = dev.work_group(), global = Groups(row * count, wg) * wg;
  ex.Enqueue(Lib(a).slot, args, 1, &global, &wg, 64);
}

void ScatterAddRowsFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &idx = a.inputs[0], &src = a.inputs[1], &o = a.output;
  const int64_t row = RowElems(o, 1), count = idx.numel();
  Args args;
  const int64_t oo = args.Mem(dev, o.data), io = args.Mem(dev, idx.data),
                so = args.Mem(dev, src.data);
  args.Desc(idx, io);
  args.Desc(src, so);
  args.Desc(o, oo);
  for (DType t : {idx.dtype, src.dtype, o.dtype}) args.Long(static_cast<int64_t>(t));
  args.Long(row);
  args.Long(count);
  const size_t wg = dev.work_group(), global = Groups(row, wg) * wg;
  ex.Enqueue(Lib(a).slot, args, 1, &global, &wg, 64);
}

void TakeAlongFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &x = a.inputs[0], &idx = a.inputs[1], &o = a.output;
  const int64_t n = o.numel();
  Args args;
  const int64_t oo = args.Mem(dev, o.data), xo = args.Mem(dev, x.data),
                io = args.Mem(dev, idx.data);
  args.Desc(x, xo);
  args.Desc(idx, io);
  args.Desc(o, oo);
  for (DType t : {x.dtype, idx.dtype, o.dtype}) args.Long(static_cast<int64_t>(t));
  args.Long(n);
  const size_t wg = dev.work_group(), global = Groups(n, wg) * wg;
  ex.Enqueue(Lib(a).slot, args, 1, &global, &wg, 64);
}

void ScatterAddAlongFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &idx = a.inputs[0], &src = a.inputs[1], &o = a.output;
  const int64_t K = src.shape[src.rank - 1], N = o.shape[o.rank - 1];
  const int64_t rows = K > 0 ? src.numel() / K : RowElems(o, 0) / std::max<int64_t>(N, 1);
  Args args;
  const int64_t oo = args.Mem(dev, o.data), io = args.Mem(dev, idx.data),
                so = args.Mem(dev, src.data);
  args.Desc(idx, io);
  args.Desc(src, so);
  args.Desc(o, oo);
  for (DType t : {idx.dtype, src.dtype, o.dtype}) args.Long(static_cast<int64_t>(t));
  args.Long(rows);
  args.Long(K);
  args.Long(N);
  const size_t wg = dev.work_group(), global = Groups(rows, wg) * wg;
  ex.Enqueue(Lib(a).slot, args, 1, &global, &wg, 64);
}

void TopKFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &x = a.inputs[0], &o = a.output;
  const int64_t N = x.shape[x.rank - 1], K = o.shape[o.rank - 1];
  const int64_t rows = N > 0 ? x.numel() / N : 0;
  Args args;
  const int64_t oo = args.Mem(dev, o.data), xo = args.Mem(dev, x.data);
  args.Desc(x, xo);
  args.Desc(o, oo);
  args.Long(static_cast<int64_t>(x.dtype));
  args.Long(static_cast<int64_t>(o.dtype));
  args.Long(rows);
  args.Long(N);
  args.Long(K);
  const size_t wg = dev.work_group(), global = std::min<size_t>(rows, 65536) * wg;
  ex.Enqueue(Lib(a).slot, args, 1, &global, &wg, 48);
}

void KvWriteFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &x = a.inputs[1], &slots = a.inputs[2], &cache = a.output;
  Args args;
  const int64_t co = args.Mem(dev, cache.data), xo = args.Mem(dev, x.data),
                so = args.Mem(dev, slots.data);
  args.Desc(cache, co);
  args.Desc(x, xo);
  args.Desc(slots, so);
  for (DType t : {cache.dtype, x.dtype, slots.dtype}) args.Long(static_cast<int64_t>(t));
  const size_t wg = dev.work_group(), global = Groups(x.numel(), wg) * wg;
  ex.Enqueue(Lib(a).slot, args, 1, &global, &wg, 64);
}

// ---- Rope -------------------------------------------------------------------------------------

// Inverse frequencies: kiln::RopeInvFreq (engine/ops.h); the tables are made on the host
// in double.
struct RopeData {
  KernelSlot* slot = nullptr;
  std::unique_ptr<backend::Buffer> freq;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  bool inverse = false;
};

void RopeFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const RopeData& d = *static_cast<const RopeData*>(a.kernel_data);
  const TensorArg &x = a.inputs[0], &pos = a.inputs[1], &o = a.output;
  const int64_t H = x.shape[x.rank - 2], D = x.shape[x.rank - 1];
  const int64_t lead = D > 0 && H > 0 ? x.numel() / (H * D) : 0;
  Args args;
  const int64_t oo = args.Mem(dev, o.data), xo = args.Mem(dev, x.data),
                po = args.Mem(dev, pos.data);
  args.Mem(dev, d.freq->data());
  args.Desc(x, xo);
  args.Desc(pos, po);
  args.Desc(o, oo);
  for (DType t : {x.dtype, pos.dtype, o.dtype}) args.Long(static_cast<int64_t>(t));
  args.Long(H);
  args.Long(D);
  args.Long(d.rotary_dim);
  args.Long(d.interleaved ? 1 : 0);
  args.Long(d.inverse ? -1 : 1);
  args.Long(lead);
  const int64_t n = lead * H * (d.rotary_dim / 2 + (D - d.rotary_dim));
  const size_t wg = dev.work_group(), global = Groups(n, wg) * wg;
  ex.Enqueue(d.slot, args, 1, &global, &wg, 64);
}

StatusOr<backend::Kernel> MakeRope(KernelHost& dev, const backend::KernelRequest& req) {
  const Attrs& at = *req.attrs;
  auto d = std::make_shared<RopeData>();
  d->slot = dev.LibraryKernel("rope");
  d->rotary_dim = at.ints[0];
  d->interleaved = at.ints[1] == 1;
  d->inverse = at.ints[3] != 0;
  const int64_t half = std::max<int64_t>(d->rotary_dim / 2, 1);
  std::vector<unsigned char> bytes;
  if (dev.fp64()) {
    std::vector<double> f(half);
    for (int64_t i = 0; i < half; ++i) f[i] = RopeInvFreq(at, i);
    bytes.resize(f.size() * sizeof(double));
    std::memcpy(bytes.data(), f.data(), bytes.size());
  } else {
    // Turns per position as an unevaluated float pair (hi + lo).
    std::vector<float> f(2 * half);
    for (int64_t i = 0; i < half; ++i) {
      const double turns = RopeInvFreq(at, i) / (2 * std::numbers::pi);
      f[2 * i] = static_cast<float>(turns);
      f[2 * i + 1] = static_cast<float>(turns - static_cast<double>(f[2 * i]));
    }
    bytes.resize(f.size() * sizeof(float));
    std::memcpy(bytes.data(), f.data(), bytes.size());
  }
  KILN_ASSIGN_OR_RETURN(d->freq, dev.Allocate(bytes.size()));
  KILN_RETURN_IF_ERROR(dev.Upload(*d->freq, bytes.data(), bytes.size()));
  return backend::Kernel{RopeFn, std::move(d), absl::StrCat(dev.kernel_prefix(), ".lib.rope")};
}

// ---- Linear and MatMul ------------------------------------------------------------------------

bool IsBlock32(DType t) {
  return t == DType::kQ4_0 || t == DType::kQ4_1 || t == DType::kQ8_0 || t == DType::kMXFP4;
}

// Weight rows per work-group of the sub-group Linear kernel (LINEAR_SG): small work-groups, so
// that the narrow projections of small models (N = 192) still spread over the GPU's SMs.
constexpr int kLinearSgRows = 2;

// `sg`: the sub-group kernel (LINEAR_SG) for devices with linear_lanes(), else the work-group one.
KernelSlot* LinearTemplate(KernelHost& dev, DType xt, DType wt, DType ot, int mt, bool sg) {
  const DType acc = xt == DType::kF64 ? DType::kF64 : DType::kF32;
  Defines d;
  d.Add(sg ? "LINEAR_SG" : "LINEAR", "1");
  d.Add("MT", absl::StrCat(mt));
  if (sg) d.Add("SGR", absl::StrCat(kLinearSgRows));
  d.Add("ACC", acc == DType::kF64 ? "double" : "float");
  d.Add("XLD(p, i)", LoadAs(xt, acc));
  d.Add("WLD(p, i)", LoadAs(wt, acc));
  d.Add("OST(p, i, v)", StoreFrom(ot, acc));
  if (IsBlock32(wt) && acc == DType::kF32 && sg) {
    d.Add("WDEQ8(wv, p, e)", absl::StrCat("deq8_", Lower(wt), "(wv, p, e)"));
  } else if (IsBlock32(wt) && acc == DType::kF32 && !dev.element_block_weights()) {
    d.Add("WDEQ32(wv, p, e)", absl::StrCat("deq32_", Lower(wt), "(wv, p, e)"));
  }
  return dev.DeclareKernel(absl::StrCat(sg ? "linear_sg_" : "linear_", Lower(wt)),
                           d.Wrap(kClLinear, absl::StrCat("// linear x ", Lower(xt), " w ",
                                                          Lower(wt), " -> ", Lower(ot), "\n")));
}

KernelSlot* MatMulTemplate(KernelHost& dev, DType t) {
  const DType acc = t == DType::kF64 ? DType::kF64 : DType::kF32;
  int ts = 1;
  while ((ts * 2) * (ts * 2) <= static_cast<int>(dev.work_group())) ts *= 2;
  Defines d;
  d.Add("MATMUL", "1");
  d.Add("TS", absl::StrCat(ts));
  d.Add("ACC", acc == DType::kF64 ? "double" : "float");
  d.Add("XLD(p, i)", LoadAs(t, acc));
  d.Add("WLD(p, i)", LoadAs(t, acc));
  d.Add("OST(p, i, v)", StoreFrom(t, acc));
  return dev.DeclareKernel(absl::StrCat("matmul_", Lower(t)), d.Wrap(kClLinear));
}

int MatMulTile(const KernelHost& dev) {
  int ts = 1;
  while ((ts * 2) * (ts * 2) <= static_cast<int>(dev.work_group())) ts *= 2;
  return ts;
}

// A BLAS view of a 2-D (rows x cols) operand with strides (sr, sc): row-major with leading
// dimension ld (trans = false), or column-major (trans = true: the transpose is row-major).
struct BlasMat {
  bool ok = false;
  bool trans = false;
  size_t ld = 0;
};
BlasMat AsBlas(int64_t rows, int64_t cols, int64_t sr, int64_t sc) {
  BlasMat m;
  if (rows <= 1) sr = std::max<int64_t>(cols, 1) * (sc == 0 ? 1 : sc);
  if (cols <= 1) sc = 1;
  if (sc == 1 && sr >= std::max<int64_t>(cols, 1)) {
    m.ok = true;
    m.ld = static_cast<size_t>(sr);
  } else if (sr == 1 && sc >= std::max<int64_t>(rows, 1)) {
    m.ok = true;
    m.trans = true;
    m.ld = static_cast<size_t>(sc);
  }
  return m;
}

// The single stride that walks the flattened dims [from, to) of `t` (0 if all broadcast), or
// -1 if there is none.
int64_t CollapsedStride(const TensorArg& t, int from, int to) {
  int64_t stride = -1, inner = 1;
  bool all_zero = true;
  for (int d = to - 1; d >= from; --d) {
    if (t.shape[d] == 1) continue;
    if (t.strides[d] != 0) all_zero = false;
    if (stride < 0) {
      stride = t.strides[d];
    } else if (t.strides[d] != stride * inner) {
      return all_zero ? 0 : -1;
    }
    inner *= t.shape[d];
  }
  if (all_zero) return 0;
  return stride < 0 ? 0 : stride;
}

// The operand of a BLAS call: the buffer behind `addr`, at element offset `byte_off / size`.
// False when the offset is not a whole number of elements.
bool BlasOperand(const KernelHost& dev, const void* addr, DType t, const BlasMat& m,
                 size_t batch_stride, GemmOperand* out) {
  size_t off = 0;
  if (!dev.Resolve(addr, &out->mem, &off)) return false;
  const size_t es = static_cast<size_t>(DTypeBlockBytes(t));
  if (off % es != 0) return false;
  out->offset = off / es;
  out->ld = m.ld;
  out->trans = m.trans;
  out->batch_stride = batch_stride;
  return true;
}

struct GemmData {
  bool blas = false;            // the host's BLAS has a GEMM for the dtype
  KernelSlot* small = nullptr;  // Linear: MT = 1 (decode); MatMul: the tiled kernel
  KernelSlot* large = nullptr;  // Linear: MT = 8 (MT = 4 for the sub-group kernel)
  bool sg = false;              // Linear: small and large are sub-group kernels (LINEAR_SG)
  KernelSlot* cast = nullptr;   // Linear: converts the weight for a BLAS GEMM (copy_strided)
};

void MatMulFn(const LaunchArgs& a, const ExecCtx& c);
void LinearFn(const LaunchArgs& a, const ExecCtx& c);

void MatMulFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const GemmData& d = *static_cast<const GemmData*>(a.kernel_data);
  const TensorArg &x = a.inputs[0], &y = a.inputs[1], &o = a.output;
  const int r = o.rank;
  const int64_t M = o.shape[r - 2], N = o.shape[r - 1], K = x.shape[r - 1];
  int64_t batch = 1;
  for (int i = 0; i < r - 2; ++i) batch *= o.shape[i];
  if (M == 0 || N == 0 || batch == 0) return;
  if (d.blas && K > 0) {
    const BlasMat am = AsBlas(M, K, x.strides[r - 2], x.strides[r - 1]);
    const BlasMat bm = AsBlas(K, N, y.strides[r - 2], y.strides[r - 1]);
    const BlasMat cm = AsBlas(M, N, o.strides[r - 2], o.strides[r - 1]);
    const int64_t sa = CollapsedStride(x, 0, r - 2), sb = CollapsedStride(y, 0, r - 2),
                  sc = CollapsedStride(o, 0, r - 2);
    if (am.ok && bm.ok && cm.ok && !cm.trans && sa >= 0 && sb >= 0 && sc >= 0 &&
        (batch == 1 || sc > 0)) {
      if (ex.DeferWhileCapturing(MatMulFn, a)) return;
      GemmCall call;
      call.dtype = o.dtype;
      call.batch = static_cast<size_t>(batch);
      call.m = static_cast<size_t>(M);
      call.n = static_cast<size_t>(N);
      call.k = static_cast<size_t>(K);
      if (BlasOperand(dev, x.data, o.dtype, am, static_cast<size_t>(sa), &call.a) &&
          BlasOperand(dev, y.data, o.dtype, bm, static_cast<size_t>(sb), &call.b) &&
          BlasOperand(dev, o.data, o.dtype, cm, static_cast<size_t>(sc), &call.c) &&
          ex.Gemm(call)) {
        return;
      }
    }
  }
  Args args;
  const int64_t oo = args.Mem(dev, o.data), xo = args.Mem(dev, x.data), yo = args.Mem(dev, y.data);
  args.Desc(x, xo);
  args.Desc(y, yo);
  args.Desc(o, oo);
  args.Long(M);
  args.Long(N);
  args.Long(K);
  args.Long(batch);
  const size_t ts = static_cast<size_t>(MatMulTile(dev));
  const size_t global[3] = {(static_cast<size_t>(N) + ts - 1) / ts * ts,
                            (static_cast<size_t>(M) + ts - 1) / ts * ts,
                            static_cast<size_t>(batch)};
  const size_t local[3] = {ts, ts, 1};
  ex.Enqueue(d.small, args, 3, global, local, 64);
}

// Linear with a weight of another dtype than the activations: the weight converted into the
// queue's scratch (f32, [N, K] row-major), then the BLAS GEMM. False when the host has no
// scratch or the BLAS declines (the templates run instead).
bool LinearThroughCast(Queue& ex, const GemmData& d, const TensorArg& x, const TensorArg& w,
                       const TensorArg& o, int64_t M) {
  const KernelHost& dev = *ex.host;
  const int64_t K = x.shape[x.rank - 1], N = w.shape[0];
  const int64_t sx = CollapsedStride(x, 0, x.rank - 1), so = CollapsedStride(o, 0, o.rank - 1);
  const BlasMat am = AsBlas(M, K, sx, x.strides[x.rank - 1]);
  const BlasMat cm = AsBlas(M, N, so, o.strides[o.rank - 1]);
  if (sx < 0 || so < 0 || !am.ok || !cm.ok || cm.trans) return false;
  void* scratch = ex.Scratch(static_cast<size_t>(DTypeBytes(o.dtype, N * K)));
  if (scratch == nullptr) return false;
  TensorArg wf;
  wf.data = scratch;
  wf.dtype = o.dtype;
  wf.rank = 2;
  wf.shape[0] = N;
  wf.shape[1] = K;
  wf.strides[0] = K;
  wf.strides[1] = 1;
  EnqueueCopy(ex, d.cast, wf, 0, w);
  GemmCall call;
  call.dtype = o.dtype;
  call.m = static_cast<size_t>(M);
  call.n = static_cast<size_t>(N);
  call.k = static_cast<size_t>(K);
  const BlasMat bm = AsBlas(K, N, 1, K);  // w^T: (K x N), strides (1, K)
  return BlasOperand(dev, x.data, o.dtype, am, 0, &call.a) &&
         BlasOperand(dev, scratch, o.dtype, bm, 0, &call.b) &&
         BlasOperand(dev, o.data, o.dtype, cm, 0, &call.c) && ex.Gemm(call);
}

void LinearFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const GemmData& d = *static_cast<const GemmData*>(a.kernel_data);
  const TensorArg &x = a.inputs[0], &w = a.inputs[1], &o = a.output;
  const int64_t K = x.shape[x.rank - 1], N = w.shape[0];
  const int64_t M = K > 0 ? x.numel() / K : RowElems(o, 0) / std::max<int64_t>(N, 1);
  if (M == 0 || N == 0) return;
  if (d.cast != nullptr && M >= kCastGemmRows && K > 0 && LinearThroughCast(ex, d, x, w, o, M)) {
    return;
  }
  if (d.blas && K > 0) {
    const int64_t sx = CollapsedStride(x, 0, x.rank - 1), so = CollapsedStride(o, 0, o.rank - 1);
    const BlasMat am = AsBlas(M, K, sx, x.strides[x.rank - 1]);
    // w [N, K] used as B^T: B = w^T is (K x N) with strides (w.s1, w.s0).
    const BlasMat bm = AsBlas(K, N, w.strides[1], w.strides[0]);
    const BlasMat cm = AsBlas(M, N, so, o.strides[o.rank - 1]);
    if (sx >= 0 && so >= 0 && am.ok && bm.ok && cm.ok && !cm.trans) {
      if (ex.DeferWhileCapturing(LinearFn, a)) return;
      GemmCall call;
      call.dtype = o.dtype;
      call.m = static_cast<size_t>(M);
      call.n = static_cast<size_t>(N);
      call.k = static_cast<size_t>(K);
      if (BlasOperand(dev, x.data, o.dtype, am, 0, &call.a) &&
          BlasOperand(dev, w.data, o.dtype, bm, 0, &call.b) &&
          BlasOperand(dev, o.data, o.dtype, cm, 0, &call.c) && ex.Gemm(call)) {
        return;
      }
    }
  }
  Args args;
  const int64_t oo = args.Mem(dev, o.data), xo = args.Mem(dev, x.data), wo = args.Mem(dev, w.data);
  args.Desc(x, xo);
  args.Long(wo);
  args.Long(w.strides[0]);
  args.Long(w.strides[1]);
  args.Desc(o, oo);
  args.Long(M);
  args.Long(N);
  args.Long(K);
  if (d.sg) {
    // A sub-group per weight row; MT = 4 reads the weights once for up to 4 rows of x.
    const size_t lanes = static_cast<size_t>(dev.linear_lanes()), rows = kLinearSgRows;
    const bool small = M == 1;
    const size_t mt = small ? 1 : 4;
    const size_t global[2] = {(static_cast<size_t>(N) + rows - 1) / rows * rows * lanes,
                              (static_cast<size_t>(M) + mt - 1) / mt};
    const size_t local[2] = {rows * lanes, 1};
    ex.Enqueue(small ? d.small : d.large, args, 2, global, local, 48);
    return;
  }
  const bool small = M <= 4;
  const size_t mt = small ? 1 : 8, wg = dev.work_group();
  const size_t global[2] = {(static_cast<size_t>(N) + 3) / 4 * wg,
                            (static_cast<size_t>(M) + mt - 1) / mt};
  const size_t local[2] = {wg, 1};
  ex.Enqueue(small ? d.small : d.large, args, 2, global, local, 48);
}

// Device scratch that kernels keep between launches, per queue (streams run concurrently;
// each runs its launches in order). Grow-only, by doubling: a buffer stays alive until the
// kernel goes, since work in flight or captured in a graph may still use it.
class QueueScratch {
 public:
  // A buffer of at least `bytes` for launches on `q`; null with `*status` set on failure.
  backend::Buffer* Get(KernelHost& dev, const Queue* q, size_t bytes, Status* status) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::unique_ptr<backend::Buffer>>& bufs = buffers_[q];
    if (bufs.empty() || bufs.back()->size() < bytes) {
      const size_t grow = std::max(bytes, bufs.empty() ? size_t{0} : 2 * bufs.back()->size());
      StatusOr<std::unique_ptr<backend::Buffer>> b = dev.Allocate(grow);
      if (!b.ok()) {
        *status = b.status();
        return nullptr;
      }
      bufs.push_back(*std::move(b));
    }
    return bufs.back().get();
  }

 private:
  std::mutex mu_;
  std::map<const Queue*, std::vector<std::unique_ptr<backend::Buffer>>> buffers_;
};

// ---- Attention ----------------------------------------------------------------------------------

// The block table of an attention kernel whose mask is not a plain causal or sliding-window
// one (attention.cl's BLOCKS): classified by `classify` before each launch into the queue's
// scratch: the table, then the visit counts (a uint per work-group row).
struct BlockTable {
  KernelSlot* classify = nullptr;
  bool paged = false;                        // tiles of query tokens (no batch rows)
  bool per_batch = false, per_head = false;  // whether the mask reads b, h
  QueueScratch scratch;
  // The last launch's, for LastBlockTableStats.
  std::mutex mu;
  backend::Buffer* last = nullptr;
  size_t entries = 0, visits_offset = 0;
  int64_t rows = 0;
};

struct AttnData {
  KernelSlot* slot = nullptr;
  bool paged = false;
  bool lse = false;  // dense attention's second output, the log-sum-exp
  int num_aux = 0;
  double scale = 0;
  bool library = false;  // causal, no score_mod, no aux: Queue::Attention(Backward) may run it
  std::unique_ptr<BlockTable> blocks;  // null: the kernel walks every block of its key range
};

// The aux tensors of an attention launch (inputs from `first`): their buffers (after the
// fixed ones), then, last in the meta, their offset, length and stride (AUX_SETUP's).
std::vector<int64_t> AttentionAuxMems(Args& args, const KernelHost& dev, const LaunchArgs& a,
                                      int first, int num_aux) {
  std::vector<int64_t> off;
  for (int i = 0; i < num_aux; ++i) off.push_back(args.Mem(dev, a.inputs[first + i].data));
  return off;
}
void AttentionAuxMeta(Args& args, const LaunchArgs& a, int first, std::span<const int64_t> off) {
  for (size_t i = 0; i < off.size(); ++i) {
    const TensorArg& t = a.inputs[first + static_cast<int>(i)];
    args.Long(off[i]);
    args.Long(t.rank > 0 ? t.shape[0] : 1);
    args.Long(t.rank > 0 ? t.strides[0] : 0);
  }
}
// The scale as the templates read it: double bits (f64 devices), then float bits.
void AttentionScale(Args& args, double scale) {
  int64_t dbits;
  std::memcpy(&dbits, &scale, 8);
  const float fscale = static_cast<float>(scale);
  int32_t fbits;
  std::memcpy(&fbits, &fscale, 4);
  args.Long(dbits);
  args.Long(fbits);
}

// Classifies the blocks of a launch with `rows` work-group rows (aux tensors: inputs from
// `aux_first`), then adds the table as the attention's next buffer argument and returns
// BLOCK_META's values (empty on failure, recorded in `ex`). Dense: q [B, Hq, Tq], k [.., Tk].
// Paged: q [T, Hq, ..], the caches [NB, BS, ..], block_table [S, MB], seq_lens, query_start
// (inputs 3..5); the table spans the MB * BS key positions a block-table row can address.
std::vector<int64_t> EnqueueBlockTable(Queue& ex, BlockTable& t, const LaunchArgs& a, int aux_first,
                                       int num_aux, Args& attn_args, int64_t rows) {
  KernelHost& dev = *ex.host;
  const TensorArg& q = a.inputs[0];
  const int64_t wg = static_cast<int64_t>(dev.work_group());
  const int64_t Hq = q.shape[1];
  const int64_t B = t.paged ? 1 : q.shape[0], Tq = t.paged ? q.shape[0] : q.shape[2];
  const int64_t Tk = t.paged ? a.inputs[3].shape[1] * a.inputs[1].shape[1] : a.inputs[1].shape[2];
  const int64_t TB = t.per_batch && !t.paged ? B : 1, TH = t.per_head ? Hq : 1;
  const int64_t nqt = (Tq + wg - 1) / wg, nkb = (Tk + wg - 1) / wg;
  const size_t entries = static_cast<size_t>(TB * TH * nqt * nkb);
  const size_t visits = (entries + 7) / 8 * 8;
  Status st;
  backend::Buffer* buf = t.scratch.Get(dev, &ex, visits + 4 * static_cast<size_t>(rows), &st);
  if (buf == nullptr) {
    ex.Fail(st);
    return {};
  }
  {
    std::lock_guard<std::mutex> lock(t.mu);
    t.last = buf;
    t.entries = entries;
    t.visits_offset = visits;
    t.rows = rows;
  }
  Args args;
  const int64_t to = args.Mem(dev, buf->data());
  std::vector<int64_t> meta;  // the CLASSIFY template's, before the aux tensors'
  if (t.paged) {
    const TensorArg &sl = a.inputs[4], &qs = a.inputs[5];
    const int64_t slo = args.Mem(dev, sl.data), qso = args.Mem(dev, qs.data);
    meta = {to, Tq, nkb, TH, a.inputs[3].shape[0], slo, sl.strides[0], qso, qs.strides[0]};
  } else {
    meta = {to, Tq, Tk, TB, TH};
  }
  const std::vector<int64_t> aux_off = AttentionAuxMems(args, dev, a, aux_first, num_aux);
  for (int64_t v : meta) args.Long(v);
  AttentionAuxMeta(args, a, aux_first, aux_off);
  // Dense: a work-group per entry; paged: per (head, token tile).
  const size_t groups = t.paged ? static_cast<size_t>(TH * nqt) : entries;
  if (groups > 0) {
    const size_t global = std::min<size_t>(groups, 65536) * dev.work_group(),
                 local = dev.work_group();
    ex.Enqueue(t.classify, args, 1, &global, &local, 32);
  }
  const int64_t tto = attn_args.Mem(dev, buf->data());
  return {tto, TB > 1 ? TH * nqt * nkb : 0, t.per_head ? nqt * nkb : 0, nkb,
          tto + static_cast<int64_t>(visits)};
}

void AttentionFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const AttnData& d = *static_cast<const AttnData*>(a.kernel_data);
  const TensorArg &q = a.inputs[0], &k = a.inputs[1], &v = a.inputs[2], &o = a.output;
  if (d.library && ex.Attention({&q, &k, &v, &o, d.lse ? &a.extra_outputs[0] : nullptr, d.scale})) {
    return;
  }
  const int fixed = d.paged ? 6 : 3;
  // Work-group rows: (token, head) paged, (batch, head, query) dense.
  const int64_t rows = q.shape[0] * q.shape[1] * (d.paged ? 1 : q.shape[2]);
  if (rows == 0) return;
  Args args;
  const int64_t oo = args.Mem(dev, o.data), qo = args.Mem(dev, q.data), ko = args.Mem(dev, k.data),
                vo = args.Mem(dev, v.data);
  int64_t bto = 0, slo = 0, qso = 0;
  const int64_t lo = d.lse ? args.Mem(dev, a.extra_outputs[0].data) : 0;
  if (d.paged) {
    bto = args.Mem(dev, a.inputs[3].data);
    slo = args.Mem(dev, a.inputs[4].data);
    qso = args.Mem(dev, a.inputs[5].data);
  }
  std::vector<int64_t> block_meta;
  if (d.blocks) {
    block_meta = EnqueueBlockTable(ex, *d.blocks, a, fixed, d.num_aux, args, rows);
    if (block_meta.empty()) return;
  }
  const std::vector<int64_t> aux_off = AttentionAuxMems(args, dev, a, fixed, d.num_aux);
  args.Desc(q, qo);
  args.Desc(k, ko);
  args.Desc(v, vo);
  args.Desc(o, oo);
  if (d.paged) {
    const TensorArg &bt = a.inputs[3], &sl = a.inputs[4], &qs = a.inputs[5];
    args.Long(bto);
    args.Long(bt.strides[0]);
    args.Long(bt.strides[1]);
    args.Long(bt.shape[0]);
    args.Long(bt.shape[1]);
    args.Long(slo);
    args.Long(sl.strides[0]);
    args.Long(qso);
    args.Long(qs.strides[0]);
  }
  AttentionScale(args, d.scale);
  if (d.lse) {
    const TensorArg& l = a.extra_outputs[0];
    args.Long(lo);
    for (int i = 0; i < 3; ++i) args.Long(l.strides[i]);
  }
  for (int64_t v : block_meta) args.Long(v);
  AttentionAuxMeta(args, a, fixed, aux_off);
  const size_t wg = dev.work_group(), global = std::min<size_t>(rows, 65536) * wg;
  ex.Enqueue(d.slot, args, 1, &global, &wg, d.lse || d.blocks ? 120 : 96);
}

// attention_backward (the template's BACKWARD): dq, dk, dv, then q, k, v, o, do, lse and the
// aux tensors; rank-4 tensors as byte offset and strides (their shapes are q's and k's).
void AttentionBackwardFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const AttnData& d = *static_cast<const AttnData*>(a.kernel_data);
  const TensorArg &q = a.inputs[0], &k = a.inputs[1], &lse = a.inputs[5];
  if (d.library &&
      ex.AttentionBackward({&q, &k, &a.inputs[2], &a.inputs[3], &a.inputs[4], &lse, &a.output,
                            &a.extra_outputs[0], &a.extra_outputs[1], d.scale})) {
    return;
  }
  // Work-group rows: dq rows, then dk/dv rows.
  const int64_t groups =
      q.shape[0] * q.shape[1] * q.shape[2] + k.shape[0] * k.shape[1] * k.shape[2];
  if (groups == 0) return;
  const TensorArg* rank4[] = {&q,           &k,        &a.inputs[2],        &a.inputs[3],
                              &a.inputs[4], &a.output, &a.extra_outputs[0], &a.extra_outputs[1]};
  Args args;
  int64_t off[8];
  for (int t : {5, 6, 7, 0, 1, 2, 3, 4}) off[t] = args.Mem(dev, rank4[t]->data);
  const int64_t lo = args.Mem(dev, lse.data);
  std::vector<int64_t> block_meta;
  if (d.blocks) {
    block_meta = EnqueueBlockTable(ex, *d.blocks, a, 6, d.num_aux, args, groups);
    if (block_meta.empty()) return;
  }
  const std::vector<int64_t> aux_off = AttentionAuxMems(args, dev, a, 6, d.num_aux);
  for (int i : {0, 1, 2}) args.Long(q.shape[i]);  // B, Hq, Tq
  for (int i : {1, 2}) args.Long(k.shape[i]);     // Hkv, Tk
  for (int t = 0; t < 8; ++t) {
    args.Long(off[t]);
    for (int i = 0; i < 4; ++i) args.Long(rank4[t]->strides[i]);
  }
  args.Long(lo);
  for (int i = 0; i < 3; ++i) args.Long(lse.strides[i]);
  AttentionScale(args, d.scale);
  for (int64_t v : block_meta) args.Long(v);
  AttentionAuxMeta(args, a, 6, aux_off);
  const size_t wg = dev.work_group(), global = std::min<size_t>(groups, 65536) * wg;
  ex.Enqueue(d.slot, args, 1, &global, &wg, 96);
}

// The key range a mask allows, from its structure: a causal or sliding-window mask, alone or
// as the first operand of an And (as in attn::DocumentMask). True when the range is the whole
// mask (no block table needed).
bool KvRange(const Expr& mask, std::string* begin, std::string* end) {
  *begin = "0L";
  *end = "len";
  if (!mask) return true;
  if (mask == attn::CausalMask()) {
    *end = "min(len, (q) + 1)";
    return true;
  }
  const ExprNode& n = mask.node();
  if (n.op == ExprOp::kAnd && n.args.size() == 2) {
    const ExprNode& lt = n.args[1].node();
    if (lt.op == ExprOp::kLt && lt.args.size() == 2 && lt.args[1].node().op == ExprOp::kConst &&
        lt.args[1].type() == DType::kI64) {
      const int64_t w = lt.args[1].node().ivalue;
      if (mask == attn::SlidingWindowMask(w)) {
        *begin = absl::StrCat("((q) - ", w, "L + 1)");
        *end = "min(len, (q) + 1)";
        return true;
      }
    }
    KvRange(n.args[0], begin, end);
  }
  return false;
}

// What the attention templates (dense, paged, backward) share in `d`: the q/k/v loaders,
// the head dims, the aux tensors (inputs from `fixed`; their meta from `aux_meta`), the
// mask_mod and score_mod functions (whose code it returns) and the key range. Unimplemented
// for what the templates cannot run.
StatusOr<std::string> AttentionDefines(KernelHost& dev, const backend::KernelRequest& req,
                                       int fixed, int max_aux, int aux_meta, Defines& d) {
  const Attrs& at = *req.attrs;
  const TensorType &q = req.inputs[0], &k = req.inputs[1], &v = req.inputs[2];
  const int num_aux = static_cast<int>(req.inputs.size()) - fixed;
  if (num_aux > max_aux) {
    return Unimplemented(OpName(req.op), " with more than ", max_aux, " aux tensors");
  }
  auto hd = q.shape.back().TryConstant();
  auto hdv = v.shape.back().TryConstant();
  if (!hd || !hdv) return Unimplemented("attention needs constant head dims on ", dev.name());
  const DType acc = ExprTypeOf(q.dtype);
  if (acc == DType::kF64 && !dev.fp64()) {
    return Unimplemented("f64 attention needs f64 support (", dev.no_fp64_reason(), ")");
  }
  const int64_t wg = static_cast<int64_t>(dev.work_group());
  d.Add("ACC", acc == DType::kF64 ? "double" : "float");
  d.Add("ACC_MAX(a, b)", acc == DType::kF64 ? "nmaxd(a, b)" : "nmaxf(a, b)");
  d.Add("QLD(p, i)", LoadAs(q.dtype, acc));
  d.Add("KLD(p, i)", LoadAs(k.dtype, acc));
  d.Add("VLD(p, i)", LoadAs(v.dtype, acc));
  d.Add("HEAD_D", absl::StrCat(std::max<int64_t>(*hd, 1)));
  d.Add("HEAD_DV", absl::StrCat(*hdv));
  d.Add("D_PER", absl::StrCat(std::max<int64_t>((*hd + wg - 1) / wg, 1)));
  d.Add("DV_PER", absl::StrCat(std::max<int64_t>((*hdv + wg - 1) / wg, 1)));
  std::string params, setup, fn_args;
  compiler::ExprFunction mask, score;
  for (int i = 0; i < num_aux; ++i) {
    absl::StrAppend(&params, ", cgptr b_aux", i);
    absl::StrAppend(&setup, "cgptr px", i, " = b_aux", i, " + m[", aux_meta + 3 * i,
                    "]; const long xn", i, " = m[", aux_meta + 3 * i + 1, "], xs", i, " = m[",
                    aux_meta + 3 * i + 2, "]; ");
    absl::StrAppend(&fn_args, ", px", i, ", xn", i, ", xs", i);
    mask.aux.push_back(req.inputs[fixed + i].dtype);
  }
  d.Add("KERNEL_AUX_PARAMS", params);
  d.Add("AUX_SETUP", setup);
  // The modifiers, printed by the engine's printer: (b, h, q_idx, kv_idx) are Index(0..3).
  std::string helpers;
  mask.num_indices = score.num_indices = 4;
  score.aux = mask.aux;
  if (at.expr[0]) {
    mask.name = "KNAME_mask";
    mask.value = at.expr[0];
    d.Add("MASK(b, h, q, kv)", absl::StrCat("KNAME_mask(b, h, q, kv", fn_args, ")"));
  }
  if (at.expr[1]) {
    // As the reference: the modifier runs in the query's compute type.
    score.name = "KNAME_score";
    score.value = Expr::Cast(acc, Substitute(at.expr[1], std::vector<Expr>{Expr::Input(0, acc)}));
    score.inputs = {acc};
    d.Add("SCORE(s, b, h, q, kv)", absl::StrCat("KNAME_score(s, b, h, q, kv", fn_args, ")"));
  }
  for (const compiler::ExprFunction* f : {&mask, &score}) {
    if (!f->value) continue;
    if (!dev.fp64() && compiler::UsesF64(f->value)) {
      return Unimplemented("the attention modifier computes in f64 but the device has no f64 (",
                           dev.no_fp64_reason(), ")");
    }
    KILN_ASSIGN_OR_RETURN(std::string code, compiler::GenerateExprFunction(*f, dev.dialect()));
    absl::StrAppend(&helpers, code);
  }
  std::string begin, end;
  KvRange(at.expr[0], &begin, &end);
  d.Add("KV_BEGIN(q)", begin);
  d.Add("KV_END(q, len)", end);
  return helpers;
}

// The paged template's loaders of the block table, seq_lens and query_start (inputs 3..5).
void PagedDefines(const backend::KernelRequest& req, Defines& d) {
  d.Add("PAGED", "1");
  d.Add("BT_LD(p, i)", absl::StrCat("ldi_", Lower(req.inputs[3].dtype), "(p, i)"));
  d.Add("SL_LD(p, i)", absl::StrCat("ldi_", Lower(req.inputs[4].dtype), "(p, i)"));
  d.Add("QS_LD(p, i)", absl::StrCat("ldi_", Lower(req.inputs[5].dtype), "(p, i)"));
}

// A block table for a kernel whose mask the key range does not cover (see BlockTable):
// declares its classify kernel and adds BLOCKS and BLOCK_META (`meta`) to `d`. Null for the
// kernels that walk their key range.
StatusOr<std::unique_ptr<BlockTable>> MakeBlockTable(KernelHost& dev,
                                                     const backend::KernelRequest& req, bool paged,
                                                     int fixed, int meta, Defines& d) {
  const Expr& mask = req.attrs->expr[0];
  std::string begin, end;
  if (KvRange(mask, &begin, &end)) return std::unique_ptr<BlockTable>();
  Defines c;
  c.Add("CLASSIFY", "1");
  if (paged) PagedDefines(req, c);
  KILN_ASSIGN_OR_RETURN(const std::string helpers,
                        AttentionDefines(dev, req, fixed, paged ? 4 : 7, paged ? 9 : 5, c));
  auto t = std::make_unique<BlockTable>();
  t->classify = dev.DeclareKernel(
      paged ? "paged_attn_blocks" : "attn_blocks",
      c.Wrap(kClAttention, absl::StrCat("// block table of ", Label(req), "\n", helpers)));
  t->paged = paged;
  t->per_batch = mask.Uses(ExprOp::kIndex, 0);
  t->per_head = mask.Uses(ExprOp::kIndex, 1);
  d.Add("BLOCKS", "1");
  d.Add("BLOCK_META", absl::StrCat(meta));
  return t;
}

StatusOr<backend::Kernel> MakeAttention(KernelHost& dev, const backend::KernelRequest& req,
                                        bool paged) {
  const Attrs& at = *req.attrs;
  const DType acc = ExprTypeOf(req.inputs[0].dtype);
  const int fixed = paged ? 6 : 3;
  const bool lse = !paged && !at.ints.empty() && at.ints[0] == 1;
  Defines d;
  if (paged) PagedDefines(req, d);
  d.Add("OST(p, i, v)", StoreFrom(req.output.dtype, acc));
  if (lse) {
    d.Add("LSE", "1");
    d.Add("LST(p, i, v)", StoreFrom(acc, acc));
  }
  const int block_meta = paged ? 83 : lse ? 78 : 74;
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<BlockTable> blocks,
                        MakeBlockTable(dev, req, paged, fixed, block_meta, d));
  const int aux_meta = block_meta + (blocks ? 5 : 0);
  KILN_ASSIGN_OR_RETURN(const std::string helpers,
                        AttentionDefines(dev, req, fixed, paged ? 4 : 7, aux_meta, d));
  auto data = std::make_shared<AttnData>();
  data->blocks = std::move(blocks);
  data->paged = paged;
  data->lse = lse;
  data->num_aux = static_cast<int>(req.inputs.size()) - fixed;
  data->scale = at.floats[0];
  data->library = !paged && data->num_aux == 0 && !at.expr[1] && at.expr[0] == attn::CausalMask();
  data->slot =
      dev.DeclareKernel(paged ? "paged_attn" : "attn",
                        d.Wrap(kClAttention, absl::StrCat("// ", Label(req), "\n", helpers)));
  return backend::Kernel{
      AttentionFn, std::move(data),
      absl::StrCat(dev.kernel_prefix(), paged ? ".gen.paged_attention" : ".gen.attention")};
}

// attention_backward: the template's BACKWARD (dq, dk and dv in one launch).
StatusOr<backend::Kernel> MakeAttentionBackward(KernelHost& dev,
                                                const backend::KernelRequest& req) {
  const DType acc = ExprTypeOf(req.inputs[0].dtype);
  Defines d;
  d.Add("BACKWARD", "1");
  d.Add("OLD(p, i)", LoadAs(req.inputs[3].dtype, acc));
  d.Add("DOLD(p, i)", LoadAs(req.inputs[4].dtype, acc));
  d.Add("LSELD(p, i)", LoadAs(req.inputs[5].dtype, acc));
  d.Add("DQST(p, i, v)", StoreFrom(req.output.dtype, acc));
  d.Add("DKST(p, i, v)", StoreFrom(req.inputs[1].dtype, acc));
  d.Add("DVST(p, i, v)", StoreFrom(req.inputs[2].dtype, acc));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<BlockTable> blocks,
                        MakeBlockTable(dev, req, /*paged=*/false, /*fixed=*/6, /*meta=*/51, d));
  KILN_ASSIGN_OR_RETURN(
      const std::string helpers,
      AttentionDefines(dev, req, /*fixed=*/6, /*max_aux=*/7, blocks ? 56 : 51, d));
  auto data = std::make_shared<AttnData>();
  data->blocks = std::move(blocks);
  data->num_aux = static_cast<int>(req.inputs.size()) - 6;
  data->scale = req.attrs->floats[0];
  data->library =
      data->num_aux == 0 && !req.attrs->expr[1] && req.attrs->expr[0] == attn::CausalMask();
  data->slot = dev.DeclareKernel(
      "attn_bwd", d.Wrap(kClAttention, absl::StrCat("// ", Label(req), "\n", helpers)));
  return backend::Kernel{AttentionBackwardFn, std::move(data),
                         absl::StrCat(dev.kernel_prefix(), ".gen.attention_backward")};
}

// ---- Training (cl/training.cl) ---------------------------------------------------------------

struct TrainData {
  KernelSlot* slot = nullptr;
};
KernelSlot* TrainSlot(const LaunchArgs& a) {
  return static_cast<const TrainData*>(a.kernel_data)->slot;
}

void FusedCrossEntropyFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &x = a.inputs[0], &t = a.inputs[1], &dl = a.inputs[2];
  const TensorArg &loss = a.output, &dx = a.extra_outputs[0];
  Args args;
  const int64_t lo = args.Mem(dev, loss.data), dxo = args.Mem(dev, dx.data),
                xo = args.Mem(dev, x.data), to = args.Mem(dev, t.data),
                dlo = args.Mem(dev, dl.data);
  args.Desc(x, xo);
  args.Desc(t, to);
  args.Desc(dl, dlo);
  args.Desc(loss, lo);
  args.Desc(dx, dxo);
  const int64_t rows = RowElems(t, 0);  // targets have the logits' leading shape
  args.Long(rows);
  const size_t wg = dev.work_group(), global = Groups(rows, 1) * wg;  // a work-group per row
  ex.Enqueue(TrainSlot(a), args, 1, &global, &wg, 96);
}

void OptimizerFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  const KernelHost& dev = *ex.host;
  const TensorArg &g = a.inputs[1], &hyper = a.inputs[2];
  // The optional grad_scale input (the kernel ignores the buffer without it: SLD is 1).
  const TensorArg& scale =
      a.num_inputs > 3 + a.num_extra_outputs ? a.inputs[a.num_inputs - 1] : hyper;
  // param and the states are written in place: the outputs are the States' storage. A
  // missing state is bound to param (the kernel never touches it).
  const TensorArg& p = a.output;
  const TensorArg& s0 = a.num_extra_outputs > 0 ? a.extra_outputs[0] : p;
  const TensorArg& s1 = a.num_extra_outputs > 1 ? a.extra_outputs[1] : p;
  Args args;
  const int64_t po = args.Mem(dev, p.data), s0o = args.Mem(dev, s0.data),
                s1o = args.Mem(dev, s1.data), go = args.Mem(dev, g.data),
                ho = args.Mem(dev, hyper.data), so = args.Mem(dev, scale.data);
  args.Desc(p, po);
  args.Desc(s0, s0o);
  args.Desc(s1, s1o);
  args.Desc(g, go);
  args.Long(ho);
  args.Long(hyper.strides[0]);
  args.Long(so);
  const size_t wg = dev.work_group(), global = Groups(p.numel(), wg) * wg;
  ex.Enqueue(TrainSlot(a), args, 1, &global, &wg, 96);
}

// A literal of the accumulator type (double, or float with an f suffix).
std::string AccLiteral(double v, DType acc) {
  return absl::StrFormat(acc == DType::kF64 ? "%.17e" : "%.9ef", v);
}

StatusOr<backend::Kernel> MakeTraining(KernelHost& dev, const backend::KernelRequest& req) {
  const Attrs& at = *req.attrs;
  const bool optimizer = req.op != OpKind::kFusedCrossEntropy;
  // Fused cross-entropy computes in the logits' compute type, the optimizers in the widest
  // float.
  const DType acc =
      optimizer ? (dev.fp64() ? DType::kF64 : DType::kF32) : ExprTypeOf(req.inputs[0].dtype);
  Defines d;
  d.Add("ACC", acc == DType::kF64 ? "double" : "float");
  if (optimizer) {
    d.Add("OPTIMIZER", "1");
    d.Add(absl::AsciiStrToUpper(OpName(req.op)), "1");
    d.Add("GLD(p, i)", LoadAs(req.inputs[1].dtype, acc));
    d.Add("HLD(p, i)", LoadAs(req.inputs[2].dtype, acc));
    const size_t states = static_cast<size_t>(OptimizerStateCount(req.op, at));
    const bool has_scale = req.inputs.size() > 3 + states;
    d.Add("SLD(p, i)", has_scale ? LoadAs(req.inputs.back().dtype, acc)
                                 : std::string(acc == DType::kF64 ? "1.0" : "1.0f"));
    for (size_t i = 0; i < at.floats.size(); ++i) {
      d.Add(absl::StrCat("F", i), AccLiteral(at.floats[i], acc));
    }
    if (req.op == OpKind::kSgd) {
      d.Add("NESTEROV", at.ints[0] ? "1" : "0");
      d.Add("MOMENTUM_STATE", states > 0 ? "1" : "0");
    }
  } else {
    const DType xt = req.inputs[0].dtype;
    d.Add("FUSED_CROSS_ENTROPY", "1");
    d.Add("ACC_MAX(a, b)", acc == DType::kF64 ? "nmaxd(a, b)" : "nmaxf(a, b)");
    d.Add("XLD(p, i)", LoadAs(xt, acc));
    d.Add("XST(p, i, v)", StoreFrom(xt, acc));
    d.Add("TLD(p, i)", absl::StrCat("ldi_", Lower(req.inputs[1].dtype), "(p, i)"));
    d.Add("IGNORE_INDEX", absl::StrCat("(", at.ints[0], "L)"));
  }
  const char* prefix = optimizer ? OpName(req.op) : "fused_cross_entropy";
  auto data = std::make_shared<TrainData>();
  data->slot =
      dev.DeclareKernel(prefix, d.Wrap(kClTraining, absl::StrCat("// ", Label(req), "\n")));
  return backend::Kernel{optimizer ? OptimizerFn : FusedCrossEntropyFn, std::move(data),
                         absl::StrCat(dev.kernel_prefix(), ".tmpl.", prefix)};
}

// ---- Sampling (cl/sampling.cl) ---------------------------------------------------------------

// The kernel's scratch: per row 2V floats and 2V ints.
struct SampleData {
  KernelSlot* slot = nullptr;
  QueueScratch scratch;
};

void SampleFn(const LaunchArgs& a, const ExecCtx& c) {
  Queue& ex = QueueOf(c);
  KernelHost& dev = *ex.host;
  auto& d = *static_cast<SampleData*>(const_cast<void*>(a.kernel_data));
  const TensorArg &logits = a.inputs[0], &params = a.inputs[1], &pen_t = a.inputs[3],
                  &pen_c = a.inputs[4], &banned = a.inputs[5];
  // The optional penalty_bias and allowed (without them, penalty_counts' buffer is bound and
  // not read).
  const bool has_bias = a.num_inputs > 6, has_allowed = a.num_inputs > 7;
  const TensorArg& pen_b = has_bias ? a.inputs[6] : pen_c;
  const TensorArg& allowed = has_allowed ? a.inputs[7] : pen_c;
  const int64_t S = logits.shape[0], V = logits.shape[1];
  if (S == 0) return;
  for (const TensorArg* t : {&logits, &params, &pen_t, &pen_c, &banned, &pen_b, &allowed}) {
    if (t->shape[1] > 1 && t->strides[1] != 1) {
      return ex.Fail(Unimplemented(dev.name(), " sample: rows must be contiguous"));
    }
  }
  const size_t region = static_cast<size_t>(S * V) * 8;  // 2V four-byte values per row
  Status st;
  backend::Buffer* buf = d.scratch.Get(dev, &ex, 2 * region, &st);
  if (buf == nullptr) return ex.Fail(st);
  void* scratch = buf->data();
  Args args;
  const void* ptrs[] = {a.output.data,
                        a.extra_outputs[0].data,
                        a.extra_outputs[1].data,
                        a.extra_outputs[2].data,
                        logits.data,
                        params.data,
                        a.inputs[2].data,
                        pen_t.data,
                        pen_c.data,
                        banned.data,
                        scratch,
                        pen_b.data,
                        allowed.data};
  int64_t off[13];
  for (int i = 0; i < 13; ++i) off[i] = args.Mem(dev, ptrs[i]);
  for (int i = 0; i < 10; ++i) args.Long(off[i]);
  for (int64_t v :
       {S, V, pen_t.shape[1], banned.shape[1], logits.strides[0], params.strides[0],
        pen_t.strides[0], banned.strides[0], a.extra_outputs[1].shape[1], off[10],
        off[10] + static_cast<int64_t>(region), pen_c.strides[0], has_bias ? off[11] : int64_t{-1},
        pen_b.strides[0], has_allowed ? off[12] : int64_t{-1}, allowed.strides[0]}) {
    args.Long(v);
  }
  const size_t wg = 1, global = static_cast<size_t>(S);  // one work-item per row
  ex.Enqueue(d.slot, args, 1, &global, &wg, 32);
}

StatusOr<backend::Kernel> MakeSample(KernelHost& dev, const backend::KernelRequest& /*req*/) {
  if (!dev.fp64()) {
    return Unimplemented(dev.name(), " has no f64 support (", dev.no_fp64_reason(),
                         "): sampling sums probability mass in "
                         "double (the host sampler runs instead)");
  }
  if (const std::string why = dev.SampleKernelDeclined(); !why.empty()) {
    return Unimplemented(dev.name(), ": ", why);
  }
  auto data = std::make_shared<SampleData>();
  // One source for every request (the op's dtypes are fixed; the optional penalty_bias and
  // allowed are launch arguments): its helper functions must be defined once per program.
  data->slot = dev.DeclareKernel("sample", absl::StrCat("// sample\n", kClSampling));
  return backend::Kernel{SampleFn, std::move(data),
                         absl::StrCat(dev.kernel_prefix(), ".tmpl.sample")};
}

StatusOr<backend::Kernel> Library(KernelHost& dev, KernelFn fn, const char* name,
                                  int64_t extra = 0) {
  auto d = std::make_shared<LibData>();
  d->slot = dev.LibraryKernel(name);
  d->extra = extra;
  return backend::Kernel{fn, std::move(d), absl::StrCat(dev.kernel_prefix(), ".lib.", name)};
}

}  // namespace

// ---- Kernel arguments ---------------------------------------------------------------------------

int Args::MetaSize(int n) {
  for (int s : {8, 16, 24, 32, 48, 64, 96, 120}) {
    if (n <= s) return s;
  }
  return -1;
}

int64_t Args::Mem(const KernelHost& host, const void* p) {
  void* mem = nullptr;
  size_t off = 0;
  if (nmems_ >= kMaxMems || !host.Resolve(p, &mem, &off)) {
    ok_ = false;
    return 0;
  }
  mems_[nmems_++] = mem;
  return static_cast<int64_t>(off);
}

void Args::Long(int64_t v) {
  if (nmeta_ >= kMaxMeta) {
    ok_ = false;
    return;
  }
  meta_[nmeta_++] = v;
}

std::span<int64_t> Args::Reserve(int n) {
  if (n < 0 || nmeta_ + n > kMaxMeta) {
    ok_ = false;
    return {};
  }
  std::span<int64_t> r(meta_.data() + nmeta_, static_cast<size_t>(n));
  std::fill(r.begin(), r.end(), 0);
  nmeta_ += n;
  return r;
}

void Args::Desc(const TensorArg& t, int64_t byte_offset) {
  Long(byte_offset);
  Long(t.rank);
  for (int d = 0; d < 8; ++d) Long(d < t.rank ? t.shape[d] : 1);
  for (int d = 0; d < 8; ++d) Long(d < t.rank ? t.strides[d] : 0);
}

compiler::FusionCaps DeviceFusionCaps(size_t max_param_bytes) {
  compiler::FusionCaps c;
  c.pointwise = c.reductions = true;
  // A generated kernel of rank 8 with n inputs passes 18 + 9n + 1 meta values and n + 1
  // buffers (compiler::DeviceLaunch).
  const int slots = static_cast<int>(max_param_bytes / 8);
  c.max_inputs =
      std::clamp(std::min((slots - 19) / 10, (Args::kMaxMeta - 19) / 9), 1, Args::kMaxMems - 1);
  return c;
}

Status DeclareKernels(KernelHost& host, std::span<const backend::KernelRequest> requests) {
  for (const backend::KernelRequest& req : requests) {
    const OpDef& def = GetOpDef(req.op);
    const bool declares = compiler::FusedGroupOf(req) != nullptr || def.pointwise != nullptr ||
                          def.reduce != nullptr || req.op == OpKind::kLinear ||
                          req.op == OpKind::kMatMul || req.op == OpKind::kAttention ||
                          req.op == OpKind::kPagedAttention || req.op == OpKind::kAttentionBackward;
    if (!declares) continue;
    StatusOr<backend::Kernel> k = host.GetKernel(req);
    if (!k.ok() && compiler::FusedGroupOf(req) != nullptr) return k.status();
  }
  return OkStatus();
}

std::string NameKernel(std::string_view source, std::string_view name) {
  std::string src(source);
  for (size_t at = src.find("KNAME"); at != std::string::npos; at = src.find("KNAME", at)) {
    src.replace(at, 5, name);
    at += name.size();
  }
  return src;
}

std::string ProgramPrelude(size_t work_group, bool fp64) {
  std::string s = absl::StrCat("#define KILN_WG ", work_group, "\n");
  // Without f64 the generated kernels print no double either (codegen.h).
  s += fp64 ? "#define KILN_FP64 1\n" : "#define KILN_NO_FP64 1\n";
  for (int t = 1; t < kNumDTypes; ++t) {
    std::string n = DTypeName(static_cast<DType>(t));
    for (char& ch : n) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    absl::StrAppend(&s, "#define DT_", n, " ", t, "\n");
  }
  return s + kClPrelude;
}

std::string GpuProgramSource(compiler::Dialect dialect, bool library, size_t work_group,
                             std::span<const std::string> kernels) {
  std::string s = absl::StrCat(kClCudaCompat, "\n", ProgramPrelude(work_group, true));
  if (library) return s + kClLibrary;
  s += compiler::Preamble(dialect);
  for (const std::string& k : kernels) absl::StrAppend(&s, "\n", k, "\n");
  return s;
}

std::string TemplateKernelName(std::string_view prefix, std::string_view source) {
  return absl::StrCat(ToAbsl(prefix), "_", compiler::Sha256Hex(source).substr(0, 16));
}

StatusOr<backend::Kernel> KernelHost::GetKernel(const backend::KernelRequest& req) {
  for (const TensorType& t : req.inputs) {
    if (!SupportsDType(t.dtype)) {
      return Unimplemented(name(), " has no f64 support (", no_fp64_reason(), ")");
    }
  }
  if (!SupportsDType(req.output.dtype)) {
    return Unimplemented(name(), " has no f64 support (", no_fp64_reason(), ")");
  }
  // Fused groups (compiler::Compile; caps() allows pointwise chains and reductions).
  if (const compiler::FusedGroup* g = compiler::FusedGroupOf(req)) {
    if (g->kind != compiler::FusedGroup::Kind::kReduce) {
      return Unimplemented(name(), " has no GEMM epilogues");
    }
    return Generated(*this, g->spec, absl::StrCat(kernel_prefix(), ".fused.", g->label));
  }
  const OpDef& def = GetOpDef(req.op);
  std::vector<DType> in;
  for (const TensorType& t : req.inputs) in.push_back(t.dtype);
  const DType out = req.output.dtype;
  if (def.pointwise != nullptr || def.reduce != nullptr) {
    // Casts from quantized blocks (a dequantization; codegen reads no quantized tensors) are
    // the library's converting copy.
    if (req.op == OpKind::kCast && IsQuantized(in[0])) {
      return Library(*this, ContiguousFn, "copy_strided");
    }
    KILN_ASSIGN_OR_RETURN(compiler::KernelSpec spec, compiler::SpecFromRequest(req));
    return Generated(*this, spec, absl::StrCat(kernel_prefix(), ".gen.", def.name));
  }
  switch (req.op) {
    case OpKind::kDimValue:
      return Library(*this, DimValueFn, "dim_value");
    case OpKind::kContiguous:
      return Library(*this, ContiguousFn, "copy_strided");
    case OpKind::kConcat:
      return Library(*this, ConcatFn, "copy_strided", req.attrs->ints[0]);
    case OpKind::kGather:
      return Library(*this, GatherFn, "gather");
    case OpKind::kScatterAddRows:
      return Library(*this, ScatterAddRowsFn, "scatter_add_rows");
    case OpKind::kTakeAlong:
      return Library(*this, TakeAlongFn, "take_along");
    case OpKind::kScatterAddAlong:
      return Library(*this, ScatterAddAlongFn, "scatter_add_along");
    case OpKind::kTopK:
      return Library(*this, TopKFn, "top_k");
    case OpKind::kKvWrite:
      return Library(*this, KvWriteFn, "kv_write");
    case OpKind::kRope:
      return MakeRope(*this, req);
    case OpKind::kAttention:
      return MakeAttention(*this, req, /*paged=*/false);
    case OpKind::kPagedAttention:
      return MakeAttention(*this, req, /*paged=*/true);
    case OpKind::kAttentionBackward:
      return MakeAttentionBackward(*this, req);
    case OpKind::kFusedCrossEntropy:
    case OpKind::kAdamW:
    case OpKind::kAdam:
    case OpKind::kSgd:
    case OpKind::kAdagrad:
      return MakeTraining(*this, req);
    case OpKind::kSample:
      return MakeSample(*this, req);
    case OpKind::kMatMul: {
      auto d = std::make_shared<GemmData>();
      d->blas = HasGemm(out);
      d->small = MatMulTemplate(*this, out);
      const std::string kname = d->blas ? absl::StrCat(kernel_prefix(), ".", blas_name(), ".matmul")
                                        : absl::StrCat(kernel_prefix(), ".tmpl.matmul");
      return backend::Kernel{MatMulFn, std::move(d), kname};
    }
    case OpKind::kLinear: {
      auto d = std::make_shared<GemmData>();
      d->blas = in[0] == in[1] && in[0] == out && HasGemm(out);
      // f16/bf16/quantized weights with f32 activations: converted for the GEMM at prefill.
      if (in[0] == out && out == DType::kF32 && in[1] != out && HasGemm(out) &&
          (in[1] == DType::kF16 || in[1] == DType::kBF16 || IsQuantized(in[1]))) {
        d->cast = LibraryKernel("copy_strided");
      }
      d->sg = linear_lanes() > 0;
      d->small = LinearTemplate(*this, in[0], in[1], out, 1, d->sg);
      d->large = LinearTemplate(*this, in[0], in[1], out, d->sg ? 4 : 8, d->sg);
      const std::string kname = d->blas
                                    ? absl::StrCat(kernel_prefix(), ".", blas_name(), ".linear")
                                    : absl::StrCat(kernel_prefix(), ".tmpl.linear_", Lower(in[1]));
      return backend::Kernel{LinearFn, std::move(d), kname};
    }
    default:
      break;
  }
  return Unimplemented(name(), " has no kernel for ", def.name);
}

StatusOr<BlockTableStats> LastBlockTableStats(KernelHost& dev, const Launch& launch) {
  if (launch.fn != AttentionFn && launch.fn != AttentionBackwardFn) {
    return InvalidArgument("LastBlockTableStats: not an attention launch");
  }
  const auto& d = *static_cast<const AttnData*>(launch.args->kernel_data);
  if (!d.blocks) return NotFound("this attention kernel has no block table");
  BlockTable& t = *d.blocks;
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.last == nullptr) return NotFound("this attention kernel has not run");
  std::vector<uint8_t> table(t.entries);
  std::vector<uint32_t> visits(static_cast<size_t>(t.rows));
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Stream> s, dev.CreateStream());
  KILN_RETURN_IF_ERROR(s->CopyToHost(table.data(), *t.last, 0, table.size()));
  KILN_RETURN_IF_ERROR(s->CopyToHost(visits.data(), *t.last, t.visits_offset, 4 * visits.size()));
  BlockTableStats r;
  for (uint8_t c : table) {
    if (c == 0) {
      ++r.empty;
    } else if (c == 1) {
      ++r.full;
    } else {
      ++r.partial;
    }
  }
  for (uint32_t v : visits) r.visited += v;
  return r;
}

}  // namespace kiln::devk
