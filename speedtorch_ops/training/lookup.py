"""A step's forward reads of its staged rows, and their backward: every position's row
(``lookup``), bags of them pooled (``pool``), through a guard that refuses the gradient of a
dropped step (``guard``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from .host_rows import Distinct


class _Guard(torch.autograd.Function):
    """The staged rows as the outputs see them: an identity whose backward refuses a gradient
    of a forward whose rows were dropped (a later forward, discard()), scales a row's gradient
    by 1 / its count in the batch (``scale_grad_by_freq``) and zeroes the padding row's."""

    @staticmethod
    def forward(ctx, rows, owner, generation, counts, pad_at, pad_in):
        ctx.owner, ctx.generation = weakref.ref(owner), generation
        ctx.save_for_backward(counts, pad_at, pad_in)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        owner = ctx.owner()
        if owner is None or owner.generation != ctx.generation:
            raise RuntimeError(
                "backward of a HostEmbedding/HostEmbeddingBag output whose staged rows were "
                "dropped: a later forward (or discard()) came before this output's backward. "
                "A module takes one forward per step (HostEmbedding: pass every id tensor of the "
                "step to one call, emb(ids_a, ids_b); HostEmbeddingBag: put every bag of the "
                "step in one input), then backward, then step()")
        counts, pad_at, pad_in = ctx.saved_tensors
        if counts.numel():
            grad = grad / counts.clamp(min=1).unsqueeze(1)
        if pad_at.numel():
            keep = (~pad_in).to(grad.dtype).view(1, 1)
            grad = grad.index_copy(0, pad_at, grad.index_select(0, pad_at) * keep)
        return grad, None, None, None, None, None


def guard(rows: Tensor, owner, counts: Tensor, pad_at: Tensor, pad_in: Tensor) -> Tensor:
    """`rows` through the guard of `owner`'s current generation (an object with a
    ``generation`` that rises when its staged step is dropped or done)."""
    return _Guard.apply(rows, owner, owner.generation, counts, pad_at, pad_in)


@dataclass
class GradTail:
    """Whether a lookup's backward writes the gradient's rows past the distinct count
    (``zero``, read when the backward runs: a reader of the whole gradient known by then asks
    for it), and whether one left them unwritten (``unset``)."""
    zero: bool
    unset: bool = False


class _Lookup(torch.autograd.Function):
    """The staged rows at every position of a step, ``rows[d.inverse]``, as one output per
    piece of the positions (``sizes``; each its own tensor, no view of another). Its backward
    sums each row's gradients over the positions the step's ``Distinct`` sorted (``perm``,
    ``starts``), reading the outputs' gradients where they are (nothing joins them first): a
    deterministic segment sum (``ops._segment_sum``), no atomics on a hot row's positions and
    no second sort."""

    @staticmethod
    def forward(ctx, rows, d, sizes, tail, cache, at):
        ctx.save_for_backward(d.perm, d.starts, d.count)
        ctx.rows, ctx.tail = rows.shape[0], tail
        return _gather(rows, d, sizes, cache, at)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        perm, starts, count = ctx.saved_tensors
        pieces = [g.reshape(-1, g.shape[-1]).contiguous() for g in grads]
        tail = ctx.tail
        zero = tail is None or tail.zero
        if not zero:
            tail.unset = True
        return (ops._segment_sum(pieces, perm, starts, count, ctx.rows, zero),
                None, None, None, None, None)


def _gather(rows: Tensor, d: Distinct, sizes: Sequence[int], cache: Optional[Tensor],
            at: Optional[Tensor]) -> tuple:
    """The pieces of ``rows[d.inverse]`` (see lookup)."""
    index = d.inverse.split(list(sizes)) if len(sizes) > 1 else (d.inverse,)
    if rows.device.type == "cpu" and cache is None:
        return tuple(F.embedding(i, rows) for i in index)  # torch's threads
    return tuple(ops._gather_staged(rows, i, cache, at) for i in index)


def lookup(rows: Tensor, d: Distinct, sizes: Sequence[int], tail: Optional[GradTail] = None,
           cache: Optional[Tensor] = None, at: Optional[Tensor] = None) -> tuple:
    """``rows[d.inverse]`` split into pieces of ``sizes`` positions (one tensor each), through
    _Lookup when a gradient may flow; with a ``cache`` (its weight rows) and ``at`` (a slot a
    distinct row), a row whose slot is given is read from the cache (its staged row is not).
    ``tail``: whether the backward writes the gradient's rows past the distinct count (None:
    it does)."""
    if not rows.requires_grad:
        return _gather(rows.detach(), d, sizes, cache, at)
    return _Lookup.apply(rows, d, list(sizes), tail, cache, at)


class TableRows(NamedTuple):
    """A pooling's rows read where they live: the table as rows of weights (``weight``) and
    the rows of its positions in it (``ids``)."""
    weight: Tensor
    ids: Tensor


class _Pool(torch.autograd.Function):
    """Bags of the staged rows pooled (torch's ``embedding_bag``, sum or mean) over the step's
    positions [lo, hi), or of the same rows where they live in the table (``TableRows``: the
    rows then were not staged). Its backward sums each distinct row's gradient from the bags its
    positions sit in, over the positions the step's ``Distinct`` sorted
    (``ops._bag_segment_sum``): no per-position gradient and no second sort (torch's backward
    sorts the positions again)."""

    @staticmethod
    def forward(ctx, rows, d, lo, hi, offsets, mode, weights, table):
        ctx.save_for_backward(offsets, weights, d.perm, d.starts, d.count)
        ctx.lo, ctx.rows, ctx.mean = lo, rows.shape[0], mode == "mean"
        index, source = (d.inverse[lo:hi], rows) if table is None else (table.ids, table.weight)
        return F.embedding_bag(index, source, offsets, mode=mode, per_sample_weights=weights,
                               include_last_offset=True)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        offsets, weights, perm, starts, count = ctx.saved_tensors
        return (ops._bag_segment_sum(grad.contiguous(), offsets, weights, ctx.mean, perm, starts,
                                     count, ctx.lo, ctx.rows),
                None, None, None, None, None, None, None)


def pool(rows: Tensor, index: Tensor, lo: int, hi: int, offsets: Tensor, mode: str,
         weights: Optional[Tensor] = None, d: Optional[Distinct] = None,
         table: Optional[TableRows] = None) -> Tensor:
    """Bags of ``rows[index[lo:hi]]`` pooled (``mode`` "sum" or "mean"; ``offsets``: each
    bag's first position from lo, then hi - lo; ``weights``: per-sample weights of a sum), as
    torch's ``embedding_bag``. With `d`, the staged step whose ``inverse`` `index` is, the
    backward on the CPU reads the step's sort (``_Pool``); without it, on a GPU, and where the
    weights take a gradient too, torch's own backward runs. With `table` (rows that were not
    staged: `rows` hold only their gradient) the bags read the table's rows."""
    weighs = weights is not None and weights.requires_grad
    if d is not None and rows.requires_grad and rows.device.type == "cpu" and not weighs:
        return _Pool.apply(rows, d, lo, hi, offsets, mode, weights, table)
    if table is None:
        return F.embedding_bag(index[lo:hi], rows, offsets, mode=mode,
                               per_sample_weights=weights, include_last_offset=True)
    if rows.requires_grad:  # the staged rows hold no values to differentiate
        raise RuntimeError("pool: the rows were not staged (stage's pool_only), so per-sample "
                           "weights that take a gradient cannot be pooled")
    return F.embedding_bag(table.ids, table.weight, offsets, mode=mode,
                           per_sample_weights=weights, include_last_offset=True)
