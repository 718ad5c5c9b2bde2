"""A collection of tables split by rows across the ranks of a process group, on the collection's
engine, with a step the host never waits in (so ``CapturedStep`` captures it whole, NCCL
collectives included):

    ebc = ShardedHostEmbeddingBagCollection(tables, optimizer=torch.optim.Adam,
                                            optimizer_kwargs={"lr": 1e-3}, cache_bytes=1 << 30)
    out = ebc(kjt)              # collective: a KeyedTensor, as the single-process one
    loss.backward()             # local
    ebc.step()                  # collective

Row ``id`` of a table lives on rank ``id % world`` (cyclic: a vocabulary sorted by frequency
spreads its hot rows over every rank); each rank holds its rows of every table in the
single-process collection's groups (one ``HostEmbedding`` per width and dtype: its pinned host
table and its own GPU row cache), plus padding rows per group.

Each phase moves buckets whose sizes every rank knows without reading anything back from a
GPU: a rank fills for every owner a bucket as long as its step's ids of that group (its own
positions for that owner first, the owner's padding rows after them), so the sizes follow from
the batches' shapes alone. ``exchange="peer"`` (GPUs of one host) keeps the buckets in torch
symmetric memory, and each rank reads in place over NVLink the rows its ids need (no padding
row crosses the link; the buckets of ids are read whole); ``"collective"`` sends whole buckets,
one ``all_to_all_single`` per group and phase. The ranks learn each other's sizes and whether
any rank failed its checks in one small host exchange (on a gloo group) per forward; a captured
step does that once, at its capture. Owners serve every slot of the buckets with their group's
forward (a padding slot reads a padding row, whose gradient is zero), so the exchange of rows
back, and of gradients to the owners in ``step()``, reuse the same sizes: see
docs/decisions.md, "A sharded step of fixed shapes".

With ``grad_scale=1`` training equals one process training the single-process collection on the
ranks' batches concatenated, with the ranks' losses summed (the owners sum the gradients of a
row asked for by several ranks); pass ``1 / world`` for DDP's average.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..collection import HostEmbeddingBagCollection
from ..table_config import TableConfig, table_index
from ..eager import eager
from . import checkpoint, peer
from .exchange import agree, backend_device, exchange, gather_cyclic, host_route_group, local_rows

# Padding rows a rank holds a group: the padding slots of a bucket read them in turn. One row
# would be a segment as long as all of a step's padding in the owners' gradient sums, which one
# warp finishes alone (docs/decisions.md, "A sharded step of fixed shapes").
PADS = 64


class _Pieces(torch.autograd.Function):
    """`rows` split into pieces of `sizes` rows, each a tensor of its own (as a lookup's
    outputs, which a caller may change in place): the backward joins their gradients with one
    cat, where index_select's adds them into a zeroed whole."""

    @staticmethod
    def forward(ctx, rows: Tensor, sizes: list) -> tuple:
        return tuple(piece.clone() for piece in rows.split(sizes))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return torch.cat([g.reshape(-1, g.shape[-1]) for g in grads]), None


class _PeerBuffers(NamedTuple):
    """The "peer" exchange's buffers: a step's ids, rows and gradients, a prefetch's ids."""
    ids: "peer.PeerBuffer"
    rows: "peer.PeerBuffer"
    grads: "peer.PeerBuffer"
    ahead_ids: "peer.PeerBuffer"


class _Regions(NamedTuple):
    """A group's byte offsets in the peer buffers of ids, rows and gradients."""
    ids: int
    rows: int
    grads: int


class _Routed(NamedTuple):
    """A group's ids routed: where each id sits in the buckets sent, the ids this rank serves."""
    index: Tensor
    served: Tensor


def _peer_buffers(coll, exchange: str) -> Optional[_PeerBuffers]:
    """The peer buffers of collection `coll` for the "peer" exchange, or None. Every rank
    decides alike: the tests are the same on every rank, or collective."""
    if coll.world == 1 or exchange == "collective":
        return None
    ok = coll.comm_device.type == "cuda" and peer.available()
    if ok and coll.device != coll.comm_device:  # the groups resolved "cuda" to a GPU
        if exchange == "peer":
            raise ValueError(f"device: exchange='peer' stages the rows on the group's GPU "
                             f"{coll.comm_device}, got {coll.device}")
        ok = False
    if ok:
        ok = peer.one_host(coll.route_group)
    if not ok:
        if exchange == "peer":
            raise ValueError("exchange='peer' needs an NCCL group of GPUs on one host and "
                             "torch's symmetric memory; use 'collective'")
        return None
    buffers = _PeerBuffers(*(peer.PeerBuffer(coll.group, coll.route_group, coll.comm_device)
                             for _ in range(4)))
    try:
        buffers.ids.reserve(0)  # collective: a host without peer access fails here, alike
    except Exception:  # any: agree raised it (or its own error) on every rank
        if exchange == "peer":
            raise
        return None  # "auto": the collectives
    return buffers


class ShardedHostEmbeddingBagCollection(HostEmbeddingBagCollection):
    """``HostEmbeddingBagCollection`` split by rows across a process group (see the module
    docstring); ``forward``, ``prefetch`` and ``step`` are collective (every rank calls them
    in the same order), backward is local.

    Args:
        tables, optimizer, optimizer_kwargs, bounds_check, dtype, state_dtype,
            stochastic_rounding, is_weighted: as HostEmbeddingBagCollection's, for the whole
            tables (each rank holds its rows).
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
        exchange: how rows and gradients move between ranks: ``"collective"``, one
            ``all_to_all_single`` per phase (NCCL or gloo; any hosts); ``"peer"``, each rank
            reads the rows it needs from its peers' GPU memory in place (torch symmetric memory,
            GPUs of one host over NVLink: no padding row crosses the link; needs `device` to be
            the group's GPU); ``"auto"`` (default): ``"peer"`` for NCCL on one host where
            symmetric memory can be set up, else collective (every rank decides alike).

    ``state_dict()`` holds this rank's rows under the single-process keys;
    ``gather_state_dict()`` (collective) the whole tables on every rank;
    ``load_state_dict`` takes either, so a single-process checkpoint loads at any world size.

    Example::

        ebc = ShardedHostEmbeddingBagCollection([TableConfig("user", 50_000_000, 128)],
                                                optimizer=torch.optim.Adam, cache_bytes=8 << 30)
        out = ebc(KeyedJaggedTensor.from_lengths_sync(["user"], ids, lengths))
        out["user"].sum().backward(); ebc.step()
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer=torch.optim.Adam,
                 optimizer_kwargs: Optional[dict] = None, group=None, device=None,
                 cache_bytes: int = 0, bounds_check: str = "raise", dtype=torch.float32,
                 stochastic_rounding: Optional[bool] = None, grad_scale: float = 1.0,
                 route_group=None, exchange: str = "auto", state_dtype=None,
                 is_weighted: bool = False):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed: call "
                               "torch.distributed.init_process_group first")
        if exchange not in ("auto", "collective", "peer"):
            raise ValueError(f"exchange must be 'auto', 'collective' or 'peer', got {exchange!r}")
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) \
                or not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be a finite number, got {grad_scale!r}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the group")
        comm_device = backend_device(group)
        tables = list(tables)
        if any(getattr(t, "hashed", False) for t in tables):
            raise NotImplementedError("tables: a sharded collection takes no hashed table yet")
        held = [local_rows(t.num_embeddings, rank, world) if isinstance(t, TableConfig) else 0
                for t in tables]  # the base class names a table that is not a TableConfig
        super().__init__(tables, optimizer, optimizer_kwargs,
                         device=comm_device if device is None else device,
                         cache_bytes=cache_bytes, bounds_check=bounds_check, dtype=dtype,
                         stochastic_rounding=stochastic_rounding, state_dtype=state_dtype,
                         is_weighted=is_weighted, _held_rows=held, _spare_rows=PADS)
        self.group, self.rank, self.world = group, rank, world
        self.padding_rows = PADS  # each group's rows past this rank's rows of its tables
        self.comm_device = comm_device
        self.grad_scale = float(grad_scale)
        if route_group is None and comm_device.type == "cuda":
            route_group = host_route_group(group)
        self.route_group = route_group if route_group is not None else group
        if dist.get_world_size(self.route_group) != world:
            raise ValueError("route_group must hold the ranks of group, in the same order")
        # Where each table's rows start in each owner's group, and each owner's first padding row.
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
        self._peer = _peer_buffers(self, exchange)
        self._peer_at: Optional[list] = None  # per group: its regions of the peer buffers
        self._ahead_at: Optional[list] = None  # the same for a prefetch's ids
        self._ahead_read = False  # a prefetch's ids read with no barrier since (see prefetch)
        self._sizes: Optional[list] = None  # [rank][group] ids of the forward being routed
        self._generation = 0  # forwards, steps and discards so far: a stale backward raises
        self._pending: Optional[list] = None  # per group: (served, received rows, sizes)

    @property
    def exchange(self) -> str:
        """How this module's ranks exchange rows: "peer" or "collective" (what "auto" chose)."""
        return "peer" if self._peer is not None else "collective"

    @property
    def _shards(self) -> list:
        """The modules this rank's rows live in (count_parameters and clip_grad_norm_ see the
        collection as sharded through them)."""
        return list(self.groups)

    def num_parameters(self) -> int:
        """The whole tables' weights (rows x dim, over every rank)."""
        return sum(t.num_embeddings * t.embedding_dim for t in self.tables)

    # ---- a step --------------------------------------------------------------------------

    def _peer_layout(self, sizes: list, ahead: bool = False) -> list:
        """Collective: per group, the byte offsets of its regions in the peer buffers (ids;
        rows and gradients too unless `ahead`, a prefetch's), the same on every rank: sized
        by the largest rank's ids."""
        ends = [0, 0, 0]
        layout = []
        for g, group in enumerate(self.groups):
            ns = [row[g] for row in sizes]
            row = group.embedding_dim * group.dtype.itemsize
            layout.append(_Regions(*ends))
            need = [self.world * max(ns) * 8, sum(ns) * row, self.world * max(ns) * row]
            ends = [e + peer.aligned(b) for e, b in zip(ends, need)]
        ids, rows, grads, ahead_ids = self._peer
        (ahead_ids if ahead else ids).reserve(ends[0])
        if not ahead:
            rows.reserve(ends[1])
            grads.reserve(ends[2])
        return layout

    def _stacked(self, table: int, ids: Tensor, trains: bool = False) -> Tensor:
        """Table `table`'s ids as (the owner's row in its group) * world + owner (no table is
        hashed here: `trains` changes nothing)."""
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
        sizes = [ids.flat.numel() for ids in prepared.grouped] if prepared else \
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

    def _padding(self, g: int, n: int, out: Optional[Tensor] = None) -> Tensor:
        """(world * n,): every owner's bucket of n slots filled with its padding rows in turn
        (written into `out` when given)."""
        spread = torch.arange(n, device=self.device) % PADS
        if out is None:
            out = torch.empty(self.world * n, dtype=torch.int64, device=self.device)
        return torch.add(self._pads[g].unsqueeze(1), spread, out=out.view(self.world, n)).view(-1)

    def _route(self, g: int, flat: Tensor, sizes: list, ahead: bool = False) -> _Routed:
        """(where each id of `flat` sits in the buckets sent, the ids this rank's owners serve)
        for group `g`: one exchange of ids, `sizes[r]` from rank r (`ahead`: a prefetch's, in
        its own peer buffer)."""
        n, world = flat.numel(), self.world
        if world == 1:
            return _Routed(torch.arange(n, device=flat.device), flat)
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
        if self._peer is not None:
            buffer = self._peer.ahead_ids if ahead else self._peer.ids
            at = (self._ahead_at if ahead else self._peer_at)[g].ids
            send = self._padding(g, n, out=buffer.local(at, (world * n,), torch.int64))
            send.index_copy_(0, index, flat // world)
            buffer.barrier()
            # Rank r's bucket for this rank: ids r asks of it, then this rank's padding rows.
            received = torch.cat([buffer.remote(r, at + self.rank * sizes[r] * 8, (sizes[r],),
                                                torch.int64) if sizes[r] else flat.new_empty(0)
                                  for r in range(world)])
            return _Routed(index, received)
        send = self._padding(g, n).index_copy_(0, index, flat // world)
        received = torch.empty(sum(sizes), dtype=torch.int64, device=self.comm_device)
        exchange(received, send.to(self.comm_device), sizes, [n] * world, self.group)
        return _Routed(index, received.to(self.device))

    @eager
    def forward(self, features):
        prepared, sizes = self._agreed(features)  # raises before anything changes
        if self._peer is not None:
            self._peer_at = self._peer_layout(sizes)
            self._ahead_read = False  # its barriers follow the last prefetch's reads
        self._sizes = sizes
        self._pending = []  # a forward without its step before: the groups drop its rows
        self._generation += 1  # that forward's outputs can no longer take a backward
        return self._forward(prepared)

    def _group_rows(self, g: int, flat: Tensor, lookup_only: bool, pool_only=False) -> tuple:
        """The rows of every id of `flat`: routed to their owners, staged by them, sent back
        (see the module docstring)."""
        sizes = [row[g] for row in self._sizes]
        n = flat.numel()
        index, served_ids = self._route(g, flat, sizes)
        group = self.groups[g]
        engine = group.engine
        d = engine.stage((served_ids,), group.trains, lookup_only=True).distinct
        self._count(g, d)
        (served,) = engine.lookup(engine.lookup_rows(d.inverse), d, [served_ids.numel()])
        back = None  # the peer exchange's (this rank's bucket places, served slots' sources)
        if self.world == 1:
            rows = served.detach()  # a leaf of its own: step() hands its gradient to served
        elif self._peer is not None:
            rows, back = self._peer_rows(g, served.detach(), served_ids, index, n, sizes)
            index = torch.arange(n, device=self.device)  # rows come in this rank's id order
        else:
            rows = served.new_empty((self.world * n, served.shape[1]), device=self.comm_device)
            exchange(rows, served.detach().to(self.comm_device), [n] * self.world, sizes,
                     self.group)
            rows = rows.to(self.device)
        if engine.staged is not None:  # a training forward: step() sends the gradients back
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
            self._pending.append((g, served, rows, sizes, back))

        ordered = self.world == 1 or self._peer is not None  # rows in the ids' order

        def pick(lo: int, hi: int, sizes: list) -> tuple:
            if ordered and lo == 0 and hi == rows.shape[0]:
                return _Pieces.apply(rows, sizes)
            # Every position has a slot of its own: index_select's backward adds nothing twice.
            return rows.index_select(0, index[lo:hi]).split(sizes)
        return rows, index, pick

    def _peer_rows(self, g: int, served: Tensor, served_ids: Tensor, index: Tensor, n: int,
                   sizes: list) -> tuple:
        """(this rank's rows, one per id in its order, read from their owners' served rows in
        place; what step() needs to send the gradients back the same way)."""
        group = self.groups[g]
        buffer, at = self._peer.rows, self._peer_at[g].rows
        buffer.local(at, tuple(served.shape), served.dtype).copy_(served)
        buffer.barrier()
        owner = index // n if n else index
        before = sum(sizes[:self.rank])  # this rank's bucket in every owner's served rows
        rows = buffer.rows(at, owner, index - owner * n + before, group.embedding_dim,
                           served.dtype)
        # The served slots' gradients: slot k of rank r's bucket is row rank * sizes[r] + k of
        # r's bucketed gradients, a padding slot none (zeros, never read over the link). Made
        # by kernels from host ints alone: no upload (a capture holds no host copy).
        source = torch.cat([torch.full((m,), r, dtype=torch.int64, device=self.device)
                            for r, m in enumerate(sizes)])
        row_of = torch.cat([torch.arange(self.rank * m, (self.rank + 1) * m, device=self.device)
                            for m in sizes])
        row_of = torch.where(served_ids >= self._pads[g][self.rank], -1, row_of)
        return rows, (index, source, row_of)

    @eager
    def step(self) -> None:
        """Collective: the gradients of the last forward's rows go to their owners, which
        update their rows and state and commit them."""
        if not self._pending:
            raise RuntimeError(f"{type(self).__name__}.step(): no forward (in training mode, "
                               "with grad enabled) since the last step")
        pending, self._pending = self._pending, None
        self._generation += 1
        for g, served, rows, sizes, back in pending:
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            if back is not None:
                index, source, row_of = back
                buffer, at = self._peer.grads, self._peer_at[g].grads
                n = rows.shape[0]
                buffer.local(at, (self.world * n, grad.shape[1]), grad.dtype) \
                    .index_copy_(0, index, grad)  # bucketed; the padding slots left as they are
                buffer.barrier()
                grad = buffer.rows(at, source, row_of, grad.shape[1], grad.dtype)
            elif self.world > 1:
                n = rows.shape[0] // self.world
                back = grad.new_empty((sum(sizes), grad.shape[1]), device=self.comm_device)
                grad = exchange(back, grad.to(self.comm_device), sizes, [n] * self.world,
                                self.group).to(served.device)
            if self.grad_scale != 1.0:
                grad = grad * self.grad_scale
            served.backward(grad)  # sums a row's gradients from every rank that asked for it
        self._step_groups()

    @eager
    def prefetch(self, features) -> None:
        """Collective: start loading the rows of the next step's batch on their owners (see
        HostEmbedding.prefetch); one exchange of ids per group."""
        prepared, sizes = self._agreed(features, pooling=False)
        if self._peer is not None:
            self._ahead_at = self._peer_layout(sizes, ahead=True)
            if self._ahead_read:  # the peers may still read the last prefetch's ids
                self._peer.ahead_ids.barrier()
            self._ahead_read = True
        for g, (group, (feats, flat, _)) in enumerate(zip(self.groups, prepared.grouped)):
            group.prefetch(self._route(g, flat, [row[g] for row in sizes], ahead=True).served)

    @eager
    def discard(self) -> None:
        self._pending = None
        self._generation += 1
        super().discard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, _, rows, _, _ in self._pending or ():
            rows.grad = None
        super().zero_grad(set_to_none)

    # ---- checkpoints ---------------------------------------------------------------------

    def gather_state_dict(self) -> dict:
        """Collective: the single-process collection's ``state_dict`` (every table whole, its
        state, the groups' scalars) on every rank, the tables on the host, everything as
        copies (unlike ``state_dict()``'s references, later steps leave them as they are; a
        scalar stays on its device). For tests and export: it holds every table in host
        memory."""
        if self._pending:
            raise RuntimeError(f"{type(self).__name__}.gather_state_dict(): a forward awaits "
                               "its step(); call step() first")
        out = {}
        for key, value in self.state_dict().items():
            name, _, rest = key.partition(".")
            if value.dim() >= 1:  # a table's rows (the scalars are 0-dim), on every rank
                value = gather_cyclic(value, self.tables[table_index(self.tables, name)].num_embeddings,
                                      self.group, self.comm_device)
            else:  # a copy like the tables': a snapshot the next step does not change
                value = value.detach().clone()
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
