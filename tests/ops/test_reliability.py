"""Leaks (host RSS and CUDA memory flat over 10^5 calls), concurrency (threads and CUDA streams on
distinct tables), and damaged or mismatched files (a clear error, nothing half-loaded)."""

import os
import threading

import numpy as np
import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA, STORES, index_device, place, random_rows

CALLS = int(os.environ.get("SPEEDTORCH_OPS_LEAK_CALLS", "100000"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("store", STORES)
def test_no_leak_over_many_calls(store, gen):
    """10^5 calls of each op on the CPU (10^4 on the GPU paths, whose calls wait for the device):
    host RSS grows by less than 8 MiB after warm-up, CUDA memory not at all."""
    dev = index_device(store)
    table = place(random_rows((1000, 8), torch.float32, gen), store)
    index = torch.randint(0, 1000, (16,), generator=gen).to(dev)
    src = torch.randn(16, 8, generator=gen).to(dev)
    out = torch.empty(16, 8, device=dev)
    batch = [torch.empty(16, 8, device=dev)]
    bad = torch.tensor([5, 1000], device=dev)

    def burst(n):
        for i in range(n):
            so.pinned_gather(table, index)
            so.pinned_gather_into(table, index, out)
            so.pinned_scatter(table, index, src, accumulate=bool(i & 1))
            so.optimizer_state_swap([table], batch, index, index)
            if i % 1000 == 0:  # the error path must not leak either
                with pytest.raises(RuntimeError):
                    so.pinned_gather(table, bad, bounds_check="raise")

    calls = CALLS if store == "cpu" else CALLS // 10
    burst(calls // 10)
    if HAS_CUDA:
        torch.cuda.synchronize()
    rss, cuda = rss_bytes(), torch.cuda.memory_allocated() if HAS_CUDA else 0
    burst(calls)
    if HAS_CUDA:
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == cuda
    growth = rss_bytes() - rss
    assert growth < 8 << 20, f"host RSS grew by {growth / 2**20:.1f} MiB over {calls} x 4 calls"


def test_switcher_training_loop_does_not_leak(gen):
    emb = nn.Embedding(64, 8)
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    model = nn.Module()
    model.emb = emb
    sw = so.PytorchModelFactory(emb, 5000, 8, deviceType="cpu")
    of = so.PytorchOptimizerFactory(opt, 5000, 8, model, "emb", deviceType="cpu")
    sw.normalDistributionInit(0, 1)
    of.optInit()
    rng = np.random.default_rng(0)
    slots = torch.arange(64)

    def steps(n):
        for _ in range(n):
            ids = rng.integers(0, 5000, 64)
            sw.beforeForwardPass(ids)
            of.beforeForwardPass(ids)
            opt.zero_grad()
            emb(slots).pow(2).sum().backward()
            opt.step()
            sw.afterOptimizerStep(ids)
            of.afterOptimizerStep(ids)

    steps(300)
    rss = rss_bytes()
    steps(3000)
    growth = rss_bytes() - rss
    assert growth < 8 << 20, f"host RSS grew by {growth / 2**20:.1f} MiB over 3000 steps"


@pytest.mark.parametrize("store", STORES)
def test_threads_on_distinct_tables(store, gen):
    """Several threads (and, on the GPU, one CUDA stream each) using the ops on their own tables
    at once give the same results as running alone."""
    dev = index_device(store)
    workers = 4
    datas = [random_rows((2000, 16), torch.float32, gen) for _ in range(workers)]
    tables = [place(d, store) for d in datas]
    plans = [[(torch.randint(0, 2000, (256,), generator=gen),
               torch.randn(256, 16, generator=gen)) for _ in range(50)] for _ in range(workers)]
    errors = []

    def work(k):
        try:
            stream = torch.cuda.Stream() if dev.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                for idx, src in plans[k]:
                    so.pinned_scatter(tables[k], idx.to(dev), src.to(dev), accumulate=True)
            if stream is not None:
                stream.synchronize()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(workers):
        ref = datas[k].double()
        for idx, src in plans[k]:
            ref.index_add_(0, idx, src.double())
        assert torch.allclose(tables[k].cpu().double(), ref, rtol=1e-4, atol=1e-4), k


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_damaged_and_mismatched_files_load_nothing(tmp_path, gen):
    sw = so.PytorchModelFactory(nn.Embedding(2, 4), 30, 4, deviceType="cpu")
    sw.normalDistributionInit(0, 1)
    before = sw.getNumpyVersion()
    good = tmp_path / "good.npy"
    np.save(good, np.ones((30, 4), np.float32))
    raw = good.read_bytes()
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes(raw[: len(raw) - 100])
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not a numpy file at all" * 10)
    with pytest.raises((ValueError, OSError)):
        sw.loadCupy(str(truncated))
    with pytest.raises((ValueError, OSError)):
        sw.loadCupy(str(garbage))
    with pytest.raises((ValueError, OSError)):
        so.load_npy(str(truncated), pin=False)
    torch.save(torch.ones(31, 4), tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"holds \(31, 4\)"):
        sw.loadTorch(str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="tables\\[0\\]"):
        sw.load_state_dict({"tables": [torch.ones(31, 4)]})
    assert np.array_equal(sw.getNumpyVersion(), before), "a failed load changed the table"
