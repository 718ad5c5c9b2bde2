"""A huge table's set-up on the GPU machine: how long pinning (speedtorch_ops.pin_, in pieces)
and filling take, and whether transparent huge pages change that or the zero-copy gather rate.

For each way of getting the memory -- torch.empty (what empty_pinned does), an anonymous mmap,
and an anonymous mmap advised MADV_HUGEPAGE before its pages exist -- it pins
a table of --gib GiB (rows of --dim float32), fills it with uniform_ in chunks (initialize_, one
thread) and again on every thread (fill_random_), reads how much of it the kernel backs with
huge pages (AnonHugePages in /proc/meminfo), and times pinned_gather of
--rows random rows to the GPU (CUDA events, median of --reps after 3 warm-ups). One table at a
time, freed before the next; --repeats rounds, each in another order (the first table of a
fresh machine can pay for the machine's memory growing). Without a GPU there is no pinning and no gather: the pin column is
then the time to touch every page (zero_). Output: a table and pinning.json in --out.

    python3 bench/pinning.py --gib 32
"""

import argparse
import gc
import json
import mmap
import os
import time

import torch

import speedtorch_ops as so
from _timing import timed

CUDA = torch.cuda.is_available()  # without a GPU: no pinning and no gather, the fills only
DEVICE = torch.cuda.get_device_name() if CUDA else "no GPU"


def meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def thp_setting() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def allocate(kind: str, nbytes: int):
    """(flat float32 CPU tensor, mmap or None)."""
    if kind == "torch.empty":
        return torch.empty(nbytes // 4, dtype=torch.float32), None
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "mmap+MADV_HUGEPAGE":
        mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=torch.float32), mm


def gather_ms(table: torch.Tensor, rows: int, reps: int) -> float:
    index = torch.randint(0, table.shape[0], (rows,), device="cuda")
    return timed(lambda: so.pinned_gather(table, index), reps)


def one(kind: str, a) -> dict:
    nbytes = a.gib << 30
    huge_before = meminfo_kib("AnonHugePages")
    t0 = time.perf_counter()
    flat, mm = allocate(kind, nbytes)
    t1 = time.perf_counter()
    if CUDA:
        so.pin_(flat, progress=False)
    else:
        flat.zero_()  # faults every page in, as pinning does, so both fills find them present
    t2 = time.perf_counter()
    huge = (meminfo_kib("AnonHugePages") - huge_before) * 1024  # every page exists now
    table = flat.view(-1, a.dim)
    if a.serial_fill:
        so.initialize_(table, lambda t: t.uniform_(-1, 1), progress=False)
    t3 = time.perf_counter()
    so.fill_random_(table, "uniform", -1, 1, progress=False)  # every thread draws
    t4 = time.perf_counter()
    ms = gather_ms(table, a.rows, a.reps) if CUDA else float("nan")
    row_bytes = a.dim * 4
    fill_s = t3 - t2 if a.serial_fill else float("nan")
    result = dict(kind=kind, gib=a.gib, allocate_s=t1 - t0, pin_s=t2 - t1, fill_s=fill_s,
                  pin_gb_per_s=nbytes / (t2 - t1) / 1e9, fill_gb_per_s=nbytes / fill_s / 1e9,
                  parallel_fill_s=t4 - t3, parallel_fill_gb_per_s=nbytes / (t4 - t3) / 1e9,
                  huge_page_fraction=huge / nbytes, gather_ms=ms,
                  gather_gb_per_s=a.rows * row_bytes / ms / 1e6)
    if CUDA:
        so.unpin_(flat)
    del table, flat
    gc.collect()
    if mm is not None:
        mm.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=1 << 20, help="rows per timed gather")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--kinds", nargs="+",
                   default=["torch.empty", "mmap", "mmap+MADV_HUGEPAGE"])
    p.add_argument("--repeats", type=int, default=1, help="rounds, the order rotated each time")
    p.add_argument("--no-serial-fill", dest="serial_fill", action="store_false",
                   help="skip the one-thread initialize_ fill (fill_random_ still runs)")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    results = []
    for r in range(a.repeats):
        order = a.kinds[r % len(a.kinds):] + a.kinds[:r % len(a.kinds)]
        results += [dict(one(kind, a), round=r) for kind in order]
    print(f"{DEVICE}; THP: {thp_setting()}; {torch.get_num_threads()} "
          f"threads; {a.gib} GiB table of {a.dim} x float32 rows; gather of {a.rows:,} random rows")
    print(f"{'round':>5} {'memory':>20} {'pin s':>7} {'GB/s':>6} {'fill s':>7} {'GB/s':>6} {'pfill s':>7} "
          f"{'GB/s':>6} {'huge':>5} {'gather ms':>9} {'GB/s':>6}")
    for r in results:
        print(f"{r['round']:5d} {r['kind']:>20} {r['pin_s']:7.2f} {r['pin_gb_per_s']:6.2f} {r['fill_s']:7.2f} "
              f"{r['fill_gb_per_s']:6.2f} {r['parallel_fill_s']:7.2f} "
              f"{r['parallel_fill_gb_per_s']:6.2f} {r['huge_page_fraction']:5.2f} "
              f"{r['gather_ms']:9.3f} {r['gather_gb_per_s']:6.2f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "pinning.json"), "w") as f:
        json.dump(dict(gpu=DEVICE, thp=thp_setting(),
                       threads=torch.get_num_threads(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
