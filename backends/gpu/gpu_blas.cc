#include "backends/gpu/gpu_blas.h"

#if KILN_GPU_HIP
// HIP: no BLAS library here (rocBLAS and hipBLASLt are not in Debian 12); GEMMs run Kiln's own
// kernels.
namespace kiln::gpu {

struct BlasApi {};

StatusOr<std::unique_ptr<BlasHandle>> BlasHandle::Create(cudaStream_t) {
  return Unavailable("the hip backend has no BLAS library; GEMMs run Kiln's kernels");
}
BlasHandle::~BlasHandle() = default;
bool BlasHandle::Supports(DType) { return false; }
bool BlasHandle::Gemm(const devk::GemmCall&, std::string* why) {
  *why = "no BLAS library";
  return false;
}

}  // namespace kiln::gpu

#else
#include <cublas_api.h>
#include <dlfcn.h>

#include <mutex>

#include "absl/strings/str_cat.h"

namespace kiln::gpu {

// The cuBLAS entry points used, with cuBLAS's own signatures.
struct BlasApi {
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t) = nullptr;
  cublasStatus_t (*set_workspace)(cublasHandle_t, void*, size_t) = nullptr;
  cublasStatus_t (*gemm_batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                 int, const void*, const void*, cudaDataType, int, long long,
                                 const void*, cudaDataType, int, long long, const void*, void*,
                                 cudaDataType, int, long long, int, cublasComputeType_t,
                                 cublasGemmAlgo_t) = nullptr;
  const char* (*status_string)(cublasStatus_t) = nullptr;
};

namespace {

constexpr size_t kWorkspaceBytes = 32ull << 20;

StatusOr<const BlasApi*> LoadBlas() {
  static std::once_flag once;
  static StatusOr<const BlasApi*>* result = nullptr;
  std::call_once(once, [] {
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (h == nullptr) continue;
      auto* api = new BlasApi();
      bool ok = true;
      auto sym = [&](auto& fn, const char* s) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, s));
        ok &= fn != nullptr;
      };
      sym(api->create, "cublasCreate_v2");
      sym(api->destroy, "cublasDestroy_v2");
      sym(api->set_stream, "cublasSetStream_v2");
      sym(api->set_workspace, "cublasSetWorkspace_v2");
      sym(api->gemm_batched, "cublasGemmStridedBatchedEx");
      sym(api->status_string, "cublasGetStatusString");
      if (ok) {
        result = new StatusOr<const BlasApi*>(api);
        return;
      }
      delete api;
      dlclose(h);
    }
    result = new StatusOr<const BlasApi*>(
        Unavailable("cuBLAS not found (libcublas.so.13, .12): GEMMs use Kiln's kernels"));
  });
  return *result;
}

}  // namespace

StatusOr<std::unique_ptr<BlasHandle>> BlasHandle::Create(cudaStream_t stream) {
  KILN_ASSIGN_OR_RETURN(const BlasApi* api, LoadBlas());
  std::unique_ptr<BlasHandle> h(new BlasHandle());
  h->api_ = api;
  cublasHandle_t handle = nullptr;
  if (cublasStatus_t st = api->create(&handle); st != CUBLAS_STATUS_SUCCESS) {
    return Unavailable("cublasCreate: ", api->status_string(st));
  }
  h->handle_ = handle;
  if (cudaMalloc(&h->workspace_, kWorkspaceBytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return ResourceExhausted("cannot allocate cuBLAS's ", kWorkspaceBytes >> 20, " MiB workspace");
  }
  if (cublasStatus_t st = api->set_workspace(handle, h->workspace_, kWorkspaceBytes);
      st != CUBLAS_STATUS_SUCCESS) {
    return Internal("cublasSetWorkspace: ", api->status_string(st));
  }
  if (cublasStatus_t st = api->set_stream(handle, stream); st != CUBLAS_STATUS_SUCCESS) {
    return Internal("cublasSetStream: ", api->status_string(st));
  }
  return h;
}

BlasHandle::~BlasHandle() {
  if (handle_ != nullptr) api_->destroy(static_cast<cublasHandle_t>(handle_));
  if (workspace_ != nullptr) cudaFree(workspace_);
}

bool BlasHandle::Supports(DType t) {
  return t == DType::kF32 || t == DType::kF64 || t == DType::kF16 || t == DType::kBF16;
}

bool BlasHandle::Gemm(const devk::GemmCall& g, std::string* why) {
  cudaDataType_t type;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  size_t es = 4;
  switch (g.dtype) {
    case DType::kF32:
      type = CUDA_R_32F;
      break;
    case DType::kF64:
      type = CUDA_R_64F;
      compute = CUBLAS_COMPUTE_64F;
      es = 8;
      break;
    case DType::kF16:
      type = CUDA_R_16F;
      es = 2;
      break;
    case DType::kBF16:
      type = CUDA_R_16BF;
      es = 2;
      break;
    default:
      *why = "no cuBLAS GEMM for this dtype";
      return false;
  }
  // Row-major C (m x n) = A (m x k) B (k x n) is column-major C^T = B^T A^T: a row-major
  // operand is its column-major transpose, so B comes first and the shapes swap.
  const auto op = [](bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; };
  const auto at = [&](const devk::GemmOperand& o) {
    return static_cast<const char*>(o.mem) + o.offset * es;
  };
  const float f1 = 1, f0 = 0;
  const double d1 = 1, d0 = 0;
  const void* alpha = compute == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&d1) : &f1;
  const void* beta = compute == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&d0) : &f0;
  const cublasStatus_t st = api_->gemm_batched(
      static_cast<cublasHandle_t>(handle_), op(g.b.trans), op(g.a.trans), static_cast<int>(g.n),
      static_cast<int>(g.m), static_cast<int>(g.k), alpha, at(g.b), type, static_cast<int>(g.b.ld),
      static_cast<long long>(g.b.batch_stride), at(g.a), type, static_cast<int>(g.a.ld),
      static_cast<long long>(g.a.batch_stride), beta, const_cast<char*>(at(g.c)), type,
      static_cast<int>(g.c.ld), static_cast<long long>(g.c.batch_stride), static_cast<int>(g.batch),
      compute, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) {
    *why = absl::StrCat("cublasGemmStridedBatchedEx: ", api_->status_string(st));
    return false;
  }
  return true;
}

}  // namespace kiln::gpu

#endif  // KILN_GPU_HIP
