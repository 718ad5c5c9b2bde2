"""Streamed, atomic saving and loading (speedtorch_ops.io): .npy, safetensors, torch checkpoints,
torch.distributed.checkpoint. Peak memory and killed saves are checked in subprocesses."""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import speedtorch_ops
from speedtorch_ops import io, memory

HAS_CUDA = torch.cuda.is_available()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMPY_DTYPES = [torch.float32, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16,
                torch.int32, torch.int64, torch.bool]
ALL_DTYPES = NUMPY_DTYPES + [torch.bfloat16]


def data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 10).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def run_script(script, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


class Recorder:
    def __init__(self):
        self.bytes = 0

    def __call__(self, total_bytes, desc, progress=None):
        self.expected = total_bytes
        return self

    def update(self, n):
        self.bytes += n

    def close(self):
        pass


# --- .npy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(1003, 7), (50,), (), (0, 4), (3, 4, 5)])
def test_npy_round_trip_in_small_chunks(tmp_path, dtype, shape):
    table = data(shape, dtype)
    path = tmp_path / "t.npy"
    io.save_npy(table, path, chunk_bytes=100)
    assert np.array_equal(np.load(path), table.numpy())  # a plain .npy file
    assert sorted(os.listdir(tmp_path)) == ["t.npy"]  # no temporary file left
    loaded = io.load_npy(path, pin=False, chunk_bytes=100)
    assert loaded.dtype == dtype and torch.equal(loaded, table)
    out = torch.zeros_like(table)
    ptr = out.data_ptr()
    assert io.load_npy(path, out=out, chunk_bytes=64) is out
    assert out.data_ptr() == ptr and torch.equal(out, table)


def test_npy_reads_files_numpy_wrote_and_writes_non_contiguous(tmp_path):
    a = np.arange(60, dtype=np.float32).reshape(6, 10)
    np.save(tmp_path / "np.npy", a)
    assert torch.equal(io.load_npy(tmp_path / "np.npy", pin=False), torch.from_numpy(a))
    t = torch.from_numpy(a).t()  # non-contiguous: written row chunk by row chunk
    io.save_npy(t, tmp_path / "t.npy", chunk_bytes=16)
    assert np.array_equal(np.load(tmp_path / "t.npy"), a.T)


def test_npy_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="no dtype for torch.bfloat16.*save_safetensors"):
        io.save_npy(torch.zeros(3, dtype=torch.bfloat16), tmp_path / "b.npy")
    np.save(tmp_path / "a.npy", np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"holds torch.float32 of shape \(4, 3\).*out is "
                                         r"torch.float32 of shape \(4, 4\)"):
        io.load_npy(tmp_path / "a.npy", out=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="out must be a contiguous CPU tensor"):
        io.load_npy(tmp_path / "a.npy", out=torch.zeros(3, 4).t())
    np.save(tmp_path / "be.npy", np.zeros(3, ">f4"))
    with pytest.raises(ValueError, match="little-endian"):
        io.load_npy(tmp_path / "be.npy", pin=False)
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((3, 2), np.float32)))
    with pytest.raises(ValueError, match="C-ordered"):
        io.load_npy(tmp_path / "f.npy", pin=False)
    raw = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "short.npy").write_bytes(raw[:-5])
    with pytest.raises(ValueError, match="truncated"):
        io.load_npy(tmp_path / "short.npy", pin=False)


def test_package_load_npy_is_the_streamed_loader(tmp_path):
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    np.save(tmp_path / "a.npy", a)
    assert speedtorch_ops.load_npy is io.load_npy
    assert torch.equal(speedtorch_ops.load_npy(str(tmp_path / "a.npy"), pin=False),
                       torch.from_numpy(a))
    with pytest.raises(TypeError, match="keyword-only"):
        speedtorch_ops.load_npy(str(tmp_path / "a.npy"), False)


def test_io_builds_on_memory_without_a_cycle():
    # memory imports nothing of the package (one load_npy: io's); io loads in a fresh interpreter.
    assert not hasattr(memory, "load_npy")
    assert "from ." not in open(memory.__file__).read()
    subprocess.run([sys.executable, "-c", "import speedtorch_ops.io"], check=True, cwd=REPO)


def test_progress_counts_every_byte(monkeypatch, tmp_path):
    rec = Recorder()
    monkeypatch.setattr(io, "progress_bar", rec)
    table = data((300, 9), torch.float32)
    io.save_npy(table, tmp_path / "t.npy", chunk_bytes=1000)
    assert rec.bytes == rec.expected == table.numel() * 4
    rec.bytes = 0
    io.load_npy(tmp_path / "t.npy", out=torch.empty_like(table), chunk_bytes=1000, progress=True)
    assert rec.bytes == table.numel() * 4
    rec.bytes = 0
    io.save_safetensors({"a": table, "b": table[:10]}, tmp_path / "t.st", chunk_bytes=1000)
    io.load_safetensors(tmp_path / "t.st", pin=False)
    assert rec.bytes == 2 * 310 * 9 * 4


# --- safetensors ------------------------------------------------------------------------

def test_safetensors_round_trip_every_dtype_in_place_and_new(tmp_path):
    tensors = {f"t_{str(d).split('.')[-1]}": data((37, 3), d, seed=i)
               for i, d in enumerate(ALL_DTYPES)}
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 5)
    path = tmp_path / "t.safetensors"
    io.save_safetensors(tensors, path, metadata={"step": "7"}, chunk_bytes=50)
    loaded = io.load_safetensors(path, pin=False, chunk_bytes=50)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    out = {name: torch.zeros_like(t) for name, t in tensors.items()}
    ptrs = {name: t.data_ptr() for name, t in out.items()}
    io.load_safetensors(path, out=out, chunk_bytes=50)
    for name, t in tensors.items():
        assert out[name].data_ptr() == ptrs[name] and torch.equal(out[name], t), name
    assert io.read_safetensors_header(path)[1] == {"step": "7"}


def test_safetensors_file_layout(tmp_path):
    path = tmp_path / "t.safetensors"
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, 2], dtype=torch.int16)
    io.save_safetensors({"a": a, "b": b}, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["b"] == {"dtype": "I16", "shape": [2], "data_offsets": [24, 28]}
    assert raw[8 + n:] == a.numpy().tobytes() + b.numpy().tobytes()


def test_safetensors_errors_are_clear(tmp_path):
    path = tmp_path / "t.safetensors"
    io.save_safetensors({"a": torch.zeros(4, 2), "b": torch.zeros(3)}, path)
    with pytest.raises(ValueError, match=r"lacks \['c'\] and has unexpected \['b'\]"):
        io.load_safetensors(path, out={"a": torch.zeros(4, 2), "c": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected"):
        io.load_safetensors(path, out={"a": torch.zeros(4, 2)})
    a = torch.ones(4, 2)
    io.load_safetensors(path, out={"a": a}, strict=False)
    assert not a.any()
    with pytest.raises(ValueError, match=r"load_safetensors\(a\).*shape \(4, 2\).*shape \(2, 4\)"):
        io.load_safetensors(path, out={"a": torch.zeros(2, 4), "b": torch.zeros(3)})
    raw = path.read_bytes()
    (tmp_path / "short").write_bytes(raw[:-4])
    with pytest.raises(ValueError, match="truncated"):
        io.load_safetensors(tmp_path / "short", pin=False)
    (tmp_path / "junk").write_bytes(b"\xff" * 20)
    with pytest.raises(ValueError, match="not a safetensors file"):
        io.load_safetensors(tmp_path / "junk", pin=False)
    with pytest.raises(ValueError, match="complex"):
        io.save_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, path)


def test_safetensors_package_reads_ours_and_we_read_its(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {"w": data((33, 5), torch.bfloat16), "i": data((7,), torch.int64),
               "m": data((4, 4), torch.bool), "h": data((2, 3, 4), torch.float16)}
    io.save_safetensors(tensors, tmp_path / "ours.safetensors", metadata={"k": "v"})
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(theirs[k], v) for k, v in tensors.items())
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"k": "v"})
    ours = io.load_safetensors(tmp_path / "theirs.safetensors", pin=False)
    assert all(torch.equal(ours[k], v) for k, v in tensors.items())


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_loads_into_new_and_existing_pinned_tables(tmp_path):
    table = data((5000, 33), torch.float32)
    io.save_npy(table, tmp_path / "t.npy")
    io.save_safetensors({"t": table}, tmp_path / "t.st")
    fresh = io.load_npy(tmp_path / "t.npy")
    assert fresh.is_pinned() and torch.equal(fresh, table)
    fresh = io.load_safetensors(tmp_path / "t.st")["t"]
    assert fresh.is_pinned() and torch.equal(fresh, table)
    pinned = speedtorch_ops.empty_pinned(table.shape, piece_bytes=1 << 20).zero_()
    io.load_npy(tmp_path / "t.npy", out=pinned)
    assert pinned.is_pinned() and torch.equal(pinned, table)
    idx = torch.arange(5000, device="cuda")
    assert torch.equal(speedtorch_ops.pinned_gather(pinned, idx).cpu(), table)
    pinned.zero_()
    io.load_safetensors(tmp_path / "t.st", out={"t": pinned})
    assert torch.equal(pinned, table)


# --- atomic saves ---------------------------------------------------------------------------

KILLED_SAVE = """
    import sys, time, torch
    from speedtorch_ops import io
    path, fmt = sys.argv[1], sys.argv[2]
    write = io._write
    def write_then_stall(f, buffer):  # the first chunk is out, the rest never comes
        write(f, buffer)
        print("WRITING", flush=True)
        time.sleep(300)
    io._write = write_then_stall
    table = torch.full((1000, 64), 7.0)
    if fmt == "npy":
        io.save_npy(table, path, chunk_bytes=4096)
    else:
        io.save_safetensors({"t": table}, path, chunk_bytes=4096)
"""


@pytest.mark.parametrize("fmt", ["npy", "safetensors"])
def test_killed_save_leaves_the_previous_file(tmp_path, fmt):
    path = tmp_path / f"table.{fmt}"
    previous = torch.ones(1000, 64)
    save, load = ((io.save_npy, io.load_npy) if fmt == "npy" else
                  (lambda t, p: io.save_safetensors({"t": t}, p),
                   lambda p, pin: io.load_safetensors(p, pin=pin)["t"]))
    save(previous, path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_SAVE), str(path), fmt],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", proc.stderr.read() if proc.poll() is not None else line
        strays = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        assert len(strays) == 1 and strays[0].startswith(f".table.{fmt}.")  # beside the target
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    assert torch.equal(load(path, pin=False), previous)


def test_failed_save_removes_its_temporary_file_and_keeps_the_previous(tmp_path, monkeypatch):
    path = tmp_path / "t.npy"
    io.save_npy(torch.ones(100), path)

    def broken(f, buffer):
        raise OSError("disk full")
    monkeypatch.setattr(io, "_write", broken)
    with pytest.raises(OSError, match="disk full"):
        io.save_npy(torch.zeros(100), path)
    assert os.listdir(tmp_path) == ["t.npy"] and np.array_equal(np.load(path), np.ones(100))


def test_atomic_write_replaces_and_keeps_the_umask_permissions(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with io.atomic_write(path) as f:
        f.write(b"new")
        assert path.read_bytes() == b"old"  # not visible until the block completes
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_bytes() == b"new" and (os.stat(path).st_mode & 0o777) == 0o666 & ~umask


# --- peak memory ------------------------------------------------------------------------------

PEAK_RSS = """
    import os, sys, torch
    from speedtorch_ops import io, memory
    directory, table_mib, chunk_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    chunk = chunk_mib << 20

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith(key + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS: what the imports peaked at does not count
    base = status("VmRSS")
    table = torch.empty(table_mib << 18)  # float32
    memory.initialize_(table, lambda c: c.uniform_(), chunk_bytes=chunk)
    checksum = float(table.sum())
    npy, st = os.path.join(directory, "t.npy"), os.path.join(directory, "t.st")
    io.save_npy(table, npy, chunk_bytes=chunk)
    io.save_safetensors({"t": table}, st, chunk_bytes=chunk)
    table.zero_()
    io.load_npy(npy, out=table, chunk_bytes=chunk)
    assert float(table.sum()) == checksum
    table.zero_()
    io.load_safetensors(st, out={"t": table}, chunk_bytes=chunk)
    assert float(table.sum()) == checksum
    del table
    table = io.load_npy(npy, pin=False, chunk_bytes=chunk)
    assert float(table.sum()) == checksum
    del table
    table = io.load_safetensors(st, pin=False, chunk_bytes=chunk)["t"]
    assert float(table.sum()) == checksum
    print(base, status("VmHWM"))
"""


def test_peak_rss_of_streamed_saves_and_loads_is_table_plus_chunk(tmp_path):
    table_mib, chunk_mib, slack_mib = 256, 16, 32
    r = run_script(PEAK_RSS, tmp_path, table_mib, chunk_mib)
    assert r.returncode == 0, r.stderr
    base, peak = map(int, r.stdout.split())
    grown = (peak - base) >> 20
    assert grown < table_mib + chunk_mib + slack_mib, f"peak grew {grown} MiB"


CHECKPOINT_ANON = """
    import os, sys, torch
    from speedtorch_ops import io

    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) << 10 for l in f if l.startswith("RssAnon:"))

    path, table_mib = sys.argv[1], int(sys.argv[2])
    table = torch.rand(table_mib << 18)
    io.save_checkpoint({"weight": table, "state": {"step": 3, "exp_avg": table[:10].clone()}}, path)
    expected = table.clone()
    table.zero_()
    before = anon()
    sd = io.load_checkpoint(path)
    io.copy_into_(table, sd["weight"], chunk_bytes=8 << 20)
    assert torch.equal(table, expected) and sd["state"]["step"] == 3
    mapped = anon() - before
    del sd
    before = anon()
    plain = torch.load(path, map_location="cpu")  # without mmap: a second copy of the table
    print(mapped >> 20, (anon() - before) >> 20)
"""


def test_memory_mapped_checkpoint_does_not_duplicate_the_table(tmp_path):
    table_mib = 128
    r = run_script(CHECKPOINT_ANON, tmp_path / "ck.pt", table_mib)
    assert r.returncode == 0, r.stderr
    mapped_mib, plain_mib = map(int, r.stdout.split())
    assert plain_mib >= table_mib * 0.9, "the measurement cannot see a second copy"
    assert mapped_mib < 16, f"loading through the memory map added {mapped_mib} MiB"


def test_checkpoint_round_trip_and_copy_into_checks(tmp_path):
    sd = {"weight": data((20, 3), torch.float32), "step": 4}
    io.save_checkpoint(sd, tmp_path / "ck.pt")
    assert os.listdir(tmp_path) == ["ck.pt"]
    loaded = io.load_checkpoint(tmp_path / "ck.pt")
    assert loaded["step"] == 4 and torch.equal(loaded["weight"], sd["weight"])
    with pytest.raises(ValueError, match=r"source is torch.float32 of shape \(20, 3\)"):
        io.copy_into_(torch.zeros(20, 4), loaded["weight"])
    dst = torch.zeros(20, 3)
    assert io.copy_into_(dst, loaded["weight"], chunk_bytes=24) is dst
    assert torch.equal(dst, sd["weight"])


# --- torch.distributed.checkpoint -------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_distributed_checkpoint_saves_and_loads_pinned_tables_in_place(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    pin = HAS_CUDA

    def table(shape, seed):
        return memory.empty_pinned(shape, pin=pin).copy_(data(shape, torch.float32, seed))
    state = {"weight": table((1000, 16), 0),
             "optimizer": {"exp_avg": table((1000, 16), 1), "exp_avg_sq": table((1000, 16), 2),
                           "step": torch.tensor(5.0)}}
    expected = {"weight": state["weight"].clone(),
                "exp_avg": state["optimizer"]["exp_avg"].clone()}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    ptrs = (state["weight"].data_ptr(), state["optimizer"]["exp_avg"].data_ptr())
    state["weight"].zero_()
    state["optimizer"]["exp_avg"].zero_()
    state["optimizer"]["step"].zero_()
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))
    assert (state["weight"].data_ptr(), state["optimizer"]["exp_avg"].data_ptr()) == ptrs
    assert torch.equal(state["weight"], expected["weight"])
    assert torch.equal(state["optimizer"]["exp_avg"], expected["exp_avg"])
    assert state["optimizer"]["step"].item() == 5.0
    assert state["weight"].is_pinned() == pin
