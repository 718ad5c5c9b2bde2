"""Probe: can the demo's transfers overlap its training kernels? The transfer kernels' speed on
a capped number of SMs, the demo's compute alone, both at once (transfers on a side stream),
and the demo's step rate (colocated, prefetch) under each cap; plus the host time of one step
queued on an idle GPU.

    python3 bench/probes/overlap.py [--vocab 4000000] [--caps 0 8 16 32 64]

Medians of CUDA-event times (transfer, compute), wall clock for the step rates.
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import speedtorch_ops as so  # noqa: E402
from _timing import timed  # noqa: E402
from speedtorch_ops import demo  # noqa: E402


def main() -> None:
    p = demo.parser()
    p.add_argument("--caps", type=int, nargs="+", default=[0, 8, 16, 32, 64])
    p.add_argument("--measure", type=int, default=40)
    p.add_argument("--host-profile", action="store_true",
                   help="only cProfile the host side of 20 colocated steps (cap 8)")
    p.set_defaults(vocab=4_000_000, dim=128, batch=8192, tokens=4_000_000, switching="prefetch")
    a = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    corpus = demo.Corpus(a.vocab, a.cluster_size, a.tokens)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(16)]
    run = demo.SwitcherTraining(a, device)
    rows = run.v_sw._rows  # the v table's shared rows: (vocab, 3 * dim) pinned
    table = rows.flat
    n = a.batch * (1 + a.negatives)
    gen = torch.Generator().manual_seed(1)
    load = torch.randint(0, a.vocab, (n,), generator=gen).to(device)
    wb = torch.randperm(a.vocab, generator=gen)[:n].to(device)
    out = torch.empty(n, table.shape[1], device=device)
    src = torch.empty(n, table.shape[1], device=device)
    so.pinned_gather_into(table, wb, src)  # writes the rows back unchanged
    so.pinned_gather_into(table, load, out)
    assert torch.equal(out.cpu(), table[load.cpu()])
    mb = n * table.shape[1] * 4 / 1e6
    side = torch.cuda.Stream(device)
    run.load(*batches[0])

    def both(transfer):
        def go():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                transfer()
            run.compute()
            torch.cuda.current_stream().wait_stream(side)
        return go

    gather = lambda: so.pinned_gather_into(table, load, out)  # noqa: E731
    scatter = lambda: so.pinned_scatter(table, wb, src)  # noqa: E731
    # The colocated path: the same rows split into weight/state parts (_sorted_transfer).
    by_load, by_wb = torch.sort(load, stable=True), torch.sort(wb)  # wb is unique: owners = perm
    parts = [torch.empty(n, rows.dim, device=device) for _ in range(rows.width)]
    wb_parts = [p.contiguous() for p in src.view(n, rows.width, rows.dim).unbind(1)]
    part_load = lambda: so.ops._sorted_transfer(rows.host, parts, *by_load, load=True)  # noqa
    part_wb = lambda: so.ops._sorted_transfer(rows.host, wb_parts, *by_wb, load=False)  # noqa
    part_load()
    assert all(torch.equal(p, out.view(n, rows.width, rows.dim)[:, k])
               for k, p in enumerate(parts))
    compute_ms = timed(run.compute, 30)
    print(f"v table {tuple(table.shape)} pinned, {n:,} rows = {mb:.1f} MB per transfer; "
          f"compute alone {compute_ms:.3f} ms")
    print("cap (SMs) | gather ms (GB/s) | scatter ms | parts load | parts write-back | "
          "gather + compute | scatter + compute")
    for cap in a.caps:
        with so.transfer_sm_limit(cap):
            g, s = timed(gather, 20), timed(scatter, 20)
            pl, pw = timed(part_load, 20), timed(part_wb, 20)
            gc, sc = timed(both(gather), 20), timed(both(scatter), 20)
        print(f"{cap or 'all':>9} | {g:.3f} ({mb / g:.1f}) | {s:.3f} | {pl:.3f} | {pw:.3f} | "
              f"{gc:.3f} | {sc:.3f}")
    sys.stdout.flush()

    def step(i):
        run.step(batches[i % 16], batches[(i + 1) % 16])

    if a.host_profile:
        import cProfile
        import pstats
        run.prefetching = False
        with so.transfer_sm_limit(8):
            for i in range(8):
                step(i)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for i in range(20):
                step(i)
            torch.cuda.synchronize()
            prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
        return

    for prefetching in (False, True):
        run.prefetching = prefetching
        for cap in a.caps:
            with so.transfer_sm_limit(cap):
                for i in range(8):
                    step(i)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for i in range(a.measure):
                    step(i)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - start) * 1e3 / a.measure
                host = []
                for i in range(10):  # one step queued on an idle GPU: the host's own time
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    step(i)
                    host.append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
            print(f"{'prefetch' if prefetching else 'colocated'} cap {cap or 'all'}: "
                  f"{ms:.2f} ms/step ({1e3 / ms:.1f} steps/s); host per step "
                  f"{statistics.median(host):.2f} ms")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
