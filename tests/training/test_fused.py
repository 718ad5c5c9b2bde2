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
from speedtorch_ops.training.optim_state import RowLayout
from conftest import HAS_CUDA, plain

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
        init_dtype=None, state_dtype=None):
    """A HostEmbedding trained a few steps; `init_dtype`: its start rounded through it."""
    init = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    if init_dtype is not None:
        init = init.to(init_dtype).double()
    batches = [torch.randint(0, rows // 2, (6, 5), generator=gen) for _ in range(steps)]
    targets = [torch.randn(6, 5, dim, generator=gen, dtype=torch.float64) for _ in batches]
    emb = so.HostEmbedding.from_pretrained(init.to(dtype), freeze=False, optimizer=cls,
                                           optimizer_kwargs=kwargs, device=device, dtype=dtype,
                                           state_dtype=state_dtype)
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


ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,state_dtype", [
    (torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32)])
@pytest.mark.parametrize("name", ["adam", "rowwise", "sgd-momentum", "partial-rowwise-adam"])
@pytest.mark.parametrize("dim", [7, 16])
@pytest.mark.parametrize("fused_update", [True, False])
def test_fused_step_in_low_precision(device, dtype, state_dtype, name, dim, fused_update, gen):
    """Math in float32 inside the kernel (or, for torch's own step, on float32 copies of the
    staged weight and state), values stored in `dtype` and the state in `state_dtype` (rounded
    stochastically: the modules' default): after a few steps within a few roundings of the
    coarser dtype of torch's step in float64 from the same (rounded) start. torch's step in 16
    bits would be no reference: it computes in 16 bits (Adam's second moment underflows)."""
    cls, kwargs = CASES[name]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ours = run(cls, kwargs, device, dtype, fused_update, torch.Generator().manual_seed(seed),
               dim=dim, state_dtype=state_dtype)
    ref = run(cls, kwargs, device, torch.float64, False, torch.Generator().manual_seed(seed),
              init_dtype=dtype, dim=dim)
    assert ours.fused is fused_update
    assert ours.state_dtype == (state_dtype or dtype)
    for key, value in ours.state_dict().items():
        if key.startswith("optimizer.exp_avg") or key == "optimizer.momentum_buffer":
            expected = torch.float32 if value.dim() == 1 else state_dtype or dtype
            assert value.dtype == expected, (key, value.dtype)
    ulp = max(ULP[dtype], ULP[state_dtype or dtype])
    tol = 16 * ulp  # per step: the stored values' rounding and the 16-bit gradient's
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


def _records(layout, rows, values: dict, device) -> torch.Tensor:
    """`rows` records of `layout` (uint8) holding `values` (name -> (rows, dim) or (rows,))."""
    buf = torch.zeros(rows, layout.width, dtype=torch.uint8)
    for name, value in values.items():
        layout.of_record(buf, name).copy_(value)
    return buf.to(device)


ADAM_LAYOUT = RowLayout(4, ["exp_avg", "exp_avg_sq"], [], torch.float64)


def _fields(layout, row=None, states=("exp_avg", "exp_avg_sq")):
    """The op's fields: the weight's offset, the row value's (-1: none), each state's."""
    return layout.offsets(["weight"]) + (layout.offsets([row]) if row else [-1]) + \
        layout.offsets(states)


def _buffer(device, rows=6, dim=4, gen=None):
    values = {"weight": torch.randn(rows, dim, generator=gen, dtype=torch.float64),
              "exp_avg": torch.randn(rows, dim, generator=gen, dtype=torch.float64),
              "exp_avg_sq": torch.randn(rows, dim, generator=gen, dtype=torch.float64).abs()}
    grad = torch.randn(rows, dim, generator=gen, dtype=torch.float64).to(device)
    return _records(ADAM_LAYOUT, rows, values, device), grad, values


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_the_count_are_untouched(device, gen):
    buf, grad, values = _buffer(device, gen=gen)
    before = buf.clone()
    count = torch.tensor([4], device=device)
    step = torch.tensor(3.0, device=device)
    ops._fused_row_update(buf, grad, count, step, fused.ADAM, (0.1, 0.0, 0.9, 0.999, 1e-8), 0,
                          _fields(ADAM_LAYOUT), torch.float64)
    assert torch.equal(buf[4:], before[4:])
    assert not torch.equal(buf[:4], before[:4])
    # Adam's formula at step 3 against torch's Adam on those rows (state given).
    p = values["weight"][:4].clone().requires_grad_()
    p.grad = grad[:4].cpu().clone()
    opt = torch.optim.Adam([p], lr=0.1)
    opt.state[p].update(step=torch.tensor(2.0), exp_avg=values["exp_avg"][:4].clone(),
                        exp_avg_sq=values["exp_avg_sq"][:4].clone())
    opt.step()
    got = buf.cpu()
    assert torch.allclose(ADAM_LAYOUT.of_record(got, "weight")[:4], p.detach(), rtol=1e-12,
                          atol=1e-14)
    assert torch.allclose(ADAM_LAYOUT.of_record(got, "exp_avg")[:4], opt.state[p]["exp_avg"],
                          rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_themselves_and_write_nothing(device, gen):
    buf, grad, _ = _buffer(device, gen=gen)
    before = buf.clone()
    count = torch.tensor([6], device=device)
    step = torch.tensor(1.0)
    hyper = (0.1, 0.0, 0.9, 0.999, 1e-8)
    w, m, v = _fields(ADAM_LAYOUT)[:1] + _fields(ADAM_LAYOUT)[2:]
    bad = [
        (dict(rule=7), "rule"),
        (dict(rule=fused.PARTIAL_ROWWISE_ADAM, fields=[w, -1, m]), r"fields\[1\]"),
        (dict(rule=fused.PARTIAL_ROWWISE_ADAM, fields=[w, 4, m]), r"fields\[1\] = 4 must be"),
        (dict(rule=fused.PARTIAL_ROWWISE_ADAM, fields=[w, v + 32, m]), r"fields\[1\]"),
        (dict(fields=[w, -1, m, m]), r"fields\[3\] overlaps"),
        (dict(fields=[w, -1, m, v + 8]), r"fields\[3\] = .* inside buf's record"),
        (dict(fields=[w, -1, m + 4, v]), r"fields\[2\] = .* a multiple of 8"),
        (dict(rounding=torch.tensor([1, 2], dtype=torch.int32, device=device)), "rounding"),
        (dict(rounding=torch.tensor([1, 2, 3], device=device)), "rounding"),
        (dict(grad=grad.float()), "state_dtype must be float32, bfloat16 or the weights'"),
        (dict(state_dtype=torch.float32), "state_dtype must be float64"),
        (dict(state_dtype=torch.int64), "state_dtype"),
        (dict(grad=grad[:5]), "grad must have buf's"),
        (dict(buf=buf.view(torch.float64)), "buf must be a contiguous uint8"),
        (dict(buf=buf[:, :-8]), "buf must be a contiguous uint8"),
        (dict(count=torch.tensor([6, 6], device=device)), "count"),
        (dict(hyper=(0.1, 0.0)), "hyper"),
        (dict(flags=64), "flags"),
        (dict(step=None), "step is required"),
        (dict(step=torch.tensor([1, 2])), "step must be one"),
        (dict(rule=fused.ROWWISE_ADAGRAD, fields=[w, -1]), r"fields\[1\]"),
        (dict(fields=[w, -1]), "fields must name the rule's exp_avg and exp_avg_sq"),
        (dict(fields=[w, -1, m, v], flags=4), "fields must name"),
        (dict(rule=fused.ADAGRAD), "fields must name the rule's sum"),
        (dict(rule=fused.SGD, fields=[w, -1], flags=2), "nesterov"),
        (dict(rule=fused.ADAGRAD, fields=[w, -1, m], flags=4), "amsgrad"),
        (dict(fields=[w]), "fields must hold"),
    ]
    for change, message in bad:
        args = dict(buf=buf, grad=grad, count=count, step=step, rule=fused.ADAM, hyper=hyper,
                    flags=0, fields=[w, -1, m, v], state_dtype=torch.float64, rounding=None)
        args.update(change)
        with pytest.raises(RuntimeError, match=message):
            ops._fused_row_update(args["buf"], args["grad"], args["count"], args["step"],
                                  args["rule"], args["hyper"], args["flags"], args["fields"],
                                  args["state_dtype"], rounding=args["rounding"])
        assert torch.equal(buf, before), change


RULE_LAYOUTS = {  # rule: (per-element states, the row value)
    fused.ADAM: (["exp_avg", "exp_avg_sq"], None),
    fused.ROWWISE_ADAGRAD: ([], "sum"),
    fused.SGD: (["momentum_buffer"], None),
    fused.PARTIAL_ROWWISE_ADAM: (["exp_avg"], "exp_avg_sq"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", sorted(RULE_LAYOUTS))
def test_rows_in_a_cache_are_updated_there(device, rule, gen):
    """With a cache and a slot per staged row, a cached row's weight and state are read from
    its slot and written there (its staged record, NaN here, is not read); a row without a slot
    is updated in the buffer: the same values as updating a buffer that held every row."""
    n, dim, slots = 8, 4, 6
    states, row = RULE_LAYOUTS[rule]
    layout = RowLayout(dim, states, [row] if row else [], torch.float64)
    values = {"weight": torch.randn(n, dim, generator=gen, dtype=torch.float64)}
    values.update((name, torch.rand(n, dim, generator=gen, dtype=torch.float64))
                  for name in states)  # a second moment is never negative
    if row:
        values[row] = torch.rand(n, generator=gen, dtype=torch.float64)
    whole = _records(layout, n, values, "cpu")
    grad = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    at = torch.tensor([3, slots, 0, 5, slots, slots, 1, 2])  # slots, or past the cache: staged
    cache = torch.randint(0, 256, (slots, layout.width), generator=gen, dtype=torch.uint8)
    buf = _records(layout, n, {name: torch.full_like(v, float("nan"))
                               for name, v in values.items()}, "cpu")
    for r in range(n):
        if int(at[r]) < slots:
            cache[int(at[r])] = whole[r]
        else:
            buf[r] = whole[r]
    count = torch.tensor([7])
    step = torch.tensor(2.0)
    hyper = (0.1, 0.01, 0.9, 0.999, 1e-8) if rule != fused.SGD else (0.1, 0.01, 0.9, 0.1, 0.0)
    fields = _fields(layout, row, states)
    ops._fused_row_update(whole, grad, count, step, rule, hyper, 0, fields, torch.float64)
    dev = torch.device(device)
    buf_d, cache_d = buf.to(dev), cache.to(dev)
    cache_before = cache.clone()
    ops._fused_row_update(buf_d, grad.to(dev), count.to(dev), step, rule, hyper, 0, fields,
                          torch.float64, cache_d, at.to(dev))
    buf_d, cache_d = buf_d.cpu(), cache_d.cpu()
    touched = set()
    for r in range(7):
        s = int(at[r])
        got = cache_d[s:s + 1] if s < slots else buf_d[r:r + 1]
        if s < slots:
            touched.add(s)
        for name in values:
            assert torch.allclose(layout.of_record(got, name)[0],
                                  layout.of_record(whole, name)[r], rtol=1e-12, atol=1e-14), \
                (r, name)
    for s in set(range(slots)) - touched:  # row 7 is past the count; others untouched
        assert torch.equal(cache_d[s], cache_before[s]), s
    with pytest.raises(RuntimeError, match="cache and at go together"):
        ops._fused_row_update(buf_d, grad, count, step, rule, hyper, 0, fields, torch.float64,
                              cache_d, None)
    with pytest.raises(RuntimeError, match="cache must be"):
        ops._fused_row_update(buf_d, grad, count, step, rule, hyper, 0, fields, torch.float64,
                              cache_d[:, :8], at)


def test_records_meet_the_byte_budget():
    """A 128-wide row with its state, in bytes: bfloat16 PartialRowWiseAdam is 520 (weight
    and first moment 256 each, the float32 second moment 4, padded to 8 bytes)."""
    def emb(dtype, optimizer, state_dtype=None, dim=128):
        return so.HostEmbedding(4, dim, dtype=dtype, optimizer=optimizer, device="cpu",
                                state_dtype=state_dtype)
    assert emb(torch.bfloat16, so.PartialRowWiseAdam).row_bytes == 520
    assert emb(torch.bfloat16, so.PartialRowWiseAdam, torch.float32).row_bytes == 256 + 512 + 8
    assert emb(torch.float32, torch.optim.Adam).row_bytes == 1536
    assert emb(torch.bfloat16, torch.optim.Adam).row_bytes == 768
    assert emb(torch.bfloat16, torch.optim.Adam, torch.float32).row_bytes == 256 + 2 * 512
    assert emb(torch.float32, torch.optim.Adam, torch.bfloat16).row_bytes == 512 + 2 * 256
    assert emb(torch.bfloat16, so.RowWiseAdagrad).row_bytes == 264
    assert emb(torch.float32, so.RowWiseAdagrad).row_bytes == 520
    assert emb(torch.float64, torch.optim.Adam, dim=3).row_bytes == 72


def test_bad_state_dtypes_name_the_argument():
    for dtype, state_dtype in [(torch.float64, torch.float32), (torch.float32, torch.float16),
                               (torch.float32, torch.int32), (torch.float32, "nope")]:
        with pytest.raises(TypeError, match="state_dtype"):
            so.HostEmbedding(4, 8, dtype=dtype, state_dtype=state_dtype, device="cpu")
    with pytest.raises(TypeError, match="TableConfig 't'.*state_dtype"):
        so.HostEmbeddingCollection([so.TableConfig("t", 4, 8, dtype=torch.float64,
                                                   state_dtype=torch.bfloat16)], device="cpu")
    # The collection's state_dtype where a table names none; a float64 table keeps float64.
    ebc = so.HostEmbeddingCollection([so.TableConfig("t", 4, 8, dtype=torch.float64),
                                      so.TableConfig("u", 4, 8)], state_dtype=torch.bfloat16,
                                     device="cpu")
    assert sorted(str(g.state_dtype) for g in ebc.groups) == ["torch.bfloat16", "torch.float64"]


def test_conversions_keep_a_state_dtype_the_step_takes():
    """A state that follows the weights follows a conversion; a float32 or bfloat16 one stays
    (float64 weights take float64 state); every converted module still steps."""
    cases = [(torch.float64, torch.float64, torch.float32, torch.float32),
             (torch.float16, torch.float16, torch.float32, torch.float32),
             (torch.float16, torch.float16, torch.bfloat16, torch.bfloat16),
             (torch.bfloat16, torch.float32, torch.float16, torch.float32),
             (torch.float32, torch.bfloat16, torch.float64, torch.float64),
             (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16)]
    for dtype, state_dtype, to, want in cases:
        emb = so.HostEmbedding(6, 4, dtype=dtype, state_dtype=state_dtype, device="cpu",
                               optimizer=torch.optim.Adam)
        emb.to(to)
        assert emb.dtype == to and emb.state_dtype == want, (dtype, state_dtype, to)
        emb(torch.tensor([1, 2])).float().sum().backward()
        emb.step()


def test_tables_of_one_record_share_a_group():
    """A table naming the state dtype its weights already imply groups with one naming none."""
    ebc = so.HostEmbeddingCollection([so.TableConfig("a", 10, 4, state_dtype=torch.float32),
                                      so.TableConfig("b", 10, 4)], device="cpu")
    assert len(ebc.groups) == 1
    with pytest.raises(TypeError, match="TableConfig 't': state_dtype"):
        so.TableConfig("t", 4, 8, state_dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_state_dtype_checkpoints_resume_exactly(device, dtype, state_dtype, gen):
    """A table with its state in another dtype: state_dict holds each entry in its own dtype;
    a fresh module loaded from it then trains to the same bits as the unbroken one (the
    stochastic rounding's seed and counter travel in the state_dict)."""
    def make():
        return so.HostEmbedding(40, 16, dtype=dtype, state_dtype=state_dtype,
                                optimizer=so.PartialRowWiseAdam, optimizer_kwargs={"lr": 0.05},
                                device=device)
    batches = [torch.randint(0, 40, (6, 3), generator=gen) for _ in range(6)]

    def train(emb, some):
        for ids in some:
            emb(ids.to(device)).float().pow(2).sum().backward()
            emb.step()
    a = make()
    train(a, batches[:3])
    saved = a.state_dict()
    assert saved["weight"].dtype == dtype
    assert saved["optimizer.exp_avg"].dtype == state_dtype
    assert saved["optimizer.exp_avg_sq"].dtype == torch.float32  # one a row: float32
    b = make()
    b.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items()})
    train(a, batches[3:])
    train(b, batches[3:])
    for key, value in a.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, b.state_dict()[key]), key


def test_collection_tables_keep_their_state_dtype(gen):
    """TableConfig(state_dtype=...) per table, the collection's state_dtype for the others;
    tables of one width and dtype but two state dtypes train in two groups."""
    tables = [so.TableConfig("a", 30, 8, pooling="none"),
              so.TableConfig("b", 20, 8, pooling="none", state_dtype=torch.float32)]
    ebc = so.HostEmbeddingCollection(tables, optimizer=torch.optim.Adam, device="cpu",
                                     dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    assert len(ebc.groups) == 2
    kjt = so.KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.randint(0, 20, (10,), generator=gen), torch.tensor([6, 4]))
    out = plain(ebc(kjt))
    (out["a"].float().sum() + out["b"].float().sum()).backward()
    ebc.step()
    state = ebc.state_dict()
    assert state["a.optimizer.exp_avg"].dtype == torch.bfloat16
    assert state["b.optimizer.exp_avg"].dtype == torch.float32
    assert state["a.weight"].dtype == state["b.weight"].dtype == torch.bfloat16
    assert state["b.optimizer.exp_avg"].abs().sum() > 0  # the step reached its float32 state
