"""bounds_check='deferred' (the default) with CUDA indices: the failing call neither waits nor
raises and writes nothing; the bad index reaches the user at the next call on that GPU (which
writes nothing either) or at sync_bounds_check(). GPU only: CPU indices are checked on the host
and raise at once in every mode (tests/ops/test_bad_input.py). conftest's autouse fixture checks
that each test leaves nothing unreported."""

import pytest
import torch

import speedtorch_ops
from conftest import HAS_CUDA, random_rows

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (scripts/gpu_check.sh)")

ROWS = 20


def _table(store, gen):
    data = random_rows((ROWS, 8), torch.float32, gen)
    if store == "pinned":
        return data, speedtorch_ops.empty_pinned(data.shape, data.dtype).copy_(data)
    return data, data.cuda()


@pytest.mark.parametrize("store", ["pinned", "cuda"])
def test_the_next_call_raises_and_neither_call_writes(store, gen):
    data, table = _table(store, gen)
    bad = torch.tensor([3, ROWS + 4, 5], device="cuda")
    speedtorch_ops.pinned_scatter(table, bad, torch.ones(3, 8, device="cuda"))  # no raise here
    torch.cuda.synchronize()
    good = torch.tensor([0, 1], device="cuda")
    with pytest.raises(RuntimeError, match=r"earlier call .* index\[1\] = 24 is out of range "
                                           r"for a table of 20 rows"):
        speedtorch_ops.pinned_scatter(table, good, torch.zeros(2, 8, device="cuda"))
    assert torch.equal(table.cpu(), data), "a call wrote"
    # Reported once: the same good call now runs.
    speedtorch_ops.pinned_scatter(table, good, torch.zeros(2, 8, device="cuda"))
    torch.cuda.synchronize()  # the call did not wait, and a pinned table's .cpu() does not
    expected = data.clone()
    expected[[0, 1]] = 0
    assert torch.equal(table.cpu(), expected)


@pytest.mark.parametrize("store", ["pinned", "cuda"])
def test_names_the_index_and_reports_the_first_bad_one(store, gen):
    data, table = _table(store, gen)
    batch = [torch.zeros(3, 8, device="cuda")]
    good = torch.tensor([1, 2, 3], device="cuda")
    first, second = torch.tensor([1, -7, 2], device="cuda"), torch.tensor([ROWS + 9],
                                                                          device="cuda")
    speedtorch_ops.pinned_gather(table, good)  # first-use work (the record, kernels) done here
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # both calls are queued before either runs
    speedtorch_ops.optimizer_state_swap([table], batch, good, first)
    speedtorch_ops.pinned_gather(table, second)  # found second: not reported
    with pytest.raises(RuntimeError, match=r"load_index\[1\] = -7 is out"):
        speedtorch_ops.sync_bounds_check()
    speedtorch_ops.sync_bounds_check()  # nothing left
    assert torch.equal(batch[0].cpu(), torch.zeros(3, 8)), "batch was written"
    assert torch.equal(table.cpu(), data)
    sorted_rows = torch.tensor([1, 2, 3], device="cuda")
    parts = [torch.zeros(3, 4, device="cuda") for _ in range(2)]
    speedtorch_ops.ops._sorted_transfer(table.view(ROWS, 2, 4), parts, sorted_rows,
                                        torch.tensor([0, 1, 9], device="cuda"), load=True)
    with pytest.raises(RuntimeError, match=r"slots\[2\] = 9 is out of range for a table of 3"):
        speedtorch_ops.sync_bounds_check()


def test_a_deferred_call_does_not_wait_for_the_gpu(gen):
    _, table = _table("pinned", gen)
    index = torch.tensor([1, 2], device="cuda")
    out = torch.empty(2, 8, device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out)  # first-use work done outside the window
    for mode, waits in (("deferred", False), ("prechecked", False), ("raise", True)):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU work ahead of the call
        speedtorch_ops.pinned_gather_into(table, index, out, bounds_check=mode)
        done = torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert done == waits, f"{mode}: the call {'did not wait' if waits else 'waited'}"


def test_prechecked_calls_neither_report_nor_stop_for_another_calls_index(gen):
    """A store's step is several prechecked calls: another call's bad index must not stop it
    halfway. The next checking call reports it."""
    data, table = _table("pinned", gen)
    speedtorch_ops.pinned_gather(table, torch.tensor([ROWS + 2], device="cuda"))  # deferred
    torch.cuda.synchronize()
    good = torch.tensor([3, 4], device="cuda")
    speedtorch_ops.pinned_scatter(table, good, torch.zeros(2, 8, device="cuda"),
                                  bounds_check="prechecked")
    torch.cuda.synchronize()
    expected = data.clone()
    expected[[3, 4]] = 0
    assert torch.equal(table.cpu(), expected), "the prechecked call did not run"
    with pytest.raises(RuntimeError, match=r"index\[0\] = 22 is out of range"):
        speedtorch_ops.pinned_gather(table, good)


def test_prechecked_records_nothing(gen):
    data, table = _table("cuda", gen)
    speedtorch_ops.pinned_scatter(table, torch.tensor([ROWS], device="cuda"),
                                  torch.ones(1, 8, device="cuda"), bounds_check="prechecked")
    speedtorch_ops.sync_bounds_check()  # nothing to report
    assert torch.equal(table.cpu(), data)


@pytest.mark.parametrize("mode", ["deferred", "raise"])
def test_a_captured_call_reports_at_every_replay(mode, gen):
    """A graph cannot wait, so a captured call reports like a deferred one, at each replay whose
    index (changed in place between replays) is bad."""
    data, table = _table("pinned", gen)
    index = torch.tensor([1, 2, 3], device="cuda")
    out = torch.zeros(3, 8, device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out, bounds_check=mode)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        speedtorch_ops.pinned_gather_into(table, index, out, bounds_check=mode)
    for _ in range(2):
        index.copy_(torch.tensor([4, ROWS + 1, 6]))
        out.fill_(5.0)
        graph.replay()
        with pytest.raises(RuntimeError, match=r"index\[1\] = 21"):
            speedtorch_ops.sync_bounds_check()
        assert torch.equal(out.cpu(), torch.full((3, 8), 5.0)), "a bad replay wrote"
        index.copy_(torch.tensor([4, 5, 6]))
        graph.replay()
        speedtorch_ops.sync_bounds_check()
        assert torch.equal(out.cpu(), data[[4, 5, 6]])


def test_a_report_from_a_side_stream_reaches_the_next_call(gen):
    data, table = _table("pinned", gen)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        bad = torch.tensor([ROWS * 3], device="cuda")
        speedtorch_ops.pinned_scatter(table, bad, torch.ones(1, 8, device="cuda"))
    side.synchronize()
    with pytest.raises(RuntimeError, match=r"index\[0\] = 60"):
        speedtorch_ops.pinned_gather(table, torch.tensor([0], device="cuda"))
    assert torch.equal(table.cpu(), data)


def test_sync_bounds_check_names_its_argument():
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        speedtorch_ops.sync_bounds_check("cpu")
    with pytest.raises(RuntimeError, match="device must be a CUDA device index"):
        speedtorch_ops.sync_bounds_check(torch.cuda.device_count())
