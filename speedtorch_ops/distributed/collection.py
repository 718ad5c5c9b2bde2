"""A collection of tables split by rows across the ranks of a process group, on the collection's
engine, with a step the host never waits in (so ``CapturedStep`` captures it whole, NCCL
collectives included):

    ebc = ShardedEmbeddingBagCollection(tables, optimizer=torch.optim.Adam,
                                        optimizer_kwargs={"lr": 1e-3}, cache_bytes=1 << 30)
    out = ebc(kjt)              # collective: {feature: (stride, D)} as the single-process one
    loss.backward()             # local
    ebc.step()                  # collective

Row ``id`` of a table lives on rank ``id % world`` (cyclic: a vocabulary sorted by frequency
spreads its hot rows over every rank); each rank holds its rows of every table in the
single-process collection's groups (one ``HostEmbedding`` per width and dtype: its pinned host
table and its own GPU row cache), plus one padding row per group.

Each phase is one ``all_to_all_single`` per group whose split sizes every rank knows without
reading anything back from a GPU: a rank sends every owner a bucket as long as its step's ids of
that group (its own positions for that owner first, the owner's padding row after them), so the
sizes follow from the batches' shapes alone. The ranks learn each other's sizes and whether any
rank failed its checks in one small host exchange (on a gloo group) per forward; a captured step
does that once, at its capture. Owners serve every slot of the buckets with their group's
forward (a padding slot reads the padding row, whose gradient is zero), so the exchange of rows
back, and of gradients to the owners in ``step()``, reuse the same sizes. NVLink makes the
padding cheap next to a second exchange to learn the counts: see docs/decisions.md, "A sharded
step of fixed shapes".

With ``grad_scale=1`` training equals one process training the single-process collection on the
ranks' batches concatenated, with the ranks' losses summed (the owners sum the gradients of a
row asked for by several ranks); pass ``1 / world`` for DDP's average.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..collection import HostEmbeddingBagCollection, TableConfig
from ..modules import _eager, _lookup
from . import checkpoint
from .exchange import agree, backend_device, exchange, gather_cyclic, host_route_group, local_rows


class ShardedEmbeddingBagCollection(HostEmbeddingBagCollection):
    """``HostEmbeddingBagCollection`` split by rows across a process group (see the module
    docstring); ``forward``, ``prefetch`` and ``step`` are collective (every rank calls them
    in the same order), backward is local.

    Args:
        tables, optimizer, optimizer_kwargs, bounds_check, dtype, stochastic_rounding: as
            HostEmbeddingBagCollection's, for the whole tables (each rank holds its rows).
        group: the process group (default: the default group); every member builds the module
            with the same tables in the same order.
        device: where the rows are staged (default: the GPU the group's NCCL uses, the CPU for
            gloo).
        cache_bytes: this rank's GPU row cache for its rows of all tables.
        grad_scale: the factor of a row's summed gradients (1: one process on the concatenated
            batches with the summed loss; 1 / world: DDP's average).
        route_group: a gloo group over the same ranks for the host exchange of sizes and
            statuses (made for you on an NCCL default group; pass it to ``CapturedStep``'s
            ``group`` so that a bad id on any rank stops every rank before a replay).

    ``state_dict()`` holds this rank's rows under the single-process keys;
    ``gather_state_dict()`` (collective) the whole tables on every rank;
    ``load_state_dict`` takes either, so a single-process checkpoint loads at any world size.

    Example::

        ebc = ShardedEmbeddingBagCollection([TableConfig("user", 50_000_000, 128)],
                                            optimizer=torch.optim.Adam, cache_bytes=8 << 30)
        out = ebc(KeyedJaggedTensor.from_lengths_sync(["user"], ids, lengths))
        out["user"].sum().backward(); ebc.step()
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer=torch.optim.Adam,
                 optimizer_kwargs: Optional[dict] = None, group=None, device=None,
                 cache_bytes: int = 0, bounds_check: str = "raise", dtype=torch.float32,
                 stochastic_rounding: Optional[bool] = None, grad_scale: float = 1.0,
                 route_group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed: call "
                               "torch.distributed.init_process_group first")
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) \
                or not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be a finite number, got {grad_scale!r}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the group")
        comm_device = backend_device(group)
        tables = list(tables)
        held = [local_rows(t.num_embeddings, rank, world) if isinstance(t, TableConfig) else 0
                for t in tables]  # the base class names a table that is not a TableConfig
        super().__init__(tables, optimizer, optimizer_kwargs,
                         device=comm_device if device is None else device,
                         cache_bytes=cache_bytes, bounds_check=bounds_check, dtype=dtype,
                         stochastic_rounding=stochastic_rounding, _held_rows=held,
                         _spare_rows=1)
        self.group, self.rank, self.world = group, rank, world
        self.comm_device = comm_device
        self.grad_scale = float(grad_scale)
        if route_group is None and comm_device.type == "cuda":
            route_group = host_route_group(group)
        self.route_group = route_group if route_group is not None else group
        if dist.get_world_size(self.route_group) != world:
            raise ValueError("route_group must hold the ranks of group, in the same order")
        # Where each table's rows start in each owner's group, and each owner's padding row.
        starts = np.zeros((len(tables), world), dtype=np.int64)
        pads = np.zeros((len(self.groups), world), dtype=np.int64)
        for owner in range(world):
            for k, t in enumerate(tables):
                g = self._group_of[k]
                starts[k, owner] = pads[g, owner]
                pads[g, owner] += local_rows(t.num_embeddings, owner, world)
        self._starts_cpu = torch.from_numpy(starts)
        self.register_buffer("_starts", self._starts_cpu.to(self.device), persistent=False)
        self.register_buffer("_pads", torch.from_numpy(pads).to(self.device), persistent=False)
        self._sizes: Optional[list] = None  # [rank][group] ids of the forward being routed
        self._generation = 0  # forwards, steps and discards so far: a stale backward raises
        self._pending: Optional[list] = None  # per group: (served, received rows, sizes)

    @property
    def _shards(self) -> list:
        """The modules this rank's rows live in (count_parameters and clip_grad_norm_ see the
        collection as sharded through them)."""
        return list(self.groups)

    def num_parameters(self) -> int:
        """The whole tables' weights (rows x dim, over every rank)."""
        return sum(t.num_embeddings * t.embedding_dim for t in self.tables)

    # ---- a step --------------------------------------------------------------------------

    def _stacked(self, table: int, ids: Tensor) -> Tensor:
        """Table `table`'s ids as (the owner's row in its group) * world + owner."""
        owner = ids % self.world
        starts = self._starts if ids.device == self._starts.device else self._starts_cpu
        return (ids // self.world + starts[table].to(ids.device)[owner]) * self.world + owner

    def _agreed(self, features, pooling: bool = True) -> tuple:
        """Collective: a forward's (or, `pooling` False, a prefetch's) input prepared, every
        rank's ids per group learnt, and every rank raising if any failed before the exchange."""
        prepared, error = None, None
        try:
            prepared = self._prepare(features, pooling)
        except Exception as e:  # any: a rank that raised alone would leave its peers waiting
            error = e
        sizes = [flat.numel() for _, flat, _ in prepared[4]] if prepared else \
            [0] * len(self.groups)
        # Whether this forward trains: a rank that would skip step()'s exchanges while its
        # peers join them must make every rank raise here instead.
        sizes.append(int(self.training and torch.is_grad_enabled()))
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() \
                and backend_device(self.route_group).type == "cuda":
            # A capture cannot read an NCCL exchange back: the sizes of the warm-up steps.
            if error is not None:
                raise error
            if self._sizes is None or self._sizes[self.rank] != sizes:
                raise RuntimeError(f"{type(self).__name__}: a capture on an NCCL route_group "
                                   "takes the sizes of the eager steps before it; run them with "
                                   "the captured shapes, or pass a gloo route_group")
            return prepared, self._sizes
        agreed = agree(self.route_group, error, sizes)
        if len({row[-1] for row in agreed}) > 1:
            raise RuntimeError(f"{type(self).__name__}: ranks {[row[-1] for row in agreed]} "
                               "(1: training with grad enabled) disagree; every rank must "
                               "train, or every rank read, in the same forward. Nothing moved.")
        return prepared, agreed

    def _route(self, g: int, flat: Tensor, sizes: list) -> tuple:
        """(where each id of `flat` sits in the buckets sent, the ids this rank's owners serve)
        for group `g`: one exchange of ids, `sizes[r]` from rank r."""
        n, world = flat.numel(), self.world
        if world == 1:
            return torch.arange(n, device=flat.device), flat
        owner = flat % world
        # Each id's place among the ids of its owner, by a running count over the flags "id p
        # is owner o's" laid out owner by owner: one scan of a flat tensor (a scan along the
        # first dim of an (n, world) one runs a thread a column, serially over n).
        flag = owner * n + torch.arange(n, device=flat.device)  # id p's flag
        count = (torch.arange(world, device=flat.device).unsqueeze(1) == owner).view(-1) \
            .cumsum(0)
        ends = count[n - 1::n] if n else count.new_zeros(world)  # an owner's last flag's count
        before = torch.cat([count.new_zeros(1), ends[:-1]])  # ids of the owners before
        index = owner * n + count[flag] - before[owner] - 1
        send = self._pads[g].repeat_interleave(n).index_copy_(0, index, flat // world)
        received = torch.empty(sum(sizes), dtype=torch.int64, device=self.comm_device)
        exchange(received, send.to(self.comm_device), sizes, [n] * world, self.group)
        return index, received.to(self.device)

    @_eager
    def forward(self, features) -> dict:
        prepared, sizes = self._agreed(features)  # raises before anything changes
        self._sizes = sizes
        self._pending = []  # a forward without its step before: the groups drop its rows
        self._generation += 1  # that forward's outputs can no longer take a backward
        return self._forward(*prepared)

    def _group_rows(self, g: int, flat: Tensor, lookup_only: bool) -> tuple:
        """The rows of every id of `flat`: routed to their owners, staged by them, sent back
        (see the module docstring)."""
        sizes = [row[g] for row in self._sizes]
        n = flat.numel()
        index, served_ids = self._route(g, flat, sizes)
        group = self.groups[g]
        plan, d, _ = group._stage((served_ids,), lookup_only=True)
        self._count(g, d)
        served = _lookup(group._lookup_rows(d.inverse), d, [served_ids.numel()],
                         **group._lookup_source())[0]
        if self.world == 1:
            rows = served.detach()  # a leaf of its own: step() hands its gradient to served
        else:
            rows = served.new_empty((self.world * n, served.shape[1]), device=self.comm_device)
            exchange(rows, served.detach().to(self.comm_device), [n] * self.world, sizes,
                     self.group)
            rows = rows.to(self.device)
        if group._staged is not None:  # a training forward: step() sends the gradients back
            rows.requires_grad_()
            generation = self._generation

            def current(grad: Tensor) -> Tensor:
                if self._generation != generation:
                    raise RuntimeError(
                        f"backward of a {type(self).__name__} output whose step is over: a "
                        "later forward, step() or discard() came before this backward; a "
                        "step is forward, backward, then step()")
                return grad
            rows.register_hook(current)
            self._pending.append((g, served, rows, sizes))

        def pick(lo: int, hi: int, sizes: list) -> tuple:
            # Every position has a slot of its own: index_select's backward adds nothing twice.
            return rows.index_select(0, index[lo:hi]).split(sizes)
        return rows, index, pick

    @_eager
    def step(self) -> None:
        """Collective: the gradients of the last forward's rows go to their owners, which
        update their rows and state and commit them."""
        if not self._pending:
            raise RuntimeError(f"{type(self).__name__}.step(): no forward (in training mode, "
                               "with grad enabled) since the last step")
        pending, self._pending = self._pending, None
        self._generation += 1
        for g, served, rows, sizes in pending:
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            if self.world > 1:
                n = rows.shape[0] // self.world
                back = grad.new_empty((sum(sizes), grad.shape[1]), device=self.comm_device)
                grad = exchange(back, grad.to(self.comm_device), sizes, [n] * self.world,
                                self.group).to(served.device)
            if self.grad_scale != 1.0:
                grad = grad * self.grad_scale
            served.backward(grad)  # sums a row's gradients from every rank that asked for it
        for group in self.groups:
            group.step()

    @_eager
    def prefetch(self, features) -> None:
        """Collective: start loading the rows of the next step's batch on their owners (see
        HostEmbedding.prefetch); one exchange of ids per group."""
        prepared, sizes = self._agreed(features, pooling=False)
        for g, (group, (feats, flat, _)) in enumerate(zip(self.groups, prepared[4])):
            group.prefetch(self._route(g, flat, [row[g] for row in sizes])[1])

    @_eager
    def discard(self) -> None:
        self._pending = None
        self._generation += 1
        super().discard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, _, rows, _ in self._pending or ():
            rows.grad = None
        super().zero_grad(set_to_none)

    # ---- checkpoints ---------------------------------------------------------------------

    def gather_state_dict(self) -> dict:
        """Collective: the single-process collection's ``state_dict`` (every table whole, its
        state, the groups' scalars) on every rank, on the host. For tests and export: it holds
        every table in host memory."""
        if self._pending:
            raise RuntimeError(f"{type(self).__name__}.gather_state_dict(): a forward awaits "
                               "its step(); call step() first")
        out = {}
        for key, value in self.state_dict().items():
            name, _, rest = key.partition(".")
            if value.dim() >= 1:  # a table's rows (the scalars are 0-dim), on every rank
                value = gather_cyclic(value, self.tables[self._table_index(name)].num_embeddings,
                                      self.group, self.comm_device)
            out[key] = value
        return out

    def save_shards(self, directory: str) -> None:
        """Collective: each rank writes its rows of every table (weight and optimizer state)
        and its groups' scalars to one file of `directory` (a folder every rank sees), rank 0 a
        ``meta.json``; returns when every file is written. ``load_shards`` reads them at any
        world size, without a rank ever holding more than its own rows."""
        if self._pending:
            raise RuntimeError(f"{type(self).__name__}.save_shards(): a forward awaits its "
                               "step(); call step() first")
        checkpoint.save_collection(self, directory)

    def load_shards(self, directory: str) -> None:
        """This rank's rows of every table, and the groups' scalars, from a checkpoint that
        ``save_shards`` wrote at any world size (the same tables: names, rows, widths, dtypes;
        the same optimizer's state). Everything is checked before anything loads."""
        if self._pending:
            raise RuntimeError(f"{type(self).__name__}.load_shards(): a forward awaits its "
                               "step(); call step() first")
        checkpoint.load_collection(self, directory)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """A whole table (the single-process collection's or ``gather_state_dict``'s) keeps
        this rank's rows; this rank's own rows (``state_dict``'s) load as they are."""
        mine = dict(state_dict)
        names = {t.name: k for k, t in enumerate(self.tables)}
        for key, value in state_dict.items():
            if not key.startswith(prefix):
                continue
            k = names.get(key[len(prefix):].partition(".")[0])
            whole = self.tables[k].num_embeddings if k is not None else None
            if k is not None and isinstance(value, Tensor) and value.dim() >= 1 \
                    and value.shape[0] == whole and whole != self._rows[k]:
                mine[key] = value[self.rank::self.world]
        super()._load_from_state_dict(mine, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rank {self.rank} of {self.world}, "
                f"grad_scale={self.grad_scale}")
