"""NVIDIA dynamicemb's public BatchedDynamicEmbeddingTables benchmark (recsys-examples,
corelib/dynamicemb/benchmark/benchmark_batched_dynamicemb_tables.py, its Adam configs without
pooling) for our HostEmbeddingCollection and the strongest plain-PyTorch step, in one process.

Their workload: --tables 10 tables of --cap rows x --dim 128 float32, --ids-per-table 104,857
ids a table a step (one a sample, no pooling); Adam lr 0.1, eps 1e-8, one global step count.
After torch.cuda.manual_seed(42) each table in turn draws all its --steps batches at once with
their PowerLaw(1, cap, 1.05, n) (benchmark/dataset_generator.py), a bounded power law by
inverse CDF: x ~ U[0, 1) (torch.rand, float64), g = 1 - alpha (a float32 tensor, as there),
id = int64((x (cap^g - 1) + 1)^(1/g)), an id >= cap made cap - 1: ids in [1, cap - 1]; batch i
of table t is its draws [i*B, (i+1)*B). --warmup steps over the same batches with an all-ones
output gradient (their reporting loop; it fills the caches), then --steps timed with a fixed
torch.randn one, each step (forward, backward, update) alone between CUDA events, the device
synchronized after it; reported: the mean (theirs), median and p90. Each system runs fresh and
in turn (theirs interleave the two systems step by step).

- baseline: the whole tables on the GPU, stacked in one (tables*cap, D) weight (table t's ids
  offset by t*cap, as a table-batched kernel stores them) with exp_avg, exp_avg_sq and a
  gradient buffer alike. A step gathers the rows (index_select: the output), index_add_s the
  output gradient into the gradient buffer, gathers each position's summed gradient and state,
  runs torch's fused Adam kernel on them (Adam(fused=True)'s; step count on the GPU), writes
  them back with index_copy_ (duplicates write equal values) and zeroes the gradient rows: three
  eager steps, then one CUDA graph, replayed after copying the ids into its input (timed).
  --selfcheck: its steps against float64 lazy Adam (Adam on the touched rows, summed gradients).
- ours: HostEmbeddingCollection, tables + Adam state in pinned host memory, a GPU row cache of
  cfr x (each table's distinct ids over the batches) rows ("all": every row), budget rows x
  3*D*4 B + CachedRows.index_bytes(cap) a table (the collection shares one cache between
  tables of one width). --mode eager (KeyedJaggedTensors built beforehand, untimed, as theirs)
  and captured (CapturedStep: the ids already on the GPU, checked there with one wait within
  the timed step; run last, stopping at the first failure, which can spoil the CUDA state);
  captured-prefetch: captured, each step also prefetching the next batch's rows (the batches
  cycle), as a training pipeline that knows its next batch can. --hashed: ours with hashed
  tables (TableConfig(num_embeddings=None, capacity=--cap)) fed each id as a random-looking
  int64 key (a fixed bijection, ``keyed``): eager, uncached (a hashed group has no cache yet).

Output: a table, --out JSON (per run: mean / median / p90 ms and each timed step's, the hit rate
over the timed steps beside the best static cache's (each table's most drawn rows, as many as
ours holds), ours_over_baseline = our ms / the baseline's; the published H100 numbers), --plot
PNG; with --profile DIR, a torch.profiler table and chrome trace of 3 more steps a run.

    python bench/bdet.py --cap 1677721 --out bench/results/bdet-cap1.7M.json \\
        --plot bench/results/bdet-cap1.7M.png
    python bench/bdet.py --selfcheck            # the baseline's update (CPU; and the GPU graph)
    python bench/bdet.py --device cpu --cap 1000 --tables 3 --ids-per-table 500 --steps 3 \\
        --warmup 2                              # a smoke run of the code path, tiny
"""

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import numpy as np
import torch

from _workloads import lazy_adam_

LR, EPS, BETAS = 0.1, 1e-8, (0.9, 0.999)
# Their benchmark_results.json: mean ms of forward + backward (the update fused in), Adam, pool
# none, 10 tables, 1,048,570 ids; 1.68 M rows a table whole in HBM, 26.8 M behind a cache of cfr
# x the distinct ids. The distinct ids a step tell whether our draws match theirs.
PUBLISHED = {
    "source": "NVIDIA/recsys-examples corelib/dynamicemb/benchmark/benchmark_results.json",
    "gpu": "NVIDIA H100 80GB HBM3",
    "cap_1677721": {"torchrec_tbe_hbm_ms": 1.352, "dynamicemb_hbm_ms": 2.185,
                    "avg_distinct_ids_per_step": 350280.02},
    "cap_26843545": {"torchrec_ms": {"1.0": 14.37, "0.8": 15.00},
                     "dynamicemb_ms": {"1.0": 12.28, "0.8": 24.33},
                     "avg_distinct_ids_per_step": 433722.73},
}


def power_law(lo, hi, alpha, n, device):
    """Their PowerLaw(lo, hi, alpha, n) as written (the float32 exponent included), so one seed
    draws the same ids."""
    x = torch.rand(n, device=device, dtype=torch.float64)
    gamma = torch.tensor([1 - alpha], device=device)
    y = torch.pow(x * (torch.pow(hi, gamma) - torch.pow(lo, gamma)) + torch.pow(lo, gamma),
                  1.0 / gamma)
    y[y >= hi] = hi - 1
    return y.to(torch.int64)


def draw_batches(a, device):
    """(steps, tables * B) ids, table by table within a batch; the fixed output gradient."""
    (torch.cuda.manual_seed if device.type == "cuda" else torch.manual_seed)(42)
    per_table = [power_law(1, a.cap, 1.05, a.steps * a.ids_per_table, device)
                 for _ in range(a.tables)]
    ids = torch.stack([v.view(a.steps, a.ids_per_table) for v in per_table], 1)
    return ids.reshape(a.steps, -1), torch.randn(ids[0].numel(), a.dim, device=device)


class Baseline:
    """The whole tables on the GPU, stacked (module docstring); run(ids) trains one step."""

    def __init__(self, tables, cap, dim, ids_per_table, out_grad, device):
        self.weight = torch.randn(tables * cap, dim, device=device)
        self.exp_avg, self.exp_avg_sq, self.grad_rows = (
            torch.zeros_like(self.weight) for _ in range(3))
        self.step_count = torch.zeros((), device=device)  # fused Adam takes a float32 count
        self.ids = torch.zeros(tables * ids_per_table, dtype=torch.int64, device=device)
        self.base = torch.arange(tables, device=device).mul_(cap).repeat_interleave(ids_per_table)
        self.out_grad, self.device, self.graph, self.calls = out_grad, device, None, 0

    def _step(self):
        gid = self.ids + self.base
        rows = self.weight.index_select(0, gid)  # the forward's output
        # The output is spent once the backward is done, so the update reuses its buffer.
        lazy_adam_([(self.weight, self.exp_avg, self.exp_avg_sq, self.grad_rows)], [gid], [rows],
                   [self.out_grad], self.step_count,
                   dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=0.0, eps=EPS,
                        amsgrad=False, maximize=False))

    def run(self, ids):
        self.ids.copy_(ids)
        self.calls += 1
        if self.device.type != "cuda":
            self._step()
        elif self.calls <= 3:  # a capture needs the allocations and lazy set-ups done before
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self._step()
            self.graph.replay()


def selfcheck(device, steps=5):
    """Each of `steps` baseline steps (eager, then graph replays on a GPU) against lazy Adam in
    float64: torch.optim.Adam on the touched rows only, with their summed gradients."""
    tables, cap, dim, per = 3, 40, 8, 30
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(tables * per, dim, generator=gen)
    base = Baseline(tables, cap, dim, per, grad.to(device), device)
    ref = {"w": base.weight.double().cpu(), "m": torch.zeros(tables * cap, dim).double(),
           "v": torch.zeros(tables * cap, dim).double()}
    for s in range(1, steps + 1):
        ids = torch.randint(0, cap // 2, (tables * per,), generator=gen)  # duplicates, untouched
        base.run(ids.to(device))
        touched, where = (ids + base.base.cpu()).unique(return_inverse=True)
        p = torch.nn.Parameter(ref["w"][touched])
        p.grad = torch.zeros_like(p).index_add_(0, where, grad.double())
        opt = torch.optim.Adam([p], lr=LR, betas=BETAS, eps=EPS)
        opt.state[p] = {"step": torch.tensor(float(s - 1)), "exp_avg": ref["m"][touched],
                        "exp_avg_sq": ref["v"][touched]}
        opt.step()
        ref["w"][touched], ref["m"][touched] = p.detach(), opt.state[p]["exp_avg"]
        ref["v"][touched] = opt.state[p]["exp_avg_sq"]
        for name, got in (("w", base.weight), ("m", base.exp_avg), ("v", base.exp_avg_sq)):
            torch.testing.assert_close(got.cpu().double(), ref[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {s}, {name}: {m}")
        assert not base.grad_rows.any(), f"step {s}: gradient rows not zeroed"
    print(f"selfcheck on {device}: {steps} baseline steps equal float64 lazy Adam")


def timed_steps(step, a, grad, fixed_grad, device, after_warmup=lambda: None, label="",
                after_step=lambda: None):
    """--warmup steps with an all-ones output gradient, after_warmup(), then --steps with the
    fixed one: ms of each of those alone (CUDA events; perf_counter on the CPU), after_step()
    after each (outside the timing). With --profile DIR, the last three batches again under
    torch.profiler: DIR/<label>.txt, the kernels and phases by GPU time, and <label>.json, their
    chrome trace."""
    cuda = device.type == "cuda"
    grad.fill_(1)
    for i in range(a.warmup):
        step(i % a.steps)
        if cuda:
            torch.cuda.synchronize()
    after_warmup()
    grad.copy_(fixed_grad)
    times = []
    for i in range(a.steps):
        if not cuda:
            t = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - t) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        after_step()
    if a.profile and cuda:
        os.makedirs(a.profile, exist_ok=True)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for i in range(max(a.steps - 3, 0), a.steps):
                step(i)
                torch.cuda.synchronize()
        with open(os.path.join(a.profile, f"{label}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60,
                                              max_name_column_width=70))
        prof.export_chrome_trace(os.path.join(a.profile, f"{label}.json"))
    return {"mean_ms": statistics.fmean(times), "median_ms": statistics.median(times),
            "p90_ms": float(np.percentile(times, 90)), "steps": len(times),
            "times_ms": [round(t, 4) for t in times]}


def run_baseline(a, ids, grad, fixed_grad, device):
    need = 4 * a.tables * a.cap * a.dim * 4
    print(f"baseline: {need / 2**30:.2f} GiB on the GPU (weight, Adam state, gradients)",
          flush=True)
    if device.type == "cuda" and need + 8 * grad.nbytes > torch.cuda.mem_get_info()[0]:
        return {"skipped": "the whole tables do not fit in free GPU memory"}
    base = Baseline(a.tables, a.cap, a.dim, a.ids_per_table, grad, device)
    return timed_steps(lambda i: base.run(ids[i]), a, grad, fixed_grad, device,
                       label="baseline")


def host_available():
    """/proc/meminfo's MemAvailable in bytes (0: unknown)."""
    with open("/proc/meminfo") as f:
        return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")), 0)


def run_ours(a, ids, grad, fixed_grad, device, mode, cache_bytes):
    import speedtorch_ops as so
    from speedtorch_ops.demo.train import set_sm_caps
    cuda = device.type == "cuda"
    need, free = a.tables * a.cap * row_bytes(a), host_available()
    print(f"ours {mode}: {need / 2**30:.2f} GiB of {'pinned ' if cuda else ''}host memory "
          f"({free / 2**30:.1f} GiB available), GPU cache budget "
          f"{cache_bytes / 2**30:.2f} GiB", flush=True)
    if need > free > 0:  # asking anyway may end in the OOM killer
        return {"skipped": "the tables do not fit in available host memory"}
    keys = [f"t{k}" for k in range(a.tables)]
    kwargs = {"lr": LR, "eps": EPS, "betas": BETAS, **({"capturable": True} if cuda else {})}
    dtype = getattr(torch, a.dtype)
    sizes = dict(num_embeddings=None, capacity=a.cap) if a.hashed else dict(num_embeddings=a.cap)
    ebc = so.HostEmbeddingCollection(
        [so.TableConfig(name=k, embedding_dim=a.dim, pooling="none", **sizes)
         for k in keys], optimizer=torch.optim.Adam, optimizer_kwargs=kwargs, device=device,
        cache_bytes=cache_bytes if cuda else 0, bounds_check="prechecked", dtype=dtype,
        stochastic_rounding=a.rounding == "stochastic")
    set_sm_caps(ebc, a)  # the cache's, where given
    if dtype != grad.dtype:  # the outputs' gradient in their dtype, the same values
        grad, fixed_grad = torch.empty_like(grad, dtype=dtype), fixed_grad.to(dtype)
    grads = list(grad.split(a.ids_per_table))
    lengths = torch.ones(len(keys) * a.ids_per_table, dtype=torch.int64, device=device)
    offsets = torch.arange(len(lengths) + 1, device=device)  # one id a sample, as theirs

    def train(kjt, ahead=None):
        out = ebc(kjt)
        if ahead is not None:  # the next batch's rows load during this step's backward
            ebc.prefetch(ahead)
        torch.autograd.backward([out[k].values() for k in keys], grads)
        ebc.step()
        return ()

    def batch(values):  # given the ids per key, building it reads nothing back: capturable
        return so.KeyedJaggedTensor(keys, values, lengths=lengths, offsets=offsets,
                                    length_per_key=[a.ids_per_table] * len(keys))

    if mode == "eager":
        kjts = [so.KeyedJaggedTensor.from_lengths_sync(keys, keyed(ids[i]) if a.hashed
                                                       else ids[i], lengths)
                for i in range(a.steps)]
        step = lambda i: train(kjts[i])  # noqa: E731
    elif mode == "captured":
        captured = so.CapturedStep(lambda values: train(batch(values)), rows=(a.cap,))
        step = lambda i: captured(ids[i])  # noqa: E731  (on the GPU: checked there)
    else:  # captured-prefetch: each step also prefetches the next batch (a pipeline's)
        captured = so.CapturedStep(lambda values, ahead: train(batch(values), batch(ahead)),
                                   rows=(a.cap, a.cap))
        step = lambda i: captured(ids[i], ids[(i + 1) % a.steps])  # noqa: E731
    marks = []  # the counts after the warm-up, whose lookups stay out of the hit rate
    counts = ("host_loads", "evictions", "direct_writebacks")
    per_step = {k: [] for k in counts}  # with --per-step: each timed step's

    def count_step():
        if a.per_step and cuda:
            now = ebc.cache_stats()["total"]
            for k in counts:
                per_step[k].append(now[k] - marks[-1][k])
            marks.append(now)

    result = timed_steps(step, a, grad, fixed_grad, device,
                         lambda: marks.append(ebc.cache_stats()["total"]),
                         label=f"ours-{mode}-cfr{cache_bytes}", after_step=count_step)
    if a.per_step and cuda:
        result["counts_per_step"] = per_step
    after = ebc.cache_stats()["total"]
    lookups = after["lookups"] - marks[0]["lookups"]  # from the warm-up's end
    hit = (after["hits"] - marks[0]["hits"]) / lookups if cuda and lookups else None
    # Per step (the timed ones and the profiled, if any): rows that crossed the host link.
    steps = result["steps"] + (3 if a.profile and cuda else 0)
    moved = {k: (after[k] - marks[0][k]) / steps for k in (
        "host_loads", "prefetched_loads", "deferred_loads", "prefetched_rows", "evictions",
        "direct_writebacks", "host_bytes")}
    return {**result, "hit_rate": hit, "per_step": moved}


def keyed(ids: torch.Tensor) -> torch.Tensor:
    """--hashed: each id as a random-looking int64 key, by a fixed bijection (an odd multiplier
    mod 2^64, then x ^ (x >> 29) unsigned), so a hashed table cannot index by the id."""
    x = ids * -7046029254386353131  # 0x9E3779B97F4A7C15, wrapping
    return x ^ ((x >> 29) & ((1 << 35) - 1))


def row_bytes(a) -> int:
    """Our row with Adam's two moments in --dtype."""
    return 3 * a.dim * getattr(torch, a.dtype).itemsize


def cache_plan(a, ids):
    """Each table's distinct ids over the batches, the mean distinct ids a step (all tables:
    their Avg N_unique), and per cfr our cache rows a table and budget, and the hit rate of the
    best static cache of as many rows (each table's most drawn rows over the batches, ties in
    row order; the share of a step's distinct ids it holds, as our hit rate counts)."""
    per = ids.view(a.steps, a.tables, a.ids_per_table)
    steps = [[per[i, t].unique() for i in range(a.steps)] for t in range(a.tables)]
    distinct = [int(torch.cat(steps[t]).unique().numel()) for t in range(a.tables)]
    lookups = sum(u.numel() for rows in steps for u in rows)
    step_distinct = lookups / a.steps
    plans = {}
    if "ours" in a.systems:
        from speedtorch_ops.training.cache import CachedRows
        drawn = [torch.bincount(per[:, t].flatten(), minlength=a.cap) for t in range(a.tables)]
        for cfr in a.cfr:
            rows = [a.cap] * a.tables if cfr == "all" else [int(float(cfr) * d) for d in distinct]
            hits = 0
            for t, r in enumerate(rows):
                held = torch.zeros(a.cap, dtype=torch.bool, device=ids.device)
                held[torch.sort(drawn[t], descending=True, stable=True).indices[:r]] = True
                hits += sum(int(held[u].sum()) for u in steps[t])
            plans[cfr] = {"cache_rows_per_table": rows, "cache_bytes": sum(
                r * row_bytes(a) + CachedRows.index_bytes(a.cap) for r in rows),
                "static_hit_rate": hits / lookups}
        del drawn
    return distinct, step_distinct, plans


def plot(path, runs, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    bars = [(f"baseline\n({r['mode']})" if r["system"] == "baseline" else
             f"ours {r['mode']}\ncfr {r['cfr']}", r["mean_ms"],
             "C0" if r["system"] == "baseline" else "C1") for r in runs if "mean_ms" in r]
    for key, ms in PUBLISHED.get(f"cap_{a.cap}", {}).items():  # the peers at this cap
        name = key.split("_")[0]
        if isinstance(ms, dict):
            bars += [(f"{name} cfr {c}\n(published, H100)", v, "0.6") for c, v in ms.items()]
        elif key.endswith("_ms"):
            bars.append((f"{name} in HBM\n(published, H100)", ms, "0.6"))
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(bars)), 4.5))
    ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    for x, b in enumerate(bars):
        ax.text(x, b[1], f"{b[1]:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("ms / step (mean)")
    ax.set_title(f"{a.tables} tables x {a.cap:,} x {a.dim} + Adam (ours {a.dtype}), "
                 f"{a.tables * a.ids_per_table:,} power-law ids a step\n{a.device_name}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    listed = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--cap", type=int, default=1677721, help="rows a table")
    p.add_argument("--cfr", type=listed, default=["1.0", "0.8", "all"],
                   help="ours: cache rows a table over its distinct ids (all: every row)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--tables", type=int, default=10)
    p.add_argument("--ids-per-table", type=int, default=104857)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="our tables' and their state's dtype (16-bit: stochastic rounding); the "
                        "baseline keeps float32")
    p.add_argument("--rounding", choices=["stochastic", "nearest"], default="stochastic",
                   help="how 16-bit tables store their updates")
    p.add_argument("--systems", type=listed, default=["ours", "baseline"])
    p.add_argument("--mode", type=listed, default=["eager", "captured"],
                   help="ours' modes: eager, captured, captured-prefetch (captured, each step "
                        "prefetching the next batch's rows, as a training pipeline can)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the code")
    p.add_argument("--hashed", action="store_true",
                   help="ours with hashed tables (capacity --cap, any int64 id), each id mapped "
                        "to a random-looking key; eager only, no row cache (a hashed group has "
                        "none yet)")
    p.add_argument("--lane-sms", type=int, default=None,
                   help="the SMs the cache's loads (and a prefetch's) may use (CachedRows.lane_sms; "
                        "default: the store's)")
    p.add_argument("--write-sms", type=int, default=None,
                   help="the SMs the cache's write-backs may use (CachedRows.write_sms; default: "
                        "the store's)")
    p.add_argument("--out", help="JSON path")
    p.add_argument("--plot", help="PNG path")
    p.add_argument("--profile", help="a folder for torch.profiler tables and chrome traces of 3 "
                                     "steps a run")
    p.add_argument("--per-step", action="store_true",
                   help="ours: also each timed step's host loads, evictions and direct "
                        "write-backs (read between steps, outside the timing)")
    p.add_argument("--selfcheck", action="store_true",
                   help="the baseline's steps against float64 lazy Adam on tiny tables: on the "
                        "CPU, and through the graph on --device when it is a GPU")
    p.add_argument("--prefetch-priority", type=int, default=None,
                   help="with captured-prefetch: the priority of ours' prefetch streams "
                        "(training.stores.PREFETCH_PRIORITY; 0: the step's own); default the "
                        "library's")
    a = p.parse_args()
    device = torch.device(a.device)
    if a.prefetch_priority is not None:
        from speedtorch_ops.training import stores
        stores.PREFETCH_PRIORITY = a.prefetch_priority
    if a.selfcheck:
        for d in [torch.device("cpu")] + ([device] if device.type == "cuda" and
                                          torch.cuda.is_available() else []):
            selfcheck(d)
        return
    if any(c != "all" and not float(c) > 0 for c in a.cfr):
        p.error(f"--cfr: ratios above 0, or all; got {a.cfr}")
    a.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    ids, fixed_grad = draw_batches(a, device)
    assert 1 <= int(ids.min()) and int(ids.max()) < a.cap  # ours trusts them ("prechecked")
    distinct, step_distinct, plans = cache_plan(a, ids)
    theirs = PUBLISHED.get(f"cap_{a.cap}", {}).get("avg_distinct_ids_per_step")
    print(f"{a.device_name}: {a.tables} tables x {a.cap:,} x {a.dim}, {ids.shape[1]:,} ids a "
          f"step, {step_distinct:,.0f} distinct a step (theirs: {theirs or '-'}); each table's "
          f"distinct ids over the batches {distinct}", flush=True)
    grad = torch.empty_like(fixed_grad)  # the output gradient every system reads
    runs = []

    def attempt(record, fn):
        try:
            record.update(fn())
        except Exception as error:  # noqa: BLE001 - the other runs still report
            traceback.print_exc()
            record["error"] = f"{type(error).__name__}: {error}"
        print({k: v for k, v in record.items()
               if k not in ("cache_rows_per_table", "times_ms", "counts_per_step")},
              flush=True)
        runs.append(record)
        gc.collect()  # this run's tables go before the next one's come
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return "error" not in record

    if "baseline" in a.systems:
        attempt({"system": "baseline", "mode": "captured" if device.type == "cuda" else "eager"},
                lambda: run_baseline(a, ids, grad, fixed_grad, device))
    if a.hashed and (set(a.mode) != {"eager"} or set(a.cfr) != {"all"}):
        p.error("--hashed runs --mode eager --cfr all (a hashed table trains eagerly, uncached)")
    for mode in [m for m in ("eager", "captured", "captured-prefetch")
                 if m in a.mode and "ours" in a.systems]:
        if mode.startswith("captured") and device.type != "cuda":
            continue  # a CUDA graph needs a GPU
        for cfr in a.cfr:
            if not attempt({"system": "ours", "mode": mode, "cfr": cfr, **plans[cfr]},
                           lambda: run_ours(a, ids, grad, fixed_grad, device, mode,
                                            plans[cfr]["cache_bytes"])) and mode != "eager":
                break
    base = next((r["mean_ms"] for r in runs if r["system"] == "baseline" and "mean_ms" in r),
                None)
    print(f"{'system':>8} {'mode':>8} {'cfr':>4} {'mean ms':>8} {'median':>8} {'p90':>8} "
          f"{'hit':>6} {'static':>6} {'/ base':>7}")
    for r in runs:
        head = f"{r['system']:>8} {r['mode']:>8} {r.get('cfr', '-'):>4}"
        if "mean_ms" not in r:
            print(head, r.get("error") or r.get("skipped"))
            continue
        if base and r["system"] == "ours":
            r["ours_over_baseline"] = r["mean_ms"] / base  # below 1: ours is faster
        nan = float("nan")
        print(f"{head} {r['mean_ms']:>8.3f} {r['median_ms']:>8.3f} {r['p90_ms']:>8.3f} "
              f"{r.get('hit_rate') if r.get('hit_rate') is not None else nan:>6.3f} "
              f"{r.get('static_hit_rate', nan):>6.3f} "
              f"{r.get('ours_over_baseline', nan):>7.2f}")
    result = {"benchmark": "dynamicemb BatchedDynamicEmbeddingTables, Adam, pool none",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": a.device_name, "torch": torch.__version__,
              "config": {k: v for k, v in vars(a).items() if k != "device_name"},
              "ids_per_step": ids.shape[1], "distinct_per_table": distinct,
              "avg_distinct_ids_per_step": step_distinct, "runs": runs, "published": PUBLISHED}
    for path in (a.out, a.plot):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(a.plot, runs, a)


if __name__ == "__main__":
    main()
