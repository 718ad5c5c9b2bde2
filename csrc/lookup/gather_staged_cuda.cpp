// _gather_staged on a GPU (registration.cpp has the contract; gather_staged.cu the kernel): one
// launch on the current stream, nothing read back.
#include "common/elem_of.h"
#include "lookup/gather_staged.h"
#include "lookup/lookup_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace speedtorch_ops {
namespace {

at::Tensor gather_staged_cuda(const at::Tensor& rows, const at::Tensor& index,
                            const c10::optional<at::Tensor>& cache,
                            const c10::optional<at::Tensor>& at) {
  check_gather_staged_args(rows, index, cache, at);
  const c10::cuda::CUDAGuard guard(rows.device());
  auto out = at::empty({index.numel(), rows.size(1)}, rows.options());
  const bool cached = cache.has_value();
  C10_CUDA_CHECK(kernels::launch_gather_staged(
      torch_cuda::elem_of(rows.scalar_type()), rows.const_data_ptr(), rows.stride(0),
      rows.size(1), index.const_data_ptr<int64_t>(), index.numel(),
      cached ? cache->const_data_ptr() : nullptr, cached ? cache->stride(0) : 0,
      cached ? cache->size(0) : 0, cached ? at->const_data_ptr<int64_t>() : nullptr,
      out.mutable_data_ptr(), at::cuda::getCurrentCUDAStream(rows.device().index())));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_gather_staged", &gather_staged_cuda);
}

}  // namespace speedtorch_ops
