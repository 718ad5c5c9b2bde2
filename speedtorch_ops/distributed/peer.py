"""Buffers every rank of a group reads in place on its peers (torch symmetric memory: on GPUs of
one host, each rank's buffer mapped into every other's address space, read over NVLink), for a
sharded step's exchanges: a rank reads exactly the rows it needs from their owners, where a
collective of fixed split sizes moves whole buckets, padding included.

Ordering: a rank writes its part, then every rank passes a barrier (a kernel on the current
stream, so the host waits nowhere and a CUDA graph holds it), then the ranks read. A buffer is
written again only after the next barrier on the same ranks, which no rank passes before every
rank has queued (and so finished) the reads before it: each phase of a step that writes a buffer
follows a barrier of a later phase. The last reads of a step have no barrier after them: a
module's buffers go back to torch's symmetric pool when it is freed, so free one (and make the
next) after a device synchronization when its peers may still be reading."""

from __future__ import annotations

import math
import socket
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from .exchange import agree

_ALIGN = 256  # every region starts this many bytes apart (the kernel's 16-byte words and more)
# A barrier waits this long for its peers before it fails the step (a rank that raised mid-step
# would otherwise leave them spinning for good); as long as NCCL's default watchdog, since a
# peer may legitimately be busy on its host (saving a checkpoint) while this GPU waits.
_BARRIER_MS = 10 * 60 * 1000


def aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def one_host(route_group) -> bool:
    """Collective on `route_group` (gloo): whether every rank runs on this host."""
    names = [None] * dist.get_world_size(route_group)
    dist.all_gather_object(names, socket.gethostname(), group=route_group)
    return len(set(names)) == 1


def available() -> bool:
    """Whether this torch has symmetric memory (CUDA builds)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class PeerBuffer:
    """One symmetric buffer of a group: the same size on every rank, grown collectively."""

    def __init__(self, group, route_group, device: torch.device):
        self.group = group if group is not None else dist.group.WORLD
        self.route_group = route_group
        self.device = torch.device(device)
        self.nbytes = 0
        self.buf: Optional[Tensor] = None
        self.handle = None
        self.ptrs: Optional[Tensor] = None  # every rank's buffer address, on the device
        self._retired: list = []  # the buffers before a growth (see reserve)

    def reserve(self, nbytes: int) -> None:
        """Collective (every rank passes the same `nbytes`, as the step's agreed sizes give
        them): the buffer holds at least `nbytes`, in eager steps only (a capture allocates
        nothing). The ranks agree that the allocation worked (one that failed raises on every
        rank, over `route_group`). A grown buffer's old one is kept, never freed: peers may
        still read it, and a captured step keeps reading it (and its addresses) at every
        replay."""
        if self.buf is not None and nbytes <= self.nbytes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a captured sharded step needs more exchange memory than its "
                               "eager steps before it: run them with the captured shapes")
        import torch.distributed._symmetric_memory as symm_mem
        # Doubling: the kept ones sum below the newest.
        nbytes = max(aligned(nbytes), _ALIGN, 2 * self.nbytes)
        made, error = None, None
        try:
            buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(buf, self.group)
            # Each rank's buffer where get_buffer (remote) sees it: the handle's offset applied.
            ptrs = [handle.get_buffer(r, (nbytes,), torch.uint8).data_ptr()
                    for r in range(handle.world_size)]
            made = (buf, handle, torch.tensor(ptrs, dtype=torch.int64, device=self.device))
        except Exception as e:  # out of memory, no peer access: every rank raises (agree)
            error = e
        agree(self.route_group, error, [])
        if self.buf is not None:
            self._retired.append((self.buf, self.handle, self.ptrs))
        self.buf, self.handle, self.ptrs = made
        self.nbytes = nbytes

    def local(self, offset: int, shape, dtype: torch.dtype) -> Tensor:
        """This rank's bytes [offset, ...) as a tensor of `shape` and `dtype`."""
        size = math.prod(shape) * dtype.itemsize
        return self.buf[offset:offset + size].view(dtype).view(shape)

    def remote(self, rank: int, offset: int, shape, dtype: torch.dtype) -> Tensor:
        """Rank `rank`'s bytes [offset, ...) as a tensor here, read in place."""
        return self.handle.get_buffer(rank, tuple(shape), dtype, offset // dtype.itemsize)

    def barrier(self) -> None:
        """Every rank's writes queued before it are seen by every rank's work queued after."""
        self.handle.barrier(channel=0, timeout_ms=_BARRIER_MS)

    def rows(self, offset: int, rank_of: Tensor, row_of: Tensor, dim: int,
             dtype: torch.dtype) -> Tensor:
        """(len(row_of), dim): row row_of[i] of rank rank_of[i]'s rows at `offset` (zeros where
        row_of[i] < 0)."""
        return ops._peer_rows(self.ptrs, offset, rank_of, row_of, dim, dtype)
