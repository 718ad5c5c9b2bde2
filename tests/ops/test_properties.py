"""Property tests (hypothesis): random shapes, dtypes, row widths and index patterns against
plain PyTorch. Short in CI; SPEEDTORCH_OPS_LONG=1 runs ~10^4 cases per test."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import speedtorch_ops
from conftest import (DTYPES, HAS_CUDA, last_wins_reference, place, random_rows,
                      sequential_add_reference)

LONG = os.environ.get("SPEEDTORCH_OPS_LONG", "0") == "1"
SETTINGS = settings(max_examples=10_000 if LONG else 150, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STORES = ["cpu"] + (["pinned", "cuda"] if HAS_CUDA else [])


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 300))
    row_shape = draw(st.sampled_from([(), (1,), (2,), (3,), (7,), (16,), (31,), (64,), (2, 5)]))
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 400))
    pattern = draw(st.sampled_from(["random", "sorted", "reversed", "all-same", "unique"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if pattern == "unique":
        n = min(n, rows)
        index = torch.randperm(rows, generator=g)[:n]
    elif pattern == "all-same":
        index = torch.full((n,), int(torch.randint(0, rows, (), generator=g)))
    else:
        index = torch.randint(0, rows, (n,), generator=g)
        if pattern == "sorted":
            index = index.sort().values
        elif pattern == "reversed":
            index = index.sort(descending=True).values
    index = index.to(draw(st.sampled_from([torch.int64, torch.int32])))
    store = draw(st.sampled_from(STORES))
    return dict(rows=rows, row_shape=row_shape, dtype=dtype, index=index, store=store, g=g)


def _device(store):
    return torch.device("cpu") if store == "cpu" else torch.device("cuda")


@SETTINGS
@given(cases())
def test_gather_property(case):
    data = random_rows((case["rows"], *case["row_shape"]), case["dtype"], case["g"])
    table = place(data, case["store"])
    index = case["index"].to(_device(case["store"]))
    out = speedtorch_ops.pinned_gather(table, index)
    assert torch.equal(out.cpu(), data[case["index"].long()])


@SETTINGS
@given(cases(), st.booleans())
def test_scatter_property(case, accumulate):
    data = random_rows((case["rows"], *case["row_shape"]), case["dtype"], case["g"])
    table = place(data, case["store"])
    n = case["index"].numel()
    src = random_rows((n, *case["row_shape"]), case["dtype"], case["g"])
    dev = _device(case["store"])
    speedtorch_ops.pinned_scatter(table, case["index"].to(dev), src.to(dev), accumulate)
    if dev.type == "cuda":  # a pinned table is written from the GPU; the op does not wait for it
        torch.cuda.synchronize()
    if accumulate:
        if n > 60:  # the sequential reference is slow in Python; a float64 one instead
            if case["dtype"] in (torch.float16, torch.bfloat16, torch.bool) or not (
                    case["dtype"].is_floating_point):
                return
            ref = data.double().index_add_(0, case["index"].long(), src.double())
            assert torch.allclose(table.cpu().double(), ref, rtol=1e-4, atol=1e-4)
            return
        expected = sequential_add_reference(data, case["index"], src)
    else:
        expected = last_wins_reference(data, case["index"], src) if n else data
    assert torch.equal(table.cpu(), expected)
