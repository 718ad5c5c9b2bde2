"""The compatible factories' colocated rows on the modules' stores.

A factory's batch-sized module holds one slot per id, duplicates included (``training.plan``),
where the modules' stores (``HostRows``, ``CachedRows``) stage each distinct row once. The row
store here expands a stage's distinct rows to the batch's slots at ``load`` and folds each row's
owner slot back before the commit at ``write_back``: the factories' colocated rows, their GPU row
cache and their prefetch are the modules' own.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..memory import is_zero_copy_usable
from .cache import CachedRows
from .host_rows import Distinct, HostRows
from .plan import Plan
from .stores import RowStore


class _Loaded(NamedTuple):
    """The batch loaded last: its plan, the stage's distinct rows (``buf``, parts first) and
    their Distinct, and the rows expanded to the batch's slots (``slots``, on the batch's
    device)."""
    plan: Plan
    buf: Tensor
    distinct: Distinct
    slots: Tensor


class ColocatedRows(RowStore):
    """The parts of a row (a weight and its optimizer state) side by side in one host table of
    shape (rows, parts, *row), for a pair of compatible factories (``colocate``): one transfer
    each way moves a row's weight and state together. Zero-copy reads of random rows over
    multi-GiB host tables are limited by a row rate rather than by bytes, so fewer, larger rows
    move faster (docs/decisions.md, "The demo's colocated rows").

    The rows move through the modules' stores (``self.rows``): ``HostRows``, or with ``slots`` a
    ``CachedRows`` GPU row cache. ``load(plan)`` stages the batch's distinct rows and expands them
    to its slots (a second call for the batch, by the other factory of the pair, returns the same
    tensors); ``write_back(plan)`` puts each row's owner slot in the staged rows and commits them
    (a second call does nothing). ``prefetch(plan)`` loads a coming batch's rows on the store's
    side stream while the current batch trains. It skips the rows of the batch loaded and not
    yet written back, and the cached ones: their host copies are stale until that write-back,
    so the load that takes the prefetch reads them then (``HostRows.prefetch``).

    Args:
        host: the table (rows, parts, *row): pinned or CUDA memory, or ordinary host memory
            (with a GPU `device` its rows then move on the CPU and are copied over; no cache).
        device: where the batch's rows go.
        slots: rows of a GPU row cache in front of the table (0: no cache).

    Example::

        table = so.empty_pinned((rows, 3, dim), torch.float32)   # weight, exp_avg, exp_avg_sq
        store = ColocatedRows(table, torch.device("cuda"))
        plan = store.plan_for(ids)
        weight, exp_avg, exp_avg_sq = store.load(plan)   # (len(ids), dim) each, slot i = ids[i]
        ...                                              # the optimizer updates them in place
        store.write_back(plan)
    """

    def __init__(self, host: Tensor, device: torch.device, slots: int = 0):
        if host.dim() < 3:
            raise ValueError("ColocatedRows: host must have shape (rows, parts, *row)")
        self.host = host
        self.device = torch.device(device)
        # A table no kernel on the GPU can address (ordinary host memory): its rows move on the
        # CPU and the batch is copied over.
        through_cpu = self.device.type == "cuda" and not is_zero_copy_usable(host)
        if slots and through_cpu:
            raise ValueError("ColocatedRows: a GPU row cache (cache_bytes) needs a pinned or CUDA "
                             "host table (its misses are read in place by the GPU), got "
                             "ordinary host memory")
        self.rows = (CachedRows(host, self.device, slots) if slots
                     else HostRows(host, torch.device("cpu") if through_cpu else self.device))
        self._current: Optional[_Loaded] = None
        self._written: Optional[Plan] = None  # the last batch written back
        self._ahead: Optional[Plan] = None  # the last batch prefetched

    def tables(self) -> List[Tensor]:
        """Views of the host table, one per part; a cache writes its rows there first (this
        waits for the GPU)."""
        if isinstance(self.rows, CachedRows):
            self.rows.flush()
        return [self.host[:, k] for k in range(self.host.shape[1])]

    def _plan_device(self) -> torch.device:
        return self.rows.device

    def _recent_plans(self):
        return (self._current.plan if self._current is not None else None, self._written,
                self._ahead)

    def load(self, plan: Plan, out: Optional[Sequence[Tensor]] = None) -> List[Tensor]:
        """The plan's rows of every part, one slot per id, on the device (`out` is not used:
        the store's own tensors, which ``write_back`` reads)."""
        current = self._current
        if current is not None and current.plan is plan:
            return list(current.slots.unbind(0))
        plan.check(self.host.shape[0])  # before the batch loaded last is dropped
        if current is not None:
            self.rows.discard()  # a batch never written back leaves nothing behind
            self._current = None
        buf, distinct = self.rows.stage(plan)
        slots = buf.index_select(1, distinct.inverse).to(self.device)
        # A row's first slot in the stable sort of the stage is its owner: the duplicate
        # gradients' sums and the write-back need no sort of the plan's own.
        plan.adopt_owner(distinct.perm[distinct.starts[distinct.inverse]])
        self._current = _Loaded(plan, buf, distinct, slots)
        return list(slots.unbind(0))

    def write_back(self, plan: Plan, rows: Sequence[Tensor] = ()) -> None:
        """Write the batch loaded last (the tensors ``load`` returned, which the optimizer
        updated in place; `rows` is not used) back: each distinct row once, from its owner slot.
        A second call for the same batch does nothing."""
        current = self._current
        if current is None and plan is self._written:
            return  # the pair's second call
        if current is None or current.plan is not plan:
            raise ValueError("write_back: these ids are not the batch loaded last by this store")
        # Every slot of a row takes its owner's values, so all writes to a distinct row agree.
        owned = current.slots.index_select(1, plan.owner.to(self.device))
        current.buf.index_copy_(1, current.distinct.inverse, owned.to(current.buf.device))
        self.rows.commit()
        self._current, self._written = None, plan

    def prefetch(self, plan: Plan) -> None:
        """Start loading the rows of `plan`, a coming batch, that the host table will hold
        unchanged when it is loaded (see the class docstring); nothing waits."""
        self.rows.prefetch(plan)
        self._ahead = plan

    def settle(self, writing: bool = False) -> None:
        """The host table complete (queued write-backs landed, a cache's rows written; waits
        for the GPU); with `writing`, the device's copies are dropped: the prefetched rows, the
        cache's, and the batch loaded and not written back (a later ``write_back`` of it
        raises)."""
        self.rows.flush()
        if writing:
            self.rows.reset()
            self._current = None
