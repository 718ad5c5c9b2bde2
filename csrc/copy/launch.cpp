#include "copy/launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

namespace speedtorch_ops::torch_cuda {
namespace {

// Process-wide, like the GPU it shares: a knob set once (e.g. by a training loop) for every
// thread that launches transfers.
std::atomic<int64_t> g_sm_limit{0};

}  // namespace

kernels::Grid transfer_grid(const c10::Device& device, int64_t call_sms) {
  const int sms = at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
  // A call's own cap tightens the process-wide one, never loosens it.
  const int64_t global = g_sm_limit.load();
  const int64_t limit =
      call_sms > 0 ? (global > 0 ? std::min(call_sms, global) : call_sms) : global;
  if (limit > 0 && limit < sms) return {static_cast<int>(limit), true};
  return {sms, false};
}

int64_t set_transfer_sm_limit(int64_t sms) {
  TORCH_CHECK(sms >= 0, "sms must be >= 0 (0 removes the cap), got ", sms);
  return g_sm_limit.exchange(sms);
}

int64_t set_fused_extra_blocks(int64_t blocks) {
  TORCH_CHECK(blocks >= 0 && blocks <= (int64_t{1} << 20),
              "blocks must be in [0, 2^20] (0 turns the hook off), got ", blocks);
  return kernels::set_fused_extra_blocks(static_cast<int>(blocks));
}

}  // namespace speedtorch_ops::torch_cuda
