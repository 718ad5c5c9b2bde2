"""The CPU kernels run a pass on the calling thread when its work is under a threshold of bytes
(`_set_cpu_serial_bytes`, a test hook) and in one parallel region above it; `_distinct` and
`_sort_ids` sort by a serial radix sort up to it and by at::sort above. Both sides of the
threshold, forced with the hook and met at the default, must give what plain PyTorch gives:
the same rows, duplicates resolved the same way, bad ids refused with nothing written."""

import numpy as np
import pytest
import torch

import speedtorch_ops
from speedtorch_ops import ops

_ops = torch.ops.speedtorch_ops
SERIAL, PARALLEL = 1 << 62, 1  # thresholds that make every pass serial / parallel
DEFAULT = _ops._set_cpu_serial_bytes.default(0)  # 0 restores the default and returns it


@pytest.fixture(params=["serial", "parallel"])
def side(request):
    """Every pass serial, or every pass of more than one item parallel (on 2 threads at
    least, so that a parallel pass really splits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    previous = _ops._set_cpu_serial_bytes.default(
        SERIAL if request.param == "serial" else PARALLEL)
    yield request.param
    _ops._set_cpu_serial_bytes.default(previous)
    torch.set_num_threads(threads)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_hook_returns_the_previous_threshold_and_zero_restores_the_default():
    previous = _ops._set_cpu_serial_bytes.default(12345)
    try:
        assert previous == DEFAULT
        assert _ops._set_cpu_serial_bytes.default(0) == 12345
        assert _ops._set_cpu_serial_bytes.default(0) == DEFAULT
        with pytest.raises(RuntimeError, match="must be >= 0 bytes"):
            _ops._set_cpu_serial_bytes.default(-1)
    finally:
        _ops._set_cpu_serial_bytes.default(previous)


@pytest.mark.parametrize("n", [0, 1, 2, 33, 5_000, 70_000])
@pytest.mark.parametrize("bound", [1, 3, 2048, 4_000_003, 2**40, 2**62])
def test_sorts_match_torch_sort(side, n, bound):
    """The radix sort (serial side) and at::sort (parallel side) against torch.sort, stable,
    with many repeats, for keys of 0 to 62 significant bits."""
    g = gen(n * 31 + bound % 1009)
    distinct = max(1, min(bound, n // 4 + 1))
    keys = torch.randint(0, distinct, (n,), generator=g) * max(1, bound // distinct)
    keys = keys.clamp_(max=bound - 1)
    want_keys, want_perm = torch.sort(keys, stable=True)
    got_keys, got_perm = ops._sort_ids(keys, bound)
    assert torch.equal(got_keys, want_keys) and torch.equal(got_perm, want_perm)
    ids, inverse, count, *_ = ops._distinct(keys, bound)
    want, want_inverse = torch.unique(keys, sorted=True, return_inverse=True)
    c = want.numel()
    assert int(count) == c and torch.equal(ids[:c], want) and not ids[c:].any()
    assert torch.equal(inverse, want_inverse)


def test_sort_of_keys_out_of_the_contract(side):
    """Keys are trusted to lie in [0, bound); keys outside still come back sorted (negative
    ones through at::sort, large ones through enough radix passes)."""
    g = gen(5)
    keys = torch.randint(-50, 50, (3000,), generator=g)
    keys[::7] = 2**62 + 3
    want_keys, want_perm = torch.sort(keys, stable=True)
    got_keys, got_perm = ops._sort_ids(keys, 10)
    assert torch.equal(got_keys, want_keys) and torch.equal(got_perm, want_perm)


@pytest.mark.parametrize("n,rows,parts,width", [(1, 5, 3, 16), (257, 40, 3, 16),
                                                (6_000, 20_000, 3, 64), (6_000, 300, 1, 5)])
def test_sorted_transfer_both_ways(side, n, rows, parts, width):
    g = gen(n + rows)
    data = torch.randn(rows, parts, width, generator=g)
    table = data.clone()
    ids = torch.randint(0, rows, (n,), generator=g)
    sorted_ids, perm = torch.sort(ids, stable=True)
    bufs = [torch.full((n, width), float("nan")) for _ in range(parts)]
    ops._sorted_transfer(table, bufs, sorted_ids, perm, True, bounds_check="prechecked")
    for k in range(parts):
        assert torch.equal(bufs[k], data[ids, k])
    # Write-back from the owner slots (the first slot of each id): each row once.
    owner = perm[torch.searchsorted(sorted_ids, sorted_ids)]
    new = [torch.randn(n, width, generator=g) for _ in range(parts)]
    ops._sorted_transfer(table, new, sorted_ids, owner, False, bounds_check="prechecked")
    want = data.clone()
    uniq, first = np.unique(ids.numpy(), return_index=True)
    for k in range(parts):
        want[torch.from_numpy(uniq), k] = new[k][torch.from_numpy(first)]
    assert torch.equal(table, want)


@pytest.mark.parametrize("bad_at", [0, 4_999])
def test_sorted_transfer_bad_ids_write_nothing(side, bad_at):
    g = gen(bad_at)
    data = torch.randn(100, 2, 8, generator=g)
    table = data.clone()
    ids, perm = torch.sort(torch.randint(0, 100, (5_000,), generator=g), stable=True)
    ids[bad_at] = 100 if bad_at else -1
    bufs = [torch.randn(5_000, 8, generator=g) for _ in range(2)]
    before = [b.clone() for b in bufs]
    for load in (True, False):
        with pytest.raises(RuntimeError, match=rf"sorted_rows\[{bad_at}\] = "):
            ops._sorted_transfer(table, bufs, ids, perm, load, bounds_check="prechecked")
        assert torch.equal(table, data)
        assert all(torch.equal(b, o) for b, o in zip(bufs, before))


@pytest.mark.parametrize("n,row", [(1, (16,)), (3_000, (64,)), (20_000, (5,)), (700, (2, 300))])
def test_gather_and_scatter(side, n, row):
    """pinned_gather / pinned_scatter on CPU tensors: index_select, last-wins and summed
    duplicates (int64 rows, so sums are exact in any order)."""
    g = gen(n)
    rows = max(1, n // 3)
    data = torch.randint(-1000, 1000, (rows, *row), generator=g)
    for dtype in (torch.int64, torch.int32):
        index = torch.randint(0, rows, (n,), generator=g).to(dtype)
        assert torch.equal(speedtorch_ops.pinned_gather(data, index), data[index.long()])
        src = torch.randint(-1000, 1000, (n, *row), generator=g)
        table = data.clone()
        speedtorch_ops.pinned_scatter(table, index, src)
        want = data.clone()
        for i, r in enumerate(index.tolist()):  # the last duplicate wins
            want[r] = src[i]
        assert torch.equal(table, want)
        table = data.clone()
        speedtorch_ops.pinned_scatter(table, index, src, accumulate=True)
        assert torch.equal(table, data.index_add(0, index.long(), src))
    bad = torch.randint(0, rows, (n,), generator=g)
    bad[n // 2] = rows
    table = data.clone()
    with pytest.raises(RuntimeError, match=rf"index\[{n // 2}\] = {rows} is out of range"):
        speedtorch_ops.pinned_scatter(table, bad, torch.zeros(n, *row, dtype=data.dtype))
    assert torch.equal(table, data)


def test_optimizer_state_swap(side):
    g = gen(3)
    stores = [torch.randn(500, 16, generator=g) for _ in range(3)]
    want = [s.clone() for s in stores]
    batch = [torch.randn(4_000, 16, generator=g) for _ in range(3)]
    wb = torch.randint(0, 500, (4_000,), generator=g)
    load = torch.randint(0, 500, (4_000,), generator=g)
    written = [b.clone() for b in batch]
    speedtorch_ops.optimizer_state_swap(stores, batch, wb, load)
    for s, w, src, b in zip(stores, want, written, batch):
        for i, r in enumerate(wb.tolist()):
            w[r] = src[i]
        assert torch.equal(s, w)
        assert torch.equal(b, w[load])


@pytest.mark.parametrize("take", [True, False])
def test_row_moves(side, take):
    g = gen(int(take))
    slots, n = 3_000, 2_500
    src_rows = torch.randn(2, slots if take else n, 64, generator=g)
    dst = torch.randn(2, n if take else slots, 64, generator=g)
    index = torch.randperm(slots, generator=g)[:n]
    index[::5] = -1  # moves nothing
    count = torch.tensor([2_000])
    want = dst.clone()
    for i in range(2_000):
        j = int(index[i])
        if j >= 0:
            if take:
                want[:, i] = src_rows[:, j]
            else:
                want[:, j] = src_rows[:, i]
    (ops._take_rows if take else ops._put_rows)(dst, src_rows, index, count)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("bytes_vs_threshold", [-1, 0, 1])
def test_default_threshold_edges(bytes_vs_threshold):
    """At the default threshold: a pass just under it, at it and past it (the transfer's rows:
    row bytes x count) moves the same rows as indexing, on 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        row_bytes = 3 * 64 * 4
        n = DEFAULT // row_bytes + bytes_vs_threshold
        g = gen(n)
        data = torch.randn(4 * n, 3, 64, generator=g)
        ids, perm = torch.sort(torch.randint(0, 4 * n, (n,), generator=g), stable=True)
        bufs = [torch.empty(n, 64) for _ in range(3)]
        ops._sorted_transfer(data, bufs, ids, perm, True, bounds_check="prechecked")
        for k in range(3):
            assert torch.equal(bufs[k][perm], data[ids, k])
        keys = torch.randint(0, 4 * n, (DEFAULT // 16 + bytes_vs_threshold,), generator=g)
        got, order = ops._sort_ids(keys, 4 * n)
        want, want_order = torch.sort(keys, stable=True)
        assert torch.equal(got, want) and torch.equal(order, want_order)
    finally:
        torch.set_num_threads(threads)
