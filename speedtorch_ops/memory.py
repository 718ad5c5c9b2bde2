"""Pinned host memory for tables: made, pinned in place, or loaded from .npy, without a second
full-size copy, and costing the table's bytes (torch's pinned allocator rounds large blocks up to
a power of two, so a 5 GiB table would hold 8 GiB)."""

from typing import Sequence, Union

import numpy as np
import torch
from torch import Tensor


def pin_(tensor: Tensor) -> Tensor:
    """Page-lock ``tensor``'s CPU storage in place (no copy) and return ``tensor``.

    The storage stays pinned until it is freed. Needs a CUDA build and a CUDA device."""
    if not tensor.is_contiguous():
        raise ValueError("pin_: tensor must be contiguous (pin the table itself, not a view)")
    torch.ops.speedtorch_ops._pin_storage_.default(tensor)
    return tensor


def empty_pinned(shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32,
                 pin: bool = True) -> Tensor:
    """An uninitialised contiguous CPU table of ``shape``; page-locked when ``pin`` (the default),
    so CUDA indices read it in place. ``pin=False`` gives ordinary memory (CPU-only machines)."""
    table = torch.empty(shape, dtype=dtype, device="cpu")
    return pin_(table) if pin else table


def load_npy(path: str, pin: bool = True, chunk_bytes: int = 256 << 20) -> Tensor:
    """Load a ``.npy`` file straight into a (pinned) table: the file is memory-mapped and copied
    in chunks, so the host never holds a second full copy."""
    # Copy-on-write mapping: writable for torch.from_numpy, and nothing is ever written to it.
    src = np.load(path, mmap_mode="c")
    if src.dtype.byteorder == ">" or not src.flags.c_contiguous:
        raise ValueError(f"load_npy: {path} must hold a little-endian, C-ordered array; re-save it "
                         "with np.save(path, np.ascontiguousarray(a, dtype=a.dtype.newbyteorder('<')))")
    dtype = torch.from_numpy(np.empty(0, dtype=src.dtype)).dtype
    table = empty_pinned(src.shape, dtype, pin=pin)
    flat_src, flat_dst = src.reshape(-1), table.view(-1)
    step = max(1, chunk_bytes // src.itemsize)
    for start in range(0, flat_src.size, step):
        flat_dst[start:start + step].copy_(torch.from_numpy(flat_src[start:start + step]))
    return table


def is_zero_copy_usable(table: Tensor) -> bool:
    """True when a CUDA index can read ``table`` in place: a CUDA tensor, or a contiguous CPU
    tensor in pinned (page-locked, mapped) memory."""
    if table.is_cuda:
        return True
    return (table.device.type == "cpu" and table.is_contiguous() and torch.cuda.is_available()
            and table.is_pinned())
