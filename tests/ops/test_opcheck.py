"""torch.library.opcheck (schema, fake, autograd registration, AOT dispatch) for every op."""

import contextlib

import pytest
import torch

import speedtorch_ops
from torch.testing._internal.optests import generate_tests

from conftest import STORES, index_device, place, random_index, random_rows

ops = torch.ops.speedtorch_ops


@contextlib.contextmanager
def _copies_stay_pinned():
    """opcheck runs the op on copies of its arguments (generate_tests.clone_input), and a copy
    of a pinned tensor is pageable, which the zero-copy path rightly refuses. For the pinned store
    the copies are pinned in place, so opcheck sees the op as users call it."""
    original = generate_tests.clone_input

    def clone_input(x, *args, **kwargs):
        out = original(x, *args, **kwargs)
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.is_pinned():
            speedtorch_ops.pin_(out)
        return out

    generate_tests.clone_input = clone_input
    try:
        yield
    finally:
        generate_tests.clone_input = original


def opcheck(op, args, store, kwargs=None):
    """opcheck with every default test util, except test_aot_dispatch_dynamic on a pinned store:
    it always runs the op on torch.clone() copies of the arguments (pageable, and full-size
    copies of the table). The cpu and cuda stores run it for the same op; torch.compile of the
    pinned store is covered in tests/ops/test_compile.py."""
    if store != "pinned":
        torch.library.opcheck(op, args, kwargs)
        return
    with _copies_stay_pinned():
        torch.library.opcheck(
            op, args, kwargs,
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def _samples(store, gen):
    dev = index_device(store)
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        table = place(random_rows((37, 5), dtype, gen), store)
        for index_dtype in (torch.int64, torch.int32):
            index = random_index(19, 37, index_dtype, store, gen)
            src = random_rows((19, 5), dtype, gen).to(dev)
            yield table, index, src


@pytest.mark.parametrize("store", STORES)
def test_opcheck_pinned_gather(store, gen):
    for table, index, src in _samples(store, gen):
        opcheck(ops.pinned_gather.default, (table, index), store)
        opcheck(ops.pinned_gather_into.default, (table, index, torch.empty_like(src)), store)
    opcheck(ops.pinned_gather.default, (table, index), store, {"bounds_check": "prechecked"})
    opcheck(ops.pinned_gather_into.default, (table, index, torch.empty_like(src)), store,
            {"bounds_check": "prechecked"})
    table = place(random_rows((37, 5), torch.float64, gen), store).requires_grad_()
    opcheck(ops.pinned_gather.default, (table, random_index(7, 37, torch.int64, store, gen)), store)


@pytest.mark.parametrize("store", STORES)
def test_opcheck_pinned_scatter(store, gen):
    for table, index, src in _samples(store, gen):
        for accumulate in (False, True):
            opcheck(ops.pinned_scatter.default, (table, index, src, accumulate), store)
    opcheck(ops.pinned_scatter.default, (table, index, src), store, {"bounds_check": "prechecked"})


@pytest.mark.parametrize("store", STORES)
def test_opcheck_optimizer_state_swap(store, gen):
    dev = index_device(store)
    stores = [place(random_rows((30, 4), torch.float32, gen), store) for _ in range(3)]
    batch = [random_rows((8, 4), torch.float32, gen).to(dev) for _ in range(3)]
    wb = random_index(8, 30, torch.int64, store, gen)
    load = random_index(8, 30, torch.int64, store, gen)
    for args in ((wb, load), (None, load), (wb, None)):
        opcheck(ops.optimizer_state_swap.default, (stores, batch, *args), store)
    opcheck(ops.optimizer_state_swap.default, (stores, batch, wb, load), store,
            {"bounds_check": "prechecked"})


@pytest.mark.parametrize("store", STORES)
def test_opcheck_sorted_transfer(store, gen):
    dev = index_device(store)
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        table = place(random_rows((37, 3, 5), dtype, gen), store)
        sorted_rows, slots = torch.sort(random_index(19, 37, torch.int64, store, gen), stable=True)
        parts = [random_rows((19, 5), dtype, gen).to(dev) for _ in range(3)]
        for load in (True, False):
            opcheck(ops._sorted_transfer.default, (table, parts, sorted_rows, slots, load), store)
        opcheck(ops._sorted_transfer.default, (table, parts, sorted_rows, slots, True), store,
                {"bounds_check": "prechecked"})
