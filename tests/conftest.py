"""Shared fixtures: where a table lives ("store") and random data of every dtype.

Stores: "cpu" (CPU table, CPU index), "pinned" (pinned host table, CUDA index: the zero-copy
path) and "cuda" (device table, CUDA index). The last two skip without a GPU and run on the GPU
machine (scripts/gpu_check.sh)."""

import secrets

import numpy as np
import pytest
import torch

import speedtorch_ops

HAS_CUDA = torch.cuda.is_available()
STORES = ["cpu", "pinned", "cuda"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
# Row shapes: scalar rows, rows that are not a multiple of 16 bytes, wide rows, 2-D rows.
ROW_SHAPES = [(), (1,), (3,), (5,), (16,), (33,), (128,), (2, 3)]


def needs_cuda(store: str) -> None:
    if store != "cpu" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")


def index_device(store: str) -> torch.device:
    needs_cuda(store)
    return torch.device("cpu") if store == "cpu" else torch.device("cuda")


def plain(out) -> dict:
    """A collection's forward result as {feature: tensor}: a KeyedTensor's per-feature
    tensors, a JaggedTensor's values (the references compare tensors)."""
    if isinstance(out, speedtorch_ops.KeyedTensor):
        return out.to_dict()
    return {k: v.values() if isinstance(v, speedtorch_ops.JaggedTensor) else v
            for k, v in out.items()}


def random_rows(shape, dtype, generator=None) -> torch.Tensor:
    """Fresh random data, never all zeros."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -100), min(info.max, 100), shape, generator=generator,
                         dtype=torch.int64).to(dtype)


def place(data: torch.Tensor, store: str) -> torch.Tensor:
    """The table `data` held in `store`."""
    needs_cuda(store)
    if store == "cpu":
        return data.clone()
    if store == "pinned":
        table = speedtorch_ops.empty_pinned(data.shape, data.dtype)
        return table.copy_(data)
    return data.to("cuda")


def random_index(n, rows, dtype=torch.int64, store="cpu", generator=None) -> torch.Tensor:
    idx = torch.randint(0, rows, (n,), generator=generator, dtype=torch.int64).to(dtype)
    return idx.to(index_device(store))


def last_wins_reference(table: torch.Tensor, index: torch.Tensor, src: torch.Tensor):
    """table[index[i]] = src[i] where, for duplicates, the last occurrence wins (plain NumPy)."""
    ref = table.cpu().clone()
    idx = index.cpu().long().numpy()
    rev = idx[::-1]
    rows, first_in_rev = np.unique(rev, return_index=True)
    last = len(idx) - 1 - first_in_rev
    ref[torch.from_numpy(rows)] = src.cpu()[torch.from_numpy(last)]
    return ref


def sequential_add_reference(table: torch.Tensor, index: torch.Tensor, src: torch.Tensor):
    """table[index[i]] += src[i] one index at a time, in index order, in the table's dtype."""
    ref = table.cpu().clone()
    s = src.cpu()
    for i, r in enumerate(index.cpu().long().tolist()):
        if ref.dtype == torch.bool:
            ref[r] = ref[r] | s[i]
        else:
            ref[r] = ref[r] + s[i]
    return ref


@pytest.fixture
def gen():
    """A generator with a fresh seed per test (new random data every run); tests print
    gen.initial_seed() in their assertion messages so a failure can be replayed."""
    return torch.Generator().manual_seed(secrets.randbelow(2**62))


@pytest.fixture(params=[None, 7], ids=["threads-default", "threads7"])
def threads(request):
    """The CPU kernels on torch's default threads and on 7 (an odd number of tasks or row
    ranges, more than a small machine's cores); restored afterwards."""
    previous = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def no_unreported_bad_index():
    """A bad CUDA index that a deferred call recorded (the ops' default bounds_check) fails the
    test that made it, not whichever test calls an op next."""
    yield
    if HAS_CUDA:
        speedtorch_ops.sync_bounds_check()


def _shows_skips(chars: str) -> bool:
    """Whether pytest's -r characters `chars` list each skip (as -rs, -ra and -rA do; the last
    -r given wins, and N clears)."""
    shown = False
    for c in chars:
        if c in "aAsS":
            shown = True
        elif c == "N":
            shown = False
    return shown


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skips counted by reason, one line each, when -r leaves them out (scripts/test.sh does:
    on a CPU machine the CUDA tests' skips, listed by place, ran to about 60 lines)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or _shows_skips(config.option.reportchars):
        return
    counts = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    terminalreporter.section("skipped, by reason")
    for reason, n in sorted(counts.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{n:5d} {reason}")
