"""Whether the host paths' CPU work and their copies over PCIe can overlap on this machine, or
share one limit (the host memory both go through): random rows of a pinned table (by default
131,072 rows of 512 B, 64 MiB, of an 8 GiB table), both directions. In rotated order for
--rounds rounds, medians of --reps runs (wall clock, the GPU synchronized around each):

- cpu: our CPU op alone (pinned_scatter / pinned_gather_into, rows and index on the host);
- copy: the batch's bytes copied between the GPU and other pinned memory alone;
- both: that copy queued, then the CPU op at once, until both are done (the two share nothing
  but the machine);
- cpu_side: the op with the rows on the GPU through the hybrid's CPU side alone (the share hook
  at 0, a CPU index: the CPU op and the copy in 2 MiB chunks, each chunk's work as it lands);
- host_copy: 1 GiB copied host to host by torch with the same threads (the memory's own rate).

Needs a GPU and the table's pinnable memory. Writes <out>/host_overlap-<tag>.json (--out:
bench/out, ignored by git; bench/results replaces a tracked record).

    python3 bench/host_overlap.py [--tag T] [--rounds 3] [--reps 9] [--out bench/out]
                                  [--row-bytes 512] [--rows 131072] [--span-gib 8]
"""
import argparse
import json
import os

import torch

import speedtorch_ops
from _timing import wall
from _workloads import generator, hybrid_share, pinned_table, random_index

GIB = 1 << 30


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--row-bytes", type=int, default=512)
    p.add_argument("--rows", type=int, default=131072, help="rows moved")
    p.add_argument("--span-gib", type=int, default=8, help="the table's size")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ops = speedtorch_ops
    dev = torch.device("cuda")
    gen = generator()
    rb, n = a.row_bytes, a.rows
    table = pinned_table((a.span_gib * GIB // rb, rb // 4), gen)
    idx = random_index(table.size(0), n, gen)
    host_rows = pinned_table((n, rb // 4), gen)
    other_host = pinned_table((n, rb // 4), gen)
    dev_rows = torch.randn(n, rb // 4, device=dev)
    big = torch.randn(GIB // 4)
    big_out = torch.empty_like(big)

    def both(copy, cpu):
        def run():
            copy()
            cpu()
        return run

    down = lambda: other_host.copy_(dev_rows, non_blocking=True)  # noqa: E731
    up = lambda: dev_rows.copy_(other_host, non_blocking=True)  # noqa: E731
    scatter = lambda: ops.pinned_scatter(table, idx, host_rows)  # noqa: E731
    gather = lambda: ops.pinned_gather_into(table, idx, host_rows)  # noqa: E731
    fns = {
        "scatter cpu": scatter,
        "scatter copy": down,
        "scatter both": both(down, scatter),
        "scatter cpu_side": hybrid_share(0.0, lambda: ops.pinned_scatter(table, idx, dev_rows)),
        "gather cpu": gather,
        "gather copy": up,
        "gather both": both(up, gather),
        "gather cpu_side": hybrid_share(0.0, lambda: ops.pinned_gather_into(table, idx, dev_rows)),
        "host_copy 1 GiB": lambda: big_out.copy_(big),
    }
    names = list(fns)
    rounds = {k: [] for k in names}
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            rounds[k].append(round(wall(fns[k], a.reps), 3))
        print(f"{a.tag} round {r}: " + ", ".join(f"{k} {rounds[k][-1]:.3f}" for k in names),
              flush=True)
    rec = {"device": torch.cuda.get_device_name(), "threads": torch.get_num_threads(),
           "row_bytes": rb, "rows": n, "table_gib": a.span_gib, "ms": rounds}
    with open(os.path.join(a.out, f"host_overlap-{a.tag}.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
