"""Row stores: where an embedding table's rows live and how a batch's rows move.

A store holds one or more *parts* of the same rows (a weight table and/or its optimizer-state
tables) and moves a batch's rows between them and the device, only through the ops:

    plan = store.plan_for(ids)          # the store's plan of these ids (reused within a step)
    rows = store.load(plan)             # a batch-sized tensor per part: rows[k][i] = part k of ids[i]
    ...                                 # train on rows (the optimizer updates them in place)
    store.write_back(plan, rows)        # each distinct row written once, from its owner slot

Two implementations: ``SeparateTables`` (SpeedTorch's layout: a full table per part) and
``ColocatedRows`` (the parts of a row side by side in one host table, moved by one transfer each
way, with prefetch of the next batch). The callers (the compatible factories) hold a store and
delegate to it; a store never reaches into its callers. Host indices are checked here, on the
host, so the ops run with ``bounds_check='prechecked'`` and never make the host wait.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .. import ops
from ..memory import is_zero_copy_usable
from .plan import Plan, host_ids

_NO_WAIT = "prechecked"  # the plans check ids on the host before any op runs


class RowStore:
    """The interface shared by every store (see the module docstring)."""

    device: torch.device  # where batch rows go

    def tables(self) -> List[Tensor]:
        """The full table of each part (host or device tensors the store owns)."""
        raise NotImplementedError

    def plan_for(self, ids) -> Plan:
        """A plan of `ids` (1-D, SpeedTorch's order) on the store's device: the store's current
        one when it holds the same ids, so a step uploads and sorts its ids once."""
        ids = host_ids(ids)
        for plan in self._recent_plans():
            if plan is not None and plan.same_ids(ids):
                return plan
        return self._remember(Plan(ids, self.device))

    def _recent_plans(self) -> Sequence[Optional[Plan]]:
        return ()

    def _remember(self, plan: Plan) -> Plan:
        return plan

    def load(self, plan: Plan, out: Optional[Sequence[Tensor]] = None) -> List[Tensor]:
        """The plan's rows of every part, on the device (into `out` where its tensors fit)."""
        raise NotImplementedError

    def write_back(self, plan: Plan, rows: Sequence[Tensor]) -> None:
        """Write the batch's rows (part k in rows[k]) back, each distinct row from its owner."""
        raise NotImplementedError

    def prefetch(self, plan: Plan) -> None:
        raise RuntimeError(f"prefetch needs colocated factories (this store is "
                           f"{type(self).__name__}): call speedtorch_ops.colocate(model_factory, "
                           "optimizer_factory) first")

    def settle(self, writing: bool = False) -> None:
        """Before the host reads the tables (or, with `writing`, writes them): wait for the
        store's own transfers and drop what a write would make stale. Here: write-backs queued
        on the current stream of a GPU (they would land after the host's read or write)."""
        wait_for(self.device)


def wait_for(device: torch.device) -> None:
    """The host waits for the work queued so far on the current stream of `device` (on the
    CPU there is none)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@contextlib.contextmanager
def on_stream(stream: Optional["torch.cuda.Stream"], device: torch.device, *used: Tensor):
    """Work queued inside runs on `stream` (a store's transfer stream), after everything queued
    so far on the current stream of `device` (no stream, e.g. without a GPU: here and now); the
    tensors `used` (allocated on the current stream) are marked as used there, so the allocator
    does not hand their memory on before that work ran."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    for t in used:
        t.record_stream(stream)


def _index_device(table: Tensor, device: torch.device) -> torch.device:
    """Indices travel with the rows (the ops route by the table's memory); a CUDA table is
    indexed on its own GPU."""
    return table.device if table.is_cuda else device


class SeparateTables(RowStore):
    """A full table per part (SpeedTorch's layout). Batch rows have the tables' dtype unless
    `batch_dtype` says otherwise (then they move through a converting copy)."""

    def __init__(self, tables: Sequence[Tensor], device: torch.device,
                 batch_dtype: Optional[torch.dtype] = None):
        self._tables = list(tables)
        self.device = torch.device(device)
        self.batch_dtype = batch_dtype
        self._last: Optional[Plan] = None

    def tables(self) -> List[Tensor]:
        return list(self._tables)

    def _recent_plans(self):
        return (self._last,)

    def _remember(self, plan: Plan) -> Plan:
        self._last = plan
        return plan

    def _dtype(self) -> torch.dtype:
        return self.batch_dtype or self._tables[0].dtype

    def _one_swap(self) -> bool:
        """One optimizer_state_swap moves every part: the batch keeps the tables' dtype and the
        batch's device can exchange rows with every table."""
        return all(t.dtype == self._dtype() and (not t.is_cuda or t.device == self.device)
                   for t in self._tables)

    def load(self, plan: Plan, out: Optional[Sequence[Tensor]] = None) -> List[Tensor]:
        if not self._tables:
            return []
        plan.check(self._tables[0].shape[0])
        shape, dtype = (len(plan), *self._tables[0].shape[1:]), self._dtype()
        rows = list(out) if out is not None else []
        if len(rows) != len(self._tables) or any(
                tuple(r.shape) != shape or r.dtype != dtype or r.device != self.device
                for r in rows):
            rows = [torch.empty(shape, dtype=dtype, device=self.device) for _ in self._tables]
        if self._one_swap():
            ops.optimizer_state_swap(self._tables, rows, None,
                                     plan.on(_index_device(self._tables[0], self.device)),
                                     bounds_check=_NO_WAIT)
        else:
            for table, r in zip(self._tables, rows):
                got = ops.pinned_gather(table, plan.on(_index_device(table, self.device)),
                                        bounds_check=_NO_WAIT)
                r.copy_(got, non_blocking=True)
        return rows

    def write_back(self, plan: Plan, rows: Sequence[Tensor], owners: bool = True) -> None:
        """With `owners` (training), every slot of a row writes its owner's values; without
        (plain row writes), the last duplicate wins."""
        if not self._tables:
            return
        plan.check(self._tables[0].shape[0])
        if owners:
            rows = [r.detach()[plan.owner.to(r.device)] for r in rows]
        else:
            rows = [r.detach() for r in rows]
        if self._one_swap():
            moved = [r.to(self.device, t.dtype) for r, t in zip(rows, self._tables)]
            ops.optimizer_state_swap(self._tables, moved,
                                     plan.on(_index_device(self._tables[0], self.device)), None,
                                     bounds_check=_NO_WAIT)
            return
        for table, r in zip(self._tables, rows):
            where = _index_device(table, r.device)
            ops.pinned_scatter(table, plan.on(where), r.to(where, table.dtype),
                               bounds_check=_NO_WAIT)


class _Batch:
    """One batch's rows on the device: buf[k] part k, each (slots, *row) and contiguous (so
    fused and foreach optimizers take their fast paths)."""

    def __init__(self, plan: Plan, buf: Tensor, stale_from: Optional["_Batch"] = None):
        self.plan = plan
        self.buf = buf
        self.stale_from = stale_from  # the batch not yet written back when this one was loaded
        self.ready: Optional[torch.cuda.Event] = None
        self.written = False


class ColocatedRows(RowStore):
    """The parts of a row side by side in one host table of shape (rows, parts, *row): one
    transfer each way moves a row's weight and optimizer state together.

    Zero-copy reads of random rows over multi-GiB host tables are limited by a row rate rather
    than by bytes, so fewer, larger rows move faster (docs/decisions.md, "The demo's colocated
    rows").

    ``prefetch(plan)`` loads a later batch on a transfer stream while the current one trains;
    write-backs run on that stream too. Rows the two batches share are stale in the prefetched
    copy and are copied from the current batch's updated rows on the device when it is taken
    in. Ordering (CUDA): the transfer stream waits for the current stream before each transfer,
    and the current stream waits for a prefetched batch's load before using it. A write-back is
    ordered before later loads but not before later work on the current stream: read the host
    table through ``tables()`` after ``settle()``."""

    def __init__(self, host: Tensor, device: torch.device):
        if host.dim() < 3:
            raise ValueError("ColocatedRows: host must have shape (rows, parts, *row)")
        self.host = host
        self.device = torch.device(device)
        self.parts = host.shape[1]
        self.row_shape = tuple(host.shape[2:])
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.current: Optional[_Batch] = None
        self.pending: Optional[_Batch] = None  # prefetched, not yet taken in
        self._pool: list = []
        self._flat = host.view(host.shape[0], -1)  # whole rows
        # A table no kernel can address (pageable) with rows on a GPU moves whole rows through
        # the public ops, which route it through CPU threads; every other table through
        # _sorted_transfer, split into contiguous parts on the device.
        self._whole_rows = self.device.type == "cuda" and not is_zero_copy_usable(host)

    def tables(self) -> List[Tensor]:
        return [self.host[:, k] for k in range(self.parts)]

    def _recent_plans(self):
        return (self.current.plan if self.current is not None else None,
                self.pending.plan if self.pending is not None else None)

    # ---- buffers and streams -----------------------------------------------------------

    def _buffer(self, n: int) -> Tensor:
        """A device buffer of n rows other than the current batch's, reused across steps. Earlier
        uses of a reused buffer are ordered before the new one: on the transfer stream, which
        waits for the current stream first; or on the current stream, which waits for the
        transfer stream before a load of its own."""
        busy = self.current.buf if self.current is not None else None
        for buf in self._pool:
            if buf.shape[1] == n and buf is not busy:
                return buf
        # Batches of another size: keep the current batch's buffer and this size's only.
        self._pool = [b for b in self._pool if b is busy or b.shape[1] == n]
        buf = torch.empty((self.parts, n, *self.row_shape), dtype=self.host.dtype,
                          device=self.device)
        self._pool.append(buf)
        return buf

    def _gather(self, batch: _Batch) -> None:
        """Load the batch's rows: each distinct row read once, whole, in address order."""
        if self._whole_rows:
            rows = torch.empty((batch.buf.shape[1], self._flat.shape[1]), dtype=self.host.dtype,
                               device=self.device)
            ops.pinned_gather_into(self._flat, batch.plan.on(self.device), rows,
                                   bounds_check=_NO_WAIT)
            batch.buf.copy_(rows.view(-1, self.parts, *self.row_shape).transpose(0, 1))
            return
        ops._sorted_transfer(self.host, batch.buf.unbind(0), *batch.plan.sorted, load=True,
                             bounds_check=_NO_WAIT)

    def _scatter(self, batch: _Batch) -> None:
        """Write the batch's rows back: each distinct row once, from its owner slot."""
        plan = batch.plan
        if self._whole_rows:  # every slot writes its owner's values
            owner = plan.owner
            rows = batch.buf[:, owner].transpose(0, 1).reshape(len(plan), -1)
            ops.pinned_scatter(self._flat, plan.on(self.device), rows, bounds_check=_NO_WAIT)
            return
        ops._sorted_transfer(self.host, batch.buf.unbind(0), plan.sorted[0], plan.owner_sorted,
                             load=False, bounds_check=_NO_WAIT)

    # ---- a step ---------------------------------------------------------------------------

    def prefetch(self, plan: Plan) -> None:
        if self.pending is not None and self.pending.plan is plan:
            return
        plan.check(self.host.shape[0])
        self.pending = None
        current = self.current
        stale = current if current is not None and not current.written else None
        batch = _Batch(plan, self._buffer(len(plan)), stale_from=stale)
        # The sort runs on the current stream, the transfer that uses it on the transfer stream.
        used = () if self._whole_rows else plan.sorted
        with on_stream(self.stream, self.device, batch.buf, *used):
            self._gather(batch)
            if self.stream is not None:
                batch.ready = self.stream.record_event()
        self.pending = batch

    def load(self, plan: Plan, out: Optional[Sequence[Tensor]] = None) -> List[Tensor]:
        """The plan's rows: the prefetched copy (patched) or a fresh load. A second call for the
        current batch (the other factory of a colocated pair) returns the same tensors."""
        if self.current is not None and self.current.plan is plan and not self.current.written:
            return list(self.current.buf.unbind(0))
        plan.check(self.host.shape[0])
        batch, self.pending = self.pending, None
        if batch is not None and batch.plan is plan:
            if batch.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(batch.ready)
            if batch.stale_from is not None and batch.stale_from.written:
                self._patch(batch, batch.stale_from)
        else:
            batch = _Batch(plan, self._buffer(len(plan)))
            if self.stream is not None:  # write-backs queued on the transfer stream land first
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._gather(batch)
        batch.stale_from = None
        self.current = batch
        return list(batch.buf.unbind(0))

    def write_back(self, plan: Plan, rows: Sequence[Tensor] = ()) -> None:
        """Write the current batch (its own tensors, which `load` returned and the optimizer
        updated in place) into the host table: each distinct row once, from its owner slot. A
        second call for the same batch does nothing."""
        batch = self.current
        if batch is None or batch.plan is not plan:
            raise ValueError("write_back: these ids are not the batch loaded last by this store")
        if batch.written:
            return
        # The sort and the owners are computed on the current stream, used on the transfer one.
        used = (plan.owner,) if self._whole_rows else (*plan.sorted, plan.owner_sorted)
        with on_stream(self.stream, self.device, batch.buf, *used):
            self._scatter(batch)
        batch.written = True

    def _patch(self, batch: _Batch, older: _Batch) -> None:
        """Rows of `batch` that `older` also holds take older's updated values (the row's owner
        slot: its first slot, which the stable sort puts first). Found on the device by binary
        search in older's sorted ids (a host-side row -> slot map costs random accesses into a
        map as large as the table's row count, every step)."""
        sorted_ids, perm = older.plan.sorted
        idx = batch.plan.on(self.device)
        if sorted_ids.numel() == 0 or idx.numel() == 0:
            return
        pos = torch.searchsorted(sorted_ids, idx).clamp_(max=sorted_ids.numel() - 1)
        hit = (sorted_ids[pos] == idx).view(1, -1, *([1] * len(self.row_shape)))
        batch.buf.copy_(torch.where(hit, older.buf.index_select(1, perm[pos]), batch.buf))

    def settle(self, writing: bool = False) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        if writing:
            self.pending = None
