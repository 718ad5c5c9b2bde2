"""A step's plan: one batch's ids, checked on the host, uploaded and sorted once, with the owner
slot of every duplicate. A plan belongs to the store (or module) whose step made it; nothing
here is shared between tables or steps.

Duplicate ids (the rule of the factories and the modules): slot i of a batch holds row ids[i];
a row's first slot is its *owner*. Gradients of all slots of a row are summed into the owner
(``sum_into_owners``) and each distinct row is written back once, from its owner slot. So each
row is updated once with the sum of its gradients: the same as training the full table on the
batch, lazily (rows outside the batch and their optimizer state do not change).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .placement import upload

_INTEGER = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def reshaped_retrieval(pos, neg=None):
    """SpeedTorch's index order: positives flattened (C order), then negatives flattened."""
    if neg is None:
        return pos.reshape(-1)
    if isinstance(pos, Tensor) or isinstance(neg, Tensor):
        return torch.cat([torch.as_tensor(pos).reshape(-1), torch.as_tensor(neg).reshape(-1)])
    return np.concatenate([np.asarray(pos).reshape(-1), np.asarray(neg).reshape(-1)])


def host_ids(ids, name: str = "ids") -> Tensor:
    """`ids` (NumPy, list or a tensor on any device) as a 1-D int64 CPU tensor."""
    if isinstance(ids, Tensor):
        if ids.dtype not in _INTEGER:
            raise TypeError(f"{name} must be integers, got {ids.dtype}")
        if type(ids) is not Tensor or ids.device.type != "cpu":  # a subclass (fake, batched)
            return ids.reshape(-1).to("cpu", torch.int64)  # ids on a GPU come over once
        ids = ids.resolve_neg().numpy()
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {ids.dtype}")
    # NumPy converts on this thread: torch's conversion of a few ten thousand ids wakes its
    # thread pool, which on a many-core host costs the step milliseconds.
    return torch.from_numpy(np.ascontiguousarray(ids.reshape(-1), dtype=np.int64))


def check_bounds_mode(bounds_check: str) -> None:
    """Raise unless `bounds_check` names a way to treat ids that came on the GPU (see
    ``Plan.check``)."""
    if bounds_check not in ("raise", "prechecked"):
        raise ValueError(f"bounds_check must be 'raise' or 'prechecked', got {bounds_check!r}")


def out_of_range(name: str, position: int, value: int, rows: int) -> RuntimeError:
    return RuntimeError(f"{name}[{position}] = {value} is out of range for a table of {rows} "
                        f"rows; every id must be in [0, {rows}). Nothing was written.")


class Plan:
    """One batch's ids: on the host (``cpu``), and on ``device`` once asked for (``index``),
    sorted once, with each slot's owner. Device work is queued without synchronizing.

    ``Plan.on_device(index)``: a plan of ids that are already on a GPU (``cpu`` is None); no
    host copy is made, so such a plan can be built inside a CUDA graph capture.

    Args:
        ids: the batch's integer ids (any shape), on the host.
        device: where the index goes.

    Example::

        plan = Plan(torch.tensor([3, 1, 3]), torch.device("cpu"))
        plan.check(10)          # every id in [0, 10), or an error naming it
        plan.index              # the ids on the device, int64
    """

    def __init__(self, ids, device: torch.device):
        self.cpu = host_ids(ids)
        self.bounds_check = "raise"
        self.device = torch.device(device)
        self._index: Optional[Tensor] = None
        self._init_cache()

    @classmethod
    def on_device(cls, index: Tensor, bounds_check: str = "raise", name: str = "ids") -> "Plan":
        """A plan of the ids `index` (integers, any shape) where they are; nothing crosses to
        the host. ``bounds_check``: how ``check`` treats them (see there)."""
        if index.dtype not in _INTEGER:
            raise TypeError(f"{name} must be integers, got {index.dtype}")
        check_bounds_mode(bounds_check)
        plan = cls.__new__(cls)
        plan.bounds_check = bounds_check
        plan.cpu = None
        plan.device = index.device
        plan._index = index.reshape(-1).to(torch.int64).contiguous()  # a column of a batch too
        plan._init_cache()
        return plan

    def _init_cache(self) -> None:
        self._sorted: Optional[tuple] = None
        self._owner_sorted: Optional[Tensor] = None
        self._owner: Optional[Tensor] = None
        self._range: Optional[tuple] = None

    def __len__(self) -> int:
        return self.cpu.numel() if self.cpu is not None else self._index.numel()

    def same_ids(self, other: Tensor) -> bool:
        """Whether `other` (1-D int64 on the CPU) holds these ids: a few first (batches of a
        step differ there), then all of them with NumPy (torch.equal wakes its thread pool)."""
        if other.shape != self.cpu.shape:
            return False
        x, y = self.cpu.numpy(), other.numpy()
        return bool((x[:8] == y[:8]).all()) and bool(np.array_equal(x, y))

    def check(self, rows: int, name: str = "ids") -> None:
        """Raise unless every id is in [0, rows). Host ids are checked on the host, where they
        already are, so the ops need not wait for their own device-side check (they run with
        bounds_check='prechecked'). Ids that came on the GPU are checked there with one wait
        for the GPU (the plan's ``bounds_check="raise"``), or not at all (``"prechecked"``: the
        caller checked them, e.g. on the host before copying them into a CUDA graph's inputs)."""
        if self.cpu is None:
            self._check_on_device(rows, name)
            return
        if self.cpu.numel() == 0:
            return
        if self._range is None:  # NumPy: torch wakes its thread pool for 50 k ids
            ids = self.cpu.numpy()
            self._range = (int(ids.min()), int(ids.max()))
        if self._range[0] < 0 or self._range[1] >= rows:
            bad = int(((self.cpu < 0) | (self.cpu >= rows)).nonzero()[0])
            raise out_of_range(name, bad, int(self.cpu[bad]), rows)

    def _check_on_device(self, rows: int, name: str) -> None:
        if self.bounds_check == "prechecked" or self._range is not None or self._index.numel() == 0:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name} on the GPU cannot be checked inside a CUDA graph capture "
                               "(the check waits for the GPU): check them on the host before "
                               "they are copied into the graph's inputs and pass "
                               "bounds_check='prechecked'")
        bad = ((self._index < 0) | (self._index >= rows)).nonzero()  # waits for the GPU
        if bad.numel():
            at = int(bad[0, 0])
            raise out_of_range(name, at, int(self._index[at]), rows)
        self._range = (0, rows - 1)

    @property
    def index(self) -> Tensor:
        """The ids as int64 on the plan's device (uploaded once)."""
        if self._index is None:
            self._index = upload(self.cpu, self.device)
        return self._index

    def on(self, device: torch.device) -> Tensor:
        """The ids on `device`: the plan's own copy there, else a fresh upload."""
        if device == self.device or device.type == self.device.type == "cpu":
            return self.index
        if self.cpu is None:
            return self._index.to(device)
        return upload(self.cpu, device)

    @property
    def sorted(self) -> tuple:
        """(the ids sorted, stably; the slot of each): a row's first slot comes first."""
        if self._sorted is None:
            self._sorted = torch.sort(self.index, stable=True)
        return self._sorted

    @property
    def owner_sorted(self) -> Tensor:
        """The owner slot of each sorted position (the row's first slot: a binary search finds
        the first position of each run, the stable sort keeps a row's slots ascending)."""
        if self._owner_sorted is None:
            sorted_ids, perm = self.sorted
            self._owner_sorted = perm[torch.searchsorted(sorted_ids, sorted_ids)]
        return self._owner_sorted

    @property
    def owner(self) -> Tensor:
        """The owner slot of each slot (see ``adopt_owner``)."""
        if self._owner is None:
            _, perm = self.sorted
            self._owner = torch.empty_like(perm).index_copy_(0, perm, self.owner_sorted)
        return self._owner

    def adopt_owner(self, owner: Tensor) -> None:
        """Take `owner` (the owner slot of each slot, on the plan's device) as ``owner``, which
        then needs no sort of its own: a store that sorted these ids already found it."""
        if owner.shape != (len(self),):
            raise ValueError(f"owner: one slot per id ({len(self)}), got shape "
                             f"{tuple(owner.shape)}")
        self._owner = owner


def sum_into_owners(grad: Tensor, owner: Tensor) -> Tensor:
    """Gradient hook: each row's slot gradients summed into its owner slot, others zero."""
    if grad.is_sparse:
        grad = grad.coalesce()
        rows = owner.to(grad.device)[grad.indices()[0]]
        return torch.sparse_coo_tensor(rows.unsqueeze(0), grad.values(), grad.shape,
                                       check_invariants=False).coalesce()
    return torch.zeros_like(grad).index_add_(0, owner.to(grad.device), grad)
