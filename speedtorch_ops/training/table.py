"""The host rows: a table and its optimizer state as one record a row (``RowLayout``) in host
memory (pinned where a GPU stages the rows, ordinary memory on the CPU), with a view per field."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..memory import fill_random_
from .optim_state import RowLayout
from .placement import allocate, resolve_dtype

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_state_dtype(state_dtype, dtype: torch.dtype) -> Optional[torch.dtype]:
    """`state_dtype=` checked against the weights' `dtype`: None (the weights' dtype), float32
    or bfloat16, or the weights' own; float64 tables keep float64 state. Returns the setting a
    table keeps: None where the state follows the weights' dtype (a later conversion takes it
    along)."""
    if state_dtype is None:
        return None
    try:
        state_dtype = resolve_dtype(state_dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"state_dtype: {e}") from None
    if dtype == torch.float64 and state_dtype != torch.float64:
        raise TypeError(f"state_dtype: a float64 table keeps float64 optimizer state, got "
                        f"{state_dtype}")
    if state_dtype not in (torch.float32, torch.bfloat16, dtype):
        raise TypeError(f"state_dtype must be torch.float32, torch.bfloat16, the weights' dtype "
                        f"({dtype}) or None (the weights' dtype), got {state_dtype}")
    return None if state_dtype == dtype else state_dtype


def state_dtype_for(setting: Optional[torch.dtype], dtype: torch.dtype) -> torch.dtype:
    """The state's dtype for weights of `dtype`: the setting (state_dtype=: float32 or
    bfloat16), or the weights' where there is none or they are float64 (a conversion such as
    ``.double()`` or ``.half()`` takes the state along where it followed the weights)."""
    return setting if setting is not None and dtype != torch.float64 else dtype


def normal_init(weight: Tensor) -> None:
    """nn.Embedding's initialisation, N(0, 1), drawn on all CPU threads for a host table."""
    if weight.device.type == "cpu":
        fill_random_(weight, "normal", 0.0, 1.0)
    else:
        weight.normal_()


class HostTable:
    """A table of `rows` records laid out by `layout`, in host memory.

    Args:
        rows: the table's rows.
        layout: a row and its optimizer state as one record (``RowLayout``).
        pinned: page-locked memory (a GPU stages the rows), else ordinary host memory.
        fills: each state field's initial value.

    Example::

        table = HostTable(1000, RowLayout(64, ["exp_avg", "exp_avg_sq"], [], torch.float32),
                          pinned=False, fills={"exp_avg": 0.0, "exp_avg_sq": 0.0})
        table.view("weight").normal_()      # (1000, 64), a view of the records
    """

    def __init__(self, rows: int, layout: RowLayout, pinned: bool, fills: dict):
        if layout.dtype not in FLOATING:
            raise TypeError(f"dtype: a table holds floating point rows (float16, bfloat16, "
                            f"float32, float64), got {layout.dtype}")
        self.rows, self.layout, self.fills = rows, layout, dict(fills)
        self.host = allocate((rows, 1, layout.width), torch.uint8,
                             "pinned" if pinned else "cpu")
        self.fill_state()

    @property
    def row_bytes(self) -> int:
        """Bytes a row takes with its optimizer state, in the table, each transfer and each
        cache slot."""
        return self.host[0].nbytes

    @property
    def state_keys(self) -> list:
        return list(self.fills)

    def view(self, name: str) -> Tensor:
        """"weight" (rows, dim), a state entry's (rows, dim), or (rows,) for state kept per
        row: views of the records."""
        return self.layout.of_table(self.host, name)

    def fill_state(self) -> None:
        for key, fill in self.fills.items():
            self.view(key).fill_(fill)

    @torch.no_grad()
    def reset(self, init: Optional[Callable[[Tensor], object]] = None,
              padding_idx: Optional[int] = None) -> None:
        """The weight re-initialised (``init(weight)``, default normal(0, 1) with the padding
        row zero, as nn.Embedding's) and the state at its initial values."""
        weight = self.view("weight")
        if init is not None:
            init(weight)
        else:
            normal_init(weight)
            if padding_idx is not None:
                weight[padding_idx].zero_()
        self.fill_state()

    @torch.no_grad()
    def copy_from(self, other: "HostTable") -> None:
        """Every field of `other` (the same rows and fields, any dtypes) into this table."""
        for name in ["weight", *self.state_keys]:
            self.view(name).copy_(other.view(name))
