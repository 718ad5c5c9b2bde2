// _segment_sum's kernels (segment_sum.h). Free of torch headers.
#include "segment_sum.h"

#include "floats.cuh"

#include <algorithm>

namespace speedtorch_ops::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarp;
// Columns a lane sums at once: a column block is kWarp * kCols wide.
constexpr int kCols = 4;

// Phase 1: warp c sums the rows of sorted positions [c L, (c + 1) L). A segment inside the
// chunk goes to out; one that began before it to partial[c][0], one that continues after it
// (and began inside) to partial[c][1].
template <class V>
__global__ void chunk_sums_kernel(const V* grad, int64_t n_pos, int64_t dim, const int64_t* perm,
                                  const int64_t* starts, int64_t n_seg, V* out, int64_t rows,
                                  typename Math<V>::type* partial) {
  using T = typename Math<V>::type;
  const int lane = threadIdx.x % kWarp;
  const int64_t chunks = (n_pos + kSegmentChunk - 1) / kSegmentChunk;
  for (int64_t c = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarp; c < chunks;
       c += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t lo = c * kSegmentChunk, hi = min(n_pos, lo + kSegmentChunk);
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
    for (int64_t col0 = 0; col0 < dim; col0 += kWarp * kCols) {
      T acc[kCols];
      int64_t cur = first;
      for (int k = 0; k < kCols; ++k) acc[k] = 0;
      const auto emit = [&](int64_t r) {
        if (r < 0 || r >= n_seg || r >= rows) return;
        const int64_t s0 = starts[r], s1 = starts[r + 1];
        T* dst = nullptr;
        if (s0 < lo) {
          dst = partial + (c * 2) * dim;
        } else if (s1 > hi) {
          dst = partial + (c * 2 + 1) * dim;
        }
        for (int k = 0; k < kCols; ++k) {
          const int64_t j = col0 + k * kWarp + lane;
          if (j >= dim) break;
          if (dst != nullptr) {
            dst[j] = acc[k];
          } else {
            store(out + r * dim + j, acc[k]);
          }
        }
      };
      for (int64_t p = lo; p < hi; ++p) {
        if (cur + 1 < n_seg && p >= starts[cur + 1]) {  // the next segment
          emit(cur);
          while (cur + 1 < n_seg && p >= starts[cur + 1]) ++cur;
          for (int k = 0; k < kCols; ++k) acc[k] = 0;
        }
        const V* g = grad + perm[p] * dim;
        for (int k = 0; k < kCols; ++k) {
          const int64_t j = col0 + k * kWarp + lane;
          if (j < dim) acc[k] += load(g + j);
        }
      }
      emit(cur);
    }
  }
}

// Phase 2: warp r finishes row r: a segment that spans chunks sums its partials in chunk
// order; rows past the segments (or past count) are zero; the others phase 1 wrote.
template <class V>
__global__ void finish_rows_kernel(int64_t dim, const int64_t* starts, int64_t n_seg,
                                   const int64_t* count, V* out, int64_t rows,
                                   const typename Math<V>::type* partial) {
  using T = typename Math<V>::type;
  const int lane = threadIdx.x % kWarp;
  const int64_t live = min(min(*count, n_seg), rows);
  for (int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarp; r < rows;
       r += int64_t{gridDim.x} * kWarpsPerBlock) {
    if (r >= live) {
      for (int64_t j = lane; j < dim; j += kWarp) store(out + r * dim + j, T(0));
      continue;
    }
    const int64_t s0 = starts[r], s1 = starts[r + 1];
    if (s1 <= s0) {  // no position (never for a distinct id): zero
      for (int64_t j = lane; j < dim; j += kWarp) store(out + r * dim + j, T(0));
      continue;
    }
    const int64_t c0 = s0 / kSegmentChunk, c1 = (s1 - 1) / kSegmentChunk;
    if (c0 == c1) continue;  // inside one chunk: phase 1 wrote it
    for (int64_t j = lane; j < dim; j += kWarp) {
      T acc = partial[(c0 * 2 + 1) * dim + j];
      for (int64_t c = c0 + 1; c <= c1; ++c) acc += partial[(c * 2) * dim + j];
      store(out + r * dim + j, acc);
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

cudaError_t launch_segment_sum(Elem elem, const void* grad, int64_t n_pos, int64_t dim,
                               const int64_t* perm, const int64_t* starts, int64_t n_seg, const int64_t* count, void* out, int64_t rows,
                               void* scratch, cudaStream_t stream) {
  if (rows == 0 || dim == 0) return cudaSuccess;
  const auto go = [&](auto zero) {
    using V = decltype(zero);
    using T = typename Math<V>::type;
    auto* partial = static_cast<T*>(scratch);
    if (n_pos > 0) {
      const int64_t chunks = (n_pos + kSegmentChunk - 1) / kSegmentChunk;
      chunk_sums_kernel<V><<<blocks_for_warps(chunks), kThreadsPerBlock, 0, stream>>>(
          static_cast<const V*>(grad), n_pos, dim, perm, starts, n_seg, static_cast<V*>(out),
          rows, partial);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    finish_rows_kernel<V><<<blocks_for_warps(rows), kThreadsPerBlock, 0, stream>>>(
        dim, starts, n_seg, count, static_cast<V*>(out), rows, partial);
    return cudaGetLastError();
  };
  return with_float_elem(elem, go);
}

}  // namespace speedtorch_ops::cuda
