"""Embedding modules whose tables live in host memory: ``HostEmbedding`` (like ``nn.Embedding``)
and ``HostEmbeddingBag`` (like ``nn.EmbeddingBag``), each with its own optimizer.

    emb = HostEmbedding(num_embeddings, dim, optimizer=torch.optim.Adam,
                        optimizer_kwargs={"lr": 1e-3}, device="cuda", cache_bytes=2**30)
    out = emb(ids)              # (*ids.shape, dim)
    loss.backward()
    emb.step()                  # the touched rows and their optimizer state are updated

The full table and its per-row optimizer state sit side by side in one pinned host table (rows,
1 + states, dim) (ordinary memory on a machine without a GPU); state that holds one value per
row (``speedtorch_ops.optim.RowWiseAdagrad``) is packed after the row's weight instead, so its
rows are (1, dim + 1 rounded up to 16 bytes). A forward stages the distinct rows
of its ids, with their state, on the device (from a GPU row cache when ``cache_bytes`` allows
one, else from the host); ``step()`` updates those rows and commits them: in one fused kernel
for SGD, Adagrad, RowWiseAdagrad, Adam and AdamW (``fused``; a cached row is updated in its
slot), by the torch optimizer's own step for the others.

Update rule ("lazy"): only the rows a step touched change, each with the sum of its gradients;
per-table scalars such as Adam's ``step`` are global. So SGD equals SGD on the full table, and
Adam equals torch's Adam formula applied to the touched rows only (SparseAdam's rule up to where
it adds eps). A step is one forward (pass every id tensor of the step to that one call:
``emb(ids_a, ids_b)`` returns one output each), one backward, one ``step()``. A forward under
``torch.no_grad()``, in eval mode or of a frozen module only reads. A forward while an earlier
forward's rows are still staged (an exception between a forward and its ``step()``) drops them
first, writing nothing; the dropped forward's outputs then refuse their backward. ``discard()``
drops them explicitly. The tables are not ``nn.Parameter``s (the module updates them itself, as
FBGEMM's fused embeddings do): keep them out of the dense optimizer; ``count_parameters`` and
``clip_grad_norm_`` below see them.

nn's options: ``padding_idx`` (that row's gradient is zero and it never updates; a bag leaves
its entries out), ``max_norm``/``norm_type`` (looked-up rows renormalised in the table, as nn
does, also by a read-only forward), ``scale_grad_by_freq``, ``sparse`` (accepted: the gradient
reaches the optimizer as the touched rows only either way), ``include_last_offset`` and
``mode="max"`` (bags), ``from_pretrained(freeze=True)`` (a frozen module only reads).
``module.to(dtype)``, ``.double()``, ``.half()`` convert the table and its state;
``.to(device)`` moves where the rows are staged (the table stays in host memory).

Ids from the host are checked there (a bad id raises naming it; nothing is written) and
uploaded once. Ids already on the module's GPU stay there: ``bounds_check="raise"`` (default)
checks them on the GPU with one wait, ``"prechecked"`` trusts the caller; with those the
whole step has no host wait and a CUDA graph can capture it (``speedtorch_ops.CapturedStep``).
The same holds for a bag's offsets. Under ``torch.compile`` the forward, ``step()`` and the
other methods that move rows run eagerly (Dynamo does not trace them; the model around them
compiles).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .memory import fill_random_
from .training import optim_state
from .training.cache import CachedRows, Distinct, HostRows, Stat
from .training.fused import FusedUpdate
from .training.placement import allocate, resolve_dtype, upload
from .training.plan import _INTEGER, Plan, check_bounds_mode

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Optimizer state that holds squared gradients (or their sums): float16 cannot keep it.
_SQUARED_STATE = ("exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "acc_delta")
_STARTED = "momentum_started"  # the module's own optimizer state: SGD's first step has run
# The module's own optimizer state of a 16-bit table's stochastic rounding: 0-dim views of its
# (seed, counter), so checkpoints carry them and a resumed run draws as the unbroken one would.
_ROUNDING = ("rounding_seed", "rounding_counter")
# State a checkpoint may lack (one from before it, or from a table without stochastic
# rounding): never missing. The rounding's entries are never unexpected either (a 16-bit
# table's checkpoint loads into a float32 one).
OPTIONAL_STATE = (_STARTED, *_ROUNDING)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _normal_init(weight: Tensor) -> None:
    """nn.Embedding's initialisation, N(0, 1), drawn on all CPU threads for a host table."""
    if weight.device.type == "cpu":
        fill_random_(weight, "normal", 0.0, 1.0)
    else:
        weight.normal_()


_EAGER = "_speedtorch_ops_eager"


def _eager(fn):
    """Mark method `fn` to run eagerly under torch.compile: what moves rows reads host state
    (ids, counts), mutates views of one staging buffer and keeps Python state between calls,
    none of which Dynamo can trace soundly. ``_compile_eagerly`` wraps it in
    ``torch.compiler.disable`` when its class makes its first instance."""
    setattr(fn, _EAGER, True)
    return fn


def _compile_eagerly(cls: type) -> None:
    """Wrap the ``_eager`` methods of `cls` and its bases in ``torch.compiler.disable``, once:
    at a class's first instance (which comes before anything can compile a call of it), not
    at import, since ``torch.compiler.disable`` imports Dynamo, seconds of every process that
    imports the package (spawned DataLoader workers too)."""
    if cls.__dict__.get("_compile_eagerly_done"):
        return
    for klass in cls.__mro__:
        for name, value in list(vars(klass).items()):
            if getattr(value, _EAGER, None) is True:
                wrapped = torch.compiler.disable(value, recursive=True)
                setattr(wrapped, _EAGER, "wrapped")
                setattr(klass, name, wrapped)
    cls._compile_eagerly_done = True


@dataclass
class _Staged:
    """A training forward's staged step: the buffer (parts, n + spare, width) whose first
    ``distinct.count`` rows are the step's distinct rows with their state, the distinct ids,
    and where the padding row sits in it (``pad_at``: its position, ``pad_in``: whether the
    step holds it; both on the device) when the module has a ``padding_idx``."""
    buf: Tensor
    distinct: Distinct
    pad_at: Optional[Tensor] = None
    pad_in: Optional[Tensor] = None


class _Guard(torch.autograd.Function):
    """The staged rows as the outputs see them: an identity whose backward refuses a gradient
    of a forward whose rows were dropped (a later forward, discard()), scales a row's gradient
    by 1 / its count in the batch (``scale_grad_by_freq``) and zeroes the padding row's."""

    @staticmethod
    def forward(ctx, rows, module, generation, counts, pad_at, pad_in):
        ctx.module, ctx.generation = weakref.ref(module), generation
        ctx.save_for_backward(counts, pad_at, pad_in)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        module = ctx.module()
        if module is None or module._generation != ctx.generation:
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


@dataclass
class _GradTail:
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
    """The pieces of ``rows[d.inverse]`` (see _lookup)."""
    index = d.inverse.split(list(sizes)) if len(sizes) > 1 else (d.inverse,)
    if rows.device.type == "cpu" and cache is None:
        return tuple(F.embedding(i, rows) for i in index)  # torch's threads
    return tuple(ops._gather_staged(rows, i, cache, at) for i in index)


def _lookup(rows: Tensor, d: Distinct, sizes: Sequence[int], tail: Optional[_GradTail] = None,
            cache: Optional[Tensor] = None, at: Optional[Tensor] = None) -> tuple:
    """``rows[d.inverse]`` split into pieces of ``sizes`` positions (one tensor each), through
    _Lookup when a gradient may flow; with a ``cache`` (its weight rows) and ``at`` (a slot a
    distinct row), a row whose slot is given is read from the cache (its staged row is not).
    ``tail``: whether the backward writes the gradient's rows past the distinct count (None:
    it does)."""
    if not rows.requires_grad:
        return _gather(rows.detach(), d, sizes, cache, at)
    return _Lookup.apply(rows, d, list(sizes), tail, cache, at)


@dataclass
class _BagInput:
    """A bag forward's checked arguments on the module's device: ``offsets`` (int64; None for a
    2-D input) and ``weights`` (per-sample weights in the table's dtype, or None)."""
    offsets: Optional[Tensor]
    weights: Optional[Tensor]


def _bag_input(input: Tensor, offsets, per_sample_weights, mode: str, include_last_offset: bool,
               device: torch.device, dtype: torch.dtype, check_values: bool) -> _BagInput:
    """nn.EmbeddingBag's checks of a forward's arguments, made before any id moves. Offsets on
    the host are checked there; offsets on a GPU with one wait for it when `check_values`."""
    if input.dtype not in _INTEGER:
        raise TypeError(f"input must hold integer ids, got {input.dtype}")
    if per_sample_weights is not None and mode != "sum":
        raise NotImplementedError(
            f"per_sample_weights is only supported for mode='sum' (got mode={mode!r}), as in "
            "nn.EmbeddingBag")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None for a 2-D input (each row is a bag of fixed "
                             "length)")
    elif input.dim() == 1:
        offsets = _bag_offsets(offsets, input.numel(), include_last_offset, check_values)
        offsets = (upload(offsets, device) if offsets.device.type == "cpu"
                   else offsets.to(device)).to(torch.int64)
    else:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
    if per_sample_weights is not None:
        per_sample_weights = torch.as_tensor(per_sample_weights)
        if per_sample_weights.shape != input.shape:
            raise ValueError(f"per_sample_weights must have input's shape {tuple(input.shape)}, "
                             f"got {tuple(per_sample_weights.shape)}")
        if not per_sample_weights.is_floating_point():
            raise TypeError(f"per_sample_weights must be floating point, got "
                            f"{per_sample_weights.dtype}")
        per_sample_weights = per_sample_weights.to(device, dtype)
    return _BagInput(offsets, per_sample_weights)


def _bag_offsets(offsets, n: int, include_last_offset: bool, check_values: bool) -> Tensor:
    """`offsets` checked as nn.EmbeddingBag checks them for a 1-D input of `n` ids."""
    if offsets is None:
        raise ValueError("offsets is required for a 1-D input (bag b is "
                         "input[offsets[b]:offsets[b + 1]])")
    offsets = torch.as_tensor(offsets)
    if offsets.dim() != 1:
        raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in _INTEGER:
        raise TypeError(f"offsets must be integers, got {offsets.dtype}")
    if include_last_offset and offsets.numel() == 0:
        raise ValueError("offsets must hold at least one entry with include_last_offset=True "
                         "(the end of the last bag)")
    if not check_values or offsets.numel() == 0:
        return offsets
    values = offsets.cpu().numpy().astype(np.int64, copy=False)  # a GPU's offsets: one wait
    if values[0] != 0:
        raise ValueError(f"offsets[0] must be 0 (the first bag starts at the first id), got "
                         f"{int(values[0])}")
    down = np.flatnonzero(np.diff(values) < 0)
    if down.size:
        i = int(down[0]) + 1
        raise ValueError(f"offsets must not decrease: offsets[{i}] = {int(values[i])} follows "
                         f"offsets[{i - 1}] = {int(values[i - 1])}")
    if values[-1] > n:
        raise ValueError(f"offsets[-1] = {int(values[-1])} is past the end of input ({n} ids)")
    return offsets


def _pool(weight: Tensor, index: Tensor, bag: _BagInput, mode: str,
          include_last_offset: bool = False, padding_idx: Optional[int] = None) -> Tensor:
    """The bags of `index` (the input's shape; positions in `weight`) pooled by torch's own
    embedding_bag: nn's sums, means and maxima, and their gradients."""
    return F.embedding_bag(index, weight, bag.offsets, mode=mode,
                           per_sample_weights=bag.weights,
                           include_last_offset=include_last_offset, padding_idx=padding_idx)


def _check_state_dtype(state_dtype, dtype: torch.dtype) -> Optional[torch.dtype]:
    """`state_dtype=` checked against the weights' `dtype`: None (the weights' dtype), float32
    or bfloat16, or the weights' own; float64 tables keep float64 state. Returns the setting a
    module keeps: None where the state follows the weights' dtype (a later conversion takes it
    along)."""
    if state_dtype is None:
        return None
    try:
        state_dtype = resolve_dtype(state_dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"state_dtype: {e}") from None
    if dtype == torch.float64 and state_dtype != torch.float64:
        raise TypeError(f"state_dtype: a float64 table keeps float64 optimizer state, got "
                        f"{state_dtype}")
    if state_dtype not in (torch.float32, torch.bfloat16, dtype):
        raise TypeError(f"state_dtype must be torch.float32, torch.bfloat16, the weights' dtype "
                        f"({dtype}) or None (the weights' dtype), got {state_dtype}")
    return None if state_dtype == dtype else state_dtype


def _state_dtype(setting: Optional[torch.dtype], dtype: torch.dtype) -> torch.dtype:
    """The state's dtype for weights of `dtype`: the setting (state_dtype=: float32 or
    bfloat16), or the weights' where there is none or they are float64 (a conversion such as
    ``.double()`` or ``.half()`` takes the state along where it followed the weights)."""
    return setting if setting is not None and dtype != torch.float64 else dtype


class _HostRowsModule(nn.Module):
    """What both modules share: the host table, the store, staging and the optimizer step."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, *,
                 dtype=torch.float32, optimizer=torch.optim.Adam,
                 optimizer_kwargs: Optional[dict] = None, device=None, cache_bytes: int = 0,
                 bounds_check: str = "raise", stochastic_rounding: Optional[bool] = None,
                 state_dtype=None, _weight: Optional[Tensor] = None, _freeze: bool = False):
        super().__init__()
        _compile_eagerly(type(self))
        check_bounds_mode(bounds_check)
        self.bounds_check = bounds_check
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
            raise TypeError("optimizer must be a torch.optim.Optimizer class, e.g. "
                            f"torch.optim.Adam, got {optimizer!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = self._check_padding_idx(padding_idx)
        if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(
                max_norm, (int, float)) or not max_norm > 0):
            raise ValueError(f"max_norm must be a number > 0 or None, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
            raise ValueError(f"norm_type must be a number, got {norm_type!r}")
        for name, value in (("scale_grad_by_freq", scale_grad_by_freq), ("sparse", sparse)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
        self.scale_grad_by_freq = scale_grad_by_freq
        # Accepted for nn's signature: the optimizer sees the touched rows only either way.
        self.sparse = sparse
        self.frozen = bool(_freeze)
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"weights must have shape ({num_embeddings}, {embedding_dim}), got "
                             f"{tuple(_weight.shape)}")
        if stochastic_rounding is not None and not isinstance(stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be a bool or None, got "
                            f"{stochastic_rounding!r}")
        self._rounding_setting = stochastic_rounding
        self._state_setting = _check_state_dtype(state_dtype, resolve_dtype(dtype))
        self._optimizer_cls = optimizer
        self._optimizer_kwargs = dict(optimizer_kwargs or {})
        self._cache_budget = cache_bytes
        device = torch.device(device) if device is not None else _default_device()
        self._build(resolve_dtype(dtype), device)
        with torch.no_grad():
            if _weight is not None:
                self._table("weight").copy_(_weight)
            else:
                _normal_init(self._table("weight"))
                if self.padding_idx is not None:  # nn's padding row starts at zero
                    self._table("weight")[self.padding_idx].zero_()
        self._seed_rounding()
        self.steps = 0  # step() calls so far
        self._generation = 0  # a training forward's outputs belong to one generation

    def _seed_rounding(self) -> None:
        """A new seed for the stochastic rounding from torch's generator (none without it)."""
        if self._rounding is not None:
            self._rounding[0] = int(torch.randint(0, 2**62, ()))

    def _check_padding_idx(self, padding_idx: Optional[int]) -> Optional[int]:
        """nn's rule: in [-rows, rows), a negative index counting from the end."""
        if padding_idx is None:
            return None
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or not (
                -self.num_embeddings <= padding_idx < self.num_embeddings):
            raise ValueError(f"padding_idx must be an int in [-{self.num_embeddings}, "
                             f"{self.num_embeddings}) (within num_embeddings), got "
                             f"{padding_idx!r}")
        return padding_idx % self.num_embeddings

    def _build(self, dtype: torch.dtype, device: torch.device) -> None:
        """The optimizer, the row layout, the host table (state filled, weight zero) and the
        store, for `dtype` rows staged on `device`."""
        if dtype not in _FLOATING:
            raise TypeError(f"dtype: a table holds floating point rows (float16, bfloat16, "
                            f"float32, float64), got {dtype}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cpu" and self._cache_budget:
            warnings.warn(f"cache_bytes={self._cache_budget} is ignored on the CPU: the table "
                          "already lives in the memory the step runs in", stacklevel=4)
        self.dtype, self.device = dtype, device
        # The optimizer's one parameter: its data is the staged rows' weight part.
        self._rows = torch.zeros((0, self.embedding_dim), dtype=dtype,
                                 device=device).requires_grad_()
        self.optimizer = self._optimizer_cls([self._rows], **self._optimizer_kwargs)
        self._fused = FusedUpdate.of(self.optimizer)
        group = self.optimizer.param_groups[0]
        self._fills, scalars = optim_state.state_layout(self.optimizer, group)
        optim_state.init_state(self.optimizer, self._rows, group, self._fills, scalars)
        self.state_keys = list(self._fills)
        per_row = optim_state.row_state_keys(self.optimizer)
        self.state_dtype = _state_dtype(self._state_setting, dtype)
        # Per-row state is float32 whatever the state dtype (RowLayout).
        squares = [k for k in self.state_keys if k in _SQUARED_STATE and k not in per_row]
        if self.state_dtype == torch.float16 and squares:
            warnings.warn(f"float16 state with {type(self.optimizer).__name__}: its state "
                          f"{squares} holds squared gradients, which fall below float16's range "
                          "(about 6e-8) and then stall or blow up the update; bfloat16 keeps "
                          "float32's range (state_dtype=torch.bfloat16 or torch.float32)",
                          stacklevel=3)
        self.layout = optim_state.RowLayout(
            self.embedding_dim, [k for k in self.state_keys if k not in per_row],
            [k for k in self.state_keys if k in per_row], dtype, self.state_dtype)
        placement = "pinned" if device.type == "cuda" else "cpu"
        self.host = allocate((self.num_embeddings, 1, self.layout.width), torch.uint8,
                             placement)
        self._fill_state()
        # Stochastic rounding of the fused update's 16-bit stores (on by default, as FBGEMM's):
        # (seed, counter) on the device, the counter rising every step. The seed comes from
        # torch's generator (_seed_rounding, after the weights are initialised: a table starts
        # from the same weights with or without it), so torch.manual_seed reproduces a run.
        rounds = (any(dt in (torch.float16, torch.bfloat16)
                      for _, dt, _ in self.layout.fields.values())
                  and self._rounding_setting is not False)
        self._rounding = (torch.zeros(2, dtype=torch.int64, device=device) if rounds else None)
        if rounds:
            state = self.optimizer.state[self._rows]
            state.update(zip(_ROUNDING, self._rounding.unbind()))
        self.store = self._make_store(self._cache_budget)
        self._no_rows = torch.empty((1, 0, self.layout.width), dtype=torch.uint8, device=device)
        self._staged: Optional[_Staged] = None
        self._in_place = False  # see _stage
        self._tail: Optional[_GradTail] = None  # see _lookup_source
        self._spare_at = 0  # the staged rows before the spare ones (see _stage)
        # torch's SGD takes the first step's gradient as the momentum buffer (no dampening);
        # the buffer here exists ahead of that step, so the first step leaves it out. Whether
        # it ran is state (a 0-dim CPU tensor): checkpoints carry it, in-place loads too.
        if isinstance(self.optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
            self.optimizer.state[self._rows][_STARTED] = torch.zeros((), dtype=torch.int64)
        # state_dict's tensors of the optimizer's Python scalars: key -> (tensor, value given)
        self._scalar_views: dict = {}

    def _table(self, name: str) -> Tensor:
        """A view of the host table: "weight" (rows, dim), or a state entry's (rows, dim), or
        (rows,) for state kept per row."""
        return self.layout.of_table(self.host, name)

    def _fill_state(self) -> None:
        for key in self.state_keys:
            self._table(key).fill_(self._fills[key])

    def set_cache_bytes(self, cache_bytes: int) -> None:
        """Change the GPU row cache's budget (0: no cache). The cached rows are written back
        first (this waits for the GPU); the new cache starts empty, its frequencies from zero.
        The old cache's memory is freed: a ``CapturedStep`` that captured this module must not
        replay afterwards (make a new one)."""
        if not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        if self._staged is not None:
            raise RuntimeError("set_cache_bytes between steps only (a forward is staged; "
                               "step() or discard() first)")
        store = self._make_store(cache_bytes)  # raises before anything changes
        self.store.drop_prefetch()
        self.store.flush()
        self.store = store
        self._cache_budget = cache_bytes

    def _make_store(self, cache_bytes: int):
        if cache_bytes == 0 or self.device.type != "cuda":
            return HostRows(self.host, self.device)
        row_bytes = self.host[0].nbytes
        slots = (cache_bytes - CachedRows.index_bytes(self.num_embeddings)) // row_bytes
        if slots < 1:
            raise ValueError(f"cache_bytes={cache_bytes} holds no row: the cache's index takes "
                             f"{CachedRows.index_bytes(self.num_embeddings)} bytes and a row with "
                             f"its optimizer state {row_bytes}; pass 0 for no cache or more bytes")
        # Slots beyond the batch's own rows are what makes a cache; more than the table is waste.
        return CachedRows(self.host, self.device, min(slots, self.num_embeddings))

    # ---- a step --------------------------------------------------------------------------

    @property
    def _training(self) -> bool:
        return torch.is_grad_enabled() and self.training and not self.frozen

    def _stage(self, ids: Sequence, spare: int = 0, lookup_only: bool = False) -> tuple:
        """Stage the distinct rows of all `ids` tensors (a forward's staged rows still there
        are dropped first); returns (the plan, its Distinct, the shapes of the id tensors). A
        training forward keeps them for step(); a read-only one writes back what max_norm
        renormalised, or nothing. `lookup_only`: the forward reads the rows only through
        ``_lookup`` (no bags), which then reads a cached row in its slot when the step updates
        it there: its weight is not staged either (``_in_place``)."""
        self.discard()
        tensors = [torch.as_tensor(i) for i in ids]
        shapes = [t.shape for t in tensors]
        plan = self._plan(tensors)
        direct = self._direct()
        self._in_place = direct and lookup_only
        weight_bytes = self.embedding_dim * self.dtype.itemsize  # at the front of a record
        buf, d = self.store.stage(plan, spare, direct=direct,
                                  weights=0 if self._in_place else weight_bytes)
        # The staged rows the optimizer and the backward see: on the CPU, where the count is
        # known without a wait, the distinct rows only (the rest would cost the optimizer's
        # arithmetic for nothing); on a GPU every position's (fixed shapes, no wait). The spare
        # rows follow them.
        self._spare_at = int(d.count) if self.device.type == "cpu" else d.n
        if self._spare_at < d.n:
            buf = buf.narrow(1, 0, self._spare_at + spare)
        try:
            self._point_at(buf)
            pad_at, pad_in = self._find_padding(d)
            if self.max_norm is not None:
                self._renorm()
        except BaseException:
            self.store.discard()
            self._point_at(self._no_rows)
            raise
        if self._training:
            self._staged = _Staged(buf, d, pad_at, pad_in)
        elif self.max_norm is not None:
            self.store.commit()  # nn renormalises the table under no_grad too
        else:
            self.store.discard()
        return plan, d, shapes

    def _direct(self) -> bool:
        """Whether this forward's cached rows will be updated where they live (their state is
        then not staged and not put back: a third of the bytes for Adam's rows): a training
        forward with the fused update, and none of the options that rewrite staged rows
        (max_norm, padding_idx)."""
        return (self._training and self.fused and self._fused.ready(self.optimizer)
                and self.max_norm is None and self.padding_idx is None)

    def _find_padding(self, d: Distinct) -> tuple:
        """(the position of the padding row among the distinct ids, whether the step holds
        it), on the device; (None, None) without a padding_idx or ids."""
        if self.padding_idx is None or self._spare_at == 0:
            return None, None
        pad = torch.full((1,), self.padding_idx, dtype=torch.int64, device=d.ids.device)
        at = torch.searchsorted(d.key, pad).clamp_(max=self._spare_at - 1)
        return at, d.key[at] == pad

    @torch.no_grad()
    def _renorm(self) -> None:
        """nn's max_norm: each staged row whose norm exceeds it scaled to max_norm (the rows
        past the distinct ones are never moved, whatever this makes of them)."""
        rows = self._rows[:self._spare_at]
        norms = torch.linalg.vector_norm(rows, ord=self.norm_type, dim=1, keepdim=True)
        rows.mul_(torch.where(norms > self.max_norm, self.max_norm / (norms + 1e-7),
                              torch.ones_like(norms)))

    def _lookup_rows(self, index: Tensor, pad_at: Optional[Tensor] = None) -> Tensor:
        """The staged weight rows as a forward reads them through `index` (positions in
        them): in a training forward through the guard (see _Guard); `pad_at`: the padding
        row's staged position, whose gradient the guard zeroes."""
        if self.frozen:
            return self._rows.detach()
        if self._staged is None:
            return self._rows
        empty = index.new_empty(0)
        counts = (torch.zeros(self._rows.shape[0], dtype=self.dtype, device=self.device)
                  .index_add_(0, index.reshape(-1), torch.ones(index.numel(), dtype=self.dtype,
                                                               device=self.device))
                  if self.scale_grad_by_freq else empty.to(self.dtype))
        pad_in = self._staged.pad_in
        if pad_at is None or pad_in is None:
            pad_at, pad_in = empty, empty.to(torch.bool)
        return _Guard.apply(self._rows, self, self._generation, counts, pad_at, pad_in)

    def _point_at(self, buf: Tensor) -> None:
        """The optimizer's parameter and its per-row state become views of `buf` (parts, n,
        width): a step's staged rows, or no rows once the step is done, so the step's buffer
        goes back to the allocator (a CUDA graph's capture cannot reuse it, and within a tight
        GPU budget it needs the room)."""
        with torch.no_grad():  # set_, not .data: autograd then sees the new shape (an empty batch)
            self._rows.set_(self.layout.of_staged(buf, "weight"))
        self._rows.grad = None
        self._tail = None
        state = self.optimizer.state[self._rows]
        for key in self.state_keys:
            state[key] = self.layout.of_staged(buf, key)

    def _plan(self, tensors: list) -> Plan:
        """One plan for the ids of all `tensors` of a step."""
        if self.device.type == "cuda" and all(t.device == self.device for t in tensors):
            # Ids on the module's GPU stay there: no host copy, so a whole training step can
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

    @_eager
    def prefetch(self, ids, *more_ids) -> None:
        """Start loading the rows of the next step's ids (the id tensors its forward will take)
        while this step computes: call it after this step's forward, before its ``step()``
        (or between steps). On a GPU the rows travel on a side stream, overlapping this step's
        backward, update and commit; the next forward takes each row whose id it finds at the
        same place in the sorted distinct ids (compared on the device, so ids on the GPU need
        no wait), and loads the rest (rows this step's commit wrote back or evicted, ids the
        prefetch did not name). Other ids waste the prefetch's bytes and change nothing else.
        Ids are checked here: a bad id raises and nothing is loaded. Inside a captured step
        (``CapturedStep``), between the forward and ``step()``: pass the next step's ids as
        inputs of the step."""
        tensors = [torch.as_tensor(i) for i in (ids, *more_ids)]
        self.store.prefetch(self._plan(tensors))

    @_eager
    def step(self) -> None:
        """Update the rows the last forward touched (and their optimizer state) with their
        gradients, and commit them to the cache or the host table. A frozen module has
        nothing to update: its step() does nothing."""
        staged = self._staged
        if staged is None:
            if self.frozen:
                return
            raise RuntimeError(f"{type(self).__name__}.step(): no forward (in training mode, "
                               "with grad enabled) since the last step")
        if self._rows.grad is not None and isinstance(self.optimizer, torch.optim.SparseAdam):
            self._rows.grad = self._rows.grad.to_sparse(1)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            try:
                self._check_capturable()
            except RuntimeError:
                # The capture fails: its forward is dropped, so the stores' side streams are
                # joined and the capture ends on this error alone.
                self.discard()
                raise
        self._take_scalar_views()
        pad = None
        if staged.pad_at is not None:  # the padding row never updates: kept as staged
            pad = staged.buf.index_select(1, staged.pad_at)
        self._optimizer_step(staged)
        if pad is not None:
            now = staged.buf.index_select(1, staged.pad_at)
            staged.buf.index_copy_(1, staged.pad_at,
                                   torch.where(staged.pad_in.view(1, 1, 1), pad, now))
        self._rows.grad = None
        self._staged = None
        self._generation += 1  # this forward's outputs have had their backward
        self.store.commit()
        self._point_at(self._no_rows)
        self.steps += 1

    def _optimizer_step(self, staged: _Staged) -> None:
        """The optimizer's step on the staged rows, as torch's step would run it: in one fused
        kernel for the optimizers that have one (``fused``), else by torch's optimizer (its
        first SGD step as torch's first step runs)."""
        state = self.optimizer.state[self._rows]
        started = state.get(_STARTED)
        first = started is not None and not bool(started)
        grad = self._rows.grad
        cache, at = self.store.direct_target()
        if self.fused and grad is not None and not grad.is_sparse and self._fused.step(
                self.optimizer, self._rows, staged.buf, staged.distinct.count, self.layout,
                first_step=first, cache=cache, at=at, rounding=self._rounding):
            if first:
                started.fill_(1)
            return
        if cache is not None and grad is not None:  # the hits' state was left in the cache
            raise RuntimeError("step(): this forward staged its cached rows for the fused "
                               "update, which cannot run now (fused_update was turned off, or "
                               "a hyper-parameter became a tensor on a GPU, after the "
                               "forward); nothing was updated. Call discard() and run the step "
                               "again")
        self._settle_grad()  # torch's step reads every row of the gradient
        if ((self._rounding is not None or self.layout.mixed) and grad is not None
                and not grad.is_sparse):
            self._torch_step_in_float32(staged, first)
        else:
            self._torch_step(first and grad is not None)
        if first and grad is not None:
            started.fill_(1)

    def _torch_step(self, first: bool, param: Optional[Tensor] = None) -> None:
        """torch's optimizer step on the staged rows (or on `param`, the optimizer's parameter
        for now); `first`: SGD's first step with momentum, which torch's step takes from the
        gradient (the optimizer sees no buffer)."""
        if not first:
            self.optimizer.step()
            return
        state = self.optimizer.state[self._rows if param is None else param]
        view = state.pop("momentum_buffer")
        try:
            self.optimizer.step()
            view.copy_(state["momentum_buffer"])
        finally:
            state["momentum_buffer"] = view

    def _torch_step_in_float32(self, staged: "_Staged", first: bool) -> None:
        """torch's step for 16-bit weights or state, or fields of several dtypes (torch's
        optimizers take one): on float32 copies of the staged weight, state and gradient,
        given to the optimizer as its parameter for this step, each field stored back in its
        own dtype, rounded stochastically (ops._round_into) as the fused update stores its
        own, or to nearest without stochastic rounding."""
        layout = self.layout
        names = ["weight", *self.state_keys]
        high = {name: layout.of_staged(staged.buf, name).float() for name in names}
        param = high["weight"].requires_grad_()
        param.grad = self._rows.grad.float()
        group = self.optimizer.param_groups[0]
        own = self.optimizer.state.pop(self._rows)
        state = self.optimizer.state[param]
        state.update((key, high[key] if key in self.state_keys else value)
                     for key, value in own.items())
        group["params"] = [param]
        try:
            self._torch_step(first, param)
        finally:
            group["params"] = [self._rows]
            del self.optimizer.state[param]
            # The scalars torch's step changed (a tensor in place, a number replaced) go back.
            own.update((key, value) for key, value in state.items() if key not in self.state_keys)
            self.optimizer.state[self._rows] = own
        with torch.no_grad():
            for name in names:
                low = layout.of_staged(staged.buf, name)
                if self._rounding is None or low.dtype not in (torch.float16, torch.bfloat16):
                    low.copy_(high[name])
                    continue
                rounded = torch.empty_like(high[name], dtype=low.dtype)
                ops._round_into(rounded, high[name], self._rounding)
                self._rounding[1:] += 1  # each field draws anew
                low.copy_(rounded)  # exact: the values are the format's own

    @property
    def fused(self) -> bool:
        """Whether ``step()`` updates the rows in one fused kernel (SGD, Adagrad, Adam, AdamW
        and RowWiseAdagrad with host-number hyper-parameters, and ``fused_update`` on) rather
        than by torch's optimizer. Both give torch's formula."""
        return self.fused_update and self._fused is not None

    # Set False to run torch's own optimizer step even where a fused rule exists.
    fused_update = True

    @property
    def stochastic_rounding(self) -> bool:
        """Whether a step's 16-bit weights and state are stored rounded stochastically (the
        expected stored value is the float32 result): float16 and bfloat16 tables, unless built
        with ``stochastic_rounding=False``. The fused update computes in float32 and rounds its
        stores; torch's own step (the optimizers without a fused rule) runs on a float32 copy
        of the staged rows, stored back rounded the same way."""
        return self._rounding is not None

    @property
    def row_bytes(self) -> int:
        """Bytes a row takes with its optimizer state, in the host table, each transfer and
        each cache slot."""
        return self.host[0].nbytes

    def _check_capturable(self) -> None:
        """A captured step replays GPU work only: state the optimizer keeps on the CPU (a step
        count) would change at the capture and never again."""
        state = self.optimizer.state[self._rows]
        on_host = [k for k, v in state.items()
                   if isinstance(v, Tensor) and v.device.type == "cpu" and k != _STARTED]
        if on_host:
            raise RuntimeError(f"optimizer: {type(self.optimizer).__name__} keeps {on_host} on "
                               "the CPU, which a CUDA graph cannot update; build it with "
                               "capturable=True (where it has it)")

    @_eager
    def discard(self) -> None:
        """Drop the rows a training forward staged, writing nothing (after an exception
        between a forward and its step(): the module is then as before that forward). The
        next forward does this itself. The dropped forward's outputs refuse their backward."""
        self._generation += 1
        if self._staged is not None:
            self._staged = None
            self.store.discard()
            self._point_at(self._no_rows)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the staged rows' gradients (as nn's zero_grad; the staged rows stay: see
        ``discard``)."""
        self._rows.grad = None

    def requires_grad_(self, requires_grad: bool = True) -> "_HostRowsModule":
        """``requires_grad_(False)`` freezes the table (forwards only read; ``step()`` does
        nothing), ``True`` unfreezes it; as nn's for a module's parameters."""
        self.frozen = not requires_grad
        return self

    # ---- conversions ------------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        """nn's conversions (``to``, ``double``, ``half``, ``cuda``, ``cpu``, ...) reach the
        table: a new dtype converts it and its optimizer state, a new device moves where the
        rows are staged (the table stays in host memory)."""
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        if isinstance(probe, Tensor) and (probe.dtype != self.dtype
                                          or probe.device != self.device):
            self._convert(probe.dtype, probe.device)
        return super()._apply(fn, recurse)

    def _convert(self, dtype: torch.dtype, device: torch.device) -> None:
        """The table and its state in `dtype`, staged on `device`: a new host table, optimizer
        (its hyperparameters and scalars carried over) and store (the same budget, empty)."""
        self.discard()
        self.store.drop_prefetch()
        self.flush()
        old = {name: self._table(name) for name in ["weight", *self.state_keys]}
        state = self.optimizer.state[self._rows]
        scalars = {k: v for k, v in state.items() if k not in self.state_keys}
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        self._build(dtype, device)
        self.optimizer.param_groups[0].update(group)
        with torch.no_grad():
            for name, table in old.items():
                self._table(name).copy_(table)
        state = self.optimizer.state[self._rows]
        if not any(key in scalars for key in _ROUNDING):
            self._seed_rounding()  # a new 16-bit table (else the old one's stream carries on)
        for key, value in scalars.items():
            if isinstance(value, Tensor) and isinstance(state.get(key), Tensor):
                state[key].copy_(value)
            elif key not in _ROUNDING:  # a table without stochastic rounding keeps none
                state[key] = value

    # ---- inspection and checkpoints --------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, init: Optional[Callable[[Tensor], object]] = None) -> None:
        """Re-initialise the weight in place (``init(weight)``, default: normal(0, 1) like
        nn.Embedding's, the padding row zero) and the per-row optimizer state; cached copies
        are dropped."""
        self.discard()
        self.store.reset()
        weight = self._table("weight")
        if init is not None:
            init(weight)
        else:
            _normal_init(weight)
            if self.padding_idx is not None:
                weight[self.padding_idx].zero_()
        self._fill_state()

    def flush(self) -> None:
        """Write every cached row to the host table (complete afterwards; waits for the GPU)."""
        self.store.flush()

    @property
    def weight(self) -> Tensor:
        """The full table (a view of the host table; flushed first)."""
        self.flush()
        return self._table("weight")

    def num_parameters(self) -> int:
        """The table's weights (rows x dim): what nn's parameter count would show for it."""
        return self.num_embeddings * self.embedding_dim

    def step_parameters(self) -> list:
        """The tensors whose ``.grad`` holds this step's gradient of the table, between
        backward and ``step()``: the staged rows (the touched rows, each once; the rest of the
        table's gradient is zero). For gradient clipping with the dense parameters (see
        ``clip_grad_norm_``); scaling their ``.grad`` in place scales what ``step()`` applies."""
        self._settle_grad(whole=True)
        return [self._rows]

    def _lookup_source(self) -> dict:
        """_lookup's keyword arguments for the staged step: a fused step reads the gradient's
        rows below the distinct count only, so the rest stays unwritten unless something asks
        for the whole gradient (see _settle_grad); rows updated in their cache slots are read
        there (``_in_place``)."""
        if self._staged is None:
            return {}
        self._tail = _GradTail(zero=not self.fused)
        kwargs = {"tail": self._tail}
        cache, at = self.store.direct_target() if self._in_place else (None, None)
        if cache is not None:  # a store without a cache staged every row whole
            kwargs.update(cache=self.layout.of_staged(cache, "weight"), at=at)
        return kwargs

    def _settle_grad(self, whole: bool = False) -> None:
        """Zero the staged gradient's rows past the distinct count where the lookup's backward
        left them unwritten, before something reads the whole gradient (clipping, torch's own
        optimizer step); `whole`: from now on this step's backward writes them too (the
        gradient may be asked for before the backward, or through torch.autograd.grad)."""
        tail, grad = self._tail, self._rows.grad
        if tail is None:
            return
        tail.zero |= whole
        if tail.unset and grad is not None and self._staged is not None:
            # A lookup's gradient has a row a position (no spare rows): valid marks the live ones.
            live = self._staged.distinct.valid[:grad.shape[0]]
            grad.masked_fill_(~live.view(-1, *([1] * (grad.dim() - 1))), 0)
            tail.unset = False

    def cache_stats(self) -> dict:
        """Counts since construction (reading them waits for the GPU): distinct rows looked up,
        cache hits, rows taken from the host (misses; lookups = hits + host loads), of which a
        ``prefetch`` had loaded ahead, rows prefetches loaded (taken or not), rows written back
        from the cache to make room (a read-only forward's too, whose rows stay cached; counted
        once its step commits or is discarded), misses not admitted to the cache (written back
        by the next step, or a flush), of the misses those the step before had not admitted
        (``deferred_loads``: their values come from the GPU's copy); the hit rate; bytes moved
        over the host link."""
        counts = self.store.counters().tolist()
        out = {stat.name.lower(): int(counts[stat]) for stat in Stat}
        moved = (out["host_loads"] - out["prefetched_loads"] + out["prefetched_rows"]
                 + out["evictions"] + out["direct_writebacks"])
        out.update(hit_rate=out["hits"] / out["lookups"] if out["lookups"] else 0.0,
                   host_bytes=self.row_bytes * moved,
                   cache_bytes=self.store.cached_bytes(),
                   cache_rows=getattr(self.store, "slots", 0))
        return out

    def _scalar_view(self, key: str, value) -> Tensor:
        """The tensor state_dict gives for a Python scalar of the optimizer's (SparseAdam's
        step): kept, so a checkpoint loaded into it in place (torch.distributed.checkpoint's
        load) reaches the optimizer at the next step()."""
        view, _ = self._scalar_views.get(key, (None, None))
        if view is None:
            view = torch.tensor(value)
        else:
            view.fill_(value)
        self._scalar_views[key] = (view, value)  # the tensor and the value it was given
        return view

    def _take_scalar_views(self) -> None:
        """A scalar written into state_dict's tensor since it was given (an in-place load)
        goes to the optimizer."""
        state = self.optimizer.state[self._rows]
        for key, (view, given) in self._scalar_views.items():
            value = view.item()
            if value != given and key in state and not isinstance(state[key], Tensor):
                state[key] = type(state[key])(value)
                self._scalar_views[key] = (view, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.flush()
        destination[prefix + "weight"] = self._table("weight")
        state = self.optimizer.state[self._rows]
        for key in self.state_keys:
            destination[f"{prefix}optimizer.{key}"] = self._table(key)
        self._take_scalar_views()
        for key, value in state.items():
            if key not in self.state_keys:
                # The live tensor (an in-place load restores it); Python scalars a kept view.
                destination[f"{prefix}optimizer.{key}"] = (
                    value.detach() if isinstance(value, Tensor) else self._scalar_view(key, value))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        state = self.optimizer.state[self._rows]
        tables = {"weight": self._table("weight")}
        tables.update({f"optimizer.{key}": self._table(key) for key in self.state_keys})
        scalars = [key for key in state if key not in self.state_keys]
        expected = list(tables) + [f"optimizer.{key}" for key in scalars
                                   if key not in OPTIONAL_STATE
                                   or prefix + f"optimizer.{key}" in state_dict]
        optional = {f"optimizer.{key}" for key in _ROUNDING}  # never unexpected: see _ROUNDING
        # Only this module's keys: missing_keys and error_msgs are the whole model's, and nn
        # passes strict=True here whatever the caller asked (it judges strict itself).
        present = [name for name in expected if prefix + name in state_dict]
        missing_keys.extend(prefix + name for name in expected if name not in present)
        for key in state_dict:  # the module has no children: every key under prefix is its own
            name = key[len(prefix):]
            if key.startswith(prefix) and name not in expected and name not in optional:
                unexpected_keys.append(key)
        errors = []
        for name in present:
            value = state_dict[prefix + name]
            shape = tuple(tables[name].shape) if name in tables else ()
            if not isinstance(value, (Tensor, int, float)) or (
                    name in tables and not isinstance(value, Tensor)) or (
                    isinstance(value, Tensor) and (tuple(value.shape) != shape
                                                   and not (shape == () and value.numel() == 1))):
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                errors.append(f"{prefix + name}: shape {got} in the checkpoint, {shape} here")
        if errors or not present:
            error_msgs.extend(errors)
            return  # nothing of this module written
        self.discard()
        # A state_dict of this module loaded in place (DCP, load_safetensors) is the table
        # itself: nothing to copy, and the cached rows must not be flushed over it.
        in_place = {name for name in present if name in tables
                    and _same_view(state_dict[prefix + name], tables[name])}
        if not all(name in present for name in tables):
            # A partial load keeps the cached rows' latest values of what it does not load.
            kept = {name: tables[name].clone() for name in in_place}
            self.store.flush()
            with torch.no_grad():
                for name, value in kept.items():
                    tables[name].copy_(value)
        self.store.reset()
        with torch.no_grad():
            for name, table in tables.items():
                if name in present and name not in in_place:
                    table.copy_(state_dict[prefix + name])
        for key in scalars:
            name = f"optimizer.{key}"
            if name in present:
                value = state_dict[prefix + name]
                old = state[key]
                if isinstance(old, Tensor):  # in place: a captured step holds this tensor
                    if value is not old:
                        old.copy_(torch.as_tensor(value).reshape(()).to(old.device, old.dtype))
                else:
                    state[key] = type(old)(value.item() if isinstance(value, Tensor) else value)
                    self._scalar_views.pop(key, None)
        if _STARTED in state and f"optimizer.{_STARTED}" not in present and \
                "optimizer.momentum_buffer" in present:
            state[_STARTED].fill_(1)  # a checkpoint from before the flag: a buffer means started

    def _fqn_modifiers(self) -> dict:
        """For torch.distributed.checkpoint's state-dict helpers, which walk each key's dotted
        names as attributes: ``optimizer.<state>`` names no attribute of the optimizer, so
        that walk goes through a stand-in holding every name (``_checkpoint_names``)."""
        return {"optimizer": "_checkpoint_names"}

    @property
    def _checkpoint_names(self):
        keys = list(self.optimizer.state[self._rows])
        return _Names(optimizer=_Names(**{key: None for key in keys}))

    def _extra_repr_options(self) -> list:
        out = []
        if self.padding_idx is not None:
            out.append(f"padding_idx={self.padding_idx}")
        if self.max_norm is not None:
            out.append(f"max_norm={self.max_norm}")
        if self.norm_type != 2.0:
            out.append(f"norm_type={self.norm_type}")
        if self.scale_grad_by_freq:
            out.append("scale_grad_by_freq=True")
        if self.sparse:
            out.append("sparse=True")
        if self.frozen:
            out.append("frozen=True")
        return out

    def extra_repr(self) -> str:
        return ", ".join([f"{self.num_embeddings}, {self.embedding_dim}",
                          *self._extra_repr_options(), f"dtype={self.dtype}",
                          f"optimizer={type(self.optimizer).__name__}", f"device={self.device}",
                          f"cache_bytes={self.store.cached_bytes()}"])

    @classmethod
    def _pretrained(cls, embeddings: Tensor, freeze: bool, kwargs: dict):
        if not isinstance(embeddings, Tensor) or embeddings.dim() != 2:
            raise ValueError(f"embeddings must be a 2-D tensor (rows, dim), got shape "
                             f"{tuple(getattr(embeddings, 'shape', ()))}")
        kwargs.setdefault("dtype", embeddings.dtype)
        return cls(embeddings.shape[0], embeddings.shape[1], _weight=embeddings, _freeze=freeze,
                   **kwargs)


def _same_view(a, b: Tensor) -> bool:
    return (isinstance(a, Tensor) and a.device == b.device and a.dtype == b.dtype
            and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


class _Names:
    """Attributes named after checkpoint keys (see _fqn_modifiers)."""

    def __init__(self, **names):
        self.__dict__.update(names)


class HostEmbedding(_HostRowsModule):
    """``nn.Embedding`` with its table and optimizer state in host memory (see the module
    docstring). ``forward(input, *more_input)``: one output ``(*input.shape, dim)`` per id
    tensor, all of one step.

    Args:
        num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
            sparse: as nn.Embedding's (``sparse`` is accepted and changes nothing).
        dtype: the weights' dtype (float32, bfloat16, float16, float64).
        state_dtype: the optimizer's per-element state's dtype: float32, bfloat16 or None (the
            default: ``dtype``); a float64 table keeps float64 state. State kept one value a
            row (RowWiseAdagrad, PartialRowWiseAdam) is float32 (float64 in a float64 table).
        optimizer, optimizer_kwargs: the torch optimizer class that updates the touched rows,
            and its arguments.
        device: where a step's rows are staged and the outputs live (default: the current
            GPU, else the CPU); the table stays in host memory (pinned with a GPU).
        cache_bytes: the GPU row cache's budget (0: none; ignored on the CPU).
        bounds_check: "raise" (GPU ids checked with one wait) or "prechecked".
        stochastic_rounding: with float16 or bfloat16 weights or state, store the update's
            results rounded stochastically (None, the default: on; False: round to nearest). Seeded
            from torch's generator.

    Example::

        emb = HostEmbedding(1_000_000, 64, optimizer=torch.optim.Adam,
                            optimizer_kwargs={"lr": 1e-3}, device="cuda", cache_bytes=1 << 28)
        out = emb(torch.tensor([[1, 2], [3, 1]]))   # (2, 2, 64)
        out.sum().backward(); emb.step()
    """

    @_eager
    def forward(self, input, *more_input):
        plan, d, shapes = self._stage((input, *more_input), lookup_only=True)
        pad_at = self._staged.pad_at if self._staged is not None else None
        pieces = _lookup(self._lookup_rows(d.inverse, pad_at), d, [s.numel() for s in shapes],
                         **self._lookup_source())
        outs = tuple(p.view(*s, self.embedding_dim) for p, s in zip(pieces, shapes))
        return outs[0] if len(shapes) == 1 else outs

    def _outputs(self, rows: Tensor, shapes: list):
        """Rows of every position (a sharded step's) split into one output per id tensor."""
        outs, start = [], 0
        for shape in shapes:
            n = shape.numel()
            outs.append(rows[start:start + n].view(*shape, self.embedding_dim))
            start += n
        return outs[0] if len(shapes) == 1 else tuple(outs)

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True,
                        padding_idx: Optional[int] = None, max_norm: Optional[float] = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False, **kwargs):
        """A module whose table starts as `embeddings` (rows, dim), like nn.Embedding's: frozen
        unless ``freeze=False`` (nn's default). Other keywords as the constructor's."""
        kwargs.update(padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                      scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        return cls._pretrained(embeddings, freeze, kwargs)


class HostEmbeddingBag(_HostRowsModule):
    """``nn.EmbeddingBag`` with its table and optimizer state in host memory:
    ``forward(input, offsets=None, per_sample_weights=None)`` as nn.EmbeddingBag's (2-D input:
    fixed-length bags; 1-D input with offsets: bag b is input[offsets[b]:offsets[b+1]], the
    last bag running to the end of input unless ``include_last_offset``; an empty bag gives
    zeros). Modes "sum", "mean" and "max"; per-sample weights with "sum".

    Args:
        num_embeddings, embedding_dim, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
            include_last_offset, padding_idx: as nn.EmbeddingBag's.
        dtype, state_dtype, optimizer, optimizer_kwargs, device, cache_bytes, bounds_check,
            stochastic_rounding: as HostEmbedding's.

    Returns (forward): ``(bags, dim)`` on ``device``.

    Example::

        bag = HostEmbeddingBag(1_000_000, 64, mode="sum", optimizer=torch.optim.Adagrad)
        pooled = bag(torch.tensor([4, 2, 9, 9]), torch.tensor([0, 3]))   # (2, 64)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: Optional[float] = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = False, _weight: Optional[Tensor] = None,
                 include_last_offset: bool = False, padding_idx: Optional[int] = None,
                 **kwargs):
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        if mode == "max" and scale_grad_by_freq:
            raise ValueError("max mode does not support scaling the gradient by the frequency "
                             "(as in nn.EmbeddingBag)")
        if not isinstance(include_last_offset, bool):
            raise TypeError(f"include_last_offset must be a bool, got {include_last_offset!r}")
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                         scale_grad_by_freq, sparse, _weight=_weight, **kwargs)
        self.mode = mode
        self.include_last_offset = include_last_offset

    @_eager
    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        input = torch.as_tensor(input)
        on_host = (offsets is None or not isinstance(offsets, Tensor)
                   or offsets.device.type == "cpu")
        bag = _bag_input(input, offsets, per_sample_weights, self.mode, self.include_last_offset,
                         self.device, self.dtype,
                         check_values=on_host or self.bounds_check != "prechecked")
        spare = 0 if self.padding_idx is None else 1
        plan, d, _ = self._stage((input,), spare)
        index, padding = d.inverse, None
        if self.padding_idx is not None:  # its entries point at the spare row, left out
            padding = self._spare_at
            index = torch.where(plan.index == self.padding_idx, padding, index)
        index = index.view(input.shape)
        return _pool(self._lookup_rows(index), index, bag, self.mode, self.include_last_offset,
                     padding)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        extra = f", mode={self.mode!r}" + (", include_last_offset=True"
                                           if self.include_last_offset else "")
        head = f"{self.num_embeddings}, {self.embedding_dim}"
        return head + extra + base[len(head):]

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True,
                        max_norm: Optional[float] = None, norm_type: float = 2.0,
                        scale_grad_by_freq: bool = False, mode: str = "mean",
                        sparse: bool = False, include_last_offset: bool = False,
                        padding_idx: Optional[int] = None, **kwargs):
        """A bag whose table starts as `embeddings` (rows, dim), like nn.EmbeddingBag's: frozen
        unless ``freeze=False`` (nn's default). Other keywords as the constructor's."""
        kwargs.update(max_norm=max_norm, norm_type=norm_type,
                      scale_grad_by_freq=scale_grad_by_freq, mode=mode, sparse=sparse,
                      include_last_offset=include_last_offset, padding_idx=padding_idx)
        return cls._pretrained(embeddings, freeze, kwargs)


def _shards_of(m: nn.Module) -> list:
    """The single-process modules a sharded module keeps this rank's rows in (a sharded
    table's ``shard``, a sharded collection's ``_shards``); none for other modules."""
    shard = getattr(m, "shard", None)
    if isinstance(shard, _HostRowsModule):
        return [shard]
    return list(getattr(m, "_shards", ()))


def _tables(model: nn.Module) -> tuple:
    """(the modules of `model`, itself included, whose tables live in host memory; the sharded
    ones among those, each counted whole and its own shard left out)."""
    sharded = [m for m in model.modules() if _shards_of(m)]
    shards = {id(s) for m in sharded for s in _shards_of(m)}
    single = [m for m in model.modules()
              if isinstance(m, _HostRowsModule) and id(m) not in shards]
    return single, sharded


def host_modules(model: nn.Module) -> Iterator[_HostRowsModule]:
    """The single-process modules of `model` (itself included) whose tables live in host
    memory."""
    return iter(_tables(model)[0])


def count_parameters(model: nn.Module, trainable: bool = False) -> int:
    """`model`'s parameter count with its host tables included (nn's ``parameters()`` does not
    see them: they are not nn.Parameters; a sharded table counts whole). ``trainable``: only
    parameters that require grad and tables that are not frozen (``requires_grad_(False)``
    called on the table module itself: nn's, called on a parent, walks only parameters)."""
    single, sharded = _tables(model)
    dense = sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)
    return (dense + sum(m.num_parameters() for m in single if not (trainable and m.frozen))
            + sum(m.num_parameters() for m in sharded))


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    **kwargs) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over `model`'s parameters and its host tables' step
    gradients (call it between backward and the tables' ``step()``): the total norm counts
    each touched row once with its summed gradient, as the whole table's gradient would, and
    the clipping scales what ``step()`` applies. Returns the total norm."""
    single, sharded = _tables(model)
    if sharded:
        raise ValueError("clip_grad_norm_: a sharded table's gradients reach their owners only "
                         "in its step(), after which clipping is too late; clip the dense "
                         "parameters alone (torch.nn.utils.clip_grad_norm_)")
    params = list(model.parameters())
    for m in single:
        params.extend(m.step_parameters())
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, **kwargs)
