// _gather_staged's argument checks, shared by its CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace speedtorch_ops {

// _gather_staged: rows (n, dim) floating (float32, float64, float16, bfloat16) with contiguous
// elements; index 1-D int64 contiguous; cache and at both or neither: cache (slots, dim) like
// rows (dtype, device, elements contiguous), at 1-D int64 contiguous of at least n entries.
void check_gather_staged_args(const at::Tensor& rows, const at::Tensor& index,
                              const c10::optional<at::Tensor>& cache,
                              const c10::optional<at::Tensor>& at);

}  // namespace speedtorch_ops
