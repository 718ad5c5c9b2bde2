// _segment_sum on a GPU (registration.cpp has the contract; segment_sum.cu the kernels): two
// launches on the current stream, nothing read back.
#include "../cuda/transfer.h"
#include "segment_sum.h"
#include "speedtorch_ops/checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

namespace speedtorch_ops {
namespace {

at::Tensor segment_sum_cuda(const at::Tensor& grad, const at::Tensor& perm,
                            const at::Tensor& starts, const at::Tensor& count, int64_t rows) {
  check_segment_sum_args(grad, perm, starts, count, rows);
  const c10::cuda::CUDAGuard guard(grad.device());
  const auto elem = cuda_impl::elem_of(grad.scalar_type());
  const int64_t n_pos = grad.size(0), dim = grad.size(1);
  auto out = at::empty({rows, dim}, grad.options());
  const size_t bytes = cuda::segment_sum_scratch_bytes(elem, n_pos, dim);
  auto scratch = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))},
                           grad.options().dtype(at::kByte));
  C10_CUDA_CHECK(cuda::launch_segment_sum(
      elem, grad.const_data_ptr(), n_pos, dim, perm.const_data_ptr<int64_t>(),
      starts.const_data_ptr<int64_t>(), starts.numel() - 1, count.const_data_ptr<int64_t>(),
      out.mutable_data_ptr(), rows, scratch.mutable_data_ptr(),
      at::cuda::getCurrentCUDAStream(grad.device().index())));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_segment_sum", &segment_sum_cuda);
}

}  // namespace speedtorch_ops
