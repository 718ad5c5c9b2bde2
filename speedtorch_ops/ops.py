"""Typed wrappers of the registered ops, their fakes (for torch.compile) and autograd.

Each wrapper is one call of ``torch.ops.speedtorch_ops.<op>.default``: nothing here reads data,
so the wrappers trace under ``torch.compile(fullgraph=True)``. Argument checks (values, devices,
pinned memory) happen in C++ before any byte moves.

Where an op's rows go to a GPU, pass the index on that GPU: the op itself picks the path (a
zero-copy kernel for a pinned or CUDA table; CPU threads and DMA for a pageable host table).
A CPU index with a host table and rows on a GPU chooses the hybrid path explicitly.

Every transfer op takes ``bounds_check`` (keyword only); in every mode a bad index writes
nothing:

- ``"deferred"`` (default): CUDA indices are checked on the GPU and the call does not wait for
  it, so the host keeps queueing ahead. A bad one is recorded in pinned host memory and raised by
  the next ``"deferred"`` or ``"raise"`` op call on that GPU (which then writes nothing either)
  or by :func:`sync_bounds_check`, naming the index, its position and its value. The rows a
  failing :func:`pinned_gather` returns are undefined.
- ``"raise"``: a bad index raises in the failing call. CUDA indices are checked on the GPU and
  the call waits for the current stream to read the result (not while a CUDA graph is being
  captured: a captured call reports like a deferred one, at each replay that finds one).
- ``"prechecked"``: the caller validated the indices on the host (e.g. once per batch of ids).
  CUDA indices are still checked on the GPU, so a bad one writes nothing, but nothing waits,
  records or raises (not even another call's recorded index: a sequence of prechecked calls
  never stops halfway), and no path that waits is taken.

Indices a call reads on the host (CPU tables, the hybrid path, a pageable table) are checked
there in every mode and a bad one raises at once: that check costs no wait.
"""

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

_ops = torch.ops.speedtorch_ops


def pinned_gather(table: Tensor, index: Tensor, *, bounds_check: str = "deferred") -> Tensor:
    """Rows ``table[index]`` as a new tensor on ``index``'s device.

    ``table``: contiguous, rows along dim 0, any dtype; pinned host memory or a CUDA tensor for a
    CUDA ``index`` (read in place by one zero-copy kernel; a pageable host table is read by CPU
    threads and copied up, after a wait for the stream), a CPU tensor for a CPU ``index``.
    ``index``: 1-D int32/int64 with values in ``[0, table.shape[0])``.
    ``bounds_check``: ``"deferred"``, ``"raise"`` or ``"prechecked"`` (see the module docstring).
    Differentiable with respect to ``table`` (like ``index_select``).

    Returns: ``(len(index), *table.shape[1:])`` in the table's dtype, on ``index``'s device.

    Example::

        table = speedtorch_ops.empty_pinned((1_000_000, 128), torch.float32)
        rows = pinned_gather(table, torch.tensor([5, 9, 5], device="cuda"))   # (3, 128) on the GPU
    """
    return _ops.pinned_gather.default(table, index, bounds_check=bounds_check)


def pinned_gather_into(table: Tensor, index: Tensor, out: Tensor, *,
                       bounds_check: str = "deferred") -> None:
    """``out[:] = table[index]`` into a caller-provided contiguous tensor.

    ``out`` on ``index``'s device allocates nothing (training loops, CUDA-graph capture). A CPU
    ``index`` with a host ``table`` and a CUDA ``out`` takes the hybrid path: CPU threads and the
    copy engine move part of the rows while the zero-copy kernel moves the rest (the split
    adapts by itself); the call returns when the CPU's part is done. ``bounds_check``:
    ``"deferred"``, ``"raise"`` or ``"prechecked"`` (see the module docstring). Mutates ``out``; not
    differentiable.

    Example::

        out = torch.empty(4096, 128, device="cuda")
        pinned_gather_into(table, ids_on_gpu, out)        # the same buffer every step
    """
    _ops.pinned_gather_into.default(table, index, out, bounds_check=bounds_check)


def pinned_scatter(table: Tensor, index: Tensor, src: Tensor, accumulate: bool = False, *,
                   bounds_check: str = "deferred") -> None:
    """``table[index[i]] = src[i]`` in place (``+=`` with ``accumulate``).

    ``table`` as for :func:`pinned_gather`; ``src`` has shape ``(len(index), *table.shape[1:])``,
    the table's dtype, on ``index``'s device (or on a GPU with a CPU ``index`` and a host
    ``table``: the hybrid path, as in :func:`pinned_gather_into`). Duplicate indices are
    deterministic: without ``accumulate`` the last occurrence wins, with it all add up in index
    order. ``bounds_check``: ``"deferred"``, ``"raise"`` or ``"prechecked"`` (see the module
    docstring).

    Example::

        pinned_scatter(table, ids_on_gpu, updated_rows)               # write the batch back
        pinned_scatter(table, ids_on_gpu, grads, accumulate=True)     # add into the rows
    """
    _ops.pinned_scatter.default(table, index, src, accumulate, bounds_check=bounds_check)


def optimizer_state_swap(
    stores: Sequence[Tensor],
    batch: Sequence[Tensor],
    writeback_index: Optional[Tensor],
    load_index: Optional[Tensor],
    *,
    bounds_check: str = "deferred",
) -> None:
    """For every pair ``(stores[k], batch[k])``: write ``batch[k]`` to rows ``writeback_index`` of
    ``stores[k]``, then load rows ``load_index`` into ``batch[k]``. Either index may be None. A
    row in both indices is written back before it is loaded. Mutates both lists. Both indices
    on the batch's device (or both on the CPU with host stores and GPU batch tensors: the hybrid
    path, see :func:`pinned_gather_into`). ``bounds_check``: ``"raise"`` or ``"prechecked"``
    (see the module docstring)."""
    _ops.optimizer_state_swap.default(list(stores), list(batch), writeback_index, load_index,
                                      bounds_check=bounds_check)


def _sorted_transfer(table: Tensor, parts: Sequence[Tensor], sorted_rows: Tensor, slots: Tensor,
                     load: bool, count: Optional[Tensor] = None, *,
                     bounds_check: str = "deferred", sms: int = 0) -> None:
    """Private, for the stores: a batch's rows moved by ids the caller sorted once, for a
    ``table`` of shape ``(rows, len(parts), ...)`` (a weight and its optimizer state side by
    side); ``parts[k]`` of shape ``(m, ...)`` holds part ``k`` of the batch's rows.
    ``sorted_rows`` ascending, ``slots[j]`` the part row paired with ``sorted_rows[j]``. With
    ``load``: ``parts[k][slots[j]] = table[sorted_rows[j], k]``, each distinct row read once;
    else ``table[sorted_rows[j], k] = parts[k][slots[j]]`` for the last ``j`` of each run of
    equal rows. ``count`` (one int64 on the parts' device): only the first ``count`` positions
    take part, the rest are neither validated nor moved (a length known only on the GPU, with
    no wait). A pinned or CUDA ``table`` with parts on its GPU, or all on the CPU.
    ``bounds_check``: ``"deferred"``, ``"raise"`` or ``"prechecked"`` (see the module
    docstring). ``sms`` > 0: this call's kernels use at most that many SMs (a transfer on a side
    stream, beside training kernels), or fewer where ``set_transfer_sm_limit`` set a lower cap;
    0: that cap alone."""
    _ops._sorted_transfer.default(table, list(parts), sorted_rows, slots, load, count,
                                  bounds_check=bounds_check, sms=sms)


# ---- planning a row cache's step on the device (private, for the stores) ----------------------
# Fixed shapes, counts kept on the device (one int64), nothing read back: a step planned with
# these never makes the host wait and can be captured in a CUDA graph. Values are trusted (the
# stores check ids on the host); one out of range gives an unspecified result, but nothing is
# read or written outside the tensors. On a GPU each is a few kernels where the same plan in
# torch ops took tens.

def _sort_ids(keys: Tensor, bound: int):
    """(``keys`` (1-D int64, each below ``bound``) sorted ascending, stably; the position of
    each). On a GPU only the bits below ``bound`` are sorted (a radix pass per 8 bits)."""
    return _ops._sort_ids.default(keys, bound)


def _distinct(index: Tensor, bound: int):
    """(ids, inverse, count, perm, starts) of ``index`` (1-D int64, each below ``bound``):
    ``ids[:count]`` its distinct values ascending, ``ids[count:]`` zero,
    ``ids[inverse[i]] == index[i]``; ``count`` one int64; ``perm`` the positions sorted by
    value (stably); distinct value r's positions are ``perm[starts[r]:starts[r + 1]]``
    (``starts``: n + 1 entries, n from ``count`` on)."""
    return _ops._distinct.default(index, bound)


def _segment_sum(grads: Sequence[Tensor], perm: Tensor, starts: Tensor, count: Tensor,
                 rows: int, zero_tail: bool = True) -> Tensor:
    """(rows, dim): row r the sum of ``grad[perm[starts[r]:starts[r + 1]]]`` for r below
    ``count`` (one int64), zero after (undefined with ``zero_tail=False``: for a caller that
    reads the rows below count only), where grad is the rows of the `grads` pieces in turn
    (each contiguous (n_k, dim); on a GPU read in place, never joined); deterministic (no
    atomics)."""
    return _ops._segment_sum.default(list(grads), perm, starts, count, rows, zero_tail)


def _bag_segment_sum(grad: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
                     mean: bool, perm: Tensor, starts: Tensor, count: Tensor, lo: int,
                     rows: int) -> Tensor:
    """(rows, dim), CPU only: row r the sum, over its positions ``p = perm[starts[r]:starts[r +
    1]]`` in ``[lo, lo + offsets[-1])``, of ``grad[bag(p)]`` (the bags: ``offsets``, bags + 1
    entries from 0) times ``per_sample_weights[p - lo]``, 1 / the bag's size with ``mean``, or
    1; rows from ``count`` (one int64) on zero. The backward of a sum- or mean-pooled lookup of
    staged rows, from the step's one sort (``_distinct``'s perm and starts); not
    differentiable."""
    return _ops._bag_segment_sum.default(grad, offsets, per_sample_weights, mean, perm, starts,
                                         count, lo, rows)


def _hash_find(keys: Tensor, rows: Tensor, ids: Tensor) -> tuple:
    """(each of `ids`' row, -1 where it has none; the slot holding it, -1), CPU only: the id
    map of ``keys`` (the ids) and ``rows`` (their rows; -1 an empty slot, -2 an erased one),
    1-D int64 of a power-of-two length, open addressing with linear probing from each id's
    home slot (MurmurHash3's finalizer). Reads only; not differentiable."""
    return _ops._hash_find.default(keys, rows, ids)


def _hash_insert(keys: Tensor, rows: Tensor, ids: Tensor, new_rows: Tensor) -> Tensor:
    """Insert `ids` (distinct, none held: the caller's contract) with `new_rows` into the map
    of ``_hash_find``, each into the first free slot from its home, in order; mutates `keys`
    and `rows`; raises writing nothing where the free slots are fewer. Returns how many erased
    slots it took (a 0-d int64)."""
    return _ops._hash_insert.default(keys, rows, ids, new_rows)


def _gather_staged(rows: Tensor, index: Tensor, cache: Optional[Tensor] = None,
                 at: Optional[Tensor] = None) -> Tensor:
    """``rows[index]`` (a new contiguous tensor), except that with a ``cache`` (slots, dim) a
    row r whose ``at[r]`` names a slot is read from that slot: a step's lookup of rows the
    cache holds, where they live."""
    return _ops._gather_staged.default(rows, index, cache, at)


def _peer_rows(ptrs: Tensor, offset: int, rank_of: Tensor, row_of: Tensor, dim: int,
               dtype: torch.dtype) -> Tensor:
    """(len(row_of), dim) of `dtype`: row ``row_of[i]`` of the contiguous (., dim) rows that
    start `offset` bytes past address ``ptrs[rank_of[i]]``, zeros where ``row_of[i] < 0``. The
    addresses are a group's buffers read in place (torch symmetric memory on GPUs; host memory
    on the CPU), 16-byte aligned and trusted, like the rows: the sharded step's exchange of
    rows over NVLink, which reads only the rows it needs."""
    return _ops._peer_rows.default(ptrs, offset, rank_of, row_of, dim, dtype)


def _partition(flags: Tensor):
    """(order, count) of ``flags`` (1-D bool): the positions of the true flags ascending, then
    the others descending; ``count`` (one int64) how many are true."""
    return _ops._partition.default(flags)


def _cache_lookup(ids: Tensor, count: Tensor, slot_of: Tensor, freq: Tensor, scratch: int):
    """(at, miss) for the first ``count`` of ``ids`` (distinct table rows): ``at[i]`` the slot
    ``slot_of[ids[i]]`` (int32, -1: none) or ``scratch``, ``miss[i]`` true for none; counts
    each in ``freq`` (float32, in place). Later positions: ``scratch``, no miss, not counted."""
    return _ops._cache_lookup.default(ids, count, slot_of, freq, scratch)


def _coldest_slots(id_of: Tensor, freq: Tensor, at: Tensor, k: int,
                   hand: Optional[Tensor] = None, window: int = 0):
    """(victims, cold): the ``k`` slots of least priority, ascending (ties: the lower slot
    first), and their priorities. Slot ``s`` (``id_of[s]``: its row, -1: none) has priority
    ``freq[id_of[s]]``, -1 when empty, +inf when it is in ``at`` (used by this step). With
    ``window`` > 0, only the ``window`` slots from ``hand`` (one int64 on the device) on,
    cyclically, are candidates, and ``hand`` moves on by ``window`` (in place)."""
    return _ops._coldest_slots.default(id_of, freq, at, k, hand, window)


def _admission(ids: Tensor, first: Tensor, victims: Tensor, cold: Tensor, misses: Tensor,
               freq: Tensor, id_of: Tensor, by_frequency: bool):
    """(admit, keys, evicted) for the misses at positions ``first`` of ``ids`` paired with the
    slots ``victims`` (priorities ``cold``): ``admit[j]`` for the first ``misses`` (one int64)
    whose victim's slot is free to take (finite ``cold``) and, ``by_frequency``, used less often
    than the miss (a tie keeps the cached row); ``keys[j]`` the row the victim's slot held (``id_of``) when it is
    evicted, else ``len(freq)``; ``evicted`` how many (one int64)."""
    return _ops._admission.default(ids, first, victims, cold, misses, freq, id_of, by_frequency)


def _cache_admit(slot_of: Tensor, id_of: Tensor, ids: Tensor, at: Tensor, first: Tensor,
                 victims: Tensor, admit: Tensor) -> Tensor:
    """Each admitted miss (``admit[j]``: row ``ids[first[j]]``) takes slot ``victims[j]`` in the
    map (``slot_of``, ``id_of``, in place) and the row that held it leaves; returns ``at`` with
    those positions on their new slots."""
    return _ops._cache_admit.default(slot_of, id_of, ids, at, first, victims, admit)


def _take_rows(out: Tensor, src: Tensor, index: Tensor, count: Tensor) -> None:
    """``out[:, i] = src[:, index[i]]`` (tensors (parts, rows, ...), each row contiguous, rows
    any stride apart: a view of each record's first bytes moves only those) for the first
    ``count`` (one int64) positions whose ``index[i]`` is a row of ``src``; other entries (-1,
    or a scratch slot past a view of a cache's slots) leave ``out[:, i]`` as it was. In place;
    only the rows that move are read and written."""
    _ops._take_rows.default(out, src, index, count)


def _put_rows(dst: Tensor, src: Tensor, index: Tensor, count: Tensor) -> None:
    """``dst[:, index[i]] = src[:, i]`` for the first ``count`` positions whose ``index[i]`` is a
    row of ``dst`` (distinct entries); the others move nothing. In place."""
    _ops._put_rows.default(dst, src, index, count)


def _age_frequencies(freq: Tensor, age: Tensor, period: int) -> None:
    """``age += 1`` (one int64) and, when it reaches a multiple of ``period``, ``freq`` halves;
    in place, decided on the device."""
    _ops._age_frequencies.default(freq, age, period)


def _fused_row_update(buf: Tensor, grad: Tensor, count: Tensor, step: Optional[Tensor],
                      rule: int, hyper: Sequence[float], flags: int, fields: Sequence[int],
                      state_dtype: torch.dtype, cache: Optional[Tensor] = None,
                      at: Optional[Tensor] = None, rounding: Optional[Tensor] = None) -> None:
    """One optimizer step, in place, on the first ``count`` (one int64 on buf's device) staged
    rows of ``buf`` (n, record) uint8, each a record of the row's weight and state, with their
    gradient ``grad`` (n, dim) in the weights' dtype: torch's formula of ``rule`` (0 SGD, 1
    Adagrad, 2 RowWiseAdagrad, 3 Adam, 4 AdamW, 5 PartialRowWiseAdam) with ``hyper`` (lr,
    weight_decay, a, b, eps) and ``flags`` (1 maximize, 2 nesterov, 4 amsgrad, 8 SGD's first
    step). ``fields``: the byte offsets in a record of the weight (dim values of grad's dtype),
    the rule's per-row value (float32, float64 for float64 state; -1 for a rule without one)
    and each per-element state in the rule's order (dim values of ``state_dtype`` each).
    ``step`` the step count after this step's increment (Adagrad, Adam, AdamW,
    PartialRowWiseAdam). Math in float32 (float64 for float64 rows). With a row ``cache``
    (slots, record) and ``at`` (a slot per staged row): a row whose ``at[r]`` is a slot is
    updated in the cache (weight and state read and written there; its row in ``buf`` is not
    read). ``rounding`` (seed, counter; int64 on buf's device): float16 and bfloat16 values are
    stored rounded stochastically, the draw a hash of (seed, counter, the row's position, the
    element), the same bits on every device."""
    _ops._fused_row_update.default(buf, grad, count, step, rule, [float(v) for v in hyper],
                                   flags, list(fields), state_dtype, cache, at, rounding)


def _round_into(dst: Tensor, src: Tensor, rounding: Tensor) -> None:
    """``dst.copy_(src)`` for a float32 ``src`` of dst's shape (both contiguous, one device),
    rounded stochastically where ``dst`` is float16 or bfloat16, as ``_fused_row_update``
    rounds its stores (the draws of element i under block i // 2**16 of ``rounding``'s (seed,
    counter), int64 on dst's device); exact for float32 and float64."""
    _ops._round_into.default(dst, src, rounding)


def set_transfer_sm_limit(sms: int) -> int:
    """Cap the SMs the CUDA transfer kernels use (one 1024-thread block per allowed SM), so
    transfers can overlap with training kernels; 0 (the default) removes the cap. Process-wide.
    Returns the previous cap. Needs the CUDA build."""
    if not hasattr(_ops, "_set_transfer_sm_limit"):
        raise RuntimeError("set_transfer_sm_limit needs speedtorch_ops built with CUDA")
    return int(_ops._set_transfer_sm_limit.default(int(sms)))


def sync_bounds_check(device=None) -> None:
    """Waits for the current stream of ``device`` (a CUDA device; default: the current one),
    then raises the bad CUDA index that a call with ``bounds_check="deferred"`` found there
    since the last report, if any. Without a CUDA GPU there is nothing to report."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    if not hasattr(_ops, "_sync_bounds_check") or not torch.cuda.is_available():
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    _ops._sync_bounds_check.default(index)


@contextlib.contextmanager
def transfer_sm_limit(sms: int) -> Iterator[None]:
    """``with transfer_sm_limit(8): ...`` -- :func:`set_transfer_sm_limit` for a block."""
    previous = set_transfer_sm_limit(sms)
    try:
        yield
    finally:
        set_transfer_sm_limit(previous)


def inductor_options() -> dict:
    """Inductor options for compiled code that writes a table in place:
    ``torch.compile(fn, options=speedtorch_ops.inductor_options())``.

    Inductor's inference pass ``reorder_for_locality`` moves a read of a table (e.g. a gather
    whose result is used later) past an in-place write of the same table, because it does not
    treat the functionalized write (``auto_functionalized_v2``) as a mutation boundary; the
    re-inplacing pass must then run the write on a full copy of the table (and a copy of a pinned
    table is pageable, which the ops refuse). Without that pass the write stays in place. For
    ``mode="reduce-overhead"`` pass ``{**inductor_options(), "triton.cudagraphs": True}``
    (torch.compile takes ``mode`` or ``options``, not both)."""
    return {"reorder_for_locality": False}


# ---- fakes: shapes, dtypes and devices only; they read no data -------------------------------

def _check_index_meta(index: Tensor, name: str) -> None:
    torch._check(index.dim() == 1, lambda: f"{name} must be 1-D")
    torch._check(index.dtype in (torch.int32, torch.int64), lambda: f"{name} must be int32/int64")


@torch.library.register_fake("speedtorch_ops::pinned_gather")
def _pinned_gather_fake(table: Tensor, index: Tensor, *, bounds_check: str = "deferred") -> Tensor:
    _check_index_meta(index, "index")
    return table.new_empty((index.shape[0], *table.shape[1:]), device=index.device)


@torch.library.register_fake("speedtorch_ops::pinned_gather_into")
def _pinned_gather_into_fake(table: Tensor, index: Tensor, out: Tensor, *,
                             bounds_check: str = "deferred") -> None:
    _check_index_meta(index, "index")
    torch._check(out.shape == (index.shape[0], *table.shape[1:]), lambda: "out has the wrong shape")
    torch._check(out.dtype == table.dtype, lambda: "out must have the table's dtype")


@torch.library.register_fake("speedtorch_ops::pinned_scatter")
def _pinned_scatter_fake(table: Tensor, index: Tensor, src: Tensor, accumulate: bool = False, *,
                         bounds_check: str = "deferred") -> None:
    _check_index_meta(index, "index")
    torch._check(src.shape == (index.shape[0], *table.shape[1:]), lambda: "src has the wrong shape")
    torch._check(src.dtype == table.dtype, lambda: "src must have the table's dtype")


@torch.library.register_fake("speedtorch_ops::optimizer_state_swap")
def _optimizer_state_swap_fake(stores, batch, writeback_index, load_index, *,
                               bounds_check: str = "deferred") -> None:
    torch._check(len(stores) == len(batch), lambda: "stores and batch must pair up")
    for store, b in zip(stores, batch):
        torch._check(b.shape[1:] == store.shape[1:], lambda: "batch rows must match store rows")
        torch._check(b.dtype == store.dtype, lambda: "batch must have the store's dtype")


@torch.library.register_fake("speedtorch_ops::_sorted_transfer")
def _sorted_transfer_fake(table, parts, sorted_rows, slots, load, count=None, *,
                          bounds_check: str = "deferred", sms: int = 0) -> None:
    torch._check(sms >= 0, lambda: f"sms must be >= 0, got {sms}")
    _check_index_meta(sorted_rows, "sorted_rows")
    _check_index_meta(slots, "slots")
    torch._check(table.dim() >= 2 and table.shape[1] == len(parts),
                 lambda: "table must have shape (rows, len(parts), ...)")
    torch._check(slots.shape == sorted_rows.shape, lambda: "slots must pair with sorted_rows")
    for part in parts:
        torch._check(part.shape == (parts[0].shape[0], *table.shape[2:]),
                     lambda: "a part has the wrong shape")
        torch._check(part.dtype == table.dtype, lambda: "parts must have the table's dtype")


@torch.library.register_fake("speedtorch_ops::_sort_ids")
def _sort_ids_fake(keys: Tensor, bound: int):
    _check_index_meta(keys, "keys")
    return torch.empty_like(keys), torch.empty_like(keys)


@torch.library.register_fake("speedtorch_ops::_distinct")
def _distinct_fake(index: Tensor, bound: int):
    _check_index_meta(index, "index")
    return (torch.empty_like(index), torch.empty_like(index), index.new_empty(1),
            torch.empty_like(index), index.new_empty(index.shape[0] + 1))


@torch.library.register_fake("speedtorch_ops::_hash_find")
def _hash_find_fake(keys, rows, ids):
    torch._check(keys.dim() == 1 and rows.shape == keys.shape and ids.dim() == 1,
                 lambda: "keys and rows one 1-D length, ids 1-D")
    return ids.new_empty(ids.shape), ids.new_empty(ids.shape)


@torch.library.register_fake("speedtorch_ops::_hash_insert")
def _hash_insert_fake(keys, rows, ids, new_rows):
    torch._check(new_rows.shape == ids.shape, lambda: "one new row an id")
    return keys.new_empty(())


@torch.library.register_fake("speedtorch_ops::_segment_sum")
def _segment_sum_fake(grads, perm, starts, count, rows: int, zero_tail: bool = True):
    torch._check(len(grads) > 0, lambda: "grads must hold at least one tensor")
    torch._check(all(g.dim() == 2 and g.shape[1] == grads[0].shape[1] for g in grads),
                 lambda: "grads must be (positions, dim) tensors of one dim")
    torch._check(sum(g.shape[0] for g in grads) == perm.shape[0],
                 lambda: "grads must have one row a position of perm")
    return grads[0].new_empty((rows, grads[0].shape[1]))


@torch.library.register_fake("speedtorch_ops::_bag_segment_sum")
def _bag_segment_sum_fake(grad, offsets, per_sample_weights, mean, perm, starts, count, lo, rows):
    torch._check(grad.dim() == 2 and offsets.dim() == 1 and offsets.shape[0] == grad.shape[0] + 1,
                 lambda: "grad (bags, dim) with offsets of bags + 1 entries")
    return grad.new_empty((rows, grad.shape[1]))


@torch.library.register_fake("speedtorch_ops::_peer_rows")
def _peer_rows_fake(ptrs, offset, rank_of, row_of, dim, dtype):
    torch._check(rank_of.dim() == 1 and row_of.dim() == 1 and ptrs.dim() == 1,
                 lambda: "ptrs, rank_of and row_of are 1-D")
    torch._check(rank_of.shape[0] == row_of.shape[0],
                 lambda: "rank_of and row_of have one entry a row each")
    return row_of.new_empty((row_of.shape[0], dim), dtype=dtype)


@torch.library.register_fake("speedtorch_ops::_gather_staged")
def _gather_staged_fake(rows, index, cache=None, at=None):
    torch._check(rows.dim() == 2 and index.dim() == 1, lambda: "rows (n, dim), index 1-D")
    torch._check((cache is None) == (at is None),
                 lambda: "cache and at go together: give both or neither")
    if cache is not None:
        torch._check(cache.dim() == 2 and cache.shape[1] == rows.shape[1] and at.dim() == 1,
                     lambda: "cache (slots, dim) with rows' dim, at 1-D")
    return rows.new_empty((index.shape[0], rows.shape[1]))


@torch.library.register_fake("speedtorch_ops::_partition")
def _partition_fake(flags: Tensor):
    torch._check(flags.dim() == 1 and flags.dtype == torch.bool, lambda: "flags must be 1-D bool")
    return (flags.new_empty(flags.shape, dtype=torch.int64),
            flags.new_empty(1, dtype=torch.int64))


@torch.library.register_fake("speedtorch_ops::_cache_lookup")
def _cache_lookup_fake(ids, count, slot_of, freq, scratch: int):
    _check_index_meta(ids, "ids")
    return torch.empty_like(ids), ids.new_empty(ids.shape, dtype=torch.bool)


@torch.library.register_fake("speedtorch_ops::_coldest_slots")
def _coldest_slots_fake(id_of, freq, at, k: int, hand=None, window: int = 0):
    torch._check(0 <= k <= id_of.shape[0], lambda: f"k must be in [0, {id_of.shape[0]}]")
    return id_of.new_empty(k), freq.new_empty(k)


@torch.library.register_fake("speedtorch_ops::_admission")
def _admission_fake(ids, first, victims, cold, misses, freq, id_of, by_frequency: bool):
    torch._check(first.shape == victims.shape == cold.shape,
                 lambda: "first, victims and cold must have one length")
    return first.new_empty(first.shape, dtype=torch.bool), torch.empty_like(first), \
        first.new_empty(1)


@torch.library.register_fake("speedtorch_ops::_cache_admit")
def _cache_admit_fake(slot_of, id_of, ids, at, first, victims, admit):
    torch._check(first.shape == victims.shape == admit.shape,
                 lambda: "first, victims and admit must have one length")
    return torch.empty_like(at)


def _move_rows_fake(dst, src, index, count, positions) -> None:
    torch._check(dst.dim() >= 2 and src.dim() >= 2 and dst.shape[0] == src.shape[0]
                 and dst.shape[2:] == src.shape[2:],
                 lambda: "src must have the other tensor's parts and row shape")
    torch._check(index.dim() == 1 and index.shape[0] <= positions.shape[1],
                 lambda: "index must have at most one entry a position")


@torch.library.register_fake("speedtorch_ops::_take_rows")
def _take_rows_fake(out, src, index, count) -> None:
    _move_rows_fake(out, src, index, count, out)


@torch.library.register_fake("speedtorch_ops::_put_rows")
def _put_rows_fake(dst, src, index, count) -> None:
    _move_rows_fake(dst, src, index, count, src)


@torch.library.register_fake("speedtorch_ops::_age_frequencies")
def _age_frequencies_fake(freq, age, period: int) -> None:
    torch._check(period >= 1, lambda: f"period must be at least 1, got {period}")


@torch.library.register_fake("speedtorch_ops::_round_into")
def _round_into_fake(dst, src, rounding) -> None:
    torch._check(src.shape == dst.shape, lambda: "src must have dst's shape")


@torch.library.register_fake("speedtorch_ops::_fused_row_update")
def _fused_row_update_fake(buf, grad, count, step, rule, hyper, flags, fields, state_dtype,
                           cache=None, at=None, rounding=None) -> None:
    torch._check(buf.dim() == 2 and grad.dim() == 2 and grad.shape[0] == buf.shape[0],
                 lambda: "grad must have buf's rows")


# ---- autograd: pinned_gather is index_select, so its gradient is an index_add ----------------

def _gather_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    table, index = inputs
    ctx.save_for_backward(index)
    ctx.table_meta = (table.shape, table.dtype, table.device)


def _gather_backward(ctx, grad: Tensor):
    (index,) = ctx.saved_tensors
    shape, dtype, device = ctx.table_meta
    # The gradient lives with the table (host for a host table), like index_select's.
    grad_table = torch.zeros(shape, dtype=dtype, device=device)
    grad_table.index_add_(0, index.to(device), grad.to(device))
    return grad_table, None


torch.library.register_autograd(
    "speedtorch_ops::pinned_gather", _gather_backward, setup_context=_gather_setup_context
)
