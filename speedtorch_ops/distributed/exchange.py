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
from typing import List, Optional

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


class Route:
    """One step's routing on one rank: its distinct ids bucketed by owner, how many each rank
    asks of it, and the local row ids it must serve (``requested``, on the host).

    Counts and ids travel on `route_group` (its own device: the host for gloo), rows and
    gradients on `group` (tensors on `comm_device`). Construction is collective. It raises on
    every rank when any rank passed an id outside [0, num_embeddings) or failed before the
    exchange (``error``); nothing has moved then."""

    def __init__(self, ids: Tensor, num_embeddings: int, group, comm_device: torch.device,
                 route_group, error: Optional[BaseException] = None):
        self.group, self.comm_device = group, comm_device
        route_device = backend_device(route_group)
        world = dist.get_world_size(group)
        status, bad = _OK, None
        if error is not None:
            status = _FAILED
        elif ids.numel():
            values = ids.numpy()  # NumPy: torch's reductions wake its thread pool
            if values.min() < 0 or values.max() >= num_embeddings:
                status = _BAD_IDS
                bad = int(np.flatnonzero((values < 0) | (values >= num_embeddings))[0])
        if status == _OK:
            uniq, self.inverse = torch.unique(ids, sorted=True, return_inverse=True)
            owner = uniq % world
            self.order = torch.argsort(owner, stable=True)  # by owner, ascending ids within
            send_ids = (uniq[self.order] // world)
            send_counts = torch.bincount(owner, minlength=world)
        else:
            send_ids = torch.zeros(0, dtype=torch.int64)
            send_counts = torch.zeros(world, dtype=torch.int64)
        header = torch.stack([send_counts, torch.full((world,), status, dtype=torch.int64)], 1)
        received = torch.empty_like(header, device=route_device)
        _all_to_all(received, header.to(route_device), [1] * world, [1] * world, route_group)
        received = received.cpu()  # the host needs the counts to size the next buffers
        statuses = received[:, 1].tolist()
        if status == _FAILED:
            raise error
        if status == _BAD_IDS:
            raise RuntimeError(
                f"ids[{bad}] = {int(ids[bad])} is out of range for a table of {num_embeddings} "
                f"rows; every id must be in [0, {num_embeddings}). Every rank raises; nothing "
                "was written.")
        if any(s != _OK for s in statuses):
            ranks = [r for r, s in enumerate(statuses) if s != _OK]
            what = ("passed ids out of range [0, %d)" % num_embeddings
                    if all(statuses[r] == _BAD_IDS for r in ranks) else "failed in forward")
            raise RuntimeError(f"rank(s) {ranks} of the group {what} (see their errors); every "
                               "rank raises; nothing was written.")
        self.send_counts = send_counts.tolist()
        self.recv_counts = received[:, 0].tolist()
        requested = torch.empty(sum(self.recv_counts), dtype=torch.int64, device=route_device)
        _all_to_all(requested, send_ids.to(route_device), self.recv_counts, self.send_counts,
                    route_group)
        self.requested = requested.cpu()
        self.distinct = len(send_ids)
        self._order = upload(self.order, comm_device)

    def to_requesters(self, rows: Tensor) -> Tensor:
        """The rows an owner serves (``len(requested)``, *row), in ``requested``'s order -> this
        rank's distinct rows in ascending id order (collective)."""
        rows = rows.to(self.comm_device)
        out = rows.new_empty((self.distinct, *rows.shape[1:]))
        _all_to_all(out, rows, self.send_counts, self.recv_counts, self.group)
        return torch.empty_like(out).index_copy_(0, self._order, out)

    def to_owners(self, grad: Tensor) -> Tensor:
        """Gradients of this rank's distinct rows (ascending ids) -> the gradients each owner
        receives, in ``requested``'s order (collective): the reverse of ``to_requesters``."""
        grad = grad.to(self.comm_device)
        send = grad.index_select(0, self._order)
        out = grad.new_empty((len(self.requested), *grad.shape[1:]))
        _all_to_all(out, send, self.recv_counts, self.send_counts, self.group)
        return out


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
