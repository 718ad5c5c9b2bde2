"""Saving and loading tables of tens of GiB: streamed, in place, atomic.

- ``.npy`` and safetensors are written straight from the table's memory and read straight into
  the destination table (``read`` into its bytes, no memory map), so the host never holds more
  than the table itself; ``chunk_bytes`` only sets the size of each read or write (the progress
  bar's step).
- A load either fills existing (pinned) tensors in place, shape and dtype checked, or makes new
  pinned ones.
- Every save is atomic: it writes a temporary file in the destination's directory, fsyncs it and
  renames it over the destination, so a process killed mid-save leaves the previous file intact
  (and at worst a stray ``.<name>.<random>.tmp`` beside it).
- ``load_checkpoint`` memory-maps a ``torch.save`` file, so copying its tables into pinned ones
  (``copy_into_``) duplicates nothing in anonymous memory.
"""

import contextlib
import json
import math
import os
import secrets
import struct
import warnings
from typing import Dict, Iterator, Mapping, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .memory import CHUNK_BYTES, empty_pinned, progress_bar

PathLike = Union[str, os.PathLike]

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_SAFETENSORS_TORCH = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}


@contextlib.contextmanager
def atomic_write(path: PathLike) -> Iterator:
    """Open a binary file that replaces ``path`` only once the ``with`` block completes: written
    to a temporary file in the same directory (a rename across file systems is not atomic),
    fsynced, then renamed over ``path``. An exception removes the temporary file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # os.open applies the umask to 0o666, so the file gets the permissions open() would give.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename itself survives a crash only once the directory is on disk.
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write(f, buffer: np.ndarray) -> None:
    """One chunk to ``f`` (a seam for tests that stop a save midway)."""
    f.write(buffer)


def _byte_chunks(tensor: Tensor, chunk_bytes: int) -> Iterator[np.ndarray]:
    """``tensor``'s bytes in C order as uint8 arrays of about ``chunk_bytes``: views of its own
    memory for a contiguous CPU tensor, else one copied chunk of whole rows at a time."""
    if tensor.numel() == 0:
        return
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        flat = tensor.reshape(-1).view(torch.uint8).numpy()
        for start in range(0, flat.size, chunk_bytes):
            yield flat[start:start + chunk_bytes]
        return
    rows = tensor.reshape(1, *tensor.shape) if tensor.dim() == 0 else tensor
    step = max(1, chunk_bytes // max(1, rows[0].numel() * rows.element_size()))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step].cpu().contiguous()
        yield chunk.reshape(-1).view(torch.uint8).numpy()


def _write_tensor(f, tensor: Tensor, chunk_bytes: int, bar) -> None:
    for chunk in _byte_chunks(tensor, chunk_bytes):
        _write(f, chunk)
        bar.update(chunk.size)


def _read_into(f, tensor: Tensor, chunk_bytes: int, bar, path: str) -> None:
    """Fill ``tensor`` with the next bytes of ``f``: read straight into a contiguous CPU tensor;
    into any other (a strided view, such as a module's optimizer state inside its rows, or a
    GPU tensor) a chunk of rows at a time through a buffer."""
    if tensor.numel() == 0:
        return
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        _read_bytes(f, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), chunk_bytes,
                    bar, path)
        return
    if tensor.dim() == 0:
        tensor = tensor.view(1)
    step = max(1, chunk_bytes // max(1, tensor[0].numel() * tensor.element_size()))
    for start in range(0, tensor.shape[0], step):
        part = tensor[start:start + step]
        buffer = torch.empty(part.shape, dtype=part.dtype)
        _read_bytes(f, memoryview(buffer.reshape(-1).view(torch.uint8).numpy()), chunk_bytes,
                    bar, path)
        part.copy_(buffer)


def _read_bytes(f, view: memoryview, chunk_bytes: int, bar, path: str) -> None:
    """Fill `view` with the next bytes of ``f``."""
    pos = 0
    while pos < len(view):
        n = f.readinto(view[pos:pos + chunk_bytes])
        if not n:
            raise ValueError(f"{path} is truncated: it ends {len(view) - pos} bytes before the "
                             "end of its data")
        pos += n
        bar.update(n)


def _check_target(out: Tensor, shape: Tuple[int, ...], dtype: torch.dtype, what: str,
                  strided: bool = False) -> None:
    """Raise unless `out` can take a file's tensor of `shape` and `dtype` (a contiguous CPU
    tensor; with `strided`, any tensor)."""
    if not strided and (out.device.type != "cpu" or not out.is_contiguous()):
        raise ValueError(f"{what}: out must be a contiguous CPU tensor (a pinned table), got "
                         f"device {out.device}, contiguous={out.is_contiguous()}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{what}: the file holds {dtype} of shape {tuple(shape)}, but out is "
                         f"{out.dtype} of shape {tuple(out.shape)}")


def new_table(shape: Tuple[int, ...], dtype: torch.dtype, pin: bool, progress: Optional[bool],
              what: str) -> Tensor:
    """A new table for a load: pinned when `pin` and a CUDA device is present; without one in
    ordinary memory, with a warning (nothing could read it in place); a build that cannot pin on
    a machine with a GPU raises, naming ``pin=False``."""
    if pin and not torch.cuda.is_available():
        warnings.warn(f"{what}: no CUDA device, so the table is loaded into ordinary memory, "
                      "not pinned (pinned memory serves a GPU only); pass pin=False to say so",
                      stacklevel=3)
        pin = False
    try:
        return empty_pinned(shape, dtype, pin=pin, progress=progress)
    except RuntimeError as e:
        if pin and "built without CUDA" in str(e):
            raise RuntimeError(f"{what}: pin=True, but this speedtorch_ops build cannot pin "
                               "memory (it was built without CUDA); pass pin=False for an "
                               "ordinary CPU table, or rebuild with CUDA to read the table in "
                               "place from the GPU") from e
        raise


# --- .npy ---------------------------------------------------------------------------------

def _check_order(call: str, data, path) -> None:
    """Raise a TypeError naming the order of `call`'s arguments when its data argument is a path
    (NumPy's ``np.save(path, array)`` takes the path first)."""
    if isinstance(data, (str, bytes, os.PathLike)) or isinstance(path, (Tensor, Mapping)):
        raise TypeError(f"{call.partition('(')[0]}: the arguments are {call}, the data first and "
                        f"the path second (np.save takes the path first); got a "
                        f"{type(data).__name__} as the data and a {type(path).__name__} as the "
                        "path. Nothing was written.")


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise ValueError(f"save_npy: NumPy has no dtype for {dtype}; save it with "
                         "save_safetensors, or convert it first") from None


def save_npy(table, path: PathLike, *, progress: Optional[bool] = None,
             chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write ``table`` to ``path`` as a ``.npy`` file (readable by ``np.load``), streamed from
    the table's memory and atomic (a temporary file renamed over ``path``). A list of tables of
    one shape and dtype is written as their stack (k, *shape) without stacking them in memory.
    Unlike ``np.save``, ``path`` gets no ``.npy`` suffix added, and the table comes first."""
    _check_order("save_npy(table, path)", table, path)
    tables = list(table) if isinstance(table, (list, tuple)) else [table]
    if any(not isinstance(t, Tensor) for t in tables):
        raise TypeError(f"save_npy: table must be a tensor or a list of tensors, got "
                        f"{type(table).__name__} (a NumPy array: np.save, or torch.from_numpy)")
    if not tables or any(t.shape != tables[0].shape or t.dtype != tables[0].dtype
                         for t in tables):
        raise ValueError("save_npy: table must be a tensor or a non-empty list of tensors of one "
                         "shape and dtype")
    shape = tuple(tables[0].shape) if not isinstance(table, (list, tuple)) else (
        len(tables), *tables[0].shape)
    header = {"descr": np.lib.format.dtype_to_descr(_numpy_dtype(tables[0].dtype)),
              "fortran_order": False, "shape": shape}
    nbytes = sum(t.numel() * t.element_size() for t in tables)
    bar = progress_bar(nbytes, "saving", progress)
    try:
        with atomic_write(path) as f:
            try:
                np.lib.format.write_array_header_1_0(f, header)
            except ValueError:  # a header too long for version 1.0
                np.lib.format.write_array_header_2_0(f, header)
            for t in tables:
                _write_tensor(f, t, chunk_bytes, bar)
    finally:
        bar.close()


def read_npy_header(path: PathLike) -> Tuple[Tuple[int, ...], torch.dtype, int]:
    """(shape, dtype, offset of the data) of a ``.npy`` file that a table can be loaded from."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"{path}: .npy version {version} is not supported (1.0 and 2.0 are)")
        offset = f.tell()
    if dtype.byteorder == ">" or (fortran and len(shape) > 1) or dtype.fields is not None:
        raise ValueError(f"{path} must hold a plain little-endian, C-ordered array; re-save it "
                         "with np.save(path, np.ascontiguousarray(a, dtype=a.dtype.newbyteorder('<')))")
    try:
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError:
        raise ValueError(f"{path}: torch has no dtype for NumPy's {dtype}") from None
    return tuple(shape), torch_dtype, offset


def load_npy(path: PathLike, out: Optional[Tensor] = None, *, pin: bool = True,
             progress: Optional[bool] = None, chunk_bytes: int = CHUNK_BYTES) -> Tensor:
    """Load a ``.npy`` file into ``out`` in place (a contiguous CPU tensor of the file's shape and
    dtype, e.g. an existing pinned table), or into a new table (pinned when ``pin``), reading
    straight into the table's memory, so the host never holds a second copy. Also
    ``speedtorch_ops.load_npy``. Returns the table.

    ``pin`` on a machine without a CUDA device loads into ordinary memory with a warning
    (``pin=False`` says so and silences it): there pinning serves nothing, since only a GPU
    reads pinned memory in place, and a file that loads on a laptop is what a user expects. On
    a machine with a GPU whose speedtorch_ops build cannot pin (built without CUDA) it raises,
    naming ``pin=False``: there an unpinned table would quietly lose the zero-copy reads the
    table was loaded for."""
    if out is not None and not isinstance(out, Tensor):
        raise TypeError(f"load_npy: out must be a tensor or None, got {type(out).__name__} "
                        "(pin, progress and chunk_bytes are keyword-only)")
    path = os.fspath(path)
    shape, dtype, offset = read_npy_header(path)
    if out is None:
        out = new_table(shape, dtype, pin, progress, "load_npy")
    else:
        _check_target(out, shape, dtype, "load_npy")
    bar = progress_bar(out.numel() * out.element_size(), "loading", progress)
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            _read_into(f, out, chunk_bytes, bar, path)
    finally:
        bar.close()
    return out


# --- safetensors --------------------------------------------------------------------------

def save_safetensors(tensors: Mapping[str, Tensor], path: PathLike,
                     metadata: Optional[Mapping[str, str]] = None, *,
                     progress: Optional[bool] = None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write ``tensors`` (name -> tensor) to ``path`` in the safetensors format (an 8-byte
    little-endian header length, a JSON header, then each tensor's bytes back to back), streamed
    from the tensors' memory and atomic. ``metadata``: strings kept in the header."""
    _check_order("save_safetensors(tensors, path)", tensors, path)
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        if name == "__metadata__":
            raise ValueError("save_safetensors: '__metadata__' cannot name a tensor")
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"save_safetensors: {name} has dtype {t.dtype}, which safetensors "
                             "cannot hold")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    bar = progress_bar(offset, "saving", progress)
    try:
        with atomic_write(path) as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for t in tensors.values():
                _write_tensor(f, t, chunk_bytes, bar)
    finally:
        bar.close()


def read_safetensors_header(path: PathLike) -> Tuple[Dict[str, dict], Dict[str, str], int]:
    """(entries: name -> {"dtype": torch dtype, "shape", "data_offsets"}, metadata, offset of the
    data) of a safetensors file, checked against the file's size."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"{path} is not a safetensors file (header length {length} exceeds "
                             "the file)")
        header = json.loads(f.read(length))
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + length
    entries = {}
    for name, entry in header.items():
        if entry["dtype"] not in _SAFETENSORS_TORCH:
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, not supported")
        dtype = _SAFETENSORS_TORCH[entry["dtype"]]
        begin, end = entry["data_offsets"]
        expected = math.prod(entry["shape"]) * torch.empty(0, dtype=dtype).element_size()
        if end - begin != expected or begin < 0 or start + end > size:
            raise ValueError(f"{path}: tensor {name}'s data_offsets {entry['data_offsets']} do not "
                             f"fit its shape {entry['shape']} and dtype, or the file ({size} "
                             "bytes) is truncated")
        entries[name] = {"dtype": dtype, "shape": tuple(entry["shape"]),
                         "data_offsets": (begin, end)}
    return entries, metadata, start


def load_safetensors(path: PathLike, out: Optional[Mapping[str, Tensor]] = None, *,
                     pin: bool = True, strict: bool = True, progress: Optional[bool] = None,
                     chunk_bytes: int = CHUNK_BYTES) -> Dict[str, Tensor]:
    """Load a safetensors file, reading straight into the tables' memory: into ``out``'s tensors
    in place (each of the file's shape and dtype: a contiguous CPU tensor is read into
    directly, any other, such as a module's ``state_dict()`` views, through a buffer a chunk of
    rows at a time; with ``strict`` the file must hold exactly ``out``'s names, else it may hold
    more), or into new tables (pinned when ``pin``; without a CUDA device, ordinary memory and
    a warning, as ``load_npy``). Returns name -> tensor."""
    path = os.fspath(path)
    entries, _, start = read_safetensors_header(path)
    if out is None:
        out = {name: new_table(e["shape"], e["dtype"], pin, progress, "load_safetensors")
               for name, e in entries.items()}
    else:
        missing = sorted(set(out) - set(entries))
        unexpected = sorted(set(entries) - set(out)) if strict else []
        if missing or unexpected:
            raise ValueError(f"load_safetensors: {path} lacks {missing} and has unexpected "
                             f"{unexpected} (pass strict=False to ignore unexpected names)")
        for name, t in out.items():
            _check_target(t, entries[name]["shape"], entries[name]["dtype"],
                          f"load_safetensors({name})", strided=True)
    total = sum(t.numel() * t.element_size() for t in out.values())
    bar = progress_bar(total, "loading", progress)
    try:
        with open(path, "rb", buffering=0) as f:
            for name, t in out.items():
                f.seek(start + entries[name]["data_offsets"][0])
                _read_into(f, t, chunk_bytes, bar, path)
    finally:
        bar.close()
    return dict(out)


# --- torch checkpoints ----------------------------------------------------------------------

def save_checkpoint(obj: object, path: PathLike) -> None:
    """``torch.save(obj, path)``, atomic (a temporary file renamed over ``path``). Pinned tables
    are written from their own memory; they load back as ordinary CPU tensors."""
    with atomic_write(path) as f:
        torch.save(obj, f)


def load_checkpoint(path: PathLike, *, weights_only: bool = True) -> object:
    """``torch.load`` of a ``torch.save`` file, memory-mapped: its tensors are views of the file,
    read only where touched, so copying them into existing (pinned) tables with ``copy_into_``
    (or ``Tensor.copy_``) never holds a second copy of a table in anonymous memory."""
    return torch.load(os.fspath(path), map_location="cpu", mmap=True, weights_only=weights_only)


def copy_into_(dst: Tensor, src: Tensor, *, progress: Optional[bool] = None,
               chunk_bytes: int = CHUNK_BYTES) -> Tensor:
    """``dst.copy_(src)`` for tables: shape and dtype must match (a clear error otherwise), and
    the copy goes a chunk of rows at a time with a progress bar for large tables. Returns ``dst``."""
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise ValueError(f"copy_into_: source is {src.dtype} of shape {tuple(src.shape)}, the "
                         f"table is {dst.dtype} of shape {tuple(dst.shape)}")
    if dst.numel() == 0:
        return dst
    if dst.dim() == 0:
        return dst.copy_(src)
    step = max(1, chunk_bytes // max(1, dst[0].numel() * dst.element_size()))
    bar = progress_bar(dst.numel() * dst.element_size(), "copying", progress)
    try:
        for start in range(0, dst.shape[0], step):
            part = dst[start:start + step]
            part.copy_(src[start:start + step])
            bar.update(part.numel() * part.element_size())
    finally:
        bar.close()
    return dst
