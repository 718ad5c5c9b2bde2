"""The row cache's device ops (_sort_ids, _distinct, _partition, _cache_lookup,
_coldest_slots, _admission, _cache_admit, _age_frequencies, _take_rows, _put_rows) against plain PyTorch/NumPy references on fresh random data, on the CPU and
(on the GPU machine) on CUDA; their errors; opcheck."""

import numpy as np
import pytest
import torch
from torch import Tensor

from speedtorch_ops import ops

from conftest import HAS_CUDA

DEVICES = ["cpu", "cuda"]


def device_of(name: str) -> torch.device:
    if name == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    return torch.device(name)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


SIZES = [0, 1, 2, 7, 1000, 50_000]
BOUNDS = [1, 5, 1000, 4_000_003, 2**40]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bound", BOUNDS)
def test_sort_ids_is_a_stable_sort(device, n, bound):
    dev = device_of(device)
    keys = torch.randint(0, bound, (n,), generator=gen(n + bound % 97), dtype=torch.int64)
    sorted_keys, perm = ops._sort_ids(keys.to(dev), bound)
    want_keys, want_perm = torch.sort(keys, stable=True)
    assert torch.equal(sorted_keys.cpu(), want_keys)
    assert torch.equal(perm.cpu(), want_perm)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_cpu_sorts_at_every_thread_count(threads):
    """Past the serial size the CPU sorts by radix with one or two threads, by at::sort with
    more: the same stable order either way, and the same distinct ids."""
    keys = torch.randint(0, 4_000_003, (200_000,), generator=gen(threads), dtype=torch.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sorted_keys, perm = ops._sort_ids(keys, 4_000_003)
        ids, inverse, count, *_ = ops._distinct(keys, 4_000_003)
    finally:
        torch.set_num_threads(before)
    want_keys, want_perm = torch.sort(keys, stable=True)
    assert torch.equal(sorted_keys, want_keys) and torch.equal(perm, want_perm)
    unique, unique_inverse = torch.unique(keys, return_inverse=True)
    assert int(count) == unique.numel() and torch.equal(ids[:int(count)], unique)
    assert torch.equal(inverse, unique_inverse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bound", BOUNDS)
def test_distinct_matches_unique(device, n, bound):
    dev = device_of(device)
    # About n / 3 distinct values (duplicates), spread over the whole range below bound.
    distinct = max(1, min(bound, n // 3))
    index = torch.randint(0, distinct, (n,), generator=gen(7 * n + 1), dtype=torch.int64)
    index *= max(1, bound // distinct)
    ids, inverse, count, *_ = ops._distinct(index.to(dev), bound)
    want, want_inverse = torch.unique(index, sorted=True, return_inverse=True)
    c = want.numel()
    assert count.shape == (1,) and int(count) == c
    assert torch.equal(ids.cpu()[:c], want)
    assert not ids.cpu()[c:].any()
    assert torch.equal(inverse.cpu(), want_inverse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_partition_puts_the_flagged_first(device, n, share):
    dev = device_of(device)
    flags = torch.rand(n, generator=gen(n)) < share
    order, count = ops._partition(flags.to(dev))
    f = flags.numpy()
    want = np.concatenate([np.flatnonzero(f), np.flatnonzero(~f)[::-1]])
    assert int(count) == f.sum()
    assert np.array_equal(order.cpu().numpy(), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,count", [(0, 0), (1, 1), (50, 0), (50, 31), (50, 80), (4000, 4000)])
def test_cache_lookup(device, n, count):
    dev = device_of(device)
    rows, slots = 10_000, 600
    g = gen(n * 13 + count)
    ids = torch.randperm(rows, generator=g)[:n]
    ids[count:] = 0  # padding, as _distinct leaves it
    slot_of = torch.full((rows + 1,), -1, dtype=torch.int32)
    cached = torch.randperm(rows, generator=g)[:slots]
    slot_of[cached] = torch.randperm(slots, generator=g).int()
    freq = torch.rand(rows + 1, generator=g) * 10
    count_t = torch.tensor([count])
    freq_dev = freq.clone().to(dev)
    at, miss = ops._cache_lookup(ids.to(dev), count_t.to(dev), slot_of.to(dev), freq_dev, slots)
    want_at = np.full(n, slots)
    want_miss = np.zeros(n, dtype=bool)
    want_freq = freq.double().numpy().copy()
    for i in range(min(count, n)):
        s = int(slot_of[ids[i]])
        want_at[i] = s if s >= 0 else slots
        want_miss[i] = s < 0
        want_freq[ids[i]] += 1
    assert np.array_equal(at.cpu().numpy(), want_at)
    assert np.array_equal(miss.cpu().numpy(), want_miss)
    assert np.allclose(freq_dev.cpu().double().numpy(), want_freq, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots,n,k", [(0, 0, 0), (1, 3, 1), (50, 20, 0), (50, 20, 50),
                                       (70_000, 9000, 9000), (70_000, 0, 300)])
def test_coldest_slots(device, slots, n, k):
    dev = device_of(device)
    rows = 100_000
    g = gen(slots + n + k)
    id_of = torch.randperm(rows, generator=g)[:slots]
    id_of[torch.rand(slots, generator=g) < 0.2] = -1  # empty slots
    freq = torch.randint(0, 30, (rows,), generator=g).float()  # many ties
    at = torch.randint(0, slots + 1, (n,), generator=g)  # slots + 1: the scratch slot
    victims, cold = ops._coldest_slots(id_of.to(dev), freq.to(dev), at.to(dev), k)
    prio = np.where(id_of.numpy() >= 0, freq.numpy()[id_of.clamp(min=0).numpy()], -1.0)
    used = at.numpy()[at.numpy() < slots]
    prio[used] = np.inf
    want = np.argsort(prio, kind="stable")[:k]
    assert np.array_equal(victims.cpu().numpy(), want)
    assert np.array_equal(cold.cpu().numpy(), prio[want].astype(np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots,n,k,window,hand", [(50, 20, 10, 10, 0), (50, 20, 10, 30, 45),
                                                   (70_000, 9000, 9000, 20_000, 65_000),
                                                   (1000, 0, 5, 1000, 999)])
def test_coldest_slots_in_a_window(device, slots, n, k, window, hand):
    """Only the window's slots from the hand on (cyclically) are candidates; the hand moves on
    by the window, twice in a row."""
    dev = device_of(device)
    rows = 100_000
    g = gen(slots + n + k + window + hand)
    id_of = torch.randperm(rows, generator=g)[:slots]
    id_of[torch.rand(slots, generator=g) < 0.2] = -1
    freq = torch.randint(0, 30, (rows,), generator=g).float()
    at = torch.randint(0, slots + 1, (n,), generator=g)
    h = torch.tensor([hand], device=dev)
    prio = np.where(id_of.numpy() >= 0, freq.numpy()[id_of.clamp(min=0).numpy()], -1.0)
    prio[at.numpy()[at.numpy() < slots]] = np.inf
    start = hand
    for _ in range(2):
        victims, cold = ops._coldest_slots(id_of.to(dev), freq.to(dev), at.to(dev), k, h, window)
        candidates = (start + np.arange(window)) % slots
        want = candidates[np.argsort(prio[candidates], kind="stable")[:k]]
        assert np.array_equal(victims.cpu().numpy(), want)
        assert np.array_equal(cold.cpu().numpy(), prio[want].astype(np.float32))
        start = (start + window) % slots
        assert int(h) == start
    with pytest.raises(RuntimeError, match="window must be in"):
        ops._coldest_slots(id_of.to(dev), freq.to(dev), at.to(dev), k, h, k - 1 if k else -1)
    if k:
        with pytest.raises(RuntimeError, match="hand is required"):
            ops._coldest_slots(id_of.to(dev), freq.to(dev), at.to(dev), k, None, window)


def _pieces(grad: Tensor, count: int, shifted: bool, g) -> list:
    """`grad` as `count` contiguous pieces of random sizes (some empty); `shifted`: each in
    memory one element past an aligned start (the kernels' one-element path)."""
    n = grad.shape[0]
    cuts = sorted(torch.randint(0, n + 1, (count - 1,), generator=g).tolist())
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    pieces = list(grad.split(sizes))
    if shifted:
        pieces = [torch.cat([p.new_zeros(1), p.reshape(-1)])[1:].view(p.shape) for p in pieces]
    return [p.contiguous() for p in pieces]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,distinct,dim", [(0, 1, 4), (1, 1, 3), (37, 5, 1), (5000, 700, 33),
                                            (40_000, 50, 128)])
@pytest.mark.parametrize("pieces,shifted", [(1, False), (3, False), (70, False), (3, True)])
def test_segment_sum_sums_each_rows_positions(device, dtype, n, distinct, dim, pieces, shifted):
    """_distinct's perm and starts, and _segment_sum over them, against index_add_ in float64:
    hot rows span many chunks of the CUDA kernel (a fifth of the positions on one row); the
    gradient in several pieces read in place (more than a kernel argument holds: joined), and
    pieces one element off alignment (the kernels' narrow loads)."""
    dev = device_of(device)
    g = gen(n * 7 + distinct + dim + pieces)
    index = torch.randint(0, distinct, (n,), generator=g)
    index[torch.rand(n, generator=g) < 0.2] = 0  # one hot row
    index *= 3  # ids with gaps
    ids, inverse, count, perm, starts = ops._distinct(index.to(dev), 3 * distinct + 1)
    c = int(count)
    want_ids = torch.unique(index)
    assert torch.equal(ids.cpu()[:c], want_ids)
    assert perm.shape == (n,) and starts.shape == (n + 1,)
    assert torch.equal(index[perm.cpu()], torch.sort(index, stable=True).values)
    assert torch.equal(perm.cpu(), torch.sort(index, stable=True).indices)
    assert (starts.cpu()[c:] == n).all()
    grad = torch.randn(n, dim, generator=g, dtype=torch.float64)
    rows = n + 2
    parts = _pieces(grad.to(dtype).to(dev), pieces, shifted, g)
    out = ops._segment_sum(parts, perm, starts, count, rows)
    want = torch.zeros(rows, dim, dtype=torch.float64).index_add_(
        0, inverse.cpu(), grad.to(dtype).double())
    tol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 2e-2,
           torch.float16: 5e-3}[dtype]
    scale = want.abs().amax(1, keepdim=True).clamp(min=1)
    assert out.shape == (rows, dim) and out.dtype == dtype
    assert torch.allclose(out.double().cpu() / scale, want / scale, rtol=tol, atol=tol)
    # zero_tail=False: the same rows below the count (the rest left unwritten)
    live = ops._segment_sum(parts, perm, starts, count, rows, zero_tail=False)
    assert live.shape == (rows, dim)
    assert torch.equal(live[:c].cpu(), out[:c].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,dim,width", [(0, 4, 4), (1, 3, 3), (300, 128, 128), (257, 16, 21),
                                         (1000, 33, 40)])
@pytest.mark.parametrize("cached,shifted", [(False, False), (True, False), (True, True)])
def test_gather_staged_reads_cached_rows_in_their_slots(device, dtype, n, dim, width, cached,
                                                      shifted):
    """_gather_staged against indexing in plain PyTorch: rows (n, dim) strided `width` apart,
    positions with repeats; with a cache, the rows whose `at` names a slot come from that slot
    (the staged row, NaN then, is never read); `shifted`: every tensor one element off a
    16-byte start (the kernel's narrow loads)."""
    dev = device_of(device)
    g = gen(n * 11 + dim + width + cached + shifted)

    def make(shape):  # a (rows, width) tensor, maybe one element past an aligned start
        flat = torch.randn(shape[0] * shape[1] + shifted, generator=g).to(dtype).to(dev)
        return flat[shifted:].view(shape)  # shifted where it lives: a copy would realign it

    table = make((n, width))
    rows = table[:, :dim]
    index = torch.randint(0, max(n, 1), (3 * n,), generator=g)
    if not cached:
        out = ops._gather_staged(rows, index.to(dev))
        assert out.shape == (3 * n, dim) and out.is_contiguous()
        assert torch.equal(out.cpu(), rows.cpu()[index])
        return
    slots = max(n // 2, 1)
    cache_table = make((slots, width))
    at = torch.full((n,), slots + 3, dtype=torch.int64)  # past the cache: the staged row
    hit = torch.rand(n, generator=g) < 0.5
    chosen = torch.randperm(slots, generator=g)[:int(hit.sum())]
    hit_rows = hit.nonzero().view(-1)[:chosen.numel()]
    at[hit_rows] = chosen
    at[(torch.rand(n, generator=g) < 0.1) & ~hit] = -1  # no slot either
    want = rows.cpu()[index].clone()
    from_cache = at[index]
    in_cache = (from_cache >= 0) & (from_cache < slots)
    want[in_cache] = cache_table.cpu()[:, :dim][from_cache[in_cache]]
    staged = make((n, width))[:, :dim]
    staged.copy_(rows)
    staged[at.to(dev).lt(slots) & at.to(dev).ge(0)] = float("nan")  # never read
    out = ops._gather_staged(staged, index.to(dev), cache_table[:, :dim], at.to(dev))
    assert out.shape == (3 * n, dim) and out.dtype == dtype
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_staged_names_bad_arguments(device):
    dev = device_of(device)
    rows, index = torch.zeros(4, 3, device=dev), torch.tensor([0, 3], device=dev)
    cache, at = torch.zeros(2, 3, device=dev), torch.tensor([0, 5, -1, 1], device=dev)
    for args, message in [((rows.int(), index), "rows must be float"),
                          ((rows.t(), index), "each row's elements contiguous"),
                          ((rows, index.int()), "index"),
                          ((rows, index, cache, None), "cache and at go together"),
                          ((rows, index, cache[:, :2], at), r"cache must be \(slots, 3\)"),
                          ((rows, index, cache.double(), at), "cache must be Float like rows"),
                          ((rows, index, cache, at[:3]), "at must have an entry a row")]:
        with pytest.raises(RuntimeError, match=message):
            ops._gather_staged(*args)
    if dev.type == "cpu":  # a GPU trusts its indices (a step's inverse)
        with pytest.raises(RuntimeError, match=r"index must hold rows of rows"):
            ops._gather_staged(rows, torch.tensor([4]))


@pytest.mark.parametrize("device", DEVICES)
def test_segment_sum_names_bad_arguments(device):
    dev = device_of(device)
    grad = torch.zeros(4, 3, device=dev)
    perm, starts = torch.arange(4, device=dev), torch.tensor([0, 4, 4, 4, 4], device=dev)
    count = torch.ones(1, dtype=torch.int64, device=dev)
    for args, message in [(([grad.int()], perm, starts, count, 4), "grads must be float"),
                          (([], perm, starts, count, 4), "grads must hold at least one"),
                          (([grad[:2], grad[2:, :2].contiguous()], perm, starts, count, 4),
                           r"grads\[1\] must have grads\[0\]'s 3 columns"),
                          (([grad[:2], grad[2:].double()], perm, starts, count, 4),
                           r"grads\[1\] must be"),
                          (([grad.t()], perm, starts, count, 4), r"grads\[0\] must be a contiguous"),
                          (([grad], perm[:3], starts, count, 4), "perm must have one entry"),
                          (([grad[:2], grad[2:3]], perm, starts, count, 4),
                           "perm must have one entry"),
                          (([grad], perm, starts[:0], count, 4), "starts must hold"),
                          (([grad], perm, starts, count.view(()).expand(2), 4), "count"),
                          (([grad], perm, starts, count, -1), "rows must be")]:
        with pytest.raises(RuntimeError, match=message):
            ops._segment_sum(*args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,misses", [(0, 0, 0), (5, 5, 5), (400, 100, 37), (5000, 3000, 4000)])
@pytest.mark.parametrize("by_frequency", [True, False])
def test_admission(device, n, k, misses, by_frequency):
    dev = device_of(device)
    rows, slots = 20_000, 6000
    g = gen(n + k + misses + by_frequency)
    ids = torch.randperm(rows, generator=g)[:n]
    first = torch.randperm(n, generator=g)[:k]
    victims = torch.randperm(slots, generator=g)[:k]
    freq = torch.randint(0, 20, (rows + 1,), generator=g).float()  # ties included
    cold = torch.randint(-1, 20, (k,), generator=g).float()
    cold[torch.rand(k, generator=g) < 0.2] = float("inf")  # slots this step uses
    id_of = torch.randint(-1, rows, (slots,), generator=g)
    admit, keys, evicted = ops._admission(
        ids.to(dev), first.to(dev), victims.to(dev), cold.to(dev),
        torch.tensor([misses], device=dev), freq.to(dev), id_of.to(dev), by_frequency)
    want_admit = np.zeros(k, dtype=bool)
    want_keys = np.full(k, rows + 1)
    for j in range(k):
        miss = int(ids[first[j]])
        ok = j < misses and np.isfinite(float(cold[j]))
        if ok and by_frequency:
            ok = float(freq[miss]) > float(cold[j])  # a tie keeps the cached row
        want_admit[j] = ok
        if ok and int(id_of[victims[j]]) >= 0:
            want_keys[j] = int(id_of[victims[j]])
    assert np.array_equal(admit.cpu().numpy(), want_admit)
    assert np.array_equal(keys.cpu().numpy(), want_keys)
    assert int(evicted) == int((want_keys < rows + 1).sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k", [(0, 0), (5, 5), (400, 100), (5000, 5000)])
def test_cache_admit(device, n, k):
    dev = device_of(device)
    rows, slots = 20_000, 8000
    g = gen(n + 3 * k)
    held = torch.randperm(rows, generator=g)[:slots]
    id_of = torch.cat([held, torch.tensor([-1])])  # the scratch slot holds nothing
    id_of[:slots][torch.rand(slots, generator=g) < 0.3] = -1
    slot_of = torch.full((rows + 1,), -1, dtype=torch.int32)
    live = id_of[:slots] >= 0
    slot_of[id_of[:slots][live]] = torch.arange(slots, dtype=torch.int32)[live]
    uncached = torch.nonzero(slot_of[:rows] < 0).flatten()
    ids = uncached[torch.randperm(uncached.numel(), generator=g)[:n]]  # the misses
    at = torch.full((n,), slots)
    first = torch.randperm(n, generator=g)[:k]
    victims = torch.randperm(slots, generator=g)[:k]
    admit = torch.rand(k, generator=g) < 0.7
    want_slot_of, want_id_of, want_dest = slot_of.clone(), id_of.clone(), at.clone()
    for j in range(k):
        if admit[j]:
            v, row = int(victims[j]), int(ids[first[j]])
            if want_id_of[v] >= 0:
                want_slot_of[want_id_of[v]] = -1
            want_slot_of[row] = v
            want_id_of[v] = row
            want_dest[first[j]] = v
    s, i = slot_of.to(dev), id_of.to(dev)
    dest = ops._cache_admit(s, i, ids.to(dev), at.to(dev), first.to(dev), victims.to(dev),
                            admit.to(dev))
    assert torch.equal(dest.cpu(), want_dest)
    assert torch.equal(s.cpu(), want_slot_of)
    assert torch.equal(i.cpu(), want_id_of)


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_entries_touch_nothing(device):
    """The ops trust their values, but one out of range is skipped, not written through."""
    dev = device_of(device)
    rows, slots = 10, 4
    slot_of = torch.tensor([-1, 0, -1, 2, -1, -1, -1, 1, -1, -1, -1], dtype=torch.int32)
    id_of = torch.tensor([1, 7, 3, -1, -1])  # slots 0-3 and the scratch slot
    freq = torch.rand(rows + 1, generator=gen(1))
    ids = torch.tensor([2, rows + 5, -3, 7])
    f = freq.clone().to(dev)
    at, miss = ops._cache_lookup(ids.to(dev), torch.tensor([4], device=dev), slot_of.to(dev), f,
                                 slots)
    assert at.tolist() == [slots, slots, slots, 1] and miss.tolist() == [True, False, False, False]
    want = freq.clone()
    want[2] += 1
    want[7] += 1
    assert torch.equal(f.cpu(), want)
    s, i = slot_of.clone().to(dev), id_of.clone().to(dev)
    dest = ops._cache_admit(s, i, ids.to(dev), at, torch.tensor([0, 1, 9], device=dev),
                            torch.tensor([99, 3, 2], device=dev),
                            torch.tensor([True, True, True], device=dev))
    # Entry 0: victim 99 is no slot; entry 1: ids[1] is no row; entry 2: position 9 is past ids.
    assert torch.equal(dest.cpu(), at.cpu())
    assert torch.equal(s.cpu(), slot_of) and torch.equal(i.cpu(), id_of)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("period", [1, 3, 256, 300_000])
def test_age_frequencies_halves_every_period(device, period):
    dev = device_of(device)
    freq = torch.rand(300_000, generator=gen(period)) * 100  # more than the kernel's grid
    want = freq.double().clone()
    f, age = freq.to(dev), torch.tensor([5], device=dev)
    steps = range(6, 6 + 2 * period + 3) if period < 1000 else [6, 7, period, period + 1]
    for step in steps:
        if step != int(age) + 1:  # jump ahead: the count only decides when to halve
            age.fill_(step - 1)
        ops._age_frequencies(f, age, period)
        if step % period == 0:
            want *= 0.5
        assert int(age) == step
    assert torch.allclose(f.cpu().double(), want, rtol=1e-6, atol=0)


# (row shape, dtype): 512-byte rows (16-byte pieces), 24 (8-byte), 20 (4-byte), 6 (2-byte),
# 7 (bytes), and rows of two dims.
ROWS = [((128,), torch.float32), ((3,), torch.float64), ((5,), torch.float32),
        ((3,), torch.float16), ((7,), torch.int8), ((2, 8), torch.float64)]


def random_rows(shape, dtype, g):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=torch.int64).to(dtype)


def move_case(parts, n, slots, row, dtype, count, seed):
    """(slots tensor, positions tensor, index, count) on the CPU: a cache of `slots` rows plus a
    scratch slot and `n` positions; index names each slot at most once, with -1, the scratch
    slot and numbers past it among them."""
    g = gen(seed)
    cache = random_rows((parts, slots + 1, *row), dtype, g)
    rows = random_rows((parts, n, *row), dtype, g)
    index = torch.randperm(slots, generator=g)[:n]
    index = torch.cat([index, torch.zeros(n - index.numel(), dtype=torch.int64)])
    odd = torch.rand(n, generator=g)
    index[odd < 0.15] = -1
    index[(odd >= 0.15) & (odd < 0.3)] = slots  # the scratch slot: past the view of the slots
    index[(odd >= 0.3) & (odd < 0.35)] = slots + 7
    return cache, rows, index, torch.tensor([count])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("take", [True, False], ids=["take", "put"])
def test_row_moves_at_odd_addresses(device, take):
    """Tensors one element off 16-byte alignment (a view past a table's first element), with
    repeated take entries: the kernels move narrower pieces and every row still lands."""
    dev = device_of(device)
    g = gen(11 + take)
    slots, n, d = 300, 2000, 8  # 32-byte rows, but the views start 4 bytes in
    base_slots = torch.randn(2 * slots * d + 1, generator=g)
    base_rows = torch.randn(2 * n * d + 1, generator=g)
    cache = base_slots[1:].view(2, slots, d)
    rows = base_rows[1:].view(2, n, d)
    index = torch.randint(-1, slots, (n,), generator=g)  # repeats, and -1
    if not take:  # put: distinct entries
        index = torch.randperm(slots, generator=g)[: n // 10]
        index = torch.cat([index, torch.full((n - index.numel(),), -1)])
    want_cache, want_rows = cache.clone(), rows.clone()
    for i in range(n):
        if index[i] >= 0:
            if take:
                want_rows[:, i] = cache[:, index[i]]
            else:
                want_cache[:, index[i]] = rows[:, i]
    got_slots, got_rows = base_slots.to(dev), base_rows.to(dev)
    c, r = got_slots[1:].view(2, slots, d), got_rows[1:].view(2, n, d)
    count = torch.tensor([n], device=dev)
    if take:
        ops._take_rows(r, c, index.to(dev), count)
    else:
        ops._put_rows(c, r, index.to(dev), count)
    assert torch.equal(c.cpu(), want_cache) and torch.equal(r.cpu(), want_rows)
    assert got_slots[0].item() == base_slots[0].item()  # nothing before the views


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row,dtype", ROWS)
@pytest.mark.parametrize("parts,n,count", [(3, 1000, 1000), (1, 1000, 617), (2, 50, 80),
                                           (3, 50, 0), (3, 50, -3), (3, 0, 0), (1, 7, 7),
                                           (2, 20_000, 20_000)])  # more warps than the grid
@pytest.mark.parametrize("take", [True, False], ids=["take", "put"])
def test_row_moves_match_indexing(device, row, dtype, parts, n, count, take):
    """_take_rows / _put_rows against a loop of plain indexing; the slots given as a view of a
    cache without its scratch slot, which must stay untouched."""
    dev = device_of(device)
    slots = 2 * n + 3
    cache, rows, index, c = move_case(parts, n, slots, row, dtype, count,
                                      n + parts + count + take)
    want_cache, want_rows = cache.clone(), rows.clone()
    for i in range(min(n, count)):
        if 0 <= index[i] < slots:
            if take:
                want_rows[:, i] = cache[:, index[i]]
            else:
                want_cache[:, index[i]] = rows[:, i]
    got_cache, got_rows = cache.to(dev), rows.to(dev)
    if take:
        ops._take_rows(got_rows, got_cache[:, :slots], index.to(dev), c.to(dev))
    else:
        ops._put_rows(got_cache[:, :slots], got_rows, index.to(dev), c.to(dev))
    assert torch.equal(got_rows.cpu(), want_rows)
    assert torch.equal(got_cache.cpu(), want_cache)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("take", [True, False], ids=["take", "put"])
def test_row_moves_of_each_rows_first_elements(device, take):
    """Views of each row's first elements (a record's weight, say): rows a whole row apart,
    the elements past the view untouched in both tensors."""
    dev = device_of(device)
    g = gen(23 + take)
    slots, n, width, k = 40, 30, 12, 5
    cache = torch.randn(1, slots, width, generator=g)
    rows = torch.randn(1, n, width, generator=g)
    if take:
        index = torch.randint(-1, slots, (n,), generator=g)  # repeats, and -1
    else:  # put: distinct entries
        index = torch.cat([torch.randperm(slots, generator=g)[: n // 2],
                           torch.full((n - n // 2,), -1)])
    want_cache, want_rows = cache.clone(), rows.clone()
    for i in range(n):
        if index[i] >= 0:
            if take:
                want_rows[:, i, :k] = cache[:, index[i], :k]
            else:
                want_cache[:, index[i], :k] = rows[:, i, :k]
    c, r = cache.to(dev), rows.to(dev)
    count = torch.tensor([n], device=dev)
    if take:
        ops._take_rows(r[..., :k], c[..., :k], index.to(dev), count)
    else:
        ops._put_rows(c[..., :k], r[..., :k], index.to(dev), count)
    assert torch.equal(c.cpu(), want_cache) and torch.equal(r.cpu(), want_rows)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_are_named(device):
    dev = device_of(device)
    i64 = torch.zeros(4, dtype=torch.int64, device=dev)
    i32 = torch.zeros(4, dtype=torch.int32, device=dev)
    freq = torch.zeros(5, device=dev)
    slot_of = torch.full((5,), -1, dtype=torch.int32, device=dev)
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    rows = torch.zeros(1, 3, 8, device=dev)
    rows32 = torch.ones(1, 3, 8, device=dev)
    three = torch.tensor([3], device=dev)  # so that a missed check would write rows
    idx = torch.tensor([2, 0, 1], device=dev)
    shared = torch.tensor([1] * 21 + [2, 0, 1], device=dev)  # rows that also serve as ids
    longs = torch.full((1, 3, 8), 7, device=dev)
    cases = [
        (lambda: ops._sort_ids(i32, 10), "keys must be Long"),
        (lambda: ops._sort_ids(i64.view(2, 2), 10), "keys must be 1-D"),
        (lambda: ops._sort_ids(i64, 0), "bound must be at least 1"),
        (lambda: ops._distinct(i32, 10), "index must be Long"),
        (lambda: ops._partition(i64), "flags must be Bool"),
        (lambda: ops._cache_lookup(i32, one, slot_of, freq, 3), "ids must be Long"),
        (lambda: ops._cache_lookup(i64, i64, slot_of, freq, 3), "count must be one int64"),
        (lambda: ops._cache_lookup(i64, one, slot_of.long(), freq, 3), "slot_of must be Int"),
        (lambda: ops._cache_lookup(i64, one, slot_of, freq.double(), 3), "freq must be Float"),
        (lambda: ops._cache_lookup(i64, one, slot_of, freq[:4], 3), "freq must have slot_of's"),
        (lambda: ops._cache_lookup(i64, one, slot_of, freq, -1), "scratch must be"),
        (lambda: ops._coldest_slots(i32, freq, i64, 2), "id_of must be Long"),
        (lambda: ops._coldest_slots(i64, freq, i64, 5), "k must be in"),
        (lambda: ops._cache_admit(slot_of, i64, i64, i64, i64, i64, i64), "admit must be Bool"),
        (lambda: ops._cache_admit(slot_of, i64, i64, i64, i64, i64[:3], i64 == 0),
         "first, victims and admit must have one length"),
        (lambda: ops._cache_admit(slot_of, i64, i64, i64[:2], i64[:3], i64[:3], i64[:3] == 0),
         "first must not be longer than at"),
        (lambda: ops._admission(i64, i64, i64, freq[:4], i64, freq, i64, True),
         "misses must be one int64"),
        (lambda: ops._admission(i64, i64, i64[:3], freq[:4], one, freq, i64, True),
         "first, victims and cold must have one length"),
        (lambda: ops._coldest_slots(i64, freq.cpu() if dev.type == "cuda" else freq.double(),
                                    i64, 2), "freq must be"),
        (lambda: ops._take_rows(rows, rows32.double(), idx, three), "src must have out's dtype"),
        (lambda: ops._take_rows(rows, rows32.expand(2, 3, 8).contiguous(), idx, three),
         "src must have out's parts"),
        (lambda: ops._put_rows(rows, rows32[:, :, :4].contiguous(), idx, three),
         "src must have dst's parts and row shape"),
        (lambda: ops._take_rows(rows[0, 0], rows32[0, 0], idx, three), "out must have at least 2"),
        (lambda: ops._take_rows(rows, rows32, torch.cat([idx, idx[:1]]), three),
         "index must have at most out's 3"),
        (lambda: ops._put_rows(rows, rows32, torch.cat([idx, idx[:1]]), three),
         "index must have at most src's 3"),
        (lambda: ops._take_rows(rows, rows32, idx.int(), three), "index must be Long"),
        (lambda: ops._take_rows(rows, rows32, idx, i64), "count must be one int64"),
        (lambda: ops._take_rows(rows.transpose(1, 2), rows32.transpose(1, 2), idx, three),
         "out must have each row contiguous"),
        (lambda: ops._take_rows(rows.as_strided((1, 3, 8), (24, 4, 1)), rows32, idx, three),
         "out must not have overlapping rows"),
        (lambda: ops._take_rows(rows.expand(3, 3, 8), rows32.expand(3, 3, 8), idx, three),
         "out must not have overlapping parts"),
        (lambda: ops._take_rows(rows[:, :2], rows[:, 1:], idx[:2], three), "out and src"),
        (lambda: ops._put_rows(shared[:24].view(1, 3, 8), longs, shared[21:24], three),
         "dst and index"),
        (lambda: ops._take_rows(shared[:24].view(1, 3, 8), longs, idx, shared[23:24]),
         "out and count"),
        (lambda: ops._age_frequencies(freq, i64, 3), "age must be one int64"),
        (lambda: ops._age_frequencies(freq, one, 0), "period must be at least 1"),
    ]
    if dev.type == "cuda":
        cases.append((lambda: ops._cache_lookup(i64, one.cpu(), slot_of, freq, 3),
                      "count must be on ids's device"))
    for call, message in cases:
        before = [t.clone() for t in (freq, slot_of, i64, one, rows, shared)]
        with pytest.raises(RuntimeError, match=message):
            call()
        for t, b in zip((freq, slot_of, i64, one, rows, shared), before):
            assert torch.equal(t, b)  # nothing written


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    dev = device_of(device)
    ids = torch.tensor([9, 2, 2, 7, 0], device=dev)
    freq = torch.rand(11, device=dev)
    slot_of = torch.tensor([-1, 0, -1, 2, -1, -1, -1, 1, -1, -1, -1], dtype=torch.int32,
                           device=dev)
    cases = [
        (torch.ops.speedtorch_ops._sort_ids.default, (ids, 10)),
        (torch.ops.speedtorch_ops._distinct.default, (ids, 10)),
        (torch.ops.speedtorch_ops._partition.default, (ids > 3,)),
        (torch.ops.speedtorch_ops._cache_lookup.default,
         (torch.tensor([0, 3, 7, 0], device=dev), torch.tensor([3], device=dev), slot_of, freq,
          3)),
        (torch.ops.speedtorch_ops._coldest_slots.default,
         (torch.tensor([3, -1, 0, 7], device=dev), freq, torch.tensor([2, 4], device=dev), 3)),
        (torch.ops.speedtorch_ops._admission.default,
         (torch.tensor([5, 4, 0], device=dev), torch.tensor([1, 0], device=dev),
          torch.tensor([2, 1], device=dev), torch.tensor([0.5, float("inf")], device=dev),
          torch.tensor([2], device=dev), freq, torch.tensor([1, 7, -1], device=dev), True)),
        (torch.ops.speedtorch_ops._cache_admit.default,
         (slot_of.clone(), torch.tensor([1, 7, 3, -1], device=dev), torch.tensor([5, 4, 0],
          device=dev), torch.tensor([3, 3, 2], device=dev), torch.tensor([1, 0], device=dev),
          torch.tensor([2, 1], device=dev), torch.tensor([True, False], device=dev))),
        (torch.ops.speedtorch_ops._age_frequencies.default,
         (freq, torch.tensor([2], device=dev), 3)),
        (torch.ops.speedtorch_ops._take_rows.default,
         (torch.zeros(2, 4, 3, device=dev), torch.rand(2, 5, 3, device=dev),
          torch.tensor([4, -1, 0, 9], device=dev), torch.tensor([3], device=dev))),
        (torch.ops.speedtorch_ops._put_rows.default,
         (torch.zeros(2, 5, 3, device=dev), torch.rand(2, 4, 3, device=dev),
          torch.tensor([4, -1, 0, 9], device=dev), torch.tensor([4], device=dev))),
    ]
    _, _, count, perm, starts = ops._distinct(ids, 10)
    grads = [torch.rand(2, 3, device=dev), torch.rand(3, 3, device=dev)]
    cases.append((torch.ops.speedtorch_ops._segment_sum.default,
                  (grads, perm, starts, count, 6)))
    cases.append((torch.ops.speedtorch_ops._gather_staged.default,
                  (torch.rand(4, 5, device=dev)[:, :3], torch.tensor([3, 0, 3], device=dev),
                   torch.rand(2, 3, device=dev), torch.tensor([1, 5, -1, 0], device=dev))))
    cases.append((torch.ops.speedtorch_ops._round_into.default,
                  (torch.empty(3, 5, dtype=torch.bfloat16, device=dev),
                   torch.rand(3, 5, device=dev), torch.tensor([4, 2], device=dev))))
    rounding = torch.tensor([4, 2], device=dev)
    # PartialRowWiseAdam's records of bfloat16 weight and first moment (7 each), then its
    # float32 second moment.
    records = torch.zeros(4, 32, dtype=torch.uint8, device=dev)
    records[:, :28].view(torch.bfloat16).copy_(torch.rand(4, 14))
    records[:, 28:].view(torch.float32).copy_(torch.rand(4, 1))
    cases.append((torch.ops.speedtorch_ops._fused_row_update.default,
                  (records,
                   torch.rand(4, 7, dtype=torch.bfloat16, device=dev), torch.tensor([3], device=dev),
                   torch.tensor(1.0, device=dev), 5, [0.1, 0.0, 0.9, 0.99, 1e-8], 0, [0, 28, 14],
                   torch.bfloat16, None, None, rounding)))
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
def test_distinct_ids_of_a_strided_plan(device):
    """Ids given as a column of a batch (a strided view) plan like contiguous ones."""
    from speedtorch_ops.training.host_rows import Distinct
    from speedtorch_ops.training.plan import Plan
    dev = device_of(device)
    batch = torch.randint(0, 50, (300, 3), generator=gen(5)).to(dev)
    d = Distinct(Plan.on_device(batch[:, 1], "prechecked"), 50)
    want, inverse = torch.unique(batch[:, 1].cpu(), return_inverse=True)
    assert int(d.count) == want.numel()
    assert torch.equal(d.ids.cpu()[: want.numel()], want)
    assert torch.equal(d.inverse.cpu(), inverse)
