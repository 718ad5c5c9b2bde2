// _segment_sum on a GPU (registration.cpp has the contract; segment_sum.cu the kernels): two
// launches on the current stream, nothing read back; the gradient pieces are read in place.
#include "common/elem_of.h"
#include "optim/optim_checks.h"
#include "optim/segment_sum.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace speedtorch_ops {
namespace {

at::Tensor segment_sum_cuda(at::TensorList grads, const at::Tensor& perm,
                            const at::Tensor& starts, const at::Tensor& count, int64_t rows,
                            bool zero_tail) {
  check_segment_sum_args(grads, perm, starts, count, rows);
  const c10::cuda::CUDAGuard guard(perm.device());
  // More pieces than a kernel argument holds are joined into one (a copy of the gradient).
  std::vector<at::Tensor> joined;
  if (grads.size() > static_cast<size_t>(kernels::kMaxGradPieces)) {
    joined.push_back(at::cat(grads));
    grads = joined;
  }
  const at::Tensor& first = grads[0];
  const auto elem = torch_cuda::elem_of(first.scalar_type());
  const int64_t n_pos = perm.numel(), dim = first.size(1);
  kernels::GradPieces pieces{};
  int64_t end = 0;
  for (const at::Tensor& g : grads) {
    pieces.ptr[pieces.count] = g.const_data_ptr();
    end += g.size(0);
    pieces.end[pieces.count] = end;
    ++pieces.count;
  }
  auto out = at::empty({rows, dim}, first.options());
  const size_t bytes = kernels::segment_sum_scratch_bytes(elem, n_pos, dim);
  auto scratch = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))},
                           first.options().dtype(at::kByte));
  C10_CUDA_CHECK(kernels::launch_segment_sum(
      elem, pieces, n_pos, dim, perm.const_data_ptr<int64_t>(), starts.const_data_ptr<int64_t>(),
      starts.numel() - 1, count.const_data_ptr<int64_t>(), out.mutable_data_ptr(), rows,
      zero_tail, scratch.mutable_data_ptr(),
      at::cuda::getCurrentCUDAStream(perm.device().index())));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_segment_sum", &segment_sum_cuda);
}

}  // namespace speedtorch_ops
