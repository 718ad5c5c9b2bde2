"""CPU-only: pinned_gather / pinned_scatter against index_select / index_copy_ with the same
threads, for several row sizes (runs on a machine without a GPU).

    python bench/cpu_ops.py [--rows 1048576] [--batch 131072] [--threads N] [--reps 20]
"""

import argparse
import json
import os

import torch

import speedtorch_ops
from _timing import wall
from _workloads import generator, random_index


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--batch", type=int, default=131072)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    g = generator()
    print(f"CPU, {a.threads} threads; batch {a.batch:,} random rows from {a.rows:,}-row tables")
    print(f"{'row bytes':>9} {'gather ms':>10} {'index_select':>12} {'scatter ms':>11} "
          f"{'index_copy_':>11} {'gather x':>9} {'scatter x':>9}")
    results = []
    for dim in (8, 32, 128, 512):
        rows = max(a.batch, a.rows * 128 // dim // 4)  # about the same table bytes per size
        table = torch.randn(rows, dim, generator=g)
        index = random_index(rows, a.batch, g)
        src = torch.randn(a.batch, dim, generator=g)
        out = torch.empty(a.batch, dim)
        assert torch.equal(speedtorch_ops.pinned_gather(table, index), table[index])
        ours_g = wall(lambda: speedtorch_ops.pinned_gather_into(table, index, out), a.reps, warmup=1)
        ref_g = wall(lambda: torch.index_select(table, 0, index, out=out), a.reps, warmup=1)
        ours_s = wall(lambda: speedtorch_ops.pinned_scatter(table, index, src), a.reps, warmup=1)
        ref_s = wall(lambda: table.index_copy_(0, index, src), a.reps, warmup=1)
        results.append(dict(row_bytes=dim * 4, table_rows=rows, gather_ms=ours_g,
                            index_select_ms=ref_g, scatter_ms=ours_s, index_copy_ms=ref_s))
        print(f"{dim * 4:>9} {ours_g:>10.3f} {ref_g:>12.3f} {ours_s:>11.3f} {ref_s:>11.3f} "
              f"{ref_g / ours_g:>9.2f} {ref_s / ours_s:>9.2f}")
    with open(os.path.join(a.out, "cpu_ops.json"), "w") as f:
        json.dump({"threads": a.threads, "batch": a.batch, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
