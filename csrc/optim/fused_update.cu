// The fused optimizer update's kernel (fused_update.h). Free of torch headers.
#include "fused_update.h"

#include "floats.cuh"

#include <algorithm>
#include <cstdint>

namespace speedtorch_ops::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kUpdateThreads = 256;

template <class T> __device__ __forceinline__ T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The state pointers of a kernel (at most three per-element parts), by value.
struct Parts {
  int part[3];
  int count;
};

// Where a row's updated values go: its cache slot when the step left it there (`at` names a
// slot of `cache`), else its staged row.
struct Target {
  void* cache;           // nullptr: every row lives in buf
  int64_t cache_stride;  // elements between the cache's parts
  int64_t slots;
  const int64_t* at;
  int64_t at_len;
};

// One warp a row: its lanes stride over the row's columns, VW at a time. A row-wise
// accumulator takes the mean of the row's squared gradients (a warp reduction) before the
// weights move. The weight and state are read from where the row lives and written there (a
// cached row's in its slot: its weight need not be staged). Every load of a row's piece comes
// before the arithmetic, so a lane keeps them all in flight at once.
template <class V, int VW>
__global__ void fused_row_update_kernel(V* buf, int64_t n, int64_t part_stride, int64_t width,
                                        int64_t dim, const V* grad, const int64_t* count,
                                        optim::Rule rule, optim::Hyper h, const void* step,
                                        bool step_f64, Parts parts, Target target,
                                        const int64_t* rounding) {
  using T = typename Math<V>::type;
  // Stochastic rounding's (seed, counter), read on the device (a captured step's replays
  // count on); nullptr: round to nearest.
  const bool rounds = rounding != nullptr;
  const uint64_t seed = rounds ? static_cast<uint64_t>(rounding[0]) : 0;
  const uint64_t counter = rounds ? static_cast<uint64_t>(rounding[1]) : 0;
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
    const V* g_row = grad + r * dim;
    V* home = buf + r * width;  // part 0 of where the row lives
    int64_t stride = part_stride;
    if (target.cache != nullptr && r < target.at_len) {
      const int64_t s = target.at[r];
      if (s >= 0 && s < target.slots) {
        home = static_cast<V*>(target.cache) + s * width;
        stride = target.cache_stride;
      }
    }
    const uint64_t key = rounds ? optim::row_key(seed, counter, r) : 0;
    T row_sum = 0;
    if (optim::has_row_value(rule)) {
      T sq = 0;
      for (int64_t j = lane; j < dim; j += kWarp) {
        const T g = optim::effective_grad(load(g_row + j), load(home + j), h, rule);
        sq += g * g;
      }
      sq = warp_sum(sq);
      row_sum = optim::row_value(rule, h, load(home + dim), sq / static_cast<T>(dim));
      __syncwarp();
      if (lane == 0) {
        store_pack_rounded<V, 1>(home + dim, &row_sum, rounds, key, optim::kRowElement);
      }
    }
    for (int64_t j = lane * VW; j < dim; j += kWarp * VW) {
      T w[VW], g[VW], s[3][VW] = {};
      load_pack<V, VW>(w, home + j);
      load_pack<V, VW>(g, g_row + j);
      // Constant trip counts (a state part past the rule's count is skipped), unrolled: the
      // state stays in registers.
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (k < parts.count) load_pack<V, VW>(s[k], home + parts.part[k] * stride + j);
      }
#pragma unroll
      for (int e = 0; e < VW; ++e) {
        T st[3] = {s[0][e], s[1][e], s[2][e]};
        optim::update(rule, h, optim::effective_grad(g[e], w[e], h, rule), w[e], st, momentum,
                      row_sum);
        for (int k = 0; k < 3; ++k) s[k][e] = st[k];
      }
      store_pack_rounded<V, VW>(home + j, w, rounds, key, optim::weight_element(j));
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (k < parts.count) {
          store_pack_rounded<V, VW>(home + parts.part[k] * stride + j, s[k], rounds, key,
                                    optim::state_element(k, j));
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_fused_row_update(Elem elem, void* buf, int64_t n, int64_t part_stride,
                                    int64_t width, int64_t dim, const void* grad, const int64_t* count, optim::Rule rule,
                                    optim::Hyper h, const void* step, bool step_f64,
                                    const int* state_part, int states, void* cache,
                                    int64_t cache_stride, int64_t slots, const int64_t* at,
                                    int64_t at_len, const int64_t* rounding,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (states < 0 || states > 3) return cudaErrorInvalidValue;
  Parts parts{{0, 0, 0}, states};
  for (int k = 0; k < states; ++k) parts.part[k] = state_part[k];
  const int per_block = kUpdateThreads / kWarp;
  const int blocks = static_cast<int>(std::min<int64_t>((n + per_block - 1) / per_block, 8192));
  const auto go = [&](auto zero) {
    using V = decltype(zero);
    constexpr int kVec = static_cast<int>(16 / sizeof(V));
    const bool vec = dim % kVec == 0 && width % kVec == 0 && part_stride % kVec == 0 &&
                     aligned16(buf) && aligned16(grad) &&
                     (cache == nullptr || (aligned16(cache) && cache_stride % kVec == 0));
    const Target target{cache, cache_stride, slots, at, at_len};
    if (vec) {
      fused_row_update_kernel<V, kVec><<<blocks, kUpdateThreads, 0, stream>>>(
          static_cast<V*>(buf), n, part_stride, width, dim, static_cast<const V*>(grad), count,
          rule, h, step, step_f64, parts, target, rounding);
    } else {
      fused_row_update_kernel<V, 1><<<blocks, kUpdateThreads, 0, stream>>>(
          static_cast<V*>(buf), n, part_stride, width, dim, static_cast<const V*>(grad), count,
          rule, h, step, step_f64, parts, target, rounding);
    }
    return cudaGetLastError();
  };
  return with_float_elem(elem, go);
}

}  // namespace speedtorch_ops::kernels
