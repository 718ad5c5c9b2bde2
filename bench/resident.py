"""CUDA-resident tables: pinned_gather_into / pinned_scatter against index_select /
index_copy_ on the same 1 GiB table, 131,072 random rows of 512, 128, 64 and 32 B. ms per call in a
loop of 20 (the GPU's rate; a call's host time counts only where it is longer) and for one call
alone (medians, CUDA events). Writes <out>/resident-<tag>.json (--out: bench/out, ignored by
git; bench/results replaces a tracked record).

    python3 bench/resident.py [--tag T] [--out bench/out]
"""
import argparse
import json
import os

import torch

import speedtorch_ops
from _timing import loop_ms, timed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="run")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    results = []
    for rb in (512, 128, 64, 32):
        rows, dim, n = (1 << 30) // rb, rb // 4, 131072
        table = torch.randn(rows, dim, device=dev)
        idx = torch.randint(0, rows, (n,), generator=gen).to(dev)
        src = torch.randn(n, dim, device=dev)
        out = torch.empty(n, dim, device=dev)
        speedtorch_ops.pinned_gather_into(table, idx, out)
        assert torch.equal(out, table[idx])
        fns = {"ours_gather": lambda: speedtorch_ops.pinned_gather_into(table, idx, out),
               "index_select": lambda: torch.index_select(table, 0, idx, out=out),
               "ours_scatter": lambda: speedtorch_ops.pinned_scatter(table, idx, src),
               "index_copy_": lambda: table.index_copy_(0, idx, src)}
        rec = {"row_bytes": rb, "rows": rows, "n": n,
               "ms": {k: {"loop": round(loop_ms(f), 4), "single": round(timed(f, 20), 4)}
                      for k, f in fns.items()}}
        print(f"{a.tag} {rb} B rows: " + ", ".join(
            f"{k} loop {v['loop']:.4f} single {v['single']:.4f}" for k, v in rec["ms"].items()),
            flush=True)
        results.append(rec)
        table = src = out = None
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, f"resident-{a.tag}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
