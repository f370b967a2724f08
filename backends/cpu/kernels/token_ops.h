// Per-token operations on the cpu backend: RoPE, the paged KV-cache write, the strided copy
// of a view into rows (contiguous; any dtype of 1, 2, 4 or 8 bytes), concatenation and the
// embedding gradient's row scatter (token_ops.cc). Selected for f32 activations (and f32/f16/bf16
// caches); other layouts run the reference kernel. Results equal the reference's bit for bit.
#pragma once

#include <optional>

#include "backends/cpu/kernels/select.h"

namespace kiln::cpu {

StatusOr<std::optional<backend::Kernel>> MakeRopeKernel(const backend::KernelRequest& req,
                                                        const SelectContext& ctx);
StatusOr<std::optional<backend::Kernel>> MakeKvWriteKernel(const backend::KernelRequest& req,
                                                           const SelectContext& ctx);
StatusOr<std::optional<backend::Kernel>> MakeContiguousKernel(const backend::KernelRequest& req,
                                                              const SelectContext& ctx);
// concat into a contiguous output, inputs of the output's dtype (1, 2, 4 or 8 bytes).
StatusOr<std::optional<backend::Kernel>> MakeConcatKernel(const backend::KernelRequest& req,
                                                          const SelectContext& ctx);
// scatter_add_rows with f32 rows and i32/i64 ids (the embedding's gradient).
StatusOr<std::optional<backend::Kernel>> MakeScatterAddRowsKernel(const backend::KernelRequest& req,
                                                                  const SelectContext& ctx);

}  // namespace kiln::cpu
