// oneDNN (Debian's libdnnl 2.6, OpenMP runtime) f32 GEMM as a candidate implementation for
// Linear/MatMul on the cpu backend: y[M, n0:n1] = x · W[n0:n1]^T (or y += ...) for one pool
// thread's tile.
//
// One primitive per (K, weight layout) with run-time M, N and strides, created at compile
// time and executed from every pool thread on its own tile with oneDNN limited to one
// thread (omp_set_num_threads(1) in the calling thread), so oneDNN never starts an OpenMP
// team that would compete with the pool for the cores.
//
// Thread-safety: Run may be called from many threads at once (disjoint outputs).
#pragma once

#include <cstdint>
#include <memory>

#include "backends/cpu/kernels/kernels.h"
#include "engine/base/status.h"

namespace kiln::cpu {

class OneDnnGemm {
 public:
  // `w_k_contiguous`: W's rows are K-contiguous ([N, K], Linear) rather than N-contiguous
  // ([K, N], MatMul). Unavailable (error) if oneDNN cannot build the primitive here.
  // `x_transposed`: x is column-major (GemmArgs::x_transposed). `accumulate`: Run adds the
  // product to y's tile instead of overwriting it.
  static StatusOr<std::unique_ptr<OneDnnGemm>> Create(int64_t K, bool w_k_contiguous,
                                                      bool x_transposed = false,
                                                      bool accumulate = false);
  ~OneDnnGemm();

  // The tile [m0, m1) x [n0, n1) of y. REQUIRES: a.wtype == f32, a.K == the K of Create, the
  // layout of Create (w_k_stride == 1 iff w_k_contiguous; N-contiguous W has
  // w_row_bytes == 4; a.x_transposed as created).
  void Run(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) const;

  // "gemm:jit" — oneDNN's name for the implementation it picked.
  const char* impl_name() const;

 private:
  OneDnnGemm() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::cpu
