"""Pinned host memory for tables: made, pinned in place and initialised without a second
full-size copy, and costing the table's bytes (torch's pinned allocator rounds large blocks up to
a power of two, so a 5 GiB table would hold 8 GiB). ``speedtorch_ops.io`` loads tables from
files; it builds on this module, which imports nothing else of the package.

Tables of tens of GiB are pinned in pieces (one ``cudaHostRegister`` per piece), and work on
tables of ``PROGRESS_MIN_BYTES`` or more shows a progress bar (tqdm, when installed) unless the
caller passes ``progress=False``."""

import math
import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

try:
    import resource
except ImportError:  # not on Windows, where there is no memlock limit to report
    resource = None

# The most bytes one cudaHostRegister call pins: a driver may refuse one registration of tens of
# GiB that it accepts in pieces, and pieces give the progress bar its steps.
PIECE_BYTES = 1 << 30
# Work on this many bytes or more shows a progress bar by default.
PROGRESS_MIN_BYTES = 1 << 30
# Initialising, copying and streaming go this many bytes at a time (a progress bar's step).
CHUNK_BYTES = 64 << 20
# empty_pinned takes tables of this many bytes or more from an anonymous mapping advised to use
# transparent huge pages: pinning faults every page in, and with 2 MiB pages a table pins in
# about half the time of 4 KiB pages, fills as fast and gathers at the same zero-copy rate
# (see docs/decisions.md, "Huge pages for pinned tables").
HUGE_PAGE_MIN_BYTES = 64 << 20


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total_bytes: int, desc: str, progress: Optional[bool] = None):
    """A tqdm bar counting ``total_bytes`` (call ``update(n)``, then ``close()``), or a bar that
    shows nothing: when ``progress`` is False, when it is None and the work is smaller than
    ``PROGRESS_MIN_BYTES``, or when tqdm is not installed."""
    if progress is None:
        progress = total_bytes >= PROGRESS_MIN_BYTES
    if not progress:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return _NoBar()
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                mininterval=0.5)


def _storage_nbytes(tensor: Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _gib(nbytes: Union[int, float]) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _memlock_text(limit: Optional[int]) -> str:
    if limit is None:
        return "unknown"
    return "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes ({_gib(limit)})"


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pin_failure_message(nbytes: int, cause: BaseException) -> str:
    """The error pin_ raises when the driver refuses to page-lock ``nbytes``: the size, the
    locked-memory limit (RLIMIT_MEMLOCK), the memory available and the fixes."""
    if resource is None:
        soft = hard = None
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    available = _mem_available()
    avail = "unknown" if available is None else _gib(available)
    return (f"could not pin a table of {nbytes} bytes ({_gib(nbytes)}): {cause}. "
            f"The locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`) is {_memlock_text(soft)} "
            f"(hard limit {_memlock_text(hard)}); the machine has {avail} available. "
            "Fix: raise the limit for the process that pins (`ulimit -l unlimited` in its shell; "
            "`docker run --ulimit memlock=-1`; `LimitMEMLOCK=infinity` for a systemd service; "
            "`memlock` in /etc/security/limits.conf), free host memory, or make the table "
            "smaller. Nothing was left pinned.")


def pin_(tensor: Tensor, piece_bytes: Optional[int] = None,
         progress: Optional[bool] = None) -> Tensor:
    """Page-lock ``tensor``'s CPU storage in place (no copy) and return ``tensor``.

    The storage is registered in pieces of at most ``piece_bytes`` (default ``PIECE_BYTES``);
    it stays pinned until it is freed (or ``unpin_``). When the driver refuses (the memlock
    limit, or memory), a RuntimeError names the size, the limit and the fix, and nothing is left
    pinned. ``progress``: a bar (default: for ``PROGRESS_MIN_BYTES`` or more). Needs a CUDA build
    and a CUDA device."""
    if not tensor.is_contiguous():
        raise ValueError("pin_: tensor must be contiguous (pin the table itself, not a view)")
    piece = PIECE_BYTES if piece_bytes is None else int(piece_bytes)
    if piece <= 0:
        raise ValueError(f"pin_: piece_bytes must be > 0, got {piece}")
    if torch.cuda.is_available():
        # PyTorch reports memory as pinned (Tensor.is_pinned, which the ops check) only once it
        # has initialised CUDA itself; a table pinned first thing in a process was not seen as
        # pinned (seen on a GPU machine).
        torch.cuda.init()
    nbytes = _storage_nbytes(tensor)
    bar = progress_bar(nbytes, "pinning", progress)
    done = 0
    try:
        while True:
            now = torch.ops.speedtorch_ops._pin_storage_pieces_.default(tensor, piece, 1)
            bar.update(now - done)
            done = now
            if done >= nbytes:
                return tensor
    except BaseException as e:
        # Also on KeyboardInterrupt between pieces: never leave a table half-pinned.
        torch.ops.speedtorch_ops._unpin_storage_.default(tensor)
        if isinstance(e, RuntimeError) and "cudaHostRegister refused" in str(e):
            raise RuntimeError(pin_failure_message(nbytes, e)) from e
        raise
    finally:
        bar.close()


def unpin_(tensor: Tensor) -> Tensor:
    """Unregister the storage that ``pin_`` / ``empty_pinned`` pinned (the memory and data stay);
    a no-op for memory they did not pin. Returns ``tensor``."""
    torch.ops.speedtorch_ops._unpin_storage_.default(tensor)
    return tensor


def empty_pinned(shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32,
                 pin: bool = True, *, piece_bytes: Optional[int] = None,
                 progress: Optional[bool] = None) -> Tensor:
    """An uninitialised contiguous CPU table of ``shape``; page-locked when ``pin`` (the default),
    so CUDA indices read it in place. ``pin=False`` gives ordinary memory (CPU-only machines).
    ``piece_bytes`` and ``progress`` as in ``pin_``."""
    table = _huge_page_table(shape, dtype) if pin else None
    if table is None:
        table = torch.empty(shape, dtype=dtype, device="cpu")
    return pin_(table, piece_bytes=piece_bytes, progress=progress) if pin else table


def _huge_page_table(shape: Union[int, Sequence[int]], dtype: torch.dtype) -> Optional[Tensor]:
    """An uninitialised CPU tensor in a fresh anonymous mapping advised MADV_HUGEPAGE before any
    page exists (the kernel then backs it with 2 MiB pages where it can), or None for tables under
    HUGE_PAGE_MIN_BYTES and where the platform has no such advice. The mapping lives as long as
    the tensor's storage (which holds it) and is unmapped with it."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def _row_chunks(table: Tensor, chunk_bytes: int) -> list:
    """Views of ``table``'s consecutive rows (dim 0), about ``chunk_bytes`` each."""
    rows = table.view(1, *table.shape) if table.dim() == 0 else table
    row_bytes = max(1, rows[0].numel() * rows.element_size())
    step = max(1, chunk_bytes // row_bytes)
    return [rows[start:start + step] for start in range(0, rows.shape[0], step)]


def initialize_(table: Tensor, init: Callable[[Tensor], object], *,
                progress: Optional[bool] = None, chunk_bytes: int = CHUNK_BYTES) -> Tensor:
    """Apply the in-place ``init`` (e.g. ``lambda t: t.zero_()``) to ``table`` one chunk of
    about ``chunk_bytes`` at a time (whole rows, ``init`` gets a contiguous view), with a
    progress bar for large tables. Random initialisers draw the same numbers for the same seed
    and ``chunk_bytes``, on one thread (torch draws CPU random numbers serially):
    ``fill_random_`` fills on all threads. Returns ``table``."""
    if not table.is_contiguous():
        raise ValueError("initialize_: table must be contiguous")
    if table.numel() == 0:
        return table
    bar = progress_bar(table.numel() * table.element_size(), "initialising", progress)
    try:
        for chunk in _row_chunks(table, chunk_bytes):
            init(chunk)
            bar.update(chunk.numel() * chunk.element_size())
    finally:
        bar.close()
    return table


RANDOM_FILLS = {"uniform": "uniform_", "normal": "normal_"}


def fill_random_(table: Tensor, distribution: str, a: float, b: float, *,
                 generator: Optional[torch.Generator] = None, threads: Optional[int] = None,
                 chunk_bytes: int = CHUNK_BYTES, progress: Optional[bool] = None) -> Tensor:
    """Fill a CPU ``table`` (any strides) in place with random numbers on ``threads`` threads
    (default: torch's): ``"uniform"`` on [a, b) or ``"normal"`` with mean a and standard
    deviation b. Each chunk of about ``chunk_bytes`` of rows draws from its own generator, seeded
    from one number drawn from ``generator`` (default: torch's default generator), so a seed and
    ``chunk_bytes`` give the same table on any number of threads. Returns ``table``."""
    if distribution not in RANDOM_FILLS:
        raise ValueError(f"fill_random_: distribution must be one of {sorted(RANDOM_FILLS)}, got "
                         f"{distribution!r}")
    if table.device.type != "cpu":
        raise ValueError(f"fill_random_: table must be on the CPU, got {table.device}")
    if not table.is_floating_point():
        raise ValueError(f"fill_random_: table must be a floating-point table, got {table.dtype}")
    if distribution == "uniform" and not a <= b:
        raise ValueError(f"fill_random_: uniform needs a <= b, got a={a}, b={b}")
    if distribution == "normal" and not b >= 0:
        raise ValueError(f"fill_random_: normal needs a standard deviation b >= 0, got b={b}")
    workers = torch.get_num_threads() if threads is None else int(threads)
    if workers < 1:
        raise ValueError(f"fill_random_: threads must be at least 1, got {threads}")
    if table.numel() == 0:
        return table
    chunks = _row_chunks(table, chunk_bytes)
    base = int(torch.randint(0, 2**62, (), generator=generator))
    method = RANDOM_FILLS[distribution]

    def fill(i: int) -> int:
        chunk = chunks[i]
        gen = torch.Generator().manual_seed(base + i)
        getattr(chunk, method)(a, b, generator=gen)  # releases the GIL while it draws
        return chunk.numel() * chunk.element_size()

    bar = progress_bar(table.numel() * table.element_size(), "initialising", progress)
    try:
        if workers == 1 or len(chunks) == 1:
            for i in range(len(chunks)):
                bar.update(fill(i))
        else:
            # Each chunk's kernel runs on one thread: the pool's threads are the parallelism.
            with ThreadPoolExecutor(min(workers, len(chunks))) as pool:
                for nbytes in pool.map(fill, range(len(chunks))):
                    bar.update(nbytes)
    finally:
        bar.close()
    return table


def is_zero_copy_usable(table: Tensor) -> bool:
    """True when a CUDA index can read ``table`` in place: a CUDA tensor, or a contiguous CPU
    tensor in pinned (page-locked, mapped) memory."""
    if table.is_cuda:
        return True
    return (table.device.type == "cpu" and table.is_contiguous() and torch.cuda.is_available()
            and table.is_pinned())
