#include "engine/program.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/planner.h"
#include "engine/profile.h"

namespace kiln {

struct Program::Recipe {
  TensorArg* arg = nullptr;
  int32_t node = -1;      // the value described (for messages)
  int32_t external = -1;  // external index of the root, or -1 for the arena
  int64_t arena_offset = 0;
  int32_t offset = 0;  // dim index: element offset within the root's storage
  int32_t rank = 0;
  int32_t shape[kMaxRank] = {};
  int32_t strides[kMaxRank] = {};
};

struct Program::GuardRegion {
  int64_t offset;
  int64_t bytes;
  int32_t node;
};

namespace {

constexpr uint8_t kGuardByte = 0xA5;

std::string Label(const Graph& g, int32_t id) {
  const Node& n = g.node(id);
  return absl::StrCat("%", id, n.name.empty() ? "" : absl::StrCat(" '", n.name, "'"), " (",
                      OpName(n.op), " ", TypeString(n.dtype, n.shape, g), ")");
}

}  // namespace

Program::~Program() = default;

int Program::DimIndex(const Dim& d) {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i] == d) return static_cast<int>(i);
  }
  dims_.push_back(d);
  return static_cast<int>(dims_.size()) - 1;
}

int Program::FindExternal(std::string_view name) const {
  for (size_t i = 0; i < externals_.size(); ++i) {
    if (externals_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

StatusOr<std::unique_ptr<Program>> CompileImpl(const Graph& graph, std::span<const Value> outs,
                                               backend::Device& device,
                                               const CompileOptions& options) {
  const DumpConfig& dump = options.dump;
  DumpGraph(dump, "build", graph);
  std::vector<Value> outputs(outs.begin(), outs.end());
  KILN_RETURN_IF_ERROR(Verify(graph, outputs));
  DumpGraph(dump, "verify", graph);
  KILN_ASSIGN_OR_RETURN(Graph g1, EliminateDeadCode(graph, outputs));
  DumpGraph(dump, "dce", g1);
  if (device.GetExtension(backend::kMatMulMixedRhsExtension) == nullptr) {
    if (std::optional<Graph> cast = CastMatMulRhs(g1, outputs)) {
      g1 = *std::move(cast);
      DumpGraph(dump, "cast_matmul_rhs", g1);
    }
  }
  std::vector<Layout> layouts;
  KILN_ASSIGN_OR_RETURN(Graph g, LowerViews(g1, outputs, &layouts));
  const int32_t n = g.size();
  if (dump.Enabled("lower_views")) {
    std::vector<std::string> marks(n);
    for (int32_t i = 0; i < n; ++i) {
      if (layouts[i].root != i) {
        std::vector<std::string> st;
        for (const Dim& d : layouts[i].strides) st.push_back(d.ToString(g.symbol_names()));
        marks[i] = absl::StrCat("view of %", layouts[i].root, " strides=[", absl::StrJoin(st, ","),
                                "] offset=", layouts[i].offset.ToString(g.symbol_names()));
      }
    }
    DumpGraph(dump, "lower_views", g, &marks);
  }

  std::unique_ptr<Program> p(new Program());
  p->device_ = &device;
  p->dump_ = dump;
  std::vector<int32_t> ext_index(n, -1);
  for (int32_t i = 0; i < n; ++i) {
    const Node& node = g.node(i);
    if (GetOpDef(node.op).cls != OpClass::kSource) continue;
    ext_index[i] = static_cast<int32_t>(p->externals_.size());
    p->externals_.push_back({node.name, node.op, node.dtype, node.shape});
    p->external_node_.push_back(i);
    if (!device.SupportsDType(node.dtype)) {
      return Unimplemented("compile: ", Label(g, i), ": device ", std::string(device.name()),
                           " does not support ", DTypeName(node.dtype));
    }
  }
  p->bound_.resize(p->externals_.size());

  // ---- assign: one kernel per node that computes something ----
  std::vector<int32_t> kernel_of(n, -1);
  std::vector<std::string> kernel_marks(n);
  for (int32_t i = 0; i < n; ++i) {
    const Node& node = g.node(i);
    if (!IsLaunched(node.op)) continue;
    std::vector<TensorType> in;
    for (int32_t id : node.inputs) in.push_back({g.node(id).dtype, g.node(id).shape});
    backend::KernelRequest req;
    req.op = node.op;
    req.attrs = &node.attrs;
    req.inputs = in;
    req.output = {node.dtype, node.shape};
    req.name = node.name;
    StatusOr<backend::Kernel> k = device.GetKernel(req);
    if (!k.ok()) {
      return Status(k.status().code(),
                    absl::StrCat("compile: ", Label(g, i), " cannot run on device ",
                                 ToAbsl(device.name()), ": ", k.status().message()));
    }
    kernel_of[i] = static_cast<int32_t>(p->kernels_.size());
    kernel_marks[i] = k->name;
    p->kernels_.push_back(*std::move(k));
  }
  DumpGraph(dump, "assign", g, &kernel_marks);

  // ---- plan: liveness over launch order (node order), in-place reuse, one arena ----
  // The node whose launch writes each value: itself, or an output_of node's producer.
  std::vector<int32_t> writer(n, -1);
  for (int32_t i = 0; i < n; ++i) {
    writer[i] = g.node(i).op == OpKind::kOutputOf ? g.node(i).inputs[0] : i;
  }
  const std::vector<int64_t> maxv = g.SymbolMaxValues();
  std::vector<int32_t> last_use(n, -1);
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t in : g.node(i).inputs) {
      const int32_t r = layouts[in].root;
      last_use[r] = std::max(last_use[r], i);
    }
  }
  std::vector<char> is_output(n, 0);
  for (Value v : outputs) {
    last_use[layouts[v.id].root] = n;
    is_output[layouts[v.id].root] = 1;
  }
  // Storage group per planned node (in-place ops join their input's group).
  std::vector<int32_t> group(n, -1);
  // Arena storage: every launched output that is not a view or an in-place alias of State.
  auto planned = [&](int32_t i) { return kernel_of[writer[i]] >= 0 && layouts[i].root == i; };
  const bool allow_inplace = options.guard_bytes == 0;
  for (int32_t i = 0; i < n; ++i) {
    if (!planned(i)) continue;
    group[i] = i;
    const Node& node = g.node(i);
    const int k = GetOpDef(node.op).reuse_input;
    if (!allow_inplace || k < 0 || k >= static_cast<int>(node.inputs.size())) continue;
    const int32_t v = node.inputs[k];
    if (!planned(v) || last_use[v] != i || is_output[v]) continue;
    const Node& src = g.node(v);
    if (DTypeBlockBytes(src.dtype) != DTypeBlockBytes(node.dtype) || src.shape != node.shape)
      continue;
    bool hazard = false;  // another input reading the same storage through a different view
    for (size_t j = 0; j < node.inputs.size(); ++j) {
      if (static_cast<int>(j) != k && layouts[node.inputs[j]].root == v) hazard = true;
    }
    if (hazard) continue;
    group[i] = group[v];
  }
  const int64_t guard = static_cast<int64_t>(options.guard_bytes);
  const int64_t align =
      std::max<int64_t>(static_cast<int64_t>(options.alignment), backend::kMinAlignment);
  auto round_up = [&](int64_t v) { return (v + align - 1) / align * align; };
  std::vector<int32_t> request_of(n, -1);
  std::vector<BufferRequest> requests;
  std::vector<int32_t> request_node;
  for (int32_t i = 0; i < n; ++i) {
    if (group[i] < 0) continue;
    const Node& node = g.node(i);
    const int64_t elems = NumElements(node.shape).Eval(maxv);
    const int64_t bytes = DTypeBytes(node.dtype, elems);
    const int32_t root = group[i];
    if (request_of[root] < 0) {
      request_of[root] = static_cast<int32_t>(requests.size());
      requests.push_back({0, writer[i], i});
      request_node.push_back(root);
    }
    BufferRequest& r = requests[request_of[root]];
    // With guards: [guard][data][guard], the trailing guard right after the last data byte.
    const int64_t total = bytes == 0 ? 0 : (guard > 0 ? round_up(guard) * 2 + bytes : bytes);
    r.bytes = std::max(r.bytes, total);
    p->unplanned_bytes_ += static_cast<size_t>(round_up(bytes));
    // Live from the launch that writes it to its last reader.
    r.first = std::min(r.first, writer[i]);
    r.last = std::max(r.last, std::max(last_use[i], i));
    if (guard > 0) r.first = 0, r.last = n;  // guards are checked after the run: no sharing
  }
  const MemoryPlan plan = PlanMemory(requests, align);
  p->arena_bytes_ = static_cast<size_t>(plan.peak);
  p->storage_offset_.assign(n, -1);
  std::vector<std::string> plan_marks(n);
  for (int32_t i = 0; i < n; ++i) {
    if (group[i] < 0) continue;
    const int32_t req = request_of[group[i]];
    const int64_t data_off = plan.offsets[req] + (guard > 0 ? round_up(guard) : 0);
    p->storage_offset_[i] = data_off;
    plan_marks[i] = absl::StrCat(
        "arena+", data_off, group[i] != i ? absl::StrCat(" (in place of %", group[i], ")") : "");
  }
  if (guard > 0) {
    for (size_t r = 0; r < requests.size(); ++r) {
      if (requests[r].bytes == 0) continue;
      const int64_t g0 = round_up(guard);
      p->guards_.push_back({plan.offsets[r], g0, request_node[r]});
      p->guards_.push_back({plan.offsets[r] + requests[r].bytes - g0, g0, request_node[r]});
    }
  }
  if (plan.peak > 0) {
    KILN_ASSIGN_OR_RETURN(std::unique_ptr<backend::Buffer> arena,
                          device.Allocate(static_cast<size_t>(plan.peak)));
    p->arena_ = std::move(arena);
  }
  if (dump.Enabled("plan")) {
    std::ostringstream os;
    os << "arena: " << plan.peak << " bytes (without reuse: " << p->unplanned_bytes_ << ")\n";
    g.Print(os, &plan_marks);
    dump.Write("plan", os.str());
  }

  // ---- emit: launches with recipes for every tensor argument ----
  size_t total_inputs = 0, total_launches = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (kernel_of[i] < 0) continue;
    ++total_launches;
    total_inputs += g.node(i).inputs.size() + static_cast<size_t>(g.NumOutputs(i) - 1);
  }
  p->arg_pool_.reserve(total_inputs);  // pointers into these vectors must stay valid
  p->launch_args_.reserve(total_launches);
  p->output_args_.reserve(outputs.size());
  auto add_recipe = [&](TensorArg* dst, int32_t value) -> Status {
    const Layout& l = layouts[value];
    const Node& node = g.node(value);
    if (node.shape.size() > static_cast<size_t>(kMaxRank)) {
      return InvalidArgument("compile: ", Label(g, value), " has rank above ", kMaxRank);
    }
    Program::Recipe r;
    r.arg = dst;
    r.node = value;
    r.external = ext_index[l.root];
    if (r.external < 0) {
      KILN_CHECK(p->storage_offset_[l.root] >= 0, "a value's root has no storage");
      r.arena_offset = p->storage_offset_[l.root];
    }
    r.offset = p->DimIndex(l.offset);
    r.rank = static_cast<int32_t>(node.shape.size());
    for (int d = 0; d < r.rank; ++d) {
      r.shape[d] = p->DimIndex(node.shape[d]);
      r.strides[d] = p->DimIndex(l.strides[d]);
    }
    dst->dtype = node.dtype;
    dst->rank = r.rank;
    p->recipes_.push_back(r);
    return OkStatus();
  };
  for (int32_t i = 0; i < n; ++i) {
    if (kernel_of[i] < 0) continue;
    const Node& node = g.node(i);
    p->launch_args_.emplace_back();
    LaunchArgs& la = p->launch_args_.back();
    la.kernel_data = p->kernels_[kernel_of[i]].data.get();
    la.num_inputs = static_cast<int32_t>(node.inputs.size());
    la.inputs = p->arg_pool_.data() + p->arg_pool_.size();
    for (int32_t in : node.inputs) {
      p->arg_pool_.emplace_back();
      KILN_RETURN_IF_ERROR(add_recipe(&p->arg_pool_.back(), in));
    }
    KILN_RETURN_IF_ERROR(add_recipe(&la.output, i));
    la.num_extra_outputs = static_cast<int32_t>(g.NumOutputs(i) - 1);
    la.extra_outputs =
        la.num_extra_outputs > 0 ? p->arg_pool_.data() + p->arg_pool_.size() : nullptr;
    for (int32_t o = 1; o <= la.num_extra_outputs; ++o) {
      p->arg_pool_.emplace_back();
      KILN_RETURN_IF_ERROR(add_recipe(&p->arg_pool_.back(), i + o));
    }
    for (size_t j = 0; j < node.attrs.dims.size() && j < static_cast<size_t>(kMaxLaunchParams);
         ++j) {
      p->params_.push_back({&la.params[j], p->DimIndex(node.attrs.dims[j])});
    }
    p->launches_.push_back({p->kernels_[kernel_of[i]].fn, &la});
    p->launch_node_.push_back(i);
  }
  for (int32_t i = 0; i < n; ++i) {
    const Node& node = g.node(i);
    if (node.op != OpKind::kSlice) continue;
    p->slice_checks_.push_back({i, p->DimIndex(node.attrs.dims[0]), p->DimIndex(node.attrs.dims[1]),
                                p->DimIndex(g.node(node.inputs[0]).shape[node.attrs.ints[0]])});
  }
  for (Value v : outputs) {
    p->output_args_.emplace_back();
    p->outputs_.push_back(static_cast<int32_t>(p->recipes_.size()));
    KILN_RETURN_IF_ERROR(add_recipe(&p->output_args_.back(), v.id));
  }
  p->symbol_values_.assign(g.num_symbols(), 0);
  p->symbol_set_.assign(g.num_symbols(), 0);
  p->dim_values_.assign(p->dims_.size(), 0);
  p->graph_ = std::move(g);
  if (dump.Enabled("program")) dump.Write("program", p->DebugString());
  return p;
}

StatusOr<std::unique_ptr<Program>> Compile(const Graph& graph, std::span<const Value> outputs,
                                           backend::Device& device, const CompileOptions& options) {
  return CompileImpl(graph, outputs, device, options);
}

std::string Program::DebugString() const {
  std::ostringstream os;
  os << "program on " << device_->name() << ": " << launches_.size() << " launches, arena "
     << arena_bytes_ << " bytes (" << unplanned_bytes_ << " without reuse)\n";
  for (size_t k = 0; k < launches_.size(); ++k) {
    const int32_t i = launch_node_[k];
    const Node& node = graph_.node(i);
    os << "#" << k << " %" << i;
    if (!node.name.empty()) os << " " << node.name;
    os << ": " << OpName(node.op) << " -> " << TypeString(node.dtype, node.shape, graph_);
    int kernel = 0;
    for (size_t j = 0; j < kernels_.size(); ++j) {
      if (launch_args_[k].kernel_data == kernels_[j].data.get() &&
          kernels_[j].fn == launches_[k].fn) {
        kernel = static_cast<int>(j);
      }
    }
    os << " [" << kernels_[kernel].name << "]";
    if (storage_offset_[i] >= 0) os << " @arena+" << storage_offset_[i];
    // Extra outputs (output_of nodes follow their producer).
    for (int o = 1; o < graph_.NumOutputs(i); ++o) {
      os << " +%" << (i + o) << " "
         << TypeString(graph_.node(i + o).dtype, graph_.node(i + o).shape, graph_);
      if (storage_offset_[i + o] >= 0) os << " @arena+" << storage_offset_[i + o];
    }
    os << "\n";
  }
  return os.str();
}

Status Program::SetSymbol(int index, int64_t value) {
  if (index < 0 || index >= graph_.num_symbols()) {
    return InvalidArgument("SetSymbol: no symbol #", index, " (the program has ",
                           graph_.num_symbols(), ")");
  }
  const SymbolInfo& s = graph_.symbol(index);
  if (value < s.min || value > s.max) {
    return OutOfRange("symbol ", s.name, " = ", value, " is outside its declared range [", s.min,
                      ", ", s.max, "]");
  }
  if (!symbol_set_[index] || symbol_values_[index] != value) prepared_ = false;
  symbol_values_[index] = value;
  symbol_set_[index] = 1;
  return OkStatus();
}

Status Program::SetSymbol(std::string_view name, int64_t value) {
  const int i = graph_.FindSymbol(name);
  if (i < 0) return NotFound("SetSymbol: the program has no symbol '", ToAbsl(name), "'");
  return SetSymbol(i, value);
}

Status Program::Bind(int external, const Tensor& tensor) {
  if (external < 0 || external >= static_cast<int>(externals_.size())) {
    return InvalidArgument("Bind: no external tensor #", external);
  }
  const ExternalInfo& e = externals_[external];
  if (!tensor.defined()) return InvalidArgument("Bind '", e.name, "': undefined tensor");
  if (tensor.dtype() != e.dtype) {
    return InvalidArgument("Bind '", e.name, "': dtype ", DTypeName(tensor.dtype()),
                           " but the graph declares ", DTypeName(e.dtype));
  }
  if (!tensor.IsContiguous())
    return InvalidArgument("Bind '", e.name, "': the tensor must be dense");
  if (&tensor.buffer()->device() != device_) {
    return InvalidArgument("Bind '", e.name, "': the tensor is on ",
                           ToAbsl(tensor.buffer()->device().name()), " but the program runs on ",
                           ToAbsl(device_->name()));
  }
  bound_[external] = tensor;
  prepared_ = false;
  return OkStatus();
}

Status Program::Bind(std::string_view name, const Tensor& tensor) {
  const int i = FindExternal(name);
  if (i < 0) return NotFound("Bind: the program has no external tensor '", ToAbsl(name), "'");
  return Bind(i, tensor);
}

Status Program::Prepare() {
  if (prepared_) return OkStatus();
  for (int s = 0; s < graph_.num_symbols(); ++s) {
    if (!symbol_set_[s]) return FailedPrecondition("symbol ", graph_.symbol(s).name, " is not set");
  }
  for (size_t k = 0; k < dims_.size(); ++k) dim_values_[k] = dims_[k].Eval(symbol_values_);
  for (size_t e = 0; e < externals_.size(); ++e) {
    const ExternalInfo& info = externals_[e];
    if (!bound_[e].defined()) {
      return FailedPrecondition(OpName(info.kind), " '", info.name, "' is not bound");
    }
    const std::vector<int64_t> want = EvalShape(info.shape, symbol_values_);
    if (bound_[e].shape() != want) {
      return InvalidArgument(OpName(info.kind), " '", info.name, "' is bound to shape [",
                             absl::StrJoin(bound_[e].shape(), ","), "] but needs [",
                             absl::StrJoin(want, ","), "] (",
                             ShapeString(info.shape, graph_.symbol_names()), ")");
    }
  }
  for (const SliceCheck& c : slice_checks_) {
    const int64_t start = dim_values_[c.start], size = dim_values_[c.size],
                  extent = dim_values_[c.extent];
    if (start < 0 || size < 0 || start + size > extent) {
      return OutOfRange("slice ", Label(graph_, c.node), ": [", start, ", ", start + size,
                        ") is outside an axis of size ", extent, " for these symbol values");
    }
  }
  char* arena = arena_ ? static_cast<char*>(arena_->data()) : nullptr;
  for (const Recipe& r : recipes_) {
    TensorArg& a = *r.arg;
    char* base =
        r.external >= 0 ? static_cast<char*>(bound_[r.external].data()) : arena + r.arena_offset;
    a.data = base + ByteOffset(a.dtype, dim_values_[r.offset]);
    for (int d = 0; d < r.rank; ++d) {
      a.shape[d] = dim_values_[r.shape[d]];
      a.strides[d] = dim_values_[r.strides[d]];
    }
  }
  for (const ParamRecipe& pr : params_) *pr.dst = dim_values_[pr.dim];
  prepared_ = true;
  return OkStatus();
}

Status Program::Run(backend::Stream& stream) {
  KILN_RETURN_IF_ERROR(Prepare());
  if (!guards_.empty()) {
    std::vector<uint8_t> pattern;
    for (const GuardRegion& gr : guards_) {
      pattern.assign(static_cast<size_t>(gr.bytes), kGuardByte);
      KILN_RETURN_IF_ERROR(stream.CopyToDevice(*arena_, static_cast<size_t>(gr.offset),
                                               pattern.data(), pattern.size()));
    }
  }
  if (LaunchProfile* profile = LaunchProfile::Get()) {
    KILN_RETURN_IF_ERROR(RunProfiled(stream, *profile));
  } else {
    KILN_RETURN_IF_ERROR(stream.Run(launches_));
  }
  if (!guards_.empty()) return CheckGuards(stream);
  return OkStatus();
}

Status Program::RunProfiled(backend::Stream& stream, LaunchProfile& profile) {
  using Clock = std::chrono::steady_clock;
  const auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  const auto shape = [](const TensorArg& a) {
    return absl::StrCat("[", absl::StrJoin(a.shape, a.shape + a.rank, ","), "]");
  };
  KILN_RETURN_IF_ERROR(stream.Synchronize());
  const Clock::time_point start = Clock::now();
  for (size_t k = 0; k < launches_.size(); ++k) {
    const Node& node = graph_.node(launch_node_[k]);
    const LaunchArgs& la = launch_args_[k];
    std::string kernel;
    for (const backend::Kernel& kn : kernels_) {
      if (la.kernel_data == kn.data.get() && kn.fn == launches_[k].fn) kernel = kn.name;
    }
    std::string key = absl::StrCat(OpName(node.op), " ", kernel, " ", shape(la.output), " <-");
    for (int i = 0; i < la.num_inputs; ++i) absl::StrAppend(&key, " ", shape(la.inputs[i]));
    if (!node.name.empty()) absl::StrAppend(&key, "  ", FoldBlockIndex(node.name));
    // FLOPs of the products: 2 * output elements * the reduced extent.
    double flops = 0;
    if ((node.op == OpKind::kMatMul || node.op == OpKind::kLinear) && la.num_inputs >= 1 &&
        la.inputs[0].rank >= 1) {
      flops = 2.0 * static_cast<double>(la.output.numel()) *
              static_cast<double>(la.inputs[0].shape[la.inputs[0].rank - 1]);
    }
    const Clock::time_point t0 = Clock::now();
    KILN_RETURN_IF_ERROR(stream.Run(std::span<const Launch>(&launches_[k], 1)));
    KILN_RETURN_IF_ERROR(stream.Synchronize());
    profile.Add(key, seconds(t0, Clock::now()), flops);
  }
  profile.AddRun(static_cast<int>(launches_.size()), seconds(start, Clock::now()));
  return OkStatus();
}

Status Program::CheckGuards(backend::Stream& stream) {
  KILN_RETURN_IF_ERROR(stream.Synchronize());
  std::vector<uint8_t> got;
  for (const GuardRegion& gr : guards_) {
    got.assign(static_cast<size_t>(gr.bytes), 0);
    KILN_RETURN_IF_ERROR(
        stream.CopyToHost(got.data(), *arena_, static_cast<size_t>(gr.offset), got.size()));
    for (size_t b = 0; b < got.size(); ++b) {
      if (got[b] != kGuardByte) {
        return Internal("memory guard around ", Label(graph_, gr.node), " was overwritten (byte ",
                        b, " of ", gr.bytes, "): a kernel wrote outside its output buffer");
      }
    }
  }
  return OkStatus();
}

StatusOr<Tensor> Program::Output(int i) const {
  if (i < 0 || i >= num_outputs()) return InvalidArgument("Output: no output #", i);
  if (!prepared_) return FailedPrecondition("Output: the program has not been prepared/run");
  const Recipe& r = recipes_[outputs_[i]];
  const TensorArg& a = *r.arg;
  std::vector<int64_t> shape(a.shape, a.shape + a.rank), strides(a.strides, a.strides + a.rank);
  int64_t offset = dim_values_[r.offset];
  std::shared_ptr<backend::Buffer> buf;
  if (r.external >= 0) {
    buf = bound_[r.external].buffer();
    offset += bound_[r.external].offset();
  } else {
    buf = arena_;
    offset += r.arena_offset / DTypeBlockBytes(a.dtype) * DTypeBlockElems(a.dtype);
  }
  return Tensor::FromParts(std::move(buf), a.dtype, std::move(shape), std::move(strides), offset);
}

}  // namespace kiln
