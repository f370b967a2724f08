// Reference kernels: plain, obviously correct loops for every op of the op table. They are
// the oracle every other kernel is checked against (backends/harness), so they favour
// clarity over speed: elements are loaded into double (or int64 for integer types), computed
// in double, and rounded once when stored; strided inputs are walked index by index.
//
// Kernels use the calling convention of engine/backend/kernel_abi.h and do all their work on thread
// 0 (other threads return at once). Bad data never crashes a kernel: out-of-range indices
// read as zeros and are skipped when writing (gather, take_along, scatter, kv_write,
// paged attention block tables); integer division by zero gives 0.
#pragma once

#include "engine/backend/backend.h"

namespace kiln::ref {

// A reference kernel for the request; Unimplemented for ops without kernels (sources and
// views, which the executor handles without launches).
StatusOr<backend::Kernel> KernelFor(const backend::KernelRequest& request);

// The loops of some reference kernels over a range of rows or elements, for backends that
// split them over threads (the cpu backend): the same code and numerics as the reference.
// fused_cross_entropy: rows [begin, end) of FusedCrossEntropyRowCount(args).
int64_t FusedCrossEntropyRowCount(const LaunchArgs& args);
void FusedCrossEntropyRows(const LaunchArgs& args, int64_t ignore_index, int64_t begin,
                           int64_t end);
// The optimizers (adamw, adam, sgd, adagrad: `op`, with the node's `attrs`): elements
// [begin, end) of the parameter.
void OptimizerElements(const LaunchArgs& args, OpKind op, const Attrs& attrs, int64_t begin,
                       int64_t end);
// sample: rows (sequences) [begin, end) of SampleRowCount(args).
int64_t SampleRowCount(const LaunchArgs& args);
void SampleRows(const LaunchArgs& args, int64_t begin, int64_t end);

}  // namespace kiln::ref
