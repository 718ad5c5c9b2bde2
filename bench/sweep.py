"""Sweeps of the transfer speed against the PCIe limit and the other ways of doing the job, all
measured in one process: table span (256 MiB - 24 GiB), row bytes (32 B - 4 KiB), batch rows
(1 k - 1 M), random vs sorted indices, fp32 vs bf16, the Adam optimizer-state swap, and
GPU-resident tables.

    python bench/sweep.py [--max-gib 24] [--reps 15] [--threads 16] [--groups span rows ...]
                          [--out bench/out]

Paths: ours with a CUDA index (zero-copy kernels, sorted reads; past 6 GiB the hybrid), ours
with a CPU index (the hybrid: CPU threads + DMA beside the zero-copy kernels), the best PyTorch
recipe (index_select into pinned staging + async copy; copy + index_copy_), plain unsorted
zero-copy (a CuPy array over the pinned table, the original SpeedTorch technique) when CuPy is
present, and the memcpy of the same bytes (the limit). Every path is checked against plain
indexing before it is timed. Medians of --reps runs after warm-up, CUDA events. Writes
sweep.json and sweep.png."""

import argparse
import json
import os
import time

import torch

import speedtorch_ops
from _timing import timed
from _workloads import (HYBRID_SETTLE_CALLS, cupy_paths, generator, memcpy_paths,
                        pytorch_recipe, random_index)

GIB = 1 << 30
MIB = 1 << 20
GROUPS = ("span", "rows", "small_rows_largest", "batch", "order", "dtype", "adam", "resident")


class Bench:
    def __init__(self, a):
        self.a = a
        self.dev = torch.device("cuda")
        self.gen = generator()
        self.points = []
        self._memcpy = {}
        # One pinned buffer; every table is a prefix of it viewed with its row width. Filled with
        # 64 MiB of random numbers, each copy offset by its block number (no two blocks equal).
        numel = a.max_gib * GIB // 4
        t0 = time.time()
        self.buf = speedtorch_ops.empty_pinned((numel,), torch.float32)
        block = torch.randn(16 * MIB, generator=self.gen)
        for k, start in enumerate(range(0, numel, block.numel())):
            part = self.buf[start:start + block.numel()]
            torch.add(block[:part.numel()], float(k), out=part)
        print(f"pinned buffer: {a.max_gib} GiB in {time.time() - t0:.1f} s", flush=True)

    def table(self, span_bytes, row_bytes, dtype=torch.float32):
        rows = span_bytes // row_bytes
        flat = self.buf.view(dtype) if dtype != torch.float32 else self.buf
        dim = row_bytes // flat.element_size()
        return flat[: rows * dim].view(rows, dim)

    def memcpy_ms(self, nbytes, to_device=True):
        key = (nbytes, to_device)
        if key not in self._memcpy:
            h2d, d2h = memcpy_paths(nbytes, self.dev)
            self._memcpy[key] = timed(h2d if to_device else d2h, self.a.reps)
        return self._memcpy[key]

    def index(self, rows, n, order):
        return random_index(rows, n, self.gen, order)

    def point(self, group, table, n, order="random", scatter=False, extra=None):
        """Times every path for one configuration (gather, and the scatter when asked)."""
        a = self.a
        rows, rb = table.shape[0], table[0].nbytes
        idx_cpu = self.index(rows, n, order)
        idx = idx_cpu.to(self.dev)
        var = torch.empty((n, *table.shape[1:]), dtype=table.dtype, device=self.dev)
        staging = torch.empty(var.shape, dtype=table.dtype, pin_memory=True)
        expected = table[idx_cpu]

        def check(name, fn):
            var.zero_()
            fn()
            torch.cuda.synchronize()
            # bytes, not values: a bf16 view of random float32 bits holds NaNs
            assert torch.equal(var.cpu().view(torch.uint8), expected.view(torch.uint8)), \
                f"{name}: wrong rows"

        paths = {
            # Warm-up calls enough for the hybrid's split to settle: past the span threshold a
            # CUDA index takes the hybrid too.
            "ours_cuda_index": (lambda: speedtorch_ops.pinned_gather_into(table, idx, var),
                                lambda: speedtorch_ops.pinned_scatter(table, idx, var),
                                HYBRID_SETTLE_CALLS),
            "ours_cpu_index": (lambda: speedtorch_ops.pinned_gather_into(table, idx_cpu, var),
                               lambda: speedtorch_ops.pinned_scatter(table, idx_cpu, var),
                               HYBRID_SETTLE_CALLS),
            "pytorch_recipe": (*pytorch_recipe(table, idx_cpu, var, staging), 3),
        }
        cupy = cupy_paths(table, idx, var)
        if cupy is not None:
            paths["plain_zero_copy"] = (*cupy, 3)
        result = {"group": group, "span_gib": table.nbytes / GIB, "row_bytes": rb, "n": n,
                  "order": order, "dtype": str(table.dtype).replace("torch.", ""),
                  "bytes": n * rb, "gather_ms": {}, "scatter_ms": {}}
        result.update(extra or {})
        result["gather_ms"]["memcpy"] = self.memcpy_ms(n * rb)
        for name, (to, back, warm) in paths.items():
            check(name, to)
            result["gather_ms"][name] = timed(to, a.reps, warm)
            if scatter:  # writes var (= the table's own rows) back: the table keeps its values
                result["scatter_ms"][name] = timed(back, a.reps, warm)
        if scatter:
            result["scatter_ms"]["memcpy"] = self.memcpy_ms(n * rb, to_device=False)
        self.points.append(result)
        self.report(result)
        return result

    @staticmethod
    def report(r):
        def fmt(ms):
            return " ".join(f"{k}={v:.3f}ms({r['bytes'] / v / 1e6:.1f}GB/s)" for k, v in ms.items())
        print(f"[{r['group']}] span {r['span_gib']:.2f} GiB, {r['row_bytes']} B rows, n {r['n']:,}, "
              f"{r['order']}, {r['dtype']}\n  gather : {fmt(r['gather_ms'])}", flush=True)
        if r["scatter_ms"]:
            print(f"  scatter: {fmt(r['scatter_ms'])}", flush=True)

    def adam_swap(self, span_bytes, n):
        """Weight + exp_avg + exp_avg_sq of one table: write back and load in one call."""
        rb = 512
        rows = span_bytes // rb
        stores = [self.buf[k * rows * 128:(k + 1) * rows * 128].view(rows, 128) for k in range(3)]
        batch = [torch.empty(n, 128, device=self.dev) for _ in range(3)]
        wb_cpu = self.index(rows, n, "random")
        load_cpu = self.index(rows, n, "random")
        wb, load = wb_cpu.to(self.dev), load_cpu.to(self.dev)
        for b, s in zip(batch, stores):  # batch = its store's rows: the write-back changes nothing
            b.copy_(s[wb_cpu].to(self.dev))
        out = {"group": "adam_swap", "span_gib_per_table": span_bytes / GIB, "row_bytes": rb,
               "n": n, "bytes": 6 * n * rb, "ms": {}}

        def swap(w, l):
            def fn():
                speedtorch_ops.optimizer_state_swap(stores, batch, w, l)
                speedtorch_ops.optimizer_state_swap(stores, batch, l, w)  # back: repeatable
            return fn
        for name, (w, l) in {"ours_cuda_index": (wb, load), "ours_cpu_index": (wb_cpu, load_cpu)}.items():
            fn = swap(w, l)
            fn()
            torch.cuda.synchronize()
            assert all(torch.equal(b.cpu(), s[wb_cpu]) for b, s in zip(batch, stores)), name
            out["ms"][name] = timed(fn, self.a.reps, 12) / 2
        out["ms"]["memcpy"] = self.memcpy_ms(3 * n * rb) + self.memcpy_ms(3 * n * rb, False)
        self.points.append(out)
        print(f"[adam_swap] 3 tables x {span_bytes / GIB:.0f} GiB, n {n:,}: " + " ".join(
            f"{k}={v:.3f}ms" for k, v in out["ms"].items()), flush=True)

    def gpu_resident(self, span_bytes, rb, n):
        table = self.table(span_bytes, rb).to(self.dev)
        idx = random_index(table.shape[0], n, self.gen).to(self.dev)
        var = torch.empty(n, table.shape[1], device=self.dev)
        speedtorch_ops.pinned_gather_into(table, idx, var)
        assert torch.equal(var, table[idx])
        ms = {"ours_gather": timed(lambda: speedtorch_ops.pinned_gather_into(table, idx, var), self.a.reps),
              "index_select": timed(lambda: torch.index_select(table, 0, idx, out=var), self.a.reps),
              "ours_scatter": timed(lambda: speedtorch_ops.pinned_scatter(table, idx, var), self.a.reps),
              "index_copy_": timed(lambda: table.index_copy_(0, idx, var), self.a.reps)}
        out = {"group": "gpu_resident", "span_gib": span_bytes / GIB, "row_bytes": rb, "n": n, "ms": ms}
        self.points.append(out)
        print(f"[gpu_resident] {span_bytes / GIB:.0f} GiB, {rb} B rows, n {n:,}: " + " ".join(
            f"{k}={v:.3f}ms" for k, v in ms.items()), flush=True)
        del table


def plot(points, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, group, key, xlabel, logx in ((axes[0], "rows", "row_bytes", "row bytes", True),
                                         (axes[1], "span", "span_gib", "table span (GiB)", False)):
        pts = sorted((p for p in points if p["group"] == group), key=lambda p: p[key])
        if not pts:
            continue
        for name in pts[0]["gather_ms"]:
            xs = [p[key] for p in pts if name in p["gather_ms"]]
            ys = [p["bytes"] / p["gather_ms"][name] / 1e6 for p in pts if name in p["gather_ms"]]
            ax.plot(xs, ys, "k--" if name == "memcpy" else "o-", label=name)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GB/s (gather of random rows to the GPU)")
        ax.set_title(f"{group} sweep ({pts[0]['order']} rows)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-gib", type=int, default=24)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=GROUPS,
                   help="the groups of points to time (default: all)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(a.threads)
    b = Bench(a)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.threads} CPU threads",
          flush=True)
    spans = [s for s in (0.25, 1, 4, 8, 16, 24) if s <= a.max_gib]
    big = min(8, a.max_gib)
    g = set(a.groups)
    for span in spans if "span" in g else ():  # 512 B rows, 64 MiB per transfer
        b.point("span", b.table(int(span * GIB), 512), 131072, scatter=span in (1, big, a.max_gib))
    for rb in (32, 64, 128, 512, 2048, 4096) if "rows" in g else ():  # 8 GiB, ~64 MiB moved
        b.point("rows", b.table(big * GIB, rb), min(1 << 20, 64 * MIB // rb),
                scatter=rb in (64, 128))
    for rb in (64, 128) if "small_rows_largest" in g else ():  # small rows, the largest table
        b.point("small_rows_largest", b.table(a.max_gib * GIB, rb), 1 << 19, scatter=True)
    for n in (1024, 8192, 65536, 262144, 1 << 20) if "batch" in g else ():  # 8 GiB, 512 B rows
        b.point("batch", b.table(big * GIB, 512), n)
    if "order" in g:
        b.point("order", b.table(big * GIB, 512), 131072, order="sorted", scatter=True)
    if "dtype" in g:
        b.point("dtype", b.table(big * GIB, 512, torch.bfloat16), 131072, scatter=True)
    if "adam" in g:
        b.adam_swap(2 * GIB, 131072)
    if "resident" in g:
        b.gpu_resident(GIB, 512, 131072)
        b.gpu_resident(GIB, 64, 131072)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "threads": a.threads, "reps": a.reps, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(os.path.join(a.out, "sweep.json"), "w") as f:
        json.dump({"meta": meta, "points": b.points}, f, indent=1)
    plot(b.points, os.path.join(a.out, "sweep.png"))
    print("wrote sweep.json and sweep.png", flush=True)


if __name__ == "__main__":
    main()
