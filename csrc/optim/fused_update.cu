// The fused optimizer update's kernel (fused_update.h). Free of torch headers.
#include "fused_update.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace speedtorch_ops::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kUpdateThreads = 256;

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

template <class T> __device__ __forceinline__ T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The state pointers of a kernel (at most three per-element parts), by value.
struct Parts {
  int part[3];
  int count;
};

// One warp a row: its lanes stride over the row's columns. A row-wise accumulator takes the
// mean of the row's squared gradients (a warp reduction) before the weights move.
template <class V>
__global__ void fused_row_update_kernel(V* buf, int64_t n, int64_t part_stride, int64_t width,
                                        int64_t dim,
                                        const V* grad, const int64_t* count, optim::Rule rule,
                                        optim::Hyper h, const void* step, bool step_f64,
                                        Parts parts) {
  using T = typename Math<V>::type;
  if (step != nullptr) {
    const double s = step_f64 ? *static_cast<const double*>(step)
                              : static_cast<double>(*static_cast<const float*>(step));
    optim::derive(h, rule, s);
  }
  const int64_t rows = min(n, *count);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / kWarp);
  const bool momentum = rule == optim::Rule::kSgd && parts.count > 0;
  for (int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp; r < rows;
       r += warps) {
    V* w_row = buf + r * width;
    const V* g_row = grad + r * dim;
    T row_sum = 0;
    if (rule == optim::Rule::kRowWiseAdagrad) {
      T sq = 0;
      for (int64_t j = lane; j < dim; j += kWarp) {
        const T g = optim::effective_grad(load(g_row + j), load(w_row + j), h, rule);
        sq += g * g;
      }
      sq = warp_sum(sq);
      row_sum = load(w_row + dim) + sq / static_cast<T>(dim);
      if (lane == 0) store(w_row + dim, row_sum);
    }
    for (int64_t j = lane; j < dim; j += kWarp) {
      T w = load(w_row + j);
      const T g = optim::effective_grad(load(g_row + j), w, h, rule);
      T s[3];
      for (int k = 0; k < parts.count; ++k) s[k] = load(buf + parts.part[k] * part_stride + r * width + j);
      optim::update(rule, h, g, w, s, momentum, row_sum);
      store(w_row + j, w);
      for (int k = 0; k < parts.count; ++k) store(buf + parts.part[k] * part_stride + r * width + j, s[k]);
    }
  }
}

}  // namespace

cudaError_t launch_fused_row_update(Elem elem, void* buf, int64_t n, int64_t part_stride,
                                    int64_t width, int64_t dim, const void* grad, const int64_t* count, optim::Rule rule,
                                    optim::Hyper h, const void* step, bool step_f64,
                                    const int* state_part, int states, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (states < 0 || states > 3) return cudaErrorInvalidValue;
  Parts parts{{0, 0, 0}, states};
  for (int k = 0; k < states; ++k) parts.part[k] = state_part[k];
  const int per_block = kUpdateThreads / kWarp;
  const int blocks = static_cast<int>(std::min<int64_t>((n + per_block - 1) / per_block, 8192));
  const auto go = [&](auto zero) {
    using V = decltype(zero);
    fused_row_update_kernel<V><<<blocks, kUpdateThreads, 0, stream>>>(
        static_cast<V*>(buf), n, part_stride, width, dim, static_cast<const V*>(grad), count, rule, h, step,
        step_f64, parts);
    return cudaGetLastError();
  };
  switch (elem) {
    case Elem::kF32: return go(float{});
    case Elem::kF64: return go(double{});
    case Elem::kF16: return go(__half{});
    case Elem::kBF16: return go(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace speedtorch_ops::cuda
