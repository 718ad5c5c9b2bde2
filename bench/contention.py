"""Whether a zero-copy transfer slows the small kernels that run beside it, and how that depends
on how many SMs the transfer may use.

A captured cached step runs its planning (sorts, lookups, masks: many kernels of a few µs) on
one stream while the row cache's lane moves rows over the host link on another. This times a
burst of such small kernels (captured in one CUDA graph, so that its time is the GPU's) alone,
a transfer alone (rows of 1,536 bytes, a row and its Adam state, between a pinned table and the
GPU, sorted like the stores' own: a load, a write-back of other rows, or both at once on two
streams), and both together, for each SM cap of the transfer. Every run starts at an event the
GPU reaches after the host has queued all of it (the GPU sleeps first), so no part pays
another's launch.

    python3 bench/contention.py [--rows 24000] [--sms 0 32 16 12 8 6 4] [--reps 15]
                                [--out bench/out]

Writes contention.json: per direction and cap, the transfer's ms and GB/s alone and beside the
burst, the burst's ms alone and beside the transfer (medians, CUDA events)."""

import argparse
import json
import os
import statistics
import time

import torch

import speedtorch_ops
from speedtorch_ops import ops


def burst(state, repeats=20):
    """Small kernels like a step's planning: a lookup in a 4 M-entry map, masks, a scan."""
    ids, slot_of, mask = state
    for _ in range(repeats):
        hit = slot_of[ids] >= 0
        mask.copy_(hit & (ids > 7))
        torch.cumsum(mask, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--table-rows", type=int, default=2_000_000)
    p.add_argument("--rows", type=int, default=24_000, help="rows moved per transfer")
    p.add_argument("--sms", type=int, nargs="+", default=[0, 32, 16, 12, 8, 6, 4])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(0)
    host = speedtorch_ops.empty_pinned((a.table_rows, 3, 128), torch.float32)
    host.view(-1)[: 1 << 20].normal_()
    parts = [torch.randn(a.rows, 128, device=dev) for _ in range(3)]
    # Loads and write-backs touch different rows, as a cache's prefetch and evictions do.
    picked = torch.randperm(a.table_rows, generator=g)[: 2 * a.rows].view(2, -1)
    load_rows, write_rows = (x.sort().values.to(dev) for x in picked)
    slots = torch.arange(a.rows, device=dev)
    count = torch.tensor([a.rows], device=dev)
    state = (torch.randint(0, 4_000_000, (49_152,), generator=g).to(dev),
             torch.randint(-1, 100, (4_000_001,), generator=g, dtype=torch.int32).to(dev),
             torch.zeros(49_152, dtype=torch.bool, device=dev))
    sides = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    main_stream = torch.cuda.current_stream(dev)
    moved = a.rows * 3 * 128 * 4
    # The burst as one CUDA graph, so that its time is the GPU's (launched one by one, its
    # kernels would wait on the host and hide any slowdown).
    burst(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        burst(state)

    def transfer(direction, sms):
        """Loads, write-backs, or both at once on two streams (a cache's prefetch and its
        evictions); the current stream waits for them."""
        loads = {"load": [True], "write-back": [False], "both": [True, False]}[direction]
        here = torch.cuda.current_stream(dev)
        fork = here.record_event()
        for side, load in zip(sides, loads):
            side.wait_event(fork)
            with torch.cuda.stream(side):
                ops._sorted_transfer(host, parts if load else written,
                                     load_rows if load else write_rows, slots, load,
                                     count=count, bounds_check="prechecked", sms=sms)
            here.wait_stream(side)

    written = [x.clone() for x in parts]
    side = torch.cuda.Stream(dev)  # the transfers' start and end, beside the burst

    def together(direction, sms, burst_too=True):
        """(transfer ms or None, burst ms or None) from one common start: the GPU sleeps while
        the host queues both, so neither pays the other's launch."""
        start = torch.cuda.Event(enable_timing=True)
        t_end, b_end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda._sleep(2_000_000)  # about a millisecond
        start.record(main_stream)
        if direction is not None:
            side.wait_event(start)
            with torch.cuda.stream(side):
                transfer(direction, sms)
                t_end.record(side)
        if burst_too:
            graph.replay()
            b_end.record(main_stream)
        main_stream.wait_stream(side)
        torch.cuda.synchronize()
        return (start.elapsed_time(t_end) if direction is not None else None,
                start.elapsed_time(b_end) if burst_too else None)

    def median_of(direction, sms, burst_too=True):
        for _ in range(3):
            together(direction, sms, burst_too)
        runs = [together(direction, sms, burst_too) for _ in range(a.reps)]
        return tuple(statistics.median(r[k] for r in runs) if runs[0][k] is not None else None
                     for k in range(2))

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gpu": torch.cuda.get_device_name(dev), "args": vars(a), "runs": []}
    burst_alone = median_of(None, 0)[1]
    result["burst_alone_ms"] = burst_alone
    print(f"burst alone {burst_alone:.3f} ms")
    for direction in ("load", "write-back", "both"):
        for sms in a.sms:
            alone = median_of(direction, sms, burst_too=False)[0]
            t_both, b_both = median_of(direction, sms)
            row = {"direction": direction, "sms": sms, "transfer_alone_ms": alone,
                   "transfer_gbs": moved * (2 if direction == "both" else 1) / alone / 1e6,
                   "transfer_beside_ms": t_both, "burst_beside_ms": b_both,
                   "burst_slowdown": b_both / burst_alone}
            result["runs"].append(row)
            print(f"{row['direction']:>10} sms {sms:>3}: transfer {alone:.3f} ms "
                  f"({row['transfer_gbs']:.1f} GB/s), beside the burst {t_both:.3f}; burst "
                  f"{b_both:.3f} ms ({row['burst_slowdown']:.1f}x alone)")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "contention.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
