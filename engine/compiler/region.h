// Regional compilation: finding the structurally identical subgraphs of a graph (the N
// transformer blocks) so that one is compiled and the others reuse its kernels.
//
// Regions come from the name scopes model code gives nodes ("blk.3.attn_norm" is in region
// "blk.3"; unnamed nodes belong to the region of the next named node, as builders name a
// block's results). Two regions are identical when their structural hashes match: the hash
// covers every node's op, attributes, dtype and shape and how nodes connect inside the
// region; inputs from outside are parameters described only by kind, dtype and shape
// (weights of different blocks are different tensors of the same type). Kernels are keyed
// by their generated source, so identical regions ask for identical kernels: the first
// instance compiles them and the rest reuse them (CompileCounters::reused).
//
// Thread-safety: pure function.
#pragma once

#include <string>
#include <vector>

#include "engine/graph.h"

namespace kiln::compiler {

struct RegionClass {
  std::string family;                  // "blk"
  std::string hash;                    // structural hash (hex, 16 digits)
  std::vector<std::string> instances;  // "blk.1", "blk.2", ...
  int nodes = 0;                       // per instance
};

struct RegionReport {
  int regions = 0;                   // scoped regions found
  std::vector<RegionClass> classes;  // distinct structures, most instances first
  // Classes with more than one instance, and how many instances those cover.
  int RepeatedInstances() const;
  std::string Summary() const;  // "30 regions blk.N in 2 structures (29 + 1)"
};

RegionReport FindRegions(const Graph& g);

}  // namespace kiln::compiler
