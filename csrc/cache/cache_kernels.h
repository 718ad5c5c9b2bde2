// Launchers of the kernels that plan a row cache's step on the device (cache_ops_cuda.cpp has
// the contracts). Plain C++ types only, like copy/kernels.h. Launchers that need scratch take `temp`:
// with temp == nullptr they only set *temp_bytes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// Given sorted keys (n, ascending) and the permutation that sorted them: ids[0:count] the
// distinct keys ascending (ids must be zeroed by the caller), inverse[perm[i]] the position in
// ids of sorted[i], *count the number of distinct keys, starts[r] (n + 1 entries) the first i
// of distinct key r (n from r = count on). rank: n int64 of scratch. n < 2^31.
cudaError_t launch_unique_sorted(void* temp, size_t* temp_bytes, const int64_t* sorted,
                                 const int64_t* perm, int64_t* rank, int64_t n, int64_t* ids,
                                 int64_t* inverse, int64_t* count, int64_t* starts,
                                 cudaStream_t stream);

// order: the positions i < n with flags[i] ascending, then the others descending; *count the
// number flagged. n < 2^31.
cudaError_t launch_partition(void* temp, size_t* temp_bytes, const bool* flags, int64_t n,
                             int64_t* order, int64_t* count, cudaStream_t stream);

// For i < min(n, *count): s = slot_of[ids[i]]; at[i] = s >= 0 ? s : scratch, miss[i] = s < 0,
// freq[ids[i]] += 1. Other positions, and ids outside [0, rows) (slot_of's and freq's length):
// at[i] = scratch, miss[i] = false.
cudaError_t launch_cache_lookup(const int64_t* ids, const int64_t* count, int64_t n,
                                const int32_t* slot_of, int64_t rows, float* freq,
                                int64_t scratch, int64_t* at, bool* miss, cudaStream_t stream);

// The victims of a step among `window` candidate slots (k <= window <= slots < 2^31): candidate
// i is slot (start + i) mod slots, start = *hand (0 without a hand). prio[i] = freq[id_of[s]]
// for an occupied slot s (id_of[s] in [0, rows), freq's length), -1 for an empty one, +inf for a
// slot in at[0:n] (used by the step; entries >= slots are ignored); victims[0:k] the k
// candidates of least prio, ascending (ties: the earlier candidate first), and cold[j] their
// prio. Then *hand = start + window (mod slots). prio, keys_in/keys_out (window uint32 each),
// cand_in/cand_out (window int64 each): scratch.
cudaError_t launch_coldest_slots(void* temp, size_t* temp_bytes, const int64_t* id_of,
                                 int64_t slots, const float* freq, int64_t rows,
                                 const int64_t* at, int64_t n, int64_t k, int64_t* hand,
                                 int64_t window, float* prio, uint32_t* keys_in,
                                 uint32_t* keys_out, int64_t* cand_in, int64_t* cand_out,
                                 int64_t* victims, float* cold, cudaStream_t stream);

// For j < k: admit[j] = j < *misses, cold[j] finite and (unless !by_frequency) freq[r] >
// cold[j] for the miss r = ids[first[j]] (a tie keeps the row cached); the row held by
// victims[j] (old) is evicted when admit[j] and old is a row: keys[j] = old, else rows;
// *evicted counts the evicted (zeroed by the caller). Entries out of range are not admitted.
cudaError_t launch_admission(const int64_t* ids, int64_t n, const int64_t* first,
                             const int64_t* victims, const float* cold, int64_t k,
                             const int64_t* misses, const float* freq, const int64_t* id_of,
                             int64_t slots, int64_t rows, bool by_frequency, bool* admit,
                             int64_t* keys, int64_t* evicted, cudaStream_t stream);

// For j < k with admit[j]: the miss r = ids[first[j]] takes slot v = victims[j] (slot_of[r] =
// v, id_of[v] = r, dest[first[j]] = v), and the row that held v, if any, leaves the map
// (slot_of[old] = -1). Victims are distinct slots, the misses distinct uncached rows: no two
// threads write one place. Entries out of range (a victim outside [0, slots), first[j] outside
// [0, n), a row outside [0, rows)) are skipped.
cudaError_t launch_cache_admit(int32_t* slot_of, int64_t rows, int64_t* id_of, int64_t slots,
                               const int64_t* ids, int64_t n, const int64_t* first,
                               const int64_t* victims, const bool* admit, int64_t k,
                               int64_t* dest, cudaStream_t stream);

// Rows between slots and positions, each tensor (parts, rows, row_bytes) with parts
// *_part_bytes and rows *_row_stride bytes apart: for i < min(n, *count) with
// 0 <= index[i] < slots, take: dst row i = src row index[i]; else dst row index[i] = src row i
// (index entries then distinct). Other entries move nothing.
cudaError_t launch_move_rows(void* dst, int64_t dst_part_bytes, int64_t dst_row_stride,
                             const void* src, int64_t src_part_bytes, int64_t src_row_stride,
                             int64_t slots, int64_t row_bytes, int64_t parts,
                             const int64_t* index, const int64_t* count, int64_t n, bool take,
                             cudaStream_t stream);

// Counts one step in *age; when the count reaches a multiple of period, freq[0:n] halves. The
// kernel over freq returns at once on the other steps, so a captured step pays no pass.
cudaError_t launch_age(float* freq, int64_t n, int64_t* age, int64_t period, cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
