"""Prefetch (``HostEmbedding.prefetch``): loading the next step's rows ahead never changes what
training computes. A module that prefetches, with no cache or a small one that evicts every
step, trains exactly like one that does not (float64), with the next batch sharing hot ids with
the current one (the rows the current step's commit rewrites), prefetches of other ids mixed in
(dropped), prefetches issued during a step or between steps, and a host table rewritten after a
prefetch. On the CPU the transfer is synchronous; on the GPU it runs on a side stream, and ids
may come on the GPU (the same tensors at prefetch and forward)."""

import pytest
import torch

import speedtorch_ops as so
from speedtorch_ops.training.cache import CachedRows, HostRows
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
    plain, ahead = (so.HostEmbedding.from_pretrained(init, optimizer=cls, optimizer_kwargs=kwargs,
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
    assert stats["hits"] + stats["host_loads"] + stats["reused_rows"] == stats["lookups"]
    assert stats["lookups"] == plain.cache_stats()["lookups"]
    # The next batch shares hot ids with this one: the rows a cache of 0 or 3 slots cannot keep
    # (there are 6 hot ids) are copied from this step's buffer, not loaded again (12 slots may
    # keep them all: the CI once saw no reuse there).
    if when == "during" and slots <= 3:
        assert stats["reused_rows"] > 0
    if when == "between":
        assert stats["reused_rows"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [0, 12])
def test_prefetch_of_other_ids_is_dropped(device, slots, gen):
    plain, ahead = pair(device, 0, slots, gen)
    data = batches(gen, 6)
    for i, (ids, target) in enumerate(data):
        train(plain, ids.to(device), target.to(device))
        ahead.prefetch((ids + 1) % ROWS)  # never what the forward asks for
        train(ahead, ids.to(device), target.to(device))
    assert ahead.cache_stats()["prefetched_loads"] == 0
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
    plain, ahead = (so.HostEmbeddingBag.from_pretrained(init, mode="sum", device="cpu")
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


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run scripts/gpu_check.sh there)")
def test_prefetch_refused_inside_a_capture(gen):
    emb = so.HostEmbedding(ROWS, DIM, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device="cuda", cache_bytes=1 << 16, bounds_check="prechecked")
    ids = torch.randint(0, ROWS, (8,), generator=gen).cuda()
    emb.prefetch(ids)  # eager: fine
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match="prefetch cannot run inside a CUDA graph capture"):
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            emb.prefetch(ids)
    torch.cuda.synchronize()


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


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run scripts/gpu_check.sh there)")
def test_gpu_ids_match_only_the_same_tensors(gen):
    """GPU ids match a prefetch only as the same tensor objects, unmodified: a new tensor at a
    freed one's address or an in-place write do not (int32 ids, which the plan
    copies, included)."""
    plain, ahead = pair("cuda", 0, 12, gen)
    data = batches(gen, 5, shape=(6, 6))
    for i, (ids, target) in enumerate(data):
        x = ids.int().cuda()
        for emb in (plain, ahead):
            out = emb(x)
            if emb is ahead and i + 1 < len(data):
                nxt = data[i + 1][0].int().cuda()
                emb.prefetch(nxt)
                if i == 0:
                    del nxt  # freed: the next batch is a new tensor, maybe at its address
                elif i == 1:
                    nxt.add_(0)  # written to in place: its version moves on
            ((out * target.cuda()).sum(-1) - 1).pow(2).sum().backward()
            emb.step()
    assert_same(plain, ahead, "cuda")
    assert ahead.cache_stats()["prefetched_loads"] == 0
    x = data[0][0].cuda()
    ahead.prefetch(x)
    train(ahead, x, data[0][1].cuda())  # the same tensor: used
    assert ahead.cache_stats()["prefetched_loads"] > 0


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run scripts/gpu_check.sh there)")
def test_no_prefetch_for_a_captured_table(gen):
    emb = so.HostEmbedding(ROWS, DIM, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device="cuda", cache_bytes=1 << 16, bounds_check="prechecked")
    ids = torch.randint(0, ROWS, (8,), generator=gen)

    def step(x):
        loss = emb(x).sum()
        loss.backward()
        emb.step()
        return loss.detach()

    captured = so.CapturedStep(step, rows=(ROWS,))
    for _ in range(5):
        captured(ids)
    assert captured.graph is not None
    with pytest.raises(RuntimeError, match="captured in a CUDA graph"):
        emb.prefetch(ids)
