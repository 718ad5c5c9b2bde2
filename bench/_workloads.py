"""Shared by the benchmarks: the tables and indices they time, and the other ways of doing the
same job that they are compared with (the PCIe memcpy of the same bytes, the best plain-PyTorch
recipe, the original SpeedTorch technique through CuPy)."""

import os
import time

import torch

import speedtorch_ops


def generator(seed=None):
    """A CPU generator; by default seeded from the clock, so repeated runs draw new rows and a
    number that holds only for one draw shows up as run-to-run spread."""
    return torch.Generator().manual_seed(int(time.time()) if seed is None else seed)


def add_seed_shape(parser):
    """The seed workload's shape as arguments: --rows of the table, --batch rows moved, --dim
    float32 values a row (the SpeedTorch README's 1 M x 128 table, 131,072 rows), and --out."""
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--batch", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))


def add_skipgram_shape(parser):
    """The main job's shape as arguments: two --vocab x --dim tables, batches of --batch centre
    words with --negatives each, drawn from a --tokens corpus (--corpus, Zipf by default) with
    planted clusters of --cluster-size words."""
    from speedtorch_ops.demo.corpus import CORPORA
    parser.add_argument("--vocab", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--negatives", type=int, default=5)
    parser.add_argument("--cluster-size", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="zipf")


def skipgram_corpus(a):
    """The corpus add_skipgram_shape parsed into `a`."""
    from speedtorch_ops.demo.corpus import CORPORA
    return CORPORA[a.corpus](a.vocab, a.cluster_size, a.tokens)


def seed_workload(a):
    """(pinned table, the same on the GPU, random CPU index) of the shape add_seed_shape parsed
    into `a`, after making the output folder."""
    os.makedirs(a.out, exist_ok=True)
    g = generator()
    table = pinned_table((a.rows, a.dim), g)
    return table, table.to("cuda"), random_index(a.rows, a.batch, g)


def random_index(rows, n, gen, order="random"):
    """`n` ids drawn uniformly from `rows` (duplicates included, like a training batch); sorted
    with order="sorted"."""
    idx = torch.randint(0, rows, (n,), generator=gen)
    return idx.sort().values if order == "sorted" else idx


def unique_index(rows, n, gen):
    """`n` distinct ids: a write-back, where each row is written once."""
    return torch.randperm(rows, generator=gen)[:n]


def pinned_table(shape, gen, dtype=torch.float32):
    """A pinned host table of random values (exactly its bytes: empty_pinned)."""
    table = speedtorch_ops.empty_pinned(shape, dtype)
    table.normal_(generator=gen)
    return table


def memcpy_paths(nbytes, device):
    """(to the device, to the host): a plain pinned <-> device copy of `nbytes`, the PCIe limit
    any indexed transfer of the same bytes is measured against."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return (lambda: dev.copy_(host, non_blocking=True),
            lambda: host.copy_(dev, non_blocking=True))


def pytorch_recipe(table, idx_cpu, var, staging):
    """(gather, scatter) the best plain-PyTorch way: index_select into pinned staging, then an
    async copy to the device; back: copy down, then index_copy_."""
    def to_var():
        torch.index_select(table, 0, idx_cpu, out=staging)
        var.copy_(staging, non_blocking=True)

    def from_var():
        staging.copy_(var)
        table.index_copy_(0, idx_cpu, staging)
    return to_var, from_var


def cupy_paths(table, idx, var):
    """(gather, scatter) the original SpeedTorch way: a CuPy array over the pinned table's memory
    (UVA) indexed by CuPy, unsorted. None without CuPy or for a dtype CuPy lacks."""
    try:
        import cupy
    except ImportError:
        return None
    dtype = {torch.float32: cupy.float32}.get(table.dtype)
    if dtype is None:
        return None
    mem = cupy.cuda.UnownedMemory(table.data_ptr(), table.nbytes, table)
    arr = cupy.ndarray(table.shape, dtype, cupy.cuda.MemoryPointer(mem, 0))
    cidx, cvar = cupy.asarray(idx), cupy.asarray(var)  # cvar shares var's memory

    def to_var():
        cvar[...] = arr[cidx]

    def from_var():
        arr[cidx] = cvar
    return to_var, from_var


def beside(side, first, second):
    """A function that queues second() on the stream `side` and first() on the current stream
    (GPU work, or host work that runs meanwhile), and returns when both are queued with the
    current stream waiting for `side`: time it to see whether the two overlap."""
    def run():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            second()
        first()
        torch.cuda.current_stream().wait_stream(side)
    return run


def big_table_case(buf, span_gib, row_bytes, n, gen, device):
    """A float32 view of `span_gib` GiB of the pinned `buf` with rows of `row_bytes`, n random
    row indices on the host and on `device`, a batch on `device` and pinned staging for it."""
    rows, dim = span_gib * (1 << 30) // row_bytes, row_bytes // 4
    table = buf[: rows * dim].view(rows, dim)
    idx_cpu = torch.randint(0, rows, (n,), generator=gen)
    return (table, idx_cpu, idx_cpu.to(device), torch.empty(n, dim, device=device),
            torch.empty(n, dim, pin_memory=True))


# Untimed calls of a hybrid route before it is timed: its split's search times a shape's first
# 20 calls at the CPU side alone, then settles within 56 (csrc/hybrid/share_search.h).
HYBRID_SETTLE_CALLS = 60


def hybrid_share(share, fn):
    """fn() with the hybrid path's zero-copy share fixed (0: all CPU threads + DMA; a negative
    value: tuned, the default), restored afterwards."""
    def run():
        previous = torch.ops.speedtorch_ops._set_hybrid_share(share)
        try:
            fn()
        finally:
            torch.ops.speedtorch_ops._set_hybrid_share(previous)
    return run


def lazy_adam_(tables, ids, rows, position_grads, count, hyper) -> None:
    """Lazy Adam by fixed-shape GPU ops, the captured all-on-GPU baselines' update: for each
    table k, ``tables[k]`` = (weight, exp_avg, exp_avg_sq, gradient buffer), dense (V, D);
    ``rows[k]`` its rows gathered at ``ids[k]`` (updated in place, then written back) and
    ``position_grads[k]`` those positions' gradients. Each row's gradients are summed in its
    buffer, torch's fused Adam kernel runs on every position's row with its row's summed
    gradient and state (a row's positions compute equal values), the rows and their state go
    back by index_copy_ and the buffer's rows are zeroed. ``count``: the global step count (a
    0-dim float tensor on the device), raised by one; ``hyper``: _fused_adam_'s keywords."""
    for (*_, buf), i, g in zip(tables, ids, position_grads):
        buf.index_add_(0, i, g)
    exp_avgs, exp_avg_sqs, grads = ([t[k].index_select(0, i) for t, i in zip(tables, ids)]
                                    for k in (1, 2, 3))
    count.add_(1)
    torch._fused_adam_(rows, grads, exp_avgs, exp_avg_sqs, [], [count] * len(rows), **hyper)
    for (weight, exp_avg, exp_avg_sq, buf), i, *new in zip(tables, ids, rows, exp_avgs,
                                                           exp_avg_sqs):
        for table, r in zip((weight, exp_avg, exp_avg_sq), new):
            table.index_copy_(0, i, r)
        buf.index_fill_(0, i, 0)
