"""The row stores on their own: a load gives table[ids] for every part, a write-back writes each
distinct row once from its owner (first) slot, plans belong to their store, bad ids raise
before anything is written, and a prefetch never hands a load a row older than the host's.
Against plain PyTorch indexing, float64, fresh random data; colocated rows with and (on a GPU)
without a row cache."""

import pytest
import torch

from speedtorch_ops.training import ColocatedRows, Plan, SeparateTables
from speedtorch_ops.training.host_rows import Stat
from conftest import HAS_CUDA

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# (store kind, device): a row cache only in front of a GPU.
KINDS = [(kind, d) for kind in ("separate", "colocated") for d in DEVICES] + (
    [("cached", "cuda")] if HAS_CUDA else [])


def host(shape, gen):
    t = torch.randn(shape, dtype=torch.float64, generator=gen)
    if HAS_CUDA:
        t = t.pin_memory()
    return t


def make(kind, parts, gen, device, rows=20, dim=3):
    """(store, its tables as separate (rows, dim) tensors, for checks)."""
    if kind == "separate":
        tables = [host((rows, dim), gen) for _ in range(parts)]
        return SeparateTables(tables, device), tables
    table = host((rows, parts, dim), gen)
    slots = 2 if kind == "cached" else 0  # fewer than a batch's rows: evictions every step
    return ColocatedRows(table, device, slots), [table[:, k] for k in range(parts)]


def owner_rule(ids, new, old):
    """The expected table after writing `new` (one row per slot) to `ids`: each distinct id takes
    the value of its first slot."""
    want = old.clone()
    seen = set()
    for slot, i in enumerate(ids.tolist()):
        if i not in seen:
            want[i] = new[slot]
            seen.add(i)
    return want


@pytest.mark.parametrize("kind,device", KINDS)
@pytest.mark.parametrize("parts", [1, 3])
def test_load_then_write_back_follows_the_owner_rule(device, kind, parts, gen):
    store, tables = make(kind, parts, gen, torch.device(device))
    ids = torch.randint(0, 20, (15,), generator=gen)  # duplicates
    before = [t.clone() for t in tables]
    plan = store.plan_for(ids.numpy())
    rows = store.load(plan)
    mine = rows if kind == "separate" else rows[:parts]
    for r, t in zip(mine, before):
        assert r.device.type == device and torch.equal(r.cpu(), t[ids])
    new = [torch.randn(r.shape, dtype=r.dtype, generator=gen) for r in mine]
    for r, n in zip(mine, new):
        r.copy_(n)  # what an optimizer step does: in place
    store.write_back(plan, mine)
    store.settle()
    for t, n, b in zip(tables, new, before):
        assert torch.equal(t, owner_rule(ids, n, b))


@pytest.mark.parametrize("kind", ["separate", "colocated"])
def test_plans_belong_to_their_store(kind, gen):
    a, _ = make(kind, 2, gen, torch.device("cpu"))
    b, _ = make(kind, 2, gen, torch.device("cpu"))
    ids = torch.randint(0, 20, (7,), generator=gen).numpy()
    plan = a.plan_for(ids)
    a.load(plan)
    assert a.plan_for(ids.copy()) is plan          # the same step's ids: the same plan
    assert b.plan_for(ids) is not plan             # another store makes its own
    other = (ids + 1) % 20
    assert a.plan_for(other) is not plan


@pytest.mark.parametrize("kind,device", KINDS)
def test_bad_ids_raise_and_write_nothing(device, kind, gen):
    store, tables = make(kind, 2, gen, torch.device(device))
    before = [t.clone() for t in tables]
    for bad in (20, -1):
        ids = torch.tensor([1, 2, bad, 3])
        with pytest.raises(RuntimeError, match=r"ids\[2\] = .* out of range .* 20 rows"):
            store.load(Plan(ids, device))
    good = store.plan_for(torch.tensor([4, 5]))
    rows = store.load(good)
    # Separate tables check the ids; colocated rows refuse any batch but the one they loaded.
    with pytest.raises((RuntimeError, ValueError), match="out of range|not the batch loaded"):
        store.write_back(Plan(torch.tensor([4, 25]), device), rows)
    store.settle()
    for t, b in zip(tables, before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("kind,device", [k for k in KINDS if k[0] != "separate"])
@pytest.mark.parametrize("early", [False, True])
def test_prefetched_rows_are_never_older_than_the_host(device, kind, early, gen):
    """A prefetch of the next batch, issued while the current one (sharing rows with it) is
    loaded (or, `early`, before it is loaded), then the current batch updated and written back:
    the next load holds every row as written back, and the rows only the next batch has
    come from the prefetch (uncached: counted by the store)."""
    store, tables = make(kind, 2, gen, torch.device(device))
    first = torch.tensor([3, 4, 5, 3, 4])  # another length: no row of the carry fits it
    second = torch.tensor([5, 6, 3, 7])
    p1, p2 = store.plan_for(first), store.plan_for(second)
    if early:
        store.prefetch(p2)
    rows = store.load(p1)
    if not early:
        store.prefetch(p2)
    for r in rows:
        r.add_(torch.randn(r.shape, dtype=r.dtype, generator=gen).to(r.device))
    store.write_back(p1, rows)
    rows2 = store.load(p2)             # rows 5 and 3: the first batch's updates
    store.settle()
    for k, t in enumerate(tables):
        assert torch.equal(rows2[k].cpu(), t[second])
    taken = int(store.rows.counters()[Stat.PREFETCHED_LOADS])
    if kind == "colocated":  # every stage empties the carry: an early prefetch is lost
        assert taken == (0 if early else 2)


@pytest.mark.parametrize("kind,device", [k for k in KINDS if k[0] != "separate"])
def test_a_colocated_load_gives_its_plan_the_owner_slots(device, kind, gen):
    """The owners a load hands its plan (from the stage's sort) are the plan's own: each
    slot's row's first slot; a bad owner is refused."""
    store, _ = make(kind, 2, gen, torch.device(device))
    ids = torch.randint(0, 20, (40,), generator=gen)  # duplicates
    plan = store.plan_for(ids)
    store.load(plan)
    assert torch.equal(plan.owner.cpu(), Plan(ids, device).owner.cpu())
    with pytest.raises(ValueError, match="owner: one slot per id"):
        plan.adopt_owner(torch.zeros(3, dtype=torch.int64))
