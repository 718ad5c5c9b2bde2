// The launcher of _fused_row_update's CUDA kernel (fused_update_cuda.cpp has the op). Plain C++
// types only, like the other launchers: the kernel file is compiled without torch's headers.
#pragma once

#include "../transfer/kernels.h"
#include "rules.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// A staged buffer of parts of n rows of `width` elements (elem: F32, F64, F16, BF16), each
// part contiguous, part k at buf + k * part_stride; grad (at least min(n, *count) rows of dim elements, contiguous, buf's type).
// For each row r < min(n, *count), one step of `rule` on its weight (part 0, columns [0, dim))
// and its state: per-element state k in part state_part[k] (k < states), the row-wise
// accumulator at part 0, column dim. Math in float (double for F64). h's step-dependent
// constants come from *step (a float or double on the device, after this step's increment)
// when step != nullptr, else as given. With a cache (parts cache_stride apart, `slots` rows of
// width): a row r < at_len whose at[r] is a slot lives there: its weight and state are read and
// written there (its staged row is not read). With rounding != nullptr (F16 and BF16 only;
// wider types ignore it), the stores round stochastically (rounding.h) under rounding[0]
// (seed) and rounding[1] (counter), read on the device.
cudaError_t launch_fused_row_update(Elem elem, void* buf, int64_t n, int64_t part_stride,
                                    int64_t width, int64_t dim, const void* grad, const int64_t* count, optim::Rule rule,
                                    optim::Hyper h, const void* step, bool step_f64,
                                    const int* state_part, int states, void* cache,
                                    int64_t cache_stride, int64_t slots, const int64_t* at,
                                    int64_t at_len, const int64_t* rounding,
                                    cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
