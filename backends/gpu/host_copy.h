// Tensors between the host and a CUDA device, whose memory the host cannot read
// (Tensor::FromDoubles and ToDoubles need a host-visible device): for the GPU tests and
// benchmarks. Copies are blocking on `stream`. Also cudaMalloc'd SDPA workspaces.
#pragma once

#include <span>
#include <vector>

#include "backends/builtin.h"
#include "backends/gpu/gpu_runtime.h"
#include "backends/gpu/gpu_sdpa.h"
#include "engine/tensor.h"

namespace kiln::gpu {

// A dense tensor on `dev` holding `values` rounded to `dtype`.
inline StatusOr<Tensor> DeviceTensor(backend::Device& dev, backend::Stream& stream, DType dtype,
                                     std::vector<int64_t> shape, std::span<const double> values) {
  static backend::Backend* host = backend::MakeRefBackend().release();
  KILN_ASSIGN_OR_RETURN(Tensor h, Tensor::FromDoubles(*host->device(0), dtype, shape, values));
  KILN_ASSIGN_OR_RETURN(Tensor d, Tensor::Empty(dev, dtype, std::move(shape)));
  KILN_RETURN_IF_ERROR(stream.CopyToDevice(*d.buffer(), 0, h.data(), h.nbytes()));
  return d;
}

// The values of a dense device tensor.
inline StatusOr<std::vector<double>> HostDoubles(backend::Stream& stream, const Tensor& t) {
  static backend::Backend* host = backend::MakeRefBackend().release();
  if (!t.IsContiguous()) return InvalidArgument("HostDoubles needs a dense tensor");
  KILN_ASSIGN_OR_RETURN(Tensor h, Tensor::Empty(*host->device(0), t.dtype(), t.shape()));
  KILN_RETURN_IF_ERROR(stream.CopyToHost(h.data(), *t.buffer(),
                                         static_cast<size_t>(DTypeBytes(t.dtype(), t.offset())),
                                         static_cast<size_t>(t.nbytes())));
  return h.ToDoubles();
}

// SDPA workspaces from cudaMalloc, freed with the object (outside a device's allocator).
class MallocScratch {
 public:
  MallocScratch() = default;
  MallocScratch(const MallocScratch&) = delete;
  MallocScratch& operator=(const MallocScratch&) = delete;
  ~MallocScratch() {
    for (void* p : held_) cudaFree(p);
  }
  SdpaScratch fn() {
    return [this](size_t bytes) -> void* {
      void* p = nullptr;
      if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
      held_.push_back(p);
      return p;
    };
  }

 private:
  std::vector<void*> held_;
};

}  // namespace kiln::gpu
