// Host tables with batch rows on a GPU, indices read on the host: the hybrid path. Part of the
// rows move by the zero-copy kernels, the rest by CPU threads through pinned staging and DMA
// copies, at the same time (route::Path::kHybrid); tables no kernel can address move entirely
// through the CPU side (route::Path::kHostStaged).
#pragma once

#include "copy/pairs.h"
#include "copy/route.h"

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace speedtorch_ops::torch_cuda {

// What the indices' values are checked against, and the names errors give them.
struct IndexCheck {
  int64_t rows = 0;  // every value in [0, rows)
  const char* writeback_name = "writeback_index";
  const char* load_name = "load_index";
};

// @brief For every pair (tables[k] on the host, its batch rows on `device`; pairs[k] their
// addresses, the table's nullptr where no kernel can address it): write the batch back to
// rows writeback_index (+= with accumulate, one pair only), then load rows load_index into it.
// Indices are on the host or on `device` (brought to the host: a wait for the current
// stream); their values are checked here, before anything moves. No CUDA graph is being
// captured. Returns when the host's part is done; the GPU's part is ordered on the current
// stream.
void hybrid_transfer(const std::vector<at::Tensor>& tables, const std::vector<Pair>& pairs,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index, bool accumulate,
                     route::Path path, const c10::Device& device, const IndexCheck& check);

}  // namespace speedtorch_ops::torch_cuda
