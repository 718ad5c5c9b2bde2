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
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .training.placement import upload_all
from .training.plan import Plan, host_ids


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

    Returns (a call ``captured(*ids)``, ids as NumPy arrays or tensors on any device): the
    step's outputs, the graph's own tensors (overwritten by the next call: clone to keep).

    Example::

        captured = CapturedStep(train_step, rows=(V,))
        for ids in batches:
            loss = captured(ids)
    """

    def __init__(self, step: Callable, rows: Sequence[int], device=None, warmup: int = 3):
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
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: Optional[list] = None
        self._flat: Optional[torch.Tensor] = None  # the inputs' one buffer
        self._outputs = None
        self._side = torch.cuda.Stream(self.device)

    def _checked(self, ids) -> list:
        if len(ids) != len(self.rows):
            raise ValueError(f"expected {len(self.rows)} id tensors (one per entry of rows), got "
                             f"{len(ids)}")
        out = []
        for k, (x, rows) in enumerate(zip(ids, self.rows)):
            shape = tuple(np.shape(x))
            flat = host_ids(x, f"ids[{k}]")
            if self._inputs is not None and shape != tuple(self._inputs[k].shape):
                raise ValueError(f"ids[{k}] has shape {shape}, but the step was captured with "
                                 f"{tuple(self._inputs[k].shape)}; a graph replays fixed shapes")
            Plan(flat, "cpu").check(rows, f"ids[{k}]")
            out.append(flat.view(shape))
        return out

    def __call__(self, *ids):
        with torch.cuda.device(self.device):
            return self._call(ids)

    def _call(self, ids):
        host = self._checked(ids)
        self.calls += 1
        if self.calls <= self.warmup:
            current = torch.cuda.current_stream(self.device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                result = self.step(*upload_all(host, self.device)[1])
            current.wait_stream(self._side)
            return result
        if self.graph is None:
            # One buffer for every input: each step's ids then cross in one copy.
            self._flat, self._inputs = upload_all(host, self.device)
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
            upload_all(host, self.device, out=self._flat)
        self.graph.replay()
        return self._outputs
