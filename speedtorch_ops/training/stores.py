"""Row stores: where an embedding table's rows live and how a batch's rows move.

A store holds one or more *parts* of the same rows (a weight table and/or its optimizer-state
tables) and moves a batch's rows between them and the device, only through the ops:

    plan = store.plan_for(ids)          # the store's plan of these ids (reused within a step)
    rows = store.load(plan)             # a batch-sized tensor per part: rows[k][i] = part k of ids[i]
    ...                                 # train on rows (the optimizer updates them in place)
    store.write_back(plan, rows)        # each distinct row written once, from its owner slot

Two implementations: ``SeparateTables`` here (SpeedTorch's layout: a full table per part) and
``ColocatedRows`` (``training.positions``: the parts of a row side by side in one host table,
moved by the modules' stores of distinct rows, with their GPU row cache and prefetch). The
callers (the compatible factories) hold a store and delegate to it; a store never reaches into
its callers. Host indices are checked on the host, so the ops run with
``bounds_check='prechecked'`` and never make the host wait.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .. import ops
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
        return self._remember(Plan(ids, self._plan_device()))

    def _plan_device(self) -> torch.device:
        """Where the store's plans keep their ids: where its transfers index the tables."""
        return self.device

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


# The priority of a prefetch's side stream, which loads the next step's rows beside this
# step's backward and update: higher than the step's own. Its kernels are capped to a few SMs;
# at the step's priority the block scheduler handed the SMs to the backward's and the update's
# large grids first, and the loads waited with the link idle. A CUDA graph keeps the priority
# its kernels were captured with (torch instantiates graphs to use each node's priority). A
# cache's lane stays at the step's priority: raised too, it added little to the main job and
# the public benchmark's step, whose lane runs without a prefetch, took longer
# (docs/decisions.md, "The prefetch's stream priority").
PREFETCH_PRIORITY = -1


def prefetch_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """A new side stream for a prefetch on `device` (None off a GPU), at
    ``PREFETCH_PRIORITY``."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=PREFETCH_PRIORITY)


@contextlib.contextmanager
def on_stream(stream: Optional["torch.cuda.Stream"], device: torch.device, *used: Tensor):
    """Work queued inside runs on `stream` (a store's side stream), after everything queued
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
