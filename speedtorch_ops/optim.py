"""Optimizers made for embedding tables.

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
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # checked first: a refused step changes nothing
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("RowWiseAdagrad takes dense gradients (HostEmbedding "
                                       "gives them); for nn.Embedding use sparse=False")
                if p.grad is not None and p.dim() == 0:
                    raise ValueError("RowWiseAdagrad needs parameters with rows (at least 1-D)")
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
