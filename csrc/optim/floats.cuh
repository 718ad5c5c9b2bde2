// The floating element types of the step's kernels (fused_update.cu, segment_sum.cu): their
// math type, conversions to and from it, and the dispatch from a kernels' Elem. Torch-free.
#pragma once

#include "../cuda/kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace speedtorch_ops::cuda {

// Math in float for 16- and 32-bit values, double for double.
template <class V> struct Math { using type = float; };
template <> struct Math<double> { using type = double; };

template <class V> __device__ __forceinline__ typename Math<V>::type load(const V* p) {
  return static_cast<typename Math<V>::type>(*p);
}
template <> __device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
template <> __device__ __forceinline__ float load(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
template <class V, class T> __device__ __forceinline__ void store(V* p, T v) {
  *p = static_cast<V>(v);
}
template <> __device__ __forceinline__ void store(__half* p, float v) { *p = __float2half(v); }
template <> __device__ __forceinline__ void store(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16(v);
}

// go(V{}) for the element type of `elem` (F32, F64, F16, BF16); others are refused.
template <class F> cudaError_t with_float_elem(Elem elem, F&& go) {
  switch (elem) {
    case Elem::kF32: return go(float{});
    case Elem::kF64: return go(double{});
    case Elem::kF16: return go(__half{});
    case Elem::kBF16: return go(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace speedtorch_ops::cuda
