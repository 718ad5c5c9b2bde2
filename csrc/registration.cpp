// The one TORCH_LIBRARY block: every schema of speedtorch_ops, with its contract in one line.
// Kernels register per dispatch key in each feature folder's *_cpu.cpp and *_cuda.cpp; fakes and
// autograd in ops.py.
#include <torch/library.h>

#include "common/parallel.h"

#ifdef SPEEDTORCH_OPS_WITH_CUDA
#include "copy/deferred.h"
#include "copy/launch.h"
#include "hybrid/tuner.h"
#endif

TORCH_LIBRARY(speedtorch_ops, m) {
  // The transfer ops pass opcheck (schema, fake, autograd registration, AOT dispatch) and are
  // CUDA-graph capturable (tests/ops/test_compile.py), so they carry the PT2-compliant tag.
  // Their keyword bounds_check is 'deferred', 'raise' or 'prechecked' (common/bounds_check.h
  // says what each does).
  const std::vector<at::Tag> pt2{at::Tag::pt2_compliant_tag};
  // out[i] = table[index[i]]; out lives on index's device (zero-copy read of a pinned host
  // table for a CUDA index).
  m.def("pinned_gather(Tensor table, Tensor index, *, str bounds_check='deferred') -> Tensor", pt2);
  // The same into a caller-provided tensor: allocates nothing (training loops, CUDA graphs).
  m.def("pinned_gather_into(Tensor table, Tensor index, Tensor(a!) out, *, "
        "str bounds_check='deferred') -> ()", pt2);
  // table[index[i]] = src[i] in place (+= with accumulate); the last duplicate wins without it.
  m.def("pinned_scatter(Tensor(a!) table, Tensor index, Tensor src, bool accumulate=False, *, "
        "str bounds_check='deferred') -> ()", pt2);
  // For every pair k: write batch[k] to stores[k][writeback_index], then load
  // stores[k][load_index] into batch[k]. Either index may be None.
  m.def("optimizer_state_swap(Tensor(a!)[] stores, Tensor(b!)[] batch, Tensor? writeback_index, "
        "Tensor? load_index, *, str bounds_check='deferred') -> ()", pt2);
  // For the stores (private): a batch's rows moved by ids the caller sorted once, for a table
  // whose rows are split into parts (a weight and its optimizer state side by side: table of
  // shape (rows, len(parts), ...), parts[k] of shape (m, ...) holding part k of the batch's
  // rows). sorted_rows ascending, slots[j] the part row paired with sorted_rows[j]. With count
  // (one int64 on the parts' device), only the first min(count, n) positions take part: the
  // rest are neither validated nor moved, so a step can pass fixed-size indices whose length is
  // known only on the device (the row cache's misses) without the host waiting for it. load:
  // parts[k][slots[j]] = table[sorted_rows[j], k], each distinct table row read once, whole.
  // Otherwise (write-back): table[sorted_rows[j], k] = parts[k][slots[j]] for the last j of each
  // run of equal rows (callers pass slots that agree within a run), each row written once. The
  // public ops sort their index themselves; this one lets a training step sort a batch's ids
  // once for its load, its write-back and its duplicate bookkeeping. Index values are validated
  // like the public ops'; sortedness is checked on the CPU (on a GPU unsorted duplicates race).
  m.def("_sorted_transfer(Tensor(a!) table, Tensor(b!)[] parts, Tensor sorted_rows, "
        "Tensor slots, bool load, Tensor? count=None, *, str bounds_check='deferred', int sms=0) -> ()");
  // Planning a row cache's step on the device (private, for the stores): fixed shapes, counts
  // known only on the device stay there, nothing waits. Values are trusted (the stores check
  // ids on the host); one out of range gives an unspecified result, but nothing is read or
  // written outside the tensors.
  // (keys sorted ascending, stably; the position of each), sorting only the bits below bound.
  m.def("_sort_ids(Tensor keys, int bound) -> (Tensor, Tensor)");
  // (ids, inverse, count, perm, starts): ids[:count] the distinct keys of index ascending,
  // ids[count:] zero; ids[inverse[i]] == index[i]; count one int64; perm the positions of index
  // sorted by key, stably (ascending positions within a key); starts (n + 1 entries) where each
  // distinct key's positions begin in perm: key r's are perm[starts[r]:starts[r + 1]], and
  // starts[r] = n from r = count on. Keys below bound.
  m.def("_distinct(Tensor index, int bound) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // out (rows, dim): out[r] = the sum of grad[perm[j]] over j in [starts[r], starts[r + 1]) (in
  // that order on the CPU; in a fixed order on a GPU: deterministic, no atomics) for
  // r < min(count, rows, len(starts) - 1), zero for the other rows (left as they are with
  // zero_tail false: a caller that reads rows below count only). grad is the rows of the
  // `grads` pieces in turn (each (n_k, dim), one floating dtype; len(perm) rows in all), read
  // where they are (a step's outputs' gradients, never joined on a GPU); perm and starts as
  // _distinct gives them (their values are trusted: on a GPU they are not checked), count one
  // int64, all on one device. The backward of a lookup of staged rows by the positions
  // _distinct sorted.
  m.def("_segment_sum(Tensor[] grads, Tensor perm, Tensor starts, Tensor count, int rows, "
        "bool zero_tail=True) -> Tensor");
  // out (len(index), dim): out[p] = row index[p] of rows (n, dim; its elements contiguous, rows
  // any stride apart), or, given a cache (slots, dim, the same way) and at (n entries, one a row
  // of rows), cache row at[index[p]] where that is a slot (0 <= at < slots): a step's lookup
  // that reads its cached rows where they live. index in [0, n) (trusted on a GPU, like at).
  // out (rows, dim): out[r] = the sum of scale(p) * grad[bag(p)] over the positions p =
  // perm[j], j in [starts[r], starts[r + 1]), that lie in [lo, lo + n) (in that order), for
  // r < min(count, rows, len(starts) - 1), zero for the other rows; n = offsets[-1]. The bags:
  // offsets (bags + 1 entries ascending from 0) put position lo + i in bag b where offsets[b]
  // <= i < offsets[b + 1]; grad (bags, dim) their pooled outputs' gradient; scale(p)
  // per_sample_weights[p - lo] (n of grad's dtype), else 1 / the bag's size with mean, else 1.
  // perm, starts and count as _distinct gives them, on the CPU (no CUDA kernel). The backward
  // of a sum- or mean-pooled lookup of staged rows: each distinct row's gradient read from the
  // bags its positions sit in, with no dense per-position gradient and no second sort.
  m.def("_bag_segment_sum(Tensor grad, Tensor offsets, Tensor? per_sample_weights, bool mean, "
        "Tensor perm, Tensor starts, Tensor count, int lo, int rows) -> Tensor");
  m.def("_gather_staged(Tensor rows, Tensor index, Tensor? cache=None, Tensor? at=None) -> Tensor");
  // An id map of open addressing with linear probing over a power-of-two number of slots:
  // keys[s] the id slot s holds where rows[s] >= 0 (its row), rows[s] -1 an empty slot, -2 an
  // erased one (a search probes past it, an insert may take it). An id's home slot is
  // MurmurHash3's 64-bit finalizer of it, modulo the slots.
  // (found, slots): each of ids' row (-1: not held) and the slot holding it (-1).
  m.def("_hash_find(Tensor keys, Tensor rows, Tensor ids) -> (Tensor, Tensor)");
  // Each of ids (distinct, none held: the caller's contract) into the first free slot from its
  // home, with row new_rows[i] (>= 0), in order; raises writing nothing where the free slots
  // are fewer than the ids. Returns how many erased slots it took (one int64, 0-d).
  m.def("_hash_insert(Tensor(a!) keys, Tensor(b!) rows, Tensor ids, Tensor new_rows) -> Tensor");
  // out (len(row_of), dim) of dtype on row_of's device: out[i] = the row row_of[i] of the
  // (., dim) contiguous rows of dtype that start `offset` bytes past address ptrs[rank_of[i]]
  // (a group's buffers, each rank's read in place: torch's symmetric memory on GPUs, host
  // memory on the CPU; 16-byte aligned), zeros where row_of[i] < 0. The addresses and rows are
  // trusted (rank_of is checked on the CPU only): the sharded step's row exchange over NVLink.
  m.def("_peer_rows(Tensor ptrs, int offset, Tensor rank_of, Tensor row_of, int dim, "
        "ScalarType dtype) -> Tensor");
  // (order, count): the positions of the true flags ascending, then the others descending;
  // count (one int64) how many are true.
  m.def("_partition(Tensor flags) -> (Tensor, Tensor)");
  // (at, miss) for the first count ids (distinct table rows): at[i] = slot_of[ids[i]] where
  // that is a slot (>= 0), else scratch, and miss[i] says which; freq[ids[i]] += 1. Later
  // positions: at = scratch, miss = False, nothing counted.
  m.def("_cache_lookup(Tensor ids, Tensor count, Tensor slot_of, Tensor(a!) freq, int scratch) "
        "-> (Tensor, Tensor)");
  // (victims, cold): the k slots of least priority, ascending (ties: the lower slot first), and
  // their priorities. A slot s of id_of (the row each slot holds, -1: none) has priority
  // freq[id_of[s]], -1 when empty, +inf when it is in at (used by this step; entries past the
  // slots are ignored). 0 <= k <= slots.
  // With window > 0 only the window slots from *hand on (cyclically) are candidates (k <=
  // window <= slots), and hand (one int64 on id_of's device) then moves on by window (when
  // k > 0): each
  // step looks at the next slots, a cost that follows the step's ids, not the cache's size.
  m.def("_coldest_slots(Tensor id_of, Tensor freq, Tensor at, int k, Tensor(a!)? hand=None, "
        "int window=0) -> (Tensor, Tensor)");
  // (admit, keys, evicted) of a step's first k = len(first) misses paired with their victims:
  // admit[j] when j < misses (one int64), the victim's slot is free to take (cold[j] finite)
  // and, with by_frequency, the miss ids[first[j]] is used at least as often as the victim
  // (freq[miss] >= cold[j]); keys[j] the row the victim's slot held when it is evicted (admitted
  // and holding a row; id_of gives it), else len(freq), to sort; evicted how many (one int64).
  m.def("_admission(Tensor ids, Tensor first, Tensor victims, Tensor cold, Tensor misses, "
        "Tensor freq, Tensor id_of, bool by_frequency) -> (Tensor, Tensor, Tensor)");
  // dest: at, where each admitted miss (admit[j]) has its victim's slot: for each such j the
  // row ids[first[j]] takes slot victims[j] in the map (slot_of, id_of), and the row that held
  // it leaves the map. Victims distinct slots, the admitted rows distinct and not cached.
  m.def("_cache_admit(Tensor(a!) slot_of, Tensor(b!) id_of, Tensor ids, Tensor at, "
        "Tensor first, Tensor victims, Tensor admit) -> Tensor");
  // Rows between a row cache's slots and a step's buffer, tensors (parts, rows, ...): for
  // i < min(len(index), count) whose index[i] is a row of the slots' tensor, out[:, i] =
  // src[:, index[i]] (take), or dst[:, index[i]] = src[:, i] (put); other entries (-1, the
  // scratch slot past a view of the slots) move nothing. Unlike index_select / index_copy_,
  // only the rows that move are read and written. put's index entries must be distinct.
  m.def("_take_rows(Tensor(a!) out, Tensor src, Tensor index, Tensor count) -> ()");
  m.def("_put_rows(Tensor(a!) dst, Tensor src, Tensor index, Tensor count) -> ()");
  // age += 1; when age reaches a multiple of period, every freq halves (LFU aging decided on
  // the device, so a captured step ages too).
  m.def("_age_frequencies(Tensor(a!) freq, Tensor(b!) age, int period) -> ()");
  // One optimizer step on a step's staged rows (private, for the modules; rules.h has each
  // rule's formula, torch's own): buf (n, record) uint8 holds each row's record, its fields at
  // the byte offsets `fields` names: the weight (dim values of grad's dtype), the rule's row
  // value (RowWiseAdagrad's accumulator, PartialRowWiseAdam's second moment: float32, float64
  // with float64 state; -1 for the other rules), then the rule's per-element states in its
  // order (dim values of state_dtype each); grad (n, dim) the gradient; rows r < count (one
  // int64 on buf's device) update in place, the others are not touched. rule: 0 SGD, 1
  // Adagrad, 2 RowWiseAdagrad, 3 Adam, 4 AdamW, 5 PartialRowWiseAdam; hyper (lr,
  // weight_decay, a, b, eps) with a, b = momentum, dampening (SGD), lr_decay, - (Adagrad),
  // beta1, beta2 (Adam); flags: 1 maximize, 2 nesterov, 4 amsgrad, 8 SGD's first step; step
  // the step count after this step's increment (Adagrad, Adam, PartialRowWiseAdam), read on
  // the device when it lives there. Math in float32 (float64 for float64 weights). With a row
  // cache (slots, record) and at (a slot per staged row, as _cache_lookup gives it): a row
  // whose at[r] is a slot is updated there (its weight and state read and written there; its
  // row in buf is not read: a step need not stage a cached row's weight). With
  // rounding (seed, counter: 2 int64 on buf's device, read there), float16 and bfloat16 values
  // are stored rounded stochastically (unbiased; the draw a hash of seed, counter, the row's
  // position and the element, so a (seed, counter) gives the same bits on every device);
  // wider types ignore it.
  m.def("_fused_row_update(Tensor(a!) buf, Tensor grad, Tensor count, Tensor? step, int rule, "
        "float[] hyper, int flags, int[] fields, ScalarType state_dtype, Tensor(b!)? cache=None, "
        "Tensor? at=None, Tensor? rounding=None) -> ()");
  // dst = src (float32) stored in dst's dtype, rounded stochastically where dst is float16 or
  // bfloat16 (as _fused_row_update rounds its stores; the draws of element i under the row
  // i / 2^16 of rounding's (seed, counter)), exactly where dst is float32 or float64; the
  // general path of a 16-bit table's optimizer step (torch's step in float32, stored back).
  m.def("_round_into(Tensor(a!) dst, Tensor src, Tensor rounding) -> ()");
  // Page-lock an existing CPU tensor's storage in place (cudaHostRegister, mapped); unregistered
  // when the storage is freed. A helper for pinned stores, not for traced code.
  m.def("_pin_storage_(Tensor(a!) self) -> ()");
  // Page-lock up to max_pieces more pieces (each at most piece_bytes) of self's storage in place
  // (one cudaHostRegister may be refused for a very large table); returns the bytes pinned so
  // far. A refusal unregisters every piece and raises, leaving nothing half-pinned.
  m.def("_pin_storage_pieces_(Tensor(a!) self, int piece_bytes, int max_pieces) -> int");
  // Unregister every piece _pin_storage_pieces_ registered in self's storage.
  m.def("_unpin_storage_(Tensor(a!) self) -> ()");
  // Test hook of the CPU kernels: the bytes of work below which a pass runs on the calling
  // thread alone, not in a parallel region (0 restores the default); returns the previous
  // setting. Process-wide.
  m.def("_set_cpu_serial_bytes(int bytes) -> int", &speedtorch_ops::set_serial_bytes);
#ifdef SPEEDTORCH_OPS_WITH_CUDA
  // The most SMs the transfer kernels may use (0: no cap, the default), so transfers can run
  // beside training kernels. Process-wide; returns the previous setting.
  m.def("_set_transfer_sm_limit(int sms) -> int", &speedtorch_ops::torch_cuda::set_transfer_sm_limit);
  // Test hook of the hybrid path (CPU indices, host tables, rows on a GPU): the share of rows
  // the zero-copy kernels move, fixed in [0, 1], or negative for the automatic split.
  m.def("_set_hybrid_share(float share) -> float", &speedtorch_ops::torch_cuda::set_hybrid_share);
  // Test hook of the automatic split: forgets every shape's search; with quick, new searches
  // change their share from the first call on, one call a share.
  m.def("_reset_hybrid_tuner(bool quick) -> ()", &speedtorch_ops::torch_cuda::reset_hybrid_tuner);
  // Test hook of the routing: the table span (bytes) from which a CUDA index over pinned host
  // tables takes the hybrid path and write-backs go through the CPU (0 restores the default);
  // returns the previous setting.
  m.def("_set_hybrid_min_span(int bytes) -> int",
        &speedtorch_ops::torch_cuda::set_hybrid_min_span);
  // Test hook of the one-kernel write-back into CUDA tables: its cooperative launch asks for
  // this many blocks more than the device holds at once, so the runtime refuses it and the
  // call takes the separate kernels (0: off); returns the previous setting.
  m.def("_set_fused_extra_blocks(int blocks) -> int",
        &speedtorch_ops::torch_cuda::set_fused_extra_blocks);
  // Waits for the current stream of CUDA device `device`, then raises the bad index a call with
  // bounds_check='deferred' recorded there since the last report.
  m.def("_sync_bounds_check(int device) -> ()", &speedtorch_ops::torch_cuda::sync_bounds_check);
#endif
}
