"""Pinned-memory helpers: empty_pinned, pin_ (in pieces), unpin_, initialize_, load_npy,
is_zero_copy_usable, progress bars. The GPU tests run on the GPU machine (scripts/gpu_check.sh)."""

import ctypes
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import speedtorch_ops
from speedtorch_ops import memory

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int8, np.bool_])
def test_load_npy_in_chunks_equals_file(tmp_path, dtype):
    rng = np.random.default_rng()
    data = (rng.standard_normal((1003, 7)) * 50).astype(dtype)
    path = tmp_path / "table.npy"
    np.save(path, data)
    # A chunk of a few rows forces many chunk copies.
    table = speedtorch_ops.load_npy(str(path), pin=HAS_CUDA, chunk_bytes=100 * data.itemsize * 7)
    assert table.shape == data.shape and table.is_contiguous()
    assert np.array_equal(table.numpy(), data)
    assert speedtorch_ops.is_zero_copy_usable(table) == HAS_CUDA


def test_load_npy_one_dimensional_and_empty(tmp_path):
    data = np.arange(10, dtype=np.int32)[::-1].copy()
    np.save(tmp_path / "a.npy", data)
    assert np.array_equal(speedtorch_ops.load_npy(str(tmp_path / "a.npy"), pin=False).numpy(), data)
    empty = np.zeros((0, 3), dtype=np.float32)
    np.save(tmp_path / "e.npy", empty)
    assert speedtorch_ops.load_npy(str(tmp_path / "e.npy"), pin=False).shape == (0, 3)


def test_empty_pinned_unpinned_fallback_and_checks():
    t = speedtorch_ops.empty_pinned((5, 3), torch.bfloat16, pin=False)
    assert t.shape == (5, 3) and t.dtype == torch.bfloat16 and not t.is_pinned()
    with pytest.raises(ValueError, match="must be contiguous"):
        speedtorch_ops.pin_(torch.zeros(4, 4).t())


def _meminfo_kib(key):
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _thp_advisable():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_huge_page_tables_hold_data_and_free_their_memory(dtype):
    """empty_pinned's memory for large tables (before pinning): an anonymous mapping that the
    kernel backs with huge pages where it allows them, freed with its last view."""
    assert memory._huge_page_table((1000, 3), dtype) is None  # small tables: torch.empty
    rows = (memory.HUGE_PAGE_MIN_BYTES * 2) // (64 * torch.empty((), dtype=dtype).element_size())
    rss0, huge0 = _rss_mib(), _meminfo_kib("AnonHugePages")
    t = memory._huge_page_table((rows, 64), dtype)
    assert t.shape == (rows, 64) and t.dtype == dtype and t.is_contiguous()
    ref = (torch.rand(rows, 64) * 100).to(dtype)
    t.copy_(ref)  # touches every page
    if _thp_advisable():
        assert _meminfo_kib("AnonHugePages") - huge0 >= 1024  # at least half the 2 MiB pages
    assert _rss_mib() - rss0 >= t.nbytes >> 21
    view = t[rows // 2:]
    del t
    assert torch.equal(view, ref[rows // 2:])  # the mapping outlives the tensor made on it
    del view, ref
    assert _rss_mib() - rss0 < memory.HUGE_PAGE_MIN_BYTES >> 20  # unmapped with the last view


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only error")
def test_pin_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="(without CUDA|cannot pin|CUDA)"):
        speedtorch_ops.empty_pinned((4, 4), torch.float32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_pin_in_place_keeps_data_and_address():
    t = torch.randn(1000, 33)
    ref = t.clone()
    ptr = t.data_ptr()
    assert not speedtorch_ops.is_zero_copy_usable(t)
    speedtorch_ops.pin_(t)
    assert t.data_ptr() == ptr and t.is_pinned() and torch.equal(t, ref)
    assert speedtorch_ops.is_zero_copy_usable(t)
    speedtorch_ops.pin_(t)  # pinning twice is a no-op
    idx = torch.randint(0, 1000, (50,), device="cuda")
    assert torch.equal(speedtorch_ops.pinned_gather(t, idx).cpu(), ref[idx.cpu()])
    view = t[10:20]
    del t
    assert torch.equal(view, ref[10:20])  # the storage outlives the tensor that pinned it
    del view


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_empty_pinned_costs_its_bytes():
    # 300 MiB + a bit: torch's pinned allocator would round this up to 512 MiB.
    shape = (300 * 1024 + 7, 256)
    t = speedtorch_ops.empty_pinned(shape, torch.float32)
    assert t.is_pinned() and t.untyped_storage().nbytes() == shape[0] * shape[1] * 4
    # Large enough for the huge-page mapping: the rows read in place from the GPU.
    assert t.nbytes >= memory.HUGE_PAGE_MIN_BYTES and speedtorch_ops.is_zero_copy_usable(t)
    t[-5:] = torch.arange(5 * 256, dtype=torch.float32).view(5, 256)
    idx = torch.arange(shape[0] - 5, shape[0], device="cuda")
    assert torch.equal(speedtorch_ops.pinned_gather(t, idx).cpu(), t[-5:])


# --- pinning in pieces, progress, initialising ---------------------------------------------

MIB = 1 << 20


class Recorder:
    """Stands in for progress_bar: records the bytes reported."""

    def __init__(self):
        self.total = self.updates = 0
        self.closed = False

    def __call__(self, total_bytes, desc, progress=None):
        self.expected = total_bytes
        return self

    def update(self, n):
        self.total += n
        self.updates += 1

    def close(self):
        self.closed = True


def test_progress_bar_default_on_only_for_large_tables(monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    assert isinstance(memory.progress_bar(memory.PROGRESS_MIN_BYTES - 1, "x"), memory._NoBar)
    bar = memory.progress_bar(memory.PROGRESS_MIN_BYTES, "x", progress=None)
    assert isinstance(bar, tqdm.tqdm)
    bar.close()
    assert isinstance(memory.progress_bar(1 << 40, "x", progress=False), memory._NoBar)
    bar = memory.progress_bar(10, "x", progress=True)
    assert isinstance(bar, tqdm.tqdm)
    bar.close()


def test_progress_bar_without_tqdm_shows_nothing(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)  # import raises ImportError
    bar = memory.progress_bar(1 << 40, "x", progress=True)
    assert isinstance(bar, memory._NoBar)
    bar.update(5)
    bar.close()


def test_pin_failure_message_names_size_limit_and_fix(monkeypatch):
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (65536, 65536))
    msg = memory.pin_failure_message(3 << 30, RuntimeError("cudaHostRegister refused ..."))
    for part in ["3221225472 bytes", "3.00 GiB", "RLIMIT_MEMLOCK", "ulimit -l", "65536 bytes",
                 "--ulimit memlock", "Nothing was left pinned", "cudaHostRegister refused"]:
        assert part in msg, (part, msg)
    monkeypatch.setattr(memory.resource, "getrlimit",
                        lambda which: (memory.resource.RLIM_INFINITY,) * 2)
    assert "is unlimited" in memory.pin_failure_message(1, RuntimeError("x"))


def test_pin_checks_piece_bytes():
    with pytest.raises(ValueError, match="piece_bytes must be > 0"):
        speedtorch_ops.pin_(torch.zeros(4), piece_bytes=0)


def test_unpin_of_memory_never_pinned_is_a_no_op():
    t = torch.arange(6.0)
    assert memory.unpin_(t) is t and torch.equal(t, torch.arange(6.0))


@pytest.mark.parametrize("shape", [(1000, 7), (10,), (), (0, 3), (5, 2, 3)])
def test_initialize_touches_every_element_once(monkeypatch, shape):
    rec = Recorder()
    monkeypatch.setattr(memory, "progress_bar", rec)
    table = torch.zeros(shape)
    calls = []
    # Chunks of 3 rows (or one row when a row is wider): many calls.
    out = memory.initialize_(table, lambda c: (calls.append(c.shape), c.add_(1)),
                             chunk_bytes=3 * 4 * math.prod(shape[1:]))
    assert out is table and torch.equal(table, torch.ones(shape))
    assert rec.total == table.numel() * 4 and (rec.closed or table.numel() == 0)
    if table.dim() > 0 and table.shape[0] > 3:
        assert len(calls) == -(-table.shape[0] // 3)
    with pytest.raises(ValueError, match="contiguous"):
        memory.initialize_(torch.zeros(4, 4).t(), lambda c: c)


def test_initialize_random_is_reproducible_for_a_chunk_size():
    a, b = torch.empty(5000, 3), torch.empty(5000, 3)
    torch.manual_seed(1)
    memory.initialize_(a, lambda c: c.normal_(0, 1), chunk_bytes=4096)
    torch.manual_seed(1)
    memory.initialize_(b, lambda c: c.normal_(0, 1), chunk_bytes=4096)
    assert torch.equal(a, b) and 0.9 < a.std() < 1.1


@pytest.mark.parametrize("distribution,a,b", [("uniform", -0.5, 2.0), ("normal", 1.5, 0.25)])
def test_fill_random_same_table_on_any_thread_count(distribution, a, b):
    """Each chunk draws from its own seeded generator: one seed gives one table on 1 or 3
    threads; the values follow the distribution (float64 moments of 600,000 draws), chunks do
    not repeat each other, and another seed gives another table."""
    tables = []
    for threads in (1, 3, 3):
        torch.manual_seed(7 if len(tables) < 2 else 8)
        t = torch.empty(20000, 30, dtype=torch.float64)
        speedtorch_ops.fill_random_(t, distribution, a, b, threads=threads, chunk_bytes=50_000)
        tables.append(t)
    assert torch.equal(tables[0], tables[1]) and not torch.equal(tables[0], tables[2])
    t = tables[0]
    chunk_rows = 50_000 // (30 * 8)
    assert not torch.equal(t[:chunk_rows], t[chunk_rows:2 * chunk_rows])
    mean, std = (a + b) / 2, (b - a) / 12 ** 0.5
    if distribution == "normal":
        mean, std = a, b
        assert abs(float(((t - a) / b).pow(3).mean())) < 0.03  # symmetric
    else:
        assert float(t.min()) >= a and float(t.max()) < b
    assert abs(float(t.mean()) - mean) < 5 * std / t.numel() ** 0.5
    assert abs(float(t.std()) / std - 1) < 0.01


def test_fill_random_strided_view_and_generator():
    """A strided view (a module's weight inside its row layout) is filled, its neighbours are
    not; an explicit generator decides the table, not the default one."""
    host = torch.zeros(5000, 3, 8)
    weight = host[:, 0, :5]
    gen = torch.Generator().manual_seed(3)
    speedtorch_ops.fill_random_(weight, "normal", 0.0, 1.0, generator=gen, chunk_bytes=4000,
                                threads=2)
    assert (weight != 0).all() and (host[:, 1:] == 0).all() and (host[:, 0, 5:] == 0).all()
    again = torch.zeros(5000, 3, 8)
    torch.manual_seed(99)
    speedtorch_ops.fill_random_(again[:, 0, :5], "normal", 0.0, 1.0, chunk_bytes=4000,
                                generator=torch.Generator().manual_seed(3))
    assert torch.equal(again, host)


@pytest.mark.parametrize("args,match", [
    (("gamma", 0.0, 1.0), "distribution must be one of"),
    (("uniform", 1.0, 0.0), "uniform needs a <= b"),
    (("normal", 0.0, -1.0), "standard deviation b >= 0"),
])
def test_fill_random_bad_arguments_write_nothing(args, match):
    t = torch.zeros(100, 4)
    with pytest.raises(ValueError, match=match):
        speedtorch_ops.fill_random_(t, *args)
    with pytest.raises(ValueError, match="threads must be at least 1"):
        speedtorch_ops.fill_random_(t, "normal", 0.0, 1.0, threads=0)
    with pytest.raises(ValueError, match="floating-point"):
        speedtorch_ops.fill_random_(torch.zeros(4, dtype=torch.int64), "normal", 0.0, 1.0)
    assert (t == 0).all()


def test_empty_pinned_passes_progress(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(memory, "progress_bar", rec)
    t = speedtorch_ops.empty_pinned((4, 4), pin=False, progress=True)
    assert t.shape == (4, 4) and rec.updates == 0  # nothing pinned, nothing reported


# GPU: the CUDA runtime torch loaded, through ctypes, to see which pages are registered without
# leaving an error behind (a failed runtime call would surface in torch's next launch check).
class _PointerAttributes(ctypes.Structure):
    # CUDA 13's layout (driver_types.h): 8 reserved longs follow the pointers; a struct without
    # them is overrun by the runtime.
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("reserved", ctypes.c_long * 8)]


def _runtime():
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line}
    assert paths, "torch's CUDA runtime is not loaded"
    rt = ctypes.CDLL(sorted(paths)[0])
    rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    rt.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_PointerAttributes), ctypes.c_void_p]
    return rt


def _register(addr, nbytes):
    rt = _runtime()
    ok = rt.cudaHostRegister(addr, nbytes, 0) == 0
    rt.cudaGetLastError()
    return ok


def _unregister(addr):
    rt = _runtime()
    assert rt.cudaHostUnregister(addr) == 0
    rt.cudaGetLastError()


def _is_registered(addr):
    """True when the byte at addr lies in page-locked (registered) host memory."""
    rt = _runtime()
    attr = _PointerAttributes()
    err = rt.cudaPointerGetAttributes(ctypes.byref(attr), addr)
    rt.cudaGetLastError()
    return err == 0 and attr.type == 1  # cudaMemoryTypeHost


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_pin_in_pieces_reads_across_piece_boundaries(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(memory, "progress_bar", rec)
    rows, width = 40_000, 33  # 5.03 MiB: six 1 MiB pieces, the first one short
    t = torch.randn(rows, width)
    ref = t.clone()
    ptr = t.data_ptr()
    speedtorch_ops.pin_(t, piece_bytes=MIB, progress=True)
    assert t.data_ptr() == ptr and t.is_pinned() and torch.equal(t, ref)
    assert rec.total == t.numel() * 4 and rec.updates >= 5  # one update per piece
    for offset in range(0, t.numel() * 4, MIB // 2):
        assert _is_registered(ptr + offset), offset
    idx = torch.arange(rows, device="cuda").flip(0)
    assert torch.equal(speedtorch_ops.pinned_gather(t, idx).cpu(), ref.flip(0))
    src = torch.randn(rows, width, device="cuda")
    speedtorch_ops.pinned_scatter(t, idx, src)
    torch.cuda.synchronize()
    assert torch.equal(t, src.flip(0).cpu())


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_freeing_or_unpinning_unregisters_every_piece():
    # NumPy owns the memory, so it outlives the tensor and its registration can be checked.
    owner = np.ones(3 * MIB + 123, dtype=np.uint8)
    addr = owner.ctypes.data
    t = torch.from_numpy(owner)
    speedtorch_ops.pin_(t, piece_bytes=MIB)
    assert all(_is_registered(addr + o) for o in range(0, owner.size, MIB))
    del t  # the last reference: the wrapped deleter unregisters, then NumPy's reference drops
    assert not any(_is_registered(addr + o) for o in range(0, owner.size, MIB))
    t = torch.from_numpy(owner)
    speedtorch_ops.pin_(t, piece_bytes=MIB)
    speedtorch_ops.unpin_(t)
    assert not t.is_pinned() and not any(_is_registered(addr + o) for o in range(0, owner.size, MIB))
    assert bool(t.eq(1).all())
    speedtorch_ops.pin_(t)  # pinnable again, one piece
    assert t.is_pinned()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_refused_piece_leaves_nothing_pinned():
    owner = np.zeros(4 * MIB, dtype=np.uint8)
    t = torch.from_numpy(owner)
    addr = t.data_ptr()
    # Someone registered a page in the third piece: that piece's registration is refused.
    blocker = (addr + 2 * MIB + 4096 * 3) // 4096 * 4096
    assert _register(blocker, 4096)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)could not pin.*RLIMIT_MEMLOCK.*Fix:.*"
                                                r"Nothing was left pinned"):
            speedtorch_ops.pin_(t, piece_bytes=MIB)
        assert not t.is_pinned() and not _is_registered(addr) and not _is_registered(addr + MIB)
    finally:
        _unregister(blocker)
    speedtorch_ops.pin_(t, piece_bytes=MIB)  # and the table can be pinned afterwards
    assert t.is_pinned()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_empty_pinned_of_several_default_pieces():
    # 2.5 GiB: three pieces of the default size, a progress bar by default (>= 1 GiB).
    rows = (5 << 30) // 2 // 512
    t = speedtorch_ops.empty_pinned((rows, 128), torch.float32)
    assert t.is_pinned() and t.untyped_storage().nbytes() == rows * 512
    boundary = memory.PIECE_BYTES // 512
    near = torch.tensor([0, boundary - 1, boundary, 2 * boundary - 1, 2 * boundary, rows - 1])
    t[near] = torch.arange(6, dtype=torch.float32)[:, None]
    out = speedtorch_ops.pinned_gather(t, near.cuda()).cpu()
    assert torch.equal(out, torch.arange(6, dtype=torch.float32)[:, None].expand(6, 128))


MEMLOCK_SCRIPT = r"""
import resource, torch, speedtorch_ops
soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, hard))
torch.cuda.init()
t = torch.empty(64 << 20, dtype=torch.uint8)
try:
    speedtorch_ops.pin_(t)
    print("PINNED", t.is_pinned())
except RuntimeError as e:
    print("REFUSED", t.is_pinned(), str(e).replace("\n", " "))
"""


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_memlock_limit_refusal_is_clear_or_not_applied():
    """Under a 64 KiB memlock limit, pinning 64 MiB either works (the driver does not count
    registered memory against RLIMIT_MEMLOCK) or fails with the limit named and nothing pinned."""
    r = subprocess.run([sys.executable, "-c", MEMLOCK_SCRIPT], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    print(line)
    if line.startswith("REFUSED"):
        assert line.startswith("REFUSED False") and "65536 bytes" in line and "ulimit -l" in line
    else:
        assert line == "PINNED True"
