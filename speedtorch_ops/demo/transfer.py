"""Transfer demo: batches of random rows moved between a host table and the device with the ops,
checked against plain PyTorch indexing, with the rate printed.

    python -m speedtorch_ops.demo.transfer [--rows N] [--dim D] [--batch B] [--steps S] [--device cpu|cuda]
"""

import argparse
import time

import torch

import speedtorch_ops


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=131_072)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    on_gpu = dev.type == "cuda"

    table = speedtorch_ops.empty_pinned((a.rows, a.dim), torch.float32, pin=on_gpu)
    table.copy_(torch.randn(a.rows, a.dim))
    reference = table.clone()
    where = "pinned host memory (zero-copy)" if on_gpu else "CPU memory"
    print(f"table {a.rows:,} x {a.dim} float32 = {table.nbytes / 2**20:,.0f} MiB in {where}; "
          f"batch {a.batch:,} rows to {dev}")

    batch = torch.empty(a.batch, a.dim, device=dev)
    moved, start = 0, 0.0
    for step in range(a.steps + 1):  # step 0 is checked against torch and not timed
        index = torch.randint(0, a.rows, (a.batch,), device=dev)
        speedtorch_ops.pinned_gather_into(table, index, batch)      # host rows -> device
        batch.mul_(0.5).add_(1.0)                                  # "training"
        speedtorch_ops.pinned_scatter(table, index, batch)          # device rows -> host
        if step == 0:  # check one step against plain PyTorch indexing
            idx = index.cpu()
            expected = reference[idx] * 0.5 + 1.0
            assert torch.allclose(batch.cpu(), expected), "gather result differs from torch"
            reference[idx] = batch.cpu()  # duplicates: any copy of a row holds the same value
            assert torch.equal(table, reference), "scatter result differs from torch"
            start = time.perf_counter()
            continue
        moved += 2 * a.batch
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"{a.steps} steps in {seconds:.3f} s: {moved / seconds / 1e6:.1f} M rows/s, "
          f"{moved * a.dim * 4 / seconds / 1e9:.2f} GB/s (gather + scatter; step 0 checked against torch)")


if __name__ == "__main__":
    main()
