// _fused_row_update on a GPU (registration.cpp has the contract; fused_update.cu the kernel):
// one launch on the current stream; the step count is read by the kernel when it lives on the
// device (a captured step's replays count on), on the host when it lives there.
#include "common/elem_of.h"
#include "optim/fused_update.h"
#include "optim/optim_checks.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace speedtorch_ops {
namespace {

void fused_row_update_cuda(at::Tensor& buf, const at::Tensor& grad, const at::Tensor& count,
                           const c10::optional<at::Tensor>& step, int64_t rule_arg,
                           at::ArrayRef<double> hyper, int64_t flags,
                           at::ArrayRef<int64_t> fields, at::ScalarType state_dtype,
                           const c10::optional<at::Tensor>& cache,
                           const c10::optional<at::Tensor>& at,
                           const c10::optional<at::Tensor>& rounding) {
  const FusedUpdateArgs checked = check_fused_update_args(
      buf, grad, count, step, rule_arg, hyper, flags, fields, state_dtype, cache, at, rounding);
  const c10::cuda::CUDAGuard guard(buf.device());
  const void* step_ptr = nullptr;  // a count on the device: the kernel derives the constants
  bool step_f64 = false;
  if (step.has_value() && !step->device().is_cpu()) {
    step_ptr = step->const_data_ptr();
    step_f64 = step->scalar_type() == at::kDouble;
  }
  kernels::RecordFields f{fields[0], fields[1], {0, 0, 0}, static_cast<int>(fields.size()) - 2};
  for (int k = 0; k < f.states; ++k) f.state[k] = fields[2 + k];
  C10_CUDA_CHECK(kernels::launch_fused_row_update(
      torch_cuda::elem_of(grad.scalar_type()), torch_cuda::elem_of(state_dtype),
      buf.mutable_data_ptr(), buf.size(0), buf.size(1), f, grad.size(1), grad.const_data_ptr(),
      count.const_data_ptr<int64_t>(), checked.rule, checked.hyper, step_ptr, step_f64,
      cache.has_value() ? cache->mutable_data_ptr() : nullptr,
      cache.has_value() ? cache->size(0) : 0,
      at.has_value() ? at->const_data_ptr<int64_t>() : nullptr, at.has_value() ? at->numel() : 0,
      checked.rounds ? rounding->const_data_ptr<int64_t>() : nullptr,  // on buf's device
      at::cuda::getCurrentCUDAStream(buf.device().index())));
}

}  // namespace

TORCH_LIBRARY_IMPL(speedtorch_ops, CUDA, m) {
  m.impl("_fused_row_update", &fused_row_update_cuda);
}

}  // namespace speedtorch_ops
