#include "engine/compiler/compile.h"

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <optional>

#include "absl/strings/str_format.h"
#include "engine/compiler/fusion.h"
#include "engine/compiler/host_services.h"
#include "engine/passes.h"
#include "spdlog/spdlog.h"

namespace kiln::compiler {
namespace {

// What the pre-lowering rewrite needs from the compile that runs on this thread.
struct Context {
  Target* target = nullptr;
  FusionCaps caps;
  DumpConfig dump;
  bool fuse = true;
  CompileReport* report = nullptr;
  std::vector<std::shared_ptr<const FusedGroup>> groups;
};
thread_local Context* tl_context = nullptr;

class ScopedContext {
 public:
  explicit ScopedContext(Context* c) : prev_(tl_context) { tl_context = c; }
  ~ScopedContext() { tl_context = prev_; }

 private:
  Context* prev_;
};

bool Computes(const Node& n) { return IsLaunched(n.op); }

// Every kernel request of `g` (what assign will ask for).
Status PrepareAll(Target& target, const Graph& g) {
  std::vector<std::vector<TensorType>> types;
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < g.size(); ++i) {
    const Node& n = g.node(i);
    if (!Computes(n)) continue;
    std::vector<TensorType> t;
    for (int32_t in : n.inputs) t.push_back({g.node(in).dtype, g.node(in).shape});
    types.push_back(std::move(t));
    ids.push_back(i);
  }
  std::vector<backend::KernelRequest> reqs;
  for (size_t k = 0; k < ids.size(); ++k) {
    const Node& n = g.node(ids[k]);
    reqs.push_back({n.op, &n.attrs, types[k], {n.dtype, n.shape}, n.name});
  }
  return target.Prepare(reqs);
}

StatusOr<std::optional<Graph>> Rewrite(const Graph& g, std::vector<Value>& outputs) {
  Context* c = tl_context;
  if (c == nullptr) return std::optional<Graph>();
  CompileReport& rep = *c->report;
  rep.regions = FindRegions(g);
  rep.nodes = 0;
  for (const Node& n : g.nodes()) rep.nodes += Computes(n);
  const bool any_caps = c->caps.pointwise || c->caps.reductions || c->caps.gemm_epilogues;
  if (!c->fuse || !any_caps) {
    (void)PrepareAll(*c->target, g);  // plain kernels fall back on their own
    return std::optional<Graph>();
  }
  std::vector<Value> fused_outputs = outputs;
  FusionOptions fo;
  fo.caps = c->caps;
  if (c->caps.max_inputs > 0) fo.max_inputs = std::min(fo.max_inputs, c->caps.max_inputs);
  KILN_ASSIGN_OR_RETURN(FusionResult r, Fuse(g, fused_outputs, fo));
  if (c->dump.Enabled("fuse")) DumpGraph(c->dump, "fuse", r.graph, &r.marks);
  c->groups = r.groups;
  const Status s = PrepareAll(*c->target, r.graph);
  if (!s.ok() && r.fused_groups > 0) {
    spdlog::warn("compile: fused kernels could not be built, compiling unfused: {}",
                 StatusMessage(s).substr(0, 1000));
    c->groups.clear();
    rep.unfused_fallback = true;
    (void)PrepareAll(*c->target, g);
    return std::optional<Graph>();
  }
  rep.fused_groups = r.fused_groups;
  rep.fused_nodes = r.fused_nodes;
  outputs = fused_outputs;
  return std::optional<Graph>(std::move(r.graph));
}

bool EnvOff(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && (std::string_view(v) == "0" || std::string_view(v) == "false");
}

CompileCounters Minus(const CompileCounters& a, const CompileCounters& b) {
  return {a.compiled - b.compiled, a.cached - b.cached, a.reused - b.reused,
          a.compiler_runs - b.compiler_runs, a.seconds - b.seconds};
}

void Record(metrics::Registry& m, const CompileReport& r) {
  auto& kernels = m.AddCounter("kiln_compile_kernels_total",
                               "Kernels programs needed, by origin: compiled (the compiler ran), "
                               "reused (already in this process), cached (disk cache or built in).",
                               {"outcome"});
  kernels.WithLabels({"compiled"})->Increment(static_cast<double>(r.kernels.compiled));
  kernels.WithLabels({"reused"})->Increment(static_cast<double>(r.kernels.reused));
  kernels.WithLabels({"cached"})->Increment(static_cast<double>(r.kernels.cached));
  m.AddCounter("kiln_compile_seconds_total",
               "Wall time spent compiling programs (fusion, code generation, kernel builds).")
      .WithLabels(std::initializer_list<std::string_view>{})
      ->Increment(r.seconds);
}

}  // namespace

// host_services.cc: what ThisProcessServices() hands a plugin.
const void* ThreadCompileContext() { return tl_context; }

const FusedGroup* FusedGroupOf(const backend::KernelRequest& request) {
  // In a plugin, the compile runs in the host's copy of this file: its context is the one set.
  const HostServices* host = AdoptedHostServices();
  const Context* c =
      host != nullptr ? static_cast<const Context*>(host->compile_context()) : tl_context;
  if (c == nullptr || request.attrs == nullptr) return nullptr;
  const int i = FusedGroupIndex(*request.attrs);
  if (i < 0 || i >= static_cast<int>(c->groups.size())) return nullptr;
  return c->groups[i].get();
}

backend::KernelRequest FusedGroup::GemmRequest() const {
  return backend::KernelRequest{gemm_op, &gemm_attrs, gemm_inputs, gemm_output, label};
}

std::string CompileReport::ToString() const {
  std::string s =
      absl::StrFormat("%s; %d nodes -> %d launches", regions.Summary(), nodes, launches);
  if (fused_groups > 0) {
    absl::StrAppendFormat(&s, " (fused %d nodes into %d groups)", fused_nodes, fused_groups);
  }
  if (unfused_fallback) s += " (unfused: fused kernels failed to build)";
  absl::StrAppendFormat(&s,
                        "; kernels: %d compiled, %d cached, %d reused (%d compiler run%s); %.2f s",
                        kernels.compiled, kernels.cached, kernels.reused, kernels.compiler_runs,
                        kernels.compiler_runs == 1 ? "" : "s", seconds);
  return s;
}

StatusOr<std::unique_ptr<Program>> Compile(const Graph& graph, std::span<const Value> outputs,
                                           backend::Device& device, const CompilerOptions& options,
                                           CompileReport* report) {
  const auto t0 = std::chrono::steady_clock::now();
  CompileReport local;
  CompileReport& rep = report != nullptr ? *report : local;
  rep = CompileReport();
  auto* target = static_cast<Target*>(device.GetExtension(kTargetExtension));
  StatusOr<std::unique_ptr<Program>> p;
  if (target == nullptr) {
    p = kiln::Compile(graph, outputs, device, options.program);
    rep.regions = FindRegions(graph);
  } else {
    static std::once_flag once;
    std::call_once(once, [] { SetPreLowerRewrite(&Rewrite); });
    Context ctx;
    ctx.target = target;
    ctx.caps = target->caps();
    ctx.dump = options.program.dump;
    ctx.fuse = options.fuse && !EnvOff("KILN_FUSE");
    ctx.report = &rep;
    const CompileCounters before = target->counters();
    {
      ScopedContext scope(&ctx);
      p = kiln::Compile(graph, outputs, device, options.program);
      if (!p.ok() && !ctx.groups.empty()) {
        // A device may have refused a fused node at assign time: compile the plain graph
        // instead. Warned only when that works: a node the device cannot run at all fails
        // both ways, and its error is the answer (e.g. a sample op the device declines).
        const Status fused = p.status();
        ctx.fuse = false;
        ctx.groups.clear();
        rep.unfused_fallback = true;
        rep.fused_groups = rep.fused_nodes = 0;
        p = kiln::Compile(graph, outputs, device, options.program);
        if (p.ok()) {
          spdlog::warn("compile: fused program failed ({}); compiled unfused",
                       StatusMessage(fused).substr(0, 1000));
        }
      }
    }
    rep.kernels = Minus(target->counters(), before);
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!p.ok()) return p;
  rep.launches = (*p)->num_launches();
  spdlog::info("compile{}{}: {}", options.label.empty() ? "" : " ", options.label, rep.ToString());
  if (options.metrics != nullptr) Record(*options.metrics, rep);
  return p;
}

}  // namespace kiln::compiler
