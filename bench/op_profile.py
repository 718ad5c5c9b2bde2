"""Where one op call's GPU time goes: torch.profiler over repeated calls of the transfer ops on
the seed workload (131,072 random rows of a 1 M x 128 float32 table, CUDA index): each kernel's
mean time per call, and the time per call of a loop of calls, for a pinned and a CUDA-resident
table, both directions, every bounds_check mode given.

    python bench/op_profile.py [--rows 1048576] [--batch 131072] [--dim 128] [--calls 20]
                               [--modes deferred raise prechecked] [--out bench/out]

Writes op_profile.json. The loop's time per call (CUDA events around the whole loop) includes
the gaps the host leaves between kernels (its waits, or a host slower than the GPU); the
kernels' sum does not, so their difference is what the host adds. The host time per call (a
wall clock around a loop started with the GPU idle) tells which: a call that does not wait
costs the host only its launches. Last, the read and write ceilings of a zero-copy kernel
against memcpys of the same bytes and of the whole batch's."""

import argparse
import json
import os
import time
from collections import defaultdict

import torch

import speedtorch_ops
from _timing import loop_ms
from _workloads import add_seed_shape, seed_workload


def host_us(fn, calls):
    """Host µs per call: a wall clock around a loop of calls that start with the GPU idle (a
    call that waits for the GPU counts that wait)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def profile(fn, calls):
    """({kernel name: mean µs per call}, µs per call of a loop of calls by CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] += e.device_time / calls
    return dict(kernels), loop_ms(fn, calls, warmup=0) * 1e3


def main():
    p = argparse.ArgumentParser()
    add_seed_shape(p)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=["deferred", "raise"])
    a = p.parse_args()
    dev = torch.device("cuda")
    pinned, on_gpu, idx_cpu = seed_workload(a)
    tables = {"pinned": pinned, "cuda": on_gpu}
    idx = idx_cpu.to(dev)
    var = torch.randn(a.batch, a.dim, device=dev)
    results = {}
    for tname, table in tables.items():
        for mode in a.modes:
            for op, fn in (
                    ("gather", lambda: speedtorch_ops.pinned_gather_into(table, idx, var,
                                                                         bounds_check=mode)),
                    ("scatter", lambda: speedtorch_ops.pinned_scatter(table, idx, var,
                                                                      bounds_check=mode))):
                kernels, per_call = profile(fn, a.calls)
                host = host_us(fn, a.calls)
                key = f"{tname} {op} {mode}"
                results[key] = {"kernels_us": kernels, "per_call_us": per_call, "host_us": host}
                print(f"\n{key}: {per_call:.1f} us per call in a loop, kernels "
                      f"{sum(kernels.values()):.1f} us, host {host:.1f} us")
                for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                    print(f"  {us:9.1f} us  {name}")
    # The ceilings of the zero-copy kernel, each way: the batch's distinct rows, presorted and
    # dense (the first rows of the table, no duplicates, nothing to sort), against a memcpy of
    # the same bytes that way and one of the whole batch's bytes (the seed table's yardstick).
    # No op that moves rows in place can beat its direction's rate.
    distinct = int(torch.unique(idx).numel())
    rows = torch.arange(distinct, device=dev)
    part = torch.empty(distinct, a.dim, device=dev)
    wide = pinned.view(a.rows, 1, a.dim)
    host = torch.empty(distinct * a.dim, pin_memory=True)
    flat = part.view(-1)
    batch_host = torch.empty(a.batch * a.dim, pin_memory=True)
    batch_dev = torch.empty(a.batch * a.dim, device=dev)

    def zero_copy(load):
        return lambda: speedtorch_ops.ops._sorted_transfer(wide, [part], rows, rows, load=load,
                                                           bounds_check="prechecked")

    for name, n, fn in (
            ("zero-copy read of the distinct rows, dense", distinct, zero_copy(True)),
            ("memcpy of the same bytes", distinct, lambda: flat.copy_(host, non_blocking=True)),
            ("zero-copy write of the distinct rows, dense", distinct, zero_copy(False)),
            ("memcpy of the same bytes back", distinct,
             lambda: host.copy_(flat, non_blocking=True)),
            ("memcpy of the whole batch's bytes back", a.batch,
             lambda: batch_host.copy_(batch_dev, non_blocking=True))):
        kernels, per_call = profile(fn, a.calls)
        results[f"ceiling: {name}"] = {"kernels_us": kernels, "per_call_us": per_call,
                                       "bytes": n * a.dim * 4}
        print(f"\nceiling: {name} ({n:,} rows): {per_call:.1f} us per call, "
              f"{n * a.dim * 4 / per_call / 1e3:.1f} GB/s")
    with open(os.path.join(a.out, "op_profile.json"), "w") as f:
        json.dump({"rows": a.rows, "batch": a.batch, "dim": a.dim, "calls": a.calls,
                   "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
