"""CPU-only: a DLRM-like training step with our HostEmbeddingBag tables against plain PyTorch
(nn.EmbeddingBag(sparse=True) + SparseAdam), same batches, same intra-op threads.

The model: 8 bag tables of varied sizes (mode "sum"), a bottom MLP on dense features, the bags'
sums and its output concatenated into a top MLP, a logistic loss; Adam (lr 1e-3) on the MLP in
both, on the tables ours (``HostEmbeddingBag(..., device="cpu", optimizer=torch.optim.Adam)``)
or SparseAdam on ``nn.EmbeddingBag(sparse=True)`` tables. Ids are Zipf-distributed (a random
permutation of the rows spreads the hot ones), each bag 1 to --bag-len ids (1-D input with
offsets). Steps of the two alternate in rounds (each round --steps steps of one, then of the
other), after warm-up; medians over every timed step. Phases are timed around the public calls
(tables' forward, the rest of the forward, backward, the tables' step, the dense step).

Each thread count runs in a subprocess of its own (torch's thread pools are sized once); with
--busy a process spinning on one core (pinned there) runs while they time (--both: without it
first). --trees runs the same measurement with each given source tree first on PYTHONPATH
(e.g. a copy of the code before a change, built in place with `python setup.py build_ext
--inplace`), so before and after share one run. --serial-bytes sets the CPU kernels' serial
threshold (the test hook _set_cpu_serial_bytes), one measurement per value. --profile adds
torch.profiler's costliest ops of each model. --ours-fused gives our tables fused Adam.
Pin the whole run to two cores with `taskset -c 0,1` to see a 2-core machine on a larger one.

--sweep measures the threshold itself instead of the step: one table step's load, write-back
and distinct ids at growing sizes, each forced serial and forced parallel (sweep_kernels).

    python bench/cpu_module.py --threads 1 2 16 [--busy [--both]] [--profile] [--tag NAME]
    python bench/cpu_module.py --threads 1 2 --trees /tmp/before . --busy --both
    python bench/cpu_module.py --sweep --threads 2 --busy --both

Output: a printed table, <out>/cpu_module-<tag>.json (and .png with matplotlib), or
<out>/cpu_module-sweep-<tag>.json; --out defaults to bench/out (ignored by git: pass --out
bench/results to replace a tracked record).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

TABLE_ROWS = [1_000_000, 500_000, 300_000, 200_000, 100_000, 50_000, 40_000, 20_000]
PHASES = ["tables_forward", "mlp_forward", "backward", "tables_step", "dense_step"]


# ---- the workload --------------------------------------------------------------------------

class Zipf:
    """Ids of a table of `rows` rows drawn with P(rank k) ~ 1 / (k + 1)^s; a permutation fixed
    per table maps ranks to rows, so the hot rows are the same in every batch."""

    def __init__(self, rng, rows: int, s: float):
        self.cdf = np.cumsum(1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s)
        self.rows = rng.permutation(rows)

    def draw(self, rng, n: int) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, rng.random(n) * self.cdf[-1])
        return self.rows[np.minimum(ranks, len(self.rows) - 1)]


def make_batches(a) -> list:
    """`a.distinct_batches` batches: (dense features, [(ids, offsets)] per table, labels)."""
    import torch
    rng = np.random.default_rng(a.seed)
    zipfs = [Zipf(rng, rows, a.zipf) for rows in a.tables]
    batches = []
    for _ in range(a.distinct_batches):
        tables = []
        for zipf in zipfs:
            lengths = rng.integers(1, a.bag_len + 1, a.batch)
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            ids = zipf.draw(rng, int(lengths.sum()))
            tables.append((torch.from_numpy(ids.astype(np.int64)),
                           torch.from_numpy(offsets.astype(np.int64))))
        dense = torch.from_numpy(rng.standard_normal((a.batch, a.dense), dtype=np.float32))
        labels = torch.from_numpy((rng.random(a.batch) < 0.3).astype(np.float32))
        batches.append((dense, tables, labels))
    return batches


class Model:
    """The MLPs and a list of bag tables, either ours or nn.EmbeddingBag; step() runs one
    training step and returns its phase times (ms)."""

    def __init__(self, a, ours: bool):
        import torch
        from torch import nn
        torch.manual_seed(a.seed)
        self.ours = ours
        dim = a.dim
        self.bottom = nn.Sequential(nn.Linear(a.dense, 128), nn.ReLU(), nn.Linear(128, dim),
                                    nn.ReLU())
        self.top = nn.Sequential(nn.Linear(dim * (1 + len(a.tables)), 128), nn.ReLU(),
                                 nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))
        dense_params = list(self.bottom.parameters()) + list(self.top.parameters())
        self.dense_opt = torch.optim.Adam(dense_params, lr=a.lr)
        if ours:
            import speedtorch_ops as so
            kwargs = {"lr": a.lr, **({"fused": True} if a.ours_fused else {})}
            self.tables = [so.HostEmbeddingBag(rows, dim, mode="sum", device="cpu",
                                               optimizer=torch.optim.Adam,
                                               optimizer_kwargs=kwargs)
                           for rows in a.tables]
            self.sparse_opt = None
        else:
            self.tables = [nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
                           for rows in a.tables]
            self.sparse_opt = torch.optim.SparseAdam(
                [t.weight for t in self.tables], lr=a.lr)

    def step(self, batch) -> dict:
        import torch
        dense, tables, labels = batch
        t0 = time.perf_counter()
        self.dense_opt.zero_grad(set_to_none=True)
        if self.sparse_opt is not None:
            self.sparse_opt.zero_grad(set_to_none=True)
        bags = [table(ids, offsets) for table, (ids, offsets) in zip(self.tables, tables)]
        t1 = time.perf_counter()
        x = torch.cat([self.bottom(dense)] + bags, dim=1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            self.top(x).squeeze(1), labels)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if self.ours:
            for table in self.tables:
                table.step()
        else:
            self.sparse_opt.step()
        t4 = time.perf_counter()
        self.dense_opt.step()
        t5 = time.perf_counter()
        ms = [(b - a) * 1e3 for a, b in zip((t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5))]
        out = dict(zip(PHASES, ms))
        out["step"] = (t5 - t0) * 1e3
        return out


def profile_model(model, batches, steps: int, top: int) -> list:
    """torch.profiler over `steps` steps of `model`: the ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps):
            model.step(batches[k % len(batches)])
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "total_ms_per_step": e.cpu_time_total / 1e3 / steps,
             "calls_per_step": e.count / steps} for e in rows]


def set_serial_bytes(value: int) -> int:
    """The CPU kernels' serial threshold (test hook; 0: the code's default); returns the one in
    force, or -1 for code without the hook."""
    import torch
    hook = getattr(torch.ops.speedtorch_ops, "_set_cpu_serial_bytes", None)
    if hook is None:
        return -1
    hook.default(value)
    return hook.default(value)


def measure(a) -> dict:
    """One thread count, in this process: both models, alternating rounds."""
    import torch
    import speedtorch_ops  # noqa: F401  (registers the ops)
    torch.set_num_threads(a.threads[0])
    serial = set_serial_bytes(a.serial_bytes[0])
    batches = make_batches(a)
    models = {"ours": Model(a, ours=True), "baseline": Model(a, ours=False)}
    times = {name: [] for name in models}
    for name, model in models.items():
        for k in range(a.warmup):
            model.step(batches[k % len(batches)])
    k = 0
    for _ in range(a.rounds):
        for name, model in models.items():
            for _ in range(a.steps):
                times[name].append(model.step(batches[k % len(batches)]))
                k += 1
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__,
              "serial_bytes": serial, "impls": {}}
    for name, steps in times.items():
        keys = list(steps[0])
        result["impls"][name] = {
            key: {"median": statistics.median(s[key] for s in steps),
                  "p10": float(np.percentile([s[key] for s in steps], 10)),
                  "p90": float(np.percentile([s[key] for s in steps], 90))} for key in keys}
        result["impls"][name]["step_ms_each"] = [round(s["step"], 3) for s in steps]
    if a.profile:
        for name, model in models.items():
            result[f"profile_{name}"] = profile_model(model, batches, a.profile_steps, a.top)
    return result


# ---- the serial threshold of the CPU kernels -------------------------------------------------

SWEEP_ROWS = [64, 256, 512, 1024, 1365, 2048, 4096, 8192, 16384, 32768, 65536]


def sweep_kernels(a) -> dict:
    """Milliseconds (median of --sweep-reps calls) of a table step's two transfers (the load and
    the write-back of n distinct rows of a --sweep-table-row table, (1 + 2 Adam states) x --dim
    fp32 a row) and of its distinct ids (_distinct of 3n Zipf ids), each pass forced serial and
    forced parallel with the test hook _set_cpu_serial_bytes, in this process."""
    import torch
    from speedtorch_ops import ops
    # A tree without the hook (code from before it) runs each call as its code decides.
    hook = getattr(torch.ops.speedtorch_ops, "_set_cpu_serial_bytes", None)
    hook = hook.default if hook is not None else (lambda _: 0)
    modes = (("serial", 1 << 62), ("parallel", 1)) if hook(0) else (("default", 0),)
    torch.set_num_threads(a.threads[0])
    rng = np.random.default_rng(a.seed)
    table = torch.randn(a.sweep_table, 3, a.dim)
    zipf = Zipf(rng, a.sweep_table, a.zipf)
    out = {"threads": torch.get_num_threads(), "row_bytes": 3 * a.dim * 4, "cases": [],
           "modes": [m for m, _ in modes]}
    previous = hook(0)
    try:
        for n in SWEEP_ROWS:
            ids = torch.from_numpy(np.sort(rng.choice(a.sweep_table, n, replace=False)))
            slots = torch.arange(n)
            parts = [torch.empty(n, a.dim) for _ in range(3)]
            keys = torch.from_numpy(zipf.draw(rng, 3 * n).astype(np.int64))
            calls = {
                "load": lambda: ops._sorted_transfer(table, parts, ids, slots, True,
                                                     bounds_check="prechecked"),
                "write_back": lambda: ops._sorted_transfer(table, parts, ids, slots, False,
                                                           bounds_check="prechecked"),
                "distinct": lambda: ops._distinct(keys, a.sweep_table),
            }
            case = {"n": n}
            for name, fn in calls.items():
                for mode, bytes_ in modes:
                    hook(bytes_)
                    times = []
                    for _ in range(a.sweep_reps + 3):
                        start = time.perf_counter()
                        fn()
                        times.append((time.perf_counter() - start) * 1e3)
                    case[f"{name}_{mode}"] = statistics.median(times[3:])
            out["cases"].append(case)
    finally:
        hook(previous)
    return out


def print_sweep(r: dict) -> None:
    print(f"\n{r['threads']} threads, busy={r['busy']}, tree {r['tree']!r}: ms per call, "
          f"{' / '.join(r['modes'])} ({r['row_bytes']} B rows; distinct ids of 3n)")
    print(f"{'n':>7} {'bytes':>9} {'load':>17} {'write-back':>17} {'distinct':>17}")
    for c in r["cases"]:
        print(f"{c['n']:>7} {c['n'] * r['row_bytes']:>9} " + " ".join(
            f"{'/'.join(f'{c[k + chr(95) + m]:.3f}' for m in r['modes']):>17}"
            for k in ("load", "write_back", "distinct")))


# ---- the driver ----------------------------------------------------------------------------

def busy_loop(core: int) -> subprocess.Popen:
    """A process spinning on `core` (pinned there) until killed."""
    code = (f"import os\nos.sched_setaffinity(0, {{{core}}})\n"
            "x = 0\nwhile True:\n    x += 1\n")
    return subprocess.Popen([sys.executable, "-c", code])


def child_args(a, threads: int, serial_bytes: int = 0) -> list:
    args = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(threads)]
    for key in ("batch", "bag_len", "dim", "dense", "zipf", "lr", "steps", "warmup", "rounds",
                "distinct_batches", "seed", "profile_steps", "top"):
        args += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    args += ["--tables"] + [str(r) for r in a.tables]
    args += ["--serial-bytes", str(serial_bytes)]
    if a.ours_fused:
        args.append("--ours-fused")
    if a.profile:
        args.append("--profile")
    if a.sweep:
        args += ["--sweep", "--sweep-table", str(a.sweep_table), "--sweep-reps",
                 str(a.sweep_reps)]
    return args


def run_child(a, threads: int, tree: str, serial_bytes: int = 0) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(child_args(a, threads, serial_bytes), env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"the measurement with {threads} threads (tree {tree!r}) failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def label(r: dict) -> str:
    """The tree's folder name, and the serial threshold where one was set."""
    name = os.path.basename(os.path.normpath(r["tree"])) if r["tree"] else "."
    serial = r.get("serial_bytes", -1)
    return name if serial in (-1, None) else f"{name}@{serial // 1024}K"


def print_table(results: list) -> None:
    print(f"{'tree':>14} {'busy':>5} {'thr':>4} {'impl':>9} {'step ms':>8} {'p10-p90':>13} "
          f"{'x base':>7} " + " ".join(f"{p[:12]:>12}" for p in PHASES))
    for r in results:
        base = r["impls"]["baseline"]["step"]["median"]
        for name, phases in r["impls"].items():
            step = phases["step"]
            print(f"{label(r):>14} "
                  f"{str(r['busy']):>5} {r['threads']:>4} {name:>9} {step['median']:>8.2f} "
                  f"{step['p10']:>6.2f}-{step['p90']:<6.2f} {base / step['median']:>7.2f} " +
                  " ".join(f"{phases[p]['median']:>12.2f}" for p in PHASES))
    for r in results:
        for key in ("profile_ours", "profile_baseline"):
            if key in r:
                print(f"\n{key}, {r['threads']} threads, busy={r['busy']}, tree {r['tree']!r}: "
                      "self ms / total ms / calls per step")
                for e in r[key]:
                    print(f"  {e['self_ms_per_step']:8.3f} {e['total_ms_per_step']:8.3f} "
                          f"{e['calls_per_step']:6.1f}  {e['op']}")


def plot(results: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, x = [], 0
    for r in results:
        for name, phases in r["impls"].items():
            bottom = 0.0
            for k, p in enumerate(PHASES):
                v = phases[p]["median"]
                ax.bar(x, v, bottom=bottom, color=f"C{k}", label=p if x == 0 else None)
                bottom += v
            labels.append(f"{name}\n{r['threads']} thr{' busy' if r['busy'] else ''}\n"
                          f"{label(r)}")
            x += 1
    ax.set_xticks(range(x), labels, fontsize=6)
    ax.set_ylabel("ms per step (median of each phase)")
    ax.set_title("DLRM-like step on the CPU: HostEmbeddingBag + Adam against "
                 "nn.EmbeddingBag(sparse) + SparseAdam", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 16])
    p.add_argument("--tables", type=int, nargs="+", default=TABLE_ROWS,
                   help="rows of each table")
    p.add_argument("--batch", type=int, default=2048, help="samples (bags per table) a step")
    p.add_argument("--bag-len", type=int, default=4, help="ids per bag: 1 to this, uniform")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dense", type=int, default=13, help="dense features a sample")
    p.add_argument("--zipf", type=float, default=1.05, help="the ids' Zipf exponent")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=12, help="timed steps a round, each model")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--distinct-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--busy", action="store_true",
                   help="a process spins on one core (--busy-core) while the steps run")
    p.add_argument("--busy-core", type=int, default=None, help="default: the last core")
    p.add_argument("--both", action="store_true", help="with --busy: also without (first)")
    p.add_argument("--trees", nargs="+", default=[""],
                   help="source trees to put first on PYTHONPATH, one measurement each")
    p.add_argument("--repeat", type=int, default=1, help="the whole set, this many times")
    p.add_argument("--serial-bytes", type=int, nargs="+", default=[0],
                   help="the CPU kernels' serial threshold (bytes; 0: the code's default), "
                        "one measurement each")
    p.add_argument("--ours-fused", action="store_true",
                   help="our tables' Adam with fused=True (one kernel a step)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler's costliest ops of a few steps (after the timing)")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tag", default="run")
    p.add_argument("--out", default="bench/out")
    p.add_argument("--sweep", action="store_true",
                   help="instead of the step: the serial threshold's sweep (see sweep_kernels)")
    p.add_argument("--sweep-table", type=int, default=1_000_000)
    p.add_argument("--sweep-reps", type=int, default=30)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(sweep_kernels(a) if a.sweep else measure(a)))
        return
    if a.steps * a.rounds < 20 and not a.sweep:
        p.error("time at least 20 steps a model (--steps x --rounds)")
    results = []
    busy_modes = [False, True] if a.busy and a.both else [a.busy]
    for rep in range(a.repeat):
        for busy in busy_modes:
            spinner = None
            if busy:
                core = a.busy_core if a.busy_core is not None else os.cpu_count() - 1
                spinner = busy_loop(core)
                time.sleep(0.5)
            try:
                for threads in a.threads:
                    for tree, serial in [(t, b) for t in a.trees for b in a.serial_bytes]:
                        r = run_child(a, threads, tree, serial)
                        r.update(busy=busy, tree=tree, repeat=rep)
                        results.append(r)
                        print_sweep(r) if a.sweep else print_table([r])
                        sys.stdout.flush()
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    os.makedirs(a.out, exist_ok=True)
    if a.sweep:
        path = os.path.join(a.out, f"cpu_module-sweep-{a.tag}.json")
        with open(path, "w") as f:
            json.dump({"cpus": os.cpu_count(), "args": vars(a), "results": results}, f, indent=1)
        print(f"wrote {path}")
        return
    print("\nall:")
    print_table(results)
    base = os.path.join(a.out, f"cpu_module-{a.tag}")
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "args": {k: v for k, v in vars(a).items() if k != "child"}}
    with open(base + ".json", "w") as f:
        json.dump({**meta, "results": results}, f, indent=1)
    plot(results, base + ".png")
    print(f"wrote {base}.json")


if __name__ == "__main__":
    main()
