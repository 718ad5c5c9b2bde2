"""The fused update's float32 arithmetic against float64: a rule's weights 1 - beta1, 1 - beta2
(and SGD's 1 - dampening) are taken in double and rounded once, as torch's optimizers take them
in Python. Rounding beta2 to float32 first and subtracting there puts the second moment's
increment off by about 1.3e-5 relatively, far beyond float32's rounding of the increment.
Checked on a fresh step (zero state), where each state is the complement times the gradient
term, against that product in float64. The "cuda" cases run on the GPU machine."""

import pytest
import torch

from speedtorch_ops import ops
from speedtorch_ops.training import fused
from speedtorch_ops.training.optim_state import RowLayout
from conftest import HAS_CUDA

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# rule: (per-element states, the row value, (a, b) of hyper, flags)
RULES = {
    "adam": (fused.ADAM, ["exp_avg", "exp_avg_sq"], None, (0.9, 0.999)),
    "adamw": (fused.ADAMW, ["exp_avg", "exp_avg_sq"], None, (0.9, 0.999)),
    "partial-rowwise-adam": (fused.PARTIAL_ROWWISE_ADAM, ["exp_avg"], "exp_avg_sq",
                             (0.9, 0.999)),
    # momentum 0.9, dampening 0.999, past the first step: the buffer is (1 - dampening) g
    "sgd-dampening": (fused.SGD, ["momentum_buffer"], None, (0.9, 0.999)),
}
# float32's rounding of the few products and sums of a fresh step (the row value sums 8
# squares) stays within this; the old rounding of beta2 alone exceeds it tenfold.
RTOL = 1e-6


def _expected(name, grad, a, b) -> dict:
    """Each state after a fresh step, in float64 from the float32 gradient."""
    g = grad.double()
    if name == "sgd-dampening":
        return {"momentum_buffer": (1 - b) * g}
    expected = {"exp_avg": (1 - a) * g}
    if name == "partial-rowwise-adam":
        expected["exp_avg_sq"] = (1 - b) * g.pow(2).mean(1)
    else:
        expected["exp_avg_sq"] = (1 - b) * g.pow(2)
    return expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(RULES))
def test_float32_state_matches_float64_after_a_fresh_step(device, name, gen):
    rule, states, row, (a, b) = RULES[name]
    n, dim = 64, 8
    layout = RowLayout(dim, states, [row] if row else [], torch.float32)
    buf = torch.zeros(n, layout.width, dtype=torch.uint8)
    layout.of_record(buf, "weight").copy_(torch.randn(n, dim, generator=gen))
    grad = torch.randn(n, dim, generator=gen, dtype=torch.float32)
    fields = layout.offsets(["weight"]) + (layout.offsets([row]) if row else [-1]) + \
        layout.offsets(states)
    step = torch.tensor(1.0) if rule != fused.SGD else None
    dev = torch.device(device)
    buf = buf.to(dev)
    ops._fused_row_update(buf, grad.to(dev), torch.tensor([n], device=dev), step, rule,
                          (0.01, 0.0, a, b, 1e-8), 0, fields, torch.float32)
    got = buf.cpu()
    for key, want in _expected(name, grad, a, b).items():
        have = layout.of_record(got, key).double()
        rel = ((have - want).abs() / want.abs().clamp(min=1e-30)).max()
        assert rel <= RTOL, (name, key, float(rel))
