"""The hybrid path's automatic split against fixed zero-copy shares and the PyTorch recipe, in
one process: random rows of an 8-24 GiB pinned table gathered to the GPU by a CUDA index. Each
shape first runs `--settle` untimed calls (the split's search settles within 56), printing
the search's trace; then rounds in rotated order of the automatic split, each fixed share and the
recipe (index_select into pinned staging + an async copy), medians of 9 calls with CUDA
events. Needs a GPU and 24 GiB of pinnable memory. Writes <out>/hybrid_split-<tag>.json.

    python3 bench/hybrid_split.py [--tag T] [--rounds 4] [--shares 0 0.2 0.45] [--settle 60]
"""
import argparse
import json
import os

import torch

import speedtorch_ops
from _timing import timed
from _workloads import HYBRID_SETTLE_CALLS, big_table_case, hybrid_share

GIB = 1 << 30
CASES = [(8, 512, 1 << 17), (24, 512, 1 << 17), (8, 128, 1 << 19), (24, 128, 1 << 19)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="run")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--shares", type=float, nargs="*", default=[0.0, 0.2, 0.45])
    p.add_argument("--settle", type=int, default=HYBRID_SETTLE_CALLS)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    buf = speedtorch_ops.empty_pinned((24 * GIB // 4,), torch.float32)
    results = []
    for span, rb, n in CASES:
        t, idx_cpu, idx, var, staging = big_table_case(buf, span, rb, n, gen, dev)
        print(f"{a.tag} {span} GiB {rb} B: the search's trace", flush=True)
        os.environ["SPEEDTORCH_OPS_TRACE_SPLIT"] = "1"
        try:
            for _ in range(a.settle):
                speedtorch_ops.pinned_gather_into(t, idx, var)
            torch.cuda.synchronize()
        finally:
            del os.environ["SPEEDTORCH_OPS_TRACE_SPLIT"]
        gather = lambda: speedtorch_ops.pinned_gather_into(t, idx, var)  # noqa: E731
        fns = {"auto": gather}
        fns.update({f"share{s:g}": hybrid_share(s, gather) for s in a.shares})
        fns["recipe"] = lambda: (torch.index_select(t, 0, idx_cpu, out=staging),
                                 var.copy_(staging, non_blocking=True))
        assert torch.equal(var.cpu(), t[idx_cpu])
        names = list(fns)
        rec = {"span_gib": span, "row_bytes": rb, "n": n, "ms": {}}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                rec["ms"].setdefault(name, []).append(
                    round(timed(fns[name], 9, warmup=12 if r == 0 else 3), 4))
        print(f"{a.tag} {span} GiB {rb} B gather by a CUDA index (ms, each round): " + ", ".join(
            f"{k}={'/'.join(f'{v:.3f}' for v in vs)}" for k, vs in rec["ms"].items()), flush=True)
        results.append(rec)
    path = os.path.join(a.out, f"hybrid_split-{a.tag}.json")
    with open(path, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "device": torch.cuda.get_device_name(),
                   "cases": results}, f, indent=1)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
