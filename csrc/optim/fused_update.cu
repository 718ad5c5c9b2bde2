// The fused optimizer update's kernel (fused_update.h). Free of torch headers.
#include "optim/fused_update.h"

#include "optim/floats.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace speedtorch_ops::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kUpdateThreads = 256;

template <class T> __device__ __forceinline__ T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Where a row's updated values go: its cache slot when the step left it there (`at` names a
// slot of `cache`), else its staged record.
struct Target {
  char* cache;  // nullptr: every row lives in buf
  int64_t slots;
  const int64_t* at;
  int64_t at_len;
};

// One warp a row: its lanes stride over the row's columns, VW at a time. A row-wise
// accumulator takes the mean of the row's squared gradients (a warp reduction) before the
// weights move. The weight and state are read from where the row lives and written there (a
// cached row's in its slot: its weight need not be staged). Every load of a row's piece comes
// before the arithmetic, so a lane keeps them all in flight at once. V: the weights' type, S
// the per-element state's, R the row value's.
template <class V, class S, int VW>
__global__ void fused_row_update_kernel(char* buf, int64_t n, int64_t record, RecordFields f,
                                        int64_t dim, const V* grad, const int64_t* count,
                                        optim::Rule rule, optim::Hyper h, const void* step,
                                        bool step_f64, Target target, const int64_t* rounding) {
  using T = typename Math<V>::type;
  using R = std::conditional_t<std::is_same_v<S, double>, double, float>;
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
  const bool momentum = rule == optim::Rule::kSgd && f.states > 0;
  for (int64_t r = blockIdx.x * int64_t{blockDim.x / kWarp} + threadIdx.x / kWarp; r < rows;
       r += warps) {
    const V* g_row = grad + r * dim;
    char* home = buf + r * record;  // the record where the row lives
    if (target.cache != nullptr && r < target.at_len) {
      const int64_t s = target.at[r];
      if (s >= 0 && s < target.slots) home = target.cache + s * record;
    }
    V* w_row = reinterpret_cast<V*>(home + f.weight);
    S* s_row[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) s_row[k] = reinterpret_cast<S*>(home + f.state[k]);
    const uint64_t key = rounds ? optim::row_key(seed, counter, r) : 0;
    T row_sum = 0;
    if (optim::has_row_value(rule)) {
      T sq = 0;
      for (int64_t j = lane; j < dim; j += kWarp) {
        const T g = optim::effective_grad(load(g_row + j), load(w_row + j), h, rule);
        sq += g * g;
      }
      sq = warp_sum(sq);
      R* value = reinterpret_cast<R*>(home + f.row);
      row_sum = optim::row_value(rule, h, static_cast<T>(*value), sq / static_cast<T>(dim));
      __syncwarp();
      if (lane == 0) *value = static_cast<R>(row_sum);
    }
    for (int64_t j = lane * VW; j < dim; j += kWarp * VW) {
      T w[VW], g[VW], s[3][VW] = {};
      load_pack<V, VW>(w, w_row + j);
      load_pack<V, VW>(g, g_row + j);
      // Constant trip counts (a state past the rule's count is skipped), unrolled: the state
      // stays in registers.
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (k < f.states) load_pack<S, VW>(s[k], s_row[k] + j);
      }
#pragma unroll
      for (int e = 0; e < VW; ++e) {
        T st[3] = {s[0][e], s[1][e], s[2][e]};
        optim::update(rule, h, optim::effective_grad(g[e], w[e], h, rule), w[e], st, momentum,
                      row_sum);
        for (int k = 0; k < 3; ++k) s[k][e] = st[k];
      }
      store_pack_rounded<V, VW>(w_row + j, w, rounds, key, optim::weight_element(j));
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (k < f.states) {
          store_pack_rounded<S, VW>(s_row[k] + j, s[k], rounds, key, optim::state_element(k, j));
        }
      }
    }
  }
}

// go(V{}, S{}) for the weights' and state's types: the pairs the op lets through (F64 with
// F64; else a state of F32, BF16 or the weights' type).
template <class F> cudaError_t with_update_types(Elem weights, Elem state, F&& go) {
  return with_float_elem(weights, [&](auto v) {
    return with_float_elem(state, [&](auto s) {
      using V = decltype(v);
      using S = decltype(s);
      constexpr bool wide_v = std::is_same_v<V, double>, wide_s = std::is_same_v<S, double>;
      if constexpr (wide_v == wide_s && (std::is_same_v<S, V> || std::is_same_v<S, float> ||
                                         std::is_same_v<S, __nv_bfloat16>)) {
        return go(v, s);
      } else {
        return cudaErrorInvalidValue;
      }
    });
  });
}

}  // namespace

cudaError_t launch_fused_row_update(Elem weights, Elem state, void* buf, int64_t n,
                                    int64_t record, RecordFields fields, int64_t dim,
                                    const void* grad, const int64_t* count, optim::Rule rule,
                                    optim::Hyper h, const void* step, bool step_f64, void* cache,
                                    int64_t slots, const int64_t* at, int64_t at_len,
                                    const int64_t* rounding, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (fields.states < 0 || fields.states > 3) return cudaErrorInvalidValue;
  for (int k = fields.states; k < 3; ++k) fields.state[k] = 0;  // never read past the count
  const int per_block = kUpdateThreads / kWarp;
  const int blocks = static_cast<int>(std::min<int64_t>((n + per_block - 1) / per_block, 8192));
  const Target target{static_cast<char*>(cache), slots, at, at_len};
  return with_update_types(weights, state, [&](auto v_zero, auto s_zero) {
    using V = decltype(v_zero);
    using S = decltype(s_zero);
    // The widest VW whose pieces every record, field and pointer is aligned to: 16 bytes of
    // weights, else 8, else one element.
    const auto fits = [&](int64_t vw) {
      if (dim % vw != 0) return false;
      const int64_t wb = pack_align(vw * sizeof(V)), sb = pack_align(vw * sizeof(S));
      bool ok = record % wb == 0 && fields.weight % wb == 0 && aligned(buf, wb) &&
                aligned(grad, wb) && (cache == nullptr || aligned(cache, wb));
      for (int k = 0; k < fields.states; ++k) {
        ok = ok && record % sb == 0 && fields.state[k] % sb == 0 && aligned(buf, sb) &&
             (cache == nullptr || aligned(cache, sb));
      }
      return ok;
    };
    const auto launch = [&](auto width) {
      constexpr int VW = decltype(width)::value;
      fused_row_update_kernel<V, S, VW><<<blocks, kUpdateThreads, 0, stream>>>(
          static_cast<char*>(buf), n, record, fields, dim, static_cast<const V*>(grad), count,
          rule, h, step, step_f64, target, rounding);
      return cudaGetLastError();
    };
    constexpr int kVec16 = static_cast<int>(16 / sizeof(V));
    constexpr int kVec8 = static_cast<int>(8 / sizeof(V));
    if (fits(kVec16)) return launch(std::integral_constant<int, kVec16>{});
    if constexpr (kVec8 > 1) {
      if (fits(kVec8)) return launch(std::integral_constant<int, kVec8>{});
    }
    return launch(std::integral_constant<int, 1>{});
  });
}

}  // namespace speedtorch_ops::kernels
