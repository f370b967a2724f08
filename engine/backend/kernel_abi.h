// The kernel calling convention: what one launch of a compiled Program hands a kernel.
//
// A Program is a flat list of Launch {fn, args}. Running it is a loop that calls
// `fn(args, ctx)` — no allocation, lookups or virtual calls per launch. Everything a launch
// needs is resolved before the loop: data pointers, concrete shapes and strides (symbolic
// dims evaluated once per run), and run-time attribute values (`params`).
//
// Threading: a host backend may call every launch on `thread_count` threads at once (with a
// barrier between launches, like ggml); each call gets its `thread_index` and must do its
// share or nothing. Reference kernels do all the work on thread 0 and return at once on the
// others. Device backends call fn once per launch on the host to enqueue work on
// `native_stream`.
//
// Plain data only: this header is shared with out-of-tree backend plugins.
#pragma once

#include <cstdint>

#include "engine/dtype.h"

namespace kiln {

inline constexpr int kMaxRank = 8;
inline constexpr int kMaxLaunchParams = 4;

// A tensor as a kernel sees it. `data` is the device address of element (0, ..., 0);
// strides are in elements (0 for broadcast axes). Block-quantized tensors are addressed by
// rows: element offsets used with them are multiples of the block size, and the byte offset
// of element e is ByteOffset(dtype, e).
struct TensorArg {
  void* data = nullptr;
  DType dtype = DType::kInvalid;
  int32_t rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[i];
    return n;
  }
  bool IsContiguous() const {
    int64_t expect = 1;
    for (int i = rank - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expect) return false;
      expect *= shape[i];
    }
    return true;
  }
};

// Byte offset of element `elems` (a block boundary for quantized dtypes).
inline int64_t ByteOffset(DType t, int64_t elems) {
  return elems / DTypeBlockElems(t) * DTypeBlockBytes(t);
}

// Outputs: `output` is output 0 of the node. Multi-output nodes (engine/graph.h: fused
// cross-entropy's dlogits, attention's log-sum-exp, the optimizers' states) hand outputs 1 .. n-1
// in `extra_outputs`, in output order; single-output nodes have none (null, 0). An output
// that the op writes in place (ops.h: OpDef::writes_input) points at the State it updates.
struct LaunchArgs {
  const void* kernel_data = nullptr;  // the Kernel's data (per node, made at compile time)
  const TensorArg* inputs = nullptr;
  int32_t num_inputs = 0;
  TensorArg output;
  int64_t params[kMaxLaunchParams] = {};  // the node's attrs.dims, evaluated for this run
  const TensorArg* extra_outputs = nullptr;
  int32_t num_extra_outputs = 0;
};

// A kernel computes share `thread_index` of `thread_count` of its launch. Host streams
// normally run the shares at once on their pool. `shares_in_sequence`: this time one thread
// runs them one after another, in index order (HostStream's straggler fallback). Then the same
// shares give the same results, but a kernel must not wait for a later share of its own
// launch (an in-launch barrier would never open).
struct ExecCtx {
  int thread_index = 0;
  int thread_count = 1;
  void* native_stream = nullptr;
  bool shares_in_sequence = false;
};

using KernelFn = void (*)(const LaunchArgs& args, const ExecCtx& ctx);

struct Launch {
  KernelFn fn = nullptr;
  const LaunchArgs* args = nullptr;
};

}  // namespace kiln
