// _peer_rows on a GPU (registration.cpp has the contract; peer_rows.cu the kernel): one launch on
// the current stream, nothing read back.
#include "peer/peer_checks.h"
#include "peer/peer_rows.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace speedtorch_ops {
namespace {

at::Tensor peer_rows_cuda(const at::Tensor& ptrs, int64_t offset, const at::Tensor& rank_of,
                          const at::Tensor& row_of, int64_t dim, at::ScalarType dtype) {
  check_peer_rows_args(ptrs, offset, rank_of, row_of, dim);
  const c10::cuda::CUDAGuard guard(rank_of.device());
  auto out = at::empty({row_of.numel(), dim}, rank_of.options().dtype(dtype));
  C10_CUDA_CHECK(kernels::launch_peer_rows(
      ptrs.const_data_ptr<int64_t>(), offset, rank_of.const_data_ptr<int64_t>(),
      row_of.const_data_ptr<int64_t>(), row_of.numel(), dim * out.element_size(),
      out.mutable_data_ptr(), at::cuda::getCurrentCUDAStream(rank_of.device().index())));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_peer_rows", &peer_rows_cuda);
}

}  // namespace speedtorch_ops
