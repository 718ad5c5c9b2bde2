"""Can a write-back and a load run at once, each in its own PCIe direction? At the demo's shape
(three 2 GiB pinned tables of 512 B rows, 49,152 random rows each way), times with CUDA events
(medians): the zero-copy load alone (one call for the three tables, and one call per table);
the write-back by zero-copy alone; the write-back's rows copied down by DMA into pinned staging
alone; the load together with that DMA (two streams); write-back then load; and by wall clock:
the CPU scatter of the staged rows into the tables alone and beside the load, and the hybrid
write-back (CPU ids) with shares 0, 0.5 and automatic.

    python3 bench/duplex.py [--rows-per-table 4000000] [--batch 49152]
"""

import argparse
import threading

import torch

import speedtorch_ops as so
from _timing import timed, wall
from _workloads import beside, generator, hybrid_share, pinned_table, random_index, unique_index


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows-per-table", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=49_152)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    gen = generator(0)
    tables = [pinned_table((a.rows_per_table, a.dim), gen) for _ in range(3)]
    load_cpu = random_index(a.rows_per_table, a.batch, gen)
    wb_cpu = unique_index(a.rows_per_table, a.batch, gen)
    load, wb = load_cpu.cuda(), wb_cpu.cuda()
    batch = [torch.randn(a.batch, a.dim, device="cuda") for _ in range(3)]
    out = [torch.empty_like(b) for b in batch]
    staging = [torch.empty(b.shape, pin_memory=True) for b in batch]
    side = torch.cuda.Stream()
    nbytes = 3 * a.batch * a.dim * 4

    def zc_load():
        so.optimizer_state_swap(tables, out, None, load)

    def zc_writeback():
        so.optimizer_state_swap(tables, batch, wb, None)

    def dma_down():
        for s, b in zip(staging, batch):
            s.copy_(b, non_blocking=True)

    def cpu_scatter():
        so.optimizer_state_swap(tables, staging, wb_cpu, None)

    def load_beside_cpu_scatter():
        worker = threading.Thread(target=cpu_scatter)
        worker.start()
        zc_load()
        torch.cuda.synchronize()
        worker.join()

    print(f"3 tables of {a.rows_per_table:,} x {a.dim} float32 (pinned), {a.batch:,} random rows "
          f"per table each way ({nbytes / 1e6:.1f} MB each way), {torch.get_num_threads()} threads")
    for name, fn in [("zero-copy load", zc_load), ("zero-copy write-back", zc_writeback),
                     ("DMA of the write-back rows to staging", dma_down),
                     ("zero-copy load + DMA down at once", beside(side, zc_load, dma_down)),
                     ("zero-copy load, one call per table",
                      lambda: [so.optimizer_state_swap([t], [o], None, load)
                               for t, o in zip(tables, out)]),
                     ("zero-copy write-back then load", lambda: (zc_writeback(), zc_load()))]:
        ms = timed(fn, a.reps)
        print(f"  {name:42s} {ms:7.3f} ms  {nbytes / ms / 1e6:6.1f} GB/s per direction")

    def hybrid_writeback():
        so.optimizer_state_swap(tables, batch, wb_cpu, None)

    for name, fn in [("CPU scatter of staged rows, one swap (wall)", cpu_scatter),
                     ("CPU scatter, one pinned_scatter per table", lambda: [
                         so.pinned_scatter(t, wb_cpu, s) for t, s in zip(tables, staging)]),
                     ("zero-copy load beside the CPU scatter", load_beside_cpu_scatter),
                     ("hybrid write-back, share 0 (DMA + CPU)", hybrid_share(0.0, hybrid_writeback)),
                     ("hybrid write-back, share 0.5", hybrid_share(0.5, hybrid_writeback)),
                     ("hybrid write-back, tuned", hybrid_share(-1.0, hybrid_writeback))]:
        ms = wall(fn, a.reps)
        print(f"  {name:42s} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
