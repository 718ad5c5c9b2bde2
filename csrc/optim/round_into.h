// The launcher of _round_into's CUDA kernel (round_into_cuda.cpp has the op). Plain C++ types
// only, like the other launchers: the kernel file is compiled without torch's headers.
#pragma once

#include "common/kernel_types.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// dst[i] = src[i] (n float32 values) in dst's type (elem: F32, F64, F16, BF16), 16-bit types
// rounded stochastically under (rounding[0], rounding[1]), read on the device (rounding.h's
// flat rows).
cudaError_t launch_round_into(Elem elem, void* dst, const float* src, int64_t n,
                              const int64_t* rounding, cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
