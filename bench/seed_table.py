"""The SpeedTorch README table re-run: 131,072 random rows x 128 float32 to and from a batch-sized
CUDA variable, against the PCIe limit and the PyTorch baselines, all in one process.

    python bench/seed_table.py [--rows 1048576] [--batch 131072] [--dim 128] [--reps 30]
                               [--threads 16 2] [--out bench/out]

Times are medians of --reps runs after warm-up, measured with CUDA events; every path is checked
against plain PyTorch indexing before it is timed. Writes a table and seed_table.json."""

import argparse
import json
import os

import torch

import speedtorch_ops
from _timing import timed
from _workloads import (HYBRID_SETTLE_CALLS, add_seed_shape, cupy_paths, pytorch_recipe,
                        seed_workload)


def main():
    p = argparse.ArgumentParser()
    add_seed_shape(p)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, nargs="+", default=[16, 2])
    a = p.parse_args()
    dev = torch.device("cuda")
    table, gpu_table, idx_cpu = seed_workload(a)
    idx = idx_cpu.to(dev)
    var = torch.empty(a.batch, a.dim, device=dev)
    staging = torch.empty(a.batch, a.dim, pin_memory=True)
    nbytes = a.batch * a.dim * 4
    expected = table[idx_cpu]
    results = {}

    def row(name, to_ms, from_ms, check=None):
        results[name] = {"to_var_ms": to_ms, "from_var_ms": from_ms}
        print(f"{name:<58} {to_ms:9.3f} {from_ms:9.3f}", flush=True)

    def check_to_var(name):
        assert torch.equal(var.cpu(), expected), f"{name}: wrong rows"
        var.normal_()

    print(f"table {a.rows:,} x {a.dim} fp32 ({table.nbytes / 2**20:,.0f} MiB, pinned); batch "
          f"{a.batch:,} random rows ({nbytes / 2**20:.0f} MiB); {torch.cuda.get_device_name()}")
    print(f"{'path':<58} {'to var ms':>9} {'back ms':>9}")

    h2d = timed(lambda: var.copy_(staging, non_blocking=True), a.reps)
    d2h = timed(lambda: staging.copy_(var, non_blocking=True), a.reps)
    row("PCIe memcpy of the same bytes (the limit)", h2d, d2h)

    # Ours, pinned store: zero-copy kernel reading/writing host rows.
    speedtorch_ops.pinned_gather_into(table, idx, var)
    check_to_var("ours pinned")
    row("speedtorch_ops pinned store",
        timed(lambda: speedtorch_ops.pinned_gather_into(table, idx, var), a.reps),
        timed(lambda: speedtorch_ops.pinned_scatter(table, idx, var), a.reps))

    # Ours and PyTorch, GPU-resident store.
    speedtorch_ops.pinned_gather_into(gpu_table, idx, var)
    check_to_var("ours cuda")
    row("speedtorch_ops cuda store",
        timed(lambda: speedtorch_ops.pinned_gather_into(gpu_table, idx, var), a.reps),
        timed(lambda: speedtorch_ops.pinned_scatter(gpu_table, idx, var), a.reps))
    row("PyTorch cuda store: index_select(out=) / index_copy_",
        timed(lambda: torch.index_select(gpu_table, 0, idx, out=var), a.reps),
        timed(lambda: gpu_table.index_copy_(0, idx, var), a.reps))

    cupy = cupy_paths(table, idx, var)
    if cupy is not None:
        cupy[0]()
        torch.cuda.synchronize()
        check_to_var("cupy")
        row("CuPy technique (CuPy array over the pinned table)", timed(cupy[0], a.reps),
            timed(cupy[1], a.reps))

    for threads in a.threads:
        torch.set_num_threads(threads)
        # Ours with the index on the CPU: CPU threads + DMA share the rows with the zero-copy
        # kernel (the split's search settles over the warm-up calls).
        speedtorch_ops.pinned_gather_into(table, idx_cpu, var)
        torch.cuda.synchronize()
        check_to_var("ours hybrid")
        row(f"speedtorch_ops pinned store, CPU index (hybrid), {threads} threads",
            timed(lambda: speedtorch_ops.pinned_gather_into(table, idx_cpu, var), a.reps,
                  HYBRID_SETTLE_CALLS),
            timed(lambda: speedtorch_ops.pinned_scatter(table, idx_cpu, var), a.reps,
                  HYBRID_SETTLE_CALLS))
        recipe_to, recipe_from = pytorch_recipe(table, idx_cpu, var, staging)
        recipe_to()
        torch.cuda.synchronize()
        check_to_var("recipe")
        row(f"PyTorch best recipe, {threads} threads (index_select+async copy)",
            timed(recipe_to, a.reps), timed(recipe_from, a.reps))
        def naive_to():
            var.copy_(table[idx_cpu].cuda())
        def naive_from():
            table[idx_cpu] = var.cpu()
        reps = max(5, a.reps // 3)
        row(f"PyTorch as written, {threads} threads (t[idx].cuda())",
            timed(naive_to, reps, 1), timed(naive_from, reps, 1))

    with open(os.path.join(a.out, "seed_table.json"), "w") as f:
        json.dump({"rows": a.rows, "batch": a.batch, "dim": a.dim, "reps": a.reps,
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "results_ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
