"""The update of a step's staged rows: the optimizer whose one parameter is the staged rows'
weight (``RowUpdate.param``), its per-row state as views of the same staged records, and the
step: one fused kernel for the optimizers that have a rule (``training/fused.py``), else torch's
own optimizer step (on float32 copies for 16-bit or mixed records, stored back rounded)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from .. import ops
from . import optim_state
from .fused import FusedUpdate
from .optim_state import RowLayout

# Optimizer state that holds squared gradients (or their sums): float16 cannot keep it.
SQUARED_STATE = ("exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "acc_delta")
STARTED = "momentum_started"  # the update's own optimizer state: SGD's first step has run
# The update's own optimizer state of a 16-bit table's stochastic rounding: 0-dim views of its
# (seed, counter), so checkpoints carry them and a resumed run draws as the unbroken one would.
ROUNDING_STATE = ("rounding_seed", "rounding_counter")
# State a checkpoint may lack (one from before it, or from a table without stochastic
# rounding): never missing. The rounding's entries are never unexpected either (a 16-bit
# table's checkpoint loads into a float32 one).
OPTIONAL_STATE = (STARTED, *ROUNDING_STATE)


class RowUpdate:
    """The optimizer of one table's staged rows.

    Args:
        optimizer_cls, optimizer_kwargs: the torch optimizer class and its arguments.
        dim: the row width; dtype: the weights' dtype; device: where rows are staged.

    Example::

        update = RowUpdate(torch.optim.Adam, {"lr": 1e-3}, 64, torch.float32, device)
        update.point_at(layout, staged_buffer)   # param and state: views of the staged records
    """

    def __init__(self, optimizer_cls: type, optimizer_kwargs: dict, dim: int,
                 dtype: torch.dtype, device: torch.device):
        # The optimizer's one parameter: its data is the staged rows' weight part.
        self.param = torch.zeros((0, dim), dtype=dtype, device=device).requires_grad_()
        self.optimizer = optimizer_cls([self.param], **optimizer_kwargs)
        self.rule = FusedUpdate.of(self.optimizer)
        group = self.optimizer.param_groups[0]
        self.fills, scalars = optim_state.state_layout(self.optimizer, group)
        optim_state.init_state(self.optimizer, self.param, group, self.fills, scalars)
        self.state_keys = list(self.fills)
        self.row_keys = optim_state.row_state_keys(self.optimizer)
        self.rounding: Optional[Tensor] = None  # (seed, counter) with stochastic rounding
        # torch's SGD takes the first step's gradient as the momentum buffer (no dampening);
        # the buffer here exists ahead of that step, so the first step leaves it out. Whether
        # it ran is state (a 0-dim CPU tensor): checkpoints carry it, in-place loads too.
        if isinstance(self.optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
            self.state[STARTED] = torch.zeros((), dtype=torch.int64)
        # state_dict's tensors of the optimizer's Python scalars: key -> (tensor, value given)
        self._scalar_views: dict = {}
        # Set False to run torch's own optimizer step even where a fused rule exists.
        self.fused_enabled = True

    @property
    def state(self) -> dict:
        """The optimizer's state of the staged rows: per-row views and its scalars."""
        return self.optimizer.state[self.param]

    @property
    def element_keys(self) -> list:
        return [k for k in self.state_keys if k not in self.row_keys]

    @property
    def fused(self) -> bool:
        return self.fused_enabled and self.rule is not None

    def ready(self) -> bool:
        """Whether a fused step would run now (its hyper-parameters are host numbers)."""
        return self.fused and self.rule.ready(self.optimizer)

    def warn_float16_squares(self, state_dtype: torch.dtype) -> None:
        squares = [k for k in self.element_keys if k in SQUARED_STATE]
        if state_dtype == torch.float16 and squares:
            warnings.warn(f"float16 state with {type(self.optimizer).__name__}: its state "
                          f"{squares} holds squared gradients, which fall below float16's range "
                          "(about 6e-8) and then stall or blow up the update; bfloat16 keeps "
                          "float32's range (state_dtype=torch.bfloat16 or torch.float32)",
                          stacklevel=5)

    def round_stochastically(self, device: torch.device) -> None:
        """Stochastic rounding of 16-bit stores: (seed, counter) on the device, the counter
        rising every step, and both in the state (checkpoints carry them)."""
        self.rounding = torch.zeros(2, dtype=torch.int64, device=device)
        self.state.update(zip(ROUNDING_STATE, self.rounding.unbind()))

    def seed_rounding(self) -> None:
        """A new seed for the stochastic rounding from torch's generator (none without it)."""
        if self.rounding is not None:
            self.rounding[0] = int(torch.randint(0, 2**62, ()))

    def point_at(self, layout: RowLayout, buf: Tensor) -> None:
        """The parameter and its per-row state become views of `buf` (parts, n, width): a
        step's staged rows, or no rows once the step is done, so the step's buffer goes back
        to the allocator (a CUDA graph's capture cannot reuse it, and within a tight GPU
        budget it needs the room)."""
        with torch.no_grad():  # set_, not .data: autograd then sees the new shape (an empty batch)
            self.param.set_(layout.of_staged(buf, "weight"))
        self.param.grad = None
        state = self.state
        for key in self.state_keys:
            state[key] = layout.of_staged(buf, key)

    def check_capturable(self) -> None:
        """A captured step replays GPU work only: state the optimizer keeps on the CPU (a step
        count) would change at the capture and never again."""
        on_host = [k for k, v in self.state.items()
                   if isinstance(v, Tensor) and v.device.type == "cpu" and k != STARTED]
        if on_host:
            raise RuntimeError(f"optimizer: {type(self.optimizer).__name__} keeps {on_host} on "
                               "the CPU, which a CUDA graph cannot update; build it with "
                               "capturable=True (where it has it)")

    def step(self, layout: RowLayout, buf: Tensor, count: Tensor, cache: Optional[Tensor],
             at: Optional[Tensor], settle_grad) -> None:
        """The optimizer's step on the staged rows `buf` (the first `count` distinct), as
        torch's step would run it: in one fused kernel for the optimizers that have one,
        rows with a slot in `cache` (``at``) updated there; else by torch's optimizer (its
        first SGD step as torch's first step runs), after ``settle_grad()`` makes the whole
        gradient readable."""
        self.take_scalar_views()
        started = self.state.get(STARTED)
        first = started is not None and not bool(started)
        grad = self.param.grad
        if grad is not None and isinstance(self.optimizer, torch.optim.SparseAdam):
            grad = self.param.grad = grad.to_sparse(1)
        if self.fused and grad is not None and not grad.is_sparse and self.rule.step(
                self.optimizer, self.param, buf, count, layout, first_step=first, cache=cache,
                at=at, rounding=self.rounding):
            if first:
                started.fill_(1)
            return
        if cache is not None and grad is not None:  # the hits' state was left in the cache
            raise RuntimeError("step(): this forward staged its cached rows for the fused "
                               "update, which cannot run now (fused_update was turned off, or "
                               "a hyper-parameter became a tensor on a GPU, after the "
                               "forward); nothing was updated. Call discard() and run the step "
                               "again")
        settle_grad()  # torch's step reads every row of the gradient
        if ((self.rounding is not None or layout.mixed) and grad is not None
                and not grad.is_sparse):
            self._torch_step_in_float32(layout, buf, first)
        else:
            self._torch_step(first and grad is not None)
        if first and grad is not None:
            started.fill_(1)

    def _torch_step(self, first: bool, param: Optional[Tensor] = None) -> None:
        """torch's optimizer step on the staged rows (or on `param`, the optimizer's parameter
        for now); `first`: SGD's first step with momentum, which torch's step takes from the
        gradient (the optimizer sees no buffer)."""
        if not first:
            self.optimizer.step()
            return
        state = self.optimizer.state[self.param if param is None else param]
        view = state.pop("momentum_buffer")
        try:
            self.optimizer.step()
            view.copy_(state["momentum_buffer"])
        finally:
            state["momentum_buffer"] = view

    def _torch_step_in_float32(self, layout: RowLayout, buf: Tensor, first: bool) -> None:
        """torch's step for 16-bit weights or state, or fields of several dtypes (torch's
        optimizers take one): on float32 copies of the staged weight, state and gradient,
        given to the optimizer as its parameter for this step, each field stored back in its
        own dtype (``_store_rounded``)."""
        names = ["weight", *self.state_keys]
        high = {name: layout.of_staged(buf, name).float() for name in names}
        param = high["weight"].requires_grad_()
        param.grad = self.param.grad.float()
        group = self.optimizer.param_groups[0]
        own = self.optimizer.state.pop(self.param)
        state = self.optimizer.state[param]
        state.update((key, high[key] if key in self.state_keys else value)
                     for key, value in own.items())
        group["params"] = [param]
        try:
            self._torch_step(first, param)
        finally:
            group["params"] = [self.param]
            del self.optimizer.state[param]
            # The scalars torch's step changed (a tensor in place, a number replaced) go back.
            own.update((key, value) for key, value in state.items() if key not in self.state_keys)
            self.optimizer.state[self.param] = own
        self._store_rounded(layout, buf, high)

    @torch.no_grad()
    def _store_rounded(self, layout: RowLayout, buf: Tensor, high: dict) -> None:
        """Each float32 result of `high` stored in its field's dtype: rounded stochastically
        (ops._round_into) as the fused update stores its own, or to nearest without
        stochastic rounding."""
        for name, value in high.items():
            low = layout.of_staged(buf, name)
            if self.rounding is None or low.dtype not in (torch.float16, torch.bfloat16):
                low.copy_(value)
                continue
            rounded = torch.empty_like(value, dtype=low.dtype)
            ops._round_into(rounded, value, self.rounding)
            self.rounding[1:] += 1  # each field draws anew
            low.copy_(rounded)  # exact: the values are the format's own

    # ---- scalars a checkpoint carries ----------------------------------------------------

    def scalar_view(self, key: str, value) -> Tensor:
        """The tensor state_dict gives for a Python scalar of the optimizer's (SparseAdam's
        step): kept, so a checkpoint loaded into it in place (torch.distributed.checkpoint's
        load) reaches the optimizer at the next step()."""
        view, _ = self._scalar_views.get(key, (None, None))
        if view is None:
            view = torch.tensor(value)
        else:
            view.fill_(value)
        self._scalar_views[key] = (view, value)  # the tensor and the value it was given
        return view

    def forget_scalar_view(self, key: str) -> None:
        self._scalar_views.pop(key, None)

    def take_scalar_views(self) -> None:
        """A scalar written into state_dict's tensor since it was given (an in-place load)
        goes to the optimizer."""
        state = self.state
        for key, (view, given) in self._scalar_views.items():
            value = view.item()
            if value != given and key in state and not isinstance(state[key], Tensor):
                state[key] = type(state[key])(value)
                self._scalar_views[key] = (view, value)
