"""The engine of one table whose rows live in host memory, in named parts that every front-end
(``HostEmbedding``, ``HostEmbeddingBag``, the collections' width groups, the sharded modules'
shards) drives through the public calls below:

- the host rows (``table.py:HostTable``): the table and its optimizer state, one record a row;
- the store (``host_rows.py:HostRows`` / ``cache.py:CachedRows``, the GPU row cache): a step's
  distinct rows staged on the device and committed back;
- a step's plan (``plan.py:Plan``, ``host_rows.py:Distinct``): ids checked, sorted once, made
  distinct;
- the update (``update.py:RowUpdate``): the optimizer over the staged rows, fused or torch's;
- the lookup (``lookup.py``): the staged rows at every position, and the backward's segment sum;
- checkpoint I/O (``checkpoint.py``): the table and its state in a ``state_dict``.

A step: ``stage(ids, training)`` (returns a ``Stage``: the plan, the distinct rows, the id
tensors' shapes), ``lookup_rows`` + ``lookup`` (the forward's reads), the caller's backward,
``step()`` (the update, then the store's commit). ``discard()`` drops a staged step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .cache import CachedRows, cache_slots, check_cache_bytes
from .host_rows import Distinct, HostRows, Stat
from .lookup import GradTail, TableRows, guard, lookup, pool
from .optim_state import RowLayout
from .plan import Plan, check_bounds_mode
from .table import HostTable, check_state_dtype, state_dtype_for
from .update import ROUNDING_STATE, RowUpdate


@dataclass
class RowOptions:
    """nn.Embedding's options that change how staged rows are read and updated: the padding
    row (its gradient zero, never updated), ``max_norm`` renormalisation of looked-up rows,
    and a row's gradient scaled by 1 / its count in the batch."""
    padding_idx: Optional[int] = None
    max_norm: Optional[float] = None
    norm_type: float = 2.0
    scale_grad_by_freq: bool = False


@dataclass
class StagedStep:
    """A training forward's staged step: the buffer (parts, n + spare, width) whose first
    ``distinct.count`` rows are the step's distinct rows with their state, the distinct ids,
    and where the padding row sits in it (``pad_at``: its position, ``pad_in``: whether the
    step holds it; both on the device) when there is a ``padding_idx``; ``ids``: the plan's
    ids, where the forward pools the rows in the host table (``RowEngine.stage``'s
    `pool_only`)."""
    buf: Tensor
    distinct: Distinct
    pad_at: Optional[Tensor] = None
    pad_in: Optional[Tensor] = None
    ids: Optional[Tensor] = None


class Stage(NamedTuple):
    """What ``RowEngine.stage`` staged: the step's plan (its ids, ``plan.index``), its distinct
    rows (``distinct.inverse``: each position's row among the staged ones) and the shapes of
    the id tensors it was given."""
    plan: Plan
    distinct: Distinct
    shapes: list


class RowEngine:
    """One table's rows in host memory and everything a step does with them.

    Args:
        rows, dim: the table's shape.
        dtype: the weights' dtype; state_dtype: the state's setting (None: the weights').
        device: where a step's rows are staged (a GPU: the table is pinned).
        optimizer_cls, optimizer_kwargs: the torch optimizer of the touched rows.
        options: nn.Embedding's options (``RowOptions``).
        cache_bytes: the GPU row cache's budget (0: none).
        bounds_check: "raise" or "prechecked", for ids already on the GPU.
        rounding: stochastic rounding of 16-bit stores (None: on where a field is 16-bit).
        weight: initial weights (rows, dim), else normal(0, 1) with the padding row zero.
        name: the owner its errors name (a front-end's class).

    Example::

        engine = RowEngine(1000, 16, torch.float32, torch.device("cpu"), torch.optim.Adam,
                           {"lr": 0.1})
        stage = engine.stage([ids], training=True)
        rows = engine.lookup_rows(stage.distinct.inverse)
        (out,) = engine.lookup(rows, stage.distinct, [ids.numel()])
        out.sum().backward(); engine.step()
    """

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: torch.device,
                 optimizer_cls: type, optimizer_kwargs: dict, *,
                 options: Optional[RowOptions] = None, state_dtype=None, cache_bytes: int = 0,
                 bounds_check: str = "raise", rounding: Optional[bool] = None,
                 weight: Optional[Tensor] = None, name: str = "RowEngine"):
        check_bounds_mode(bounds_check)
        self.name = name  # the owner its messages name
        self.rows, self.dim, self.bounds_check = rows, dim, bounds_check
        self.options = options or RowOptions()
        self.state_setting = check_state_dtype(state_dtype, dtype)
        self.rounding_setting = rounding
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, dict(optimizer_kwargs)
        self.cache_budget = check_cache_bytes(cache_bytes)
        self.frozen = False  # a frozen table only reads
        self.build(dtype, device)
        with torch.no_grad():
            if weight is not None:
                self.table.view("weight").copy_(weight)
            else:
                self.table.reset(padding_idx=self.options.padding_idx)
        self.update.seed_rounding()
        self.steps = 0  # step() calls so far
        self.generation = 0  # a training forward's outputs belong to one generation

    def build(self, dtype: torch.dtype, device: torch.device) -> None:
        """The update, the host rows (state filled, weight zero) and the store, for `dtype`
        rows staged on `device`."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cpu" and self.cache_budget:
            warnings.warn(f"cache_bytes={self.cache_budget} is ignored on the CPU: the table "
                          "already lives in the memory the step runs in", stacklevel=5)
        self.dtype, self.device = dtype, device
        self.update = RowUpdate(self.optimizer_cls, self.optimizer_kwargs, self.dim, dtype,
                                device)
        update = self.update
        state_dtype = state_dtype_for(self.state_setting, dtype)
        update.warn_float16_squares(state_dtype)
        # Per-row state is float32 whatever the state dtype (RowLayout).
        layout = RowLayout(self.dim, update.element_keys,
                           [k for k in update.state_keys if k in update.row_keys], dtype,
                           state_dtype)
        self.table = HostTable(self.rows, layout, device.type == "cuda", update.fills)
        # Stochastic rounding of the fused update's 16-bit stores (on by default, as FBGEMM's).
        # The seed comes from torch's generator after the weights are initialised (a table
        # starts from the same weights with or without it), so torch.manual_seed reproduces a
        # run.
        if (any(dt in (torch.float16, torch.bfloat16) for _, dt, _ in layout.fields.values())
                and self.rounding_setting is not False):
            update.round_stochastically(device)
        self.store = self.make_store(self.cache_budget)
        self._no_rows = torch.empty((1, 0, layout.width), dtype=torch.uint8, device=device)
        self.staged: Optional[StagedStep] = None
        self._in_place = False  # see stage
        self._tail: Optional[GradTail] = None  # see lookup
        self.spare_at = 0  # the staged rows before the spare ones (see stage)

    @property
    def layout(self) -> RowLayout:
        return self.table.layout

    @property
    def fused_update(self) -> bool:
        """Whether a fused rule may run (False: torch's own optimizer step always)."""
        return self.update.fused_enabled

    @fused_update.setter
    def fused_update(self, value: bool) -> None:
        self.update.fused_enabled = value

    @property
    def param(self) -> Tensor:
        """The staged rows' weight: the optimizer's parameter, whose ``.grad`` a backward
        fills."""
        return self.update.param

    def make_store(self, cache_bytes: int):
        """The store for a cache budget: a GPU row cache of what it holds, else the host rows."""
        if cache_bytes == 0 or self.device.type != "cuda":
            return HostRows(self.table.host, self.device)
        slots = cache_slots(cache_bytes, self.rows, self.table.row_bytes)
        return CachedRows(self.table.host, self.device, slots)

    def set_cache_bytes(self, cache_bytes: int) -> None:
        """Change the GPU row cache's budget (0: no cache). The cached rows are written back
        first (this waits for the GPU); the new cache starts empty, its frequencies from zero."""
        check_cache_bytes(cache_bytes)
        if self.staged is not None:
            raise RuntimeError("set_cache_bytes between steps only (a forward is staged; "
                               "step() or discard() first)")
        store = self.make_store(cache_bytes)  # raises before anything changes
        self.store.drop_prefetch()
        self.store.flush()
        self.store = store
        self.cache_budget = cache_bytes

    # ---- a step --------------------------------------------------------------------------

    def check_restage(self) -> None:
        """Raise where a new forward would drop a staged step whose backward already ran: its
        gradient would be lost without a word (nn accumulates a second forward's gradient;
        this engine stages one forward a step)."""
        if self.staged is not None and self.param.grad is not None:
            raise RuntimeError(
                "a second forward before step(): the last forward's rows already hold a "
                "gradient from its backward, which this forward would drop. Gradients do not "
                "accumulate over forwards here: pass every micro-batch's ids to one forward "
                "(HostEmbedding: emb(ids_a, ids_b)), or call step() (or discard(), dropping "
                "that gradient) first")

    def stage(self, ids: Sequence, training: bool, spare: int = 0,
              lookup_only: bool = False, pool_only: bool = False) -> Stage:
        """Stage the distinct rows of all `ids` tensors (a staged step without a gradient yet
        is dropped first; one with a gradient raises: ``check_restage``). A `training` forward
        keeps them for step(); a read-only one writes back what max_norm renormalised, or
        nothing. `spare`: rows after the step's own (a bag's padding). `lookup_only`: the
        forward reads the rows only through ``lookup`` (no bags), which then reads a cached
        row in its slot when the step updates it there: its weight is not staged either.
        `pool_only`: the forward reads them only through ``pool`` (whose per-sample weights
        take no gradient), which on the CPU, where the update writes the host table itself,
        then reads the host rows (``RowLayout.weight_rows``): nothing is staged but the
        gradient's rows (docs/decisions.md, "The CPU step updates the table in place")."""
        self.check_restage()
        self.discard()
        tensors = [torch.as_tensor(i) for i in ids]
        shapes = [t.shape for t in tensors]
        plan = self.plan(tensors)
        direct = self._direct(training)
        self._in_place = direct and (lookup_only or pool_only and self._pools_in_table())
        weight_bytes = self.dim * self.dtype.itemsize  # at the front of a record
        buf, d = self.store.stage(plan, spare, direct=direct,
                                  weights=0 if self._in_place else weight_bytes)
        # Read in place only where the store updates there (a CPU store that took carried rows
        # staged them, and writes them back).
        in_store, _ = self.store.direct_target()
        self._in_place = self._in_place and in_store is not None
        # The staged rows the optimizer and the backward see: on the CPU, where the count is
        # known without a wait, the distinct rows only (the rest would cost the optimizer's
        # arithmetic for nothing); on a GPU every position's (fixed shapes, no wait). The spare
        # rows follow them.
        self.spare_at = int(d.count) if self.device.type == "cpu" else d.n
        if self.spare_at < d.n:
            buf = buf.narrow(1, 0, self.spare_at + spare)
        try:
            self._point_at(buf)
            pad_at, pad_in = self._find_padding(d)
            if self.options.max_norm is not None:
                self._renorm()
        except BaseException:
            self.store.discard()
            self._point_at_nothing()
            raise
        if training:
            self.staged = StagedStep(buf, d, pad_at, pad_in,
                                     plan.index if self._in_place else None)
        elif self.options.max_norm is not None:
            self.store.commit()  # nn renormalises the table under no_grad too
        else:
            self.store.discard()
        return Stage(plan, d, shapes)

    def _direct(self, training: bool) -> bool:
        """Whether this forward's cached rows will be updated where they live (their state is
        then not staged and not put back): a training forward with the fused update, and none
        of the options that rewrite staged rows (max_norm, padding_idx)."""
        return (training and self.update.ready() and self.options.max_norm is None
                and self.options.padding_idx is None)

    def _pools_in_table(self) -> bool:
        """Whether ``pool`` can read this table's rows where they live (the CPU, each record
        whole weight rows) instead of staged ones."""
        return self.device.type == "cpu" and self.layout.weight_rows(self.table.host) is not None

    def _find_padding(self, d: Distinct) -> tuple:
        """(the position of the padding row among the distinct ids, whether the step holds
        it), on the device; (None, None) without a padding_idx or ids."""
        padding_idx = self.options.padding_idx
        if padding_idx is None or self.spare_at == 0:
            return None, None
        pad = torch.full((1,), padding_idx, dtype=torch.int64, device=d.ids.device)
        at = torch.searchsorted(d.key, pad).clamp_(max=self.spare_at - 1)
        return at, d.key[at] == pad

    @torch.no_grad()
    def _renorm(self) -> None:
        """nn's max_norm: each staged row whose norm exceeds it scaled to max_norm (the rows
        past the distinct ones are never moved, whatever this makes of them)."""
        o = self.options
        rows = self.param[:self.spare_at]
        norms = torch.linalg.vector_norm(rows, ord=o.norm_type, dim=1, keepdim=True)
        rows.mul_(torch.where(norms > o.max_norm, o.max_norm / (norms + 1e-7),
                              torch.ones_like(norms)))

    def plan(self, tensors: list) -> Plan:
        """One plan for the ids of all `tensors` of a step."""
        if self.device.type == "cuda" and all(t.device == self.device for t in tensors):
            # Ids on the engine's GPU stay there: no host copy, so a whole training step can
            # be captured in a CUDA graph (with bounds_check="prechecked").
            flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else \
                tensors[0].reshape(-1)
            return Plan.on_device(flat, self.bounds_check)
        if len(tensors) == 1:
            flat = tensors[0].reshape(-1)
        elif all(t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors):
            # NumPy joins host ids without waking torch's CPU thread pool.
            flat = torch.from_numpy(np.concatenate([t.reshape(-1).numpy() for t in tensors]))
        else:
            flat = torch.cat([t.reshape(-1).to(tensors[0].device) for t in tensors])
        return Plan(flat, self.device)

    def lookup_rows(self, index: Tensor, pad_at: Optional[Tensor] = None) -> Tensor:
        """The staged weight rows as a forward reads them through `index` (positions in
        them): in a training forward through the guard (``lookup.guard``); `pad_at`: the
        padding row's staged position, whose gradient the guard zeroes."""
        rows = self.param
        if self.frozen:
            return rows.detach()
        if self.staged is None:
            return rows
        empty = index.new_empty(0)
        counts = (torch.zeros(rows.shape[0], dtype=self.dtype, device=self.device)
                  .index_add_(0, index.reshape(-1), torch.ones(index.numel(), dtype=self.dtype,
                                                               device=self.device))
                  if self.options.scale_grad_by_freq else empty.to(self.dtype))
        pad_in = self.staged.pad_in
        if pad_at is None or pad_in is None:
            pad_at, pad_in = empty, empty.to(torch.bool)
        return guard(rows, self, counts, pad_at, pad_in)

    def lookup(self, rows: Tensor, d: Distinct, sizes: Sequence[int]) -> tuple:
        """The staged `rows` (from ``lookup_rows``) at every position of the step, in pieces of
        `sizes` positions. A fused step reads the gradient's rows below the distinct count
        only, so the backward leaves the rest unwritten unless something asks for the whole
        gradient (``settle_grad``); rows updated in their cache slots are read there."""
        if self.staged is None:
            return lookup(rows, d, sizes)
        self._tail = GradTail(zero=not self.update.fused)
        cache, at = self.store.direct_target() if self._in_place else (None, None)
        if cache is None:  # a store without a cache staged every row whole
            return lookup(rows, d, sizes, self._tail)
        return lookup(rows, d, sizes, self._tail, self.layout.of_staged(cache, "weight"), at)

    def pool(self, rows: Tensor, index: Tensor, lo: int, hi: int, offsets: Tensor, mode: str,
             weights: Optional[Tensor] = None) -> Tensor:
        """Bags of the staged `rows` (from ``lookup_rows``) at the positions lo..hi of `index`
        (the stage's ``distinct.inverse``) pooled, as torch's ``embedding_bag`` with
        ``include_last_offset`` (``lookup.pool``: on the CPU the backward reads the step's
        sort; after a `pool_only` stage it reads the host rows)."""
        staged = self.staged
        d = staged.distinct if staged is not None and staged.distinct.inverse is index else None
        table = None
        if d is not None and staged.ids is not None and self.device.type == "cpu":
            weight, k = self.layout.weight_rows(self.table.host)
            ids = staged.ids[lo:hi]
            table = TableRows(weight, ids * k if k > 1 else ids)
        return pool(rows, index, lo, hi, offsets, mode, weights, d, table)

    def prefetch(self, tensors: list) -> None:
        """Start loading the rows of the next step's ids (see HostEmbedding.prefetch)."""
        self.store.prefetch(self.plan([torch.as_tensor(t) for t in tensors]))

    def step(self) -> None:
        """Update the staged rows with their gradients and commit them (see
        HostEmbedding.step)."""
        staged = self.staged
        if staged is None:
            if self.frozen:
                return
            raise RuntimeError(f"{self.name}.step(): no forward (in training mode, with grad "
                               "enabled) since the last step")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            try:
                self.update.check_capturable()
            except RuntimeError:
                # The capture fails: its forward is dropped, so the stores' side streams are
                # joined and the capture ends on this error alone.
                self.discard()
                raise
        pad = None
        if staged.pad_at is not None:  # the padding row never updates: kept as staged
            pad = staged.buf.index_select(1, staged.pad_at)
        cache, at = self.store.direct_target()
        self.update.step(self.layout, staged.buf, staged.distinct.count, cache, at,
                         self.settle_grad)
        if pad is not None:
            now = staged.buf.index_select(1, staged.pad_at)
            staged.buf.index_copy_(1, staged.pad_at,
                                   torch.where(staged.pad_in.view(1, 1, 1), pad, now))
        self.param.grad = None
        self.staged = None
        self.generation += 1  # this forward's outputs have had their backward
        self.store.commit()
        self._point_at_nothing()
        self.steps += 1

    def _point_at(self, buf: Tensor) -> None:
        """The update's parameter and state become views of `buf`; a new step's gradient tail."""
        self.update.point_at(self.layout, buf)
        self._tail = None

    def _point_at_nothing(self) -> None:
        self._point_at(self._no_rows)

    def discard(self) -> None:
        """Drop the rows a training forward staged, writing nothing. The dropped forward's
        outputs refuse their backward."""
        self.generation += 1
        if self.staged is not None:
            self.staged = None
            self.store.discard()
            self._point_at_nothing()

    def settle_grad(self, whole: bool = False) -> None:
        """Zero the staged gradient's rows past the distinct count where the lookup's backward
        left them unwritten, before something reads the whole gradient (clipping, torch's own
        optimizer step); `whole`: from now on this step's backward writes them too (the
        gradient may be asked for before the backward, or through torch.autograd.grad)."""
        tail, grad = self._tail, self.param.grad
        if tail is None:
            return
        tail.zero |= whole
        if tail.unset and grad is not None and self.staged is not None:
            # A lookup's gradient has a row a position (no spare rows): valid marks the live ones.
            live = self.staged.distinct.valid[:grad.shape[0]]
            grad.masked_fill_(~live.view(-1, *([1] * (grad.dim() - 1))), 0)
            tail.unset = False

    # ---- the table as a whole ------------------------------------------------------------

    def convert(self, dtype: torch.dtype, device: torch.device) -> None:
        """The table and its state in `dtype`, staged on `device`: a new host table, optimizer
        (its hyperparameters and scalars carried over) and store (the same budget, empty)."""
        self.discard()
        self.store.drop_prefetch()
        self.store.flush()
        old_table, old_update = self.table, self.update
        scalars = {k: v for k, v in old_update.state.items() if k not in old_update.state_keys}
        group = {k: v for k, v in old_update.optimizer.param_groups[0].items() if k != "params"}
        self.build(dtype, device)
        self.update.fused_enabled = old_update.fused_enabled
        self.update.optimizer.param_groups[0].update(group)
        self.table.copy_from(old_table)
        state = self.update.state
        if not any(key in scalars for key in ROUNDING_STATE):
            self.update.seed_rounding()  # a new 16-bit table (else the old one's stream goes on)
        for key, value in scalars.items():
            if isinstance(value, Tensor) and isinstance(state.get(key), Tensor):
                state[key].copy_(value)
            elif key not in ROUNDING_STATE:  # a table without stochastic rounding keeps none
                state[key] = value

    def reset(self, init: Optional[Callable[[Tensor], object]] = None) -> None:
        """Re-initialise the weight (see HostTable.reset) and the state; cached copies are
        dropped."""
        self.discard()
        self.store.reset()
        self.table.reset(init, self.options.padding_idx)

    def cache_stats(self) -> dict:
        """The store's counts (see HostEmbedding.cache_stats); reading them waits for the
        GPU."""
        counts = self.store.counters().tolist()
        out = {stat.name.lower(): int(counts[stat]) for stat in Stat}
        moved = (out["host_loads"] - out["prefetched_loads"] + out["prefetched_rows"]
                 + out["evictions"] + out["direct_writebacks"])
        out.update(hit_rate=out["hits"] / out["lookups"] if out["lookups"] else 0.0,
                   host_bytes=self.table.row_bytes * moved,
                   cache_bytes=self.store.cached_bytes(),
                   cache_rows=getattr(self.store, "slots", 0))
        return out
