"""The sharding claim: the demo's skip-gram (two vocab x dim tables + Adam state, ZipfCorpus) on
ShardedHostEmbedding with a fixed per-rank batch, 1 rank against 2 ranks on one machine (each
GPU with its own host link and row cache, the rows exchanged over NCCL), in samples/s; then a
profiling run with the device synchronized around each phase: route (counts and ids to the
owners), transfer (owners staging and committing rows: cache and host link, the optimizer on
the staged rows), exchange (rows to the requesters, gradients to the owners), compute (loss and
backward). Each world size runs both routings (--route): the two tables in one
ShardedEmbeddingDict (one exchange per phase for both) and each table on its own; the
speedups compare the first. The 1-rank run also times the single-process HostEmbedding (no
routing) on the same batches. Output: a table, and JSON (--json).

    python bench/sharded.py --ranks 1 2 --json sharded.json           # spawns the ranks
    torchrun --nproc_per_node=2 bench/sharded.py --json sharded.json  # one world size

On a machine without GPUs the ranks run on the CPU with gloo (small sizes: a smoke test).
"""

import argparse
import contextlib
import datetime
import gc
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import speedtorch_ops as so
from speedtorch_ops.demo.corpus import CORPORA
from speedtorch_ops.demo.model import skipgram_loss
from speedtorch_ops.distributed import ShardedEmbeddingDict, ShardedHostEmbedding
from speedtorch_ops.distributed.exchange import PhaseTimes

PHASES = ("route", "transfer", "exchange", "compute")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2],
                   help="world sizes to run one after the other (spawned); ignored under torchrun")
    p.add_argument("--vocab", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8192, help="centre words per step per rank")
    p.add_argument("--negatives", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--warmup", type=int, default=30, help="steps before the clock (fill caches)")
    p.add_argument("--repeats", type=int, default=5,
                   help="collection: the timed steps in this many windows; a run's step time "
                        "is their median")
    p.add_argument("--profile-steps", type=int, default=50)
    p.add_argument("--cache-mb", type=float, default=1200, help="row cache per rank, both tables")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--corpus", choices=sorted(CORPORA), default="zipf")
    p.add_argument("--tokens", type=int, default=2_000_000)
    p.add_argument("--cluster-size", type=int, default=20)
    p.add_argument("--route", nargs="+", choices=["together", "apart"],
                   default=["together", "apart"],
                   help="together: both tables in one ShardedEmbeddingDict (one exchange "
                        "per phase); apart: each table its own exchanges")
    p.add_argument("--engine", nargs="+", choices=["collection", "modules"],
                   default=["collection", "modules"],
                   help="collection: ShardedHostEmbeddingBagCollection, each step one CUDA graph "
                        "replay with the next batch's rows prefetched (eager on the CPU); "
                        "modules: ShardedHostEmbedding with --route, eager")
    p.add_argument("--exchange", nargs="+", choices=["auto", "collective", "peer"],
                   default=["auto"], help="the sharded collection's exchanges, each measured "
                   "(at 2+ ranks)")
    p.add_argument("--ids", nargs="+", choices=["host", "device"], default=["host", "device"],
                   help="collection: where a captured step's ids come from, each measured on "
                        "the same module and graph (the first is the run's time; default: "
                        "both, host first). host (as the demo and a DataLoader): "
                        "checked on the host and uploaded in one copy, the host running ahead; "
                        "device: checked on the GPU, so each call waits for the step before it "
                        "(CapturedStep's one wait)")
    p.add_argument("--lane-sms", type=int, default=None,
                   help="collection: the SMs its cache's loads may use (CachedRows.lane_sms; "
                        "default: the store's); the module engine keeps its default")
    p.add_argument("--write-sms", type=int, default=None,
                   help="collection: the SMs its cache's write-backs may use "
                        "(CachedRows.write_sms; default: the store's)")
    p.add_argument("--eager", action="store_true",
                   help="collection: launch the steps op by op (no CUDA graph)")
    p.add_argument("--profile", default=None,
                   help="collection: write each rank's torch.profiler table of 20 steps to "
                        "PROFILE-<world>-<rank>-<exchange>.txt (1-0-modules: the module engine)")
    p.add_argument("--trace", default=None,
                   help="collection: write each rank's torch.profiler timeline of 3 steps to "
                        "TRACE-<world>-<rank>-<exchange>.json.gz (chrome://tracing, Perfetto; "
                        "1-0-modules: the module engine)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write the collection's bar chart here (PNG)")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only redraw --plot from a JSON an earlier run wrote")
    return p.parse_args(argv)


def batches(a, rank, count=64):
    """`count` batches of this rank (drawn ahead, cycled: sampling is not what is measured)."""
    corpus = CORPORA[a.corpus](a.vocab, a.cluster_size, a.tokens)  # the same text on each rank
    corpus.rng = np.random.default_rng(1000 + rank)  # but each rank its own samples
    torch.manual_seed(1000 + rank)
    return [tuple(torch.from_numpy(x) for x in corpus.batch(a.batch, a.negatives))
            for _ in range(count)]


def tables(a, device, sharded: bool):
    kwargs = dict(optimizer=torch.optim.Adam, optimizer_kwargs={"lr": a.lr}, device=device,
                  cache_bytes=int(a.cache_mb * 2**20) // 2 if device.type == "cuda" else 0)
    cls = ShardedHostEmbedding if sharded else so.HostEmbedding
    u, v = (cls(a.vocab, a.dim, **kwargs) for _ in range(2))
    bound = 0.5 / a.dim
    u.reset_parameters(lambda w: w.uniform_(-bound, bound))
    v.reset_parameters(lambda w: w.normal_(0.0, bound))
    return u, v


def train_step(u, v, batch, timer=None, together=None):
    labels, ctx, negs = batch
    if together is not None:
        out = together({"u": labels, "v": (ctx, negs)})
        centre, (context, negatives) = out["u"], out["v"]
    else:
        centre = u(labels)
        context, negatives = v(ctx, negs)
    with timer.phase("compute") if timer else contextlib.nullcontext():
        loss = skipgram_loss(centre, context, negatives)
        loss.backward()
    if together is not None:
        together.step()
    else:
        u.step()
        v.step()


def measure(a, u, v, data, device, world, together=None):
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for i in range(a.warmup):
        train_step(u, v, data[i % len(data)], together=together)
    sync()
    start = time.perf_counter()
    for i in range(a.steps):
        train_step(u, v, data[(a.warmup + i) % len(data)], together=together)
    sync()
    seconds = time.perf_counter() - start
    result = {"step_ms": seconds / a.steps * 1e3,
              "samples_per_s": world * a.batch * a.steps / seconds}
    timer = PhaseTimes(device)
    for emb in (u, v):
        if hasattr(emb, "timer"):
            emb.timer = timer
    sync()
    start = time.perf_counter()
    for i in range(a.profile_steps):
        train_step(u, v, data[i % len(data)], timer, together)
    sync()
    total = (time.perf_counter() - start) / a.profile_steps * 1e3
    phases = {k: timer.seconds.get(k, 0.0) / a.profile_steps * 1e3 for k in PHASES}
    phases["other"] = total - sum(phases.values())
    result.update(profiled_step_ms=total, phases_ms=phases)
    if world > 1:  # every rank's phases: a rank waiting in a collective shows its peer's delay
        per_rank = [None] * world
        dist.all_gather_object(per_rank, phases)
        result["phases_ms_per_rank"] = per_rank
    return result


def collection_step(a, device, sharded: bool, exchange: str = "auto"):
    """The skip-gram on one collection of two tables, Adam, unpooled: the demo's engine
    (``CollectionTraining``), sharded or, with `sharded` False, the single-process one. On a
    GPU each step is one CUDA graph replay that also prefetches the next batch's rows."""
    from types import SimpleNamespace

    from speedtorch_ops.demo.train import CollectionTraining
    args = SimpleNamespace(vocab=a.vocab, dim=a.dim, lr=a.lr, optimizer="adam", fused=None,
                           dtype="float32", rounding=None, cache_mb=a.cache_mb,
                           graph="off" if a.eager else "on", prefetch="on",
                           bounds_check="prechecked" if device.type == "cuda" else "raise",
                           lane_sms=a.lane_sms, write_sms=a.write_sms)
    return CollectionTraining(args, device, sharded=sharded, exchange=exchange)


def exchange_bytes(a, world, ebc) -> dict:
    """Bytes a rank's step moves to or from its peers (its own bucket stays local): ids twice
    (the forward's and the prefetch's), in buckets of n slots a peer (the step's ids), padding
    included; rows once and their gradients once: whole buckets by the collectives, by the peer
    exchange only the rows of ids its peers own (counted as (world - 1) / world of the n ids,
    the share of ids a uniform owner takes: the ids are cyclic by row)."""
    n = a.batch * (2 + a.negatives)
    peers = world - 1
    row = a.dim * ebc.groups[0].dtype.itemsize
    rows = n * peers // world * row if getattr(ebc, "exchange", "") == "peer" else peers * n * row
    return {"ids": 2 * peers * n * 8, "rows": rows, "grads": rows}


def timed_steps(a, data, run, host_bytes, sync) -> tuple:
    """(the median step of a.repeats windows of a.steps / a.repeats steps of `run` after
    a.warmup, in seconds; every window's; the host-link bytes a step). `host_bytes()`: the
    run's bytes over the link so far. Several windows, each ended by a sync, so that a slow
    moment of the machine spoils one window, not the run."""
    for i in range(a.warmup):
        run.step(data[i % len(data)], data[(i + 1) % len(data)])
    sync()
    host0 = host_bytes()
    per = max(1, a.steps // a.repeats)
    windows, i = [], a.warmup
    for _ in range(a.repeats):
        start = time.perf_counter()
        for _ in range(per):
            run.step(data[i % len(data)], data[(i + 1) % len(data)])
            i += 1
        sync()
        windows.append((time.perf_counter() - start) / per)
    return float(np.median(windows)), windows, (host_bytes() - host0) / (i - a.warmup)


def gaps(a, data, run, device, steps: int = 50) -> dict:
    """Where a step's time goes between the host and the GPU, over `steps` more steps (medians,
    ms): the host's time in a call (`host_call_ms`); the stream's time from a call's start to
    its last work (`gpu_span_ms`: the step's kernels, any wait inside it for a peer, and any
    time the GPU waits for the host inside the call, e.g. while it reads back a check); and the
    stream's idle time between one call's end and the next call's start (`gpu_idle_ms`). Events
    recorded around each call on the current stream. A host call shorter than the step means
    the host runs ahead and the GPU never waits for it; a call as long as the step, that the
    call waits for the GPU."""
    if device.type != "cuda":
        return {}
    stream = torch.cuda.current_stream(device)
    marks, calls = [], []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record(stream)
        run.step(data[i % len(data)], data[(i + 1) % len(data)])
        end.record(stream)
        calls.append(time.perf_counter() - t)
        marks.append((start, end))
    torch.cuda.synchronize(device)
    span = [s.elapsed_time(e) for s, e in marks]
    idle = [e.elapsed_time(s) for (_, e), (s, _) in zip(marks, marks[1:])]
    return {"host_call_ms": float(np.median(calls)) * 1e3, "gpu_span_ms": float(np.median(span)),
            "gpu_idle_ms": float(np.median(idle))}


def profiled(a, run, data, sync, name: str) -> None:
    """With --profile, a torch.profiler table of 20 more steps at PROFILE-<name>.txt; with
    --trace, a timeline of 3 at TRACE-<name>.json.gz."""
    from torch.profiler import ProfilerActivity, profile
    for path, steps, timeline in ((a.profile, 20, False), (a.trace, 3, True)):
        if not path:
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                run.step(data[i % len(data)], data[(i + 1) % len(data)])
            sync()
        if timeline:
            prof.export_chrome_trace(f"{path}-{name}.json.gz")
        else:
            with open(f"{path}-{name}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                                  max_name_column_width=70))


def timing(a, world: int, step_s: float, windows: list) -> dict:
    """A run's step time and samples/s from its median window, and every window's step ms."""
    return {"step_ms": step_s * 1e3, "samples_per_s": world * a.batch / step_s,
            "step_ms_windows": [w * 1e3 for w in windows]}


def measure_collection(a, inputs: dict, device, world, sharded: bool,
                       exchange: str = "auto") -> dict:
    """One collection trained on each of `inputs` (ids mode: batches) in turn, the same module
    and graph; the first mode's time is the run's, every mode's is in `by_ids`."""
    run = collection_step(a, device, sharded, exchange)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    data = next(iter(inputs.values()))

    by_ids, hosts = {}, []
    for mode, batches_ in inputs.items():
        step_s, windows, host = timed_steps(
            a, batches_, run, lambda: run.ebc.cache_stats()["total"]["host_bytes"], sync)
        by_ids[mode] = {**timing(a, world, step_s, windows), **gaps(a, batches_, run, device)}
        hosts.append(host)
    host = hosts[0]  # the first mode's, as its time is the run's
    if device.type == "cuda":
        rank = dist.get_rank() if dist.is_initialized() else 0
        profiled(a, run, data, sync, f"{world}-{rank}-{run.ebc.exchange if sharded else 'single'}")
    stats = run.ebc.cache_stats()["total"]
    result = {**next(iter(by_ids.values())), "by_ids": by_ids,
              "hit_rate": stats["hit_rate"], "graph": run.graphed,
              "exchange": getattr(run.ebc, "exchange", "collective"),
              "bytes_per_step": {"host_link": host, **exchange_bytes(a, world, run.ebc)}}
    if world > 1:  # every rank's step time: a slow rank makes its peers wait
        per_rank = [None] * world
        dist.all_gather_object(per_rank, result["step_ms"])
        result["step_ms_per_rank"] = per_rank
    del run
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def measure_modules_captured(a, data, device) -> dict:
    """The demo's one-GPU engine on the same batches: two HostEmbeddings sharing the cache
    budget, each step one CUDA graph replay that prefetches the next batch's rows."""
    from types import SimpleNamespace

    from speedtorch_ops.demo.train import ModuleTraining
    run = ModuleTraining(SimpleNamespace(
        optimizer="adam", lr=a.lr, fused=None, cache_mb=a.cache_mb, dim=a.dim, vocab=a.vocab,
        negatives=a.negatives, graph="on", prefetch="on", dtype="float32", rounding=None),
        device)
    step_s, windows, host = timed_steps(
        a, data, run, lambda: sum(emb.cache_stats()["host_bytes"] for emb in (run.u, run.v)),
        lambda: torch.cuda.synchronize(device))
    where = gaps(a, data, run, device)
    profiled(a, run, data, lambda: torch.cuda.synchronize(device), "1-0-modules")
    stats = [emb.cache_stats() for emb in (run.u, run.v)]
    hits, lookups = sum(s["hits"] for s in stats), sum(s["lookups"] for s in stats)
    del run
    gc.collect()
    torch.cuda.empty_cache()
    return {**timing(a, 1, step_s, windows), **where,
            "hit_rate": hits / lookups if lookups else 0.0, "graph": True,
            "bytes_per_step": {"host_link": host, "ids": 0, "rows": 0, "grads": 0}}


def run_rank(a, rank, world, local_rank):
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # Ranks share the cores (torchrun sets OMP_NUM_THREADS=1 for the same reason); spawned ranks
    # that each use every core oversubscribe the host work of the routing.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    data = batches(a, rank)
    torch.manual_seed(rank)  # each rank initialises its own shard
    result = {"world": world, "device": str(device), "backend": backend}
    if "collection" in a.engine:
        # A step's inputs: host ids for a captured step with --ids host (CapturedStep checks
        # and uploads them), else ids on the device.
        captured = device.type == "cuda" and not a.eager
        on_device = [tuple(x.to(device) for x in b) for b in data]
        inputs = ({m: data if m == "host" else on_device for m in a.ids} if captured else
                  {device.type if device.type == "cpu" else "device": on_device})
        for x in a.exchange if world > 1 else a.exchange[:1]:
            result[f"collection_{x}"] = measure_collection(a, inputs, device, world,
                                                          sharded=True, exchange=x)
        result["collection"] = result.pop(f"collection_{a.exchange[0]}")
        if world == 1:  # the one-GPU configurations on the same batches
            result["collection_single_process"] = measure_collection(a, inputs, device, 1,
                                                                     sharded=False)
            if device.type == "cuda":
                result["hostembedding_captured"] = measure_modules_captured(a, data, device)
    if "modules" in a.engine:
        u, v = tables(a, device, sharded=True)
        for route in a.route:  # the same tables, trained on: only the routing differs
            together = ShardedEmbeddingDict({"u": u, "v": v}) if route == "together" \
                else None
            result[f"sharded_{route}"] = measure(a, u, v, data, device, world, together)
        result["sharded"] = result[f"sharded_{a.route[0]}"]
        del u, v
        if world == 1:  # the single-process module on the same batches: the routing's cost
            u, v = tables(a, device, sharded=False)
            result["single_process"] = measure(a, u, v, data, device, 1)
    return result


def _spawned(rank, world, a, store, out):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (see the device notes)
    extra = {"device_id": torch.device("cuda", rank)} if torch.cuda.is_available() else {}
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), **extra)
    try:
        result = run_rank(a, rank, world, rank)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def report(a, results):
    if "collection" in a.engine:
        report_collection(a, results)
        if a.plot:
            plot_collection(a.plot, a, results)
    if "modules" in a.engine:
        report_modules(a, results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "results": results}, f, indent=1)


def report_collection(a, results):
    """The captured collection: samples/s per world size against the best one-GPU run (the
    sharded collection at one rank, the single-process collection, or the demo's two captured
    HostEmbeddings, whichever is fastest)."""
    one = [y for r in results if r["world"] == 1
           for k in ("collection", "collection_single_process", "hostembedding_captured")
           if k in r for y in (r[k].get("by_ids") or {"": r[k]}).values()]
    best = max(one, key=lambda x: x["samples_per_s"]) if one else None  # any ids mode
    print(f"ShardedHostEmbeddingBagCollection: vocab {a.vocab:,} dim {a.dim}, {a.batch} centre "
          f"words x (2 + {a.negatives}) ids per rank per step, cache {a.cache_mb:g} MiB per rank")
    print(f"{'run':<34}{'samples/s':>12}{'step ms':>9}{'hit rate':>9}  bytes a step; step ms "
          "of the windows, of each rank")
    for r in results:
        extra = [(k, f"{r['world']} rank(s), sharded, {r[k]['exchange']}") for k in r
                 if k.startswith("collection_") and k != "collection_single_process"]
        for key, name in (("collection", f"{r['world']} rank(s), sharded"
                           + (f", {r['collection']['exchange']}" if r["world"] > 1 else "")),
                          *extra,
                          ("collection_single_process", "1 GPU, single-process collection"),
                          ("hostembedding_captured", "1 GPU, 2 HostEmbeddings (modules)")):
            x = r.get(key)
            if x is None:
                continue
            if best is not None:
                x["speedup_vs_best_one_gpu"] = x["samples_per_s"] / best["samples_per_s"]
            moved = x["bytes_per_step"]
            print(f"{name:<34}{x['samples_per_s']:>12,.0f}{x['step_ms']:>9.3f}"
                  f"{x['hit_rate']:>9.3f}  host {moved['host_link'] / 1e6:.1f} MB, to peers "
                  f"{(moved['ids'] + moved['rows'] + moved['grads']) / 1e6:.1f} MB  "
                  + (f"windows {min(x['step_ms_windows']):.3f}-{max(x['step_ms_windows']):.3f}"
                     if x.get("step_ms_windows") else "")
                  + (f" ranks {' '.join(f'{t:.3f}' for t in x['step_ms_per_rank'])}"
                     if x.get("step_ms_per_rank") else "")
                  + (f"  {x['speedup_vs_best_one_gpu']:.2f}x best one GPU"
                     if "speedup_vs_best_one_gpu" in x else ""))
            for mode, y in (x.get("by_ids") or {"": x}).items():
                if best is not None:
                    y["speedup_vs_best_one_gpu"] = y["samples_per_s"] / best["samples_per_s"]
                if "gpu_idle_ms" in y:
                    print(f"{'':<4}{mode + ' ids: ' if mode else ''}step {y['step_ms']:.3f} ms "
                          f"({y.get('speedup_vs_best_one_gpu', 0):.2f}x); host in a call "
                          f"{y['host_call_ms']:.3f}, GPU span {y['gpu_span_ms']:.3f}, GPU idle "
                          f"before the next call {y['gpu_idle_ms']:.3f}")


def plot_collection(path, a, results):
    """Samples/s of every collection run against the best one-GPU run, the 1.9x target drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    names = {"collection_single_process": "1 GPU\nsingle-process\ncollection",
             "hostembedding_captured": "1 GPU\n2 HostEmbeddings\n(modules)"}
    bars = []
    for r in results:
        for key, x in r.items():
            if not (isinstance(x, dict) and "samples_per_s" in x and key.startswith(
                    ("collection", "hostembedding"))):
                continue
            name = names.get(key) or (f"{r['world']} GPU(s)\nsharded" + (
                f"\n{x['exchange']}" if r["world"] > 1 else ""))
            modes = x.get("by_ids") or {"": x}
            for mode, y in modes.items():  # a bar per ids mode
                label = name + (f"\n{mode} ids" if len(modes) > 1 else "")
                bars.append((label, y["samples_per_s"] / 1e6, r["world"]))
    best = max(b[1] for b in bars if b[2] == 1)  # over every ids mode
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(bars)), 4.2))
    ax.bar(range(len(bars)), [b[1] for b in bars], color=["C0" if b[2] == 1 else "C1"
                                                           for b in bars])
    for x, b in enumerate(bars):
        ax.text(x, b[1], f"{b[1]:.2f}\n{b[1] / best:.2f}x", ha="center", va="bottom",
                fontsize=8)
    ax.axhline(1.9 * best, color="0.4", linestyle="--", linewidth=1)
    ax.text(len(bars) - 0.5, 1.9 * best, "2 GPUs' target: 1.9x the best one-GPU run",
            ha="right", va="bottom", fontsize=8, color="0.3")
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("million samples / s (all GPUs)")
    ax.set_ylim(0, 1.15 * max(1.9 * best, max(b[1] for b in bars)))
    ax.set_title(f"skip-gram, two {a.vocab:,} x {a.dim} tables + Adam\n{a.batch} centre words a "
                 f"GPU a step, {a.cache_mb:g} MiB cache a GPU, captured steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report_modules(a, results):
    single = next((r["single_process"] for r in results if "single_process" in r), None)
    one = next((r["sharded"] for r in results if r["world"] == 1), None)
    print(f"vocab {a.vocab:,} dim {a.dim}, {a.batch} centre words x (2 + {a.negatives}) ids per "
          f"rank per step, cache {a.cache_mb:g} MiB per rank")
    print(f"sharded: {a.route[0]} (speedups below)")
    print(f"{'run':<22}{'samples/s':>12}{'step ms':>9}  phases (ms): "
          + " ".join(f"{k:>8}" for k in (*PHASES, "other")))
    for r in results:
        runs = [(f"{r['world']} rank(s), {route}", r[f"sharded_{route}"]) for route in a.route]
        if "single_process" in r:
            runs.append(("1 rank, HostEmbedding", r["single_process"]))
        for name, x in runs:
            print(f"{name:<22}{x['samples_per_s']:>12,.0f}{x['step_ms']:>9.2f}  {'':12}"
                  + " ".join(f"{x['phases_ms'][k]:>8.2f}" for k in (*PHASES, "other")))
            for rank, phases in enumerate(x.get("phases_ms_per_rank") or []):
                print(f"{'':>49}rank {rank}: "
                      + " ".join(f"{phases[k]:>8.2f}" for k in (*PHASES, "other")))
        if r["world"] > 1:
            for name, base in (("sharded 1 rank", one), ("HostEmbedding", single)):
                if base:
                    r.setdefault("speedup", {})[name] = (r["sharded"]["samples_per_s"]
                                                         / base["samples_per_s"])
            print(f"  speedup: {r.get('speedup')}")


def main():
    a = parse()
    if a.replot:
        with open(a.replot) as f:
            saved = json.load(f)
        for key, value in saved["config"].items():
            if key not in ("plot", "replot", "json"):
                setattr(a, key, value)
        plot_collection(a.plot, a, saved["results"])
        return
    if "RANK" in os.environ:  # torchrun: this process is one rank of one world size
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local = int(os.environ.get("LOCAL_RANK", 0))
        extra = {"device_id": torch.device("cuda", local)} if torch.cuda.is_available() else {}
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", **extra)
        try:
            result = run_rank(a, dist.get_rank(), dist.get_world_size(), local)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) == 0:
            report(a, [result])
        return
    import tempfile
    results = []
    for world in a.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(_spawned, args=(world, a, os.path.join(tmp, "store"), out),
                               nprocs=world, start_method="spawn")
            with open(out) as f:
                results.append(json.load(f))
    report(a, results)


if __name__ == "__main__":
    main()
