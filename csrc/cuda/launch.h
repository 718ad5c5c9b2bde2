// The launch shape of the transfer kernels: how many SMs they may use. A cap leaves SMs to the
// training kernels that run beside a transfer.
#pragma once

#include "kernels.h"

#include <c10/core/Device.h>

#include <cstdint>

namespace speedtorch_ops::cuda_impl {

// @brief The grid of the transfer kernels on `device`: every SM, or the cap when one is set.
cuda::Grid transfer_grid(const c10::Device& device);

// @brief Sets the most SMs the transfer kernels use (0: no cap) for the whole process; returns
// the previous value.
int64_t set_transfer_sm_limit(int64_t sms);

}  // namespace speedtorch_ops::cuda_impl
