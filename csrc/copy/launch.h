// The launch shape of the transfer kernels: how many SMs they may use. A cap leaves SMs to the
// training kernels that run beside a transfer.
#pragma once

#include "copy/kernels.h"

#include <c10/core/Device.h>

#include <cstdint>

namespace speedtorch_ops::torch_cuda {

// @brief The grid of the transfer kernels on `device`: every SM, or the cap when one is set;
// sms > 0 caps this call's kernels at that many SMs too (a transfer on a side stream beside
// training kernels): the lower of the two caps holds.
kernels::Grid transfer_grid(const c10::Device& device, int64_t sms = 0);

// @brief Sets the most SMs the transfer kernels use (0: no cap) for the whole process; returns
// the previous value.
int64_t set_transfer_sm_limit(int64_t sms);

// @brief The test hook of kernels::set_fused_extra_blocks (blocks >= 0; 0: off); returns the
// previous value.
int64_t set_fused_extra_blocks(int64_t blocks);

}  // namespace speedtorch_ops::torch_cuda
