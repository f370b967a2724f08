// The dump switch: `KILN_DUMP=<pass>[,<pass>...]` or `KILN_DUMP=all` prints the graph after
// each named compiler pass (and "autograd" after Gradients; "program" prints the launch list
// of a compiled Program) to stderr, or to the file named by KILN_DUMP_FILE (appended).
//
// Pass names: build, autograd, verify, dce, cast_matmul_rhs, lower_views, assign, plan, program.
//
// Thread-safety: DumpConfig is a value; writing to one stream from several threads
// interleaves whole dumps (each dump is written with one call).
#pragma once

#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

class Graph;

struct DumpConfig {
  std::string passes;           // "verify,plan" or "all"; empty: nothing
  std::ostream* out = nullptr;  // null: KILN_DUMP_FILE if set, else stderr

  bool Enabled(std::string_view pass) const;
  // Writes `text` with a header line naming the pass.
  void Write(std::string_view pass, std::string_view text) const;
};

// From the environment (KILN_DUMP, KILN_DUMP_FILE).
DumpConfig DumpConfigFromEnv();

// Prints `g` (with optional per-node marks) if `pass` is enabled.
void DumpGraph(const DumpConfig& config, std::string_view pass, const Graph& g,
               const std::vector<std::string>* marks = nullptr);

}  // namespace kiln
