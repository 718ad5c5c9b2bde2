// Launchers of the row copy kernels. Plain C++ types only, so kernels.cu stays free of torch
// headers (nvcc is slow; the torch-facing code is built by the host compiler). Each launcher
// returns cudaGetLastError() of its launch; callers check it with C10_CUDA_CHECK.
#pragma once

#include "common/kernel_types.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace speedtorch_ops::kernels {

// status: 4 int64 on the device, zeroed per call: {bad, argument id, position, value}.
// Transfer kernels read status[0] first and write nothing when an index was bad.
constexpr int kStatusWords = 4;

// Up to kMaxTables tables moved by one launch with the same indices (a weight and its optimizer
// state): table k copies rows of row_bytes[k] bytes from src[k] to dst[k], row r starting
// r * src_stride[k] (dst_stride[k]) bytes from the base. Pointers are device-visible addresses
// (device memory, or mapped pinned host memory). Work items go table by table (each table's
// reads stay within its span), or with row_major row by row: the tables are then parts of one
// wide host row (a weight and its state side by side), read together.
constexpr int kMaxTables = 8;
struct Tables {
  char* dst[kMaxTables];
  const char* src[kMaxTables];
  int64_t row_bytes[kMaxTables];
  int64_t dst_stride[kMaxTables];
  int64_t src_stride[kMaxTables];
  int count;
  bool row_major;

  // Table k: rows of row_bytes from src to dst, rows `stride` bytes apart (0: row_bytes).
  void set(int k, char* to, const char* from, int64_t bytes, int64_t to_stride = 0,
           int64_t from_stride = 0) {
    dst[k] = to;
    src[k] = from;
    row_bytes[k] = bytes;
    dst_stride[k] = to_stride > 0 ? to_stride : bytes;
    src_stride[k] = from_stride > 0 ? from_stride : bytes;
  }
};

// How many SMs the transfer kernels may use. sms: the device's SM count, or the cap set with
// set_transfer_sm_limit. capped: one 1024-thread block per allowed SM, so at most `sms` SMs
// carry transfer traffic while training kernels use the rest; uncapped: enough 256-thread
// blocks to fill every SM several times over.
struct Grid {
  int sms;
  bool capped;
};

// limit (or nullptr): one int64 on the device; the launchers that take it treat n as
// min(n, *limit), a length known only on the device (read by the kernels, never by the host).

// The deferred record of bad indices on one device (deferred.h): claim, one word in device
// memory, counts the records claimed; record, kRecordWords int64 in mapped pinned host memory:
// {recorded, reported, name code, position, value, rows}. A validation kernel that finds a bad
// index claims the record only when claim == reported (everything recorded so far was reported),
// writes the fields, then recorded = reported + 1; the host reports it and sets reported.
// claim == nullptr: nothing is recorded.
constexpr int kRecordWords = 6;
struct Deferred {
  unsigned long long* claim = nullptr;
  int64_t* record = nullptr;
  int code = 0;  // the name of the index the launch validates
};

// Flags any idx[i] outside [0, rows) in status (one bad position is reported), and records it in
// `deferred` when that is given.
cudaError_t launch_validate(const int64_t* idx, int64_t n, int64_t rows, int arg,
                            int64_t* status, cudaStream_t stream, const int64_t* limit = nullptr,
                            Deferred deferred = {});

// Sorts n (key, value) pairs by the keys' low `bits` bits, stably (cub's radix sort: a pass per
// 8 bits, so keys below 2^20 take 3 passes instead of the 8 of a full 64-bit sort). With
// temp == nullptr only sets *temp_bytes, the scratch the sort needs. n < 2^31.
cudaError_t sort_pairs(void* temp, size_t* temp_bytes, const int64_t* keys_in, int64_t* keys_out,
                       const int64_t* values_in, int64_t* values_out, int64_t n, int bits,
                       cudaStream_t stream);

// The last position of each distinct row of an index, found without a sort (launch_mark_last):
// with one counter per table row, position j is its row's last when last[dst row of j] ==
// j + 1; with a hash, when the low half of words[entry[j]] is j + 1 (its high half holds the
// row + 1). Both nullptr: no such filter.
struct LastOf {
  const int32_t* last = nullptr;
  const unsigned long long* words = nullptr;
  const int32_t* entry = nullptr;
};

// For j in [0, n) and every table: dst row (dst_idx ? dst_idx[j] : j) = src row
// (src_idx ? src_idx[j] : j). last_of_run: dst_idx is sorted (stably) and j is skipped when
// dst_idx[j + 1] == dst_idx[j], so the last duplicate in the caller's order wins. last_of: j is
// skipped unless it is its dst row's last position (dst_idx as marked by launch_mark_last).
cudaError_t launch_copy_rows(const Tables& t, const int64_t* dst_idx, const int64_t* src_idx,
                             int64_t n, bool last_of_run, LastOf last_of,
                             const int64_t* status, Grid grid, cudaStream_t stream,
                             const int64_t* limit = nullptr);

// @brief Device scratch bytes launch_mark_last needs for an index of n positions whose values
// are below `rows`: one counter per row when there are few enough rows that zeroing them costs
// less than a hash's extra work, else a hash of 4n to 8n words (8 B) plus one int32 per
// position (independent of the table's size).
int64_t last_of_bytes(int64_t n, int64_t rows);

// The most positions launch_mark_last takes (its counters and hash entries are int32, and a
// hash has 4 to 8 entries a position) and the most table rows (a hash word holds row + 1 in 32
// bits); can_mark_last(n, rows) says whether both hold. Longer indices or larger tables sort.
constexpr int64_t kLastOfMaxRows = int64_t{1} << 28;
constexpr int64_t kLastOfMaxTableRows = (int64_t{1} << 32) - 1;
bool can_mark_last(int64_t n, int64_t rows);

// Marks the last position of each distinct row of idx[0, n) (can_mark_last(n, rows), values
// below `rows`) in `scratch` (last_of_bytes(n, rows), any contents: zeroed here), so a scatter lets
// the last duplicate win without a sort; sets *last_of for launch_copy_rows. A memset and one
// kernel.
cudaError_t launch_mark_last(const int64_t* idx, int64_t n, int64_t rows, void* scratch,
                             const int64_t* status, cudaStream_t stream, LastOf* last_of);

// @brief Whether `device` runs cooperative launches (launch_scatter_fused needs them).
bool fused_scatter_supported(int device);

// @brief Test hook: while blocks > 0, launch_scatter_fused asks for that many blocks more than
// the device holds at once, so the runtime refuses the launch as it would on a device with
// fewer SMs free (e.g. an MPS client's share). Returns the previous value.
int set_fused_extra_blocks(int blocks);

// For every table: dst row idx[j] = src row j, the last position of a repeated row winning, in
// one cooperative launch on `device` (whose current grid has `sms` SMs) that also zeroes
// `status` (kStatusWords, the caller reads it after) and checks every idx[j] against `rows`
// like launch_validate (a bad one: nothing is written). It marks as launch_mark_last does, in
// `scratch` of last_of_bytes(n, rows) bytes, any contents (zeroing only the counters of the
// index's rows). 0 < n, can_mark_last(n, rows). cudaErrorCooperativeLaunchTooLarge or
// cudaErrorNotSupported (nothing queued): the device cannot run this grid at once (e.g. an MPS
// client's share of the SMs); the separate kernels can.
cudaError_t launch_scatter_fused(const Tables& t, const int64_t* idx, int64_t n, int64_t rows,
                                 int arg, void* scratch, int64_t* status, Deferred deferred,
                                 int device, int sms, cudaStream_t stream);

// For every table: dst row perm[j] = src row sorted[j] for j in [0, n), with `sorted` ascending:
// rows are read in address order and each distinct row once (a repeated row crosses PCIe once).
cudaError_t launch_gather_sorted(const Tables& t, const int64_t* sorted, const int64_t* perm,
                                 int64_t n, const int64_t* status, Grid grid,
                                 cudaStream_t stream, const int64_t* limit = nullptr);

// table[sorted[j]] += src[perm[j]] for runs of equal sorted values, each run added in order
// (sorted stably, so in the caller's index order): deterministic, like the CPU kernel.
cudaError_t launch_accumulate_rows(char* table, const int64_t* sorted, const char* src,
                                   const int64_t* perm, int64_t n, int64_t row_elems, Elem elem,
                                   const int64_t* status, Grid grid, cudaStream_t stream);

}  // namespace speedtorch_ops::kernels
