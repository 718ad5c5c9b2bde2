// Argument checks shared by the CPU and CUDA kernels of every op.
//
// Every op validates all of its arguments with these before the first byte moves, so a failing
// call leaves every table exactly as it was. Messages name the argument and say what to pass.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace speedtorch_ops {

// index: 1-D, int32 or int64. Its values are checked separately (check_index_values on the CPU,
// a device-side validation pass on CUDA) because reading them may need the device.
void check_index(const at::Tensor& index, const char* name);

// table: at least 1-D, contiguous (rows are addressed as base + row * row_bytes).
void check_table(const at::Tensor& table, const char* name);

// rows: shape (n, *table.shape[1:]), the table's dtype, on `device`.
void check_rows_like(const at::Tensor& rows, const char* name, const at::Tensor& table,
                     int64_t n, const c10::Device& device);

// The byte ranges of `a` and `b` must not overlap. Pointers are compared across devices too:
// under unified virtual addressing a CUDA view of mapped host memory has the host address.
void check_no_overlap(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                      const char* b_name);

// CPU index values in [0, rows): raises naming `name`, the first bad position and its value.
void check_index_values(const at::Tensor& index, int64_t rows, const char* name);

// Bytes of one row (product of the trailing dims times the element size).
int64_t row_bytes(const at::Tensor& table);

// How the CPU kernels split a pass over their items (rows to copy, index entries to check):
// a pass whose items' bytes come to less than serial_bytes() runs on the calling thread alone,
// a larger one is one parallel region. A region wakes every thread and joins them; for small
// passes that costs more than the threads save, and while another process keeps one core busy
// the join waits for that core's thread to be scheduled again, far longer than the pass.
// The threshold's choice: docs/decisions.md, "Serial CPU passes".
int64_t serial_bytes();
// Test hook (_set_cpu_serial_bytes): the threshold from now on (0: the default); returns the
// previous one. 1 makes every pass of more than one item parallel; a huge value, none.
int64_t set_serial_bytes(int64_t bytes);
// Whether `n` items of `item_bytes` each come to less than serial_bytes().
bool is_serial(int64_t n, int64_t item_bytes);
// at::parallel_for's grain for a pass over `n` items of `item_bytes` each: `n` itself (so the
// pass runs on the calling thread) when is_serial, else `parallel_grain`.
int64_t grain_for(int64_t n, int64_t item_bytes, int64_t parallel_grain);

// The ops' bounds_check argument. Every mode writes nothing for a bad index; they differ in
// whether and when a call raises for one.
//   kDeferred (the default): CUDA indices are checked on the device and the call does not wait;
//     a bad one is recorded in pinned host memory and raised by the next kDeferred or kRaise call
//     on that GPU (or by sync_bounds_check), so the host runs ahead of the GPU and the error
//     still reaches the user.
//   kRaise: a bad index raises in the failing call. CUDA indices are checked on the device and
//     the call waits for the current stream to read the result (not while a CUDA graph is being
//     captured: the call then reports like kDeferred).
//   kPrechecked: the caller validated the indices on the host. CUDA indices are still checked
//     on the device, so a bad one writes nothing, but nothing waits, records or raises (not even
//     another call's recorded index), and the call never takes a path that waits.
// Indices a call reads on the host (the CPU kernels, the hybrid path, a pageable table) are
// checked there in every mode and a bad one raises: that check costs no wait.
enum class BoundsCheck { kDeferred, kRaise, kPrechecked };

// The mode named by `mode`; anything else raises, naming bounds_check and the valid values.
BoundsCheck parse_bounds_check(c10::string_view mode);

// accumulate=True is defined for real and bool dtypes (the dtypes both devices' kernels add).
void check_accumulate_dtype(at::ScalarType dtype);

// Checks of pinned_gather_into on either device: table, index, out of shape (n, *row shape) in
// the table's dtype on `device`, contiguous, sharing no memory with table or index.
void check_gather_into_args(const at::Tensor& table, const at::Tensor& index,
                            const at::Tensor& out, const c10::Device& device);

// pinned_gather's result on either device, after checking table and index: rows of the table's
// shape and dtype, one per index, on index's device, not pinned.
at::Tensor gather_output(const at::Tensor& table, const at::Tensor& index);

// Checks of pinned_scatter on either device: table, index, src shaped like out above on
// `device`, sharing no memory with table; index sharing none with table; the accumulate dtype.
void check_scatter_args(const at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate, const c10::Device& device);

// The CPU cores of the ops, reused by optimizer_state_swap and by the C++ tests. They assume
// the checks above have passed; index is contiguous.
// for_device: out is staging that a copy engine reads next, not the CPU (streaming stores
// where the rows allow).
void gather_rows_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                     bool for_device = false);
void scatter_rows_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                      bool accumulate);
// The same into several tables by one index (tables[k][index[i]] = srcs[k][i]; the index
// bucketed once for all), with the srcs' rows arriving in chunks of `chunk` positions (or
// nullptr ready: all there): ready(c) returns once rows [c * chunk, (c + 1) * chunk) may be
// read. It is called from the CPU threads, each asking for rising chunks, so rows that have
// landed are written while the rest arrive.
using ChunkReady = std::function<void(int64_t)>;
void scatter_rows_cpu(const std::vector<at::Tensor>& tables, const at::Tensor& index,
                      const std::vector<at::Tensor>& srcs, bool accumulate, int64_t chunk,
                      const ChunkReady* ready);

// Kernels, named <op>_<device>, with the schema's signature.
at::Tensor pinned_gather_cpu(const at::Tensor& table, const at::Tensor& index,
                             c10::string_view bounds_check);
void pinned_gather_into_cpu(const at::Tensor& table, const at::Tensor& index, at::Tensor& out,
                            c10::string_view bounds_check);
void pinned_scatter_cpu(at::Tensor& table, const at::Tensor& index, const at::Tensor& src,
                        bool accumulate, c10::string_view bounds_check);
void optimizer_state_swap_cpu(at::TensorList stores, at::TensorList batch,
                              const std::optional<at::Tensor>& writeback_index,
                              const std::optional<at::Tensor>& load_index,
                              c10::string_view bounds_check);
void sorted_transfer_cpu(at::Tensor& table, at::TensorList parts, const at::Tensor& sorted_rows,
                         const at::Tensor& slots, bool load,
                         const std::optional<at::Tensor>& count, c10::string_view bounds_check,
                         int64_t sms);

// Checks shared by both devices' optimizer_state_swap: pairs, shapes, dtypes, aliasing.
void check_swap_args(at::TensorList stores, at::TensorList batch,
                     const std::optional<at::Tensor>& writeback_index,
                     const std::optional<at::Tensor>& load_index,
                     const c10::Device& batch_device);

// Checks shared by both devices' _sorted_transfer: table (rows, len(parts), ...), parts (at
// least one, each (m, ...) like a part of the table's rows, contiguous, all on one device), the
// two indices (n each, on the parts' device), count (one int64 there, optional), no aliasing,
// sms >= 0. Returns the parts' device.
c10::Device check_sorted_transfer_args(const at::Tensor& table, at::TensorList parts,
                                       const at::Tensor& sorted_rows, const at::Tensor& slots,
                                       const std::optional<at::Tensor>& count, int64_t sms);

// Checks of the planning ops (the row cache's step on the device; registration.cpp has their
// contracts), shared by both devices. _sort_ids and _distinct: keys 1-D int64, contiguous;
// bound >= 1.
void check_sort_ids_args(const at::Tensor& keys, const char* name, int64_t bound);
// Of a planning op's 1-D input: at most 2^31 - 1 entries (cub's item count), naming `name`.
void check_items(const at::Tensor& t, const char* name);
// _partition: flags 1-D bool, contiguous, at most 2^31 - 1 entries.
void check_partition_args(const at::Tensor& flags);
// _cache_lookup: ids 1-D int64; count one int64; slot_of 1-D int32; freq 1-D float32 as long
// as slot_of; all contiguous on one device; scratch >= 0.
void check_cache_lookup_args(const at::Tensor& ids, const at::Tensor& count,
                             const at::Tensor& slot_of, const at::Tensor& freq, int64_t scratch);
// _coldest_slots: id_of (at most 2^31 - 1 slots) and at 1-D int64, freq 1-D float32, all
// contiguous on one device; 0 <= k <= id_of's length.
void check_coldest_slots_args(const at::Tensor& id_of, const at::Tensor& freq,
                              const at::Tensor& at, int64_t k,
                              const c10::optional<at::Tensor>& hand = c10::nullopt,
                              int64_t window = 0);
// _admission: ids, first, victims 1-D int64, cold and freq 1-D float32, misses one int64,
// id_of 1-D int64; first, victims and cold of one length; all contiguous on one device.
void check_admission_args(const at::Tensor& ids, const at::Tensor& first,
                          const at::Tensor& victims, const at::Tensor& cold,
                          const at::Tensor& misses, const at::Tensor& freq,
                          const at::Tensor& id_of);
// _cache_admit: slot_of 1-D int32, id_of, ids, at, first, victims 1-D int64, admit 1-D bool;
// first, victims and admit of one length, at most at's; all contiguous on one device.
void check_cache_admit_args(const at::Tensor& slot_of, const at::Tensor& id_of,
                            const at::Tensor& ids, const at::Tensor& at, const at::Tensor& first,
                            const at::Tensor& victims, const at::Tensor& admit);
// _take_rows / _put_rows: dst (out) and src of one dtype, device, parts (dim 0) and row shape
// (dims 2 on), each row contiguous, rows (dim 1) any stride at least a row apart, parts not
// overlapping; index 1-D int64 with at
// most as many entries as the positions' tensor has rows (out's for take, src's for put), on
// their device; count one int64 there; dst overlapping none of the others.
void check_move_rows_args(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
                          const at::Tensor& count, bool take);
// _age_frequencies: freq 1-D float32, age one int64, both contiguous on one device; period >= 1.
void check_age_args(const at::Tensor& freq, const at::Tensor& age, int64_t period);

// _fused_row_update: buf (n, record) uint8, contiguous, its data aligned to its fields' widest
// element; grad (n, dim) contiguous floating (float32, float64, float16, bfloat16: the
// weights' dtype) on buf's device; state_dtype float32, bfloat16 or grad's (float64 weights:
// float64 only); fields the byte offsets of the weight (dim of grad's type), the row value
// (float32, float64 with float64 state; -1 for the rules without one) and the rule's
// per-element states (dim of state_dtype each), each aligned to its element size, inside the
// record (a multiple of each element size) and not overlapping; count one int64 on buf's
// device; rule a Rule; hyper 5 values; flags the Flag bits; step a float32/float64 scalar on
// the CPU or buf's device, required by the rules that count steps (Adagrad, Adam, AdamW,
// PartialRowWiseAdam); cache and at together or neither: cache (slots, record) uint8,
// contiguous, aligned as buf, on buf's device, at 1-D int64 there, neither overlapping buf;
// rounding 2 contiguous int64 on buf's device. Returns the rule.
// _round_into: dst floating (float32, float64, float16, bfloat16) and contiguous, src float32,
// contiguous, dst's shape and device, not overlapping dst; rounding 2 contiguous int64 on
// dst's device.
void check_round_into_args(const at::Tensor& dst, const at::Tensor& src,
                           const at::Tensor& rounding);

int64_t check_fused_update_args(const at::Tensor& buf, const at::Tensor& grad,
                                const at::Tensor& count, const c10::optional<at::Tensor>& step,
                                int64_t rule, c10::ArrayRef<double> hyper, int64_t flags,
                                c10::ArrayRef<int64_t> fields, at::ScalarType state_dtype,
                                const c10::optional<at::Tensor>& cache = c10::nullopt,
                                const c10::optional<at::Tensor>& at = c10::nullopt,
                                const c10::optional<at::Tensor>& rounding = c10::nullopt);

// _segment_sum: grads at least one (n_k, dim) tensor, each contiguous, of one floating dtype
// (float32, float64, float16, bfloat16), one dim and one device; perm 1-D int64 of sum(n_k)
// entries, starts 1-D int64 of at least 1, count one int64, all contiguous on grads' device;
// rows >= 0.
void check_segment_sum_args(at::TensorList grads, const at::Tensor& perm,
                            const at::Tensor& starts, const at::Tensor& count, int64_t rows);

// _gather_staged: rows (n, dim) floating (float32, float64, float16, bfloat16) with contiguous
// elements; index 1-D int64 contiguous; cache and at both or neither: cache (slots, dim) like
// rows (dtype, device, elements contiguous), at 1-D int64 contiguous of at least n entries.
void check_gather_staged_args(const at::Tensor& rows, const at::Tensor& index,
                            const c10::optional<at::Tensor>& cache,
                            const c10::optional<at::Tensor>& at);

// _peer_rows: rank_of, row_of and ptrs 1-D int64 contiguous on one device, rank_of and row_of of
// one length; offset >= 0, dim >= 0.
void check_peer_rows_args(const at::Tensor& ptrs, int64_t offset, const at::Tensor& rank_of,
                          const at::Tensor& row_of, int64_t dim);

}  // namespace speedtorch_ops
