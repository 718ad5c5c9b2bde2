"""pinned_scatter against independent references: NumPy last-wins, sequential accumulate."""

import pytest
import torch

import speedtorch_ops
from conftest import (DTYPES, ROW_SHAPES, STORES, last_wins_reference, place, random_index,
                      random_rows, sequential_add_reference)


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
@pytest.mark.parametrize("threads", [None, 7])
def test_scatter_large_batch_parallel_path(store, threads, gen):
    # Big enough for the CPU kernel to split the table between threads (7: an odd number of
    # row ranges, more than this machine's cores).
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
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
    finally:
        torch.set_num_threads(previous)


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


@pytest.mark.parametrize("threads", [None, 7])
def test_scatter_into_a_table_past_the_caches(threads, gen):
    # A CPU table of 256 MiB and more takes streaming stores for rows of whole, aligned 64-byte
    # lines (64 and 192 B here), and memcpy for other rows (100 B) and for a view off 64-byte
    # alignment; every row written must match last-wins, every other row stay as it was.
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        flat = random_rows(((256 << 20) // 4 + 64,), torch.float32, gen)
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
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("store", ["pinned", "cuda"])
@pytest.mark.parametrize("rows", [32768, 32769, 200_000])
@pytest.mark.parametrize("sms", [0, 4])
def test_scatter_marks_last_positions_by_counters_or_hash(store, rows, sms, gen):
    # 1,000 positions: a table of up to 32,768 rows (16 per hash entry) marks each row's last
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
