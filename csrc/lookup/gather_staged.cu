// _gather_staged's kernel (gather_staged.h). Free of torch headers.
#include "lookup/gather_staged.h"

#include "optim/floats.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace speedtorch_ops::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
// Rows a warp moves at once: their loads are all in flight before the first store.
constexpr int kRowsPerWarp = 4;

template <class V, int VW>
__global__ void gather_staged_kernel(const V* rows, int64_t row_stride, int64_t dim,
                                   const int64_t* index, int64_t n, const V* cache,
                                   int64_t cache_stride, int64_t slots, const int64_t* at,
                                   V* out) {
  using P = Pack<V, VW>;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t{gridDim.x} * (kThreads / kWarp);
  for (int64_t p0 = (blockIdx.x * int64_t{kThreads / kWarp} + threadIdx.x / kWarp) * kRowsPerWarp;
       p0 < n; p0 += warps * kRowsPerWarp) {
    const V* src[kRowsPerWarp];
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int64_t p = p0 + k;
      src[k] = nullptr;
      if (p >= n) continue;
      const int64_t r = index[p];
      const int64_t s = cache != nullptr ? at[r] : -1;
      src[k] = s >= 0 && s < slots ? cache + s * cache_stride : rows + r * row_stride;
    }
    for (int64_t j = lane * VW; j < dim; j += kWarp * VW) {
      P x[kRowsPerWarp];
      for (int k = 0; k < kRowsPerWarp; ++k) {
        if (src[k] != nullptr) x[k] = *reinterpret_cast<const P*>(src[k] + j);
      }
      for (int k = 0; k < kRowsPerWarp; ++k) {
        if (src[k] != nullptr) *reinterpret_cast<P*>(out + (p0 + k) * dim + j) = x[k];
      }
    }
  }
}

}  // namespace

cudaError_t launch_gather_staged(Elem elem, const void* rows, int64_t row_stride, int64_t dim,
                               const int64_t* index, int64_t n, const void* cache,
                               int64_t cache_stride, int64_t slots, const int64_t* at,
                               void* out, cudaStream_t stream) {
  if (n == 0 || dim == 0) return cudaSuccess;
  const auto go = [&](auto zero) {
    using V = decltype(zero);
    // The widest VW (16 bytes, else 8, else one element) every row and pointer is aligned to.
    const auto fits = [&](int64_t vw) {
      const int64_t bytes = vw * static_cast<int64_t>(sizeof(V));
      return dim % vw == 0 && row_stride % vw == 0 && aligned(rows, bytes) &&
             aligned(out, bytes) &&
             (cache == nullptr || (aligned(cache, bytes) && cache_stride % vw == 0));
    };
    constexpr int kVec16 = static_cast<int>(16 / sizeof(V));
    constexpr int kVec8 = static_cast<int>(8 / sizeof(V));
    const int64_t warps = (n + kRowsPerWarp - 1) / kRowsPerWarp;
    const int blocks = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>((warps * kWarp + kThreads - 1) / kThreads, 65535)));
    const auto launch = [&](auto width) {
      constexpr int VW = decltype(width)::value;
      gather_staged_kernel<V, VW><<<blocks, kThreads, 0, stream>>>(
          static_cast<const V*>(rows), row_stride, dim, index, n, static_cast<const V*>(cache),
          cache_stride, slots, at, static_cast<V*>(out));
      return cudaGetLastError();
    };
    if (fits(kVec16)) return launch(std::integral_constant<int, kVec16>{});
    if constexpr (kVec8 > 1) {
      if (fits(kVec8)) return launch(std::integral_constant<int, kVec8>{});
    }
    return launch(std::integral_constant<int, 1>{});
  };
  return with_float_elem(elem, go);
}

}  // namespace speedtorch_ops::kernels
