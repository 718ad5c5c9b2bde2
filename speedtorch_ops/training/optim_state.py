"""The optimizer state of an embedding's rows: which per-row tensors (and scalars) each torch
optimizer keeps, created ahead of its first step so a batch's rows can be swapped in before it."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype


def _scalar(value: float, p: Tensor, on_device: bool) -> Tensor:
    """A step-like scalar as torch's optimizers create it."""
    dtype = _get_scalar_dtype()
    return torch.tensor(value, dtype=dtype, device=p.device if on_device else None)


def row_state_keys(optimizer) -> tuple:
    """The state entries of `optimizer` (an instance or a class) that hold one value per row (not one per element), as
    the optimizer declares them (``per_row_state``, e.g. speedtorch_ops.optim.RowWiseAdagrad)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return tuple(getattr(cls, "per_row_state", ()))


# A row record's length is a multiple of this many bytes: every field of every row in a table
# or a staged buffer then starts aligned for its element type, and the kernels that move or
# update rows use words of 8 bytes or more (16 where the record allows).
RECORD_ALIGN = 8


class Field(NamedTuple):
    """A field of a row's record: its byte offset, its dtype, and its values (the row's width,
    or None for one value a row)."""
    offset: int
    dtype: torch.dtype
    count: Optional[int]


class RowLayout:
    """A row and its optimizer state as one record of bytes: a table is (rows, 1, record)
    uint8, a staged buffer or a cache (1, n, record). The fields, in this order, each at an
    offset aligned to its element size: the weight (`dtype`, dim values), each per-element
    state (`state_dtype`, dim values), each per-row state (one value: float32, float64 for
    float64 state; a 16-bit state's row-wise accumulator would stop moving long before the
    row does); the record is padded to a multiple of RECORD_ALIGN bytes. Views in each
    field's dtype: of_table, of_staged."""

    def __init__(self, dim: int, element_keys, row_keys, dtype: torch.dtype,
                 state_dtype: Optional[torch.dtype] = None):
        self.dim = dim
        self.dtype = dtype
        self.state_dtype = dtype if state_dtype is None else state_dtype
        self.row_keys = tuple(row_keys)
        row_dtype = torch.float64 if self.state_dtype == torch.float64 else torch.float32
        # name -> its Field
        self.fields: dict = {}
        end = 0
        for name, dt, count in ([("weight", dtype, dim)]
                                + [(k, self.state_dtype, dim) for k in element_keys]
                                + [(k, row_dtype, None) for k in self.row_keys]):
            size = dt.itemsize
            end = -(-end // size) * size
            self.fields[name] = Field(end, dt, count)
            end += size * (1 if count is None else count)
        self.parts = 1
        self.width = -(-end // RECORD_ALIGN) * RECORD_ALIGN  # the record's bytes
        # Whether some field's dtype is not the weight's (torch's optimizers then step on
        # float32 copies: they take one dtype).
        self.mixed = any(dt != dtype for _, dt, _ in self.fields.values())

    def of_record(self, rows: Tensor, name: str) -> Tensor:
        """`name`'s view of records (n, record) uint8: (n, dim), or (n,) per row."""
        offset, dt, count = self.fields[name]
        view = rows[:, offset:offset + dt.itemsize * (1 if count is None else count)].view(dt)
        return view[:, 0] if count is None else view

    def of_table(self, table: Tensor, name: str) -> Tensor:
        """`name`'s view of a table (rows, 1, record): (rows, dim), or (rows,) per row."""
        return self.of_record(table[:, 0], name)

    def of_staged(self, buf: Tensor, name: str) -> Tensor:
        """`name`'s view of a staged buffer (1, n, record)."""
        return self.of_record(buf[0], name)

    def weight_rows(self, table: Tensor) -> Optional[tuple]:
        """(`table` (rows, 1, record) as rows of weights, k: row r's weight is row k * r) where
        each record is k whole weight rows with the weight first, so torch's ``embedding_bag``
        reads the table in place (a strided view it would copy whole); else None."""
        weight = self.fields["weight"]
        row = weight.dtype.itemsize * self.dim
        if weight.offset or self.width % row or not table.is_contiguous():
            return None
        k = self.width // row
        return table.view(-1).view(weight.dtype).view(table.shape[0] * k, self.dim), k

    def offsets(self, keys) -> list:
        """The byte offsets of `keys`' fields in a record."""
        return [self.fields[key].offset for key in keys]

    def update_fields(self, state_keys) -> list:
        """The fused update's `fields`: the weight's offset, the per-row value's (-1: none),
        then `state_keys`' (the rule's per-element states, in its order)."""
        return (self.offsets(["weight"]) + (self.offsets(self.row_keys[:1]) or [-1])
                + self.offsets(state_keys))

    def places(self) -> list:
        """Where each field sits, for a checkpoint: [name, offset, values (None: one), dtype]."""
        return [[name, offset, count, str(dt).removeprefix("torch.")]
                for name, (offset, dt, count) in self.fields.items()]


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
    if name == "PartialRowWiseAdam":
        return {"exp_avg": 0.0, "exp_avg_sq": 0.0}, {"step": 0.0}
    if name == "RowWiseAdagrad":
        return {"sum": float(group.get("initial_accumulator_value", 0.0))}, {}
    if name == "SGD":
        if group.get("momentum", 0) == 0:
            return {}, {}
        return {"momentum_buffer": 0.0}, {}
    raise ValueError(f"optimizer {name} is not supported; supported: Adam, AdamW, Adamax, "
                     "Adadelta, RMSprop, Adagrad, SparseAdam, ASGD, Rprop, SGD (and, in the "
                     "modules, speedtorch_ops.RowWiseAdagrad and PartialRowWiseAdam)")


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
    per_row = row_state_keys(optimizer)
    for key, fill in fills.items():
        if key not in state:
            state[key] = (torch.full(param.shape[:1], fill, dtype=param.dtype, device=param.device)
                          if key in per_row else
                          torch.full_like(param, fill, memory_format=torch.preserve_format))
