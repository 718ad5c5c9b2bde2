"""The optimizer state of an embedding's rows: which per-row tensors (and scalars) each torch
optimizer keeps, created ahead of its first step so a batch's rows can be swapped in before it."""

from __future__ import annotations

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


class RowLayout:
    """Where a row's weight and its optimizer state sit in a table of shape (rows, parts,
    width): the weight in part 0, columns [0, dim); each per-element state in a part of its
    own, columns [0, dim); each per-row state (one value) packed in part 0 after the weight, at
    column dim + k, the width then padded to a multiple of 16 bytes (the transfer kernels move
    aligned rows). A staged buffer is (parts, n, width)."""

    def __init__(self, dim: int, element_keys, row_keys, dtype: torch.dtype):
        self.dim = dim
        self.parts = 1 + len(element_keys)
        width = dim + len(row_keys)
        if row_keys:
            per = max(1, 16 // torch.empty((), dtype=dtype).element_size())
            width = -(-width // per) * per
        self.width = width
        self.at = {"weight": (0, slice(0, dim))}
        self.at.update({key: (1 + k, slice(0, dim)) for k, key in enumerate(element_keys)})
        self.at.update({key: (0, dim + k) for k, key in enumerate(row_keys)})

    def of_table(self, table: Tensor, name: str) -> Tensor:
        """`name`'s view of a table (rows, parts, width): (rows, dim), or (rows,) per row."""
        part, cols = self.at[name]
        return table[:, part, cols]

    def of_staged(self, buf: Tensor, name: str) -> Tensor:
        """`name`'s view of a staged buffer (parts, n, width)."""
        part, cols = self.at[name]
        return buf[part][:, cols]


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
