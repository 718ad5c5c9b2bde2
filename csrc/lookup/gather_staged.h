// The launcher of _gather_staged's CUDA kernel (gather_staged_cuda.cpp has the op). Plain C++ types
// only: the kernel file is compiled without torch's headers.
#pragma once

#include "common/kernel_types.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// out (n x dim, contiguous, elem: F32, F64, F16, BF16): out[p] = the row of distinct row
// r = index[p]: cache row at[r] when a cache is given and 0 <= at[r] < slots, else rows row r
// (rows row_stride elements apart, cache cache_stride apart; index and at trusted). One warp
// a few rows, 16 bytes a lane where every row and pointer allows it.
cudaError_t launch_gather_staged(Elem elem, const void* rows, int64_t row_stride, int64_t dim,
                               const int64_t* index, int64_t n, const void* cache,
                               int64_t cache_stride, int64_t slots, const int64_t* at,
                               void* out, cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
