// _segment_sum's kernels (segment_sum.h). Free of torch headers.
#include "optim/segment_sum.h"

#include "optim/floats.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace speedtorch_ops::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarp;
// Phase 2's accumulators a lane keeps for a row that spans chunks: their loads are in flight
// together.
constexpr int kAhead = 8;

// Row q of the gradient (the pieces' rows in turn): the first piece whose end passes q. Every
// lane of a warp asks for the same q: the search reads the kernel argument uniformly.
template <class V>
__device__ __forceinline__ const V* grad_row(const GradPieces& g, int64_t q, int64_t dim) {
  int lo = 0, hi = g.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (g.end[mid] > q) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int64_t base = lo == 0 ? 0 : g.end[lo - 1];
  return static_cast<const V*>(g.ptr[lo]) + (q - base) * dim;
}

// Phase 1: warp c sums the rows of sorted positions [c L, (c + 1) L). A segment inside the
// chunk goes to out; one that began before it to partial[c][0], one that continues after it
// (and began inside) to partial[c][1]. Lane l covers columns col0 + [l VW, (l + 1) VW).
template <class V, int VW>
__global__ void chunk_sums_kernel(GradPieces g, int64_t n_pos, int64_t dim, const int64_t* perm,
                                  const int64_t* starts, int64_t n_seg, V* out, int64_t rows,
                                  typename Math<V>::type* partial) {
  using T = typename Math<V>::type;
  const int lane = threadIdx.x % kWarp;
  const int64_t chunks = (n_pos + kSegmentChunk - 1) / kSegmentChunk;
  for (int64_t c = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarp; c < chunks;
       c += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t lo = c * kSegmentChunk, hi = min(n_pos, lo + kSegmentChunk);
    // Each lane holds one position of the chunk: the loop below takes them by shuffle.
    const int64_t mine = lo + lane < hi ? perm[lo + lane] : 0;
    // The segment holding position lo: the last r with starts[r] <= lo (starts ascend).
    int64_t first = 0, last = n_seg - 1;
    while (first < last) {
      const int64_t mid = (first + last + 1) / 2;
      if (starts[mid] <= lo) {
        first = mid;
      } else {
        last = mid - 1;
      }
    }
    for (int64_t col0 = 0; col0 < dim; col0 += kWarp * VW) {
      const int64_t j0 = col0 + lane * VW;
      const bool cols = j0 < dim;  // VW > 1 divides dim: a lane's pack is whole or absent
      T acc[VW];
      int64_t cur = first;
      for (int e = 0; e < VW; ++e) acc[e] = 0;
      const auto emit = [&](int64_t r) {
        if (r < 0 || r >= n_seg || r >= rows || !cols) return;
        const int64_t s0 = starts[r], s1 = starts[r + 1];
        if (s0 < lo || s1 > hi) {
          T* dst = partial + (c * 2 + (s0 < lo ? 0 : 1)) * dim + j0;
          for (int e = 0; e < VW; ++e) dst[e] = acc[e];
        } else if (VW > 1) {
          store_pack<V, VW>(out + r * dim + j0, acc);
        } else {
          store(out + r * dim + j0, acc[0]);
        }
      };
      int64_t next = cur + 1 < n_seg ? starts[cur + 1] : n_pos;
      // One position at a time: the many warps of a launch keep the loads in flight (loading
      // kAhead rows ahead took more registers, fewer warps, and more time).
      for (int64_t p = lo; p < hi; ++p) {
        if (p >= next) {  // the next segment
          emit(cur);
          while (cur + 1 < n_seg && p >= starts[cur + 1]) ++cur;
          next = cur + 1 < n_seg ? starts[cur + 1] : n_pos;
          for (int e = 0; e < VW; ++e) acc[e] = 0;
        }
        const int64_t q = __shfl_sync(0xffffffffu, mine, static_cast<int>(p - lo));
        const V* row = grad_row<V>(g, q, dim);
        if (cols) {
          if (VW > 1) {
            add_pack<V, VW>(acc, row + j0);
          } else {
            acc[0] += load(row + j0);
          }
        }
      }
      emit(cur);
    }
  }
}

// Phase 2: warp r finishes row r: a segment that spans chunks sums its partials in chunk
// order; rows past the segments (or past count) are zero (left with zero_tail false); the
// others phase 1 wrote.
template <class V, int VW>
__global__ void finish_rows_kernel(int64_t dim, const int64_t* starts, int64_t n_seg,
                                   const int64_t* count, V* out, int64_t rows, bool zero_tail,
                                   const typename Math<V>::type* partial) {
  using T = typename Math<V>::type;
  const int lane = threadIdx.x % kWarp;
  const int64_t live = max(min(min(*count, n_seg), rows), int64_t{0});
  const int64_t end = zero_tail ? rows : live;
  T zero[VW];
  for (int e = 0; e < VW; ++e) zero[e] = 0;
  for (int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarp; r < end;
       r += int64_t{gridDim.x} * kWarpsPerBlock) {
    bool empty = r >= live;
    int64_t c0 = 0, c1 = 0;
    if (!empty) {
      const int64_t s0 = starts[r], s1 = starts[r + 1];
      empty = s1 <= s0;  // no position (never for a distinct id): zero
      c0 = s0 / kSegmentChunk;
      c1 = empty ? c0 : (s1 - 1) / kSegmentChunk;
    }
    if (empty) {
      for (int64_t j = lane * VW; j < dim; j += kWarp * VW) {
        if (VW > 1) {
          store_pack<V, VW>(out + r * dim + j, zero);
        } else {
          store(out + r * dim + j, zero[0]);
        }
      }
      continue;
    }
    if (c0 == c1) continue;  // inside one chunk: phase 1 wrote it
    // The partial sums of chunks c0 (its tail), c0 + 1, ..., c1 (their heads): kAhead
    // accumulators, each taking every kAhead-th chunk, added in a fixed order at the end (a hot
    // row spans thousands of chunks: one chain of loads would be its whole cost).
    for (int64_t j = lane * VW; j < dim; j += kWarp * VW) {
      T acc[kAhead][VW];
      for (int k = 0; k < kAhead; ++k) {
        for (int e = 0; e < VW; ++e) acc[k][e] = 0;
      }
      add_pack<T, VW>(acc[0], partial + (c0 * 2 + 1) * dim + j);
      for (int64_t c = c0 + 1; c <= c1; c += kAhead) {
#pragma unroll
        for (int k = 0; k < kAhead; ++k) {
          if (c + k <= c1) add_pack<T, VW>(acc[k], partial + ((c + k) * 2) * dim + j);
        }
      }
      for (int k = 1; k < kAhead; ++k) {
        for (int e = 0; e < VW; ++e) acc[0][e] += acc[k][e];
      }
      if (VW > 1) {
        store_pack<V, VW>(out + r * dim + j, acc[0]);
      } else {
        store(out + r * dim + j, acc[0][0]);
      }
    }
  }
}

int blocks_for_warps(int64_t warps) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock,
                                             16384)));
}

}  // namespace

size_t segment_sum_scratch_bytes(Elem elem, int64_t n_pos, int64_t dim) {
  const int64_t chunks = (n_pos + kSegmentChunk - 1) / kSegmentChunk;
  const size_t acc = elem == Elem::kF64 ? sizeof(double) : sizeof(float);
  return static_cast<size_t>(chunks) * 2 * static_cast<size_t>(dim) * acc;
}

cudaError_t launch_segment_sum(Elem elem, const GradPieces& grad, int64_t n_pos, int64_t dim,
                               const int64_t* perm, const int64_t* starts, int64_t n_seg,
                               const int64_t* count, void* out, int64_t rows, bool zero_tail,
                               void* scratch, cudaStream_t stream) {
  if (rows == 0 || dim == 0) return cudaSuccess;
  if (grad.count < 1 || grad.count > kMaxGradPieces) return cudaErrorInvalidValue;
  const auto go = [&](auto zero) {
    using V = decltype(zero);
    using T = typename Math<V>::type;
    constexpr int kVec = static_cast<int>(16 / sizeof(V));
    bool vec = dim % kVec == 0 && aligned16(out);
    for (int k = 0; k < grad.count; ++k) vec = vec && aligned16(grad.ptr[k]);
    auto* partial = static_cast<T*>(scratch);
    const auto launch = [&](auto width) {
      constexpr int VW = decltype(width)::value;
      if (n_pos > 0) {
        const int64_t chunks = (n_pos + kSegmentChunk - 1) / kSegmentChunk;
        chunk_sums_kernel<V, VW><<<blocks_for_warps(chunks), kThreadsPerBlock, 0, stream>>>(
            grad, n_pos, dim, perm, starts, n_seg, static_cast<V*>(out), rows, partial);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
      }
      finish_rows_kernel<V, VW><<<blocks_for_warps(rows), kThreadsPerBlock, 0, stream>>>(
          dim, starts, n_seg, count, static_cast<V*>(out), rows, zero_tail, partial);
      return cudaGetLastError();
    };
    return vec ? launch(std::integral_constant<int, kVec>{})
               : launch(std::integral_constant<int, 1>{});
  };
  return with_float_elem(elem, go);
}

}  // namespace speedtorch_ops::kernels
