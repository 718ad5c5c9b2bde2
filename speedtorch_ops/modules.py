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

from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from .bags import bag_input, pool
from .eager import compile_eagerly, eager
from .training.checkpoint import load_rows, save_rows
from .training.engine import RowEngine, RowOptions
from .training.placement import resolve_dtype
from .training.plan import check_bounds_mode


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_options(num_embeddings: int, embedding_dim: int, padding_idx, max_norm, norm_type,
                   scale_grad_by_freq, sparse) -> RowOptions:
    """nn.Embedding's arguments checked as nn checks them; the options the engine takes."""
    for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if padding_idx is not None and (
            isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
            or not -num_embeddings <= padding_idx < num_embeddings):
        raise ValueError(f"padding_idx must be an int in [-{num_embeddings}, {num_embeddings}) "
                         f"(within num_embeddings), got {padding_idx!r}")
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(
            max_norm, (int, float)) or not max_norm > 0):
        raise ValueError(f"max_norm must be a number > 0 or None, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise ValueError(f"norm_type must be a number, got {norm_type!r}")
    for name, value in (("scale_grad_by_freq", scale_grad_by_freq), ("sparse", sparse)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    return RowOptions(None if padding_idx is None else padding_idx % num_embeddings,
                      None if max_norm is None else float(max_norm), float(norm_type),
                      scale_grad_by_freq)


def _check_engine_args(optimizer, weight, shape, stochastic_rounding) -> None:
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError("optimizer must be a torch.optim.Optimizer class, e.g. "
                        f"torch.optim.Adam, got {optimizer!r}")
    if weight is not None and tuple(weight.shape) != shape:
        raise ValueError(f"weights must have shape {shape}, got {tuple(weight.shape)}")
    if stochastic_rounding is not None and not isinstance(stochastic_rounding, bool):
        raise TypeError(f"stochastic_rounding must be a bool or None, got "
                        f"{stochastic_rounding!r}")


def _option(name: str, doc: str) -> property:
    """An nn option read from (and written to) the engine's ``RowOptions``."""
    return property(lambda self: getattr(self.engine.options, name),
                    lambda self, value: setattr(self.engine.options, name, value), doc=doc)


def _part(path: str, doc: str) -> property:
    """A read-only attribute of the engine's parts (``"store"``, ``"table.host"``, ...)."""
    def get(self):
        value = self.engine
        for name in path.split("."):
            value = getattr(value, name)
        return value
    return property(get, doc=doc)


class _HostRowsModule(nn.Module):
    """The front-end both modules share: nn's arguments, hooks and conversions over one
    ``RowEngine`` (``self.engine``: the host rows, the store, a step's plan, the update,
    checkpoint I/O)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, *,
                 dtype=torch.float32, optimizer=torch.optim.Adam,
                 optimizer_kwargs: Optional[dict] = None, device=None, cache_bytes: int = 0,
                 bounds_check: str = "raise", stochastic_rounding: Optional[bool] = None,
                 state_dtype=None, _weight: Optional[Tensor] = None, _freeze: bool = False):
        super().__init__()
        compile_eagerly(type(self))
        options = _check_options(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                                 scale_grad_by_freq, sparse)
        _check_engine_args(optimizer, _weight, (num_embeddings, embedding_dim),
                           stochastic_rounding)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # Accepted for nn's signature: the optimizer sees the touched rows only either way.
        self.sparse = sparse
        device = torch.device(device) if device is not None else _default_device()
        self.engine = RowEngine(num_embeddings, embedding_dim, resolve_dtype(dtype), device,
                                optimizer, dict(optimizer_kwargs or {}), options=options,
                                state_dtype=state_dtype, cache_bytes=cache_bytes,
                                bounds_check=bounds_check, rounding=stochastic_rounding,
                                weight=_weight, name=type(self).__name__)
        self.engine.frozen = bool(_freeze)

    padding_idx = _option("padding_idx", "nn's padding row (never updated), or None.")
    max_norm = _option("max_norm", "nn's renormalisation of looked-up rows, or None.")
    norm_type = _option("norm_type", "The norm max_norm uses.")
    scale_grad_by_freq = _option("scale_grad_by_freq", "A row's gradient / its count.")
    host = _part("table.host", "The host table (rows, 1, record) uint8.")
    layout = _part("table.layout", "A row's record: the weight and its optimizer state.")
    optimizer = _part("update.optimizer", "The optimizer of the staged rows.")
    state_keys = _part("update.state_keys", "The optimizer's per-row state entries.")
    dtype = _part("dtype", "The weights' dtype.")
    device = _part("device", "Where a step's rows are staged and the outputs live.")
    steps = _part("steps", "step() calls so far.")

    @property
    def store(self):
        """The step's store: the host rows, or a GPU row cache in front of them. Settable
        between steps (a ``CachedRows`` of other settings over ``host``)."""
        return self.engine.store

    @store.setter
    def store(self, store) -> None:
        self.engine.store = store

    @property
    def state_dtype(self) -> torch.dtype:
        """The optimizer's per-element state's dtype."""
        return self.engine.layout.state_dtype

    @property
    def bounds_check(self) -> str:
        """"raise" (ids on the GPU checked there with one wait) or "prechecked" (trusted)."""
        return self.engine.bounds_check

    @bounds_check.setter
    def bounds_check(self, value: str) -> None:
        check_bounds_mode(value)
        self.engine.bounds_check = value

    @property
    def frozen(self) -> bool:
        """Whether the table only reads (``from_pretrained(freeze=True)``,
        ``requires_grad_(False)``)."""
        return self.engine.frozen

    @property
    def fused(self) -> bool:
        """Whether ``step()`` updates the rows in one fused kernel (SGD, Adagrad, Adam, AdamW,
        RowWiseAdagrad and PartialRowWiseAdam with host-number hyper-parameters, and
        ``fused_update`` on) rather than by torch's optimizer. Both give torch's formula."""
        return self.engine.update.fused

    @property
    def fused_update(self) -> bool:
        """Set False to run torch's own optimizer step even where a fused rule exists."""
        return self.engine.fused_update

    @fused_update.setter
    def fused_update(self, value: bool) -> None:
        self.engine.fused_update = bool(value)

    @property
    def stochastic_rounding(self) -> bool:
        """Whether a step's 16-bit weights and state are stored rounded stochastically (the
        expected stored value is the float32 result): float16 and bfloat16 tables, unless built
        with ``stochastic_rounding=False``. The fused update computes in float32 and rounds its
        stores; torch's own step (the optimizers without a fused rule) runs on a float32 copy
        of the staged rows, stored back rounded the same way."""
        return self.engine.update.rounding is not None

    @property
    def row_bytes(self) -> int:
        """Bytes a row takes with its optimizer state, in the host table, each transfer and
        each cache slot."""
        return self.engine.table.row_bytes

    @property
    def trains(self) -> bool:
        """Whether a forward now trains: grad enabled, training mode, not frozen."""
        return torch.is_grad_enabled() and self.training and not self.frozen

    def set_cache_bytes(self, cache_bytes: int) -> None:
        """Change the GPU row cache's budget (0: no cache). The cached rows are written back
        first (this waits for the GPU); the new cache starts empty, its frequencies from zero.
        The old cache's memory is freed: a ``CapturedStep`` that captured this module must not
        replay afterwards (make a new one)."""
        self.engine.set_cache_bytes(cache_bytes)

    @eager
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
        self.engine.prefetch([ids, *more_ids])

    @eager
    def step(self) -> None:
        """Update the rows the last forward touched (and their optimizer state) with their
        gradients, and commit them to the cache or the host table. A frozen module has
        nothing to update: its step() does nothing."""
        self.engine.step()

    @eager
    def discard(self) -> None:
        """Drop the rows a training forward staged, writing nothing (after an exception
        between a forward and its step(): the module is then as before that forward). The
        next forward does this itself. The dropped forward's outputs refuse their backward."""
        self.engine.discard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the staged rows' gradients (as nn's zero_grad; the staged rows stay: see
        ``discard``)."""
        self.engine.param.grad = None

    def requires_grad_(self, requires_grad: bool = True) -> "_HostRowsModule":
        """``requires_grad_(False)`` freezes the table (forwards only read; ``step()`` does
        nothing), ``True`` unfreezes it; as nn's for a module's parameters."""
        self.engine.frozen = not requires_grad
        return self

    def _apply(self, fn, recurse: bool = True):
        """nn's conversions (``to``, ``double``, ``half``, ``cuda``, ``cpu``, ...) reach the
        table: a new dtype converts it and its optimizer state, a new device moves where the
        rows are staged (the table stays in host memory)."""
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        if isinstance(probe, Tensor) and (probe.dtype != self.dtype
                                          or probe.device != self.device):
            self.engine.convert(probe.dtype, probe.device)
        return super()._apply(fn, recurse)

    def reset_parameters(self, init: Optional[Callable[[Tensor], object]] = None) -> None:
        """Re-initialise the weight in place (``init(weight)``, default: normal(0, 1) like
        nn.Embedding's, the padding row zero) and the per-row optimizer state; cached copies
        are dropped."""
        self.engine.reset(init)

    def flush(self) -> None:
        """Write every cached row to the host table (complete afterwards; waits for the GPU)."""
        self.engine.store.flush()

    @property
    def weight(self) -> Tensor:
        """The full table (a view of the host table; flushed first)."""
        self.flush()
        return self.engine.table.view("weight")

    def num_parameters(self) -> int:
        """The table's weights (rows x dim): what nn's parameter count would show for it."""
        return self.num_embeddings * self.embedding_dim

    def step_parameters(self) -> list:
        """The tensors whose ``.grad`` holds this step's gradient of the table, between
        backward and ``step()``: the staged rows (the touched rows, each once; the rest of the
        table's gradient is zero). For gradient clipping with the dense parameters (see
        ``clip_grad_norm_``); scaling their ``.grad`` in place scales what ``step()`` applies."""
        self.engine.settle_grad(whole=True)
        return [self.engine.param]

    def cache_stats(self) -> dict:
        """Counts since construction (reading them waits for the GPU): distinct rows looked up,
        cache hits, rows taken from the host (misses; lookups = hits + host loads), of which a
        ``prefetch`` had loaded ahead, rows prefetches loaded (taken or not), rows written back
        from the cache to make room (a read-only forward's too, whose rows stay cached; counted
        once its step commits or is discarded), misses not admitted to the cache (written back
        by the next step, or a flush), of the misses those the step before had not admitted
        (``deferred_loads``: their values come from the GPU's copy); the hit rate; bytes moved
        over the host link."""
        return self.engine.cache_stats()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        save_rows(self.engine, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        load_rows(self.engine, state_dict, prefix, missing_keys, unexpected_keys, error_msgs)

    def _fqn_modifiers(self) -> dict:
        """For torch.distributed.checkpoint's state-dict helpers, which walk each key's dotted
        names as attributes: ``optimizer.<state>`` names no attribute of the optimizer, so
        that walk goes through a stand-in holding every name (``_checkpoint_names``)."""
        return {"optimizer": "_checkpoint_names"}

    @property
    def _checkpoint_names(self):
        keys = list(self.engine.update.state)
        return _Names(optimizer=_Names(**{key: None for key in keys}))

    def _extra_repr_options(self) -> list:
        shown = [("padding_idx", self.padding_idx, None), ("max_norm", self.max_norm, None),
                 ("norm_type", self.norm_type, 2.0),
                 ("scale_grad_by_freq", self.scale_grad_by_freq, False),
                 ("sparse", self.sparse, False), ("frozen", self.frozen, False)]
        return [f"{name}={value}" for name, value, default in shown if value != default]

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


class _Names:
    """Attributes named after checkpoint keys (see _fqn_modifiers)."""

    def __init__(self, **names):
        self.__dict__.update(names)


def split_outputs(rows: Tensor, shapes: list, dim: int):
    """Rows of every position (a step's, in the id tensors' order) split into one output
    ``(*shape, dim)`` per id tensor; the output itself for one."""
    outs, start = [], 0
    for shape in shapes:
        n = shape.numel()
        outs.append(rows[start:start + n].view(*shape, dim))
        start += n
    return outs[0] if len(shapes) == 1 else tuple(outs)


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

    @eager
    def forward(self, input, *more_input):
        engine = self.engine
        stage = engine.stage((input, *more_input), self.trains, lookup_only=True)
        d, shapes = stage.distinct, stage.shapes
        pad_at = engine.staged.pad_at if engine.staged is not None else None
        pieces = engine.lookup(engine.lookup_rows(d.inverse, pad_at), d,
                               [s.numel() for s in shapes])
        outs = tuple(p.view(*s, self.embedding_dim) for p, s in zip(pieces, shapes))
        return outs[0] if len(shapes) == 1 else outs

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

    @eager
    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        input = torch.as_tensor(input)
        on_host = (offsets is None or not isinstance(offsets, Tensor)
                   or offsets.device.type == "cpu")
        bag = bag_input(input, offsets, per_sample_weights, self.mode, self.include_last_offset,
                        self.device, self.dtype,
                        check_values=on_host or self.bounds_check != "prechecked")
        spare = 0 if self.padding_idx is None else 1
        stage = self.engine.stage((input,), self.trains, spare)
        index, padding = stage.distinct.inverse, None
        if self.padding_idx is not None:  # its entries point at the spare row, left out
            padding = self.engine.spare_at
            index = torch.where(stage.plan.index == self.padding_idx, padding, index)
        index = index.view(input.shape)
        return pool(self.engine.lookup_rows(index), index, bag, self.mode,
                    self.include_last_offset, padding)

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
    single, _ = _tables(model)
    return iter(single)


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
