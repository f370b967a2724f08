// cuDNN scaled-dot-product attention (flash attention) through cudnn-frontend's graph API:
// forward (with the log-sum-exp "stats" a backward needs) and backward (dQ, dK, dV), causal,
// GQA (fewer KV heads), f16 and bf16, head dim 64 or 128. Graphs are built once per shape and
// dtype (SdpaKey) and cached per SdpaRunner; executing one is a single cuDNN call on the
// runner's stream, with its workspace taken from the caller's scratch memory.
//
// Linking: cudnn-frontend is header-only and built in its dynamic-loading mode
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): libcudnn.so.9 is opened with dlopen on first use
// (KILN_CUDNN=/path/libcudnn.so.9 names it), and the frontend's own CUDA runtime calls go
// through the shared libcudart.so.13 it opens, so neither is a link-time dependency of kilnd.
// Builds without the frontend's headers compile this out (SdpaCompiled() is false and every
// call returns Unavailable).
//
// Layout: every tensor is dense row-major, as the engine's Attention op has them:
//   q  (B, Hq, T, D)   k, v  (B, Hkv, S, D)   o, dO, dQ  (B, Hq, T, D)   dK, dV  (B, Hkv, S, D)
//   stats (B, Hq, T) f32: the natural-log log-sum-exp of each query row's scaled, masked
//   scores (the engine's AttentionWithLse `lse`).
// The causal mask is top-left aligned (kv_idx <= q_idx), the engine's attn::CausalMask.
//
// Thread-safety: SdpaCompiled and ValidateSdpa are thread-safe; an SdpaRunner is used by one
// thread at a time (like the stream it is bound to).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "backends/gpu/gpu_runtime.h"
#include "engine/base/status.h"
#include "engine/dtype.h"

namespace kiln::gpu {

// One SDPA problem: the graph cache's key.
struct SdpaKey {
  int64_t batch = 1;
  int64_t q_heads = 1;   // Hq
  int64_t kv_heads = 1;  // Hkv; Hq % Hkv == 0 (GQA)
  int64_t q_len = 1;     // T
  int64_t kv_len = 1;    // S
  int64_t head_dim = 64;
  DType dtype = DType::kBF16;  // of q, k, v, o and their gradients
  bool causal = true;
  bool stats = false;  // forward: also write stats (training)
  float scale = 0.125f;

  bool operator==(const SdpaKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const SdpaKey& k) {
    return H::combine(std::move(h), k.batch, k.q_heads, k.kv_heads, k.q_len, k.kv_len, k.head_dim,
                      k.dtype, k.causal, k.stats, k.scale);
  }
  std::string Describe() const;  // "bf16 B=1 Hq=9 Hkv=3 T=512 S=512 D=64 causal stats"
};

// Whether Kiln's SDPA path handles `key`: f16/bf16, head dim 64 or 128, Hq % Hkv == 0.
// Otherwise the reason, which names what is allowed.
Status SdpaSupports(const SdpaKey& key);

// Whether this build has the cuDNN SDPA path (cudnn-frontend's headers were found).
bool SdpaCompiled();

// Builds the forward (backward = false) or backward graph for `key` and runs cudnn-frontend's
// validate() with the target architecture set to `sm_version` (90 = Hopper): shape inference
// and the frontend's support-surface checks, without a device or a cuDNN handle. It needs
// libcudnn (the checks read cudnnGetVersion()): Unavailable when it cannot be opened.
Status ValidateSdpa(const SdpaKey& key, bool backward, int sm_version);

// Device pointers for one call (the layout above).
struct SdpaForwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* stats = nullptr;  // REQUIRES: non-null iff key.stats
};
struct SdpaBackwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* d_o = nullptr;
  const float* stats = nullptr;  // the forward's
  void* d_q = nullptr;
  void* d_k = nullptr;
  void* d_v = nullptr;
};

// Device memory for a call's workspace, valid until the stream has run the call (the stream's
// scratch buffer, devk::Queue::Scratch); null when it cannot be had.
using SdpaScratch = std::function<void*(size_t bytes)>;

// A cuDNN handle bound to one stream, with that stream's graph cache.
class SdpaRunner {
 public:
  // Opens libcudnn (Unavailable when missing) and creates a handle on the current device.
  static StatusOr<std::unique_ptr<SdpaRunner>> Create(cudaStream_t stream);
  ~SdpaRunner();

  // Enqueues the forward / backward of `key` on the stream, building and caching its graph on
  // first use (which takes cuDNN's heuristics and plan compilation: tens of milliseconds).
  // REQUIRES: SdpaSupports(key) is OK; for Backward, key.stats (the key of the forward).
  Status Forward(const SdpaKey& key, const SdpaForwardArgs& args, const SdpaScratch& scratch);
  Status Backward(const SdpaKey& key, const SdpaBackwardArgs& args, const SdpaScratch& scratch);

  int64_t graphs_built() const;

 private:
  struct Impl;
  explicit SdpaRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::gpu
