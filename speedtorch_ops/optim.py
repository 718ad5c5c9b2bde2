"""Optimizers made for embedding tables: ``RowWiseAdagrad`` and ``PartialRowWiseAdam``.

``RowWiseAdagrad``: Adagrad with one accumulator per row instead of one per element (the rule of
FBGEMM's ``EXACT_ROWWISE_ADAGRAD``). A row of dim 128 in fp32 then carries 4 bytes of optimizer
state instead of 512 (Adam: 1024), so a host table holds it in about a third of Adam's bytes per
row and every transfer and cache slot shrinks alike. Per row r with gradient g_r (its elements
g_rj, D of them):

    sum_r += mean_j(g_rj^2)
    w_r   -= lr * g_r / (sqrt(sum_r) + eps)

With ``weight_decay`` the gradient is first g_r + weight_decay * w_r (L2, as torch's Adagrad).
Rows whose gradient is zero do not change (without weight decay), so on a full table it equals
the lazy rule of ``HostEmbedding``. Any tensor works: its first dimension is the row.

The accumulator has the parameter's dtype (in HostEmbedding it sits in the row): with fp16 or
bf16 tables it stops growing once its increments round away (FBGEMM keeps it in fp32), so
prefer fp32 tables with this optimizer.
"""

from __future__ import annotations

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row (see the module docstring).

    Args:
        params: tensors with rows (at least 1-D; the first dimension is the row), dense
            gradients.
        lr, eps, weight_decay, initial_accumulator_value: as torch.optim.Adagrad's (all >= 0).

    Example::

        emb = speedtorch_ops.HostEmbedding(4_000_000, 128, optimizer=RowWiseAdagrad,
                                           optimizer_kwargs={"lr": 0.1})
    """

    # For HostEmbedding: these state entries hold one value per row (the module packs them
    # beside the row's weight instead of giving them a row of their own).
    per_row_state = ("sum",)

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-10, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0):
        _check_nonnegative(lr=lr, eps=eps, weight_decay=weight_decay,
                           initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _begin_step(self, closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.full((p.shape[0],), group["initial_accumulator_value"],
                                              dtype=p.dtype, device=p.device)
                grad = p.grad
                if group["weight_decay"]:
                    grad = grad.add(p, alpha=group["weight_decay"])
                acc = state["sum"]
                acc.add_(grad.reshape(p.shape[0], -1).square().mean(1))
                std = acc.sqrt().add_(group["eps"])
                p.addcdiv_(grad, std.view((-1,) + (1,) * (p.dim() - 1)), value=-group["lr"])
        return loss


class PartialRowWiseAdam(torch.optim.Optimizer):
    """Adam with a per-element first moment and one second moment per row: the mean over the
    row of its squared gradient (the rule of FBGEMM's ``PARTIAL_ROWWISE_ADAM``). A row of dim
    128 then carries dim + 1 values of state instead of Adam's 2 x dim. Per row r at step t
    with gradient g_r:

        m_r  = beta1 * m_r + (1 - beta1) * g_r                  (per element, torch's lerp)
        v_r  = beta2 * v_r + (1 - beta2) * mean_j(g_rj^2)       (one value)
        w_r -= lr * (m_r / (1 - beta1^t) / (sqrt(v_r / (1 - beta2^t)) + eps) + weight_decay * w_r)

    The weight decay is decoupled (as AdamW's, and FBGEMM's rule), the weight before the step
    multiplying it. State: ``step`` (a scalar tensor, on the parameter's device with
    ``capturable=True``), ``exp_avg`` (the parameter's shape), ``exp_avg_sq`` (one value per
    row). Rows whose gradient is zero still move (as Adam's do); ``HostEmbedding`` updates the
    touched rows only (the lazy rule).

    Args:
        params: tensors with rows (at least 1-D; the first dimension is the row), dense
            gradients.
        lr, betas, eps, weight_decay: as torch.optim.AdamW's (lr, eps, weight_decay >= 0,
            betas in [0, 1)).
        capturable: keep the step count on the parameter's device (a CUDA graph can then
            replay the step).

    Example::

        emb = HostEmbedding(1_000_000, 128, optimizer=PartialRowWiseAdam,
                            optimizer_kwargs={"lr": 1e-3}, dtype=torch.bfloat16)
    """

    per_row_state = ("exp_avg_sq",)

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, capturable: bool = False):
        _check_nonnegative(lr=lr, eps=eps, weight_decay=weight_decay)
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1
                       for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be a bool, got {capturable!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, capturable=capturable))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _begin_step(self, closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32,
                                                device=p.device if group["capturable"] else None)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros(p.shape[0], dtype=p.dtype,
                                                      device=p.device)
                step = state["step"]
                step += 1
                grad = p.grad
                rows = (-1,) + (1,) * (p.dim() - 1)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                v = state["exp_avg_sq"]
                v.mul_(beta2).add_(grad.flatten(1).square().mean(1) if p.dim() > 1
                                   else grad.square(), alpha=1 - beta2)
                t = step.to(device=p.device, dtype=torch.float64)
                bias1 = 1 - torch.pow(beta1, t)
                bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, t))
                denom = (v.sqrt() / bias2_sqrt.to(p.dtype)).add_(group["eps"]).view(rows)
                update = state["exp_avg"] / denom / bias1.to(p.dtype)
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                p.sub_(update * group["lr"])
        return loss


def _check_nonnegative(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def _begin_step(optimizer: torch.optim.Optimizer, closure):
    """What a row-wise optimizer's step does first: the closure's loss, then the checks
    (dense gradients, parameters with rows) before anything changes."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(f"{name} takes dense gradients (HostEmbedding gives them); "
                                   "for nn.Embedding use sparse=False")
            if p.grad is not None and p.dim() == 0:
                raise ValueError(f"{name} needs parameters with rows (at least 1-D)")
    return loss
