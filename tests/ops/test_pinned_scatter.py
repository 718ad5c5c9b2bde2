"""pinned_scatter against independent references: NumPy last-wins, sequential accumulate."""

import pytest
import torch

import speedtorch_ops
from conftest import (DTYPES, ROW_SHAPES, STORES, last_wins_reference, needs_cuda, place,
                      random_index, random_rows, sequential_add_reference)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_scatter_last_duplicate_wins(store, dtype, index_dtype, gen):
    data = random_rows((53, 6), dtype, gen)
    table = place(data, store)
    index = random_index(120, 53, index_dtype, store, gen)  # duplicates certain
    src = random_rows((120, 6), dtype, gen).to(index.device)
    speedtorch_ops.pinned_scatter(table, index, src)
    assert torch.equal(table.cpu(), last_wins_reference(data, index, src)), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_accumulate_adds_every_duplicate(store, dtype, gen):
    data = random_rows((23, 5), dtype, gen)
    table = place(data, store)
    index = random_index(70, 23, torch.int64, store, gen)
    src = random_rows((70, 5), dtype, gen).to(index.device)
    speedtorch_ops.pinned_scatter(table, index, src, accumulate=True)
    # Same order of additions as the reference, so the same bits, on both devices.
    assert torch.equal(table.cpu(), sequential_add_reference(data, index, src)), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("store", STORES)
def test_scatter_accumulate_float64_reference(store, gen):
    data = random_rows((31, 8), torch.float32, gen)
    table = place(data, store)
    index = random_index(200, 31, torch.int64, store, gen)
    src = random_rows((200, 8), torch.float32, gen).to(index.device)
    speedtorch_ops.pinned_scatter(table, index, src, accumulate=True)
    ref = data.double().index_add_(0, index.cpu(), src.cpu().double())
    assert torch.allclose(table.cpu().double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("row_shape", ROW_SHAPES)
def test_scatter_row_shapes(store, row_shape, gen):
    for dtype in (torch.float32, torch.uint8, torch.float64):
        data = random_rows((29, *row_shape), dtype, gen)
        table = place(data, store)
        index = random_index(40, 29, torch.int64, store, gen)
        src = random_rows((40, *row_shape), dtype, gen).to(index.device)
        speedtorch_ops.pinned_scatter(table, index, src)
        assert torch.equal(table.cpu(), last_wins_reference(data, index, src)), f"{dtype}"


@pytest.mark.parametrize("store", STORES)
def test_scatter_large_batch_parallel_path(store, threads, gen):
    # Big enough for the CPU kernel to split the table between threads (7: an odd number of
    # row ranges, more than this machine's cores).
    data = random_rows((5000, 64), torch.float32, gen)
    table = place(data, store)
    index = random_index(20000, 5000, torch.int64, store, gen)
    src = random_rows((20000, 64), torch.float32, gen).to(index.device)
    speedtorch_ops.pinned_scatter(table, index, src)
    assert torch.equal(table.cpu(), last_wins_reference(data, index, src))
    table2 = place(data, store)
    speedtorch_ops.pinned_scatter(table2, index, src, accumulate=True)
    # Exact: every row's values are added in index order, in float32.
    assert torch.equal(table2.cpu(), sequential_add_reference(data, index, src))


@pytest.mark.parametrize("store", STORES)
def test_scatter_empty_index_and_non_contiguous_src(store, gen):
    data = random_rows((10, 4), torch.float32, gen)
    table = place(data, store)
    dev = "cpu" if store == "cpu" else "cuda"
    speedtorch_ops.pinned_scatter(table, torch.empty(0, dtype=torch.int64, device=dev),
                                  torch.empty(0, 4, device=dev))
    assert torch.equal(table.cpu(), data)
    index = torch.tensor([7, 2, 9], device=dev)
    src = random_rows((4, 3), torch.float32, gen).to(dev).t()  # (3, 4), non-contiguous
    assert not src.is_contiguous()
    speedtorch_ops.pinned_scatter(table, index, src)
    ref = data.clone()
    ref[index.cpu()] = src.cpu()
    assert torch.equal(table.cpu(), ref)


def test_scatter_into_a_table_past_the_caches(threads, gen):
    # A CPU table of 256 MiB and more takes streaming stores for rows of whole, aligned 64-byte
    # lines (64 and 192 B here), and memcpy for other rows (100 B) and for a view off 64-byte
    # alignment; every row written must match last-wins, every other row stay as it was.
    flat = torch.randn(((256 << 20) // 4 + 64,), generator=gen)  # float32 drawn directly
    for row_floats, offset in ((16, 0), (48, 0), (25, 0), (16, 4)):
        rows = -(-((256 << 20) // 4) // row_floats)  # at least 256 MiB
        view = flat[offset: offset + rows * row_floats].view(rows, row_floats)
        assert view.nbytes >= 256 << 20
        before = view.clone()
        index = random_index(300_000, rows, torch.int64, "cpu", gen)
        index[-5000:] = index[:5000]  # duplicates certain, the later one wins
        src = random_rows((300_000, row_floats), torch.float32, gen)
        speedtorch_ops.pinned_scatter(view, index, src)
        assert torch.equal(view, last_wins_reference(before, index, src)), (row_floats, offset)


@pytest.mark.parametrize("store", ["pinned", "cuda"])
@pytest.mark.parametrize("rows", [32768, 32769, 200_000])
@pytest.mark.parametrize("sms", [0, 4])
def test_scatter_marks_last_positions_by_counters_or_hash(store, rows, sms, gen):
    # 1,000 positions: a table of up to 32,768 rows (8 per hash entry) marks each row's last
    # position in one counter per row, a larger one in a hash of the index; both in an
    # uncapped launch and in one capped to 4 SMs (the per-team copy kernel).
    data = random_rows((rows, 20), torch.float32, gen)
    table = place(data, store)
    index = random_index(1000, rows, torch.int64, store, gen)
    index[500:] = index[:500]  # every row written twice, the later one wins
    index[100] = rows - 1  # the highest counter
    src = random_rows((1000, 20), torch.float32, gen).cuda()
    with speedtorch_ops.transfer_sm_limit(sms):
        speedtorch_ops.pinned_scatter(table, index, src)
    assert torch.equal(table.cpu(), last_wins_reference(data, index, src)), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("rows,n,dim", [(1000, 4000, 5), (131072, 4000, 5), (131073, 4000, 5),
                                        (3_000_000, 400_000, 4)])
@pytest.mark.parametrize("mode", ["deferred", "raise", "prechecked"])
@pytest.mark.parametrize("tables", [1, 3])
def test_cuda_tables_written_back_by_one_kernel(rows, n, dim, mode, tables, gen):
    # A write-back alone by a CUDA index into CUDA tables is one cooperative kernel that checks
    # the index, marks each row's last position and copies: every row written at least twice,
    # the later wins; then the same with one bad value, which writes nothing to any table.
    # Marks: one counter per row up to 8 per hash entry (131,072 rows for 4,000 positions), a
    # hash past that. 400,000 positions take more than the grid's threads (its loops go
    # round); rows of 20 B copy in 4 B words, of 16 B in 16 B vectors.
    needs_cuda("cuda")
    data = [random_rows((rows, dim), torch.float32, gen) for _ in range(tables)]
    stores = [place(d, "cuda") for d in data]
    index = random_index(n, rows, torch.int32, "cuda", gen)
    index[n // 2:] = index[:n // 2].flip(0)
    index[7] = rows - 1  # the highest counter
    batch = [random_rows((n, dim), torch.float32, gen).cuda() for _ in range(tables)]

    def write_back():
        if tables == 1:
            speedtorch_ops.pinned_scatter(stores[0], index, batch[0], bounds_check=mode)
        else:
            speedtorch_ops.optimizer_state_swap(stores, batch, index, None, bounds_check=mode)

    write_back()
    for d, s, b in zip(data, stores, batch):
        d.copy_(last_wins_reference(d, index, b))
        assert torch.equal(s.cpu(), d), f"seed {gen.initial_seed()}"
    bad = n // 3
    index[bad] = -1  # a bad value mid-index, good ones on both sides
    batch = [b + 1 for b in batch]
    message = f"\\[{bad}\\] = -1 is out of range"
    if mode == "raise":
        with pytest.raises(RuntimeError, match=message):
            write_back()
    else:
        write_back()
        if mode == "deferred":
            with pytest.raises(RuntimeError, match=message):
                speedtorch_ops.sync_bounds_check()
    for d, s in zip(data, stores):
        assert torch.equal(s.cpu(), d), f"a bad index wrote (seed {gen.initial_seed()})"


def cuda_kernel_names(fn):
    """The names of the CUDA kernels fn() ran (torch.profiler), space-separated."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events())


def test_refused_one_kernel_write_back_takes_the_separate_kernels(gen):
    # A device that cannot hold the one-kernel write-back's grid at once (fewer SMs free, as an
    # MPS client's share) refuses its cooperative launch (the hook asks for one block too
    # many); the call then takes the validation, marking and copy kernels: the same rows, the
    # last occurrence winning, a bad index writing nothing and raising, and the refusal is not
    # left behind for the next launch's error check.
    needs_cuda("cuda")
    ops = torch.ops.speedtorch_ops
    data = random_rows((5000, 8), torch.float32, gen)
    table = place(data, "cuda")
    index = random_index(3000, 5000, torch.int64, "cuda", gen)
    index[1500:] = index[:1500]  # every row twice, the later one wins
    src = random_rows((3000, 8), torch.float32, gen).cuda()
    with pytest.raises(RuntimeError, match="blocks must be in"):
        ops._set_fused_extra_blocks(-1)
    previous = ops._set_fused_extra_blocks(1)
    try:
        names = cuda_kernel_names(lambda: speedtorch_ops.pinned_scatter(table, index, src))
        assert "scatter_fused_kernel" not in names and "validate_kernel" in names, names
        assert torch.equal(table.cpu(), last_wins_reference(data, index, src))
        before = table.clone()
        bad = index.clone()
        bad[2000] = 5000
        with pytest.raises(RuntimeError, match=r"index\[2000\] = 5000"):
            speedtorch_ops.pinned_scatter(table, bad, src, bounds_check="raise")
        assert torch.equal(table, before)
    finally:
        ops._set_fused_extra_blocks(previous)
    src2 = random_rows((3000, 8), torch.float32, gen).cuda()
    names = cuda_kernel_names(lambda: speedtorch_ops.pinned_scatter(table, index, src2))
    assert "scatter_fused_kernel" in names, names
    assert torch.equal(table.cpu(), last_wins_reference(data, index, src2))


@pytest.mark.parametrize("sms,capturing", [(0, False), (4, False), (0, True)])
def test_which_cuda_table_write_backs_take_one_kernel(sms, capturing, gen):
    # The kernels a CUDA-table write-back queues (torch.profiler): the one cooperative kernel
    # uncapped; the validation, marking and copy kernels under an SM cap or while a CUDA graph
    # is captured (the graph's replay then costs no host time).
    needs_cuda("cuda")
    table = place(random_rows((5000, 8), torch.float32, gen), "cuda")
    index = random_index(3000, 5000, torch.int64, "cuda", gen)
    src = random_rows((3000, 8), torch.float32, gen).cuda()

    def call():
        with speedtorch_ops.transfer_sm_limit(sms):
            speedtorch_ops.pinned_scatter(table, index, src)

    call()  # warm-up (outside any capture)
    torch.cuda.synchronize()

    graphs = []  # kept until the replay has run

    def run():
        if capturing:
            graphs.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(graphs[0]):
                call()
            graphs[0].replay()
        else:
            call()

    names = cuda_kernel_names(run)
    fused = not capturing and sms == 0
    assert ("scatter_fused_kernel" in names) == fused, names
    assert ("validate_kernel" in names) != fused, names
