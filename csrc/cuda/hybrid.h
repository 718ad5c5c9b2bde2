// Host indices with host tables and batch rows on a GPU: the hybrid path. Part of the rows move
// by the zero-copy kernels, the rest by CPU threads through pinned staging and DMA copies, at
// the same time; the split adapts to what each side achieved on earlier calls of the same shape.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace speedtorch_ops::cuda_impl {

// For every pair (tables[k] on the CPU, batch[k] on `device`): write batch[k] back to rows
// writeback_index (+= with accumulate, one pair only), then load rows load_index into batch[k].
// Indices are CPU tensors whose values the caller checked, like every other argument; the
// caller also made sure no CUDA graph is being captured.
void hybrid_transfer(const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& batch,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index, bool accumulate,
                     const c10::Device& device);

// Test hook: a fixed share of rows for the zero-copy side in [0, 1], or < 0 for automatic.
// Returns the previous setting.
double set_hybrid_share(double share);

}  // namespace speedtorch_ops::cuda_impl
