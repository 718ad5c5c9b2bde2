// The zero-copy row kernels. A pinned host table is mapped into the GPU's address space, so the
// same kernel reads and writes host rows over PCIe or device rows in HBM.
#include "kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace speedtorch_ops::cuda {
namespace {

constexpr int kThreads = 256;

// A team of `team` threads (a power of two, at most a warp) per row, sized to the row's vectors,
// so narrow rows do not leave most of a warp idle.
int team_log2_for(int64_t row_units) {
  int log2 = 0;
  while (log2 < 5 && (int64_t{1} << log2) < row_units) ++log2;
  return log2;
}

int grid_for(int64_t n, int team_log2, int sm_count) {
  const int64_t rows_per_block = kThreads >> team_log2;
  const int64_t blocks = (n + rows_per_block - 1) / rows_per_block;
  // Enough blocks to fill every SM a few times over; the kernels stride over the rest.
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t{sm_count} * 16)));
}

// Calls go(V{}) with the widest access V (up to 16 bytes) that divides the row size and both
// base addresses; rows that are not a multiple of 16 bytes take a narrower, never a wrong, path.
template <typename Go>
cudaError_t by_vector_width(const void* dst, const void* src, int64_t row_bytes, const Go& go) {
  const auto align = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) |
                                          reinterpret_cast<uintptr_t>(src)) |
                     row_bytes;
  if (align % 16 == 0) return go(uint4{});
  if (align % 8 == 0) return go(uint2{});
  if (align % 4 == 0) return go(uint32_t{});
  if (align % 2 == 0) return go(uint16_t{});
  return go(uint8_t{});
}

__global__ void validate_kernel(const int64_t* __restrict__ idx, int64_t n, int64_t rows,
                                int arg, int64_t* __restrict__ status) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t v = idx[i];
    if (v < 0 || v >= rows) {
      auto* flag = reinterpret_cast<unsigned long long*>(status);
      if (atomicCAS(flag, 0ull, 1ull) == 0ull) {
        status[1] = arg;
        status[2] = i;
        status[3] = v;
      }
      return;
    }
  }
}

template <typename V>
__global__ void copy_rows_kernel(char* __restrict__ dst, const int64_t* __restrict__ dst_idx,
                                 const char* __restrict__ src,
                                 const int64_t* __restrict__ src_idx, int64_t n,
                                 int64_t row_vecs, int team_log2, bool last_of_run,
                                 const int32_t* __restrict__ winner,
                                 const int64_t* __restrict__ status) {
  if (status[0] != 0) return;  // a bad index: write nothing
  const int lane = threadIdx.x & ((1 << team_log2) - 1);
  const int64_t teams_per_block = blockDim.x >> team_log2;
  const int64_t stride = gridDim.x * teams_per_block;
  for (int64_t j = blockIdx.x * teams_per_block + (threadIdx.x >> team_log2); j < n; j += stride) {
    if (last_of_run && j + 1 < n && dst_idx[j + 1] == dst_idx[j]) continue;
    const int64_t d = dst_idx ? dst_idx[j] : j;
    if (winner != nullptr && winner[d] != j) continue;  // a later position writes this row
    const int64_t s = src_idx ? src_idx[j] : j;
    const V* from = reinterpret_cast<const V*>(src) + s * row_vecs;
    V* to = reinterpret_cast<V*>(dst) + d * row_vecs;
    for (int64_t c = lane; c < row_vecs; c += (1 << team_log2)) to[c] = from[c];
  }
}

// Gather in sorted order, each distinct row read once: sorted[j] holds the rows in ascending
// order and perm[j] the output slot of each. The first position of a run reads the row (over
// PCIe for a mapped host table) and writes it to every slot of the run.
template <typename V>
__global__ void gather_sorted_kernel(char* __restrict__ dst, const char* __restrict__ src,
                                     const int64_t* __restrict__ sorted,
                                     const int64_t* __restrict__ perm, int64_t n,
                                     int64_t row_vecs, int team_log2,
                                     const int64_t* __restrict__ status) {
  if (status[0] != 0) return;
  const int lane = threadIdx.x & ((1 << team_log2) - 1);
  const int64_t teams_per_block = blockDim.x >> team_log2;
  const int64_t stride = gridDim.x * teams_per_block;
  for (int64_t j = blockIdx.x * teams_per_block + (threadIdx.x >> team_log2); j < n; j += stride) {
    const int64_t row = sorted[j];
    if (j > 0 && sorted[j - 1] == row) continue;
    int64_t end = j + 1;
    while (end < n && sorted[end] == row) ++end;
    const V* from = reinterpret_cast<const V*>(src) + row * row_vecs;
    for (int64_t c = lane; c < row_vecs; c += (1 << team_log2)) {
      const V value = from[c];
      for (int64_t k = j; k < end; ++k) reinterpret_cast<V*>(dst)[perm[k] * row_vecs + c] = value;
    }
  }
}

template <typename V>
cudaError_t gather_sorted_as(char* dst, const char* src, const int64_t* sorted,
                             const int64_t* perm, int64_t n, int64_t row_bytes,
                             const int64_t* status, int sm_count, cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  const int team_log2 = team_log2_for(row_vecs);
  gather_sorted_kernel<V><<<grid_for(n, team_log2, sm_count), kThreads, 0, stream>>>(
      dst, src, sorted, perm, n, row_vecs, team_log2, status);
  return cudaGetLastError();
}

// winner[row] = the last position j with idx[j] == row (atomicMax), for a scatter in which the
// last duplicate wins without sorting. Runs after validation: with a bad index it does nothing.
__global__ void mark_last_kernel(const int64_t* __restrict__ idx, int64_t n,
                                 int32_t* __restrict__ winner,
                                 const int64_t* __restrict__ status) {
  if (status[0] != 0) return;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    atomicMax(winner + idx[i], static_cast<int32_t>(i));
  }
}

template <typename V>
cudaError_t copy_rows_as(char* dst, const int64_t* dst_idx, const char* src,
                         const int64_t* src_idx, int64_t n, int64_t row_bytes, bool last_of_run,
                         const int32_t* winner, const int64_t* status, int sm_count,
                         cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  const int team_log2 = team_log2_for(row_vecs);
  copy_rows_kernel<V><<<grid_for(n, team_log2, sm_count), kThreads, 0, stream>>>(
      dst, dst_idx, src, src_idx, n, row_vecs, team_log2, last_of_run, winner, status);
  return cudaGetLastError();
}

// Addition in the element's own type, rounded after every step like torch's index_add_ on
// the CPU, so both devices produce the same bits.
template <typename T>
__device__ __forceinline__ T add(T a, T b) { return static_cast<T>(a + b); }
template <>
__device__ __forceinline__ bool add(bool a, bool b) { return a || b; }
template <>
__device__ __forceinline__ __half add(__half a, __half b) {
  return __float2half(__half2float(a) + __half2float(b));
}
template <>
__device__ __forceinline__ __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(__bfloat162float(a) + __bfloat162float(b));
}

template <typename T>
__global__ void accumulate_rows_kernel(T* __restrict__ table, const int64_t* __restrict__ sorted,
                                       const T* __restrict__ src,
                                       const int64_t* __restrict__ perm, int64_t n,
                                       int64_t row_elems, int team_log2,
                                       const int64_t* __restrict__ status) {
  if (status[0] != 0) return;
  const int lane = threadIdx.x & ((1 << team_log2) - 1);
  const int64_t teams_per_block = blockDim.x >> team_log2;
  const int64_t stride = gridDim.x * teams_per_block;
  for (int64_t j = blockIdx.x * teams_per_block + (threadIdx.x >> team_log2); j < n; j += stride) {
    if (j > 0 && sorted[j - 1] == sorted[j]) continue;  // only the first of a run works
    const int64_t row = sorted[j];
    int64_t end = j + 1;
    while (end < n && sorted[end] == row) ++end;
    T* to = table + row * row_elems;
    for (int64_t c = lane; c < row_elems; c += (1 << team_log2)) {
      T acc = to[c];
      for (int64_t k = j; k < end; ++k) acc = add(acc, src[perm[k] * row_elems + c]);
      to[c] = acc;
    }
  }
}

template <typename T>
cudaError_t accumulate_as(char* table, const int64_t* sorted, const char* src,
                          const int64_t* perm, int64_t n, int64_t row_elems,
                          const int64_t* status, int sm_count, cudaStream_t stream) {
  const int team_log2 = team_log2_for(row_elems);
  accumulate_rows_kernel<T><<<grid_for(n, team_log2, sm_count), kThreads, 0, stream>>>(
      reinterpret_cast<T*>(table), sorted, reinterpret_cast<const T*>(src), perm, n, row_elems,
      team_log2, status);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_validate(const int64_t* idx, int64_t n, int64_t rows, int arg,
                            int64_t* status, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
  validate_kernel<<<static_cast<int>(std::max<int64_t>(blocks, 1)), kThreads, 0, stream>>>(
      idx, n, rows, arg, status);
  return cudaGetLastError();
}

cudaError_t launch_copy_rows(char* dst, const int64_t* dst_idx, const char* src,
                             const int64_t* src_idx, int64_t n, int64_t row_bytes,
                             bool last_of_run, const int32_t* winner, const int64_t* status,
                             int sm_count, cudaStream_t stream) {
  return by_vector_width(dst, src, row_bytes, [&](auto vec) {
    return copy_rows_as<decltype(vec)>(dst, dst_idx, src, src_idx, n, row_bytes, last_of_run,
                                       winner, status, sm_count, stream);
  });
}

cudaError_t launch_mark_last(const int64_t* idx, int64_t n, int32_t* winner,
                             const int64_t* status, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
  mark_last_kernel<<<static_cast<int>(std::max<int64_t>(blocks, 1)), kThreads, 0, stream>>>(
      idx, n, winner, status);
  return cudaGetLastError();
}

cudaError_t launch_gather_sorted(char* dst, const char* src, const int64_t* sorted,
                                 const int64_t* perm, int64_t n, int64_t row_bytes,
                                 const int64_t* status, int sm_count, cudaStream_t stream) {
  return by_vector_width(dst, src, row_bytes, [&](auto vec) {
    return gather_sorted_as<decltype(vec)>(dst, src, sorted, perm, n, row_bytes, status, sm_count,
                                           stream);
  });
}

cudaError_t launch_accumulate_rows(char* table, const int64_t* sorted, const char* src,
                                   const int64_t* perm, int64_t n, int64_t row_elems, Elem elem,
                                   const int64_t* status, int sm_count, cudaStream_t stream) {
  const auto go = [&](auto t) {
    return accumulate_as<decltype(t)>(table, sorted, src, perm, n, row_elems, status, sm_count,
                                      stream);
  };
  switch (elem) {
    case Elem::kF32: return go(float{});
    case Elem::kF64: return go(double{});
    case Elem::kF16: return go(__half{});
    case Elem::kBF16: return go(__nv_bfloat16{});
    case Elem::kI8: return go(int8_t{});
    case Elem::kU8: return go(uint8_t{});
    case Elem::kI16: return go(int16_t{});
    case Elem::kI32: return go(int32_t{});
    case Elem::kI64: return go(int64_t{});
    case Elem::kBool: return go(bool{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace speedtorch_ops::cuda
