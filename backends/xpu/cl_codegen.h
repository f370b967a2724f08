// OpenCL C for the op table's expression forms: pointwise and reduction kernels, and the
// mask/score modifiers of attention kernels.
//
// NOTE: a minimal, OpenCL-only printer. The engine's codegen (engine/compiler: one printer
// core with C++, OpenCL C, CUDA and HIP dialects) was not available when this backend was
// written; once it lands, pointwise and reduce kernels should come from it and this file
// shrink to the launch-geometry glue (it is a second copy of the printing logic).
//
// Generated kernels follow the xpu calling convention (xpu_device.h): buffer arguments, then
// one metadata struct. They are rank- and dtype-specialized; sizes and strides arrive at run
// time in the metadata, so one kernel serves every symbol value.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "backends/xpu/xpu_device.h"
#include "engine/expr.h"

namespace kiln::xpu {

// Prints expressions as OpenCL C statements (one `const T tN = ...;` per distinct node).
// Leaves are printed through the names the caller chooses.
class ClExprPrinter {
 public:
  struct Leaves {
    std::vector<std::string> inputs;   // Input(i)
    std::string index_prefix = "idx";  // Index(a) -> idx<a>
    std::string acc_prefix = "acc";    // Acc(k) -> acc<k>
    std::string count = "count";
    // Load(k, e) -> aux_load<k>(e): the caller defines these (bounds-checked) helpers or
    // macros; `aux_dtype[k]` is the aux tensor's dtype.
    std::vector<DType> aux_dtype;
  };
  ClExprPrinter(Leaves leaves, bool fp64) : leaves_(std::move(leaves)), fp64_(fp64) {}

  // Appends the statements computing `e` to *body and returns the C expression holding it.
  // Unimplemented for f64 expressions on a device without cl_khr_fp64.
  StatusOr<std::string> Print(const Expr& e, std::string* body);

  static const char* CType(DType expr_type);  // float, double, long, bool

 private:
  StatusOr<std::string> Node(const Expr& e, std::string* body);
  Leaves leaves_;
  bool fp64_;
  std::vector<std::pair<const ExprNode*, std::string>> memo_;
  int next_ = 0;
};

// The loader call for an element of `dtype` read as expression type `as`:
// "ldf_f16(p, i)", "ldi_i32(p, i)", "(ldi_bool(p, i) != 0)", "ldd_f64(p, i)".
std::string ClLoad(DType dtype, DType as, const std::string& ptr, const std::string& index);
// The store statement of a value of expression type `from` into an element of `dtype`.
std::string ClStore(DType dtype, DType from, const std::string& ptr, const std::string& index,
                    const std::string& value);

// ---- Pointwise kernels ----
// out[i] = value(inputs at i, Index, aux loads). `main` inputs have the output's shape (any
// strides); `aux` inputs are 1-D (Load). Buffers: out, main..., aux...
struct PointwiseKernel {
  KernelSlot* slot = nullptr;
  int rank = 0;
  int num_main = 0;
  int num_aux = 0;
  int meta_size = 0;
};
StatusOr<PointwiseKernel> MakePointwiseKernel(XpuDevice& dev, const std::string& label,
                                              const Expr& value, std::span<const DType> inputs,
                                              int num_aux, DType out, int rank);
void LaunchPointwise(const PointwiseKernel& k, const LaunchArgs& a, Exec& ex);

// ---- Reduction and row kernels ----
// One work-group per output row. `reduce_axes` are axes of input 0; inputs 1.. are per-row
// tensors indexed by the kept axes. Buffers: out, inputs...
struct ReduceKernel {
  KernelSlot* slot = nullptr;
  std::vector<int> axes;
  int rank = 0;
  bool keepdim = false;
  bool elementwise = false;
  int num_inputs = 0;
  int meta_size = 0;
};
StatusOr<ReduceKernel> MakeReduceKernel(XpuDevice& dev, const std::string& label,
                                        const ReduceForm& form, std::span<const DType> inputs,
                                        DType out, int rank, std::vector<int> axes, bool keepdim);
void LaunchReduce(const ReduceKernel& k, const LaunchArgs& a, Exec& ex);

}  // namespace kiln::xpu
