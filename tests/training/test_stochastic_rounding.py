"""Stochastic rounding of the fused update's float16 and bfloat16 stores: each result is one of
its two neighbours in the format, the nearer's share matching the remainder (the mean over many
draws is the float32 result, within a few standard errors: normal values, both signs, float16's
subnormals and the values below its smallest step); many updates smaller than half a step track
the float32 sum where round-to-nearest stalls; a (seed, counter) gives the same bits on every
device and a new counter new draws; the modules turn it on for 16-bit tables unless told not
to, and a seed reproduces a run. The "cuda" cases run on the GPU machine."""

import math

import pytest
import torch

import speedtorch_ops as so
from speedtorch_ops import ops
from speedtorch_ops.training import fused
from conftest import HAS_CUDA, plain

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
N = 20000


def sgd_store(device, dtype, w, g, lr, rounding, dim=1):
    """w - lr * g for N rows of `dim` equal elements through the fused SGD update, stored in
    `dtype`; `rounding`: (seed, counter) or None (round to nearest)."""
    buf = torch.full((N, dim), w, dtype=dtype, device=device)
    grad = torch.full((N, dim), g, dtype=dtype, device=device)
    count = torch.tensor([N], device=device)
    r = None if rounding is None else torch.tensor(rounding, device=device)
    ops._fused_row_update(buf.view(torch.uint8), grad, count, None, fused.SGD,
                          (lr, 0.0, 0.0, 0.0, 0.0), 0, [0, -1], dtype, rounding=r)
    return buf.view(-1).double().cpu()


# (dtype, w, g, lr, the neighbours below and above the exact result)
CASES = {
    "bf16": (torch.bfloat16, 1.0, -3 * 2.0**-10, 1.0, 1.0, 1.0 + 2.0**-7),
    "bf16-negative": (torch.bfloat16, -1.0, 3 * 2.0**-10, 1.0, -1.0 - 2.0**-7, -1.0),
    "fp16": (torch.float16, 1000.0, 1.0, 0.37, 999.5, 1000.0),
    "fp16-subnormal": (torch.float16, 0.0, -2.0**-20, 0.3, 4 * 2.0**-24, 5 * 2.0**-24),
    "fp16-negative-subnormal": (torch.float16, 0.0, 2.0**-20, 0.3, -5 * 2.0**-24,
                                -4 * 2.0**-24),
    "fp16-below-the-smallest-step": (torch.float16, 0.0, -2.0**-24, 0.3, 0.0, 2.0**-24),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dim", [1, 8])  # on a GPU: one element a lane, then 16 bytes
def test_each_store_is_a_neighbour_drawn_without_bias(device, name, dim):
    dtype, w, g, lr, lo, hi = CASES[name]
    exact = w - lr * g
    assert lo < exact < hi
    got = sgd_store(device, dtype, w, g, lr, (12345, 7), dim)
    assert bool(((got == lo) | (got == hi)).all()), name
    p = (exact - lo) / (hi - lo)
    se = (hi - lo) * math.sqrt(p * (1 - p) / got.numel())
    assert abs(float(got.mean()) - exact) < 5 * se, (name, float(got.mean()), exact, se)
    nearest = sgd_store(device, dtype, w, g, lr, None, dim)
    assert bool((nearest == (lo if p < 0.5 else hi)).all()), name


def test_the_cpu_and_the_gpu_draw_the_same_bits():
    """The same (seed, counter) rounds the same values to the same bits on both devices:
    _round_into over random values of both 16-bit formats (float16's subnormals among them),
    and the fused SGD update at one element a lane and at 16 bytes (its float arithmetic exact
    here: lr 1)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    g = torch.Generator().manual_seed(11)
    src = torch.randn(70000, generator=g) * torch.logspace(-7, 3, 70000)
    for dtype in (torch.bfloat16, torch.float16):
        got = []
        for device in ("cpu", "cuda"):
            dst = torch.empty(70000, dtype=dtype, device=device)
            ops._round_into(dst, src.to(device), torch.tensor([9, 4], device=device))
            got.append(dst.cpu())
        assert torch.equal(got[0], got[1]), dtype
    for dtype, w, grad in [(torch.bfloat16, 1.0, -3 * 2.0**-10), (torch.float16, 1000.0, 0.25)]:
        for dim in (7, 16):
            rows = [sgd_store(d, dtype, w, grad, 1.0, (5, 6), dim) for d in ("cpu", "cuda")]
            assert torch.equal(rows[0], rows[1]), (dtype, dim)


@pytest.mark.parametrize("device", DEVICES)
def test_a_key_gives_the_same_draws_and_a_new_counter_new_ones(device):
    dtype, w, g, lr, _, _ = CASES["bf16"]
    first = sgd_store(device, dtype, w, g, lr, (99, 3), dim=8)
    assert torch.equal(first, sgd_store(device, dtype, w, g, lr, (99, 3), dim=8))
    assert not torch.equal(first, sgd_store(device, dtype, w, g, lr, (99, 4), dim=8))
    assert not torch.equal(first, sgd_store(device, dtype, w, g, lr, (100, 3), dim=8))
    if device == "cuda":  # the draw is a hash, not a device's generator: the same bits
        assert torch.equal(first, sgd_store("cpu", dtype, w, g, lr, (99, 3), dim=8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,update", [(torch.bfloat16, 2.0**-12), (torch.float16, 2.0**-14)])
def test_small_updates_track_the_float32_sum(device, dtype, update):
    """Each update is a sixteenth (bfloat16) or an eighth (float16) of the step below 1.0, less
    than half of it: round-to-nearest never moves the weight, stochastic rounding follows the
    sum on average."""
    steps, rows = 200, 4096
    results = {}
    for rounds in (True, False):
        buf = torch.ones((rows, 8), dtype=dtype, device=device)  # records of the weight only
        grad = torch.full((rows, 8), update, dtype=dtype, device=device)
        count = torch.tensor([rows], device=device)
        rounding = torch.tensor([2024, 0], device=device) if rounds else None
        for _ in range(steps):
            ops._fused_row_update(buf.view(torch.uint8), grad, count, None, fused.SGD,
                                  (1.0, 0, 0, 0, 0), 0, [0, -1], dtype, rounding=rounding)
            if rounding is not None:
                rounding[1] += 1
        results[rounds] = buf.double().cpu().view(-1)
    exact = 1.0 - steps * update
    assert torch.equal(results[False], torch.ones_like(results[False]))  # stalled
    got = results[True]
    se = float(got.std()) / math.sqrt(got.numel())
    assert abs(float(got.mean()) - exact) < 5 * se, (float(got.mean()), exact, se)


@pytest.mark.parametrize("device", DEVICES)
def test_module_rounds_16_bit_tables_stochastically_unless_told_not_to(device):
    def emb(dtype, **kwargs):
        return so.HostEmbedding(8, 4, dtype=dtype, optimizer=torch.optim.SGD,
                                optimizer_kwargs={"lr": 0.1}, device=device, **kwargs)
    assert emb(torch.bfloat16).stochastic_rounding
    assert emb(torch.float16).stochastic_rounding
    assert not emb(torch.bfloat16, stochastic_rounding=False).stochastic_rounding
    assert not emb(torch.float32).stochastic_rounding
    assert not emb(torch.float32, stochastic_rounding=True).stochastic_rounding  # exact enough
    general = emb(torch.bfloat16)
    general.fused_update = False  # torch's own step, on a float32 copy, rounds the same way
    assert general.stochastic_rounding
    with pytest.raises(TypeError, match="stochastic_rounding must be a bool or None"):
        emb(torch.bfloat16, stochastic_rounding=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused_update", [True, False])
def test_module_small_updates_track_and_a_seed_reproduces_the_run(device, fused_update):
    """A bfloat16 table of ones under SGD with every element's update a sixteenth of the
    format's step below 1.0: with stochastic rounding the mean follows the float32 sum, without
    it nothing moves; torch.manual_seed reproduces the rounded run bit for bit. The fused update
    and torch's own step (on a float32 copy, stored back by ops._round_into) alike."""
    rows, dim, steps, lr = 512, 8, 100, 2.0**-12

    def run(seed, rounding):
        torch.manual_seed(seed)
        emb = so.HostEmbedding.from_pretrained(
            torch.ones(rows, dim, dtype=torch.bfloat16), freeze=False, optimizer=torch.optim.SGD,
            optimizer_kwargs={"lr": lr}, device=device, stochastic_rounding=rounding)
        emb.fused_update = fused_update
        ids = torch.arange(rows, device=device)
        for _ in range(steps):
            emb(ids).float().sum().backward()  # every element's gradient is 1
            emb.step()
        return emb.weight.double().cpu().view(-1)

    got = run(0, None)
    exact = 1.0 - steps * lr
    se = float(got.std()) / math.sqrt(got.numel())
    assert abs(float(got.mean()) - exact) < 5 * se, (float(got.mean()), exact, se)
    assert torch.equal(got, run(0, None))
    assert not torch.equal(got, run(1, None))
    assert torch.equal(run(0, False), torch.ones(rows * dim, dtype=torch.float64))


def test_float16_tables_warn_where_the_state_holds_squares():
    def emb(optimizer, dtype=torch.float16, state_dtype=None):
        return so.HostEmbedding(4, 8, dtype=dtype, optimizer=optimizer, device="cpu",
                                state_dtype=state_dtype)
    for optimizer in (torch.optim.Adam, torch.optim.Adagrad):
        with pytest.warns(UserWarning, match="float16 state with .*squared gradients.*bfloat16"):
            emb(optimizer)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emb(torch.optim.SGD)  # momentum or none: no squares
        emb(torch.optim.Adam, torch.bfloat16)
        emb(torch.optim.Adam, state_dtype=torch.float32)
        # Their squares are kept one a row, in float32.
        emb(so.PartialRowWiseAdam)
        emb(so.RowWiseAdagrad)


def test_cache_stats_report_the_rows_a_budget_holds():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        emb = so.HostEmbedding(100_000, 128, dtype=dtype, optimizer=torch.optim.Adam,
                               device="cuda", cache_bytes=8 << 20)
        stats = emb.cache_stats()
        assert stats["cache_rows"] == emb.store.slots
        assert stats["cache_bytes"] >= stats["cache_rows"] * emb.row_bytes
        sizes[dtype] = stats["cache_rows"]
    assert sizes[torch.bfloat16] > 1.9 * sizes[torch.float32]  # half the bytes a row
    assert so.HostEmbedding(10, 4, device="cuda").cache_stats()["cache_rows"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_into_rounds_as_the_fused_update(device, dtype):
    """ops._round_into: each value one of its two neighbours, their mean the float32 value
    (bfloat16, float16 subnormals), exact for float32; bad arguments name themselves."""
    if dtype == torch.float32:
        src = torch.randn(1000, device=device)
        dst = torch.empty_like(src)
        ops._round_into(dst, src, torch.tensor([1, 2], device=device))
        assert torch.equal(dst, src)
        return
    case = "bf16" if dtype == torch.bfloat16 else "fp16-subnormal"
    _, w, g, lr, lo, hi = CASES[case]
    exact = w - lr * g
    src = torch.full((3, N), exact, dtype=torch.float32, device=device)
    dst = torch.empty_like(src, dtype=dtype)
    ops._round_into(dst, src, torch.tensor([77, 5], device=device))
    got = dst.double().cpu().view(-1)
    assert bool(((got == lo) | (got == hi)).all())
    p = (float(torch.tensor(exact, dtype=torch.float32)) - lo) / (hi - lo)
    se = (hi - lo) * math.sqrt(p * (1 - p) / got.numel())
    assert abs(float(got.mean()) - float(torch.tensor(exact, dtype=torch.float32))) < 5 * se
    again = torch.empty_like(dst)
    ops._round_into(again, src, torch.tensor([77, 5], device=device))
    assert torch.equal(again, dst)
    for args, message in [((dst, src.double(), torch.tensor([1, 2], device=device)), "src"),
                          ((dst, src[:2], torch.tensor([1, 2], device=device)), "shape"),
                          ((dst, src, torch.tensor([1], device=device)), "rounding"),
                          ((dst.int(), src, torch.tensor([1, 2], device=device)), "dst")]:
        with pytest.raises(RuntimeError, match=message):
            ops._round_into(*args)


def _train(emb, batches, device):
    for ids in batches:
        emb(ids.to(device)).float().pow(2).sum().backward()
        emb.step()


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_resumes_the_rounding_stream(device, tmp_path):
    """A bfloat16 run saved after two steps and resumed in a fresh module (built under another
    torch seed) ends bit for bit where the unbroken run ends: the checkpoint carries the
    rounding's seed and counter with the 16-bit weight and state. A 16-bit checkpoint loads
    strictly into a float32 table and back (the rounding's entries are optional)."""
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(40, 8, generator=gen).to(torch.bfloat16)
    batches = [torch.randint(0, 40, (30,), generator=gen) for _ in range(4)]
    kw = dict(optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.01}, device=device)
    torch.manual_seed(0)
    whole = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)
    _train(whole, batches, device)
    torch.manual_seed(0)
    first = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)
    _train(first, batches[:2], device)
    torch.save(first.state_dict(), tmp_path / "emb.pt")
    torch.manual_seed(1)
    resumed = so.HostEmbedding(40, 8, dtype=torch.bfloat16, **kw)
    resumed.load_state_dict(torch.load(tmp_path / "emb.pt"))
    _train(resumed, batches[2:], device)
    sd = whole.state_dict()
    assert sd["weight"].dtype == sd["optimizer.exp_avg"].dtype == torch.bfloat16
    assert int(sd["optimizer.rounding_counter"]) == 4
    for key, value in sd.items():
        assert torch.equal(resumed.state_dict()[key], value), key
    wide = so.HostEmbedding(40, 8, dtype=torch.float32, **kw)
    wide.load_state_dict(sd)
    assert torch.equal(wide.weight, whole.weight.float())
    assert "optimizer.rounding_seed" not in wide.state_dict()
    narrow = so.HostEmbedding(40, 8, dtype=torch.bfloat16, **kw)
    narrow.load_state_dict(wide.state_dict())
    assert torch.equal(narrow.weight, whole.weight)


def test_a_collection_checkpoint_resumes_the_rounding_stream(tmp_path):
    gen = torch.Generator().manual_seed(9)
    tables = [so.TableConfig("a", 30, 8, pooling="sum"), so.TableConfig("b", 20, 8, pooling="mean")]
    batches = []
    for _ in range(4):
        lengths = torch.randint(0, 4, (2 * 5,), generator=gen)
        ids = torch.cat([torch.randint(0, 30, (int(lengths[:5].sum()),), generator=gen),
                         torch.randint(0, 20, (int(lengths[5:].sum()),), generator=gen)])
        batches.append(so.KeyedJaggedTensor.from_lengths_sync(["a", "b"], ids, lengths))

    def make(seed):
        torch.manual_seed(seed)
        return so.HostEmbeddingBagCollection(tables, optimizer=torch.optim.Adam,
                                             optimizer_kwargs={"lr": 0.01}, device="cpu",
                                             dtype=torch.bfloat16)

    def train(ebc, kjts):
        for kjt in kjts:
            out = plain(ebc(kjt))
            (out["a"].float().pow(2).sum() + out["b"].float().pow(2).sum()).backward()
            ebc.step()

    whole = make(0)
    start = {key: value.clone() for key, value in whole.state_dict().items()}  # not views
    train(whole, batches)
    first = make(1)
    first.load_state_dict(start)
    train(first, batches[:2])
    torch.save(first.state_dict(), tmp_path / "ebc.pt")
    resumed = make(2)
    resumed.load_state_dict(torch.load(tmp_path / "ebc.pt"))
    train(resumed, batches[2:])
    sd = whole.state_dict()
    assert {"a.optimizer.rounding_seed", "b.optimizer.rounding_counter"} <= set(sd)
    for key, value in sd.items():
        assert torch.equal(resumed.state_dict()[key], value), key
    wide = so.HostEmbeddingBagCollection(tables, optimizer=torch.optim.Adam,
                                         optimizer_kwargs={"lr": 0.01}, device="cpu")
    wide.load_state_dict(sd)  # strict: a table's rounding entries are optional
    assert torch.equal(wide.table_weight("a"), whole.table_weight("a").float())
    stray = {**sd, "zzz.optimizer.rounding_seed": torch.tensor(1)}
    assert wide.load_state_dict(stray, strict=False).unexpected_keys == [
        "zzz.optimizer.rounding_seed"]


@pytest.mark.parametrize("optimizer,state_dtype", [
    (torch.optim.Adam, None), (torch.optim.Adam, torch.float32),
    (so.PartialRowWiseAdam, None), (so.PartialRowWiseAdam, torch.float32)])
def test_cached_and_captured_steps_round_as_the_plain_step(optimizer, state_dtype):
    """On the GPU, a bfloat16 table's steps (its state in bfloat16 or float32: records of 96,
    160, 72 and 104 bytes, the last two moved and updated in 8-byte pieces) with a cache that evicts every step and its steps captured in
    a CUDA graph draw the same bits as its plain eager steps (the draws follow the row's place
    in the step, not where the row lives or how the step was launched)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    from speedtorch_ops.training.cache import CachedRows
    rows, dim = 300, 16
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
    batches = [torch.randint(0, rows, (64,), generator=gen).cuda() for _ in range(8)]

    def make(cache_rows):
        torch.manual_seed(0)
        emb = so.HostEmbedding.from_pretrained(
            init, freeze=False, optimizer=optimizer,
            optimizer_kwargs={"lr": 0.01, "capturable": True}, device="cuda",
            bounds_check="prechecked", state_dtype=state_dtype)
        if cache_rows:
            emb.set_cache_bytes(CachedRows.index_bytes(rows) + cache_rows * emb.row_bytes)
        return emb

    def step(emb, ids):
        loss = emb(ids).float().pow(2).sum()
        loss.backward()
        emb.step()
        return loss.detach()

    plain, tiny, graphed = make(0), make(20), make(0)
    for ids in batches:
        step(plain, ids)
        step(tiny, ids)
    assert tiny.cache_stats()["evictions"] > 0
    captured = so.CapturedStep(lambda ids: step(graphed, ids), rows=(rows,), warmup=2)
    for ids in batches:
        captured(ids)
    want = plain.state_dict()
    for other in (tiny, graphed):
        for key, value in other.state_dict().items():
            assert torch.equal(value.cpu(), want[key].cpu()), key


@pytest.mark.parametrize("device", DEVICES)
def test_float16_keeps_finite_what_nearest_keeps_finite(device):
    """Past float16's largest value (65504) the upper neighbour is infinity: a value that
    round-to-nearest keeps finite stays at 65504, one it takes to infinity may go there."""
    src = torch.tensor([65510.0, -65519.0, 65600.0, 1e6], device=device).repeat(1000)
    dst = torch.empty_like(src, dtype=torch.float16)
    ops._round_into(dst, src, torch.tensor([3, 1], device=device))
    got = dst.float().view(1000, 4).cpu()
    assert torch.equal(got[:, 0], torch.full((1000,), 65504.0))
    assert torch.equal(got[:, 1], torch.full((1000,), -65504.0))
    assert bool(torch.isinf(got[:, 3]).all())
    assert set(got[:, 2].tolist()) <= {65504.0, float("inf")}


def test_a_table_starts_from_the_same_weights_with_or_without_rounding():
    starts = []
    for dtype, rounding in [(torch.bfloat16, None), (torch.bfloat16, False), (torch.float32, None)]:
        torch.manual_seed(4)
        emb = so.HostEmbedding(50, 8, dtype=dtype, device="cpu", stochastic_rounding=rounding)
        starts.append(emb.weight.float())
    assert torch.equal(starts[0], starts[1])
    assert torch.equal(starts[0], starts[2].to(torch.bfloat16).float())
    torch.manual_seed(4)
    a = so.HostEmbedding(50, 8, dtype=torch.bfloat16, device="cpu")
    b = so.HostEmbedding(50, 8, dtype=torch.bfloat16, device="cpu")
    assert int(a.engine.update.rounding[0]) != int(b.engine.update.rounding[0])  # each table its own stream
    seed = int(a.engine.update.rounding[0])
    a.to(torch.float16)  # a conversion carries the stream on
    assert int(a.engine.update.rounding[0]) == seed
