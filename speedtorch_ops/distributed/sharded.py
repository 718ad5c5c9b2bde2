"""HostEmbedding and HostEmbeddingBag split by rows across the ranks of a torch.distributed
process group.

    emb = ShardedHostEmbedding(num_embeddings, dim, optimizer=torch.optim.Adam,
                               optimizer_kwargs={"lr": 1e-3}, group=g)
    out = emb(local_ids)        # collective
    loss.backward()             # local
    emb.step()                  # collective

Row ``id`` lives on rank ``id % world`` at local row ``id // world`` (cyclic: a vocabulary
sorted by frequency spreads its hot rows over all ranks). Each rank's shard is a single-process
``HostEmbedding`` (table and optimizer state in its pinned host memory, its own GPU row cache).

A forward deduplicates the rank's ids, sends each distinct id to its owner (counts first, then
the ids), the owners stage the requested rows (each distinct row once, however many ranks ask)
and send them back. ``step()`` sends the gradients of those rows to their owners, which sum the
gradients of a row asked for by several ranks, scale them by ``grad_scale`` and apply the
optimizer to their rows and state, the lazy rule of ``HostEmbedding``. So with the default
``grad_scale=1`` training equals one process training on the concatenated batches with the sum
of the ranks' losses; pass ``1 / world`` to match DDP's averaging of a dense part.

On an NCCL group the counts and ids travel on a gloo group over the same ranks (made at
construction for the default group, or pass ``route_group``): the host learns them without
waiting for the GPU, and only rows and gradients ride NCCL.

The gradients travel in ``step()``, not in backward: backward stays local, so a rank whose loss
does not use the output cannot leave its peers waiting, and the embedding's collectives never
interleave with DDP's in an order that differs between ranks. Keep the module out of DDP (its
tables are not parameters) and give it its own group when DDP shares the default one.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..bags import bag_input, pool
from ..modules import HostEmbedding, split_outputs
from ..training.placement import upload
from ..training.plan import host_ids
from . import checkpoint
from .exchange import (PhaseTimes, Route, backend_device, gather_cyclic, host_route_group,
                       local_rows, no_phase)


class _RoutedStep:
    """The forward of one or several sharded modules whose ids travelled together: the route,
    and per module the rows its shard staged for the requesters (``owned``) and the rows it
    received (``rows``, whose gradients ``step`` sends back)."""

    def __init__(self, route: Route, members: list, owned: list, rows: list):
        self.route, self.members, self.owned, self.rows = route, members, owned, rows


def _stage_together(members: Sequence["_ShardedRows"], ids: Sequence[Sequence],
                    error: Optional[BaseException] = None) -> list:
    """Collective: the rows of each module's ids (a sequence of id tensors per module), all
    routed in one exchange per phase; per module (rows per position, the shapes to split them
    into). Errors before the exchange (`error`, or bad id tensors) make every rank raise."""
    first = members[0]
    flats = [torch.zeros(0, dtype=torch.int64)] * len(members)
    shapes: list = [[] for _ in members]
    if error is None:
        try:
            for m in members:
                if m._pending is not None:
                    raise RuntimeError(f"{type(m).__name__}: a second forward before step(); "
                                       "pass every id tensor of a step to one call, or call "
                                       "step() first")
                if m.training != members[0].training:
                    raise ValueError("tables routed together must all be in training mode or "
                                     "all in eval mode")
            tensors = [[torch.as_tensor(i) for i in m_ids] for m_ids in ids]
            shapes = [[t.shape for t in ts] for ts in tensors]
            flats = [torch.cat([host_ids(t) for t in ts]) for ts in tensors]
        except Exception as e:  # any: a rank that raised alone would leave its peers waiting
            error = e  # raised after the header exchange, so the other ranks raise too
            flats = [torch.zeros(0, dtype=torch.int64)] * len(members)
    names = [m._name for m in members]
    with first._phase("route"):
        route = Route(flats, [m.num_embeddings for m in members], first.group, first.comm_device,
                      first.route_group, error, names)
    with first._phase("transfer"):
        owned = [m.shard(torch.cat([requested, m._pad]))
                 for m, requested in zip(members, route.requested)]
    with first._phase("exchange"):
        rows = route.to_requesters([o[:-1].detach() for o in owned])
    training = torch.is_grad_enabled() and all(m.training for m in members)
    step = _RoutedStep(route, list(members), owned, []) if training else None
    out = []
    for t, m in enumerate(members):
        r = rows[t].to(m.device)
        if step is not None:
            r.requires_grad_()
            step.rows.append(r)
            m._pending = step
        # upload: a copy from pageable memory would wait for everything queued on the stream
        out.append((r.index_select(0, upload(route.inverse[t], m.device)), shapes[t]))
    return out


def _step_together(step: _RoutedStep) -> None:
    """Collective: the gradients of a routed forward's rows to their owners (one exchange for
    all its modules), which update their rows and state and commit them."""
    first = step.members[0]
    for m in step.members:
        m._pending = None
    grads = [r.grad if r.grad is not None else torch.zeros_like(r) for r in step.rows]
    with first._phase("exchange"):
        received = step.route.to_owners(grads)
    with first._phase("transfer"):
        for m, owned, grad in zip(step.members, step.owned, received):
            grad = grad.to(owned.device)
            if m.grad_scale != 1.0:
                grad = grad * m.grad_scale
            # Rows asked for by several ranks appear once per rank: backward sums them.
            owned.backward(torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))]))
            m.shard.step()
            m.steps += 1


class _ShardedRows(nn.Module):
    """What both sharded modules share: the shard, the routing of a step, step() and export."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=torch.float32,
                 optimizer=torch.optim.Adam, optimizer_kwargs: Optional[dict] = None,
                 group=None, device=None, cache_bytes: int = 0, grad_scale: float = 1.0,
                 route_group=None, stochastic_rounding: Optional[bool] = None,
                 state_dtype=None, _local_weight: Optional[Tensor] = None):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed: call "
                               "torch.distributed.init_process_group first")
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) \
                or not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be a finite number, got {grad_scale!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the group")
        self.world = dist.get_world_size(group)
        self.comm_device = backend_device(group)
        if route_group is None and self.comm_device.type == "cuda":
            route_group = host_route_group(group)
        self.route_group = route_group if route_group is not None else group
        if dist.get_world_size(self.route_group) != self.world:
            raise ValueError("route_group must hold the ranks of group, in the same order")
        if device is None and self.comm_device.type == "cuda":
            device = self.comm_device  # NCCL: rows stay on the GPU the collectives use
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.grad_scale = float(grad_scale)
        self.local_rows = local_rows(num_embeddings, self.rank, self.world)
        # One padding row past the shard's own: an owner always stages it, so no step stages
        # nothing (the optimizer's step count stays global when a rank is asked for no row)
        # and a rank that owns no row (world > num_embeddings) still has a table.
        kwargs = dict(dtype=dtype, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs,
                      device=device, cache_bytes=cache_bytes,
                      stochastic_rounding=stochastic_rounding, state_dtype=state_dtype)
        if _local_weight is not None:
            pad = _local_weight.new_zeros((1, embedding_dim))
            self.shard = HostEmbedding.from_pretrained(torch.cat([_local_weight, pad]),
                                                       freeze=False, **kwargs)
        else:
            self.shard = HostEmbedding(self.local_rows + 1, embedding_dim, **kwargs)
        self._pad = torch.tensor([self.local_rows], dtype=torch.int64)
        self._pending: Optional[_RoutedStep] = None
        self.timer: Optional[PhaseTimes] = None  # set for a profiling run (bench/sharded.py)
        self.steps = 0
        self._name = "ids"  # in errors; a ShardedEmbeddingDict names its tables

    @property
    def dtype(self) -> torch.dtype:
        """The table's dtype (the shard's: conversions such as ``.double()`` reach it)."""
        return self.shard.dtype

    @property
    def state_dtype(self) -> torch.dtype:
        """The optimizer state's dtype (the shard's)."""
        return self.shard.state_dtype

    @property
    def device(self) -> torch.device:
        """Where the rows are staged (the shard's)."""
        return self.shard.device

    def num_parameters(self) -> int:
        """The whole table's weights (rows x dim, over every rank)."""
        return self.num_embeddings * self.embedding_dim

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of this rank's shard."""
        return self.shard.optimizer

    def _phase(self, name: str):
        return self.timer.phase(name) if self.timer is not None else no_phase(name)

    # ---- a step --------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """Collective: the forward of the single-process module (see the subclasses)."""
        try:
            ids, finish = self._route_args(*args, **kwargs)
        except Exception as e:  # bad arguments raise on every rank, not here only
            _stage_together([self], [()], e)  # raises e here, an error on the other ranks
        (staged,) = _stage_together([self], [ids])
        return finish(staged)

    def _route_args(self, *args, **kwargs) -> tuple:
        """(the id tensors of a forward's arguments, a function of their staged (rows per
        position, shapes) giving the forward's output); checks the arguments first."""
        raise NotImplementedError

    def step(self) -> None:
        """Collective: the gradients of the last forward's rows go to their owners, which update
        their rows and state and commit them."""
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}.step(): no forward (in training mode, "
                               "with grad enabled) since the last step")
        if len(self._pending.members) > 1:
            raise RuntimeError(f"{type(self).__name__}.step(): its rows were routed with other "
                               "tables' by a ShardedEmbeddingDict; call the dict's step()")
        _step_together(self._pending)

    def zero_grad(self, set_to_none: bool = True) -> None:  # gradients live per step
        if self._pending is not None:
            self._pending.rows[self._pending.members.index(self)].grad = None

    # ---- inspection, export and checkpoints -------------------------------------------------

    def _check_idle(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{type(self).__name__}.{what}: a forward awaits its step(); "
                               "call step() first")

    @torch.no_grad()
    def reset_parameters(self, init: Optional[Callable[[Tensor], object]] = None) -> None:
        """Re-initialise this rank's shard in place (``init(weight)``, default normal(0, 1))
        and its optimizer state. Each rank draws its own rows: seed per rank for repeatable
        runs, or start from ``from_pretrained`` to match a single-process table."""
        self._check_idle("reset_parameters")
        self.shard.reset_parameters(init)

    def local_table(self) -> Tensor:
        """This rank's rows (local_rows, 1, record) uint8: each row's weight and state in one
        record, laid out as ``self.shard.layout`` says."""
        self.shard.flush()
        return self.shard.host[: self.local_rows]

    def gather_weight(self) -> Tensor:
        """Collective: the full table (num_embeddings, dim) on every rank, on the host."""
        self._check_idle("gather_weight")
        local = self.shard.layout.of_table(self.local_table(), "weight")
        return gather_cyclic(local, self.num_embeddings, self.group, self.comm_device)

    def gather_state_dict(self) -> dict:
        """Collective: the state_dict of the single-process module (weight, per-row optimizer
        state, the optimizer's scalars) on every rank; ``HostEmbedding.load_state_dict`` takes
        it. Holds the full table and its state in host memory: for tests and export."""
        self._check_idle("gather_state_dict")
        full = gather_cyclic(self.local_table(), self.num_embeddings, self.group,
                             self.comm_device)
        places, scalars = checkpoint.split_state(self.shard)
        out = checkpoint.row_views(full, places)
        out.update(scalars)
        return out

    def save(self, directory: str) -> None:
        """Collective: each rank writes its shard (weight and optimizer state) to `directory`
        (one that every rank sees: ``load`` at another world size reads every rank's file), and
        rank 0 a small metadata file. Returns when every file is written."""
        self._check_idle("save")
        checkpoint.save(self, directory)

    @classmethod
    def load(cls, directory: str, group=None, optimizer=None,
             optimizer_kwargs: Optional[dict] = None, **kwargs):
        """Collective: the module saved in `directory` (at any world size), for `group`.
        ``optimizer`` and ``optimizer_kwargs`` default to the saved ones; further keyword
        arguments (device, cache_bytes, grad_scale) as the constructor's."""
        return checkpoint.load(cls, directory, group, optimizer, optimizer_kwargs, kwargs)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rank {self.rank} of "
                f"{self.world} ({self.local_rows} rows), dtype={self.dtype}, "
                f"optimizer={type(self.optimizer).__name__}, device={self.device}, "
                f"grad_scale={self.grad_scale}")

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, group=None, freeze: bool = False, **kwargs):
        """A sharded module whose table starts as `embeddings` (rows, dim): each rank keeps its
        rows (every rank passes the same full table, or at least its own rows in place). It
        trains: a sharded table has no frozen form (``freeze=True`` raises; nn's default freezes,
        so the single-process modules take ``freeze=False`` for the same)."""
        if freeze:
            raise ValueError("freeze=True: a sharded table cannot be frozen; build it with "
                             "freeze=False (it trains) or use HostEmbedding.from_pretrained")
        if not isinstance(embeddings, Tensor) or embeddings.dim() != 2:
            raise ValueError("embeddings must be a 2-D tensor (rows, dim), got "
                             f"{getattr(embeddings, 'shape', type(embeddings))}")
        kwargs.setdefault("dtype", embeddings.dtype)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = embeddings[rank::world].cpu()
        return cls(embeddings.shape[0], embeddings.shape[1], group=group, _local_weight=local,
                   **kwargs)


class ShardedHostEmbedding(_ShardedRows):
    """``HostEmbedding`` split by rows across a process group (see the module docstring).
    ``forward(ids, *more_ids)`` (collective): one output ``(*ids.shape, dim)`` per id tensor.

    Args:
        num_embeddings, embedding_dim, dtype, state_dtype, optimizer, optimizer_kwargs,
            device, cache_bytes, stochastic_rounding: as HostEmbedding's, for the whole table
            (each rank holds its rows).
        group: the process group (default: the default group); every member builds the module.
        grad_scale: the factor of the summed gradients of a row (1: one process on the
            concatenated batches with the summed loss; 1 / world: DDP's average).
        route_group: a gloo group over the same ranks for the counts and ids (made for you on
            NCCL).

    Example::

        emb = ShardedHostEmbedding(10_000_000, 128, optimizer=torch.optim.Adam, group=g)
        out = emb(local_ids); out.sum().backward(); emb.step()   # collective
    """

    def _route_args(self, ids, *more_ids) -> tuple:
        # HostEmbedding's split needs only embedding_dim, which this class has.
        return (ids, *more_ids), lambda staged: split_outputs(*staged, self.embedding_dim)


class ShardedHostEmbeddingBag(_ShardedRows):
    """``HostEmbeddingBag`` (modes "sum" and "mean") split by rows across a process group:
    ``forward(input, offsets=None, per_sample_weights=None)`` (collective) as
    ``nn.EmbeddingBag``'s.

    Args:
        num_embeddings, embedding_dim: the whole table's shape.
        mode: "sum" or "mean".
        **kwargs: as ``ShardedHostEmbedding``'s (group, device, cache_bytes, optimizer, ...).

    Example::

        bag = ShardedHostEmbeddingBag(1_000_000, 64, mode="sum", optimizer=torch.optim.Adagrad)
        pooled = bag(ids, offsets)      # every rank calls it, with its own batch
        pooled.sum().backward(); bag.step()
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", **kwargs):
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.mode = mode

    def _route_args(self, input: Tensor, offsets: Optional[Tensor] = None,
                    per_sample_weights: Optional[Tensor] = None) -> tuple:
        input = torch.as_tensor(input)
        bag = bag_input(input, offsets, per_sample_weights, self.mode, False, self.device,
                        self.dtype, check_values=True)

        def pooled(staged) -> Tensor:
            rows = staged[0]  # one row per position of input
            index = torch.arange(rows.shape[0], device=rows.device).view(input.shape)
            return pool(rows, index, bag, self.mode)
        return (input,), pooled


class ShardedEmbeddingDict(nn.Module):
    """A dict of ``ShardedHostEmbedding`` / ``ShardedHostEmbeddingBag`` modules whose ids, rows
    and gradients travel together: a step makes one exchange per phase (counts, ids, rows,
    gradients) for all of them instead of one per table. Each exchange sends its counts first,
    so its sizes follow the ids (for exchanges of fixed shapes, which a CUDA graph captures,
    use ``ShardedHostEmbeddingBagCollection``).

    ``forward(inputs)``: a dict with every table's name (every rank passes every table, an
    empty id tensor where it has none), each value what that table's forward takes (a tensor,
    or a tuple of its arguments: several id tensors, or a bag's input, offsets and
    per_sample_weights); returns a dict of the tables' outputs. Bad input on any rank (a
    missing name, an id out of range, bad bag arguments) raises on every rank before any id
    moves. ``step()`` (collective) updates every table; a table's own ``step()`` raises.

    Args:
        tables: name -> sharded module. The modules share the process group, a dtype and their
            mode (training or eval); every rank builds the dict with the same names in the
            same order (the order of the tables in a buffer).

    Example::

        tables = ShardedEmbeddingDict({"user": ShardedHostEmbedding(...),
                                       "item": ShardedHostEmbeddingBag(...)})
        out = tables({"user": user_ids, "item": (item_ids, offsets)})   # collective
        loss.backward()
        tables.step()                                                   # collective
    """

    def __init__(self, tables: dict):
        super().__init__()
        if not isinstance(tables, dict) or not tables:
            raise ValueError("tables must be a non-empty dict of name -> ShardedHostEmbedding or "
                             "ShardedHostEmbeddingBag")
        for name, m in tables.items():
            if not isinstance(m, _ShardedRows):
                raise TypeError(f"tables[{name!r}] must be a ShardedHostEmbedding or "
                                f"ShardedHostEmbeddingBag, got {type(m).__name__}")
        first = next(iter(tables.values()))
        if len({id(m) for m in tables.values()}) != len(tables):
            raise ValueError("tables: a module is listed twice")
        for name, m in tables.items():
            # The routing groups may differ (on NCCL each module makes its own gloo group over
            # the same ranks): the dict routes on the first table's.
            if m.group is not first.group:
                raise ValueError(f"tables[{name!r}] uses another process group than the first "
                                 "table; the tables travel together on one")
            if m.dtype != first.dtype:
                raise ValueError(f"tables[{name!r}] has dtype {m.dtype}, the first table "
                                 f"{first.dtype}; the rows of all tables travel in one buffer")
            m._name = f"inputs[{name!r}]"
        self.tables = nn.ModuleDict(tables)

    def forward(self, inputs: dict) -> dict:
        members = list(self.tables.values())
        routed, error = [], None
        try:
            if not isinstance(inputs, dict) or set(inputs) != set(self.tables):
                got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
                raise ValueError(f"inputs must be a dict with every table's name "
                                 f"{sorted(self.tables)}, got {got}")
            for name, m in self.tables.items():  # every table's arguments checked first
                value = inputs[name]
                routed.append(m._route_args(*(value if isinstance(value, tuple) else (value,))))
        except Exception as e:  # raised on every rank by the routing, before any id moves
            error = e
        ids = [r[0] for r in routed] if error is None else [()] * len(members)
        staged = _stage_together(members, ids, error)
        return {name: finish(st) for name, (_, finish), st in zip(self.tables, routed, staged)}

    def step(self) -> None:
        """Collective: every table's update (one gradient exchange for all)."""
        pending = [m._pending for m in self.tables.values()]
        if any(p is None for p in pending) or any(p is not pending[0] for p in pending):
            raise RuntimeError("ShardedEmbeddingDict.step(): no forward of the dict "
                               "(in training mode, with grad enabled) since the last step")
        _step_together(pending[0])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.tables.values():
            m.zero_grad(set_to_none)
