// Compiling a graph for a device, and running the result.
//
//   Graph g; Builder b(&g);
//   Dim T = b.Symbol("T", 64);
//   Value x = b.Input("x", DType::kF32, {T, 8});
//   Value y = b.Named(b.Silu(x), "y");
//   KILN_ASSIGN_OR_RETURN(auto program, Compile(g, {y}, *device));
//   KILN_RETURN_IF_ERROR(program->SetSymbol("T", 3));
//   KILN_RETURN_IF_ERROR(program->Bind("x", x_tensor));   // f32[3,8] on the same device
//   KILN_RETURN_IF_ERROR(program->Run(*stream));
//   KILN_ASSIGN_OR_RETURN(Tensor out, program->Output(0));  // f32[3,8], valid until next Run
//
// Compile runs the passes verify -> dce -> lower_views -> assign (a kernel per node from
// the device) -> plan (one arena, liveness-based, sized at the symbols' upper bounds) ->
// emit (a flat launch list). Each pass can be dumped with KILN_DUMP (dump.h).
//
// A Program runs with any symbol values within their declared ranges: the same Program
// serves a 1-token decode step and a 37-token prefill chunk. Symbolic sizes are evaluated
// once per run when a binding changed; running is a loop over pre-resolved launches.
//
// External tensors: Input (per step), Weight (bound once, read only, may be quantized or
// mmap'd) and State (bound once, updated in place by launches: kv_write's cache, adamw's
// parameters and moments; every run updates the bound tensor). Bindings persist across runs
// until replaced. Bound tensors must be dense, on the Program's device, with the exact
// dtype and the shape the graph declares under the current symbol values. An output that a
// node writes in place is a view of its State's bound tensor (it takes no arena space).
//
// Thread-safety: a Program is used by one thread at a time (it owns its arena). Compile is
// thread-safe.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/dump.h"
#include "engine/graph.h"
#include "engine/passes.h"
#include "engine/tensor.h"

namespace kiln {

class LaunchProfile;

struct CompileOptions {
  // Passes to dump ("verify,plan" or "all"); empty: from KILN_DUMP.
  DumpConfig dump = DumpConfigFromEnv();
  // Debug aid: surround every arena buffer with this many guard bytes, filled with a pattern
  // before each run and checked after it (Run fails naming the node whose guard changed).
  // Guards are checked once per run, so with guards on every buffer gets its own memory
  // (no liveness reuse, no in-place): a larger arena, for debugging and the op harness.
  size_t guard_bytes = 0;
  // Arena alignment (at least backend::kMinAlignment).
  size_t alignment = 256;
};

// One external tensor of a Program.
struct ExternalInfo {
  std::string name;
  OpKind kind;  // kInput, kWeight or kState
  DType dtype;
  SymShape shape;
};

class Program {
 public:
  ~Program();
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  // ---- Description ----
  const Graph& graph() const { return graph_; }  // after all passes
  backend::Device& device() const { return *device_; }
  const std::vector<ExternalInfo>& externals() const { return externals_; }
  int FindExternal(std::string_view name) const;  // -1 if absent
  int FindSymbol(std::string_view name) const { return graph_.FindSymbol(name); }
  int num_outputs() const { return static_cast<int>(outputs_.size()); }
  int num_launches() const { return static_cast<int>(launches_.size()); }
  // Arena bytes (the planner's peak, at the symbols' upper bounds).
  size_t arena_bytes() const { return arena_bytes_; }
  // Bytes the arena would need without reuse (sum of all buffers), for comparison.
  size_t unplanned_bytes() const { return unplanned_bytes_; }
  // The launch list: "#3 %7 blk.0.attn_norm rms_norm ref.rms_norm out=arena+1024".
  std::string DebugString() const;

  // ---- Binding (persists across runs) ----
  Status SetSymbol(int index, int64_t value);
  Status SetSymbol(std::string_view name, int64_t value);
  Status Bind(int external, const Tensor& tensor);
  Status Bind(std::string_view name, const Tensor& tensor);

  // ---- Running ----
  // Validates the bindings and resolves every launch's pointers and sizes (done by Run when
  // something changed; exposed for capture). Errors name the offending input or symbol.
  Status Prepare();
  // Enqueues the program on `stream` (host backends finish before returning). Outputs are
  // ready after stream.Synchronize().
  Status Run(backend::Stream& stream);
  // The resolved launch list (valid after Prepare, until a binding changes).
  std::span<const Launch> launches() const { return launches_; }
  // Output i of the last Prepare/Run: a view into the arena (or an external tensor), valid
  // until the next Run.
  StatusOr<Tensor> Output(int i) const;

 private:
  friend StatusOr<std::unique_ptr<Program>> CompileImpl(const Graph&, std::span<const Value>,
                                                        backend::Device&, const CompileOptions&);
  Program() = default;
  struct Recipe;
  struct GuardRegion;
  int DimIndex(const Dim& d);
  Status CheckGuards(backend::Stream& stream);
  // Run with KILN_PROFILE set: one launch at a time, each timed (engine/profile.h).
  Status RunProfiled(backend::Stream& stream, LaunchProfile& profile);

  Graph graph_;
  backend::Device* device_ = nullptr;
  std::vector<ExternalInfo> externals_;
  std::vector<Tensor> bound_;           // per external
  std::vector<int32_t> external_node_;  // node id per external
  std::vector<int64_t> symbol_values_;
  bool symbols_set_ = false;
  std::vector<char> symbol_set_;

  std::vector<backend::Kernel> kernels_;
  std::vector<TensorArg> arg_pool_;      // inputs of all launches
  std::vector<LaunchArgs> launch_args_;  // one per launch
  std::vector<Launch> launches_;
  std::vector<int32_t> launch_node_;  // node id per launch
  std::vector<Recipe> recipes_;       // how to fill every TensorArg
  std::vector<Dim> dims_;             // distinct symbolic sizes used by recipes
  std::vector<int64_t> dim_values_;
  struct ParamRecipe {
    int64_t* dst;
    int32_t dim;
  };
  std::vector<ParamRecipe> params_;
  struct SliceCheck {
    int32_t node, start, size, extent;
  };
  std::vector<SliceCheck> slice_checks_;
  std::vector<int32_t> outputs_;  // recipe index per output
  std::vector<TensorArg> output_args_;

  std::shared_ptr<backend::Buffer> arena_;
  size_t arena_bytes_ = 0;
  size_t unplanned_bytes_ = 0;
  std::vector<GuardRegion> guards_;
  std::vector<int64_t> storage_offset_;  // per node: arena byte offset or -1
  bool prepared_ = false;
  DumpConfig dump_;
};

// Compiles `outputs` of `graph` for `device`. Errors: the graph fails verification, or the
// device has no kernel for some node (the message names the node, op, types and device).
StatusOr<std::unique_ptr<Program>> Compile(const Graph& graph, std::span<const Value> outputs,
                                           backend::Device& device,
                                           const CompileOptions& options = {});
inline StatusOr<std::unique_ptr<Program>> Compile(const Graph& graph,
                                                  std::initializer_list<Value> outputs,
                                                  backend::Device& device,
                                                  const CompileOptions& options = {}) {
  return Compile(graph, std::span<const Value>(outputs.begin(), outputs.size()), device, options);
}

}  // namespace kiln
