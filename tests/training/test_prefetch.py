"""Prefetch (``HostEmbedding.prefetch``): loading the next step's rows ahead never changes what
training computes. A module that prefetches, with no cache or a small one that evicts every
step, trains exactly like one that does not (float64), with the next batch sharing hot ids with
the current one (the rows the current step's commit rewrites), prefetches of other ids mixed in
(they waste bytes), prefetches issued during a step or between steps, and a host table rewritten
after a prefetch. Without a cache the rows a stage takes from the carry are exactly those an
independent NumPy account predicts (same id at the same place of the sorted distinct ids, not
in the step staged at the prefetch). On the CPU the transfer is synchronous; on the GPU it runs
on a side stream, ids may be on the GPU, and a step captured in a CUDA graph may prefetch the
next step's ids."""

import numpy as np
import pytest
import torch

import speedtorch_ops as so
from speedtorch_ops.training.cache import CachedRows
from speedtorch_ops.training.host_rows import HostRows
from conftest import HAS_CUDA
from test_cache import OPTIMIZERS, check_map

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
ROWS, DIM = 40, 5


def batches(gen, count, shape=(4, 6)):
    out = []
    for _ in range(count):
        ids = torch.randint(0, ROWS, shape, generator=gen)
        hot = torch.randint(0, 6, shape, generator=gen)
        ids = torch.where(torch.rand(shape, generator=gen) < 0.6, hot, ids)  # shared hot ids
        out.append((ids, torch.randn(*shape, DIM, dtype=torch.float64, generator=gen)))
    return out


def pair(device, opt, slots, gen):
    cls, kwargs = OPTIMIZERS[opt]
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    plain, ahead = (so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                                     device=device) for _ in range(2))
    if slots:
        ahead.store = CachedRows(ahead.host, torch.device(device), slots, aging_steps=3)
    else:
        assert type(ahead.store) is HostRows
    return plain, ahead


def train(emb, ids, target):
    ((emb(ids) * target).sum(-1) - 1).pow(2).sum().backward()
    emb.step()


def assert_same(plain, ahead, device):
    tol = 0 if device == "cpu" else 1e-12  # GPU gradient sums of repeated ids use atomics
    want = plain.state_dict()
    for key, value in ahead.state_dict().items():
        assert torch.allclose(value, want[key], rtol=tol, atol=tol), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", range(len(OPTIMIZERS)))
@pytest.mark.parametrize("slots", [0, 3, 12, 30])
@pytest.mark.parametrize("when", ["during", "between"])
def test_prefetch_trains_like_no_prefetch(device, opt, slots, when, gen):
    plain, ahead = pair(device, opt, slots, gen)
    data = [(ids.to(device), t.to(device)) for ids, t in batches(gen, 12)]
    other = batches(gen, 12)
    for i, (ids, target) in enumerate(data):
        train(plain, ids, target)
        nxt = data[i + 1][0] if i + 1 < len(data) else None
        if i % 4 == 3:
            nxt = other[i][0].to(device)  # not the next batch: dropped at the next forward
        loss = ((ahead(ids) * target).sum(-1) - 1).pow(2).sum()
        if when == "during" and nxt is not None:
            ahead.prefetch(nxt)  # before backward: the rows of this step are still staged
        loss.backward()
        ahead.step()
        if when == "between" and nxt is not None:
            ahead.prefetch(nxt)
        if slots:
            check_map(ahead.store)
    assert_same(plain, ahead, device)
    stats = ahead.cache_stats()
    assert 0 < stats["prefetched_loads"] <= stats["host_loads"]
    assert stats["prefetched_loads"] <= stats["prefetched_rows"]
    assert stats["hits"] + stats["host_loads"] == stats["lookups"]
    assert stats["lookups"] == plain.cache_stats()["lookups"]


def distinct_padded(ids: torch.Tensor) -> tuple:
    """(the sorted distinct ids padded with zeros to the number of ids, how many): the layout
    a stage and a prefetch give their positions."""
    flat = ids.reshape(-1).numpy()
    u = np.unique(flat)
    return np.concatenate([u, np.zeros(flat.size - u.size, dtype=u.dtype)]), u.size


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["during", "between"])
def test_stage_takes_exactly_the_matching_carried_rows(device, when, gen):
    """No cache: a stage takes a carried row where the prefetch's sorted distinct ids hold the
    stage's id at the same place and the prefetch did not skip it (an id of the step staged at
    a prefetch during a step); every other row loads from the host. The next forward's ids are
    the prefetched ones, a few of them changed, or other ids altogether."""
    plain, ahead = pair(device, 0, 0, gen)
    data = batches(gen, 10)
    expected = 0
    for i, (ids, target) in enumerate(data):
        train(plain, ids.to(device), target.to(device))
        loss = ((ahead(ids.to(device)) * target.to(device)).sum(-1) - 1).pow(2).sum()
        if i + 1 < len(data):
            nxt = data[i + 1][0]
            told = nxt.clone()
            if i % 3 == 1:
                told.view(-1)[:3] = torch.randint(0, ROWS, (3,), generator=gen)
            elif i % 3 == 2:
                told = torch.randint(0, ROWS, nxt.shape, generator=gen)
            if when == "during":
                ahead.prefetch(told.to(device))
            loss.backward()
            ahead.step()
            if when == "between":
                ahead.prefetch(told.to(device))
            pre, pre_n = distinct_padded(told)
            got, got_n = distinct_padded(nxt)
            skipped = np.isin(pre, ids.numpy()) if when == "during" else np.zeros(len(pre), bool)
            valid = np.arange(len(pre)) < min(pre_n, got_n)
            expected += int((valid & (pre == got) & ~skipped).sum())
        else:
            loss.backward()
            ahead.step()
    assert_same(plain, ahead, device)
    stats = ahead.cache_stats()
    assert stats["prefetched_loads"] == expected > 0
    assert stats["host_loads"] == stats["lookups"] == plain.cache_stats()["lookups"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [0, 12])
@pytest.mark.parametrize("then", ["same ids again", "another size first"])
def test_a_stage_empties_the_carry(device, slots, then, gen):
    """What a stage found in the carry is gone after it, taken or not: the next step's rows
    may have changed at its commit. The prefetched batch trains twice in a row (the second
    time with nothing prefetched), or a batch of another size (sharing its ids) trains between
    the prefetch and the batch it was for."""
    plain, ahead = pair(device, 0, slots, gen)
    (a, ta), (b, tb) = batches(gen, 2)
    (c, tc), = batches(gen, 1, shape=(3, 6))
    c.view(-1)[:12] = b.view(-1)[:12]  # rows the prefetch loaded for b, rewritten by c's commit
    order = [(a, ta), (b, tb), (b, tb)] if then == "same ids again" else [(a, ta), (c, tc), (b, tb)]
    for i, (ids, target) in enumerate(order):
        train(plain, ids.to(device), target.to(device))
        loss = ((ahead(ids.to(device)) * target.to(device)).sum(-1) - 1).pow(2).sum()
        if i == 0:
            ahead.prefetch(b.to(device))
        loss.backward()
        ahead.step()
    assert_same(plain, ahead, device)
    if then == "same ids again":
        assert ahead.cache_stats()["prefetched_loads"] > 0
    else:
        assert ahead.cache_stats()["prefetched_loads"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [0, 12])
def test_prefetch_of_other_ids_changes_nothing(device, slots, gen):
    plain, ahead = pair(device, 0, slots, gen)
    data = batches(gen, 6)
    for i, (ids, target) in enumerate(data):
        train(plain, ids.to(device), target.to(device))
        ahead.prefetch((ids + 1) % ROWS)  # not what the forward asks for (a few may match)
        train(ahead, ids.to(device), target.to(device))
    assert ahead.cache_stats()["prefetched_rows"] > 0
    assert_same(plain, ahead, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [0, 12])
@pytest.mark.parametrize("rewrite", ["reset_parameters", "load_state_dict"])
def test_rewriting_the_table_drops_the_prefetch(device, slots, rewrite, gen):
    plain, ahead = pair(device, 0, slots, gen)
    (ids, target), (ids2, target2) = batches(gen, 2)
    for emb in (plain, ahead):
        train(emb, ids.to(device), target.to(device))
    ahead.prefetch(ids2)
    if rewrite == "reset_parameters":
        for emb in (plain, ahead):
            emb.reset_parameters(lambda w: w.fill_(0.25))
    else:
        fresh = {k: torch.randn_like(v) if k == "weight" else v
                 for k, v in plain.state_dict().items()}
        for emb in (plain, ahead):
            emb.load_state_dict(fresh)
    for emb in (plain, ahead):
        train(emb, ids2.to(device), target2.to(device))
    assert ahead.cache_stats()["prefetched_loads"] == 0
    assert_same(plain, ahead, device)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_checks_ids(device, gen):
    plain, ahead = pair(device, 0, 12, gen)
    (ids, target), = batches(gen, 1)
    bad = ids.clone()
    bad[1, 2] = ROWS
    with pytest.raises(RuntimeError, match=r"ids\[8\] = 40 is out of range"):
        ahead.prefetch(bad)
    with pytest.raises(TypeError, match="ids must be integers"):
        ahead.prefetch(torch.zeros(3))
    for emb in (plain, ahead):
        train(emb, ids.to(device), target.to(device))
    assert_same(plain, ahead, device)


def test_bag_prefetch(gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    plain, ahead = (so.HostEmbeddingBag.from_pretrained(init, freeze=False, mode="sum", device="cpu")
                    for _ in range(2))
    data = batches(gen, 5, shape=(7, 3))
    for i, (ids, target) in enumerate(data):
        for emb in (plain, ahead):
            out = emb(ids)
            if emb is ahead and i + 1 < len(data):
                emb.prefetch(data[i + 1][0])
            ((out * target[:, 0]).sum(-1) - 1).pow(2).sum().backward()
            emb.step()
    assert ahead.cache_stats()["prefetched_loads"] > 0
    assert_same(plain, ahead, "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [0, 12])
def test_prefetch_after_an_empty_step(device, slots, gen):
    """A step of no ids, prefetching the next: nothing to copy from it, nothing wrong."""
    plain, ahead = pair(device, 0, slots, gen)
    (ids, target), = batches(gen, 1)
    ids, target = ids.to(device), target.to(device)  # GPU ids match as the same tensor
    empty = torch.zeros((0, 6), dtype=torch.int64)
    for emb in (plain, ahead):
        out = emb(empty.to(device))
        if emb is ahead:
            emb.prefetch(ids)
        out.sum().backward()
        emb.step()
        train(emb, ids, target)
    assert ahead.cache_stats()["prefetched_loads"] > 0
    assert_same(plain, ahead, device)


cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run scripts/gpu_check.sh "
                                                    "there)")


@cuda_only
def test_gpu_ids_match_by_value(gen):
    """GPU ids are compared on the device: a copy of the next ids is as good as the tensor
    itself, and writing to the prefetched tensor afterwards changes nothing (the carry keeps
    the ids it loaded for)."""
    plain, ahead = pair("cuda", 0, 12, gen)
    data = batches(gen, 6, shape=(6, 6))
    for i, (ids, target) in enumerate(data):
        x = ids.int().cuda()
        for emb in (plain, ahead):
            out = emb(x)
            if emb is ahead and i + 1 < len(data):
                told = data[i + 1][0].cuda()  # another tensor (and dtype) than the forward's
                emb.prefetch(told)
                if i == 2:
                    told.random_(0, ROWS)  # after the prefetch: no effect
            ((out * target.cuda()).sum(-1) - 1).pow(2).sum().backward()
            emb.step()
    assert_same(plain, ahead, "cuda")
    assert ahead.cache_stats()["prefetched_loads"] > 0


def captured_pair(slots, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    embs = [so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.Adam, device="cuda",
                                             optimizer_kwargs={"lr": 0.05, "capturable": True},
                                             bounds_check=check)
            for check in ("raise", "prechecked")]
    if slots:
        embs[1].store = CachedRows(embs[1].host, torch.device("cuda"), slots, aging_steps=3)
    return embs


def target_of(ids: torch.Tensor) -> torch.Tensor:
    """A float64 target made from the ids on their device (a captured step takes ids only)."""
    return torch.sin(ids.double().unsqueeze(-1) * torch.arange(1, DIM + 1, device=ids.device))


@cuda_only
@pytest.mark.parametrize("slots", [0, 3, 12])
def test_captured_prefetch_trains_like_no_prefetch(slots, gen):
    """A step captured in a CUDA graph with the next step's ids as an input, prefetched between
    its forward and its step(): every replay takes what the previous one loaded. Now and then
    the ids it is told are not the next step's (wasted bytes only)."""
    plain, ahead = captured_pair(slots, gen)

    def step(ids, told):
        loss = ((ahead(ids) * target_of(ids)).sum(-1) - 1).pow(2).sum()
        ahead.prefetch(told)
        loss.backward()
        ahead.step()
        return loss.detach()

    data = [ids for ids, _ in batches(gen, 14)]
    captured = so.CapturedStep(step, rows=(ROWS, ROWS), warmup=2)
    for i, ids in enumerate(data):
        x = ids.cuda()
        train(plain, x, target_of(x))
        told = data[(i + 1) % len(data)]
        if i % 5 == 4:
            told = torch.randint(0, ROWS, ids.shape, generator=gen)
        captured(ids, told)
    assert captured.graph is not None
    assert_same(plain, ahead, "cuda")
    stats = ahead.cache_stats()
    assert 0 < stats["prefetched_loads"] <= stats["host_loads"]
    assert stats["lookups"] == plain.cache_stats()["lookups"]
    if slots:
        check_map(ahead.store)
    # The replays take and refill the carry without Python: a prefetch outside the graph would
    # race with them.
    with pytest.raises(RuntimeError, match="captured in a CUDA graph"):
        ahead.prefetch(data[0].cuda())


@cuda_only
def test_prefetch_between_steps_refused_inside_a_capture(gen):
    emb = so.HostEmbedding(ROWS, DIM, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device="cuda", cache_bytes=1 << 16, bounds_check="prechecked")
    ids = torch.randint(0, ROWS, (8,), generator=gen).cuda()
    emb.prefetch(ids)  # eager, between steps: fine
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match="between the step's forward and its step"):
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            emb.prefetch(ids)
    torch.cuda.synchronize()
