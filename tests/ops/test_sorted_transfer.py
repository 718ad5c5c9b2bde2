"""_sorted_transfer (private, for the factories): a batch's rows moved by ids sorted once by the
caller, each table row split into parts (a weight and its state side by side). Checked against
plain indexing on fresh random ids with many repeats."""

import numpy as np
import pytest
import torch

from speedtorch_ops import ops
from conftest import STORES, index_device, place, random_index, random_rows


def _sorted(ids: torch.Tensor):
    return torch.sort(ids, stable=True)


def _first_slot_of_each(sorted_ids: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """For each sorted position, the first (smallest) slot holding the same id (plain Python)."""
    s, p = sorted_ids.cpu().tolist(), perm.cpu().tolist()
    first: dict = {}
    for row, slot in zip(s, p):
        first[row] = min(first.get(row, slot), slot)
    return torch.tensor([first[r] for r in s], dtype=torch.int64)


def _parts(n, table, dev, gen):
    return [random_rows((n, *table.shape[2:]), table.dtype, gen).to(dev)
            for _ in range(table.shape[1])]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype,row,n,rows", [
    (torch.float32, (3, 128), 300, 80), (torch.bfloat16, (1, 5), 300, 80),
    (torch.int64, (2, 2, 3), 300, 80), (torch.bool, (4, 7), 300, 80),
    (torch.float32, (3, 128), 40_000, 5_000)])  # 40 k: more than one wave of the kernels
def test_load_equals_indexing(store, dtype, row, n, rows, gen):
    data = random_rows((rows, *row), dtype, gen)
    table = place(data, store)
    ids = random_index(n, rows, torch.int64, store, gen)
    parts = _parts(n, table, index_device(store), gen)
    ops._sorted_transfer(table, parts, *_sorted(ids), load=True)
    for k, part in enumerate(parts):
        assert torch.equal(part.cpu(), data[ids.cpu(), k]), gen.initial_seed()
    assert torch.equal(table.cpu(), data)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("n,rows,width", [(300, 80, 3), (40_000, 5_000, 3), (500, 60, 1),
                                          (200, 50, 9)])
def test_writeback_writes_each_row_from_its_owner_slot(store, n, rows, width, gen):
    data = random_rows((rows, width, 6), torch.float32, gen)
    table = place(data, store)
    ids = random_index(n, rows, torch.int64, store, gen)
    sorted_ids, perm = _sorted(ids)
    owners = _first_slot_of_each(sorted_ids, perm).to(ids.device)
    parts = _parts(n, table, ids.device, gen)
    ops._sorted_transfer(table, parts, sorted_ids, owners, load=False)
    ref = data.clone()
    uniq, first = np.unique(ids.cpu().numpy(), return_index=True)  # first occurrence = owner
    for k, part in enumerate(parts):
        ref[torch.from_numpy(uniq), k] = part.cpu()[torch.from_numpy(first)]
    assert torch.equal(table.cpu(), ref), gen.initial_seed()


@pytest.mark.parametrize("store", STORES)
def test_bad_input_names_the_argument_and_writes_nothing(store, gen):
    dev = index_device(store)
    data = random_rows((20, 2, 4), torch.float32, gen)
    table = place(data, store)
    sorted_ids, perm = _sorted(random_index(10, 20, torch.int64, store, gen))
    parts = _parts(10, table, dev, gen)
    before = [p.clone() for p in parts]
    bad_rows = sorted_ids.clone()
    bad_rows[-1] = 20
    bad_slots = perm.clone()
    bad_slots[3] = 10
    for args, message in (((parts, bad_rows, perm), r"sorted_rows\[9\] = 20"),
                          ((parts, sorted_ids, bad_slots), r"slots\[3\] = 10"),
                          ((parts, sorted_ids, perm[:9]), "slots has 9 entries"),
                          ((parts[:1], sorted_ids, perm), r"shape \(rows, len\(parts\), ...\)"),
                          (([parts[0][:9], parts[1]], sorted_ids, perm),
                           r"parts\[1\] must have shape \[9, 4\]"),
                          (([parts[0], parts[1].double()], sorted_ids, perm),
                           r"parts\[1\] must have the table's dtype"),
                          (([], sorted_ids, perm), "parts must hold at least one tensor"),
                          (([parts[0], parts[0]], sorted_ids, perm),
                           r"parts\[1\] and parts\[0\] share memory")):
        for load in (True, False):
            with pytest.raises(RuntimeError, match=message):
                ops._sorted_transfer(table, *args, load=load, bounds_check="raise")
            assert torch.equal(table.cpu(), data)
            assert all(torch.equal(p, b) for p, b in zip(parts, before))


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("count", [0, 1, 37, 60, 75])
def test_count_limits_the_positions_that_take_part(store, count, gen):
    """With count c, positions j < min(c, n) move and the rest neither move nor are validated
    (they hold out-of-range rows and slots here); parts may have more rows than the index."""
    dev = index_device(store)
    data = random_rows((50, 2, 4), torch.float32, gen)
    table = place(data, store)
    n, m = 60, 90  # 60 positions, parts of 90 rows
    sorted_ids, _ = _sorted(random_index(n, 50, torch.int64, store, gen))
    slots = torch.randperm(m, generator=gen)[:n].to(dev)
    used = min(count, n)
    rows = sorted_ids.clone()
    rows[used:] = 10**9  # garbage past the count
    pos = slots.clone()
    pos[used:] = -5
    limit = torch.tensor([count], dtype=torch.int64, device=dev)
    parts = _parts(m, table, dev, gen)
    before = [p.clone() for p in parts]
    ops._sorted_transfer(table, parts, rows, pos, True, limit)
    for k, (part, old) in enumerate(zip(parts, before)):
        want = old.cpu().clone()
        want[slots[:used].cpu()] = data[sorted_ids[:used].cpu(), k]
        assert torch.equal(part.cpu(), want), gen.initial_seed()
    # Write-back of the same positions: the last slot of each run of equal rows wins.
    new = _parts(m, table, dev, gen)
    ops._sorted_transfer(table, new, rows, pos, False, limit)
    ref = data.clone()
    for j in range(used):
        ref[int(sorted_ids[j]), :] = torch.stack([p[int(slots[j])].cpu() for p in new])
    assert torch.equal(table.cpu(), ref), gen.initial_seed()
    with pytest.raises(RuntimeError, match="count must be one int64"):
        ops._sorted_transfer(table, parts, rows, pos, True, limit.int())


def test_unsorted_rows_refused_on_the_cpu(gen):
    table = random_rows((20, 1, 4), torch.float32, gen)
    data = table.clone()
    rows = torch.tensor([3, 1, 2])
    with pytest.raises(RuntimeError, match=r"sorted_rows must be ascending.*sorted_rows\[0\] = 3"):
        ops._sorted_transfer(table, [random_rows((3, 4), torch.float32, gen)], rows,
                             torch.arange(3), load=False)
    assert torch.equal(table, data)


def test_pageable_table_refused_with_a_gpu_batch(gen):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    table = random_rows((20, 1, 4), torch.float32, gen)
    rows, slots = _sorted(torch.randint(0, 20, (5,), generator=gen).cuda())
    with pytest.raises(RuntimeError, match="table is in pageable host memory"):
        ops._sorted_transfer(table, [torch.empty(5, 4, device="cuda")], rows, slots, load=True)
