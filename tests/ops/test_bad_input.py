"""Every bad-input class raises a RuntimeError naming the argument, and writes nothing: the
table is bit-for-bit unchanged and the next valid call works (on CUDA: the context too)."""

import pytest
import torch

import speedtorch_ops
from conftest import STORES, index_device, needs_cuda, place, random_rows

ROWS = 20


def _setup(store, gen):
    data = random_rows((ROWS, 4), torch.float32, gen)
    table = place(data, store)
    return data, table, index_device(store)


def _bad_indices(dev):
    ok = [1, 3, 5]
    return {
        "out of range": (torch.tensor(ok + [ROWS], device=dev), r"index\[3\] = 20 is out of range"),
        "far out of range": (torch.tensor([2**40] + ok, device=dev), "out of range"),
        "negative": (torch.tensor(ok + [-1], device=dev), r"= -1 is out of range"),
        "float": (torch.tensor([1.0, 2.0], device=dev), "index must be int64 or int32"),
        "2-D": (torch.tensor([[1, 2]], device=dev), "index must be a 1-D tensor"),
    }


def _valid_call_still_works(table, data, dev):
    idx = torch.tensor([0, ROWS - 1], device=dev)
    assert torch.equal(speedtorch_ops.pinned_gather(table, idx).cpu(), data[[0, ROWS - 1]])


def _raises(message, call, mode, dev, value_error=True):
    """call() raises `message`: in the call itself for 'raise', a host index or an argument
    error; with a deferred CUDA index (a bad value), at sync_bounds_check() instead."""
    if mode == "deferred" and dev.type == "cuda" and value_error:
        call()  # queued; nothing waits
        with pytest.raises(RuntimeError, match=message):
            speedtorch_ops.sync_bounds_check()
    else:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("mode", ["deferred", "raise"])
@pytest.mark.parametrize("case", ["out of range", "far out of range", "negative", "float", "2-D"])
def test_bad_index_writes_nothing(store, mode, case, gen):
    data, table, dev = _setup(store, gen)
    index, message = _bad_indices(dev)[case]
    value_error = case not in ("float", "2-D")
    n = index.numel()
    src = random_rows((n, 4), torch.float32, gen).to(dev)
    _raises(message, lambda: speedtorch_ops.pinned_gather(table, index, bounds_check=mode), mode,
            dev, value_error)
    out = torch.full((n, 4), 3.0, device=dev)
    _raises(message, lambda: speedtorch_ops.pinned_gather_into(table, index, out,
                                                               bounds_check=mode),
            mode, dev, value_error)
    if index.dim() == 1:
        assert torch.equal(out.cpu(), torch.full((n, 4), 3.0)), "out was written"
    for accumulate in (False, True):
        _raises(message, lambda: speedtorch_ops.pinned_scatter(table, index, src, accumulate,
                                                               bounds_check=mode),
                mode, dev, value_error)
        assert torch.equal(table.cpu(), data), "table was written"
    _valid_call_still_works(table, data, dev)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("mode", ["deferred", "raise"])
def test_swap_bad_index_writes_nothing(store, mode, gen):
    data, table, dev = _setup(store, gen)
    other_data = random_rows((ROWS, 4), torch.float32, gen)
    other = place(other_data, store)
    batch = [random_rows((3, 4), torch.float32, gen).to(dev) for _ in range(2)]
    before = [b.clone() for b in batch]
    good = torch.tensor([1, 2, 3], device=dev)
    bad = torch.tensor([4, ROWS + 5, 6], device=dev)
    _raises(r"load_index\[1\] = 25 is out of range",
            lambda: speedtorch_ops.optimizer_state_swap([table, other], batch, good, bad,
                                                        bounds_check=mode), mode, dev)
    _raises(r"writeback_index\[1\] = 25 is out of range",
            lambda: speedtorch_ops.optimizer_state_swap([table, other], batch, bad, good,
                                                        bounds_check=mode), mode, dev)
    assert torch.equal(table.cpu(), data) and torch.equal(other.cpu(), other_data)
    assert all(torch.equal(b, p) for b, p in zip(batch, before)), "batch was written"
    _valid_call_still_works(table, data, dev)


@pytest.mark.parametrize("store", STORES)
def test_shape_and_dtype_mismatch(store, gen):
    data, table, dev = _setup(store, gen)
    index = torch.tensor([1, 2, 3], device=dev)
    cases = [
        (random_rows((3, 5), torch.float32, gen), r"src must have shape \[3, 4\]"),
        (random_rows((2, 4), torch.float32, gen), r"src must have shape \[3, 4\]"),
        (random_rows((3, 4), torch.float64, gen), "src must have the table's dtype Float"),
    ]
    for src, message in cases:
        with pytest.raises(RuntimeError, match=message):
            speedtorch_ops.pinned_scatter(table, index, src.to(dev))
        with pytest.raises(RuntimeError, match=message.replace("src", "out")):
            speedtorch_ops.pinned_gather_into(table, index, src.to(dev))
    assert torch.equal(table.cpu(), data)
    with pytest.raises(RuntimeError, match=r"batch\[0\] must have shape"):
        speedtorch_ops.optimizer_state_swap([table], [torch.zeros(3, 5, device=dev)], index, None)
    with pytest.raises(RuntimeError, match="load_index has 3 entries but batch"):
        speedtorch_ops.optimizer_state_swap([table], [torch.zeros(2, 4, device=dev)], None, index)
    with pytest.raises(RuntimeError, match="stores and batch must pair up"):
        speedtorch_ops.optimizer_state_swap([table], [], None, index)
    assert torch.equal(table.cpu(), data)
    _valid_call_still_works(table, data, dev)


@pytest.mark.parametrize("store", STORES)
def test_aliasing_src_out_and_table(store, gen):
    data, table, dev = _setup(store, gen)
    index = torch.tensor([4, 5], device=dev)
    if store == "cpu":  # a view of the table itself
        view = table[10:12]
        with pytest.raises(RuntimeError, match="table and src share memory"):
            speedtorch_ops.pinned_scatter(table, index, view)
        with pytest.raises(RuntimeError, match="out and table share memory"):
            speedtorch_ops.pinned_gather_into(table, index, view)
        with pytest.raises(RuntimeError, match=r"batch\[0\] and stores\[0\] share memory"):
            speedtorch_ops.optimizer_state_swap([table], [view], index, index)
    if store == "cuda":
        view = table[10:12]
        with pytest.raises(RuntimeError, match="table and src share memory"):
            speedtorch_ops.pinned_scatter(table, index, view)
        with pytest.raises(RuntimeError, match="out and table share memory"):
            speedtorch_ops.pinned_gather_into(table, index, view)
    b = torch.zeros(2, 4, device=dev)
    with pytest.raises(RuntimeError, match=r"batch\[0\] and batch\[1\] share memory"):
        speedtorch_ops.optimizer_state_swap([table, table.clone()], [b, b], None, index)
    assert torch.equal(table.cpu(), data)


@pytest.mark.parametrize("store", STORES)
def test_non_contiguous_table_is_refused(store, gen):
    needs_cuda(store)
    dev = index_device(store)
    wide = random_rows((ROWS, 8), torch.float32, gen).to("cpu" if store != "cuda" else "cuda")
    view = wide[:, ::2]
    before = wide.clone()
    with pytest.raises(RuntimeError, match="table must be contiguous"):
        speedtorch_ops.pinned_gather(view, torch.tensor([1], device=dev))
    with pytest.raises(RuntimeError, match="table must be contiguous"):
        speedtorch_ops.pinned_scatter(view, torch.tensor([1], device=dev),
                                      torch.zeros(1, 4, device=dev))
    assert torch.equal(wide, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wrong_devices(gen):
    """(A pageable table with a CUDA index is no error: tests/ops/test_hybrid.py.)"""
    data = random_rows((ROWS, 4), torch.float32, gen)
    cuda_idx = torch.tensor([1, 2], device="cuda")
    on_gpu = data.cuda()
    with pytest.raises(RuntimeError, match="index is on cpu but table is on the GPU"):
        speedtorch_ops.pinned_gather(on_gpu, torch.tensor([1, 2]))
    pinned = place(data, "pinned")
    with pytest.raises(RuntimeError, match="src must be on cuda:0"):
        speedtorch_ops.pinned_scatter(pinned, cuda_idx, torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="out must be on cuda:0"):
        speedtorch_ops.pinned_gather_into(pinned, cuda_idx, torch.ones(2, 4))
    assert torch.equal(pinned, data)
    # After all of the above the CUDA context still works.
    assert torch.equal(speedtorch_ops.pinned_gather(pinned, cuda_idx).cpu(), data[[1, 2]])
    torch.cuda.synchronize()


def _every_op(table, index, dev, gen, bounds_check):
    """Calls every transfer op with `index` (each call in its own pytest.raises-able thunk)."""
    n = index.numel()
    rows = random_rows((n, 4), torch.float32, gen).to(dev)
    sorted_rows, slots = torch.sort(index, stable=True)
    wide = table.view(ROWS, 2, 2)
    return [
        lambda: speedtorch_ops.pinned_gather(table, index, bounds_check=bounds_check),
        lambda: speedtorch_ops.pinned_gather_into(table, index, rows, bounds_check=bounds_check),
        lambda: speedtorch_ops.pinned_scatter(table, index, rows, bounds_check=bounds_check),
        lambda: speedtorch_ops.pinned_scatter(table, index, rows, True, bounds_check=bounds_check),
        lambda: speedtorch_ops.optimizer_state_swap([table], [rows], index, index,
                                                    bounds_check=bounds_check),
        lambda: speedtorch_ops.ops._sorted_transfer(
            wide, [rows[:, :2].contiguous(), rows[:, 2:].contiguous()], sorted_rows, slots,
            load=False, bounds_check=bounds_check),
    ]


@pytest.mark.parametrize("store", STORES)
def test_prechecked_bad_index_writes_nothing(store, gen):
    """bounds_check="prechecked" (the caller validated on the host): with a CUDA index a bad one
    writes nothing and raises nothing (no wait for the stream); the CPU kernels check on the
    host anyway, so they still raise."""
    data, table, dev = _setup(store, gen)
    bad = torch.tensor([1, ROWS, 2], device=dev)
    for call in _every_op(table, bad, dev, gen, "prechecked"):
        if store == "cpu":
            with pytest.raises(RuntimeError, match=r"\] = 20 is out of range"):
                call()
        else:
            call()
            torch.cuda.synchronize()
        assert torch.equal(table.cpu(), data), "table was written"
    out = torch.full((3, 4), 7.0, device=dev)
    if store != "cpu":
        speedtorch_ops.pinned_gather_into(table, bad, out, bounds_check="prechecked")
        assert torch.equal(out.cpu(), torch.full((3, 4), 7.0)), "out was written"
    with pytest.raises(RuntimeError, match="out of range"):
        speedtorch_ops.pinned_scatter(table, bad, torch.ones(3, 4, device=dev),
                                      bounds_check="raise")
    good = torch.tensor([0, ROWS - 1], device=dev)
    rows = speedtorch_ops.pinned_gather(table, good, bounds_check="prechecked")
    assert torch.equal(rows.cpu(), data[[0, ROWS - 1]])


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("mode", ["", "Raise", "none", "warn"])
def test_unknown_bounds_check_mode_raises(store, mode, gen):
    data, table, dev = _setup(store, gen)
    good = torch.tensor([1, 2, 3], device=dev)
    for call in _every_op(table, good, dev, gen, mode):
        with pytest.raises(RuntimeError, match=f"bounds_check must be 'deferred' .* 'raise' .* "
                                               f"or 'prechecked' .*got '{mode}'"):
            call()
    assert torch.equal(table.cpu(), data)
