// The launch shape and loop of the element-wise kernels (one thread an element), shared by
// copy/kernels.cu and cache/cache_kernels.cu. Torch-free, like the kernels.
#pragma once

#include <algorithm>
#include <cstdint>

namespace speedtorch_ops::kernels {

constexpr int kThreads = 256;

// Blocks of kThreads for n elements, at most 4096: the kernels stride over what the grid does
// not cover.
inline int blocks_for_elements(int64_t n) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 4096)));
}

// f(i) for every i < n, the grid's threads striding together.
template <class F>
__device__ __forceinline__ void for_each_element(int64_t n, F&& f) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    f(i);
  }
}

}  // namespace speedtorch_ops::kernels
