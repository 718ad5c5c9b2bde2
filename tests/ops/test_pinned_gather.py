"""pinned_gather / pinned_gather_into against plain PyTorch indexing, on every store."""

import pytest
import torch

import speedtorch_ops
from conftest import (DTYPES, ROW_SHAPES, STORES, index_device, place, random_index,
                      random_rows)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_matches_indexing(store, dtype, index_dtype, gen):
    data = random_rows((97, 7), dtype, gen)
    table = place(data, store)
    index = random_index(300, 97, index_dtype, store, gen)  # many duplicates
    out = speedtorch_ops.pinned_gather(table, index)
    assert out.device.type == index_device(store).type
    assert out.dtype == dtype and out.shape == (300, 7)
    assert torch.equal(out.cpu(), data[index.cpu().long()]), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("row_shape", ROW_SHAPES)
def test_gather_row_shapes(store, row_shape, gen):
    # Rows of 1, 3, 5 or 33 elements are not a multiple of 16 bytes: narrower vector path.
    for dtype in (torch.float32, torch.int8, torch.float16):
        data = random_rows((41, *row_shape), dtype, gen)
        table = place(data, store)
        index = random_index(64, 41, torch.int64, store, gen)
        out = speedtorch_ops.pinned_gather(table, index)
        assert out.shape == (64, *row_shape)
        assert torch.equal(out.cpu(), data[index.cpu()]), f"{dtype} seed {gen.initial_seed()}"


def test_gather_from_a_table_past_the_caches(threads, gen):
    # A CPU table of 256 MiB and more is read a few rows ahead of the copy (prefetch hints, one
    # for every cache line a row touches): rows of 32, 64, 100 and 512 B, and a view off 64-byte
    # alignment, must come out as plain indexing's, first and last rows included, across task
    # boundaries (7 threads).
    flat = torch.randn(((256 << 20) // 4 + 128,), generator=gen)  # float32 drawn directly
    for row_floats, offset in ((8, 0), (16, 0), (25, 0), (128, 0), (16, 5)):
        rows = -(-((256 << 20) // 4) // row_floats)  # at least 256 MiB
        view = flat[offset: offset + rows * row_floats].view(rows, row_floats)
        assert view.nbytes >= 256 << 20
        index = random_index(200_000, rows, torch.int64, "cpu", gen)
        index[:3] = torch.tensor([rows - 1, 0, rows - 1])
        index[-3:] = torch.tensor([0, rows - 1, rows - 2])
        out = speedtorch_ops.pinned_gather(view, index)
        assert torch.equal(out, view[index]), (row_floats, offset, gen.initial_seed())


@pytest.mark.parametrize("store", STORES)
def test_gather_empty_index_and_one_row_table(store, gen):
    data = random_rows((1, 5), torch.float32, gen)
    table = place(data, store)
    empty = torch.empty(0, dtype=torch.int64, device=index_device(store))
    out = speedtorch_ops.pinned_gather(table, empty)
    assert out.shape == (0, 5)
    index = torch.zeros(9, dtype=torch.int64, device=index_device(store))
    assert torch.equal(speedtorch_ops.pinned_gather(table, index).cpu(), data.expand(9, 5))


@pytest.mark.parametrize("store", STORES)
def test_gather_non_contiguous_index(store, gen):
    data = random_rows((50, 4), torch.float32, gen)
    table = place(data, store)
    index = random_index(40, 50, torch.int64, store, gen)[::2]
    assert not index.is_contiguous()
    assert torch.equal(speedtorch_ops.pinned_gather(table, index).cpu(), data[index.cpu()])


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_gather_into_writes_caller_tensor(store, dtype, gen):
    data = random_rows((60, 9), dtype, gen)
    table = place(data, store)
    index = random_index(25, 60, torch.int32, store, gen)
    out = random_rows((25, 9), dtype, gen).to(index.device)
    ptr = out.data_ptr()
    speedtorch_ops.pinned_gather_into(table, index, out)
    assert out.data_ptr() == ptr
    assert torch.equal(out.cpu(), data[index.cpu().long()])


def test_gather_is_differentiable_like_index_select(gen):
    table = torch.randn(20, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    index = random_index(15, 20, torch.int64, "cpu", gen)
    out = speedtorch_ops.pinned_gather(table, index)
    weights = torch.randn(15, 3, dtype=torch.float64, generator=gen)
    (out * weights).sum().backward()
    ref = torch.zeros(20, 3, dtype=torch.float64).index_add_(0, index, weights)
    assert torch.allclose(table.grad, ref)
    torch.autograd.gradcheck(lambda t: speedtorch_ops.pinned_gather(t, index),
                             (table.detach().clone().requires_grad_(),))


@pytest.mark.parametrize("store", ["pinned", "cuda"])
def test_gather_grad_lands_with_the_table(store, gen):
    data = random_rows((30, 4), torch.float32, gen)
    table = place(data, store).requires_grad_()
    index = random_index(12, 30, torch.int64, store, gen)
    speedtorch_ops.pinned_gather(table, index).sum().backward()
    assert table.grad.device == table.device
    ref = torch.zeros(30, 4).index_add_(0, index.cpu(), torch.ones(12, 4))
    assert torch.equal(table.grad.cpu(), ref)


@pytest.mark.parametrize("store", STORES)
def test_gather_past_2_31_rows(store):
    # More than 2^31 rows (2 GiB of int8): row offsets must be 64-bit.
    rows = 2**31 + 7
    dev = index_device(store)  # skips without a GPU
    if store == "cpu":
        table = torch.empty(rows, 1, dtype=torch.int8)
    else:
        table = (speedtorch_ops.empty_pinned((rows, 1), torch.int8) if store == "pinned"
                 else torch.empty(rows, 1, dtype=torch.int8, device="cuda"))
    picks = torch.tensor([rows - 1, 2**31, 2**31 - 1, 5, rows - 1], dtype=torch.int64)
    values = torch.tensor([[11], [22], [33], [44], [55]], dtype=torch.int8)
    speedtorch_ops.pinned_scatter(table, picks.to(dev), values.to(dev))
    out = speedtorch_ops.pinned_gather(table, picks.to(dev)).cpu()
    # rows - 1 was written twice: the last write (55) wins.
    assert out.flatten().tolist() == [55, 22, 33, 44, 55]
    del table


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("row_shape", [(), (3,), (128,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bfloat16, torch.float64])
def test_large_batches_with_repeats(store, row_shape, dtype, gen):
    """Batches long enough for the sorted, read-each-row-once path of host-mapped tables."""
    data = random_rows((5000, *row_shape), dtype, gen)
    table = place(data, store)
    index = random_index(40000, 5000, torch.int64, store, gen)  # every row ~8 times
    out = speedtorch_ops.pinned_gather(table, index)
    assert torch.equal(out.cpu(), data[index.cpu()]), f"seed {gen.initial_seed()}"
    batch = [torch.zeros(40000, *row_shape, dtype=dtype, device=index.device)]
    speedtorch_ops.optimizer_state_swap([table], batch, None, index)
    assert torch.equal(batch[0].cpu(), data[index.cpu()])
