"""Fused optimizer updates of a step's staged rows: one kernel (``ops._fused_row_update``)
applies torch's formula of SGD, Adagrad, Adam, AdamW, ``RowWiseAdagrad`` or ``PartialRowWiseAdam``
to every staged row's
weight and state in place, where torch's optimizer runs a dozen element-wise kernels over the
whole staged buffer (and, on a GPU, over its positions past the distinct rows too).

``FusedUpdate.of(optimizer)`` says whether an optimizer has a fused rule: exactly one of those
classes (a subclass may change ``step``), one parameter group, and hyper-parameters that are
numbers on the host (a tensor ``lr`` on a GPU would be read back every step; ``differentiable``
needs autograd through the step). Every other optimizer keeps torch's own step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import ops
from ..optim import PartialRowWiseAdam, RowWiseAdagrad
from .optim_state import RowLayout

# The op's rule numbers and flag bits (csrc/optim/rules.h).
SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM, ADAMW, PARTIAL_ROWWISE_ADAM = range(6)
MAXIMIZE, NESTEROV, AMSGRAD, FIRST_STEP = 1, 2, 4, 8


def _number(value) -> Optional[float]:
    """A hyper-parameter as a float, or None when it lives on a device (left to torch)."""
    if isinstance(value, Tensor):
        return float(value) if value.device.type == "cpu" and value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class FusedUpdate(NamedTuple):
    """An optimizer's fused rule: the op's rule number and the state keys of its per-element
    parts, in the rule's order."""
    rule: int
    state_keys: tuple

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> Optional["FusedUpdate"]:
        cls = type(optimizer)
        if len(optimizer.param_groups) != 1:
            return None
        group = optimizer.param_groups[0]
        if group.get("differentiable"):
            return None
        if cls is torch.optim.SGD:
            keys = ("momentum_buffer",) if group.get("momentum", 0) else ()
            return FusedUpdate(SGD, keys)
        if cls is torch.optim.Adagrad:
            return FusedUpdate(ADAGRAD, ("sum",))
        if cls is RowWiseAdagrad:
            return FusedUpdate(ROWWISE_ADAGRAD, ())
        if cls is PartialRowWiseAdam:
            return FusedUpdate(PARTIAL_ROWWISE_ADAM, ("exp_avg",))
        if cls in (torch.optim.Adam, torch.optim.AdamW):
            betas = group.get("betas", (0.9, 0.999))
            if _number(betas[0]) is None or _number(betas[1]) is None:
                return None
            decoupled = cls is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
            keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad")
                                                 else ())
            return FusedUpdate(ADAMW if decoupled else ADAM, keys)
        return None

    def hyper(self, group: dict) -> Optional[tuple]:
        """(lr, weight_decay, a, b, eps) of `group` for this rule, or None when one of them is
        not a number on the host (torch's step takes it)."""
        lr, wd, eps = (_number(group.get(k, 0.0)) for k in ("lr", "weight_decay", "eps"))
        if self.rule == SGD:
            a, b = _number(group.get("momentum", 0.0)), _number(group.get("dampening", 0.0))
        elif self.rule == ADAGRAD:
            a, b = _number(group.get("lr_decay", 0.0)), 0.0
        elif self.rule == ROWWISE_ADAGRAD:
            a, b = 0.0, 0.0
        else:
            a, b = (_number(v) for v in group["betas"])
        values = (lr, wd, a, b, eps)
        return None if any(v is None for v in values) else values

    def ready(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``step`` would run now (its hyper-parameters are host numbers)."""
        return self.hyper(optimizer.param_groups[0]) is not None

    def step(self, optimizer: torch.optim.Optimizer, param: Tensor, buf: Tensor, count: Tensor,
             layout: RowLayout, first_step: bool = False, cache: Optional[Tensor] = None,
             at: Optional[Tensor] = None, rounding: Optional[Tensor] = None) -> bool:
        """One fused step of `optimizer` on the staged rows `buf` (1, n, record) whose
        weight `param` is (its parameter, gradient set), the first `count` rows (one int64 on
        buf's device) only; the step count (Adam, Adagrad) rises by one as torch's would.
        `first_step`: SGD's momentum buffer takes the gradient (torch's first step). With a row
        `cache` (1, slots, record) and `at` (a slot per staged row), the rows cached there are
        updated there.
        `rounding` (seed, counter on buf's device): 16-bit values are stored rounded
        stochastically, and the counter rises by one. Returns False, changing nothing, when
        the group's hyper-parameters are not all host numbers."""
        group = optimizer.param_groups[0]
        hyper = self.hyper(group)
        if hyper is None:
            return False
        flags = MAXIMIZE if group.get("maximize") else 0
        if self.rule == SGD:
            flags |= NESTEROV if group.get("nesterov") else 0
            flags |= FIRST_STEP if first_step else 0
        if self.rule in (ADAM, ADAMW) and group.get("amsgrad"):
            flags |= AMSGRAD
        fields = layout.update_fields(self.state_keys)
        state = optimizer.state[param]
        step = None
        if self.rule in (ADAGRAD, ADAM, ADAMW, PARTIAL_ROWWISE_ADAM):
            step = state["step"]
            step += 1  # in place: a kept tensor (a captured step's replays count on)
        grad = param.grad
        try:
            ops._fused_row_update(buf[0], grad if grad.is_contiguous() else grad.contiguous(),
                                  count, step, self.rule, hyper, flags, fields,
                                  layout.state_dtype, None if cache is None else cache[0], at,
                                  rounding)
        except BaseException:
            if step is not None:
                step -= 1  # refused before anything moved: the count stays as it was
            raise
        if rounding is not None:
            rounding[1:] += 1  # the next step draws anew (in place: a captured step's replays)
        return True
