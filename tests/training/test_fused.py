"""The fused optimizer update (ops._fused_row_update, through the modules' step()): against
torch's own optimizer step on the same staged rows (an independent reference: torch's
implementation), in float64 tightly and in the 16/32-bit dtypes within their rounding; rows past
the count untouched; bad arguments raise naming the argument and change nothing. The "cuda"
cases run on the GPU machine."""

import pytest
import torch

import speedtorch_ops as so
from speedtorch_ops import ops
from speedtorch_ops.training import fused
from conftest import HAS_CUDA

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
CASES = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                       "maximize": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1,
                                      "initial_accumulator_value": 0.2}),
    "rowwise": (so.RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.05}),
    "adam": (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}),
    "adamw-amsgrad": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True,
                                          "maximize": True}),
    "partial-rowwise-adam": (so.PartialRowWiseAdam, {"lr": 0.05, "betas": (0.8, 0.99),
                                                     "weight_decay": 0.1}),
}


def run(cls, kwargs, device, dtype, fused_update, gen, steps=4, rows=50, dim=7,
        init_dtype=None):
    """A HostEmbedding trained a few steps; `init_dtype`: its start rounded through it."""
    init = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    if init_dtype is not None:
        init = init.to(init_dtype).double()
    batches = [torch.randint(0, rows // 2, (6, 5), generator=gen) for _ in range(steps)]
    targets = [torch.randn(6, 5, dim, generator=gen, dtype=torch.float64) for _ in batches]
    emb = so.HostEmbedding.from_pretrained(init.to(dtype), freeze=False, optimizer=cls,
                                           optimizer_kwargs=kwargs, device=device, dtype=dtype)
    emb.fused_update = fused_update
    for ids, target in zip(batches, targets):
        out = emb(ids.to(device))
        ((out.double() * target.to(device)).sum(-1) - 1).pow(2).sum().backward()
        emb.step()
    return emb


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dim", [7, 16])  # on a GPU: one element a lane, then 16 bytes
def test_fused_step_equals_torchs_step(device, name, dim, gen):
    cls, kwargs = CASES[name]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    results = {}
    for flag in (True, False):
        g = torch.Generator().manual_seed(seed)
        emb = run(cls, kwargs, device, torch.float64, flag, g, dim=dim)
        assert emb.fused is flag
        results[flag] = emb.state_dict()
    for key, value in results[False].items():
        if torch.is_tensor(value) and value.is_floating_point():
            assert torch.allclose(results[True][key].cpu(), value.cpu(), rtol=1e-12,
                                  atol=1e-13), (name, key, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["adam", "rowwise", "sgd-momentum", "partial-rowwise-adam"])
@pytest.mark.parametrize("dim", [7, 16])
@pytest.mark.parametrize("fused_update", [True, False])
def test_fused_step_in_low_precision(device, dtype, name, dim, fused_update, gen):
    """Math in float32 inside the kernel (or, for torch's own step, on a float32 copy of the
    16-bit rows), values stored in `dtype` (rounded stochastically: the modules' default):
    after a few steps within a few roundings of `dtype` of torch's step in float64 from the
    same (rounded) start. torch's step in 16 bits would be no reference: it computes in 16 bits
    (Adam's second moment underflows)."""
    cls, kwargs = CASES[name]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ours = run(cls, kwargs, device, dtype, fused_update, torch.Generator().manual_seed(seed),
               dim=dim)
    ref = run(cls, kwargs, device, torch.float64, False, torch.Generator().manual_seed(seed),
              init_dtype=dtype, dim=dim)
    assert ours.fused is fused_update
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    tol = 16 * ulp  # per step: the stored weight's rounding and the 16-bit gradient's
    # Roundings scale with the row's values (a weight that crossed zero after large updates
    # carries their rounding, not its own): each row within tol of its largest value.
    scale = ref.weight.abs().amax(1, keepdim=True).clamp(min=1)
    err = (ours.weight.double().cpu() - ref.weight.cpu()).abs() / scale
    if cls not in (torch.optim.Adam, so.PartialRowWiseAdam):
        assert err.max() <= tol, (name, dtype, seed, float(err.max()))
        return
    # Adam's step (either form) is about lr times the sign of its moment: where a gradient (with its weight
    # decay) nearly cancels, a rounding flips that sign and the element ends up to 2 lr per step
    # away. A rare element may do so (seen: 1 in 350); every other one stays within tol.
    off = err > tol
    assert off.double().mean() <= 0.01, (name, dtype, seed, int(off.sum()))
    assert err.max() <= 2 * kwargs["lr"] * 4, (name, dtype, seed, float(err.max()))


def test_which_optimizers_are_fused():
    def emb(cls, **kwargs):
        return so.HostEmbedding(10, 4, optimizer=cls, optimizer_kwargs=kwargs, device="cpu")
    assert emb(torch.optim.Adam, lr=0.1).fused
    assert emb(torch.optim.Adam, lr=torch.tensor(0.1)).fused  # a host tensor is a number
    assert emb(torch.optim.SGD, lr=0.1, momentum=0.9).fused
    assert not emb(torch.optim.RMSprop, lr=0.1).fused
    assert not emb(torch.optim.SparseAdam, lr=0.1).fused

    assert not emb(torch.optim.Adam, lr=0.1, differentiable=True).fused


def _buffer(device, rows=6, dim=4, parts=3, dtype=torch.float64, gen=None):
    buf = torch.randn(parts, rows, dim, generator=gen, dtype=dtype).to(device)
    buf[2].abs_()  # a second moment is never negative
    grad = torch.randn(rows, dim, generator=gen, dtype=dtype).to(device)
    return buf, grad


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_the_count_are_untouched(device, gen):
    buf, grad = _buffer(device, gen=gen)
    before = buf.clone()
    count = torch.tensor([4], device=device)
    step = torch.tensor(3.0, device=device)
    ops._fused_row_update(buf, grad, count, step, fused.ADAM, (0.1, 0.0, 0.9, 0.999, 1e-8), 0,
                          [1, 2])
    assert torch.equal(buf[:, 4:], before[:, 4:])
    assert not torch.equal(buf[:, :4], before[:, :4])
    # Adam's formula at step 3 against torch's Adam on those rows (state given).
    p = before[0, :4].clone().requires_grad_()
    p.grad = grad[:4].clone()
    opt = torch.optim.Adam([p], lr=0.1)
    opt.state[p].update(step=torch.tensor(2.0), exp_avg=before[1, :4].clone(),
                        exp_avg_sq=before[2, :4].clone())
    opt.step()
    assert torch.allclose(buf[0, :4], p.detach(), rtol=1e-12, atol=1e-14)
    assert torch.allclose(buf[1, :4], opt.state[p]["exp_avg"], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_themselves_and_write_nothing(device, gen):
    buf, grad = _buffer(device, gen=gen)
    before = buf.clone()
    count = torch.tensor([6], device=device)
    step = torch.tensor(1.0)
    hyper = (0.1, 0.0, 0.9, 0.999, 1e-8)
    bad = [
        (dict(rule=7), "rule"),
        (dict(rule=fused.PARTIAL_ROWWISE_ADAM, parts=[1]), "width"),
        (dict(rule=fused.PARTIAL_ROWWISE_ADAM, parts=[1, 2], grad=grad[:, :3].contiguous()),
         "state_parts must name the rule's exp_avg"),
        (dict(rounding=torch.tensor([1, 2], dtype=torch.int32, device=device)), "rounding"),
        (dict(rounding=torch.tensor([1, 2, 3], device=device)), "rounding"),
        (dict(grad=grad.float()), "grad must have buf's dtype"),
        (dict(grad=grad[:5]), "grad must have buf's"),
        (dict(count=torch.tensor([6, 6], device=device)), "count"),
        (dict(hyper=(0.1, 0.0)), "hyper"),
        (dict(flags=64), "flags"),
        (dict(parts=[1, 1]), "state_parts must be distinct"),
        (dict(parts=[3]), "state_parts"),
        (dict(step=None), "step is required"),
        (dict(step=torch.tensor([1, 2])), "step must be one"),
        (dict(rule=fused.ROWWISE_ADAGRAD, parts=[]), "width"),
        (dict(parts=[]), "state_parts must name the rule's exp_avg and exp_avg_sq"),
        (dict(parts=[1, 2], flags=4), "state_parts must name"),
        (dict(rule=fused.ADAGRAD, parts=[1, 2]), "state_parts must name the rule's sum"),
        (dict(rule=fused.SGD, parts=[], flags=2), "nesterov"),
        (dict(rule=fused.ADAGRAD, parts=[1], flags=4), "amsgrad"),
    ]
    for change, message in bad:
        args = dict(buf=buf, grad=grad, count=count, step=step, rule=fused.ADAM, hyper=hyper,
                    flags=0, parts=[1, 2], rounding=None)
        args.update(change)
        with pytest.raises(RuntimeError, match=message):
            ops._fused_row_update(args["buf"], args["grad"], args["count"], args["step"],
                                  args["rule"], args["hyper"], args["flags"], args["parts"],
                                  rounding=args["rounding"])
        assert torch.equal(buf, before), change


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule,parts", [(fused.ADAM, [1, 2]), (fused.ROWWISE_ADAGRAD, []),
                                        (fused.SGD, [1]), (fused.PARTIAL_ROWWISE_ADAM, [1])])
def test_rows_in_a_cache_are_updated_there(device, rule, parts, gen):
    """With a cache and a slot per staged row, a cached row's weight and state are read from
    its slot and written there (its staged row, NaN here, is not read); a row without a slot is
    updated in the buffer: the same values as updating a buffer that held every row."""
    n, width, slots = 8, 5, 6
    nparts = 3
    whole = torch.randn(nparts, n, width, generator=gen, dtype=torch.float64)
    whole[2].abs_()
    whole[0, :, 4].abs_()  # the row-wise value (accumulator, second moment)
    grad = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    at = torch.tensor([3, slots, 0, 5, slots, slots, 1, 2])  # slots, or past the cache: staged
    cache = torch.randn(nparts, slots, width, generator=gen, dtype=torch.float64)
    buf = torch.full((nparts, n, width), float("nan"), dtype=torch.float64)
    for r in range(n):
        if int(at[r]) < slots:
            cache[:, int(at[r])] = whole[:, r]
        else:
            buf[:, r] = whole[:, r]
    count = torch.tensor([7])
    step = torch.tensor(2.0)
    hyper = (0.1, 0.01, 0.9, 0.999, 1e-8) if rule != fused.SGD else (0.1, 0.01, 0.9, 0.1, 0.0)
    ops._fused_row_update(whole, grad, count, step, rule, hyper, 0, parts)
    dev = torch.device(device)
    buf_d, cache_d = buf.to(dev), cache.to(dev)
    cache_before = cache.clone()
    ops._fused_row_update(buf_d, grad.to(dev), count.to(dev), step, rule, hyper, 0, parts,
                          cache_d, at.to(dev))
    buf_d, cache_d = buf_d.cpu(), cache_d.cpu()
    touched = set()
    for r in range(7):
        s = int(at[r])
        got = cache_d[:, s] if s < slots else buf_d[:, r]
        if s < slots:
            touched.add(s)
        assert torch.allclose(got[0, :4], whole[0, r, :4], rtol=1e-12, atol=1e-14), r
        for p in parts:
            assert torch.allclose(got[p, :4], whole[p, r, :4], rtol=1e-12, atol=1e-14), (r, p)
        if rule in (fused.ROWWISE_ADAGRAD, fused.PARTIAL_ROWWISE_ADAM):
            assert torch.allclose(got[0, 4], whole[0, r, 4], rtol=1e-12), r
    for s in set(range(slots)) - touched:  # row 7 is past the count; others untouched
        assert torch.equal(cache_d[:, s], cache_before[:, s]), s
    with pytest.raises(RuntimeError, match="cache and at go together"):
        ops._fused_row_update(buf_d, grad, count, step, rule, hyper, 0, parts, cache_d, None)
    with pytest.raises(RuntimeError, match="cache must be"):
        ops._fused_row_update(buf_d, grad, count, step, rule, hyper, 0, parts, cache_d[:2],
                              at)
