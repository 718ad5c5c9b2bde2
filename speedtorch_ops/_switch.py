"""Machinery shared by the SpeedTorch-compatible classes: where a store lives, how a batch's ids
become an index, and how rows move between a store and the batch tensors (only through the ops).

Duplicate ids in a batch (the rule the factories document): slot i of the batch-sized weight holds
row ids[i]. A gradient hook sums the gradients of all slots of a row into the row's first slot
(its "owner") and zeroes the others; at write-back every slot of a row writes the owner's values,
for the weight and for every optimizer state tensor. So each row is updated once, with the sum of
its gradients: the same as training the full table on the batch (lazily: rows outside the batch
and their state do not change).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype

from . import ops
from .memory import empty_pinned, is_zero_copy_usable

DTypeLike = Union[str, torch.dtype, np.dtype, type]


def resolve_dtype(dtype: DTypeLike) -> torch.dtype:
    """'float32', np.float32, np.dtype('float32') or torch.float32 -> torch.float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; pass e.g. 'float32' or torch.float32")
    return resolved


def cuda_or_raise(what: str) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} keeps its table in GPU memory, but no CUDA device is available; "
                           "use a pinned/CPU store instead (e.g. CPUPinn=True)")
    return torch.device("cuda", torch.cuda.current_device())


def allocate(shape: Sequence[int], dtype: torch.dtype, placement: str) -> Tensor:
    """Zeros of `shape` in "pinned" host memory (ordinary host memory when no GPU exists: there is
    nothing to pin for), "cpu" memory, or "cuda" memory."""
    if placement == "cuda":
        return torch.zeros(shape, dtype=dtype, device=cuda_or_raise("this store"))
    if placement == "pinned":
        return empty_pinned(shape, dtype, pin=torch.cuda.is_available()).zero_()
    if placement == "cpu":
        return torch.zeros(shape, dtype=dtype)
    raise ValueError(f"unknown placement {placement!r}")


def mmap_npy(path: str, shape: Sequence[int], dtype: torch.dtype, pin: bool) -> Tensor:
    """A table backed by a memory-mapped .npy file: writes to the tensor reach the file."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np_dtype, shape=tuple(shape))
    table = torch.from_numpy(array)
    if pin and torch.cuda.is_available():
        try:
            torch.ops.speedtorch_ops._pin_storage_.default(table)
        except RuntimeError:
            pass  # some file systems cannot be page-locked: the CPU path reads it instead
    return table  # from_numpy keeps the mapping alive as long as the tensor


def next_free_name(stem: str, suffix: str) -> str:
    """`{stem}{n}{suffix}` for the first n not yet on disk (SpeedTorch's MM naming)."""
    n = 0
    while os.path.exists(f"{stem}{n}{suffix}"):
        n += 1
    return f"{stem}{n}{suffix}"


def reshaped_retrieval(pos, neg=None):
    """SpeedTorch's index order: positives flattened (C order), then negatives flattened."""
    if neg is None:
        return pos.reshape(-1)
    if isinstance(pos, Tensor) or isinstance(neg, Tensor):
        return torch.cat([torch.as_tensor(pos).reshape(-1), torch.as_tensor(neg).reshape(-1)])
    return np.concatenate([np.asarray(pos).reshape(-1), np.asarray(neg).reshape(-1)])


def variable_transformer(batchSize, posPerBatch, negPerBatch=None):
    """Slot numbers for the model's inputs: slot i of the batch-sized module holds row ids[i]."""
    pos = np.arange(batchSize * posPerBatch).reshape(batchSize, posPerBatch)
    if negPerBatch is None:
        return pos
    start = batchSize * posPerBatch
    return pos, np.arange(start, start + batchSize * negPerBatch).reshape(batchSize, negPerBatch)


def check_ids_dtype(ids: Tensor) -> None:
    if ids.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"ids must be integers, got {ids.dtype}")


def upload(values: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor on `device`, queued on the current stream. Through pinned memory: a copy
    from pageable memory would wait for the whole stream."""
    if device.type == "cpu":
        return values
    staging = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    # NumPy copies on this thread: torch's CPU copy wakes its thread pool, which cost ~1.4 ms
    # per upload on the H100 VM while the GPU streams were busy (cProfile, 2026-11-22).
    np.copyto(staging.numpy(), values.numpy())
    return staging.to(device, non_blocking=True)


class Plan:
    """One batch's ids as an int64 index (on the CPU and, lazily, on a device), plus each slot's
    owner: the first slot holding the same row. Computed on the device without synchronizing."""

    def __init__(self, ids, device: torch.device):
        index = torch.as_tensor(ids)
        check_ids_dtype(index)
        self.cpu = index.reshape(-1).to("cpu", torch.int64)  # ids given on a GPU come over once
        self.device = device
        self.index = upload(self.cpu, device)
        self._owner: Optional[Tensor] = None
        self._owner_sorted: Optional[Tensor] = None
        self._sorted: Optional[tuple] = None
        self._range = None

    def check(self, rows: int) -> None:
        """Raise unless every id is in [0, rows): on the host, where the ids already are, so the
        ops need not wait for their own device-side check."""
        if self.cpu.numel() == 0:
            return
        if self._range is None:  # NumPy: torch wakes its thread pool for 50 k ids
            ids = self.cpu.numpy()
            self._range = (int(ids.min()), int(ids.max()))
        if self._range[0] < 0 or self._range[1] >= rows:
            bad = int(((self.cpu < 0) | (self.cpu >= rows)).nonzero()[0])
            raise RuntimeError(f"ids[{bad}] = {int(self.cpu[bad])} is out of range for a table of "
                               f"{rows} rows; every id must be in [0, {rows}). Nothing was written.")

    def on(self, device: torch.device) -> Tensor:
        if device == self.device or (device.type == self.device.type == "cpu"):
            return self.index
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
        """The owner slot of each slot."""
        if self._owner is None:
            _, perm = self.sorted
            self._owner = torch.empty_like(perm).index_copy_(0, perm, self.owner_sorted)
        return self._owner


_recent: list = []  # the last few plans: a table's model and optimizer factories share one


def same_ids(a: Tensor, b: Tensor) -> bool:
    """a == b for 1-D int64 CPU tensors: a few elements first (batches of a step differ there),
    then all of them with NumPy (torch.equal costs ~0.2 ms for 50 k ids)."""
    if a.shape != b.shape:
        return False
    x, y = a.numpy(), b.numpy()
    return bool((x[:8] == y[:8]).all()) and bool(np.array_equal(x, y))


def plan_for(pos, neg, device: torch.device) -> Plan:
    """The plan of these ids on `device`: reused when a recent call had the same ids (the model
    and optimizer factories of a table, and afterOptimizerStep after beforeForwardPass), so the
    ids are uploaded and sorted once per step."""
    ids = torch.as_tensor(reshaped_retrieval(pos, neg)).reshape(-1)
    check_ids_dtype(ids)
    if ids.device.type == "cpu":  # NumPy converts without waking torch's thread pool
        ids = torch.from_numpy(ids.numpy().astype(np.int64, copy=False))
    ids = ids.to("cpu", torch.int64)
    for plan in _recent:
        if plan.device == device and same_ids(ids, plan.cpu):
            return plan
    plan = Plan(ids, device)
    _recent.insert(0, plan)
    del _recent[8:]
    return plan


def sum_into_owners(grad: Tensor, owner: Tensor) -> Tensor:
    """Gradient hook: each row's slot gradients summed into its owner slot, others zero."""
    if grad.is_sparse:
        grad = grad.coalesce()
        rows = owner.to(grad.device)[grad.indices()[0]]
        return torch.sparse_coo_tensor(rows.unsqueeze(0), grad.values(), grad.shape,
                                       check_invariants=False).coalesce()
    return torch.zeros_like(grad).index_add_(0, owner.to(grad.device), grad)


def hybrid(table: Tensor, device: torch.device) -> bool:
    """A host table a kernel cannot address (pageable, e.g. memory-mapped) with rows on a GPU:
    the ops take the ids on the CPU and move the rows through CPU threads and DMA.

    Pinned stores take a CUDA index instead (the zero-copy kernels), although the hybrid path
    is faster for one large transfer from a multi-GiB table (bench/sweep.py): it waits for the
    stream at each call, and a training step's several mid-size calls lose more to those waits
    than they gain (demo on the H100, 4 M x 128 tables: 80 steps/s hybrid vs 105 zero-copy)."""
    return not is_zero_copy_usable(table) and device.type == "cuda"


def index_for(table: Tensor, plan: Plan, device: torch.device) -> Tensor:
    """The index to pass with rows on `device`: on the table's GPU for a CUDA table, on the rows'
    GPU for a pinned table (zero-copy), else on the CPU (CPU op, or the hybrid path)."""
    if table.is_cuda:
        return plan.on(table.device)
    if device.type == "cuda" and is_zero_copy_usable(table):
        return plan.on(device)
    return plan.cpu


def gather(table: Tensor, plan: Plan, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Rows plan.index of `table` as a new tensor on `device`, in `dtype`."""
    plan.check(table.shape[0])
    if hybrid(table, device):
        rows = torch.empty((plan.cpu.numel(), *table.shape[1:]), dtype=table.dtype, device=device)
        ops.pinned_gather_into(table, plan.cpu, rows)
        return rows.to(dtype)
    with ops.host_validated():
        rows = ops.pinned_gather(table, index_for(table, plan, device))
    return rows.to(device=device, dtype=dtype, non_blocking=True)


def scatter(table: Tensor, plan: Plan, rows: Tensor, owners: bool = True) -> None:
    """table[plan.index] = rows. With `owners`, every slot of a row writes its owner's values
    (the factories' duplicate rule); without, the last duplicate wins."""
    plan.check(table.shape[0])
    rows = rows.detach()
    if owners:
        rows = rows[plan.owner.to(rows.device)]
    index = index_for(table, plan, rows.device)
    where = rows.device if hybrid(table, rows.device) else index.device
    with ops.host_validated():
        ops.pinned_scatter(table, index, rows.to(where, table.dtype))


def swappable(store: Tensor, device: torch.device) -> bool:
    """Whether optimizer_state_swap moves rows between `store` and batch tensors on `device`."""
    return store.device == device if store.is_cuda else True


def swap(stores: list, batch: list, plan: Plan, device: torch.device, load: bool) -> None:
    """One optimizer_state_swap for every state tensor: load rows plan.index into `batch`, or
    write `batch` back to them."""
    plan.check(stores[0].shape[0])
    index = index_for(stores[0], plan, device)
    with ops.host_validated():
        ops.optimizer_state_swap(stores, batch, None if load else index, index if load else None)


def check_loaded(name: str, loaded: Tensor, shape, dtype: torch.dtype) -> None:
    if tuple(loaded.shape) != tuple(shape) or loaded.dtype != dtype:
        raise ValueError(f"{name}: the file holds {tuple(loaded.shape)} {loaded.dtype}, but this "
                         f"store is {tuple(shape)} {dtype}")


# ---- optimizer state -----------------------------------------------------------------------

def _scalar(value: float, p: Tensor, on_device: bool) -> Tensor:
    """A step-like scalar as torch's optimizers create it."""
    dtype = _get_scalar_dtype()
    return torch.tensor(value, dtype=dtype, device=p.device if on_device else None)


def state_layout(optimizer: torch.optim.Optimizer, group: dict):
    """(per-element state keys with their initial fill, scalar state) of `optimizer` for a
    parameter of `group`: what torch creates at the first step(), created ahead so the batch
    rows can be swapped in before it."""
    name = type(optimizer).__name__
    lr = group.get("lr", 0.0)
    lr = float(lr) if not isinstance(lr, Tensor) else float(lr.item())
    if name in ("Adam", "AdamW"):
        keys = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
        if group.get("amsgrad"):
            keys["max_exp_avg_sq"] = 0.0
        return keys, {"step": 0.0}
    if name == "Adamax":
        return {"exp_avg": 0.0, "exp_inf": 0.0}, {"step": 0.0}
    if name == "Adadelta":
        return {"square_avg": 0.0, "acc_delta": 0.0}, {"step": 0.0}
    if name == "RMSprop":
        keys = {"square_avg": 0.0}
        if group.get("momentum", 0) > 0:
            keys["momentum_buffer"] = 0.0
        if group.get("centered"):
            keys["grad_avg"] = 0.0
        return keys, {"step": 0.0}
    if name == "Adagrad":
        return {"sum": float(group.get("initial_accumulator_value", 0.0))}, {"step": 0.0}
    if name == "SparseAdam":
        return {"exp_avg": 0.0, "exp_avg_sq": 0.0}, {"step": 0}
    if name == "ASGD":
        return {"ax": 0.0}, {"step": 0.0, "eta": lr, "mu": 1.0}
    if name == "Rprop":
        return {"prev": 0.0, "step_size": lr}, {"step": 0.0}
    if name == "SGD":
        if group.get("momentum", 0) == 0:
            return {}, {}
        return {"momentum_buffer": 0.0}, {}
    raise ValueError(f"optimizer {name} is not supported; supported: Adam, AdamW, Adamax, "
                     "Adadelta, RMSprop, Adagrad, SparseAdam, ASGD, Rprop, SGD")


def find_group(optimizer: torch.optim.Optimizer, param: Tensor):
    """The param group holding `param` (by identity) and the param's position in the
    optimizer's state_dict numbering."""
    position = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p is param:
                return group, position
            position += 1
    raise ValueError("the optimizer does not hold this model variable's weight; build it from "
                     "model.parameters()")


def init_state(optimizer: torch.optim.Optimizer, param: Tensor, group: dict, fills: dict,
               scalars: dict) -> None:
    """Create the state torch's step() expects, unless it exists (a step already ran)."""
    state = optimizer.state[param]
    # ASGD keeps its scalars on the parameter's device; the others only when capturable/fused.
    on_device = (type(optimizer).__name__ == "ASGD" or bool(group.get("capturable"))
                 or bool(group.get("fused")))
    for key, value in scalars.items():
        if key not in state:
            state[key] = value if isinstance(value, int) else _scalar(value, param, on_device)
    for key, fill in fills.items():
        if key not in state:
            state[key] = torch.full_like(param, fill, memory_format=torch.preserve_format)
