"""Colocated rows and prefetch (an extension of SpeedTorch's factories, opt-in with
``speedtorch_ops.colocate``).

A model factory and its optimizer factory normally keep one host table each: a batch row's weight
and its optimizer state sit in separate multi-GiB tables, and each step moves them in separate
transfers. Colocated, they share one host table of shape (rows, 1 + states, dim): a row's weight
and its state are adjacent (1.5 KiB for Adam at dim 128), so one transfer moves them together;
the factories' tables become views of it (``CUPYcorpus`` is ``table[:, 0]``, the optimizer's
tables ``table[:, 1 + k]``). Zero-copy reads of random rows over multi-GiB host tables are limited
by a row rate rather than by bytes (PERF.md), so fewer, larger rows move faster: on the H100,
49,152 rows of weight + Adam state from 2 GiB tables took 2.11 ms as three 512 B tables and 1.71
ms as one 1536 B table (bench/probes/layout.py, 2026-11-22).

Colocated factories can also ``prefetch`` the next batch: its rows load on a transfer stream
while the current batch trains, and the write-back runs on that stream too, while the next batch
trains. Rows the two batches share are stale in the prefetched copy (loaded before the current
batch was written back); when the next batch is taken in, they are copied from the current
batch's updated rows on the device. The device holds at most three batches' rows.

Ordering (CUDA): the transfer stream waits for the work queued on the current stream before each
transfer (so call ``prefetch`` right after ``beforeForwardPass``, before the step's compute is
queued, for the load to overlap it), and the current stream waits for a prefetched batch's load
before using it. A write-back is ordered before later loads, but not before later work on the
current stream: read the host tables only through the factories' methods (they wait) or after
``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from . import _switch as sw
from . import ops


class _Batch:
    """One batch's rows on the device: buf[0] the weight, buf[1 + k] the k-th state tensor, each
    (slots, dim) and contiguous (so fused and foreach optimizers take their fast paths)."""

    def __init__(self, plan: sw.Plan, buf: Tensor, stale_from: Optional["_Batch"] = None):
        self.plan = plan
        self.buf = buf
        self.stale_from = stale_from  # the batch not yet written back when this one was loaded
        self.ready: Optional[torch.cuda.Event] = None
        self.written = False


class SharedRows:
    """The shared host table of a model factory and (optionally) its optimizer factory, and the
    batches of rows on the device."""

    def __init__(self, model_factory, optimizer_factory=None):
        from .factories import _ModelSwitcher, _OptimizerSwitcher

        if not isinstance(model_factory, _ModelSwitcher):
            raise TypeError("colocate: model_factory must be a model factory (e.g. ModelFactory)")
        if optimizer_factory is not None and not isinstance(optimizer_factory, _OptimizerSwitcher):
            raise TypeError("colocate: optimizer_factory must be an optimizer factory "
                            "(e.g. OptimizerFactory) or None")
        mf, of = model_factory, optimizer_factory
        for f in (mf, of):
            if f is None:
                continue
            if getattr(f, "_rows", None) is not None:
                raise ValueError(f"colocate: this {type(f).__name__} is already colocated")
            if f._placement not in ("pinned", "cpu", "cuda"):
                raise ValueError(f"colocate: {type(f).__name__} keeps its table in "
                                 f"{f._placement!r} storage; only pinned, CPU and CUDA stores "
                                 "can share one table")
        shape = (mf.total_classes, mf.embed_dimension)
        weight_table = getattr(mf, mf._attr, None)  # None: colocated before its init method
        weight = mf._weight()
        if weight.dtype != mf._dtype:
            raise ValueError(f"colocate: the model's weight is {weight.dtype} but the table is "
                             f"{mf._dtype}; they must match (the batch's rows become the weight "
                             "without a copy)")
        keys: list = []
        states: Optional[list] = None
        if of is not None:
            if of._param is not weight:
                raise ValueError("colocate: the optimizer factory's variable is not this model "
                                 "factory's weight")
            if of._placement != mf._placement:
                raise ValueError(f"colocate: the stores must be in the same place, got "
                                 f"{mf._placement!r} and {of._placement!r}")
            if (of.total_classes, of.embed_dimension) != shape or of._dtype != mf._dtype:
                state_shape = (of.total_classes, of.embed_dimension)
                raise ValueError(f"colocate: the state tables are {state_shape} {of._dtype}, "
                                 f"the weight table {shape} {mf._dtype}; they must match")
            keys = list(of.optVarList)
            states = getattr(of, of._attr, None) if keys else None
        self.device = weight.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.current: Optional[_Batch] = None
        self.pending: Optional[_Batch] = None  # prefetched, not yet taken in
        self.width = 1 + len(keys)
        self.dim = shape[1]
        # Zeros, or the tables' current contents (then both exist for a moment).
        self.host = sw.allocate((shape[0], self.width, self.dim), mf._dtype, mf._placement)
        if weight_table is not None:
            self.host[:, 0].copy_(weight_table)
            setattr(mf, mf._attr, self.column(0))
        for k, key in enumerate(keys):
            if states is not None:
                self.host[:, 1 + k].copy_(states[k])
            else:
                self.host[:, 1 + k].fill_(of._fills[key])
        if states is not None:
            setattr(of, of._attr, [self.column(1 + k) for k in range(len(keys))])
        self.flat = self.host.view(shape[0], self.width * self.dim)  # whole rows
        # A pageable table with rows on a GPU moves through CPU threads (the public ops' hybrid
        # path, whole rows); every other store through _sorted_transfer.
        self._through_cpu = sw.hybrid(self.flat, self.device)
        self.model_factory, self.optimizer_factory = mf, of
        self._pool: list = []
        mf._rows = self
        if of is not None:
            of._rows = self

    def column(self, k: int) -> Tensor:
        """The host table of part k: 0 the weight, 1 + j the optimizer's j-th state tensor."""
        self.settle(writing=True)
        return self.host[:, k]

    # ---- buffers ------------------------------------------------------------------------

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
        buf = torch.empty((self.width, n, self.dim), dtype=self.host.dtype, device=self.device)
        self._pool.append(buf)
        return buf

    @contextlib.contextmanager
    def _on_transfer_stream(self, *used: Tensor):
        """Work queued inside runs on the transfer stream, after everything queued so far on
        the current stream (without a GPU: here and now); the tensors `used` (allocated on the
        current stream) are marked as used there."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        for t in used:
            t.record_stream(self.stream)

    def _sorted_ids(self, plan: sw.Plan):
        """The plan's sorted ids and slots, for _sorted_transfer, or None where the rows move
        through CPU threads. Sorted on the current stream: call before entering the transfer
        stream."""
        return None if self._through_cpu else plan.sorted

    def _gather(self, batch: _Batch, by_sort) -> None:
        """Load the batch's rows: each distinct row read once, whole, in address order."""
        with ops.host_validated():
            if by_sort is None:
                rows = torch.empty((batch.buf.shape[1], self.width * self.dim),
                                   dtype=self.host.dtype, device=self.device)
                ops.pinned_gather_into(self.flat, batch.plan.cpu, rows)
                batch.buf.copy_(rows.view(-1, self.width, self.dim).transpose(0, 1))
            else:
                ops._sorted_transfer(self.host, batch.buf.unbind(0), *by_sort, load=True)

    # ---- the factories' calls -------------------------------------------------------------

    def prefetch(self, plan: sw.Plan) -> None:
        """Start loading the rows of `plan` for a later beforeForwardPass with the same ids."""
        if self.pending is not None and self.pending.plan is plan:
            return
        plan.check(self.flat.shape[0])
        self.pending = None
        current = self.current
        stale = current if current is not None and not current.written else None
        batch = _Batch(plan, self._buffer(plan.cpu.numel()), stale_from=stale)
        by_sort = self._sorted_ids(plan)
        with self._on_transfer_stream(batch.buf, *(by_sort or ())):
            self._gather(batch, by_sort)
            if self.stream is not None:
                batch.ready = self.stream.record_event()
        self.pending = batch

    def load(self, plan: sw.Plan) -> None:
        """Make the rows of `plan` the batch: the prefetched copy (patched) or a fresh load.
        The pair's second call for the same batch does nothing."""
        if self.current is not None and self.current.plan is plan and not self.current.written:
            return
        plan.check(self.flat.shape[0])
        batch, self.pending = self.pending, None
        if batch is not None and batch.plan is plan:
            if batch.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(batch.ready)
            if batch.stale_from is not None and batch.stale_from.written:
                self._patch(batch, batch.stale_from)
        else:
            batch = _Batch(plan, self._buffer(plan.cpu.numel()))
            if self.stream is not None:  # write-backs queued on the transfer stream land first
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._gather(batch, self._sorted_ids(plan))
        batch.stale_from = None
        self.current = batch
        self._install(batch)

    def write_back(self, plan: sw.Plan) -> None:
        """Write the batch's rows (weight and state; each row's owner slot) into the table.
        The pair's second call does nothing."""
        batch = self.current
        if batch is None or batch.plan is not plan:
            raise ValueError("afterOptimizerStep: these ids are not the batch loaded by the last "
                             "beforeForwardPass of these colocated factories")
        if batch.written:
            return
        by_sort = self._sorted_ids(plan)  # and the owners: on the current stream
        owners = plan.owner if by_sort is None else plan.owner_sorted
        with self._on_transfer_stream(batch.buf, owners, *(by_sort or ())), ops.host_validated():
            if by_sort is None:  # through CPU threads: every slot writes its owner's values
                rows = batch.buf[:, owners].transpose(0, 1).reshape(-1, self.width * self.dim)
                ops.pinned_scatter(self.flat, plan.cpu, rows)
            else:  # each distinct row once, from its owner slot
                ops._sorted_transfer(self.host, batch.buf.unbind(0), by_sort[0], owners,
                                     load=False)
        batch.written = True

    def _install(self, batch: _Batch) -> None:
        """The batch's columns become the model's weight and the optimizer's state tensors."""
        self.model_factory._weight().data = batch.buf[0]
        of = self.optimizer_factory
        if of is not None and of.optVarList:
            state = of.given_optimizer.state[of._param]
            for k, key in enumerate(of.optVarList):
                state[key] = batch.buf[1 + k]

    def _patch(self, batch: _Batch, older: _Batch) -> None:
        """Rows of `batch` that `older` also holds take older's updated values (the row's owner
        slot: its first slot, which the stable sort puts first). Found on the device by binary
        search in older's sorted ids. (A host-side row -> slot map cost ~2.9 ms per step on the
        H100 VM for 4 M rows: random accesses into 16 MB; bench/probes/prefetch_host.py.)"""
        sorted_ids, perm = older.plan.sorted
        idx = batch.plan.on(self.device)
        if sorted_ids.numel() == 0 or idx.numel() == 0:
            return
        pos = torch.searchsorted(sorted_ids, idx).clamp_(max=sorted_ids.numel() - 1)
        hit = (sorted_ids[pos] == idx).view(1, -1, 1)
        batch.buf.copy_(torch.where(hit, older.buf.index_select(1, perm[pos]), batch.buf))

    def settle(self, writing: bool = False) -> None:
        """Before the host reads the tables: wait for the transfers. Before it writes them: also
        forget the prefetched batch (it would be stale)."""
        if self.stream is not None:
            self.stream.synchronize()
        if writing:
            self.pending = None


def colocate(model_factory, optimizer_factory=None) -> SharedRows:
    """Keep the rows of ``model_factory``'s table and ``optimizer_factory``'s state tables side by
    side in one host table, moved together by one transfer each way, and enable ``prefetch`` on
    both factories. Call it right after constructing the factories: their init methods
    (``uniformDistributionInit``, ``optInit``, ...) then fill the shared table. Called after
    them, it copies the tables' contents in (both layouts exist for a moment). Pinned, CPU and
    CUDA stores; the model's weight must have the table's dtype."""
    return SharedRows(model_factory, optimizer_factory)
