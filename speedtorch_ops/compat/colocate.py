"""``colocate``: a model factory and its optimizer factory share one host table (an extension of
SpeedTorch's factories, opt-in).

A model factory and its optimizer factory normally keep one host table each: a batch row's weight
and its optimizer state sit in separate multi-GiB tables and move in separate transfers.
Colocated, they share one ``ColocatedRows`` store whose host table has shape
(rows, 1 + states, dim): a row's weight and its state are adjacent (1.5 KiB for Adam at dim 128)
and move together, through the modules' stores of distinct rows (and their GPU row cache, with
``cache_bytes``); the factories' tables become views of it (``CUPYcorpus`` is ``table[:, 0]``,
the optimizer's tables ``table[:, 1 + k]``), and both factories can ``prefetch``.
"""

from __future__ import annotations

import math
from typing import Optional

from ..training.cache import cache_slots, check_cache_bytes
from ..training.placement import allocate
from ..training.positions import ColocatedRows
from .factories import _ModelSwitcher, _OptimizerSwitcher


def _check_pair(mf, of) -> None:
    if not isinstance(mf, _ModelSwitcher):
        raise TypeError("colocate: model_factory must be a model factory (e.g. ModelFactory)")
    if of is not None and not isinstance(of, _OptimizerSwitcher):
        raise TypeError("colocate: optimizer_factory must be an optimizer factory "
                        "(e.g. OptimizerFactory) or None")
    for f in (mf, of):
        if f is None:
            continue
        if isinstance(f.store, ColocatedRows):
            raise ValueError(f"colocate: this {type(f).__name__} is already colocated")
        if f.placement not in ("pinned", "cpu", "cuda"):
            raise ValueError(f"colocate: {type(f).__name__} keeps its table in "
                             f"{f.placement!r} storage; only pinned, CPU and CUDA stores "
                             "can share one table")
    weight = mf.model_weight()
    if weight.dtype != mf.table_dtype:
        raise ValueError(f"colocate: the model's weight is {weight.dtype} but the table is "
                         f"{mf.table_dtype}; they must match (the batch's rows become the weight "
                         "without a copy)")
    if of is None:
        return
    shape = (mf.total_classes, mf.embed_dimension)
    if of.param is not weight:
        raise ValueError("colocate: the optimizer factory's variable is not this model "
                         "factory's weight")
    if of.placement != mf.placement:
        raise ValueError(f"colocate: the stores must be in the same place, got "
                         f"{mf.placement!r} and {of.placement!r}")
    if (of.total_classes, of.embed_dimension) != shape or of.table_dtype != mf.table_dtype:
        state_shape = (of.total_classes, of.embed_dimension)
        raise ValueError(f"colocate: the state tables are {state_shape} {of.table_dtype}, "
                         f"the weight table {shape} {mf.table_dtype}; they must match")


def colocate(model_factory, optimizer_factory=None, cache_bytes: int = 0):
    """Keep the rows of ``model_factory``'s table and ``optimizer_factory``'s state tables side by
    side in one host table, moved together by one transfer each way, and enable ``prefetch`` on
    both factories. Call it right after constructing the factories: their init methods
    (``uniformDistributionInit``, ``optInit``, ...) then fill the shared table. Called after
    them, it copies the tables' contents in (both layouts exist for a moment). Pinned, CPU and
    CUDA stores; the model's weight must have the table's dtype. Returns the shared store.

    ``cache_bytes`` > 0 with the model on a GPU (not in SpeedTorch 0.1.6): a GPU row cache of
    that many bytes (rows with their optimizer state, plus the cache's index of 8 bytes per table
    row) keeps hot rows on the GPU, as the modules' ``cache_bytes``; a step moves only the rows
    it misses and the rows they evict, and a prefetch only the rows the cache does not hold.
    Training is the same as without it. (On the CPU there is no cache, as for the modules.)"""
    mf, of = model_factory, optimizer_factory
    _check_pair(mf, of)
    check_cache_bytes(cache_bytes)
    keys: list = list(of.optVarList) if of is not None else []
    shape = (mf.total_classes, 1 + len(keys), mf.embed_dimension)
    device = mf.model_weight().device
    slots = 0
    if cache_bytes and device.type == "cuda":  # raises before the table is made
        slots = cache_slots(cache_bytes, shape[0], math.prod(shape[1:]) * mf.table_dtype.itemsize)
    # Zeros, or the tables' current contents (then both exist for a moment).
    host = allocate(shape, mf.table_dtype, mf.placement)
    if mf.store is not None:
        (weight,) = mf.tables()
        host[:, 0].copy_(weight)
    states: Optional[list] = of.tables() if of is not None and of.store is not None else None
    for k, key in enumerate(keys):
        if states is not None:
            host[:, 1 + k].copy_(states[k])
        else:
            host[:, 1 + k].fill_(of.fills[key])
    store = ColocatedRows(host, device, slots)
    mf.use_store(store, [0])
    if of is not None:
        of.use_store(store, list(range(1, 1 + len(keys))))
    return store
