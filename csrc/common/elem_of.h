// The kernels' element type of a tensor's dtype, for the CUDA entry points of every feature.
#pragma once

#include "common/kernel_types.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace speedtorch_ops::torch_cuda {

// The element type of dtype `t` (one the caller checked).
inline kernels::Elem elem_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::Elem::kF32;
    case at::kDouble: return kernels::Elem::kF64;
    case at::kHalf: return kernels::Elem::kF16;
    case at::kBFloat16: return kernels::Elem::kBF16;
    case at::kChar: return kernels::Elem::kI8;
    case at::kByte: return kernels::Elem::kU8;
    case at::kShort: return kernels::Elem::kI16;
    case at::kInt: return kernels::Elem::kI32;
    case at::kLong: return kernels::Elem::kI64;
    case at::kBool: return kernels::Elem::kBool;
    default: TORCH_INTERNAL_ASSERT(false, "unchecked element dtype ", t);
  }
}

}  // namespace speedtorch_ops::torch_cuda
