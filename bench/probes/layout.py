"""Probe: does keeping a row's weight and its optimizer state side by side in one host table
(rows of 3 x 512 B = 1.5 KiB) move the demo's rows faster than three separate 2 GiB tables?
And how fast are the CPU paths (gather into pinned staging, scatter from it) on such rows, alone
and beside zero-copy traffic in the other direction?

    python3 bench/probes/layout.py [--rows 4000000] [--batch 49152] [--threads 16]

Medians: CUDA events for GPU-only work, wall clock (synchronized) for anything with a host part.
"""

import argparse
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import speedtorch_ops as so  # noqa: E402
from _timing import timed, wall  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=49_152)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    V, D, n = a.rows, a.dim, a.batch
    gen = torch.Generator().manual_seed(0)
    sep = [so.empty_pinned((V, D), torch.float32) for _ in range(3)]
    inter = so.empty_pinned((V, 3 * D), torch.float32)
    for t in (*sep, inter):
        t.uniform_(generator=gen)
    load_cpu = torch.randint(0, V, (n,), generator=gen)
    wb_cpu = torch.randperm(V, generator=gen)[:n]
    load, wb = load_cpu.cuda(), wb_cpu.cuda()
    out3 = [torch.empty(n, D, device="cuda") for _ in range(3)]
    rows3 = [torch.randn(n, D, device="cuda") for _ in range(3)]
    out = torch.empty(n, 3 * D, device="cuda")
    rows = torch.randn(n, 3 * D, device="cuda")
    stage_in = torch.empty(n, 3 * D, pin_memory=True)
    stage_out = torch.empty(n, 3 * D, pin_memory=True)
    side = torch.cuda.Stream()
    mb = 3 * n * D * 4 / 1e6

    # Check the paths first.
    so.pinned_gather_into(inter, load, out)
    assert torch.equal(out.cpu(), inter[load_cpu])
    so.optimizer_state_swap(sep, out3, None, load)
    assert all(torch.equal(o.cpu(), t[load_cpu]) for o, t in zip(out3, sep))

    def beside(first, second):
        """second() queued on the side stream, then first() (GPU work on the current stream, or
        host work): the time of both."""
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                second()
            first()
            torch.cuda.current_stream().wait_stream(side)
        return run

    def share(s, fn):
        def run():
            previous = torch.ops.speedtorch_ops._set_hybrid_share(s)
            try:
                fn()
            finally:
                torch.ops.speedtorch_ops._set_hybrid_share(previous)
        return run

    zc3_load = lambda: so.optimizer_state_swap(sep, out3, None, load)  # noqa: E731
    zc3_wb = lambda: so.optimizer_state_swap(sep, rows3, wb, None)  # noqa: E731
    zc_load = lambda: so.pinned_gather_into(inter, load, out)  # noqa: E731
    zc_wb = lambda: so.pinned_scatter(inter, wb, rows)  # noqa: E731
    cpu_gather = lambda: torch.index_select(inter, 0, load_cpu, out=stage_in)  # noqa: E731
    cpu_scatter = lambda: inter.index_copy_(0, wb_cpu, stage_out)  # noqa: E731
    our_cpu_scatter = lambda: so.pinned_scatter(inter, wb_cpu, stage_out)  # noqa: E731
    dma_up = lambda: out.copy_(stage_in, non_blocking=True)  # noqa: E731
    dma_down = lambda: stage_out.copy_(rows, non_blocking=True)  # noqa: E731
    hybrid_load = lambda: so.pinned_gather_into(inter, load_cpu, out)  # noqa: E731

    cases = [
        ("3 tables x 512 B, zero-copy load (one swap)", timed, zc3_load),
        ("3 tables x 512 B, zero-copy write-back", timed, zc3_wb),
        ("1 table x 1536 B, zero-copy load", timed, zc_load),
        ("1 table x 1536 B, zero-copy write-back", timed, zc_wb),
        ("1536 B: zero-copy load + zero-copy write-back, two streams", timed,
         beside(zc_load, zc_wb)),
        ("1536 B: zero-copy load + DMA down, two streams", timed, beside(zc_load, dma_down)),
        ("1536 B: zero-copy write-back + DMA up, two streams", timed, beside(zc_wb, dma_up)),
        ("DMA up (pinned staging -> GPU)", timed, dma_up),
        ("DMA down (GPU -> pinned staging)", timed, dma_down),
        ("DMA up + DMA down, two streams", timed, beside(dma_up, dma_down)),
        ("1536 B: CPU gather into staging (index_select)", wall, cpu_gather),
        ("1536 B: CPU scatter from staging (index_copy_)", wall, cpu_scatter),
        ("1536 B: CPU scatter from staging (pinned_scatter, CPU ids)", wall, our_cpu_scatter),
        ("1536 B: CPU gather beside zero-copy write-back", wall, beside(cpu_gather, zc_wb)),
        ("1536 B: CPU scatter beside zero-copy load", wall, beside(cpu_scatter, zc_load)),
        ("1536 B: CPU gather beside DMA down", wall, beside(cpu_gather, dma_down)),
        ("1536 B: CPU scatter beside DMA up", wall, beside(cpu_scatter, dma_up)),
        ("1536 B: hybrid load (CPU ids), share 0 = CPU gather + DMA", wall,
         share(0.0, hybrid_load)),
        ("1536 B: hybrid load (CPU ids), tuned share", wall, hybrid_load),
        ("zero-copy load alone, wall", wall, zc_load),
        ("zero-copy write-back alone, wall", wall, zc_wb),
    ]
    print(f"{torch.cuda.get_device_name()}, {a.threads} threads; {V:,} rows; batch {n:,} rows; "
          f"{mb:.1f} MB per direction (weight + 2 states)")
    for name, how, fn in cases:
        for _ in range(12 if "tuned" in name else 0):  # let the hybrid tune its split
            fn()
        ms = how(fn, a.reps)
        print(f"{name:<62} {ms:7.3f} ms  {mb / ms:6.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
