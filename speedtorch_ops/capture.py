"""A whole training step captured once in a CUDA graph and replayed: the host then spends
microseconds per step instead of milliseconds of Python and kernel launches.

    emb = HostEmbedding(V, D, optimizer=torch.optim.Adam,
                        optimizer_kwargs={"lr": 1e-3, "capturable": True},
                        cache_bytes=2**30, bounds_check="prechecked")

    def train_step(ids):                  # ids: on the GPU, the same shape every step
        loss = head(emb(ids)).sum()
        loss.backward()
        emb.step(); dense_optimizer.step(); dense_optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    step = CapturedStep(train_step, rows=(V,))
    for ids in batches:                   # host ids (NumPy or CPU tensors)
        loss = step(ids)                  # checked on the host, then one graph replay

Every call trains one step: the first ``warmup`` calls run eagerly on a side stream (CUDA graphs
need the allocations and lazy initialisations done before capture), the next one captures and
replays. What a step may do: only GPU work with shapes fixed by the ids' shapes (the modules
qualify: a step never makes the host wait), optimizers built with ``capturable=True`` (fused or
not: torch refuses to capture one without it), dense gradients kept between steps
(``zero_grad(set_to_none=False)``). The ids are checked on the host against ``rows`` before
they are copied in, so the modules need not check them on the GPU
(``bounds_check="prechecked"``). Returned tensors are the graph's own outputs, overwritten by the
next call: clone what you keep. Anything that reallocates what the
graph uses (``set_cache_bytes``, a new optimizer) needs a new ``CapturedStep``. A step that
fails inside the capture raises its own error; torch leaves the process's CUDA random generator
unusable after a failed capture, so start a new process.
"""

from __future__ import annotations

import gc
import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .training.placement import Uploaded, upload_all
from .training.plan import _INTEGER, Plan, host_ids, out_of_range


class CapturedStep:
    """``step(*ids)`` (device id tensors in, tensors out) captured in a CUDA graph; see the
    module docstring.

    Args:
        step: the training step, a function of the step's id tensors (on the GPU, the same
            shapes every call) returning tensors; GPU work only, no host waits.
        rows: ``rows[k]``, the number of rows the ``k``-th ids index (checked on the host: a
            bad id raises before anything is copied or run); it must not exceed the table's
            size, as the modules trust these ids (``bounds_check="prechecked"``).
        device: the GPU (default: the current one).
        warmup: eager calls before the capture (at least 1).
        group: for a step of a sharded module, a gloo group over its ranks (the module's
            ``route_group``): each call's checks are agreed on there, so a bad id on any rank
            makes every rank raise before its replay (a rank left replaying alone would wait in
            its collectives for ever). None: this process's checks alone.

    Returns (a call ``captured(*ids)``, ids as NumPy arrays or tensors on any device): the
    step's outputs, the graph's own tensors (overwritten by the next call: clone to keep). Ids
    already on the step's GPU (all of a call's) are checked there with one wait and copied on
    the device; others are checked on the host and uploaded in one copy (ids of one integer
    dtype as they are, widened to int64 on the GPU).

    Example::

        captured = CapturedStep(train_step, rows=(V,))
        for ids in batches:
            loss = captured(ids)
    """

    def __init__(self, step: Callable, rows: Sequence[int], device=None, warmup: int = 3,
                 group=None):
        if not torch.cuda.is_available():
            raise RuntimeError("CapturedStep needs a CUDA GPU (CUDA graphs)")
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (eager steps before the capture), got "
                             f"{warmup}")
        self.step = step
        self.rows = [int(r) for r in rows]
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda", torch.cuda.current_device())
        self.warmup = warmup
        self.group = group
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: Optional[list] = None
        self._flat: Optional[torch.Tensor] = None  # the inputs' one buffer
        self._outputs = None
        self._side = torch.cuda.Stream(self.device)
        self._pinned = _PinnedRing()

    def _checked(self, ids):
        """The call's ids checked against ``rows``: ``_HostIds`` (host ids of one integer
        dtype, copied into one pinned buffer and checked there), or a list of int64 tensors
        (ids on the step's GPU, or host ids of mixed dtypes)."""
        if len(ids) != len(self.rows):
            raise ValueError(f"expected {len(self.rows)} id tensors (one per entry of rows), got "
                             f"{len(ids)}")
        if ids and all(isinstance(x, torch.Tensor) and x.device == self.device for x in ids):
            return self._checked_on_device(ids)
        for k, x in enumerate(ids):
            shape = tuple(np.shape(x))
            if self._inputs is not None and shape != tuple(self._inputs[k].shape):
                raise ValueError(f"ids[{k}] has shape {shape}, but the step was captured with "
                                 f"{tuple(self._inputs[k].shape)}; a graph replays fixed shapes")
        staged = _HostIds.of(ids, self.rows, self._pinned)
        if staged is not None:
            return staged
        out = []
        for k, (x, rows) in enumerate(zip(ids, self.rows)):
            flat = host_ids(x, f"ids[{k}]")
            Plan(flat, "cpu").check(rows, f"ids[{k}]")
            out.append(flat.view(np.shape(x)))
        return out

    def _checked_on_device(self, ids) -> list:
        """Ids already on the step's GPU, checked there with one wait for them all (a bad id
        raises naming its tensor, position and value; nothing runs), as int64."""
        for k, x in enumerate(ids):
            if x.dtype not in _INTEGER:
                raise TypeError(f"ids[{k}] must be integers, got {x.dtype}")
            if self._inputs is not None and x.shape != self._inputs[k].shape:
                raise ValueError(f"ids[{k}] has shape {tuple(x.shape)}, but the step was "
                                 f"captured with {tuple(self._inputs[k].shape)}; a graph replays "
                                 "fixed shapes")
        bad = torch.stack([((x < 0) | (x >= rows)).any() for x, rows in zip(ids, self.rows)])
        for k in torch.nonzero(bad.cpu()).flatten().tolist():
            flat = ids[k].reshape(-1)
            at = int(torch.nonzero((flat < 0) | (flat >= self.rows[k]))[0])
            raise out_of_range(f"ids[{k}]", at, int(flat[at]), self.rows[k])
        return [x.to(torch.int64) for x in ids]

    def __call__(self, *ids):
        with torch.cuda.device(self.device):
            return self._call(ids)

    def _inputs_of(self, checked, out: Optional[torch.Tensor] = None) -> Uploaded:
        """One int64 buffer and the step's inputs in it, on the GPU (`out` when given): host ids
        in one upload, ids on the GPU in one copy there."""
        if isinstance(checked, _HostIds):
            uploaded = checked.upload(self.device, out)
            self._pinned.copied()
            return uploaded
        if checked[0].device.type == "cpu":
            return upload_all(checked, self.device, out=out)
        if out is None:
            out = torch.empty(sum(x.numel() for x in checked), dtype=torch.int64,
                              device=self.device)
        views = list(out.split([x.numel() for x in checked]))
        torch.cat([x.reshape(-1) for x in checked], out=out)
        return Uploaded(out, [v.view(x.shape) for v, x in zip(views, checked)])

    def _call(self, ids):
        if self.group is None:
            host = self._checked(ids)
        else:
            host, error = None, None
            try:
                host = self._checked(ids)
            except Exception as e:  # raised here, and on every other rank, by agree
                error = e
            from .distributed.exchange import agree  # only for sharded steps
            agree(self.group, error, [])
        self.calls += 1
        if self.calls <= self.warmup:
            current = torch.cuda.current_stream(self.device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                result = self.step(*self._inputs_of(host).views)
            current.wait_stream(self._side)
            return result
        if self.graph is None:
            # One buffer for every input: each step's ids then cross in one copy.
            self._flat, self._inputs = self._inputs_of(host)
            graph = torch.cuda.CUDAGraph()
            # A pinned table freed during the capture unregisters its memory, a call that a
            # capture forbids: it invalidates the capture, which then fails at a later kernel
            # (seen on a GPU when the cyclic collector freed an earlier model's tables
            # mid-capture). Collect first and keep the collector off until the capture ends.
            gc.collect()
            collecting = gc.isenabled()
            gc.disable()
            failed = None
            try:
                with torch.cuda.graph(graph):
                    try:
                        self._outputs = self.step(*self._inputs)
                    except BaseException as error:
                        failed = error
                        raise
            except Exception as error:
                # A step that fails after forking a side stream (e.g. out of memory, mid-step)
                # makes the capture's end fail too ("unjoined work"), which would hide why.
                # torch then leaves the CUDA random generator in capture mode (its next use
                # fails): a process whose capture failed should start afresh.
                if failed is not None and error is not failed:
                    raise failed from error
                raise
            finally:
                if collecting:
                    gc.enable()
            self.graph = graph  # only a capture that finished is replayed
        else:
            self._inputs_of(host, out=self._flat)
        self.graph.replay()
        return self._outputs


class _HostIds:
    """A call's host ids, all of one integer dtype (NumPy arrays or plain CPU tensors), copied
    as they are into one pinned buffer (of a ``_PinnedRing``) and checked there; widened to
    int64 on the GPU. The host's share of a step: no int64 copy of each input, two reductions
    per input and one copy (int32 ids cross in half the bytes)."""

    # NumPy dtypes whose values torch copies and widens on the GPU as they are (torch's
    # unsigned types past uint8 have no such copy).
    _DTYPES = {np.dtype(t): getattr(torch, t) for t in ("int8", "uint8", "int16", "int32",
                                                         "int64")}

    def __init__(self, staging: torch.Tensor, shapes: list):
        self.staging, self.shapes = staging, shapes

    @classmethod
    def of(cls, ids, rows: Sequence[int], pinned: "_PinnedRing") -> Optional["_HostIds"]:
        """The ids staged in a buffer of `pinned` and checked (a bad id raises, naming its
        input, position and value; nothing is copied to the GPU), or None when they are not all
        host ids of one such dtype."""
        arrays = []
        for x in ids:
            if isinstance(x, torch.Tensor):
                if type(x) is not torch.Tensor or x.device.type != "cpu" or x.is_neg():
                    return None
                x = x.numpy()
            elif not isinstance(x, np.ndarray):
                return None
            arrays.append(x)
        if not arrays:
            return None
        dtype = arrays[0].dtype
        if dtype not in cls._DTYPES or any(a.dtype != dtype for a in arrays):
            return None
        sizes = [a.size for a in arrays]
        staging = pinned.take(sum(sizes), cls._DTYPES[dtype])
        flat, at = staging.numpy(), 0
        for k, (a, n) in enumerate(zip(arrays, sizes)):
            part = flat[at:at + n]
            np.copyto(part, a.reshape(-1))
            at += n
            if n and (part.min() < 0 or part.max() >= rows[k]):
                # The first bad id, named as the general path names it.
                Plan(host_ids(a, f"ids[{k}]"), "cpu").check(rows[k], f"ids[{k}]")
        return cls(staging, [a.shape for a in arrays])

    def upload(self, device: torch.device, out: Optional[torch.Tensor] = None) -> Uploaded:
        """The ids as one int64 buffer on `device` (`out` when given) and the inputs, views of
        it in their shapes, queued on the current stream: one copy from the pinned buffer,
        widened there if narrower."""
        if out is None:
            out = torch.empty(self.staging.numel(), dtype=torch.int64, device=device)
        if self.staging.dtype == torch.int64:
            out.copy_(self.staging, non_blocking=True)
        else:
            out.copy_(self.staging.to(device, non_blocking=True))
        sizes = [math.prod(s) for s in self.shapes]
        return Uploaded(out, [part.view(s) for part, s in zip(out.split(sizes), self.shapes)])


class _PinnedRing:
    """A few pinned buffers for a step's host ids, taken in turn; each is written again once
    the copy out of it has run, so the host waits only when it is that many calls ahead of the
    GPU. Kept, not taken from torch's pinned allocator each call: while the GPU is busy its
    blocks are not free again until their copies ran, and a new block costs a page-locking
    call."""

    SIZE = 3

    def __init__(self):
        self._buffers: list = [None] * self.SIZE
        self._done: list = [None] * self.SIZE
        self._turn = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next buffer as `numel` elements of `dtype` (its last copy waited for)."""
        k = self._turn % self.SIZE
        buf = self._buffers[k]
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._buffers[k] = torch.empty(numel, dtype=dtype, pin_memory=True)
            self._done[k] = None  # the old buffer's copy keeps it (torch's allocator's event)
        elif self._done[k] is not None:
            self._done[k].synchronize()
        return buf[:numel]

    def copied(self) -> None:
        """The copy out of the buffer taken last is queued on the current stream: its event."""
        k = self._turn % self.SIZE
        self._done[k] = torch.cuda.current_stream().record_event()
        self._turn += 1
