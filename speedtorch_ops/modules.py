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
one, else from the host); ``step()`` runs the torch optimizer on those rows and commits them.

Update rule ("lazy"): only the rows a step touched change, each with the sum of its gradients;
per-table scalars such as Adam's ``step`` are global. So SGD equals SGD on the full table, and
Adam equals torch's Adam formula applied to the touched rows only (SparseAdam's rule up to where
it adds eps). A step is one forward (pass every id tensor of the step to that one call:
``emb(ids_a, ids_b)`` returns one output each), one backward, one ``step()``. A forward under
``torch.no_grad()`` or in eval mode only reads. The tables are not ``nn.Parameter``s (the module
updates them itself, as FBGEMM's fused embeddings do): keep them out of the dense optimizer.

Ids from the host are checked there (a bad id raises naming it; nothing is written) and
uploaded once. Ids already on the module's GPU stay there: ``bounds_check="raise"`` (default)
checks them on the GPU with one wait, ``"prechecked"`` trusts the caller; with those the
whole step has no host wait and a CUDA graph can capture it (``speedtorch_ops.CapturedStep``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from .memory import fill_random_
from .training import optim_state
from .training.cache import CachedRows, HostRows
from .training.placement import allocate, resolve_dtype
from .training.plan import Plan, check_bounds_mode


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


class _HostRowsModule(nn.Module):
    """What both modules share: the host table, the store, staging and the optimizer step."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=torch.float32,
                 optimizer=torch.optim.Adam, optimizer_kwargs: Optional[dict] = None,
                 device=None, cache_bytes: int = 0, bounds_check: str = "raise",
                 _weight: Optional[Tensor] = None):
        super().__init__()
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
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # The optimizer's one parameter: its data is the staged rows' weight part.
        self._rows = torch.zeros((0, embedding_dim), dtype=self.dtype,
                                 device=self.device).requires_grad_()
        self.optimizer = optimizer([self._rows], **(optimizer_kwargs or {}))
        group = self.optimizer.param_groups[0]
        self._fills, scalars = optim_state.state_layout(self.optimizer, group)
        optim_state.init_state(self.optimizer, self._rows, group, self._fills, scalars)
        self.state_keys = list(self._fills)
        per_row = optim_state.row_state_keys(self.optimizer)
        self.layout = optim_state.RowLayout(
            embedding_dim, [k for k in self.state_keys if k not in per_row],
            [k for k in self.state_keys if k in per_row], self.dtype)
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"weights must have shape ({num_embeddings}, {embedding_dim}), got "
                             f"{tuple(_weight.shape)}")
        placement = "pinned" if self.device.type == "cuda" else "cpu"
        self.host = allocate((num_embeddings, self.layout.parts, self.layout.width), self.dtype,
                             placement)
        with torch.no_grad():
            self.host[:, 0, embedding_dim:].zero_()  # packed per-row state and padding
            if _weight is not None:
                self._table("weight").copy_(_weight)
            else:
                _normal_init(self._table("weight"))
            self._fill_state()
        self.store = self._make_store(cache_bytes)
        self._no_rows = torch.empty((self.layout.parts, 0, self.layout.width), dtype=self.dtype,
                                    device=self.device)
        self._staged = None
        self.steps = 0  # step() calls so far

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
            raise RuntimeError("set_cache_bytes between steps only (a forward is staged)")
        store = self._make_store(cache_bytes)  # raises before anything changes
        self.store.drop_prefetch()
        self.store.flush()
        self.store = store

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

    def _stage(self, ids: Sequence) -> tuple:
        """Stage the distinct rows of all `ids` tensors; returns (rows looked up per position,
        the shapes to split them into)."""
        if self._staged is not None:
            raise RuntimeError(f"{type(self).__name__}: a second forward before step(); pass "
                               "every id tensor of a step to one call (emb(ids_a, ids_b)), or "
                               "call step() first")
        tensors = [torch.as_tensor(i) for i in ids]
        shapes = [t.shape for t in tensors]
        plan = self._plan(tensors)
        buf, distinct = self.store.stage(plan)
        training = torch.is_grad_enabled() and self.training
        self._point_at(buf)
        self._rows.grad = None
        rows = self._rows.index_select(0, distinct.inverse)  # backward: an index_add, no wait
        if training:
            self._staged = buf
        else:
            self.store.discard()
        return rows, shapes

    def _point_at(self, buf: Tensor) -> None:
        """The optimizer's parameter and its per-row state become views of `buf` (parts, n,
        width): a step's staged rows, or no rows once the step is done, so the step's buffer
        goes back to the allocator (a CUDA graph's capture cannot reuse it, and within a tight
        GPU budget it needs the room)."""
        with torch.no_grad():  # set_, not .data: autograd then sees the new shape (an empty batch)
            self._rows.set_(self.layout.of_staged(buf, "weight"))
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
            # NumPy joins host ids without waking torch's CPU thread pool (~0.3 ms per call).
            flat = torch.from_numpy(np.concatenate([t.reshape(-1).numpy() for t in tensors]))
        else:
            flat = torch.cat([t.reshape(-1).to(tensors[0].device) for t in tensors])
        return Plan(flat, self.device)

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

    def step(self) -> None:
        """Update the rows the last forward touched (and their optimizer state) with their
        gradients, and commit them to the cache or the host table."""
        if self._staged is None:
            raise RuntimeError(f"{type(self).__name__}.step(): no forward (in training mode, "
                               "with grad enabled) since the last step")
        if self._rows.grad is not None and isinstance(self.optimizer, torch.optim.SparseAdam):
            self._rows.grad = self._rows.grad.to_sparse(1)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._check_capturable()
        self.optimizer.step()
        self._rows.grad = None
        self._staged = None
        self.store.commit()
        self._point_at(self._no_rows)
        self.steps += 1

    def _check_capturable(self) -> None:
        """A captured step replays GPU work only: state the optimizer keeps on the CPU (a step
        count) would change at the capture and never again."""
        state = self.optimizer.state[self._rows]
        on_host = [k for k, v in state.items() if isinstance(v, Tensor) and v.device.type == "cpu"]
        if on_host:
            raise RuntimeError(f"optimizer: {type(self.optimizer).__name__} keeps {on_host} on "
                               "the CPU, which a CUDA graph cannot update; build it with "
                               "capturable=True (where it has it)")

    def zero_grad(self, set_to_none: bool = True) -> None:  # the rows' gradients live per step
        self._rows.grad = None

    # ---- inspection and checkpoints --------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, init: Optional[Callable[[Tensor], object]] = None) -> None:
        """Re-initialise the weight in place (``init(weight)``, default: normal(0, 1) like
        nn.Embedding's) and the per-row optimizer state; cached copies are dropped."""
        if self._staged is not None:
            self.store.discard()
            self._staged = None
        self.store.reset()
        weight = self._table("weight")
        init(weight) if init is not None else _normal_init(weight)
        self._fill_state()

    def flush(self) -> None:
        """Write every cached row to the host table (complete afterwards; waits for the GPU)."""
        self.store.flush()

    @property
    def weight(self) -> Tensor:
        """The full table (a view of the host table; flushed first)."""
        self.flush()
        return self._table("weight")

    def cache_stats(self) -> dict:
        """Counts since construction (reading them waits for the GPU): distinct rows looked up,
        cache hits, rows taken from the host (misses; lookups = hits + host loads), of which a
        ``prefetch`` had loaded ahead, rows prefetches loaded (taken or not), rows written back
        from the cache to make room (a read-only forward's too, whose rows stay cached; counted
        once its step commits or is discarded), misses written straight back; the hit rate;
        bytes moved over the host link."""
        lookups, hits, loads, evictions, direct, ahead, prefetched = (
            int(x) for x in self.store.stats.tolist())
        moved = loads - ahead + prefetched + evictions + direct
        return {"lookups": lookups, "hits": hits, "host_loads": loads, "evictions": evictions,
                "direct_writebacks": direct, "prefetched_loads": ahead,
                "prefetched_rows": prefetched, "hit_rate": hits / lookups if lookups else 0.0,
                "host_bytes": self.host[0].nbytes * moved,
                "cache_bytes": self.store.cached_bytes()}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.flush()
        destination[prefix + "weight"] = self._table("weight")
        state = self.optimizer.state[self._rows]
        for key in self.state_keys:
            destination[f"{prefix}optimizer.{key}"] = self._table(key)
        for key, value in state.items():
            if key not in self.state_keys:
                destination[f"{prefix}optimizer.{key}"] = value.detach().clone() if isinstance(
                    value, Tensor) else torch.tensor(value)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        state = self.optimizer.state[self._rows]
        tables = {"weight": self._table("weight")}
        tables.update({f"optimizer.{key}": self._table(key) for key in self.state_keys})
        scalars = [key for key in state if key not in self.state_keys]
        expected = list(tables) + [f"optimizer.{key}" for key in scalars]
        for name in expected:
            if prefix + name not in state_dict:
                missing_keys.append(prefix + name)
        for key in state_dict:
            rest = key[len(prefix):]
            if key.startswith(prefix) and rest not in expected and (
                    rest == "weight" or rest.startswith("optimizer.")):
                unexpected_keys.append(key)
        for name, table in tables.items():
            value = state_dict.get(prefix + name)
            if value is not None and (tuple(value.shape) != tuple(table.shape)):
                error_msgs.append(f"{prefix + name}: shape {tuple(value.shape)} in the checkpoint, "
                                  f"{tuple(table.shape)} here")
        if error_msgs or (strict and missing_keys):
            return  # nothing written
        if self._staged is not None:
            self.store.discard()
            self._staged = None
        self.store.flush()  # a partial load keeps the cached rows' latest values
        self.store.reset()
        for name, table in tables.items():
            if prefix + name in state_dict:
                table.copy_(state_dict[prefix + name])
        for key in scalars:
            if f"{prefix}optimizer.{key}" in state_dict:
                value = state_dict[f"{prefix}optimizer.{key}"]
                old = state[key]
                if isinstance(old, Tensor):  # in place: a captured step holds this tensor
                    old.copy_(value.to(old.device, old.dtype))
                else:
                    state[key] = type(old)(value.item())

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, "
                f"optimizer={type(self.optimizer).__name__}, device={self.device}, "
                f"cache_bytes={self.store.cached_bytes()}")

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, **kwargs):
        """A module whose table starts as `embeddings` (rows, dim), like nn.Embedding's."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D (rows, dim), got shape "
                             f"{tuple(embeddings.shape)}")
        kwargs.setdefault("dtype", embeddings.dtype)
        return cls(embeddings.shape[0], embeddings.shape[1], _weight=embeddings, **kwargs)


class HostEmbedding(_HostRowsModule):
    """``nn.Embedding`` with its table and optimizer state in host memory (see the module
    docstring). ``forward(ids, *more_ids)``: one output ``(*ids.shape, dim)`` per id tensor."""

    def forward(self, ids, *more_ids):
        return self._outputs(*self._stage((ids, *more_ids)))

    def _outputs(self, rows: Tensor, shapes: list):
        """The staged rows per position split into one output per id tensor."""
        outs, start = [], 0
        for shape in shapes:
            n = shape.numel()
            outs.append(rows[start:start + n].view(*shape, self.embedding_dim))
            start += n
        return outs[0] if len(shapes) == 1 else tuple(outs)


class HostEmbeddingBag(_HostRowsModule):
    """``nn.EmbeddingBag`` (modes "sum" and "mean") with its table and optimizer state in host
    memory: ``forward(input, offsets=None, per_sample_weights=None)`` as nn.EmbeddingBag's (2-D
    input: fixed-length bags; 1-D input with offsets: bag b is input[offsets[b]:offsets[b+1]];
    an empty bag gives zeros)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", **kwargs):
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.mode = mode

    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        input = torch.as_tensor(input)
        bags, bag_of = self._bags(input, offsets, per_sample_weights)
        rows, _ = self._stage((input,))
        return self._pool(rows, bags, bag_of, per_sample_weights)

    def _pool(self, rows: Tensor, bags: int, bag_of: Tensor,
              per_sample_weights: Optional[Tensor]) -> Tensor:
        """The bags' sums or means of the staged rows per position."""
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.reshape(-1, 1).to(rows.device, rows.dtype)
        out = rows.new_zeros((bags, self.embedding_dim)).index_add(0, bag_of, rows)
        if self.mode == "mean":
            counts = torch.zeros(bags, dtype=rows.dtype, device=rows.device).index_add_(
                0, bag_of, torch.ones_like(bag_of, dtype=rows.dtype))
            out = out / counts.clamp(min=1).unsqueeze(1)
        return out

    def _bags(self, input: Tensor, offsets: Optional[Tensor] = None,
              per_sample_weights: Optional[Tensor] = None) -> tuple:
        """Checks the arguments of forward (`input` a tensor; before any id moves); (number of
        bags, the bag of each id)."""
        if per_sample_weights is not None and self.mode != "sum":
            raise ValueError("per_sample_weights is only supported for mode='sum' (as in "
                             "nn.EmbeddingBag)")
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None for a 2-D input (fixed-length bags)")
            bags, length = input.shape
            bag_of = torch.arange(bags, device=self.device).repeat_interleave(length)
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError("offsets is required for a 1-D input")
            offsets = torch.as_tensor(offsets).to(self.device, torch.int64)
            if offsets.dim() != 1:
                raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
            bags = offsets.numel()
            positions = torch.arange(input.numel(), device=self.device)
            bag_of = torch.searchsorted(offsets, positions, right=True) - 1
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
        if per_sample_weights is not None and per_sample_weights.shape != input.shape:
            raise ValueError(f"per_sample_weights must have input's shape {tuple(input.shape)}, "
                             f"got {tuple(per_sample_weights.shape)}")
        return bags, bag_of
