"""Does the host link carry a load and a write-back at once at the rate of each alone? The
bound of a step below its working set depends on it: with a full-duplex link a step's loads and
write-backs cost the longer of the two, with a shared one their sum.

At the main job's shape (one pinned table of 8 M rows of 1,536 B: both 4 M x 128 tables with
their Adam state, 12 GiB; 18,500 distinct random rows each way, a step's misses at 1,200 MiB),
CUDA events, medians:
- DMA (the copy engines), contiguous: host -> GPU alone, GPU -> host alone, both at once on two
  streams;
- zero-copy (the stores' transfer kernel, rows sorted as a step sorts them): a load alone, a
  write-back alone, both at once on two streams, uncapped and under the stores' SM caps (loads
  8 SMs, write-backs 6);
each with its GB/s and, for the pairs, the duplex gain: (time of the two alone, added) / (time
together): 2 for a link that carries both directions at full rate, 1 for one that takes turns.

    python3 bench/link_duplex.py [--rows 8000000] [--row-bytes 1536] [--batch 18500]
"""

import argparse
import json
import os
import time

import torch

import speedtorch_ops as so
from speedtorch_ops import ops
from _timing import timed
from _workloads import beside, generator, unique_index


def zero_copy_pair(table, loads: int, backs: int, load_sms: int = 8, back_sms: int = 6,
                   reps: int = 20, gen=None) -> tuple:
    """(ms of a load alone, of a write-back alone, of both at once on two streams): `loads`
    and `backs` distinct random rows of the pinned `table` (rows, 1, floats) moved by the
    stores' transfer kernel, rows sorted as a step sorts them, under the stores' SM caps."""
    dev = torch.device("cuda")
    rows, floats = table.shape[0], table.shape[2]
    load_rows = unique_index(rows, loads, gen).sort().values.to(dev)
    back_rows = unique_index(rows, backs, gen).sort().values.to(dev)
    buf_in = [torch.empty(loads, floats, device=dev)]
    buf_out = [torch.randn(backs, floats, device=dev)]
    load_slots, back_slots = torch.arange(loads, device=dev), torch.arange(backs, device=dev)

    def load():
        ops._sorted_transfer(table, buf_in, load_rows, load_slots, True, sms=load_sms)

    def writeback():
        ops._sorted_transfer(table, buf_out, back_rows, back_slots, False, sms=back_sms)

    return (timed(load, reps), timed(writeback, reps),
            timed(beside(torch.cuda.Stream(), load, writeback), reps))


def pair(name, alone_a, alone_b, together, nbytes) -> dict:
    gain = (alone_a + alone_b) / together
    print(f"  {name:34s} alone {alone_a:6.3f} + {alone_b:6.3f} ms, together {together:6.3f} ms: "
          f"{2 * nbytes / together / 1e6:6.1f} GB/s both ways, duplex gain {gain:4.2f}")
    return {"name": name, "a_ms": alone_a, "b_ms": alone_b, "together_ms": together,
            "a_gb_s": nbytes / alone_a / 1e6, "b_gb_s": nbytes / alone_b / 1e6,
            "together_gb_s": 2 * nbytes / together / 1e6, "duplex_gain": gain}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--row-bytes", type=int, default=1536)
    p.add_argument("--batch", type=int, default=18_500, help="distinct rows each way")
    p.add_argument("--dma-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = generator(0)
    side = torch.cuda.Stream()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gpu": torch.cuda.get_device_name(dev), "args": vars(a), "pairs": []}

    n = a.dma_mib << 20
    host_up = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_down = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu_in = torch.empty(n, dtype=torch.uint8, device=dev)
    gpu_out = torch.empty(n, dtype=torch.uint8, device=dev)
    up = lambda: gpu_in.copy_(host_up, non_blocking=True)  # noqa: E731
    down = lambda: host_down.copy_(gpu_out, non_blocking=True)  # noqa: E731
    print(f"DMA, {a.dma_mib} MiB each way, {result['gpu']}")
    result["pairs"].append(pair("DMA up / down", timed(up, a.reps), timed(down, a.reps),
                                timed(beside(side, up, down), a.reps), n))

    floats = a.row_bytes // 4
    table = so.empty_pinned((a.rows, 1, floats), torch.float32)  # contents do not matter
    nbytes = a.batch * a.row_bytes
    print(f"zero-copy, a table of {a.rows:,} rows of {a.row_bytes} B "
          f"({a.rows * a.row_bytes / 2**30:.1f} GiB), {a.batch:,} rows each way "
          f"({nbytes / 1e6:.1f} MB)")
    for load_sms, back_sms in [(0, 0), (8, 6), (16, 16)]:
        result["pairs"].append(pair(f"zero-copy load {load_sms or 'all'} / write-back "
                                    f"{back_sms or 'all'} SMs",
                                    *zero_copy_pair(table, a.batch, a.batch, load_sms, back_sms,
                                                    a.reps, gen), nbytes))
    # A zero-copy load beside a DMA write-back of the same bytes (rows packed on the GPU,
    # copied down to pinned staging): the copy engine's direction.
    load_rows = unique_index(a.rows, a.batch, gen).sort().values.to(dev)
    slots = torch.arange(a.batch, device=dev)
    buf_in = [torch.empty(a.batch, floats, device=dev)]
    packed = torch.randn(a.batch, floats, device=dev)
    stage = torch.empty(a.batch, floats, pin_memory=True)
    load = lambda: ops._sorted_transfer(table, buf_in, load_rows, slots, True)  # noqa: E731
    dma_back = lambda: stage.copy_(packed, non_blocking=True)  # noqa: E731
    result["pairs"].append(pair("zero-copy load / DMA down", timed(load, a.reps),
                                timed(dma_back, a.reps),
                                timed(beside(side, load, dma_back), a.reps), nbytes))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "link_duplex.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
