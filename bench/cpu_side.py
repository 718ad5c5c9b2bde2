"""The host paths' CPU side on 8-24 GiB pinned tables, broken down. For each shape (table
span, row bytes, rows moved), rounds in rotated order of, to the GPU and back:

- index_select / index_copy_ alone (CPU tables, index and rows: the CPU's own rate);
- our CPU op alone (pinned_gather_into / pinned_scatter, all on the CPU);
- the hybrid's CPU side alone (the share hook at 0, a CPU index, rows on the GPU);
- the automatic route with a CPU index, and with a CUDA index (the default use);
- the PyTorch recipe (index_select into pinned staging + async copy; copy down + index_copy_),
  given the index on the host, and given the CUDA index (brought to the host first, as a
  caller holding the index on the GPU would).

Medians in ms (wall clock for CPU-only work, CUDA events otherwise), every round kept. Needs a
GPU and 24 GiB of pinnable memory. Writes <out>/cpu_side-<tag>.json and .png (--out: bench/out,
ignored by git; bench/results replaces a tracked record).

    python3 bench/cpu_side.py [--tag T] [--rounds 2] [--reps 9] [--out bench/out]
                              [--row-bytes 512 ...] [--settle 60]
"""
import argparse
import json
import os

import torch

import speedtorch_ops
from _timing import timed, wall
from _workloads import HYBRID_SETTLE_CALLS, big_table_case, hybrid_share

GIB = 1 << 30
CASES = [(8, 32, 1 << 20), (8, 64, 1 << 20), (8, 128, 1 << 19), (24, 64, 1 << 19),
         (24, 128, 1 << 19), (8, 512, 1 << 17), (24, 512, 1 << 17)]


def paths(t, idx_cpu, idx, var, staging, staging2):
    ops = speedtorch_ops
    gathers = {
        "index_select": ("wall", lambda: torch.index_select(t, 0, idx_cpu, out=staging)),
        "ours_cpu_op": ("wall", lambda: ops.pinned_gather_into(t, idx_cpu, staging2)),
        "cpu_side_alone": ("ev", hybrid_share(0.0, lambda: ops.pinned_gather_into(t, idx_cpu, var))),
        "ours_cpu_index": ("ev", lambda: ops.pinned_gather_into(t, idx_cpu, var)),
        "ours_cuda_index": ("ev", lambda: ops.pinned_gather_into(t, idx, var)),
        "recipe": ("ev", lambda: (torch.index_select(t, 0, idx_cpu, out=staging),
                                  var.copy_(staging, non_blocking=True))),
        "recipe_cuda_index": ("ev", lambda: (torch.index_select(t, 0, idx.cpu(), out=staging),
                                             var.copy_(staging, non_blocking=True))),
    }
    # var holds the table's own rows: the scatters leave the table as it was
    scatters = {
        "index_copy_": ("wall", lambda: t.index_copy_(0, idx_cpu, staging)),
        "ours_cpu_op": ("wall", lambda: ops.pinned_scatter(t, idx_cpu, staging)),
        "cpu_side_alone": ("ev", hybrid_share(0.0, lambda: ops.pinned_scatter(t, idx_cpu, var))),
        "ours_cpu_index": ("ev", lambda: ops.pinned_scatter(t, idx_cpu, var)),
        "ours_cuda_index": ("ev", lambda: ops.pinned_scatter(t, idx, var)),
        "recipe": ("ev", lambda: (staging.copy_(var), t.index_copy_(0, idx_cpu, staging))),
        "recipe_cuda_index": ("ev", lambda: (staging.copy_(var),
                                             t.index_copy_(0, idx.cpu(), staging))),
    }
    return gathers, scatters


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(12, 8))
    labels = [f"{r['span_gib']} GiB\n{r['row_bytes']} B" for r in results]
    for ax, kind in zip(axes, ("gather", "scatter")):
        names = list(results[0][kind])
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            ys = [sorted(r[kind][name])[len(r[kind][name]) // 2] for r in results]
            ax.bar([i + k * width for i in range(len(results))], ys, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], labels)
        ax.set_ylabel("ms (median over rounds; of two, the slower)")
        ax.set_title(f"{kind}: random rows of a pinned table, 16 CPU threads")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tag", default="run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--row-bytes", type=int, nargs="*", help="only the cases of these row sizes")
    p.add_argument("--settle", type=int, default=HYBRID_SETTLE_CALLS,
                   help="untimed calls of each of our routes first, for the hybrid's split "
                        "search to settle")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    buf = speedtorch_ops.empty_pinned((24 * GIB // 4,), torch.float32)
    print(f"{a.tag}: {torch.get_num_threads()} CPU threads", flush=True)
    results = []
    for span, rb, n in [c for c in CASES if not a.row_bytes or c[1] in a.row_bytes]:
        t, idx_cpu, idx, var, staging = big_table_case(buf, span, rb, n, gen, dev)
        staging2 = torch.empty(staging.shape, pin_memory=True)
        torch.index_select(t, 0, idx_cpu, out=staging)
        speedtorch_ops.pinned_gather_into(t, idx, var)
        speedtorch_ops.pinned_gather_into(t, idx_cpu, staging2)
        assert torch.equal(var.cpu().view(torch.int32), staging.view(torch.int32))
        assert torch.equal(staging2.view(torch.int32), staging.view(torch.int32))
        gathers, scatters = paths(t, idx_cpu, idx, var, staging, staging2)
        for table in (gathers, scatters):
            for name in ("ours_cpu_index", "ours_cuda_index"):
                for _ in range(a.settle):
                    table[name][1]()
        torch.cuda.synchronize()
        rec = {"span_gib": span, "row_bytes": rb, "n": n, "gather": {}, "scatter": {}}
        for r in range(a.rounds):
            for kind, table in (("gather", gathers), ("scatter", scatters)):
                names = list(table)
                names = names[r % len(names):] + names[: r % len(names)]
                for name in names:
                    how, fn = table[name]
                    ms = (wall(fn, a.reps) if how == "wall"
                          else timed(fn, a.reps, warmup=12 if r == 0 else 3))
                    rec[kind].setdefault(name, []).append(round(ms, 4))
        for kind in ("gather", "scatter"):
            print(f"{a.tag} {span} GiB {rb} B n={n} {kind} (ms, each round): " + ", ".join(
                f"{k}={'/'.join(f'{v:.3f}' for v in vs)}" for k, vs in rec[kind].items()),
                flush=True)
        results.append(rec)
    base = os.path.join(a.out, f"cpu_side-{a.tag}")
    with open(base + ".json", "w") as f:
        json.dump({"threads": torch.get_num_threads(), "device": torch.cuda.get_device_name(),
                   "cases": results}, f, indent=1)
    plot(results, base + ".png")
    print(f"wrote {base}.json and .png", flush=True)


if __name__ == "__main__":
    main()
