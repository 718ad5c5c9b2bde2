// The launcher of _fused_row_update's CUDA kernel (fused_update_cuda.cpp has the op). Plain C++
// types only, like the other launchers: the kernel file is compiled without torch's headers.
#pragma once

#include "common/kernel_types.h"
#include "optim/rules.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// Where a record's fields sit: byte offsets of the weight, the row value (-1: none) and up to
// three per-element states (`states` of them).
struct RecordFields {
  int64_t weight;
  int64_t row;
  int64_t state[3];
  int states;
};

// buf: n records of `record` bytes; grad (at least min(n, *count) rows of dim elements of the
// weights' type `weights`, contiguous). For each row r < min(n, *count), one step of `rule` on
// its weight (dim values of `weights`) and its state: per-element states of `state` (F32,
// BF16, or the weights' type; F64 with F64 only), the row value float (double with F64
// state). Math in float (double for F64). h's step-dependent constants come from *step (a
// float or double on the device, after this step's increment) when step != nullptr, else as
// given. With a cache (`slots` records of the same layout): a row r < at_len whose at[r] is a
// slot lives there: its weight and state are read and written there (its staged record is not
// read). With rounding != nullptr, the 16-bit stores round stochastically (rounding.h) under
// rounding[0] (seed) and rounding[1] (counter), read on the device.
cudaError_t launch_fused_row_update(Elem weights, Elem state, void* buf, int64_t n,
                                    int64_t record, RecordFields fields, int64_t dim,
                                    const void* grad, const int64_t* count, optim::Rule rule,
                                    optim::Hyper h, const void* step, bool step_f64, void* cache,
                                    int64_t slots, const int64_t* at, int64_t at_len,
                                    const int64_t* rounding, cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
