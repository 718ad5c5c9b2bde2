// The row cache's device ops: their argument checks, shared by the CPU and CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace speedtorch_ops {

// registration.cpp has each op's contract. _sort_ids and _distinct: keys 1-D int64, contiguous;
// bound >= 1.
void check_sort_ids_args(const at::Tensor& keys, const char* name, int64_t bound);
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
// overlapping; index 1-D int64 with at most as many entries as the positions' tensor has rows
// (out's for take, src's for put), on their device; count one int64 there; dst overlapping
// none of the others.
void check_move_rows_args(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
                          const at::Tensor& count, bool take);
// _age_frequencies: freq 1-D float32, age one int64, both contiguous on one device; period >= 1.
void check_age_args(const at::Tensor& freq, const at::Tensor& age, int64_t period);

}  // namespace speedtorch_ops
