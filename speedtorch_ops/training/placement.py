"""Where a table's memory comes from: pinned host, ordinary host, GPU or a memory-mapped file;
dtype names as SpeedTorch accepted them; uploads of ids that do not wait for the GPU."""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from ..memory import empty_pinned

DTypeLike = Union[str, torch.dtype, np.dtype, type]
PLACEMENTS = ("pinned", "cpu", "cuda", "mmap")


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
        raise RuntimeError(f"{what} keeps its table in GPU memory, but no CUDA device is "
                           "available; use a pinned/CPU store instead (e.g. CPUPinn=True)")
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
    raise ValueError(f"unknown placement {placement!r}; one of {PLACEMENTS[:3]}")


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


class Uploaded(NamedTuple):
    """Tensors uploaded in one copy: the flat buffer, and a view of it per tensor."""
    flat: Tensor
    views: list


def upload(values: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor on `device`, queued on the current stream. Through pinned memory: a copy
    from pageable memory would wait for the whole stream."""
    if device.type == "cpu":
        return values
    (view,) = upload_all([values], device).views
    return view


def upload_all(values: Sequence[Tensor], device: torch.device,
               out: Optional[Tensor] = None) -> Uploaded:
    """CPU tensors of one dtype on the GPU `device` in one copy, queued on the current stream:
    one flat buffer and views of it in their shapes. `out`: the flat buffer of an earlier call
    with the same shapes, refilled. Several small uploads each cost the host a pinned
    allocation and a launch, and the GPU a copy."""
    if not values:
        return Uploaded(torch.empty(0, device=device), [])
    dtype = values[0].dtype
    if any(v.dtype != dtype for v in values):
        raise TypeError(f"upload_all: values must share one dtype, got "
                        f"{sorted({str(v.dtype) for v in values})}")
    sizes = [v.numel() for v in values]
    if out is not None and (out.dim() != 1 or out.numel() != sum(sizes) or out.dtype != dtype):
        raise ValueError(f"upload_all: out must be the 1-D {dtype} buffer of {sum(sizes)} "
                         f"elements an earlier call returned, got {tuple(out.shape)} {out.dtype}")
    staging = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
    # NumPy copies on this thread: torch's CPU copy wakes its thread pool, which cost about a
    # millisecond per upload while the GPU streams were busy.
    flat, at = staging.numpy(), 0
    for v, n in zip(values, sizes):
        np.copyto(flat[at:at + n], v.reshape(-1).numpy())
        at += n
    if out is None:
        out = staging.to(device, non_blocking=True)
    else:
        # The staging buffer is not reused before the copy ran (torch's pinned allocator
        # records the copy's stream).
        out.copy_(staging, non_blocking=True)
    return Uploaded(out, [part.view(v.shape) for part, v in zip(out.split(sizes), values)])


def check_loaded(name: str, loaded_shape, loaded_dtype, shape, dtype: torch.dtype) -> None:
    """Raise unless what was read (its shape and dtype) fits a store of `shape` and `dtype`."""
    if tuple(loaded_shape) != tuple(shape) or loaded_dtype != dtype:
        raise ValueError(f"{name}: the file holds {tuple(loaded_shape)} {loaded_dtype}, but this "
                         f"store is {tuple(shape)} {dtype}")
