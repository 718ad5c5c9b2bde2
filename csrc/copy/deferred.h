// The deferred report of bad CUDA indices (bounds_check='deferred'): a call neither waits for
// the GPU nor raises; its validation kernel records the first bad index since the last report in
// pinned host memory, and the next 'deferred' or 'raise' call on that GPU (or
// sync_bounds_check) raises it; 'prechecked' calls (a store's step of several calls) never do.
// The host reads the record without waiting, so a training loop keeps queueing ahead.
#pragma once

#include "copy/kernels.h"

#include <c10/core/Device.h>

namespace speedtorch_ops::torch_cuda {

// @brief The device's record for a validation kernel reporting argument `name` (allocated at
// the first call on that device, also while a CUDA graph is being captured).
kernels::Deferred deferred_record(const c10::Device& device, const char* name);

// @brief Raises the bad index a deferred call on `device` recorded since the last report, if
// the GPU has recorded one by now (no wait); the record is then reported and cleared.
void raise_deferred(const c10::Device& device);

// @brief Waits for the current stream of GPU `device`, then raise_deferred: the report of every
// deferred call queued on that stream so far.
void sync_bounds_check(int64_t device);

}  // namespace speedtorch_ops::torch_cuda
