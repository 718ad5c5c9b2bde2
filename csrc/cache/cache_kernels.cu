// Kernels that plan a row cache's step on the device (cache_kernels.h). Free of torch headers.
#include "cache/cache_kernels.h"

#include "common/elementwise.cuh"

#include <cub/cub.cuh>
#include <math_constants.h>
#include <thrust/iterator/counting_iterator.h>

#include <algorithm>
#include <climits>

namespace speedtorch_ops::kernels {
namespace {

__global__ void heads_kernel(const int64_t* sorted, int64_t n, int64_t* head) {
  for_each_element(n, [&](int64_t i) {
    head[i] = (i == 0 || sorted[i] != sorted[i - 1]) ? 1 : 0;
  });
}

// rank: the inclusive scan of the heads (the position in ids, plus one).
__global__ void scatter_unique_kernel(const int64_t* sorted, const int64_t* perm,
                                      const int64_t* rank, int64_t n, int64_t* ids,
                                      int64_t* inverse, int64_t* count, int64_t* starts) {
  for_each_element(n, [&](int64_t i) {
    const int64_t r = rank[i] - 1;
    if (i == 0 || sorted[i] != sorted[i - 1]) {
      ids[r] = sorted[i];
      starts[r] = i;
    }
    inverse[perm[i]] = r;
    if (i == n - 1) *count = r + 1;
  });
}

// starts[r] = n for r in [count, n]: the segments past the distinct keys are empty.
__global__ void end_starts_kernel(const int64_t* count, int64_t n, int64_t* starts) {
  const int64_t from = *count;
  for_each_element(n + 1, [&](int64_t r) {
    if (r >= from) starts[r] = n;
  });
}

__global__ void zero_kernel(int64_t* x) { *x = 0; }

__global__ void cache_lookup_kernel(const int64_t* ids, const int64_t* count, int64_t n,
                                    const int32_t* slot_of, int64_t rows, float* freq,
                                    int64_t scratch, int64_t* at, bool* miss) {
  const int64_t valid = min(n, *count);
  for_each_element(n, [&](int64_t i) {
    const int64_t id = i < valid ? ids[i] : -1;
    if (id >= 0 && id < rows) {  // an id out of range (trusted, never expected) touches nothing
      const int32_t s = slot_of[id];
      at[i] = s >= 0 ? s : scratch;
      miss[i] = s < 0;
      atomicAdd(freq + id, 1.0f);  // distinct ids never collide; duplicates still add up
    } else {
      at[i] = scratch;
      miss[i] = false;
    }
  });
}

__global__ void halve_if_due_kernel(float* freq, int64_t n, const int64_t* age, int64_t period) {
  if ((*age + 1) % period != 0) return;
  for_each_element(n, [&](int64_t i) {
    freq[i] *= 0.5f;
  });
}

__global__ void count_step_kernel(int64_t* age) { *age += 1; }

// Float bits as an unsigned key of the same order (negative floats reversed below the others).
__device__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The first candidate slot: *hand (wrapped into [0, slots)), 0 without a hand. Candidate i is
// slot (start + i) mod slots.
__device__ __forceinline__ int64_t window_start(const int64_t* hand, int64_t slots) {
  return hand == nullptr ? 0 : ((*hand % slots) + slots) % slots;
}

__global__ void slot_priority_kernel(const int64_t* id_of, int64_t slots, const float* freq,
                                     int64_t rows, const int64_t* hand, int64_t window,
                                     float* prio, uint32_t* keys, int64_t* candidate) {
  const int64_t start = window_start(hand, slots);
  for_each_element(window, [&](int64_t i) {
    const int64_t id = id_of[(start + i) % slots];
    const float p = id >= 0 && id < rows ? freq[id] : -1.0f;
    prio[i] = p;
    keys[i] = order_key(p);
    candidate[i] = i;
  });
}

__global__ void exclude_used_kernel(const int64_t* at, int64_t n, int64_t slots,
                                    const int64_t* hand, int64_t window, float* prio,
                                    uint32_t* keys) {
  const int64_t start = window_start(hand, slots);
  for_each_element(n, [&](int64_t j) {
    const int64_t s = at[j];
    if (s >= 0 && s < slots) {
      const int64_t i = (s - start + slots) % slots;
      if (i < window) {
        prio[i] = CUDART_INF_F;
        keys[i] = order_key(CUDART_INF_F);
      }
    }
  });
}

__global__ void take_coldest_kernel(const int64_t* candidate, int64_t k, const float* prio,
                                    const int64_t* hand, int64_t slots, int64_t* victims,
                                    float* cold) {
  const int64_t start = window_start(hand, slots);
  for_each_element(k, [&](int64_t j) {
    const int64_t i = candidate[j];
    victims[j] = (start + i) % slots;
    cold[j] = prio[i];
  });
}

__global__ void advance_hand_kernel(int64_t* hand, int64_t window, int64_t slots) {
  *hand = (window_start(hand, slots) + window) % slots;
}

__global__ void admission_kernel(const int64_t* ids, int64_t n, const int64_t* first,
                                 const int64_t* victims, const float* cold, int64_t k,
                                 const int64_t* misses, const float* freq, const int64_t* id_of,
                                 int64_t slots, int64_t rows, bool by_frequency, bool* admit,
                                 int64_t* keys, unsigned long long* evicted) {
  const int64_t m = *misses;
  for_each_element(k, [&](int64_t j) {
    const int64_t at = first[j], v = victims[j];
    const int64_t row = at >= 0 && at < n ? ids[at] : -1;
    bool yes = j < m && isfinite(cold[j]) && row >= 0 && row < rows && v >= 0 && v < slots;
    if (yes && by_frequency) yes = freq[row] > cold[j];
    const int64_t old = yes ? id_of[v] : -1;
    const bool evict = old >= 0 && old < rows;
    admit[j] = yes;
    keys[j] = evict ? old : rows;
    if (evict) atomicAdd(evicted, 1ull);
  });
}

__global__ void cache_admit_kernel(int32_t* slot_of, int64_t rows, int64_t* id_of, int64_t slots,
                                   const int64_t* ids, int64_t n, const int64_t* first,
                                   const int64_t* victims, const bool* admit, int64_t k,
                                   int64_t* dest) {
  for_each_element(k, [&](int64_t j) {
    if (!admit[j]) return;
    // Out-of-range entries (trusted, never expected) are skipped: nothing outside the tensors.
    const int64_t v = victims[j], at = first[j];
    if (v < 0 || v >= slots || at < 0 || at >= n) return;
    const int64_t row = ids[at];
    if (row < 0 || row >= rows) return;
    const int64_t old = id_of[v];
    if (old >= 0 && old < rows) slot_of[old] = -1;
    slot_of[row] = static_cast<int32_t>(v);
    id_of[v] = row;
    dest[at] = v;
  });
}

// One warp a (position, part) pair, its lanes striding over the row in V-sized pieces: a
// 512-byte row of uint4 is one load and one store per lane. Positions past the count, and
// entries that name no slot, return at once.
template <class V>
__global__ void move_rows_kernel(V* dst, int64_t dst_part, int64_t dst_row, const V* src,
                                 int64_t src_part, int64_t src_row, int64_t slots, int64_t row,
                                 int64_t parts, const int64_t* index, const int64_t* count,
                                 int64_t n, bool take) {
  const int64_t m = min(n, max(*count, int64_t{0}));
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t{gridDim.x} * blockDim.x) >> 5;
  for (int64_t t = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> 5; t < m * parts;
       t += warps) {
    const int64_t i = t / parts, k = t - i * parts;
    const int64_t j = index[i];
    if (j < 0 || j >= slots) continue;
    V* to = dst + k * dst_part + (take ? i : j) * dst_row;
    const V* from = src + k * src_part + (take ? j : i) * src_row;
    for (int64_t e = lane; e < row; e += 32) to[e] = from[e];
  }
}

template <class V>
cudaError_t launch_move_rows_as(void* dst, int64_t dst_part, int64_t dst_row, const void* src,
                                int64_t src_part, int64_t src_row, int64_t slots,
                                int64_t row_bytes, int64_t parts, const int64_t* index,
                                const int64_t* count, int64_t n, bool take, cudaStream_t stream) {
  constexpr int64_t kWarpsPerBlock = kThreads / 32;
  constexpr int64_t kSize = sizeof(V);
  const int64_t blocks = std::min<int64_t>((n * parts + kWarpsPerBlock - 1) / kWarpsPerBlock, 4096);
  move_rows_kernel<V><<<static_cast<int>(std::max<int64_t>(blocks, 1)), kThreads, 0, stream>>>(
      static_cast<V*>(dst), dst_part / kSize, dst_row / kSize, static_cast<const V*>(src),
      src_part / kSize, src_row / kSize, slots, row_bytes / kSize, parts, index, count, n, take);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_unique_sorted(void* temp, size_t* temp_bytes, const int64_t* sorted,
                                 const int64_t* perm, int64_t* rank, int64_t n, int64_t* ids,
                                 int64_t* inverse, int64_t* count, int64_t* starts,
                                 cudaStream_t stream) {
  if (n > INT_MAX) return cudaErrorInvalidValue;
  if (temp == nullptr) {
    return cub::DeviceScan::InclusiveSum(nullptr, *temp_bytes, rank, rank, static_cast<int>(n),
                                         stream);
  }
  if (n == 0) {
    zero_kernel<<<1, 1, 0, stream>>>(count);
    zero_kernel<<<1, 1, 0, stream>>>(starts);
    return cudaGetLastError();
  }
  heads_kernel<<<blocks_for_elements(n), kThreads, 0, stream>>>(sorted, n, rank);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cub::DeviceScan::InclusiveSum(temp, *temp_bytes, rank, rank, static_cast<int>(n), stream);
  if (err != cudaSuccess) return err;
  scatter_unique_kernel<<<blocks_for_elements(n), kThreads, 0, stream>>>(sorted, perm, rank, n, ids,
                                                                inverse, count, starts);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  end_starts_kernel<<<blocks_for_elements(n + 1), kThreads, 0, stream>>>(count, n, starts);
  return cudaGetLastError();
}

cudaError_t launch_partition(void* temp, size_t* temp_bytes, const bool* flags, int64_t n,
                             int64_t* order, int64_t* count, cudaStream_t stream) {
  if (n > INT_MAX) return cudaErrorInvalidValue;
  if (temp != nullptr && n == 0) {
    zero_kernel<<<1, 1, 0, stream>>>(count);
    return cudaGetLastError();
  }
  // cub writes the flagged items in order from the front and the others in reverse order from
  // the back.
  return cub::DevicePartition::Flagged(temp, *temp_bytes, thrust::counting_iterator<int64_t>(0),
                                       flags, order, count, static_cast<int>(n), stream);
}

cudaError_t launch_cache_lookup(const int64_t* ids, const int64_t* count, int64_t n,
                                const int32_t* slot_of, int64_t rows, float* freq,
                                int64_t scratch, int64_t* at, bool* miss, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cache_lookup_kernel<<<blocks_for_elements(n), kThreads, 0, stream>>>(ids, count, n, slot_of, rows, freq,
                                                              scratch, at, miss);
  return cudaGetLastError();
}

cudaError_t launch_coldest_slots(void* temp, size_t* temp_bytes, const int64_t* id_of,
                                 int64_t slots, const float* freq, int64_t rows,
                                 const int64_t* at, int64_t n, int64_t k, int64_t* hand,
                                 int64_t window, float* prio, uint32_t* keys_in,
                                 uint32_t* keys_out, int64_t* cand_in, int64_t* cand_out,
                                 int64_t* victims, float* cold, cudaStream_t stream) {
  if (slots > INT_MAX || k > window || window > slots) return cudaErrorInvalidValue;
  if (temp == nullptr) {
    return cub::DeviceRadixSort::SortPairs(nullptr, *temp_bytes, keys_in, keys_out, cand_in,
                                           cand_out, static_cast<int>(window), 0, 32, stream);
  }
  if (slots == 0 || k == 0) return cudaSuccess;
  slot_priority_kernel<<<blocks_for_elements(window), kThreads, 0, stream>>>(
      id_of, slots, freq, rows, hand, window, prio, keys_in, cand_in);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (n > 0) {
    exclude_used_kernel<<<blocks_for_elements(n), kThreads, 0, stream>>>(at, n, slots, hand,
                                                                         window, prio, keys_in);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  err = cub::DeviceRadixSort::SortPairs(temp, *temp_bytes, keys_in, keys_out, cand_in, cand_out,
                                        static_cast<int>(window), 0, 32, stream);
  if (err != cudaSuccess) return err;
  take_coldest_kernel<<<blocks_for_elements(k), kThreads, 0, stream>>>(cand_out, k, prio, hand,
                                                                       slots, victims, cold);
  err = cudaGetLastError();
  if (err != cudaSuccess || hand == nullptr) return err;
  advance_hand_kernel<<<1, 1, 0, stream>>>(hand, window, slots);
  return cudaGetLastError();
}

cudaError_t launch_admission(const int64_t* ids, int64_t n, const int64_t* first,
                             const int64_t* victims, const float* cold, int64_t k,
                             const int64_t* misses, const float* freq, const int64_t* id_of,
                             int64_t slots, int64_t rows, bool by_frequency, bool* admit,
                             int64_t* keys, int64_t* evicted, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  admission_kernel<<<blocks_for_elements(k), kThreads, 0, stream>>>(
      ids, n, first, victims, cold, k, misses, freq, id_of, slots, rows, by_frequency, admit,
      keys, reinterpret_cast<unsigned long long*>(evicted));
  return cudaGetLastError();
}

cudaError_t launch_cache_admit(int32_t* slot_of, int64_t rows, int64_t* id_of, int64_t slots,
                               const int64_t* ids, int64_t n, const int64_t* first,
                               const int64_t* victims, const bool* admit, int64_t k,
                               int64_t* dest, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  cache_admit_kernel<<<blocks_for_elements(k), kThreads, 0, stream>>>(slot_of, rows, id_of, slots, ids, n,
                                                             first, victims, admit, k, dest);
  return cudaGetLastError();
}

cudaError_t launch_move_rows(void* dst, int64_t dst_part_bytes, int64_t dst_row_stride,
                             const void* src, int64_t src_part_bytes, int64_t src_row_stride,
                             int64_t slots, int64_t row_bytes, int64_t parts,
                             const int64_t* index, const int64_t* count, int64_t n, bool take,
                             cudaStream_t stream) {
  if (n == 0 || parts == 0 || row_bytes == 0) return cudaSuccess;
  // The widest piece that every address and stride is a multiple of.
  const auto fits = [&](int64_t size) {
    return reinterpret_cast<uintptr_t>(dst) % size == 0 &&
           reinterpret_cast<uintptr_t>(src) % size == 0 && dst_part_bytes % size == 0 &&
           src_part_bytes % size == 0 && dst_row_stride % size == 0 &&
           src_row_stride % size == 0 && row_bytes % size == 0;
  };
  const auto go = [&](auto piece) {
    return launch_move_rows_as<decltype(piece)>(dst, dst_part_bytes, dst_row_stride, src,
                                                src_part_bytes, src_row_stride, slots, row_bytes,
                                                parts, index, count, n, take, stream);
  };
  if (fits(16)) return go(uint4{});
  if (fits(8)) return go(uint2{});
  if (fits(4)) return go(uint32_t{});
  if (fits(2)) return go(uint16_t{});
  return go(uint8_t{});
}

cudaError_t launch_age(float* freq, int64_t n, int64_t* age, int64_t period, cudaStream_t stream) {
  // Few blocks: on the steps that do not age, each block only reads *age and returns.
  if (n > 0) {
    halve_if_due_kernel<<<std::min(blocks_for_elements(n), 1024), kThreads, 0, stream>>>(freq, n, age,
                                                                                 period);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  count_step_kernel<<<1, 1, 0, stream>>>(age);
  return cudaGetLastError();
}

}  // namespace speedtorch_ops::kernels
