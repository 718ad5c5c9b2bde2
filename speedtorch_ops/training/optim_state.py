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
