#include "backends/gpu/gpu_sdpa.h"

#include "absl/strings/str_cat.h"

#if KILN_HAVE_CUDNN_SDPA
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"

#endif

namespace kiln::gpu {

std::string SdpaKey::Describe() const {
  return absl::StrCat(DTypeName(dtype), " B=", batch, " Hq=", q_heads, " Hkv=", kv_heads,
                      " T=", q_len, " S=", kv_len, " D=", head_dim, " scale=", scale,
                      causal ? " causal" : "", stats ? " stats" : "");
}

Status SdpaSupports(const SdpaKey& key) {
  if (key.dtype != DType::kF16 && key.dtype != DType::kBF16) {
    return InvalidArgument("cuDNN SDPA: dtype ", DTypeName(key.dtype), " (allowed: f16, bf16)");
  }
  if (key.head_dim != 64 && key.head_dim != 128) {
    return InvalidArgument("cuDNN SDPA: head dim ", key.head_dim, " (allowed: 64, 128)");
  }
  if (key.kv_heads <= 0 || key.q_heads % key.kv_heads != 0) {
    return InvalidArgument("cuDNN SDPA: ", key.q_heads, " query heads are not a multiple of ",
                           key.kv_heads, " KV heads");
  }
  if (key.batch <= 0 || key.q_len <= 0 || key.kv_len <= 0) {
    return InvalidArgument("cuDNN SDPA: empty problem ", key.Describe());
  }
  return OkStatus();
}

}  // namespace kiln::gpu

#if KILN_HAVE_CUDNN_SDPA
// cudnn-frontend's dynamic-loading mode resolves every cuDNN entry point from this handle
// (declared extern in cudnn_frontend_shim.h); LoadCudnn() sets it.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace kiln::gpu {

namespace fe = cudnn_frontend;

namespace {

// Tensor uids in the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// A frontend error as a Status naming the call, file and line.
Status FeStatus(fe::error_t e, const char* call, const char* file, int line) {
  if (e.is_good()) return OkStatus();
  return Internal("cudnn-frontend ", call, " at ", file, ":", line, ": ", e.get_message(),
                  " (code ", static_cast<int>(e.get_code()), ")");
}

// The frontend throws (std::runtime_error) when a dynamically loaded symbol is missing.
#define KILN_CUDNN_FE(expr)                                                                        \
  do {                                                                                             \
    fe::error_t kiln_fe_err_;                                                                      \
    try {                                                                                          \
      kiln_fe_err_ = (expr);                                                                       \
    } catch (const std::exception& ex) {                                                           \
      return Internal("cudnn-frontend ", #expr, " at ", __FILE__, ":", __LINE__, ": ", ex.what()); \
    }                                                                                              \
    KILN_RETURN_IF_ERROR(FeStatus(kiln_fe_err_, #expr, __FILE__, __LINE__));                       \
  } while (0)

Status LoadCudnn() {
  static std::once_flag once;
  static Status* result = nullptr;
  std::call_once(once, [] {
    std::string tried;
    const char* env = std::getenv("KILN_CUDNN");
    for (const char* name : {env, "libcudnn.so.9", "libcudnn.so"}) {
      if (name == nullptr || *name == '\0') continue;
      if (void* h = dlopen(name, RTLD_NOW | RTLD_GLOBAL); h != nullptr) {
        fe::cudnn_dlhandle = h;
        result = new Status(OkStatus());
        return;
      }
      absl::StrAppend(&tried, tried.empty() ? "" : "; ", dlerror());
    }
    result = new Status(Unavailable("cuDNN not found (libcudnn.so.9; KILN_CUDNN names it): ", tried,
                                    ": attention uses Kiln's kernel"));
  });
  return *result;
}

fe::DataType_t FeType(DType t) {
  return t == DType::kF16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

// A dense row-major (d0, d1, d2, d3) tensor.
fe::graph::Tensor_attributes Dense(const char* name, Uid uid, int64_t d0, int64_t d1, int64_t d2,
                                   int64_t d3) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({d0, d1, d2, d3})
      .set_stride({d1 * d2 * d3, d2 * d3, d3, 1});
}

struct SdpaGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

// The graph of `key`'s forward or backward, validated (no handle needed up to here).
StatusOr<std::shared_ptr<fe::graph::Graph>> BuildGraph(const SdpaKey& key, bool backward,
                                                       int sm_version) {
  KILN_RETURN_IF_ERROR(SdpaSupports(key));
  if (backward && !key.stats) {
    return InvalidArgument("SDPA backward needs the forward's stats (key.stats): ", key.Describe());
  }
  KILN_RETURN_IF_ERROR(LoadCudnn());
  const int64_t b = key.batch, hq = key.q_heads, hkv = key.kv_heads, t = key.q_len, s = key.kv_len,
                d = key.head_dim;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(FeType(key.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  if (sm_version > 0) g->set_sm_version(sm_version);
  auto q = g->tensor(Dense("Q", kQ, b, hq, t, d));   // (B, Hq, T, D)
  auto k = g->tensor(Dense("K", kK, b, hkv, s, d));  // (B, Hkv, S, D)
  auto v = g->tensor(Dense("V", kV, b, hkv, s, d));  // (B, Hkv, S, D)
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("kiln.sdpa")
                    .set_generate_stats(key.stats)
                    .set_causal_mask(key.causal)
                    .set_attn_scale(key.scale);
    auto [o, stats] = g->sdpa(q, k, v, opts);
    o->set_output(true)
        .set_uid(kO)
        .set_dim({b, hq, t, d})
        .set_stride({hq * t * d, t * d, d, 1});  // (B, Hq, T, D)
    if (key.stats) {
      stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);  // (B,Hq,T,1)
    }
  } else {
    auto o = g->tensor(Dense("O", kO, b, hq, t, d));            // (B, Hq, T, D)
    auto d_o = g->tensor(Dense("dO", kDO, b, hq, t, d));        // (B, Hq, T, D)
    auto stats = g->tensor(Dense("Stats", kStats, b, hq, t, 1)  // (B, Hq, T, 1) f32
                               .set_data_type(fe::DataType_t::FLOAT));
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("kiln.sdpa_backward")
                    .set_causal_mask(key.causal)
                    .set_attn_scale(key.scale);
    auto [d_q, d_k, d_v] = g->sdpa_backward(q, k, v, o, d_o, stats, opts);
    d_q->set_output(true)
        .set_uid(kDQ)
        .set_dim({b, hq, t, d})
        .set_stride({hq * t * d, t * d, d, 1});  // (B, Hq, T, D)
    d_k->set_output(true)
        .set_uid(kDK)
        .set_dim({b, hkv, s, d})
        .set_stride({hkv * s * d, s * d, d, 1});  // (B, Hkv, S, D)
    d_v->set_output(true)
        .set_uid(kDV)
        .set_dim({b, hkv, s, d})
        .set_stride({hkv * s * d, s * d, d, 1});  // (B, Hkv, S, D)
  }
  KILN_CUDNN_FE(g->validate());
  return g;
}

}  // namespace

bool SdpaCompiled() { return true; }

Status ValidateSdpa(const SdpaKey& key, bool backward, int sm_version) {
  return BuildGraph(key, backward, sm_version).status();
}

struct SdpaRunner::Impl {
  cudaStream_t stream = nullptr;
  cudnnHandle_t handle = nullptr;
  absl::flat_hash_map<SdpaKey, SdpaGraph> forward, backward;
  int64_t built = 0;

  // The cached graph of `key`, built with this handle (heuristics mode A, then fallback).
  StatusOr<const SdpaGraph*> Get(const SdpaKey& key, bool bwd) {
    auto& cache = bwd ? backward : forward;
    if (auto it = cache.find(key); it != cache.end()) return &it->second;
    KILN_ASSIGN_OR_RETURN(auto g, BuildGraph(key, bwd, /*sm_version=*/0));
    KILN_CUDNN_FE(g->build_operation_graph(handle));
    KILN_CUDNN_FE(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}));
    KILN_CUDNN_FE(g->check_support(handle));
    KILN_CUDNN_FE(g->build_plans(handle));
    SdpaGraph entry{g, 0};
    KILN_CUDNN_FE(g->get_workspace_size(entry.workspace_bytes));
    ++built;
    return &cache.emplace(key, std::move(entry)).first->second;
  }

  Status Run(const SdpaGraph& g, std::unordered_map<int64_t, void*>& pack,
             const SdpaScratch& scratch) {
    void* ws = nullptr;
    if (g.workspace_bytes > 0) {
      ws = scratch(static_cast<size_t>(g.workspace_bytes));
      if (ws == nullptr) {
        return ResourceExhausted("no scratch memory for cuDNN SDPA's ", g.workspace_bytes,
                                 "-byte workspace");
      }
    }
    KILN_CUDNN_FE(g.graph->execute(handle, pack, ws));
    return OkStatus();
  }
};

SdpaRunner::SdpaRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SdpaRunner::~SdpaRunner() {
  if (impl_ != nullptr && impl_->handle != nullptr) {
    try {
      fe::detail::destroy_handle(impl_->handle);
    } catch (const std::exception&) {  // the library is open: cannot happen, nothing to do
    }
  }
}

StatusOr<std::unique_ptr<SdpaRunner>> SdpaRunner::Create(cudaStream_t stream) {
  KILN_RETURN_IF_ERROR(LoadCudnn());
  auto impl = std::make_unique<Impl>();
  impl->stream = stream;
  try {
    if (cudnnStatus_t st = fe::detail::create_handle(&impl->handle); st != CUDNN_STATUS_SUCCESS) {
      return Unavailable("cudnnCreate at ", __FILE__, ":", __LINE__, ": ",
                         fe::detail::get_error_string(st));
    }
    if (cudnnStatus_t st = fe::detail::set_stream(impl->handle, stream);
        st != CUDNN_STATUS_SUCCESS) {
      fe::detail::destroy_handle(impl->handle);
      return Internal("cudnnSetStream at ", __FILE__, ":", __LINE__, ": ",
                      fe::detail::get_error_string(st));
    }
  } catch (const std::exception& ex) {
    return Unavailable("cuDNN at ", __FILE__, ":", __LINE__, ": ", ex.what());
  }
  return std::unique_ptr<SdpaRunner>(new SdpaRunner(std::move(impl)));
}

Status SdpaRunner::Forward(const SdpaKey& key, const SdpaForwardArgs& a,
                           const SdpaScratch& scratch) {
  if (key.stats != (a.stats != nullptr)) {
    return InvalidArgument("SDPA forward: stats pointer given iff key.stats (", key.Describe(),
                           ")");
  }
  KILN_ASSIGN_OR_RETURN(const SdpaGraph* g, impl_->Get(key, /*bwd=*/false));
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(a.q)},
                                             {kK, const_cast<void*>(a.k)},
                                             {kV, const_cast<void*>(a.v)},
                                             {kO, a.o}};
  if (key.stats) pack[kStats] = a.stats;
  return impl_->Run(*g, pack, scratch);
}

Status SdpaRunner::Backward(const SdpaKey& key, const SdpaBackwardArgs& a,
                            const SdpaScratch& scratch) {
  KILN_ASSIGN_OR_RETURN(const SdpaGraph* g, impl_->Get(key, /*bwd=*/true));
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(a.q)},
                                             {kK, const_cast<void*>(a.k)},
                                             {kV, const_cast<void*>(a.v)},
                                             {kO, const_cast<void*>(a.o)},
                                             {kDO, const_cast<void*>(a.d_o)},
                                             {kStats, const_cast<float*>(a.stats)},
                                             {kDQ, a.d_q},
                                             {kDK, a.d_k},
                                             {kDV, a.d_v}};
  return impl_->Run(*g, pack, scratch);
}

int64_t SdpaRunner::graphs_built() const { return impl_->built; }

}  // namespace kiln::gpu

#else  // !KILN_HAVE_CUDNN_SDPA: built without cudnn-frontend's headers.

namespace kiln::gpu {

namespace {
Status NotBuilt() {
  return Unavailable(
      "cuDNN SDPA is not built (cudnn-frontend's headers were not found at "
      "configure time: run scripts/install-deps.sh)");
}
}  // namespace

bool SdpaCompiled() { return false; }
Status ValidateSdpa(const SdpaKey&, bool, int) { return NotBuilt(); }
struct SdpaRunner::Impl {};
SdpaRunner::SdpaRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SdpaRunner::~SdpaRunner() = default;
StatusOr<std::unique_ptr<SdpaRunner>> SdpaRunner::Create(cudaStream_t) { return NotBuilt(); }
Status SdpaRunner::Forward(const SdpaKey&, const SdpaForwardArgs&, const SdpaScratch&) {
  return NotBuilt();
}
Status SdpaRunner::Backward(const SdpaKey&, const SdpaBackwardArgs&, const SdpaScratch&) {
  return NotBuilt();
}
int64_t SdpaRunner::graphs_built() const { return 0; }

}  // namespace kiln::gpu

#endif  // KILN_HAVE_CUDNN_SDPA
