"""The hybrid path: a CPU index with a host table and rows on the GPU. CPU threads (through pinned
staging and DMA copies) and the zero-copy kernels each move a share of the rows, split by a hash
of the row. Every test runs with fixed shares (all CPU, a mix, all zero-copy) and the automatic
split, against plain PyTorch indexing. A pageable table (no kernel can address it) takes the
CPU side alone, with a CPU index or with a CUDA index (brought to the host). GPU only: run by
scripts/gpu_check.sh on the GPU machine."""

import re

import pytest
import torch

import speedtorch_ops
from conftest import HAS_CUDA, last_wins_reference, random_rows, sequential_add_reference

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (scripts/gpu_check.sh)")

SHARES = [0.0, 0.37, 1.0, None]  # None: the automatic split
_ops = torch.ops.speedtorch_ops


@pytest.fixture(params=SHARES, ids=lambda s: "auto" if s is None else f"share{s}")
def share(request):
    # The automatic split under the quick search: a shape's calls take 0.5, 0.2, 0.8, 0, ... in
    # turn (the default search first times 20 calls at 0 alone), so every call must be exact
    # whatever share it met.
    previous = _ops._set_hybrid_share.default(-1.0 if request.param is None else request.param)
    _ops._reset_hybrid_tuner.default(request.param is None)
    yield request.param
    _ops._reset_hybrid_tuner.default(False)
    _ops._set_hybrid_share.default(previous)


def pinned(data):
    return speedtorch_ops.empty_pinned(data.shape, data.dtype).copy_(data)


def cpu_index(n, rows, gen, dtype=torch.int64):
    return torch.randint(0, rows, (n,), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_into(share, dtype, index_dtype, gen):
    data = random_rows((3000, 37), dtype, gen)
    table = pinned(data)
    index = cpu_index(40000, 3000, gen, index_dtype)  # ~3 MB: past the small-transfer cut
    out = torch.full((40000, 37), 3, dtype=dtype, device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out)
    assert torch.equal(out.cpu(), data[index.long()]), f"seed {gen.initial_seed()}"
    assert torch.equal(table, data)


@pytest.mark.parametrize("accumulate", [False, True])
def test_scatter(share, accumulate, gen):
    data = random_rows((2000, 33), torch.float32, gen)
    table = pinned(data)
    index = cpu_index(30000, 2000, gen)  # every row repeats ~15 times
    src = random_rows((30000, 33), torch.float32, gen).cuda()
    speedtorch_ops.pinned_scatter(table, index, src, accumulate=accumulate)
    ref = (sequential_add_reference if accumulate else last_wins_reference)(data, index, src)
    assert torch.equal(table, ref), f"seed {gen.initial_seed()}"


def test_swap_writes_back_then_loads(share, gen):
    shapes = [((5000, 64), torch.float32), ((5000, 64), torch.bfloat16), ((5000, 3), torch.float32)]
    datas = [random_rows(s, d, gen) for s, d in shapes]
    stores = [pinned(d) for d in datas]
    n = 20000
    wb = cpu_index(n, 5000, gen)
    load = torch.cat([wb[: n // 4], cpu_index(n - n // 4, 5000, gen)])  # overlaps the write-back
    batch = [random_rows((n, *s[1:]), d, gen).cuda() for s, d in shapes]
    written = [b.clone() for b in batch]
    speedtorch_ops.optimizer_state_swap(stores, batch, wb, load)
    for data, s, b, w in zip(datas, stores, batch, written):
        ref = last_wins_reference(data, wb, w)
        assert torch.equal(s, ref), f"seed {gen.initial_seed()}"
        assert torch.equal(b.cpu(), ref[load]), f"seed {gen.initial_seed()}"


def gather_then_scatter(table, data, n, gen):
    """Gathers n random rows of `table` (holding `data`) to the GPU and scatters new rows back
    through CPU indices, checking both against plain indexing; returns the table's new data."""
    index = cpu_index(n, data.shape[0], gen)
    out = torch.empty((n, *data.shape[1:]), dtype=data.dtype, device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out)
    assert torch.equal(out.cpu(), data[index]), f"seed {gen.initial_seed()}"
    src = random_rows((n, *data.shape[1:]), data.dtype, gen).cuda()
    speedtorch_ops.pinned_scatter(table, index, src)
    data = last_wins_reference(data, index, src)
    assert torch.equal(table, data), f"seed {gen.initial_seed()}"
    return data


def test_automatic_split_meets_several_shares(capfd, monkeypatch, gen):
    """Under the quick search (the `auto` variant of these tests) a shape's calls take several
    shares in turn, every one exact; the search's trace (stderr) names each call's share."""
    data = random_rows((4096, 64), torch.float32, gen)
    table = pinned(data)
    monkeypatch.setenv("SPEEDTORCH_OPS_TRACE_SPLIT", "1")
    previous = _ops._set_hybrid_share.default(-1.0)
    _ops._reset_hybrid_tuner.default(True)
    try:
        for _ in range(5):
            data = gather_then_scatter(table, data, 12288, gen)  # 3 MiB a call: the hybrid
    finally:
        _ops._reset_hybrid_tuner.default(False)
        _ops._set_hybrid_share.default(previous)
    shares = re.findall(r"hybrid split: \d+ rows, share ([0-9.]+):", capfd.readouterr().err)
    assert len(shares) >= 4 and {"0.500", "0.200", "0.800"} <= set(shares), shares


def test_many_chunks_and_sorted_reads(share, gen):
    # 1 KiB rows, 24 MiB per transfer: several 2 MiB CPU chunks and a sorted zero-copy side.
    data = random_rows((8192, 256), torch.float32, gen)
    table = pinned(data)
    for _ in range(3):  # the automatic split moves between calls; every call must be exact
        data = gather_then_scatter(table, data, 24576, gen)


@pytest.mark.parametrize("threads", [1, 3, 7])
@pytest.mark.parametrize("row_floats", [8, 25, 32])
@pytest.mark.parametrize("fixed", [0.0, 0.37])
def test_cpu_side_gathers_every_chunk_on_any_thread_count(threads, row_floats, fixed, gen):
    """The CPU side gathers a load in one parallel region, each thread taking its share of
    every 2 MiB chunk and the last one in queueing the chunk's copy. With 1, 3 or 7 threads
    (uneven shares; at share 0 a last chunk of 5 rows, where some of 7 shares are empty), rows
    of 32 B and 100 B (normal stores) and 128 B (streamed), a load alone and a swap (at share 0
    a write-back through the CPU then a load; at 0.37 both split by row), every row lands where
    plain indexing puts it."""
    row_bytes = row_floats * 4
    chunk = max(1024, (2 << 20) // row_bytes)
    n = 2 * chunk + 5
    data = random_rows((3000, row_floats), torch.float32, gen)
    table = pinned(data)
    load = cpu_index(n, 3000, gen)
    wb = cpu_index(n, 3000, gen)
    written = random_rows((n, row_floats), torch.float32, gen).cuda()
    previous_threads = torch.get_num_threads()
    previous_share = _ops._set_hybrid_share.default(fixed)
    try:
        torch.set_num_threads(threads)
        out = torch.full((n, row_floats), -1.0, device="cuda")
        speedtorch_ops.pinned_gather_into(table, load, out)
        assert torch.equal(out.cpu(), data[load]), f"seed {gen.initial_seed()}"
        batch = written.clone()
        speedtorch_ops.optimizer_state_swap([table], [batch], wb, load)
        ref = last_wins_reference(data, wb, written)
        assert torch.equal(table, ref), f"seed {gen.initial_seed()}"
        assert torch.equal(batch.cpu(), ref[load]), f"seed {gen.initial_seed()}"
    finally:
        torch.set_num_threads(previous_threads)
        _ops._set_hybrid_share.default(previous_share)


def test_more_stores_than_one_launch_holds(share, gen):
    datas = [random_rows((900, 8 + k), torch.float32, gen) for k in range(10)]  # > 8 tables
    stores = [pinned(d) for d in datas]
    load = cpu_index(70000, 900, gen)
    batch = [torch.zeros((70000, d.shape[1]), device="cuda") for d in datas]
    speedtorch_ops.optimizer_state_swap(stores, batch, None, load)
    for d, b in zip(datas, batch):
        assert torch.equal(b.cpu(), d[load])


def test_pageable_table_moves_through_the_cpu(share, gen):
    """A table a kernel cannot address (pageable memory, e.g. a memory-mapped file) works with
    a CPU index: all its rows go through the CPU and DMA."""
    data = random_rows((1000, 16), torch.float32, gen)
    table = data.clone()
    assert not table.is_pinned()
    gather_then_scatter(table, data, 5000, gen)


@pytest.mark.parametrize("bounds_check", ["raise", "prechecked"])
def test_pageable_table_with_a_cuda_index_moves_through_the_cpu(share, bounds_check, gen):
    """The index on the rows' device, as callers pass it: a pageable table routes to the CPU
    side (the index is brought to the host, where it is checked in every bounds_check mode)."""
    data = random_rows((1000, 16), torch.float32, gen)
    table = data.clone()
    index = cpu_index(5000, 1000, gen).cuda()
    got = speedtorch_ops.pinned_gather(table, index, bounds_check=bounds_check)
    assert got.is_cuda and torch.equal(got.cpu(), data[index.cpu()]), f"seed {gen.initial_seed()}"
    out = torch.empty((5000, 16), device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out, bounds_check=bounds_check)
    assert torch.equal(out.cpu(), data[index.cpu()])
    src = random_rows((5000, 16), torch.float32, gen).cuda()
    speedtorch_ops.pinned_scatter(table, index, src, bounds_check=bounds_check)
    data = last_wins_reference(data, index, src)
    assert torch.equal(table, data), f"seed {gen.initial_seed()}"
    speedtorch_ops.pinned_scatter(table, index, src, accumulate=True, bounds_check=bounds_check)
    data = sequential_add_reference(data, index, src)
    assert torch.equal(table, data), f"seed {gen.initial_seed()}"
    other_data = random_rows((1000, 3), torch.bfloat16, gen)
    other = other_data.clone()
    batch = [random_rows((5000, 16), torch.float32, gen).cuda(),
             random_rows((5000, 3), torch.bfloat16, gen).cuda()]
    written = [b.clone() for b in batch]
    load = cpu_index(5000, 1000, gen).cuda()
    speedtorch_ops.optimizer_state_swap([table, other], batch, index, load,
                                        bounds_check=bounds_check)
    for d, t, b, w in ((data, table, batch[0], written[0]),
                       (other_data, other, batch[1], written[1])):
        ref = last_wins_reference(d, index, w)
        assert torch.equal(t, ref) and torch.equal(b.cpu(), ref[load.cpu()])
    before = table.clone()
    bad = index.clone()
    bad[4321] = 1000
    with pytest.raises(RuntimeError, match=r"index\[4321\] = 1000 is out of range"):
        speedtorch_ops.pinned_scatter(table, bad, src, bounds_check=bounds_check)
    out.fill_(5.0)
    with pytest.raises(RuntimeError, match=r"index\[4321\] = 1000 is out of range"):
        speedtorch_ops.pinned_gather_into(table, bad, out, bounds_check=bounds_check)
    assert torch.equal(table, before) and bool((out == 5.0).all())


def test_cuda_indices_of_both_types_come_to_the_host_together(gen):
    """A swap's two CUDA indices come to the host through one pinned area kept between calls:
    an int32 write-back index of odd length before an int64 load index (which must start
    aligned past it), then longer ones (the area may grow), then shorter; each call's rows as
    plain indexing's, and a bad value in either index raises naming it, writing nothing."""
    data = random_rows((3000, 16), torch.float32, gen)
    table = data.clone()  # pageable: every call takes the CPU side, indices on the host
    for n in (20001, 45003, 999):
        wb = cpu_index(n, 3000, gen, torch.int32)
        load = cpu_index(n, 3000, gen)
        batch = random_rows((n, 16), torch.float32, gen).cuda()
        data = last_wins_reference(data, wb, batch.cpu())
        speedtorch_ops.optimizer_state_swap([table], [batch], wb.cuda(), load.cuda())
        assert torch.equal(table, data), (n, gen.initial_seed())
        assert torch.equal(batch.cpu(), data[load]), (n, gen.initial_seed())
    for bad_wb, bad_load, name in ((wb, load.clone(), "load_index"),
                                   (wb.clone(), load, "writeback_index")):
        (bad_load if name == "load_index" else bad_wb)[-1] = 3000
        with pytest.raises(RuntimeError, match=rf"{name}\[{n - 1}\] = 3000 is out of range"):
            speedtorch_ops.optimizer_state_swap([table], [batch], bad_wb.cuda(), bad_load.cuda())
        assert torch.equal(table, data) and torch.equal(batch.cpu(), data[load]), name


def test_pageable_table_refused_beside_cuda_tables_and_under_capture(gen):
    data = random_rows((50, 4), torch.float32, gen)
    pageable = data.clone()
    index = torch.tensor([1, 2, 3], device="cuda")
    batch = [torch.zeros(3, 4, device="cuda"), torch.zeros(3, 4, device="cuda")]
    with pytest.raises(RuntimeError, match=r"stores\[1\] is in pageable host memory, which no "
                                           r"kernel can address, and other tables are on cuda"):
        speedtorch_ops.optimizer_state_swap([data.cuda(), pageable], batch, None, index)
    out = torch.zeros((3, 4), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="table is in pageable host memory, so its rows move "
                                           "through CPU threads, which a CUDA graph cannot"):
        with torch.cuda.graph(graph):
            speedtorch_ops.pinned_gather_into(pageable, index, out)
    torch.cuda.synchronize()
    assert torch.equal(pageable, data) and bool((out == 0).all())
    speedtorch_ops.pinned_gather_into(pageable, index, out)  # the context still works
    assert torch.equal(out.cpu(), data[[1, 2, 3]])


def test_bad_index_writes_nothing(share, gen):
    data = random_rows((700, 40), torch.float32, gen)
    table = pinned(data)
    index = cpu_index(30000, 700, gen)
    index[12345] = 700
    out = torch.full((30000, 40), 5.0, device="cuda")
    with pytest.raises(RuntimeError, match=r"index\[12345\] = 700 is out of range"):
        speedtorch_ops.pinned_gather_into(table, index, out)
    with pytest.raises(RuntimeError, match=r"index\[12345\] = 700 is out of range"):
        speedtorch_ops.pinned_scatter(table, index, torch.ones(30000, 40, device="cuda"))
    batch = [torch.ones(30000, 40, device="cuda")]
    with pytest.raises(RuntimeError, match=r"load_index\[12345\] = 700 is out of range"):
        speedtorch_ops.optimizer_state_swap([table], batch, cpu_index(30000, 700, gen), index)
    assert torch.equal(table, data)
    assert bool((out == 5.0).all()) and bool((batch[0] == 1.0).all())


def test_mixed_index_devices_are_refused(gen):
    table = pinned(random_rows((50, 4), torch.float32, gen))
    with pytest.raises(RuntimeError, match="must both be on the CPU or both on cuda"):
        speedtorch_ops.optimizer_state_swap([table], [torch.zeros(3, 4, device="cuda")],
                                            torch.tensor([1, 2, 3]),
                                            torch.tensor([1, 2, 3], device="cuda"))


def test_cpu_index_with_a_cuda_table(gen):
    data = random_rows((300, 12), torch.float32, gen)
    table = data.cuda()
    index = cpu_index(1000, 300, gen)
    out = torch.empty((1000, 12), device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out)
    assert torch.equal(out.cpu(), data[index])
    src = random_rows((1000, 12), torch.float32, gen).cuda()
    speedtorch_ops.pinned_scatter(table, index, src)
    assert torch.equal(table.cpu(), last_wins_reference(data, index, src))


def test_cpu_side_sees_rows_written_by_earlier_gpu_work(gen):
    """Stream order: a hybrid call's CPU threads read the table only after the work queued
    before it (here a zero-copy scatter through a CUDA index) has run."""
    previous = _ops._set_hybrid_share.default(0.0)  # every row through the CPU
    try:
        data = random_rows((4096, 64), torch.float32, gen)
        table = pinned(data)
        index = torch.randperm(4096, generator=gen)[:3000]
        for _ in range(3):
            new = random_rows((3000, 64), torch.float32, gen).cuda()
            torch.cuda._sleep(2_000_000)  # keep the stream busy so a missing wait would show
            speedtorch_ops.pinned_scatter(table, index.cuda(), new)
            out = torch.empty((3000, 64), device="cuda")
            speedtorch_ops.pinned_gather_into(table, index, out)
            assert torch.equal(out, new)
    finally:
        _ops._set_hybrid_share.default(previous)


def test_on_a_side_stream(gen):
    data = random_rows((2000, 32), torch.float32, gen)
    table = pinned(data)
    index = cpu_index(50000, 2000, gen)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = torch.empty((50000, 32), device="cuda")
        speedtorch_ops.pinned_gather_into(table, index, out)
        total = out.double().sum()
    stream.synchronize()
    assert torch.equal(out.cpu(), data[index])
    assert float(total) == pytest.approx(float(data[index].double().sum()))


@pytest.mark.parametrize("sms", [1, 3, 0])
def test_sm_limit_keeps_results(sms, gen):
    data = random_rows((5000, 48), torch.float32, gen)
    table = pinned(data)
    index = torch.randint(0, 5000, (20000,), generator=gen).cuda()
    with speedtorch_ops.transfer_sm_limit(sms):
        out = speedtorch_ops.pinned_gather(table, index)
        src = random_rows((20000, 48), torch.float32, gen).cuda()
        speedtorch_ops.pinned_scatter(table, index, src)
    assert torch.equal(out.cpu(), data[index.cpu()])
    assert torch.equal(table, last_wins_reference(data, index, src))
    assert speedtorch_ops.set_transfer_sm_limit(0) == 0  # restored after the block
    with pytest.raises(RuntimeError, match="sms must be >= 0"):
        speedtorch_ops.set_transfer_sm_limit(-1)


def test_cpu_index_refused_under_graph_capture(gen):
    data = random_rows((100, 8), torch.float32, gen)
    table = pinned(data)
    index = torch.tensor([3, 1, 4])
    out = torch.zeros((3, 8), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be used while a CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            speedtorch_ops.pinned_gather_into(table, index, out)
    torch.cuda.synchronize()
    speedtorch_ops.pinned_gather_into(table, index, out)  # the context still works
    assert torch.equal(out.cpu(), data[index])


def test_process_exits_cleanly_after_hybrid_calls():
    """The hybrid path keeps pinned staging and events per device for the life of the process;
    exiting after using it must not crash (it did once: freed after torch's CUDA teardown)."""
    import subprocess
    import sys
    code = (
        "import torch, speedtorch_ops\n"
        "torch.ops.speedtorch_ops._set_hybrid_share.default(0.5)\n"
        "t = speedtorch_ops.empty_pinned((4096, 256)).normal_()\n"
        "i = torch.randint(0, 4096, (20000,))\n"
        "o = torch.empty((20000, 256), device='cuda')\n"
        "speedtorch_ops.pinned_gather_into(t, i, o)\n"
        "speedtorch_ops.pinned_scatter(t, i, o)\n"
        "speedtorch_ops.optimizer_state_swap([t], [o], i, i)\n"
        "torch.cuda.synchronize()\n"
        "assert torch.equal(o.cpu(), t[i])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture
def huge_tables():
    """Every pinned table counts as huge: loads by a CUDA index take the hybrid path, and
    write-backs alone go through the CPU (whatever the index's device)."""
    previous = _ops._set_hybrid_min_span.default(1)
    yield
    _ops._set_hybrid_min_span.default(previous)


@pytest.mark.parametrize("accumulate", [False, True])
def test_cuda_index_over_a_huge_table(share, huge_tables, accumulate, gen):
    """A load by a CUDA index from a table past the span threshold comes to the host and moves
    through the hybrid, and a write-back alone through the CPU: the same rows as plain
    indexing, duplicates resolved the same way."""
    data = random_rows((2000, 33), torch.float32, gen)
    table = pinned(data)
    index = cpu_index(30000, 2000, gen).cuda()  # every row repeats ~15 times; 4 MB moved
    assert torch.equal(speedtorch_ops.pinned_gather(table, index).cpu(), data[index.cpu()])
    src = random_rows((30000, 33), torch.float32, gen).cuda()
    speedtorch_ops.pinned_scatter(table, index, src, accumulate=accumulate)
    ref = (sequential_add_reference if accumulate else last_wins_reference)(data, index, src)
    assert torch.equal(table, ref), f"seed {gen.initial_seed()}"
    batch = [torch.zeros(30000, 33, device="cuda")]
    speedtorch_ops.optimizer_state_swap([table], batch, None, index)
    assert torch.equal(batch[0].cpu(), ref[index.cpu()])


@pytest.mark.parametrize("row_floats", [8, 16, 25])
@pytest.mark.parametrize("on_device", [True, False])
def test_narrow_rows_of_a_huge_table_load_through_the_cpu(huge_tables, row_floats, on_device,
                                                          gen):
    """Loads of rows under 128 B from a table past the span threshold go through the CPU side
    alone (staged with normal stores: narrower than 128 B rows do not stream): the same
    rows as plain indexing, by a CUDA or a CPU index; a swap that also writes back keeps its
    route (the split for a CPU index, zero-copy for a CUDA one), a write-back alone goes
    through the CPU. (Which path each call takes: tests/cpp/test_route.cpp.)"""
    data = random_rows((5000, row_floats), torch.float32, gen)
    table = pinned(data)
    place = (lambda i: i.cuda()) if on_device else (lambda i: i)
    index = place(cpu_index(70000, 5000, gen))
    out = torch.zeros(70000, row_floats, device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out)
    assert torch.equal(out.cpu(), data[index.cpu()]), f"seed {gen.initial_seed()}"
    batch = [torch.zeros(70000, row_floats, device="cuda")]
    speedtorch_ops.optimizer_state_swap([table], batch, None, index)
    assert torch.equal(batch[0].cpu(), data[index.cpu()])
    wb = place(cpu_index(70000, 5000, gen))
    src = random_rows((70000, row_floats), torch.float32, gen).cuda()
    ref = last_wins_reference(data, wb, src)
    speedtorch_ops.optimizer_state_swap([table], [src], wb, index)
    torch.cuda.synchronize()  # a CUDA index writes the pinned table from the GPU, unsynchronized
    assert torch.equal(table, ref) and torch.equal(src.cpu(), ref[index.cpu()])
    # a write-back alone (through the CPU side alone, whatever the index's device)
    src = random_rows((70000, row_floats), torch.float32, gen).cuda()
    speedtorch_ops.pinned_scatter(table, wb, src)
    assert torch.equal(table, last_wins_reference(ref, wb, src))


@pytest.mark.parametrize("row_floats", [8, 25, 128])
def test_cpu_side_reads_a_table_past_the_caches(huge_tables, row_floats, gen):
    """The CPU side reads rows of a pinned table of 256 MiB and more a few rows ahead of the
    copy (prefetch hints) and streams them into staging (128 floats) or copies them (8 and 25:
    rows under 128 B): every row as plain indexing's, by a CUDA and a CPU index, first and last
    rows included."""
    rows = -(-((256 << 20) // 4) // row_floats)
    table = speedtorch_ops.empty_pinned((rows, row_floats), torch.float32)
    table.copy_(random_rows((rows, row_floats), torch.float32, gen))
    previous = _ops._set_hybrid_share.default(0.0)  # every row through the CPU
    try:
        for on_device in (True, False):
            index = cpu_index(150_000, rows, gen)
            index[:2] = torch.tensor([rows - 1, 0])
            index[-2:] = torch.tensor([0, rows - 1])
            out = torch.zeros(150_000, row_floats, device="cuda")
            speedtorch_ops.pinned_gather_into(table, index.cuda() if on_device else index, out)
            assert torch.equal(out.cpu(), table[index]), (on_device, gen.initial_seed())
    finally:
        _ops._set_hybrid_share.default(previous)


@pytest.mark.parametrize("mode", ["deferred", "raise"])
def test_cuda_index_over_a_huge_table_checks_on_the_host(huge_tables, mode, gen):
    """A load's (or a lone write-back's) index is read on the host, so a bad one raises in the
    call and nothing is written, and a capture (which cannot wait for the index) still takes
    the zero-copy kernels. ('prechecked' calls never take that path:
    test_prechecked_loads_from_a_huge_table_do_not_wait.)"""
    data = random_rows((2000, 33), torch.float32, gen)
    table = pinned(data)
    index = cpu_index(30000, 2000, gen)
    index[17000] = 2000
    out = torch.zeros(30000, 33, device="cuda")
    with pytest.raises(RuntimeError, match=r"index\[17000\] = 2000 is out of range"):
        speedtorch_ops.pinned_gather_into(table, index.cuda(), out, bounds_check=mode)
    with pytest.raises(RuntimeError, match=r"load_index\[17000\] = 2000 is out of range"):
        speedtorch_ops.optimizer_state_swap([table], [out], None, index.cuda(), bounds_check=mode)
    src = torch.ones(30000, 33, device="cuda")
    with pytest.raises(RuntimeError, match=r"index\[17000\] = 2000 is out of range"):
        speedtorch_ops.pinned_scatter(table, index.cuda(), src, bounds_check=mode)
    assert torch.equal(table, data) and not out.any()
    good = cpu_index(30000, 2000, gen).cuda()
    speedtorch_ops.pinned_gather_into(table, good, out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        speedtorch_ops.pinned_gather_into(table, good, out, bounds_check=mode)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), data[good.cpu()])


def test_prechecked_loads_from_a_huge_table_do_not_wait(huge_tables, gen):
    """bounds_check='prechecked' promises no wait, so such a load stays zero-copy: it returns
    while the GPU is still busy, and moves the right rows."""
    data = random_rows((2000, 33), torch.float32, gen)
    table = pinned(data)
    index = cpu_index(30000, 2000, gen).cuda()
    out = torch.zeros(30000, 33, device="cuda")
    speedtorch_ops.pinned_gather_into(table, index, out, bounds_check="prechecked")  # warm-up
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    speedtorch_ops.pinned_gather_into(table, index, out, bounds_check="prechecked")
    assert not torch.cuda.current_stream().query(), "the prechecked load waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), data[index.cpu()])
