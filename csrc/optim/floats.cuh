// The floating element types of the step's kernels (fused_update.cu, segment_sum.cu): their
// math type, conversions to and from it, and the dispatch from a kernels' Elem. Torch-free.
#pragma once

#include "common/kernel_types.h"
#include "optim/rounding.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace speedtorch_ops::kernels {

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

// VW consecutive elements moved at once: by one load or store instruction up to 16 bytes
// (VW = 16 / sizeof(V) where every row and pointer allows it: a lane then moves a 512-byte
// row's share at once), by 16-byte pieces beyond (a float32 state beside 16-bit weights).
constexpr size_t pack_align(size_t bytes) { return bytes < 16 ? bytes : 16; }
template <class V, int VW> struct alignas(pack_align(VW * sizeof(V))) Pack {
  V v[VW];
};

template <class V, int VW, class T> __device__ __forceinline__ void load_pack(T* x, const V* p) {
  const Pack<V, VW> in = *reinterpret_cast<const Pack<V, VW>*>(p);
  for (int e = 0; e < VW; ++e) x[e] = load(&in.v[e]);
}

template <class V, int VW, class T> __device__ __forceinline__ void add_pack(T* acc, const V* p) {
  const Pack<V, VW> in = *reinterpret_cast<const Pack<V, VW>*>(p);
  for (int e = 0; e < VW; ++e) acc[e] += load(&in.v[e]);
}

template <class V, int VW, class T> __device__ __forceinline__ void store_pack(V* p, const T* x) {
  Pack<V, VW> out;
  for (int e = 0; e < VW; ++e) store(&out.v[e], x[e]);
  *reinterpret_cast<Pack<V, VW>*>(p) = out;
}

// store_pack, with a 16-bit type's values rounded stochastically (rounding.h) when `rounds`:
// element e draws under `key` with element number first + e (first even: bfloat16's pairs of
// elements share a draw).
template <class V, int VW, class T>
__device__ __forceinline__ void store_pack_rounded(V* p, const T* x, bool rounds, uint64_t key,
                                                   uint32_t first) {
  if constexpr (std::is_same_v<V, __nv_bfloat16>) {
    if (rounds) {
      T r[VW];
      if constexpr (VW % 2 == 0) {
        for (int e = 0; e < VW; e += 2) {
          const uint32_t u = optim::draw(key, (first + e) >> 1);
          r[e] = optim::round_bf16(x[e], u & 0xffffu);
          r[e + 1] = optim::round_bf16(x[e + 1], u >> 16);
        }
      } else {
        for (int e = 0; e < VW; ++e) {
          r[e] = optim::round_bf16(x[e], optim::draw_bf16(key, first + e));
        }
      }
      store_pack<V, VW>(p, r);
      return;
    }
  } else if constexpr (std::is_same_v<V, __half>) {
    if (rounds) {
      T r[VW];
      for (int e = 0; e < VW; ++e) {
        r[e] = optim::round_stochastic(x[e], optim::draw(key, first + e), optim::kHalf);
      }
      store_pack<V, VW>(p, r);
      return;
    }
  }
  store_pack<V, VW>(p, x);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
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

}  // namespace speedtorch_ops::kernels
