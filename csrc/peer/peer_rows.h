// The launcher of _peer_rows's CUDA kernel (peer_rows_cuda.cpp has the op). Plain C++ types only:
// the kernel file is compiled without torch's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// out (n rows of row_bytes, contiguous): out[i] = the row_bytes at address
// ptrs[rank_of[i]] + offset + row_of[i] * row_bytes, or zeros where row_of[i] < 0. ptrs (on the
// device) hold addresses this device reads in place (the buffers of a group's ranks mapped
// here, such as torch's symmetric memory over NVLink, 16-byte aligned); every index is trusted.
// One warp a few rows, each lane moving the widest word (16 down to 1 bytes) that row_bytes,
// offset and out allow.
cudaError_t launch_peer_rows(const int64_t* ptrs, int64_t offset, const int64_t* rank_of,
                             const int64_t* row_of, int64_t n, int64_t row_bytes, void* out,
                             cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
