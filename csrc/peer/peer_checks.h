// _peer_rows' argument checks, shared by its CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace speedtorch_ops {

// _peer_rows: rank_of, row_of and ptrs 1-D int64 contiguous on one device, rank_of and row_of of
// one length; offset >= 0, dim >= 0.
void check_peer_rows_args(const at::Tensor& ptrs, int64_t offset, const at::Tensor& rank_of,
                          const at::Tensor& row_of, int64_t dim);

}  // namespace speedtorch_ops
