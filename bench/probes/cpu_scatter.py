"""Probe: CPU scatter of random 512 B rows into a large host table (pinned by cudaHostRegister
vs pageable), ours vs index_copy_, by table size and threads. python3 cpu_scatter.py"""
import sys
from pathlib import Path

import torch

import speedtorch_ops as so

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for _timing
from _timing import wall  # noqa: E402


n = 49152 * 3
for rows in (1_000_000, 4_000_000, 12_000_000):
    for kind in ("pinned", "pageable"):
        table = so.empty_pinned((rows, 128), torch.float32) if kind == "pinned" else torch.empty(rows, 128)
        table.fill_(1.0)
        idx = torch.randint(0, rows, (n,))
        src = torch.randn(n, 128)
        for threads in (16, 4):
            torch.set_num_threads(threads)
            ours = wall(lambda: so.pinned_scatter(table, idx, src), 15, warmup=2)
            ref = wall(lambda: table.index_copy_(0, idx, src), 15, warmup=2)
            gather = wall(lambda: so.pinned_gather(table, idx), 15, warmup=2)
            print(f"{rows:>10,} rows {kind:8s} {threads:2d} thr: scatter ours {ours:7.2f} ms, "
                  f"index_copy_ {ref:7.2f} ms; gather ours {gather:6.2f} ms ({n:,} x 512 B)")
        del table
