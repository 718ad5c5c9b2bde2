// _round_into's kernel (round_into.h). Free of torch headers.
#include "optim/round_into.h"

#include "optim/floats.cuh"

#include <algorithm>
#include <type_traits>

namespace speedtorch_ops::kernels {
namespace {

constexpr int kThreads = 256;

template <class V>
__global__ void round_into_kernel(V* dst, const float* src, int64_t n, const int64_t* rounding) {
  const auto seed = static_cast<uint64_t>(rounding[0]);
  const auto counter = static_cast<uint64_t>(rounding[1]);
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    float x = src[i];
    if constexpr (std::is_same_v<V, __nv_bfloat16> || std::is_same_v<V, __half>) {
      const optim::Format f = std::is_same_v<V, __nv_bfloat16> ? optim::Format::kBFloat16
                                                               : optim::Format::kHalf;
      x = optim::round_for(f, x, optim::row_key(seed, counter, i >> optim::kFlatRowBits),
                           optim::flat_element(i));
    }
    store(dst + i, x);
  }
}

}  // namespace

cudaError_t launch_round_into(Elem elem, void* dst, const float* src, int64_t n,
                              const int64_t* rounding, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 8192));
  return with_float_elem(elem, [&](auto zero) {
    using V = decltype(zero);
    round_into_kernel<V><<<blocks, kThreads, 0, stream>>>(static_cast<V*>(dst), src, n,
                                                          rounding);
    return cudaGetLastError();
  });
}

}  // namespace speedtorch_ops::kernels
