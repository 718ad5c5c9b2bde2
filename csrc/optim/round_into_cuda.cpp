// _round_into on a GPU (registration.cpp has the contract; round_into.cu the kernel): one
// launch on the current stream; the seed and counter are read by the kernel.
#include "common/elem_of.h"
#include "optim/optim_checks.h"
#include "optim/round_into.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace speedtorch_ops {
namespace {

void round_into_cuda(at::Tensor& dst, const at::Tensor& src, const at::Tensor& rounding) {
  check_round_into_args(dst, src, rounding);
  const c10::cuda::CUDAGuard guard(dst.device());
  C10_CUDA_CHECK(kernels::launch_round_into(
      torch_cuda::elem_of(dst.scalar_type()), dst.mutable_data_ptr(), src.const_data_ptr<float>(),
      src.numel(), rounding.const_data_ptr<int64_t>(),
      at::cuda::getCurrentCUDAStream(dst.device().index())));
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_round_into", &round_into_cuda);
}

}  // namespace speedtorch_ops
