"""The collectives of a sharded table on torch.distributed: where a row lives (cyclic partition),
the routing of a step's distinct ids to their owners and of rows and gradients between them, and
the gather of all shards.

Traps these functions are shaped around:
- gloo has ``all_to_all_single`` but no list ``all_to_all``: every exchange is one flat tensor
  split along dim 0;
- a receiver must size its buffer from what each sender sends (mismatched split sizes hang
  NCCL), so the counts travel first, in a (world, 2) header of fixed shape;
- every rank joins every collective, also with nothing to send, and a rank that cannot go on
  (a bad id) says so in the same header: every rank raises before any id moves, so no rank
  waits for a peer that left and nothing is written anywhere.
"""

from __future__ import annotations

import contextlib
import time
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..training.placement import upload

_OK, _BAD_IDS, _FAILED = 0, 1, 2


def local_rows(num_embeddings: int, rank: int, world: int) -> int:
    """Rows of rank `rank` under the cyclic partition: ids rank, rank + world, ..."""
    return max(0, (num_embeddings - rank + world - 1) // world)


def backend_device(group) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU for NCCL, else the
    host (gloo)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_to_all(out: Tensor, inp: Tensor, out_splits: List[int], in_splits: List[int],
                group) -> None:
    dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)


class PhaseTimes:
    """Seconds per phase of the sharded steps, the device synchronized around each phase (so
    only for a profiling run: the waits change what they measure)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seconds: dict = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def no_phase(name: str):
    return contextlib.nullcontext()


def host_route_group(group):
    """A gloo group over the ranks of an NCCL `group`, for the routing: counts and ids then
    travel host to host, and the host never waits for the GPU to learn them (the rows still
    ride NCCL). Creating a group is collective over the default group, so only for the default
    group (every rank builds the module); None otherwise (the routing uses `group` itself)."""
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        return None
    return dist.new_group(backend="gloo")


def agree(route_group, error: Optional[BaseException], sizes: Sequence[int]) -> list:
    """Collective on `route_group`: every rank learns each rank's `sizes` (host ints, [rank][k])
    and whether any rank failed before it. A rank's own `error` is raised there and every other
    rank raises naming it, so no rank goes on to a collective its peers will not join and
    nothing has moved. With one rank: raises `error`, returns [sizes]."""
    world = dist.get_world_size(route_group)
    if world == 1:
        if error is not None:
            raise error
        return [list(sizes)]
    header = torch.tensor([_OK if error is None else _FAILED, *sizes], dtype=torch.int64)
    device = backend_device(route_group)
    parts = [torch.empty_like(header, device=device) for _ in range(world)]
    dist.all_gather(parts, header.to(device), group=route_group)
    rows = torch.stack(parts).cpu().tolist()
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0] != _OK]
    if failed:
        raise RuntimeError(f"rank(s) {failed} of the group raised before the exchange (see "
                           "their errors); every rank raises; nothing was written.")
    return [row[1:] for row in rows]


def exchange(out: Tensor, inp: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
             group) -> Tensor:
    """`inp` (rows along dim 0, in_splits[r] of them for rank r) sent, `out` (out_splits[r]
    rows from rank r) filled and returned, with split sizes every rank knows already: the host
    reads nothing back and a CUDA graph can hold it. One all_to_all_single: NCCL's list
    all_to_all, with the rank's own part copied beside it, measured slower (docs/decisions.md,
    "A sharded step of fixed shapes")."""
    _all_to_all(out, inp, list(out_splits), list(in_splits), group)
    return out


class Route:
    """One step's routing on one rank, for the ids of one or several tables at once (one
    collective per phase, whatever the number of tables): each table's distinct ids bucketed
    by owner, how many each rank asks of it, and the local row ids it must serve
    (``requested[t]``, on the host).

    Counts and ids travel on `route_group` (its own device: the host for gloo), rows and
    gradients on `group` (tensors on `comm_device`), each rank's part holding its tables one
    after the other. Construction is collective. It raises on every rank when any rank passed
    an id outside its table's [0, num_embeddings) or failed before the exchange (``error``);
    nothing has moved then. With one rank nothing is exchanged."""

    def __init__(self, ids: Sequence[Tensor], num_embeddings: Sequence[int], group,
                 comm_device: torch.device, route_group, error: Optional[BaseException] = None,
                 names: Optional[Sequence[str]] = None):
        self.group, self.comm_device = group, comm_device
        tables = len(num_embeddings)
        names = list(names) if names is not None else ["ids"] * tables
        world = dist.get_world_size(group)
        self.world = world
        status, bad = _OK, None
        if error is not None:
            status = _FAILED
        else:
            for t, (flat, rows) in enumerate(zip(ids, num_embeddings)):
                if flat.numel():
                    values = flat.numpy()  # NumPy: torch's reductions wake its thread pool
                    if values.min() < 0 or values.max() >= rows:
                        status = _BAD_IDS
                        at = int(np.flatnonzero((values < 0) | (values >= rows))[0])
                        bad = (names[t], at, int(values[at]), rows)
                        break
        self.inverse, orders, send_ids = [], [], []
        send_counts = torch.zeros((world, tables), dtype=torch.int64)
        if status == _OK:
            for t, flat in enumerate(ids):
                uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
                owner = uniq % world
                order = torch.argsort(owner, stable=True)  # by owner, ascending ids within
                self.inverse.append(inverse)
                orders.append(order)
                send_ids.append(uniq[order] // world)
                send_counts[:, t] = torch.bincount(owner, minlength=world)
        self.send_counts = send_counts.tolist()  # [rank][table]
        if world == 1:  # no peer: raise here, serve the ids to ourselves
            self._raise(status, bad, error, [status])
            self.requested = send_ids
            return
        header = torch.cat([send_counts, torch.full((world, 1), status, dtype=torch.int64)], 1)
        route_device = backend_device(route_group)
        received = torch.empty_like(header, device=route_device)
        _all_to_all(received, header.to(route_device), [1] * world, [1] * world, route_group)
        received = received.cpu()  # the host needs the counts to size the next buffers
        self._raise(status, bad, error, received[:, tables].tolist())
        self.recv_counts = received[:, :tables].tolist()
        flat_send = _by_rank_then_table(send_ids, self.send_counts)
        flat_recv = torch.empty(int(received[:, :tables].sum()), dtype=torch.int64,
                                device=route_device)
        _all_to_all(flat_recv, flat_send.to(route_device), [sum(c) for c in self.recv_counts],
                    [sum(c) for c in self.send_counts], route_group)
        self.requested = _per_table(flat_recv.cpu(), self.recv_counts, [()] * tables)
        self._orders = [upload(o, comm_device) for o in orders]

    @staticmethod
    def _raise(status, bad, error, statuses) -> None:
        if status == _FAILED:
            raise error
        if status == _BAD_IDS:
            name, at, value, rows = bad
            raise RuntimeError(
                f"{name}[{at}] = {value} is out of range for a table of {rows} rows; every id "
                f"must be in [0, {rows}). Every rank raises; nothing was written.")
        if any(s != _OK for s in statuses):
            ranks = [r for r, s in enumerate(statuses) if s != _OK]
            what = ("passed ids out of range" if all(statuses[r] == _BAD_IDS for r in ranks)
                    else "failed in forward")
            raise RuntimeError(f"rank(s) {ranks} of the group {what} (see their errors); every "
                               "rank raises; nothing was written.")

    def to_requesters(self, rows: Sequence[Tensor]) -> List[Tensor]:
        """The rows an owner serves, per table (``len(requested[t])``, *row), in
        ``requested[t]``'s order -> this rank's distinct rows of each table in ascending id
        order (collective: one exchange for all tables, which share a dtype)."""
        rows = [r.to(self.comm_device) for r in rows]
        if self.world == 1:
            return rows
        out = self._exchange(rows, self.recv_counts, self.send_counts)
        return [torch.empty_like(o).index_copy_(0, order, o)
                for o, order in zip(out, self._orders)]

    def to_owners(self, grads: Sequence[Tensor]) -> List[Tensor]:
        """Gradients of this rank's distinct rows of each table (ascending ids) -> the gradients
        each owner receives, in ``requested[t]``'s order (collective): the reverse of
        ``to_requesters``."""
        grads = [g.to(self.comm_device) for g in grads]
        if self.world == 1:
            return grads
        send = [g.index_select(0, order) for g, order in zip(grads, self._orders)]
        return self._exchange(send, self.send_counts, self.recv_counts)

    def _exchange(self, parts: List[Tensor], send: list, recv: list) -> List[Tensor]:
        """parts[t] split by rank as send[r][t] rows -> what each rank sent, recv[r][t] rows of
        table t from rank r, per table (rows in rank order)."""
        dtype = parts[0].dtype
        if any(p.dtype != dtype for p in parts):
            raise ValueError("the tables routed together must share a dtype, got "
                             f"{sorted({str(p.dtype) for p in parts})}")
        shapes = [tuple(p.shape[1:]) for p in parts]
        widths = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        flat = _by_rank_then_table([p.reshape(p.shape[0], w) for p, w in zip(parts, widths)],
                                   send)
        out = flat.new_empty(sum(c * w for row in recv for c, w in zip(row, widths)))
        _all_to_all(out, flat.reshape(-1),
                    [sum(c * w for c, w in zip(row, widths)) for row in recv],
                    [sum(c * w for c, w in zip(row, widths)) for row in send], self.group)
        return _per_table(out, recv, shapes)


def _by_rank_then_table(parts: Sequence[Tensor], counts: list) -> Tensor:
    """The rows of each table's `parts[t]` (grouped by rank, counts[r][t] rows for rank r)
    regrouped rank by rank, each rank's tables one after the other: one flat send buffer."""
    starts = [0] * len(parts)
    pieces = []
    for row in counts:
        for t, n in enumerate(row):
            pieces.append(parts[t][starts[t]:starts[t] + n].reshape(-1))
            starts[t] += n
    return torch.cat(pieces) if pieces else parts[0].new_empty(0)


def _per_table(flat: Tensor, counts: list, shapes: Sequence[tuple]) -> List[Tensor]:
    """The inverse of ``_by_rank_then_table`` for a received buffer: per table, the rows of
    every rank in rank order, shaped (rows, *shapes[t])."""
    widths = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    per_table = [[] for _ in shapes]
    at = 0
    for row in counts:
        for t, n in enumerate(row):
            per_table[t].append(flat[at:at + n * widths[t]].view(n, *shapes[t]))
            at += n * widths[t]
    return [torch.cat(p) for p in per_table]


def gather_cyclic(local: Tensor, num_embeddings: int, group, comm_device: torch.device) -> Tensor:
    """The full table (num_embeddings, *row) on every rank, on the host, from each rank's
    cyclic shard `local` (collective). Shards differ by one row at most, so each is padded to
    the largest; row k of rank r is global row k * world + r, a transpose of the stack."""
    world = dist.get_world_size(group)
    width = local_rows(num_embeddings, 0, world)
    padded = torch.zeros((width, *local.shape[1:]), dtype=local.dtype, device=comm_device)
    padded[: local.shape[0]] = local.to(comm_device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    stacked = torch.stack(gathered, 1).cpu()  # (width, world, *row)
    return stacked.reshape(width * world, *local.shape[1:])[:num_embeddings].contiguous()
