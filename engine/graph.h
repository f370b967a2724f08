// The graph IR: a list of nodes in topological (builder) order, each producing one tensor.
//
// Node ids are indices into the graph and always larger than the ids of their inputs. The
// builder (builder.h) appends nodes; passes (passes.h) read graphs and produce new ones.
//
// Multi-output nodes: a node of an op with n outputs (OpDef::infer_extra) is output 0 and is
// followed directly by n - 1 `output_of` nodes, outputs 1 .. n-1 in order, each reading only
// the producer (XLA's get-tuple-element, Inductor's MultiOutput). A Value is therefore still
// one node id; output_of nodes own storage but have no kernel: the producer's launch writes
// them. Passes keep every output_of right after its producer (verify checks it).
//
// In-place writes: an output may overwrite one of its op's inputs (OpDef::writes_input), which
// must be State storage; the output is the value after the write (see passes.h, verify).
// Symbols are the graph's run-time sizes (`T`, `S`), each with a declared range; Dims in
// node shapes refer to them by index.
//
// Ownership: a Graph owns its nodes; Values are plain ids, meaningful only with their graph.
// Thread-safety: a Graph is not internally synchronized; build it on one thread, then share
// it read-only.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "engine/ops.h"

namespace kiln {

struct Node {
  OpKind op = OpKind::kInput;
  std::vector<int32_t> inputs;
  DType dtype = DType::kInvalid;
  SymShape shape;
  Attrs attrs;
  std::string name;  // "blk.3.attn_norm"; sources require one; others may be empty
};

struct SymbolInfo {
  std::string name;
  int64_t min = 1;
  int64_t max = 1;
};

class Graph {
 public:
  Graph() = default;

  // Declares a symbol with range [min, max]; returns its Dim. REQUIRES: fewer than
  // kMaxSymbols symbols and 0 <= min <= max (checked: a programmer error).
  Dim AddSymbol(std::string name, int64_t max, int64_t min = 1);
  int num_symbols() const { return static_cast<int>(symbols_.size()); }
  const SymbolInfo& symbol(int i) const { return symbols_[i]; }
  const std::vector<SymbolInfo>& symbols() const { return symbols_; }
  // Symbol names in index order (for printing Dims).
  const std::vector<std::string>& symbol_names() const { return symbol_names_; }
  // -1 if there is no such symbol.
  int FindSymbol(std::string_view name) const;
  // The symbols' upper bounds, in index order (what the memory planner sizes for).
  std::vector<int64_t> SymbolMaxValues() const;

  // Appends a node as is (no validation: use Builder). Returns its id.
  int32_t AddNode(Node node);
  int32_t size() const { return static_cast<int32_t>(nodes_.size()); }
  const Node& node(int32_t id) const { return nodes_[id]; }
  Node& mutable_node(int32_t id) { return nodes_[id]; }
  const std::vector<Node>& nodes() const { return nodes_; }

  // The number of outputs of node `id` (1 + the output_of nodes that follow it).
  int NumOutputs(int32_t id) const;

  // Ids of the source nodes of a kind (Input/Weight/State) in order; and lookup by name.
  std::vector<int32_t> Sources(OpKind kind) const;
  int32_t FindByName(std::string_view name) const;  // -1 if absent

  // One line per node, stable and readable:
  //   %5 blk.0.attn_norm: f32[T,64] = rms_norm(%4) eps=1e-05
  // `marks` (optional, by node id) are appended as " # ..." comments.
  void Print(std::ostream& os, const std::vector<std::string>* marks = nullptr) const;
  std::string ToString() const;

 private:
  std::vector<Node> nodes_;
  std::vector<SymbolInfo> symbols_;
  std::vector<std::string> symbol_names_;
};

// "f32[T,64]"
std::string TypeString(DType dtype, const SymShape& shape, const Graph& g);

// The input node whose storage value `id` (a node's output 0 or an output_of node) overwrites
// in place (OpDef::writes_input), or -1.
int32_t InPlaceTarget(const Graph& g, int32_t id);
// The node whose storage value `id` lives in: through views (to their input) and in-place
// writes (to their target) back to a node with storage of its own (a source, or a computed
// value). `id` itself if it owns its storage.
int32_t StorageOwner(const Graph& g, int32_t id);

// The block a node name belongs to: "blk.3.attn_norm" -> "blk.3" (a word, a dot, a number, a
// dot, anything); other names -> "". Regional compilation (compiler/region.h) and activation
// recomputation (autograd.h, ScopeRanges) group nodes by it.
std::string_view BlockScope(std::string_view name);

}  // namespace kiln
