// Runs the Llama-style test model (llama_graph.h) on a device: the compiler tests' end-to-end
// check that fused programs compute what the reference computes (fusion_test on cpu,
// xpu_compiler_test on OpenCL).
//
// Thread-safety: thread-safe (each call builds its own graph, program and stream).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/base/metrics.h"
#include "engine/compiler/compile.h"
#include "engine/compiler/testing/llama_graph.h"

namespace kiln::compiler::testing {

struct LlamaRun {
  bool compiler = true;  // compiler::Compile (false: kiln::Compile)
  bool fuse = true;
  int64_t seqs = 1;                 // sequences in the step
  int64_t new_tokens = 1;           // tokens per sequence in the step under test
  int64_t context = 0;              // tokens already in the cache (a prefill step fills them first)
  CompileReport* report = nullptr;  // filled when `compiler`
  metrics::Registry* registry = nullptr;  // passed to the compile
};

// The logits of the step under test, as doubles (row-major [T, vocab]).
StatusOr<std::vector<double>> RunLlama(const LlamaConfig& cfg, backend::Device& dev,
                                       const LlamaRun& run);

// Normalized mean squared error of `a` against `want`.
double Nmse(const std::vector<double>& a, const std::vector<double>& want);

}  // namespace kiln::compiler::testing
