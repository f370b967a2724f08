#include "backends/cpu/kernels/onednn_gemm.h"

#include <omp.h>

#include <limits>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "spdlog/spdlog.h"

namespace kiln::cpu {
namespace {

// One engine for the process: streams (one per thread) must belong to the primitive's engine.
const dnnl::engine& Engine() {
  static const dnnl::engine* e = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *e;
}

}  // namespace

struct OneDnnGemm::Impl {
  const dnnl::engine& engine = Engine();
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
  int64_t K = 0;
  bool w_k_contiguous = true;
  bool x_transposed = false;
  size_t scratch_bytes = 0;
};

StatusOr<std::unique_ptr<OneDnnGemm>> OneDnnGemm::Create(int64_t K, bool w_k_contiguous,
                                                         bool x_transposed, bool accumulate) {
  using dnnl::memory;
  constexpr int64_t kRt = DNNL_RUNTIME_DIM_VAL;
  try {
    auto impl = std::make_unique<Impl>();
    impl->K = K;
    impl->w_k_contiguous = w_k_contiguous;
    impl->x_transposed = x_transposed;
    const memory::desc src({kRt, K}, memory::data_type::f32,
                           x_transposed ? memory::dims{1, kRt} : memory::dims{kRt, 1});
    const memory::desc wei({K, kRt}, memory::data_type::f32,
                           w_k_contiguous ? memory::dims{1, kRt} : memory::dims{kRt, 1});
    const memory::desc dst({kRt, kRt}, memory::data_type::f32, {kRt, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    impl->pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), attr, impl->engine);
    impl->prim = dnnl::matmul(impl->pd);
    impl->scratch_bytes = impl->pd.scratchpad_desc().get_size();
    std::unique_ptr<OneDnnGemm> g(new OneDnnGemm());
    g->impl_ = std::move(impl);
    return g;
  } catch (const dnnl::error& e) {
    return Unimplemented("oneDNN cannot build an f32 matmul with K=", K, ": ", e.what());
  }
}

OneDnnGemm::~OneDnnGemm() = default;

const char* OneDnnGemm::impl_name() const { return impl_->pd.impl_info_str(); }

void OneDnnGemm::Run(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) const {
  using dnnl::memory;
  if (m0 >= m1 || n0 >= n1) return;
  const Impl& d = *impl_;
  // oneDNN's OpenMP runtime reads the calling thread's thread-count setting: one thread, so
  // the tile runs here and no OpenMP team is started. Restored afterwards.
  const int saved = omp_get_max_threads();
  if (saved != 1) omp_set_num_threads(1);
  thread_local dnnl::stream stream(d.engine);
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < d.scratch_bytes) scratch.resize(d.scratch_bytes);
  const int64_t M = m1 - m0, N = n1 - n0;
  const float* w = static_cast<const float*>(a.w);
  const memory src = d.x_transposed
                         ? memory(memory::desc({M, a.K}, memory::data_type::f32, {1, a.ldx}),
                                  d.engine, const_cast<float*>(a.x + m0))
                         : memory(memory::desc({M, a.K}, memory::data_type::f32, {a.ldx, 1}),
                                  d.engine, const_cast<float*>(a.x + m0 * a.ldx));
  memory wei;
  if (d.w_k_contiguous) {
    const int64_t ldw = a.w_row_bytes / 4;
    wei = memory(memory::desc({a.K, N}, memory::data_type::f32, {1, ldw}), d.engine,
                 const_cast<float*>(w + n0 * ldw));
  } else {
    wei = memory(memory::desc({a.K, N}, memory::data_type::f32, {a.w_k_stride, 1}), d.engine,
                 const_cast<float*>(w + n0));
  }
  const memory dst(memory::desc({M, N}, memory::data_type::f32, {a.ldy, 1}), d.engine,
                   a.y + m0 * a.ldy + n0);
  std::unordered_map<int, memory> args = {
      {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}};
  if (d.scratch_bytes > 0) {
    args.emplace(DNNL_ARG_SCRATCHPAD, memory(d.pd.scratchpad_desc(), d.engine, scratch.data()));
  }
  try {
    d.prim.execute(stream, args);
  } catch (const dnnl::error& e) {
    // Cannot happen for a primitive that was created for these types; never leave garbage.
    spdlog::error("oneDNN matmul failed ({}); the tile is NaN", e.what());
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t n = n0; n < n1; ++n)
        a.y[m * a.ldy + n] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  if (saved != 1) omp_set_num_threads(saved);
}

}  // namespace kiln::cpu
