// The cross-backend op harness (ggml's test-backend-ops, for Kiln): every op x dtype x shape
// on every registered backend, against the reference backend.
//
// Modes:
//   forward   run the case on `ref` and on the backend under test; compare with a normalized
//             MSE tolerance per output dtype (exact for integers and bools), check NaN/Inf
//             agree, check sentinels around every input buffer (out-of-bounds writes, inputs
//             modified) and guard bytes around every arena buffer.
//   gradient  in f64: the backward graph (autograd) on the backend under test against
//             central finite differences of the forward graph on `ref`, for
//             loss = sum(op(x) * R) with a fixed random R.
//   perf      time a case on a backend (runs, µs per run and per launch), plus the bare
//             per-launch overhead of the executor.
// Because the cpu backend runs pointwise and reduction ops by interpreting the op table's
// expression forms, forward mode on `cpu` is also the proof that every form matches the
// reference loops.
//
// A new op is not done without cases here (harness_test checks coverage of the op table).
// `full` adds larger shapes and more dtype combinations (slower; KILN_HARNESS_FULL=1 or
// `kiln_op_harness --full`).
//
// Thread-safety: cases are values; Run* create their own programs and streams and may run
// concurrently on different devices.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "engine/backend/backend.h"
#include "engine/builder.h"
#include "engine/program.h"

namespace kiln::harness {

enum class Init {
  kNormal,        // N(0, 1) * scale (hi)
  kUniform,       // U[lo, hi)
  kIndex,         // integers in [lo, hi)
  kBool,          // 0/1
  kCustom,        // `values`
  kRandomBlocks,  // random bytes with sane scales (quantized types that cannot be quantized here)
};

struct InputSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  Init init = Init::kNormal;
  double lo = -1, hi = 1;
  std::vector<double> values;
  OpKind source = OpKind::kInput;  // kInput, kWeight or kState
  bool differentiable = true;      // wrt in gradient mode (float inputs only)
};

struct OpCase {
  std::string op;    // grouping key: the op under test ("rms_norm")
  std::string name;  // unique: "rms_norm f16 [2,3,64]"
  std::vector<InputSpec> inputs;
  // Builds the graph from the input values (in InputSpec order); returns the output. When
  // that is a multi-output node, every one of its outputs is compared (an output written in
  // place is the State after the run).
  std::function<Value(Builder&, const std::vector<Value>&)> build;
  double tol = -1;         // NMSE tolerance override (forward)
  double grad_eps = 1e-6;  // finite-difference step (relative to max(1, |x|))
  double grad_tol = 1e-8;  // NMSE tolerance (gradient)
};

// The ops a case's graph contains (sources excluded), for coverage accounting.
StatusOr<std::vector<OpKind>> OpsOf(const OpCase& c);

std::vector<OpCase> ForwardCases(bool full);
std::vector<OpCase> GradientCases(bool full);
// A few representative cases at realistic sizes (perf mode).
std::vector<OpCase> PerfCases(bool full);

struct Result {
  enum class Outcome { kPass, kFail, kUnsupported } outcome = Outcome::kPass;
  std::string message;  // why it failed / is unsupported; the error measure otherwise
  double error = 0;     // NMSE (forward, gradient)
  double seconds = 0;   // perf: per run
  int launches = 0;
};

// Default forward NMSE tolerance for an output dtype (0: exact).
double Tolerance(DType dtype);

Result RunForward(const OpCase& c, backend::Device& ref, backend::Device& dev);
Result RunGradient(const OpCase& c, backend::Device& ref, backend::Device& dev);
Result RunPerf(const OpCase& c, backend::Device& dev, int iterations);
// Compiles a case's graph for `dev` as RunForward (forward) or RunGradient (its loss and
// gradients) do, without running it: backends that build kernels in batches declare every
// case's kernels this way first.
StatusOr<std::unique_ptr<Program>> CompileCase(const OpCase& c, bool gradient,
                                               backend::Device& dev);
// Every forward (or gradient) case on a device that builds kernels in batches: declares every
// case's kernels (CompileCase), calls `build` once (the device's batch build), then runs and
// compares each case against `ref`. `only_op` (non-empty) limits the run to one op. Cases that
// do not pass are listed in `failures` ("<case>: <message>"); unsupported counts as failing.
struct SuiteResult {
  Status build;  // what `build` returned; nothing ran when it failed
  int ran = 0, passed = 0;
  std::vector<std::string> ops;         // distinct ops run
  std::vector<std::string> failed_ops;  // distinct ops with a case that did not pass
  std::vector<std::string> failures;
  double build_seconds = 0, run_seconds = 0;
  std::string Summary() const;  // "393/393 cases passed over 68 ops (failing ops: none); ..."
};
SuiteResult RunBatchBuilt(bool gradient, backend::Device& ref, backend::Device& dev,
                          const std::function<Status()>& build, const std::string& only_op = "");

// Executor overhead: nanoseconds per launch for a program of `launches` tiny launches.
StatusOr<double> LaunchOverheadNs(backend::Device& dev, int launches, int iterations);

}  // namespace kiln::harness
