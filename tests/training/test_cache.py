"""The row cache's logic (CachedRows), on whatever device is here: a module whose store is a
small cache trains exactly like one without (float64), the map and the slots agree after every
step, the counts add up, and a flush makes the host table complete. On the CPU the cache is of
no use for speed, but its decisions are the same tensor operations as on the GPU."""

import pytest
import torch

import speedtorch_ops as so
from speedtorch_ops import ops
from speedtorch_ops.training.cache import CachedRows
from speedtorch_ops.training.host_rows import HostRows
from conftest import HAS_CUDA

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# (device, overlap): on a GPU the cache's transfers run on its lane (a side stream) or in order
# on the current stream; on the CPU there is no lane.
LANES = [("cpu", True)] + ([("cuda", True), ("cuda", False)] if HAS_CUDA else [])
OPTIMIZERS = [(torch.optim.Adam, {"lr": 0.05}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              (torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.RMSprop, {"lr": 0.01}),
              (so.RowWiseAdagrad, {"lr": 0.1})]  # its accumulator packed beside the weight


def check_map(store: CachedRows) -> None:
    ids = store.id_of.cpu()
    slot_of = store.slot_of[:-1].cpu()
    held = (ids >= 0).nonzero().view(-1)
    assert torch.equal(slot_of[ids[held]].long(), held)          # each slot's row maps back
    assert int((slot_of >= 0).sum()) == held.numel()              # and nothing else is mapped
    assert len(set(ids[held].tolist())) == held.numel()           # a row in one slot at most
    # The rows the last commit kept (not admitted) are marked -2 - their place, and only they.
    kept = store._deferred
    marked = {r: -2 - int(slot_of[r]) for r in (slot_of <= -2).nonzero().view(-1).tolist()}
    want = {} if kept is None else {int(r): j for j, r in enumerate(
        kept.rows[:int(kept.count)].tolist())}
    assert marked == want
    assert int(store.slot_of[-1]) == -1  # the spare entry names nothing


@pytest.mark.parametrize("device,overlap", LANES)
@pytest.mark.parametrize("opt", range(len(OPTIMIZERS)))
@pytest.mark.parametrize("slots", [3, 12, 30])
@pytest.mark.parametrize("admission", ["frequency", "always"])
@pytest.mark.parametrize("sample", [None, 1])  # 1: victims from a window of 2k slots
@pytest.mark.parametrize("defer", [None, False])  # None: misses not admitted kept a step
def test_small_caches_train_like_no_cache(device, overlap, opt, slots, admission, sample, defer,
                                          gen):
    cls, kwargs = OPTIMIZERS[opt]
    init = torch.randn(40, 5, dtype=torch.float64, generator=gen)
    plain = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                             device=device)
    cached = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                              device=device)
    cached.store = CachedRows(cached.host, torch.device(device), slots, aging_steps=3,
                              overlap=overlap, admission=admission, defer=defer)
    if sample is not None:
        cached.store.victim_sample = sample
    discarded = {"host_loads": 0, "evictions": 0}
    tol = 0 if device == "cpu" else 1e-12  # GPU gradient sums of repeated ids use atomics
    for step in range(10):
        ids = torch.randint(0, 40, (4, 6), generator=gen)
        hot = torch.randint(0, 6, (4, 6), generator=gen)
        ids = torch.where(torch.rand((4, 6), generator=gen) < 0.6, hot, ids)  # skewed, repeated
        target = torch.randn(4, 6, 5, dtype=torch.float64, generator=gen)
        for emb in (plain, cached):
            ((emb(ids.to(device)) * target.to(device)).sum(-1) - 1).pow(2).sum().backward()
            emb.step()
        check_map(cached.store)
        if step % 3 == 1:  # a read-only forward evicts at stage too, then is discarded
            unseen = torch.randint(0, 40, (9,), generator=gen)
            before = cached.cache_stats()
            with torch.no_grad():
                out, ref = cached(unseen.to(device)), plain(unseen.to(device))
                assert torch.allclose(out, ref, rtol=tol, atol=tol)
            after = cached.cache_stats()
            for key in discarded:  # its loads are dropped; its victims were written, stay cached
                discarded[key] += after[key] - before[key]
            check_map(cached.store)
    stats = cached.cache_stats()
    assert stats["hits"] > 0 and stats["hits"] + stats["host_loads"] == stats["lookups"]
    if admission == "always" and slots >= 24:  # a step's misses always fit in its unused slots
        assert stats["direct_writebacks"] == 0
    # Every row a training step loaded is cached or went back.
    assert stats["host_loads"] - discarded["host_loads"] == (
        stats["evictions"] - discarded["evictions"] + stats["direct_writebacks"]
        + int((cached.store.id_of >= 0).sum()))
    for key, value in plain.state_dict().items():
        assert torch.allclose(cached.state_dict()[key], value, rtol=tol, atol=tol), key


@pytest.mark.skipif(not HAS_CUDA, reason="the race is between the GPU's write-backs and the CPU")
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("before", ["read-only forward", "forward without step", "step"])
def test_reset_parameters_waits_for_queued_write_backs(cached, overlap, before):
    """A forward evicts at stage and a step writes back at commit, both queued on the GPU;
    reset_parameters then rewrites the host table on the CPU. A GPU kept busy makes the queued
    writes land late: none of them may land over the new values."""
    if not cached and not overlap:
        pytest.skip("no cache: no lane")
    emb = so.HostEmbedding(4096, 64, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device="cuda", bounds_check="prechecked")
    if cached:
        emb.store = CachedRows(emb.host, torch.device("cuda"), 256, overlap=overlap)
    emb(torch.arange(256, device="cuda")).sum().backward()  # fills the cache
    emb.step()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the GPU is busy for a while: what follows is queued
    ids = torch.arange(1024, 1280, device="cuda")  # all misses: 256 victims
    if before == "read-only forward":
        with torch.no_grad():
            emb(ids)
    elif before == "forward without step":
        emb(ids).sum()
    else:
        emb(ids).sum().backward()
        emb.step()
    emb.reset_parameters(lambda w: w.fill_(7.0))
    torch.cuda.synchronize()
    assert bool((emb.weight == 7).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("admission", ["frequency", "always"])
def test_admission_rules(device, admission):
    """One slot holding a row used in two steps; a step then misses a row used once: the
    frequency rule keeps the hot row (the miss goes straight back), "always" evicts it."""
    emb = so.HostEmbedding(10, 4, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device=device)
    emb.store = CachedRows(emb.host, torch.device(device), 1, admission=admission)
    for ids in ([0, 0, 0], [0], [5]):  # frequencies count steps: row 0 ends at 2
        emb(torch.tensor(ids, device=device)).sum().backward()
        emb.step()
    stats = emb.cache_stats()
    kept = admission == "frequency"
    assert int(emb.store.id_of[0]) == (0 if kept else 5)
    assert (stats["direct_writebacks"], stats["evictions"]) == ((1, 0) if kept else (0, 1))
    with pytest.raises(ValueError, match="admission"):
        emb.store.admission = "lru"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("between", ["nothing", "prefetch", "read-only forward", "flush",
                                     "not deferring"])
def test_kept_misses(device, between, gen):
    """A miss the frequency rule does not admit stays on the device after its commit: the next
    stage writes it back and takes it from there when it uses the row again (no host load), a
    prefetch leaves it alone (the host's copy is stale until then), a read-only forward between
    reads the kept values, and a flush writes it out; all train exactly like a module without a
    cache (float64, Adam, whose state moves with the row)."""
    dev = torch.device(device)
    init = torch.randn(10, 4, dtype=torch.float64, generator=gen)
    plain, cached = (so.HostEmbedding.from_pretrained(
        init, freeze=False, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1},
        device=device) for _ in range(2))
    cached.store = CachedRows(cached.host, dev, 1)
    assert cached.store.defer  # a cache smaller than its table keeps its refused misses

    def step(ids):
        for emb in (plain, cached):
            emb(torch.tensor(ids, device=device)).pow(2).sum().backward()
            if emb is cached and between == "prefetch":
                emb.prefetch(torch.tensor([5, 6], device=device))
            emb.step()

    for ids in ([0, 0, 0], [0], [7, 8, 9], [0, 0], [5]):  # row 0 holds the slot; 5 is kept
        step(ids)
        check_map(cached.store)
    assert int(cached.store.id_of[0]) == 0
    assert cached.cache_stats()["direct_writebacks"] == 4  # 7, 8 and 9 (used once each), 5
    marks = (cached.store.slot_of <= -2).nonzero().view(-1).tolist()
    assert marks == [5] and int(cached.store.slot_of[5]) == -2  # kept, first place
    if between == "prefetch":  # between steps too: the carry must not take 5 from the host
        cached.prefetch(torch.tensor([5, 6], device=device))
    elif between == "read-only forward":
        with torch.no_grad():
            assert torch.equal(cached(torch.tensor([5, 6], device=device)),
                               plain(torch.tensor([5, 6], device=device)))
    elif between == "not deferring":  # those kept are written back by the next stage
        cached.store.defer = False
    elif between == "flush":
        cached.flush()
        host = cached.layout.of_table(cached.host, "weight")  # the host's copy, as it is
        assert torch.equal(host[5].cpu(), plain.weight.detach()[5].cpu())
    step([5, 6])  # 5 comes from the kept rows, or the host after a flush
    stats = cached.cache_stats()
    if between == "prefetch":  # 5 and 6 four times, 6 (5 staged), 6 (5 kept), none (staged)
        assert stats["prefetched_rows"] == 10
    # The read-only forward took 5 from the kept rows too (and wrote them back, unchanged).
    assert stats["deferred_loads"] == {"flush": 0, "read-only forward": 2}.get(between, 1)
    if between == "not deferring":  # 5 and 6 refused, written back by the commit: none kept
        assert cached.store._deferred is None
        for ids in ([5], [5], [1]):  # 5 takes the slot, then 1: its map entry must stay
            step(ids)
            check_map(cached.store)
    assert stats["host_bytes"] == cached.row_bytes * (
        stats["host_loads"] - stats["prefetched_loads"]
        + stats["prefetched_rows"] + stats["evictions"] + stats["direct_writebacks"])
    for key, value in plain.state_dict().items():  # state_dict flushes the kept rows
        assert torch.equal(cached.state_dict()[key], value), key
    check_map(cached.store)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kept_before", [True, False])
def test_kept_misses_after_a_capture(device, kept_before, gen):
    """Once a step is captured, the kept buffer keeps its size (the graph's stages write back
    and take from it): a larger step's refused misses go back at its commit, and a store whose
    capture found no kept buffer never keeps any. Training stays exact (the capture is marked
    by hand here, so the rule runs on the CPU too)."""
    init = torch.randn(20, 4, dtype=torch.float64, generator=gen)
    plain, cached = (so.HostEmbedding.from_pretrained(
        init, freeze=False, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1},
        device=device) for _ in range(2))
    cached.store = CachedRows(cached.host, torch.device(device), 1, defer=kept_before)

    def step(ids):
        for emb in (plain, cached):
            emb(torch.tensor(ids, device=device)).pow(2).sum().backward()
            emb.step()
        check_map(cached.store)

    for ids in ([0, 0], [0], [5, 6]):
        step(ids)
    assert (cached.store._deferred is not None) == kept_before
    cached.store._graphed = True  # as a capture of this store's step would
    cached.store.defer = True
    size = cached.store._deferred.rows.numel() if kept_before else 0
    for ids in ([7, 8, 9, 10], [5, 6], [7, 8, 9, 10], [11]):  # wider than the buffer, then not
        step(ids)
        kept = cached.store._deferred
        assert (kept is None) if not kept_before else kept.rows.numel() == size
        refused = 0 if kept is None else int(kept.count)
        assert refused == (len(ids) if kept_before and len(ids) <= size else 0)
    for key, value in plain.state_dict().items():
        assert torch.equal(cached.state_dict()[key], value), key


@pytest.mark.skipif(not HAS_CUDA, reason="the race is between the lane and the current stream")
def test_kept_rows_win_over_a_late_write_back(gen):
    """A kept row staged again in the very next step: the stage loads it from the host while
    the lane's write-back of the kept copy may not have landed (here it is held back on
    purpose), so the stage must take it from the kept rows. Exact against no cache."""
    init = torch.randn(10, 4, dtype=torch.float64, generator=gen)
    plain, cached = (so.HostEmbedding.from_pretrained(
        init, freeze=False, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1},
        device="cuda") for _ in range(2))
    store = CachedRows(cached.host, torch.device("cuda"), 1)
    cached.store = store
    real = store._move

    def late(parts, rows, slots, count, load, sms=0):
        if not load and torch.cuda.current_stream() == store._lanes:
            torch.cuda._sleep(100_000_000)  # the lane's write-backs land late
        real(parts, rows, slots, count, load, sms)

    store._move = late
    for ids in ([0, 0, 0], [0], [5, 6], [5, 6], [5, 6, 0]):  # 5, 6 kept, then staged again
        for emb in (plain, cached):
            emb(torch.tensor(ids, device="cuda")).pow(2).sum().backward()
            emb.step()
    assert cached.cache_stats()["deferred_loads"] >= 2
    for key, value in plain.state_dict().items():
        assert torch.equal(cached.state_dict()[key], value), key


@pytest.mark.parametrize("name", ["lane_sms", "write_sms"])
@pytest.mark.parametrize("bad", [-1, 2.0, True, None])
def test_sm_caps_are_checked(name, bad):
    host = torch.zeros(10, 1, 4)
    with pytest.raises(ValueError, match=name):
        CachedRows(host, torch.device("cpu"), 2, **{name: bad})
    store = CachedRows(host, torch.device("cpu"), 2)
    with pytest.raises(ValueError, match=name):
        setattr(store, name, bad)
    assert getattr(store, name) == {"lane_sms": 8, "write_sms": 6}[name]  # unchanged
    store = HostRows(host, torch.device("cpu"))
    other = "ahead_sms" if name == "lane_sms" else name
    with pytest.raises(ValueError, match=other):
        setattr(store, other, bad)
    setattr(store, other, 0)  # no cap of its own
    assert getattr(store, other) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_sm_caps_reach_the_transfers(device, monkeypatch):
    """Each transfer of a cached step and of an uncached one carries its cap: loads lane_sms,
    write-backs write_sms on a GPU with the lane; no cap without one (the CPU) or for a cache
    that runs in order (overlap off); an uncached store's prefetch ahead_sms and commit
    write_sms."""
    calls = []
    real = ops._sorted_transfer

    def record(table, parts, rows, slots, load, count=None, **kw):
        calls.append((load, kw["sms"]))
        return real(table, parts, rows, slots, load, count, **kw)

    monkeypatch.setattr(ops, "_sorted_transfer", record)
    dev = torch.device(device)
    lane = device == "cuda"
    for overlap in (True, False):
        emb = so.HostEmbedding(40, 4, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                               device=device)
        emb.store = CachedRows(emb.host, dev, 3, overlap=overlap, lane_sms=5, write_sms=3)
        calls.clear()
        for ids in ([0, 1, 2, 3], [4, 5, 6, 7]):  # misses and evictions
            emb(torch.tensor(ids, device=device)).sum().backward()
            emb.prefetch(torch.tensor([9, 10], device=device))
            emb.step()
        capped = lane and overlap
        assert {c for c in calls if c[0]} == {(True, 5 if capped else 0)}
        assert {c for c in calls if not c[0]} == {(False, 3 if capped else 0)}
    emb = so.HostEmbedding(40, 4, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device=device)
    emb.store.ahead_sms, emb.store.write_sms = 7, 2
    calls.clear()
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    emb.prefetch(torch.tensor([3], device=device))
    emb.step()
    if lane:  # stage, prefetch, commit
        assert sorted(set(calls)) == [(False, 2), (True, 0), (True, 7)]
    else:  # prefetch only: the CPU's lookup reads the table, its step updates it in place
        assert sorted(set(calls)) == [(True, 7)]


def test_phases_are_labelled_for_the_profiler(gen):
    """A profile of a step shows the stores' phases under the library's own labels (the
    benchmarks read them instead of patching methods); nothing is recorded without one."""
    from torch.profiler import ProfilerActivity, profile
    emb = so.HostEmbedding(20, 4, optimizer=torch.optim.Adam, device="cpu")
    ids = torch.randint(0, 20, (9,), generator=gen)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        emb(ids).sum().backward()
        emb.prefetch(ids)
        emb.step()
    names = {e.name for e in prof.events()}
    for phase in ("HostRows.stage", "HostRows.commit", "HostRows.prefetch", "Distinct.__init__"):
        assert f"speedtorch_ops.{phase}" in names, phase
