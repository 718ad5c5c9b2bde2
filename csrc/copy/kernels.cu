// The zero-copy row kernels. A pinned host table is mapped into the GPU's address space, so the
// same kernel reads and writes host rows over PCIe or device rows in HBM.
#include "copy/kernels.h"

#include "common/elementwise.cuh"

#include <cooperative_groups.h>
#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>

namespace speedtorch_ops::kernels {
namespace {

namespace cg = cooperative_groups;

// A team of `team` threads (a power of two, at most a warp) per row, sized to the row's vectors,
// so narrow rows do not leave most of a warp idle.
int team_log2_for(int64_t row_units) {
  int log2 = 0;
  while (log2 < 5 && (int64_t{1} << log2) < row_units) ++log2;
  return log2;
}

// Capped grids (set_transfer_sm_limit) launch one block of this many threads per SM; the
// transfer kernels are bounded to it, so their registers always fit such a block.
constexpr int kCappedThreads = 1024;

struct Shape {
  int blocks;
  int threads;
};

// The launch shape of a transfer kernel over `items` rows (see Grid); the kernels stride over
// whatever the grid does not cover.
Shape shape_for(int64_t items, int team_log2, Grid grid) {
  const int threads = grid.capped ? kCappedThreads : kThreads;
  const int64_t items_per_block = threads >> team_log2;
  const int64_t needed = (items + items_per_block - 1) / items_per_block;
  // Up to 16 blocks per SM (two waves at 256 threads), but 8 (one wave) for fewer than 32 k
  // rows x tables: a second wave helps large transfers keep the link busy and costs small
  // ones more than it gives. See docs/decisions.md, "Launch shape".
  const int64_t per_sm = items < 32768 ? 8 : 16;
  const int64_t most = grid.capped ? grid.sms : int64_t{grid.sms} * per_sm;
  return {static_cast<int>(std::max<int64_t>(1, std::min(needed, most))), threads};
}

// Calls go(V{}) with the widest access V (up to 16 bytes, by_word) that divides every table's
// row size, strides and base addresses.
template <typename Go>
cudaError_t by_vector_width(const Tables& t, const Go& go) {
  uintptr_t align = 0;
  for (int k = 0; k < t.count; ++k) {
    align |= reinterpret_cast<uintptr_t>(t.dst[k]) | reinterpret_cast<uintptr_t>(t.src[k]) |
             static_cast<uintptr_t>(t.row_bytes[k]) | static_cast<uintptr_t>(t.dst_stride[k]) |
             static_cast<uintptr_t>(t.src_stride[k]);
  }
  return by_word(align, go);
}

// The team size for the widest table of a launch.
template <typename V>
int team_log2_of(const Tables& t) {
  int64_t widest = 0;
  for (int k = 0; k < t.count; ++k) widest = std::max(widest, t.row_bytes[k]);
  return team_log2_for(widest / static_cast<int64_t>(sizeof(V)));
}

// For sorted ids: the end of the run of equal values that starts at j, or -1 when j is not the
// first position of its run (the team of the first position handles the run).
__device__ __forceinline__ int64_t run_end(const int64_t* __restrict__ sorted, int64_t n,
                                           int64_t j) {
  const int64_t row = sorted[j];
  if (j > 0 && sorted[j - 1] == row) return -1;
  int64_t end = j + 1;
  while (end < n && sorted[end] == row) ++end;
  return end;
}

// n, or min(n, *limit) when the length is known only on the device (negative: none).
__device__ __forceinline__ int64_t limited(int64_t n, const int64_t* __restrict__ limit) {
  return limit == nullptr ? n : max(int64_t{0}, min(n, *limit));
}

// Fills the deferred record unless it holds a bad index not yet reported (see Deferred). The
// fields are visible to the host before `recorded` changes.
__device__ void record_deferred(const Deferred& d, int64_t pos, int64_t value, int64_t rows) {
  volatile int64_t* r = d.record;
  auto reported = static_cast<unsigned long long>(r[1]);
  while (atomicCAS(d.claim, reported, reported + 1) != reported) {
    // Either a record is waiting for the host (keep it), or the host reported one since
    // `reported` was read: read again and claim the next.
    const auto now = static_cast<unsigned long long>(r[1]);
    if (now == reported) return;
    reported = now;
  }
  r[2] = d.code;
  r[3] = pos;
  r[4] = value;
  r[5] = rows;
  __threadfence_system();
  r[0] = static_cast<int64_t>(reported + 1);
}

// Whether index value v (at position i) is in [0, rows); when not, flags it in status (the first
// bad position found wins) and records it in `deferred` when that is given.
__device__ __forceinline__ bool in_range_or_flag(int64_t v, int64_t i, int64_t rows, int arg,
                                                 int64_t* __restrict__ status,
                                                 const Deferred& deferred) {
  if (v >= 0 && v < rows) return true;
  auto* flag = reinterpret_cast<unsigned long long*>(status);
  if (atomicCAS(flag, 0ull, 1ull) == 0ull) {
    status[1] = arg;
    status[2] = i;
    status[3] = v;
    if (deferred.claim != nullptr) record_deferred(deferred, i, v, rows);
  }
  return false;
}

__global__ void validate_kernel(const int64_t* __restrict__ idx, int64_t n, int64_t rows,
                                int arg, int64_t* __restrict__ status,
                                const int64_t* __restrict__ limit, Deferred deferred) {
  n = limited(n, limit);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (!in_range_or_flag(idx[i], i, rows, arg, status, deferred)) return;
  }
}

// Work item i of a transfer kernel: its position (returned) and its table k (see for_each_item).
__device__ __forceinline__ int64_t position_of(int64_t i, int count, bool row_major, int64_t n,
                                               int& k) {
  if (count == 1) {  // no division for one table
    k = 0;
    return i;
  }
  if (row_major) {
    const int64_t j = i / count;
    k = static_cast<int>(i - j * count);
    return j;
  }
  k = static_cast<int>(i / n);
  return i - k * n;
}

// Calls item(k, j, lane, team) for every work item of a transfer kernel: item i is (table k,
// position j) = (i / n, i % n), one team of `team` threads per item. One table at a time in
// index order, so the reads of a host table stay within that table's span (reads spread over
// several tables' spans moved fewer bytes: see docs/decisions.md, "One table at a time"). With
// row_major, (i % count, i / count): the parts of a wide row together.
// Nothing runs when the validation found a bad index (write nothing).
template <typename Item>
__device__ __forceinline__ void for_each_item(int count, bool row_major, int64_t n,
                                              int team_log2, const int64_t* __restrict__ status,
                                              const Item& item) {
  if (status[0] != 0) return;
  const int lane = threadIdx.x & ((1 << team_log2) - 1);
  const int64_t teams_per_block = blockDim.x >> team_log2;
  const int64_t stride = gridDim.x * teams_per_block;
  const int64_t items = n * count;
  for (int64_t i = blockIdx.x * teams_per_block + (threadIdx.x >> team_log2); i < items;
       i += stride) {
    int k = 0;
    const int64_t j = position_of(i, count, row_major, n, k);
    item(k, j, lane, 1 << team_log2);
  }
}

// Copies a row's `row_vecs` vectors, a team's lanes striding over them: up to kInFlight loads
// per lane are issued before their stores, so a lane keeps several PCIe reads of a host row in
// flight instead of one (the compiler cannot reorder a load past a store that may alias it).
// That lets fewer SMs reach the same rate, leaving the others to kernels running beside it.
constexpr int kInFlight = 4;

template <typename V, typename Store>
__device__ __forceinline__ void copy_row(const V* __restrict__ from, int64_t row_vecs, int lane,
                                         int team, const Store& store) {
  for (int64_t c0 = lane; c0 < row_vecs; c0 += int64_t{team} * kInFlight) {
    V v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t c = c0 + int64_t{u} * team;
      if (c < row_vecs) v[u] = from[c];
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t c = c0 + int64_t{u} * team;
      if (c < row_vecs) store(c, v[u]);
    }
  }
}

// Whether position j of a copy writes its row (no later position of the same destination row
// does: last_of_run, last_of), and then its destination and source rows.
__device__ __forceinline__ bool writes_row(const int64_t* __restrict__ dst_idx,
                                           const int64_t* __restrict__ src_idx, int64_t n,
                                           int64_t j, bool last_of_run, LastOf last_of,
                                           int64_t& d, int64_t& s) {
  if (last_of_run && j + 1 < n && dst_idx[j + 1] == dst_idx[j]) return false;
  if (last_of.last != nullptr && last_of.last[dst_idx[j]] != j + 1) return false;
  if (last_of.words != nullptr &&
      static_cast<uint32_t>(last_of.words[last_of.entry[j]]) != static_cast<uint32_t>(j + 1)) {
    return false;
  }
  d = dst_idx ? dst_idx[j] : j;
  s = src_idx ? src_idx[j] : j;
  return true;
}

// Rows a team copies at once in copy_rows_kernel: one vector of each before any store, so a
// lane keeps several reads in flight even when a row is a single vector per lane (teams of
// fewer than 8 lanes have 32 items a warp to share, so fewer than this each).
constexpr int kRowsAtOnce = 4;

// The copy kernel works warp by warp on 32 work items at a time (see for_each_item for what
// an item is): each lane first resolves one item (its index entries and whether it writes: one
// round of dependent loads for all 32, where a team resolving its own item would wait for them
// before every row), then the warp's teams copy their items kRowsAtOnce at a time, taking each
// item's rows from the lane that resolved it.
template <typename V>
__device__ __forceinline__ void copy_items_by_warps(const Tables& t,
                                                    const int64_t* __restrict__ dst_idx,
                                                    const int64_t* __restrict__ src_idx,
                                                    int64_t n, int team_log2, bool last_of_run,
                                                    LastOf last_of) {
  const int lane = threadIdx.x & 31;
  const int team = 1 << team_log2;
  const int team_lane = lane & (team - 1);
  const int team_id = lane >> team_log2;
  const int teams = 32 >> team_log2;
  const int64_t items = n * t.count;
  // Team g of the grid's G takes items g, g + G, g + 2G, ... as it would copying one at a time,
  // so the teams at work hold about G consecutive items (rows in address order when the index
  // is sorted: on a multi-GiB host table, rows far apart in flight at once cost the GPU's
  // address translation). Lane l resolves the warp's (l / teams)-th item of team l % teams.
  const int64_t grid_teams = ((int64_t{gridDim.x} * blockDim.x) >> 5) * teams;
  const int64_t first_team = ((int64_t{blockIdx.x} * blockDim.x + threadIdx.x) >> 5) * teams;
  const int64_t per_round = grid_teams * (32 / teams);
  for (int64_t base = first_team; base < items; base += per_round) {
    // This lane's item: table k, destination row d (-1: nothing to write), source row s.
    const int64_t i = base + (lane / teams) * grid_teams + (lane & (teams - 1));
    int k = 0;
    int64_t d = -1, s = 0;
    if (i < items) {
      const int64_t j = position_of(i, t.count, t.row_major, n, k);
      if (!writes_row(dst_idx, src_idx, n, j, last_of_run, last_of, d, s)) d = -1;
    }
    for (int first = 0; first < 32; first += teams * kRowsAtOnce) {
      const V* from[kRowsAtOnce];
      V* to[kRowsAtOnce];
      int64_t vecs[kRowsAtOnce];
      int64_t most = 0;
#pragma unroll
      for (int u = 0; u < kRowsAtOnce; ++u) {
        const int owner = first + u * teams + team_id;  // past 31 when teams * rows > 32
        const int64_t du = __shfl_sync(0xffffffffu, d, owner & 31);
        const int64_t su = __shfl_sync(0xffffffffu, s, owner & 31);
        const int ku = __shfl_sync(0xffffffffu, k, owner & 31);
        const bool writes = owner < 32 && du >= 0;
        vecs[u] = writes ? t.row_bytes[ku] / static_cast<int64_t>(sizeof(V)) : 0;
        from[u] = reinterpret_cast<const V*>(t.src[ku] + (writes ? su : 0) * t.src_stride[ku]);
        to[u] = reinterpret_cast<V*>(t.dst[ku] + (writes ? du : 0) * t.dst_stride[ku]);
        most = max(most, vecs[u]);
      }
      for (int64_t c = team_lane; c < most; c += team) {
        V v[kRowsAtOnce];
#pragma unroll
        for (int u = 0; u < kRowsAtOnce; ++u) {
          if (c < vecs[u]) v[u] = from[u][c];
        }
#pragma unroll
        for (int u = 0; u < kRowsAtOnce; ++u) {
          if (c < vecs[u]) to[u][c] = v[u];
        }
      }
    }
  }
}

template <typename V>
__global__ void __launch_bounds__(kCappedThreads)
    copy_rows_kernel(Tables t, const int64_t* __restrict__ dst_idx,
                     const int64_t* __restrict__ src_idx, int64_t n, int team_log2,
                     bool last_of_run, LastOf last_of,
                     const int64_t* __restrict__ status, const int64_t* __restrict__ limit) {
  n = limited(n, limit);
  if (status[0] != 0) return;  // a bad index: write nothing
  copy_items_by_warps<V>(t, dst_idx, src_idx, n, team_log2, last_of_run, last_of);
}

// The copy kernel of capped launches (a transfer on a side stream beside training kernels,
// set_transfer_sm_limit or a call's sms): a team resolves its own item before each row, one
// row in flight per team. The callers' SM caps were tuned with it; the warp kernel above in
// their place moved more bytes per SM and slowed the training step around it (see
// docs/decisions.md, "Capped launches copy row by row").
template <typename V>
__global__ void __launch_bounds__(kCappedThreads)
    copy_rows_team_kernel(Tables t, const int64_t* __restrict__ dst_idx,
                          const int64_t* __restrict__ src_idx, int64_t n, int team_log2,
                          bool last_of_run, LastOf last_of,
                          const int64_t* __restrict__ status,
                          const int64_t* __restrict__ limit) {
  n = limited(n, limit);
  for_each_item(t.count, t.row_major, n, team_log2, status,
                [&](int k, int64_t j, int lane, int team) {
    int64_t d = 0, s = 0;
    if (!writes_row(dst_idx, src_idx, n, j, last_of_run, last_of, d, s)) return;
    const int64_t row_vecs = t.row_bytes[k] / static_cast<int64_t>(sizeof(V));
    const V* from = reinterpret_cast<const V*>(t.src[k] + s * t.src_stride[k]);
    V* to = reinterpret_cast<V*>(t.dst[k] + d * t.dst_stride[k]);
    copy_row(from, row_vecs, lane, team, [&](int64_t c, const V& v) { to[c] = v; });
  });
}

// Gather in sorted order, each distinct row read once: sorted[j] holds the rows in ascending
// order and perm[j] the output slot of each. The first position of a run reads the row (over
// PCIe for a mapped host table) and writes it to every slot of the run.
template <typename V>
__global__ void __launch_bounds__(kCappedThreads)
    gather_sorted_kernel(Tables t, const int64_t* __restrict__ sorted,
                         const int64_t* __restrict__ perm, int64_t n, int team_log2,
                         const int64_t* __restrict__ status, const int64_t* __restrict__ limit) {
  n = limited(n, limit);
  for_each_item(t.count, t.row_major, n, team_log2, status,
                [&](int k, int64_t j, int lane, int team) {
    const int64_t end = run_end(sorted, n, j);
    if (end < 0) return;
    const int64_t row_vecs = t.row_bytes[k] / static_cast<int64_t>(sizeof(V));
    const V* from = reinterpret_cast<const V*>(t.src[k] + sorted[j] * t.src_stride[k]);
    char* to = t.dst[k];
    const int64_t stride = t.dst_stride[k];
    copy_row(from, row_vecs, lane, team, [&](int64_t c, const V& value) {
      for (int64_t r = j; r < end; ++r) reinterpret_cast<V*>(to + perm[r] * stride)[c] = value;
    });
  });
}

// Where launch_mark_last and the fused scatter mark each row's last position: one counter per
// table row (last), or a hash (`cap` words, then one entry per position).
struct Marks {
  int32_t* last = nullptr;
  unsigned long long* words = nullptr;
  int32_t* entry = nullptr;
  int64_t cap = 0;

  // What the copy reads of them.
  __host__ __device__ LastOf read() const { return {last, words, entry}; }
};

// Finds or claims the entry of `row` in an open-addressing hash of `cap` words (a power of
// two, at least 4n, zeroed = free; see LastOf) for position i, raises the word's low half to
// i + 1 and notes the entry in entry[i]. One word per entry, its row in the high half, so a
// claim and a raise are one atomic each, and most positions need only the claim; at a quarter
// full a warp's 32 positions rarely probe far (a warp waits for its longest probe sequence,
// which two 8 + 4 B arrays at half load made long: see docs/decisions.md, "Last-position
// marks").
__device__ __forceinline__ void mark_in_hash(int64_t row, int64_t i,
                                             unsigned long long* __restrict__ words, int64_t cap,
                                             int32_t* __restrict__ entry) {
  const unsigned long long key = static_cast<unsigned long long>(row) + 1;  // below 2^32
  const unsigned long long mine = key << 32 | static_cast<unsigned long long>(i + 1);
  // Fibonacci hashing: consecutive rows land far apart.
  uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> 20;
  for (;; ++h) {
    h &= static_cast<uint64_t>(cap - 1);
    const unsigned long long seen = atomicCAS(words + h, 0ull, mine);
    if (seen == 0ull) break;
    if (seen >> 32 == key) {  // the row's entry: the same high half, so the larger word wins
      if (seen < mine) atomicMax(words + h, mine);
      break;
    }
  }
  entry[i] = static_cast<int32_t>(h);
}

// Marks position i of row `row` in `m` (counters or hash).
__device__ __forceinline__ void mark(const Marks& m, int64_t row, int64_t i) {
  if (m.words != nullptr) {
    mark_in_hash(row, i, m.words, m.cap, m.entry);
  } else {
    atomicMax(m.last + row, static_cast<int32_t>(i + 1));
  }
}

// Marks each position i of idx in `m`. Runs after validation: with a bad index it does nothing
// (nor does the copy that reads the marks).
__global__ void mark_last_kernel(const int64_t* __restrict__ idx, int64_t n, Marks m,
                                 const int64_t* __restrict__ status) {
  if (status[0] != 0) return;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    mark(m, idx[i], i);
  }
}

// A whole scatter by one index in one cooperative launch (every block resident, grid-wide
// barriers between the phases), where the separate path queues a status memset, a validation
// kernel, a scratch memset, a marking kernel and the copy: on tables in device memory such a
// call is bound by the host's time to queue them. Phases: (1) zero the status and the scratch
// the marking reads: with one counter per table row only the counters of the index's rows
// (the rest is never read), with a hash all of it; (2) check every index value (a bad one is
// flagged and not marked) and mark each row's last position; (3) unless a value was bad, copy
// the rows whose position is their row's last, as copy_rows_kernel does.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    scatter_fused_kernel(Tables t, const int64_t* __restrict__ idx, int64_t n, int64_t rows,
                         int team_log2, int arg, Marks marks, int64_t* __restrict__ status,
                         Deferred deferred) {
  const cg::grid_group grid = cg::this_grid();
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  if (first < kStatusWords) status[first] = 0;
  if (marks.words != nullptr) {
    for (int64_t h = first; h < marks.cap; h += stride) marks.words[h] = 0;
  } else {
    for (int64_t i = first; i < n; i += stride) {
      const int64_t v = idx[i];
      if (v >= 0 && v < rows) marks.last[v] = 0;
    }
  }
  grid.sync();
  for (int64_t i = first; i < n; i += stride) {
    const int64_t v = idx[i];
    if (in_range_or_flag(v, i, rows, arg, status, deferred)) mark(marks, v, i);
  }
  grid.sync();
  if (*static_cast<volatile int64_t*>(status) != 0) return;  // a bad index: write nothing
  copy_items_by_warps<V>(t, idx, nullptr, n, team_log2, /*last_of_run=*/false,
                         marks.read());
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
__global__ void __launch_bounds__(kCappedThreads)
    accumulate_rows_kernel(T* __restrict__ table, const int64_t* __restrict__ sorted,
                           const T* __restrict__ src, const int64_t* __restrict__ perm, int64_t n,
                           int64_t row_elems, int team_log2,
                           const int64_t* __restrict__ status) {
  for_each_item(1, false, n, team_log2, status, [&](int, int64_t j, int lane, int team) {
    const int64_t end = run_end(sorted, n, j);  // only the first of a run works
    if (end < 0) return;
    T* to = table + sorted[j] * row_elems;
    for (int64_t c = lane; c < row_elems; c += team) {
      T acc = to[c];
      for (int64_t r = j; r < end; ++r) acc = add(acc, src[perm[r] * row_elems + c]);
      to[c] = acc;
    }
  });
}

}  // namespace

cudaError_t launch_validate(const int64_t* idx, int64_t n, int64_t rows, int arg,
                            int64_t* status, cudaStream_t stream, const int64_t* limit,
                            Deferred deferred) {
  validate_kernel<<<blocks_for_elements(n), kThreads, 0, stream>>>(idx, n, rows, arg, status,
                                                                   limit, deferred);
  return cudaGetLastError();
}

cudaError_t sort_pairs(void* temp, size_t* temp_bytes, const int64_t* keys_in, int64_t* keys_out,
                       const int64_t* values_in, int64_t* values_out, int64_t n, int bits,
                       cudaStream_t stream) {
  if (n > INT32_MAX) return cudaErrorInvalidValue;
  // The keys' bits as unsigned: the same order for the non-negative keys sorted here (a negative
  // one is a bad index, whose call moves nothing, so its place does not matter).
  return cub::DeviceRadixSort::SortPairs(
      temp, *temp_bytes, reinterpret_cast<const uint64_t*>(keys_in),
      reinterpret_cast<uint64_t*>(keys_out), values_in, values_out, static_cast<int>(n), 0, bits,
      stream);
}

cudaError_t launch_copy_rows(const Tables& t, const int64_t* dst_idx, const int64_t* src_idx,
                             int64_t n, bool last_of_run, LastOf last_of,
                             const int64_t* status, Grid grid, cudaStream_t stream,
                             const int64_t* limit) {
  // both filters read the destination rows
  if ((last_of_run || last_of.last != nullptr || last_of.words != nullptr) &&
      dst_idx == nullptr) {
    return cudaErrorInvalidValue;
  }
  return by_vector_width(t, [&](auto vec) {
    using V = decltype(vec);
    const int team_log2 = team_log2_of<V>(t);
    if (grid.capped) {  // one row per team: see copy_rows_team_kernel
      const Shape shape = shape_for(n * t.count, team_log2, grid);
      copy_rows_team_kernel<V><<<shape.blocks, shape.threads, 0, stream>>>(
          t, dst_idx, src_idx, n, team_log2, last_of_run, last_of, status, limit);
      return cudaGetLastError();
    }
    // A warp takes 32 items a round, whatever its teams: for 512 B rows a warp has four rows
    // in flight and a grid of 131 k items 16 k rows, plenty for device memory and PCIe. A grid
    // sized for every row in flight at once (more warps, most of their rounds empty) was no
    // faster over PCIe and slower on CUDA tables (see docs/decisions.md, "The warp copy
    // kernel's grid").
    const Shape shape = shape_for(n * t.count, 0, grid);
    copy_rows_kernel<V><<<shape.blocks, shape.threads, 0, stream>>>(
        t, dst_idx, src_idx, n, team_log2, last_of_run, last_of, status, limit);
    return cudaGetLastError();
  });
}

static int64_t last_of_entries(int64_t n) {
  int64_t cap = 1;
  while (cap < 4 * n) cap <<= 1;
  return cap;
}

// One counter per row while the table has at most this many rows per hash entry (a memset of
// at most 32 B per entry where the hash's is 8 B): an atomicMax per position on per-row
// counters, and zeroing them, take less than probing the hash. See docs/decisions.md, "Per-row
// counters".
constexpr int64_t kDirectRowsPerEntry = 8;
// ... and at most this many rows (64 MiB of counters), so a huge index beside a huge table
// does not zero gigabytes.
constexpr int64_t kDirectMaxRows = int64_t{1} << 24;

static bool direct_marks(int64_t n, int64_t rows) {
  return rows <= kDirectRowsPerEntry * last_of_entries(n) && rows <= kDirectMaxRows;
}

int64_t last_of_bytes(int64_t n, int64_t rows) {
  if (direct_marks(n, rows)) return rows * int64_t{sizeof(int32_t)};
  return last_of_entries(n) * int64_t{sizeof(unsigned long long)} +
         n * int64_t{sizeof(int32_t)};
}

// The marks for n positions below `rows` in `scratch` (last_of_bytes(n, rows)).
static Marks marks_in(void* scratch, int64_t n, int64_t rows) {
  if (direct_marks(n, rows)) return Marks{static_cast<int32_t*>(scratch)};
  Marks m;
  m.cap = last_of_entries(n);
  m.words = static_cast<unsigned long long*>(scratch);
  m.entry = reinterpret_cast<int32_t*>(m.words + m.cap);
  return m;
}

bool can_mark_last(int64_t n, int64_t rows) {
  return n <= kLastOfMaxRows && rows <= kLastOfMaxTableRows;
}

cudaError_t launch_mark_last(const int64_t* idx, int64_t n, int64_t rows, void* scratch,
                             const int64_t* status, cudaStream_t stream, LastOf* last_of) {
  const Marks m = marks_in(scratch, n, rows);
  *last_of = m.read();
  // The counters, or the hash's words, need zeros; entry[] is written for every position.
  const size_t zeroed = m.words != nullptr ? m.cap * sizeof(*m.words) : rows * sizeof(*m.last);
  cudaError_t err = cudaMemsetAsync(scratch, 0, zeroed, stream);
  if (err != cudaSuccess) return err;
  mark_last_kernel<<<blocks_for_elements(n), kThreads, 0, stream>>>(idx, n, m, status);
  return cudaGetLastError();
}

// A constant of a device found once per process: find() (nonzero) on the first call for
// `device`, its value after; 0 for a device past the table. Each caller keeps its own table.
constexpr int kMaxDevices = 64;
template <typename Find>
int once_per_device(std::atomic<int> (&known)[kMaxDevices], int device, const Find& find) {
  if (device < 0 || device >= kMaxDevices) return 0;
  int value = known[device].load();
  if (value == 0) {
    value = find();
    known[device].store(value);
  }
  return value;
}

// The blocks of scatter_fused_kernel<V> one SM holds at once (a cooperative grid must not have
// more), found once: the occupancy query would otherwise cost every call host time, the very
// thing the kernel saves. -1: none (the query failed).
template <typename V>
int fused_blocks_per_sm(int device) {
  static std::atomic<int> known[kMaxDevices] = {};
  return once_per_device(known, device, [] {
    int blocks = 0;
    const bool ok = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                        &blocks, scatter_fused_kernel<V>, kThreads, 0) == cudaSuccess;
    (void)cudaGetLastError();
    return ok && blocks > 0 ? blocks : -1;
  });
}

bool fused_scatter_supported(int device) {
  static std::atomic<int> known[kMaxDevices] = {};
  return once_per_device(known, device, [device] {
    int attr = 0;
    const bool ok = cudaDeviceGetAttribute(&attr, cudaDevAttrCooperativeLaunch, device) ==
                    cudaSuccess;
    (void)cudaGetLastError();
    return ok && attr != 0 ? 1 : -1;
  }) == 1;
}

namespace {
std::atomic<int> g_fused_extra_blocks{0};  // the test hook (set_fused_extra_blocks)
}  // namespace

int set_fused_extra_blocks(int blocks) { return g_fused_extra_blocks.exchange(blocks); }

cudaError_t launch_scatter_fused(const Tables& t, const int64_t* idx, int64_t n, int64_t rows,
                                 int arg, void* scratch, int64_t* status, Deferred deferred,
                                 int device, int sms, cudaStream_t stream) {
  if (n <= 0 || !can_mark_last(n, rows)) return cudaErrorInvalidValue;
  return by_vector_width(t, [&](auto vec) {
    using V = decltype(vec);
    const int per_sm = fused_blocks_per_sm<V>(device);
    if (per_sm <= 0) return cudaErrorNotSupported;
    int team_log2 = team_log2_of<V>(t);
    // One thread per position in the marking phases, one per item in the copy (a warp takes
    // 32 items a round); never more blocks than the device holds at once.
    int blocks = std::min(blocks_for_elements(n * t.count), per_sm * sms);
    const int extra = g_fused_extra_blocks.load(std::memory_order_relaxed);
    if (extra > 0) blocks = per_sm * sms + extra;
    Marks marks = marks_in(scratch, n, rows);
    Tables tables = t;
    void* args[] = {&tables, &idx, &n, &rows, &team_log2, &arg, &marks, &status, &deferred};
    return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(scatter_fused_kernel<V>), blocks,
                                       kThreads, args, 0, stream);
  });
}

cudaError_t launch_gather_sorted(const Tables& t, const int64_t* sorted, const int64_t* perm,
                                 int64_t n, const int64_t* status, Grid grid,
                                 cudaStream_t stream, const int64_t* limit) {
  return by_vector_width(t, [&](auto vec) {
    using V = decltype(vec);
    const int team_log2 = team_log2_of<V>(t);
    const Shape shape = shape_for(n * t.count, team_log2, grid);
    gather_sorted_kernel<V><<<shape.blocks, shape.threads, 0, stream>>>(
        t, sorted, perm, n, team_log2, status, limit);
    return cudaGetLastError();
  });
}

cudaError_t launch_accumulate_rows(char* table, const int64_t* sorted, const char* src,
                                   const int64_t* perm, int64_t n, int64_t row_elems, Elem elem,
                                   const int64_t* status, Grid grid, cudaStream_t stream) {
  const auto go = [&](auto zero) {
    using T = decltype(zero);
    const int team_log2 = team_log2_for(row_elems);
    const Shape shape = shape_for(n, team_log2, grid);
    accumulate_rows_kernel<T><<<shape.blocks, shape.threads, 0, stream>>>(
        reinterpret_cast<T*>(table), sorted, reinterpret_cast<const T*>(src), perm, n, row_elems,
        team_log2, status);
    return cudaGetLastError();
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

}  // namespace speedtorch_ops::kernels
