"""nn.EmbeddingBag's arguments, checked as nn checks them before any id moves, and its pooling
(torch's own ``embedding_bag``) over a step's staged rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .training.placement import upload
from .training.plan import _INTEGER


@dataclass
class BagInput:
    """A bag forward's checked arguments on the module's device: ``offsets`` (int64; None for a
    2-D input) and ``weights`` (per-sample weights in the table's dtype, or None)."""
    offsets: Optional[Tensor]
    weights: Optional[Tensor]


def bag_input(input: Tensor, offsets, per_sample_weights, mode: str, include_last_offset: bool,
               device: torch.device, dtype: torch.dtype, check_values: bool) -> BagInput:
    """nn.EmbeddingBag's checks of a forward's arguments, made before any id moves. Offsets on
    the host are checked there; offsets on a GPU with one wait for it when `check_values`."""
    if input.dtype not in _INTEGER:
        raise TypeError(f"input must hold integer ids, got {input.dtype}")
    if per_sample_weights is not None and mode != "sum":
        raise NotImplementedError(
            f"per_sample_weights is only supported for mode='sum' (got mode={mode!r}), as in "
            "nn.EmbeddingBag")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None for a 2-D input (each row is a bag of fixed "
                             "length)")
    elif input.dim() == 1:
        offsets = bag_offsets(offsets, input.numel(), include_last_offset, check_values)
        offsets = (upload(offsets, device) if offsets.device.type == "cpu"
                   else offsets.to(device)).to(torch.int64)
    else:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
    if per_sample_weights is not None:
        per_sample_weights = torch.as_tensor(per_sample_weights)
        if per_sample_weights.shape != input.shape:
            raise ValueError(f"per_sample_weights must have input's shape {tuple(input.shape)}, "
                             f"got {tuple(per_sample_weights.shape)}")
        if not per_sample_weights.is_floating_point():
            raise TypeError(f"per_sample_weights must be floating point, got "
                            f"{per_sample_weights.dtype}")
        per_sample_weights = per_sample_weights.to(device, dtype)
    return BagInput(offsets, per_sample_weights)


def bag_offsets(offsets, n: int, include_last_offset: bool, check_values: bool) -> Tensor:
    """`offsets` checked as nn.EmbeddingBag checks them for a 1-D input of `n` ids."""
    if offsets is None:
        raise ValueError("offsets is required for a 1-D input (bag b is "
                         "input[offsets[b]:offsets[b + 1]])")
    offsets = torch.as_tensor(offsets)
    if offsets.dim() != 1:
        raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in _INTEGER:
        raise TypeError(f"offsets must be integers, got {offsets.dtype}")
    if include_last_offset and offsets.numel() == 0:
        raise ValueError("offsets must hold at least one entry with include_last_offset=True "
                         "(the end of the last bag)")
    if not check_values or offsets.numel() == 0:
        return offsets
    values = offsets.cpu().numpy().astype(np.int64, copy=False)  # a GPU's offsets: one wait
    if values[0] != 0:
        raise ValueError(f"offsets[0] must be 0 (the first bag starts at the first id), got "
                         f"{int(values[0])}")
    down = np.flatnonzero(np.diff(values) < 0)
    if down.size:
        i = int(down[0]) + 1
        raise ValueError(f"offsets must not decrease: offsets[{i}] = {int(values[i])} follows "
                         f"offsets[{i - 1}] = {int(values[i - 1])}")
    if values[-1] > n:
        raise ValueError(f"offsets[-1] = {int(values[-1])} is past the end of input ({n} ids)")
    return offsets


def pool(weight: Tensor, index: Tensor, bag: BagInput, mode: str,
          include_last_offset: bool = False, padding_idx: Optional[int] = None) -> Tensor:
    """The bags of `index` (the input's shape; positions in `weight`) pooled by torch's own
    embedding_bag: nn's sums, means and maxima, and their gradients."""
    return F.embedding_bag(index, weight, bag.offsets, mode=mode,
                           per_sample_weights=bag.weights,
                           include_last_offset=include_last_offset, padding_idx=padding_idx)
