"""The main job's claim: the demo's engine (--engine collection: both tables in one
HostEmbeddingCollection behind one GPU row cache; module: a HostEmbedding a table) against plain
PyTorch with the whole tables on the GPU (nn.Embedding(sparse=True) + SparseAdam, and a captured
step), in the same process.

For each cache budget (both tables together, MiB; 0 = no cache) it trains the demo's skip-gram
(two vocab x dim tables + Adam state in pinned host memory) and reports steps/s, the hit rate
(and the hit rate of an oracle that pins the rows most used in these very batches in the same
number of slots), bytes over the host link per step, host time to queue a step on an idle GPU,
and GPU peak memory; then two baselines with the whole tables on the GPU: the demo's
(nn.Embedding(sparse=True) + SparseAdam, eager) and the captured all-on-GPU step (dense tables,
Adam state and gradient buffer, the step one CUDA graph replay: CapturedAllOnGpu), the latter on
the same batches and steps as the runs; and a pinned memcpy's rate (to say what the moved bytes
cost at the link's best). Each run's bound two ways: the larger of the every-row step and its
bytes' link time with both directions at their memcpy rates at once (bound_ms: a full-duplex
link), or as its loads and write-backs measured moving at once, by the stores' kernel under the
run's SM caps (bound_shared_ms: random rows share one rate both ways, bench/link_duplex.py).
Output: a table, cache_budget.json and cache_budget.png in --out.
--selfcheck checks the captured baseline's step on the CPU against a float64 lazy Adam.

    python3 bench/cache_budget.py --vocab 4000000 --dim 128 --batch 8192 --budgets 0 300 600 1200 4000
    python3 bench/cache_budget.py --dtypes float32 bfloat16 --budgets 1200 2400   # 16-bit rows
"""

import argparse
import gc
import itertools
import json
import os
import statistics
import time

import numpy as np
import torch

import speedtorch_ops as so
from speedtorch_ops.demo.model import SkipGram, skipgram_loss
from speedtorch_ops.demo.train import (DTYPES, ENGINES, OPTIMIZERS, CollectionTraining,
                                       train_all_on_gpu)
from speedtorch_ops.training import stores

from _workloads import add_skipgram_shape, lazy_adam_, skipgram_corpus


def memcpy_gbps(device, nbytes=256 << 20, back: bool = False) -> float:
    """A pinned memcpy's rate, host to GPU (GPU to host with `back`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if back:
        src, dst = dst, src
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return nbytes / statistics.median(times[2:]) / 1e6


def cache_keys(run, vocab) -> list:
    """Per cache of `run`: (batch -> the rows it looks up, as keys below `keys`, keys). The
    collection's one cache holds both tables (v's rows after u's); the module engine has a
    cache a table (u: centres; v: contexts and negatives)."""
    if isinstance(run, CollectionTraining):
        return [(lambda b: np.concatenate([b[0].ravel(), vocab + b[1].ravel(),
                                           vocab + b[2].ravel()]), 2 * vocab)]
    return [(lambda b: b[0], vocab),
            (lambda b: np.concatenate([b[1].ravel(), b[2].ravel()]), vocab)]


def oracle_hit_rate(batches, slots, caches) -> float:
    """Distinct rows per step that fall in the `slots[c]` rows of cache c used in most steps
    of `batches` (a cache that knew the future and never changed), every cache pooled;
    `caches`: cache_keys's."""
    hits = total = 0
    for (pick, vocab), n in zip(caches, slots):
        per_step = [np.unique(pick(b).ravel()) for b in batches]
        steps_used = np.bincount(np.concatenate(per_step), minlength=vocab)
        top = np.zeros(vocab, dtype=bool)
        top[np.argsort(-steps_used, kind="stable")[:n]] = True
        hits += sum(int(top[u].sum()) for u in per_step)
        total += sum(len(u) for u in per_step)
    return hits / total


class CapturedAllOnGpu:
    """The stronger baseline's step: each table's weight, exp_avg, exp_avg_sq and a gradient
    buffer as dense (V, D) tensors. A step gathers the batch's rows, takes the demo's loss and
    the rows' gradients, sums them per row in the buffer, runs the demo's Adam (its
    hyper-parameters, fused as on a GPU, the step count global and on the device) on every
    position's row with its row's summed gradient, writes the rows and their state back
    (positions of one row write equal values) and zeroes the buffer's rows: lazy Adam, as
    HostEmbedding and SparseAdam train. The demo's model has no other parameters. GPU work only,
    shapes fixed by the batch's: capturable."""

    def __init__(self, a, weights):
        cls, kwargs = OPTIMIZERS["adam"](a.lr, None)
        hp = cls([torch.zeros(1)], **kwargs).defaults
        self.hp = dict(lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1],
                       weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=hp["amsgrad"],
                       maximize=hp["maximize"])
        self.tables = [(w, *(torch.zeros_like(w) for _ in range(3))) for w in weights]
        self.count = torch.zeros((), device=weights[0].device)
        self.batch, self.negatives = a.batch, a.negatives

    def step(self, ids):
        """One step on `ids`, int64: the centres, contexts and negatives one after another."""
        B, N = self.batch, self.negatives
        pos = (ids[:B], ids[B:])  # u's ids, v's (contexts, then negatives)
        rows = [w.index_select(0, i).requires_grad_() for (w, *_), i in zip(self.tables, pos)]
        loss = skipgram_loss(rows[0].view(B, 1, -1), rows[1][:B].view(B, 1, -1),
                             rows[1][B:].view(B, N, -1))
        # The gathered rows are updated in place.
        lazy_adam_(self.tables, pos, [r.detach() for r in rows], torch.autograd.grad(loss, rows),
                   self.count, self.hp)
        return loss.detach()


def init_weights(a, device) -> tuple:
    """(u, v) initialised as the demo initialises them."""
    bound = 0.5 / a.dim
    return (torch.empty(a.vocab, a.dim, device=device).uniform_(-bound, bound),
            torch.empty(a.vocab, a.dim, device=device).normal_(0.0, bound))


def captured_baseline(a, batches, device) -> dict:
    """The captured all-on-GPU step on `batches`, cycled and timed as run_budget does: three
    eager warm-up steps on a side stream, the capture, replays (each after its batch's ids are
    copied into the graph's input) up to a.warmup, then a.steps timed ones."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = CapturedAllOnGpu(a, init_weights(a, device))
    ids = torch.empty(a.batch * (2 + a.negatives), dtype=torch.int64, device=device)

    def upload(i):
        # A fresh pinned buffer each step: the caching host allocator holds it until its copy ran.
        staging = torch.empty(ids.numel(), dtype=torch.int64, pin_memory=True)
        np.concatenate([x.ravel() for x in batches[i % len(batches)]], out=staging.numpy())
        ids.copy_(staging, non_blocking=True)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(3):
            upload(i)
            model.step(ids)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Pinned memory freed during a capture invalidates it (see speedtorch_ops.CapturedStep).
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            model.step(ids)
    finally:
        gc.enable()

    def step(i):
        upload(i)
        graph.replay()

    for i in range(3, a.warmup):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        step(i)
    torch.cuda.synchronize()
    return {"steps_per_s": a.steps / (time.perf_counter() - start),
            "gpu_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20}


def selfcheck(steps=6) -> None:
    """CapturedAllOnGpu's step, eager on the CPU at tiny sizes (duplicate ids in every step, rows
    skipped for steps between updates), against a float64 reference: the demo's model's loss and
    gradients, torch.optim.Adam (the demo's hyper-parameters) on the touched rows only with their
    summed gradients and the global step count."""
    a = argparse.Namespace(vocab=50, dim=4, batch=8, negatives=5, lr=0.05)
    torch.manual_seed(0)
    weights = init_weights(a, "cpu")
    model = CapturedAllOnGpu(a, [w.clone() for w in weights])
    ref = SkipGram(a.vocab, a.vocab, a.dim).double()
    with torch.no_grad():
        for emb, w in zip((ref.u_embeddings, ref.v_embeddings), weights):
            emb.weight.copy_(w)
    state = [[torch.zeros(a.vocab, a.dim, dtype=torch.float64) for _ in range(2)]
             for _ in range(2)]
    cls, kwargs = OPTIMIZERS["adam"](a.lr, None)
    last, gaps = torch.zeros(2, a.vocab, dtype=torch.int64), 0  # a row's last step, rows skipped
    for t in range(1, steps + 1):
        batch = [torch.randint(0, a.vocab, (a.batch, n)) for n in (1, 1, a.negatives)]
        loss = model.step(torch.cat([x.ravel() for x in batch]))
        ref.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        for emb, (m, v), ids, seen in zip((ref.u_embeddings, ref.v_embeddings), state,
                                          (batch[0], torch.cat(batch[1:], 1)), last):
            touched = ids.unique()
            assert len(touched) < ids.numel() or emb is ref.u_embeddings
            gaps += int(((seen[touched] > 0) & (seen[touched] < t - 1)).sum())
            seen[touched] = t
            rows = torch.nn.Parameter(emb.weight.detach()[touched])
            rows.grad = emb.weight.grad[touched]
            opt = cls([rows], **kwargs, foreach=False)
            opt.state[rows] = {"step": torch.tensor(t - 1.0), "exp_avg": m[touched],
                               "exp_avg_sq": v[touched]}
            opt.step()
            with torch.no_grad():
                emb.weight[touched] = rows
            m[touched], v[touched] = opt.state[rows]["exp_avg"], opt.state[rows]["exp_avg_sq"]
        torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (w, exp_avg, exp_avg_sq, grad), emb, (m, v) in zip(
            model.tables, (ref.u_embeddings, ref.v_embeddings), state):
        torch.testing.assert_close(w.double(), emb.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exp_avg.double(), m, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(exp_avg_sq.double(), v, rtol=1e-5, atol=1e-12)
        assert not grad.any()
    assert gaps, "no row was skipped between updates: the check needs other draws"
    print(f"selfcheck passed: the captured all-on-GPU step matches lazy Adam in float64 over "
          f"{steps} steps")


def run_budget(a, run, batches, device, budget_mb, mode="graph", overlap=True, lane_sms=8,
               admission="frequency", write_sms=None):
    """Steps at this budget, the tables as the previous budget left them (one set-up for all);
    mode "graph": each step one CUDA graph replay, "eager": launched op by op, "prefetch": eager,
    each step prefetching the next batch's rows (HostEmbedding.prefetch), "graph-prefetch": both
    (the captured step takes the next batch's ids as inputs); overlap: the caches' victims are
    chosen and their rows go back on a side stream beside the stage and the training kernels
    (else all in order on one stream), their loads on at most lane_sms SMs, their write-backs
    on at most write_sms (None: the store's default); without a cache lane_sms is the
    prefetch's cap (HostRows.ahead_sms) and write_sms the commit's."""
    run.set_cache_mb(budget_mb)
    for emb in run.embeddings:
        if hasattr(emb.store, "overlap"):
            emb.store.overlap, emb.store.lane_sms = overlap, lane_sms
            emb.store.admission = admission
        else:  # no cache: the SM cap of the prefetch's transfers
            emb.store.ahead_sms = lane_sms
        if write_sms is not None:
            emb.store.write_sms = write_sms
    run.graphed = mode in ("graph", "graph-prefetch")
    run.prefetching = mode in ("prefetch", "graph-prefetch")

    def step(i):
        run.step(batches[i % len(batches)], batches[(i + 1) % len(batches)])

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    stats0 = [emb.cache_stats() for emb in run.embeddings]
    start = time.perf_counter()
    for i in range(a.steps):
        step(a.warmup + i)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats1 = [emb.cache_stats() for emb in run.embeddings]
    host = []
    for i in range(10):  # host time to queue one step, the GPU idle
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(i)
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    lookups = sum(s1["lookups"] - s0["lookups"] for s0, s1 in zip(stats0, stats1))
    hits = sum(s1["hits"] - s0["hits"] for s0, s1 in zip(stats0, stats1))
    moved = sum(s1["host_bytes"] - s0["host_bytes"] for s0, s1 in zip(stats0, stats1))
    # Each direction's rows: loads (misses not carried, plus the prefetches' own), write-backs.
    delta = {k: sum(s1[k] - s0[k] for s0, s1 in zip(stats0, stats1))
             for k in ("host_loads", "prefetched_loads", "prefetched_rows", "evictions",
                       "direct_writebacks", "deferred_loads")}
    row_bytes = run.embeddings[0].row_bytes
    loads = delta["host_loads"] - delta["prefetched_loads"] + delta["prefetched_rows"]
    backs = delta["evictions"] + delta["direct_writebacks"]
    slots = [getattr(emb.store, "slots", 0) for emb in run.embeddings]
    used = batches[a.warmup % len(batches):] if len(batches) > a.warmup else batches
    return {"budget_mb": budget_mb, "mode": mode, "overlap": overlap and budget_mb > 0,
            "admission": admission if budget_mb > 0 else None,
            "lane_sms": lane_sms if overlap and budget_mb > 0 else None,
            "write_sms": run.embeddings[-1].store.write_sms if overlap or budget_mb == 0
            else None,
            "ahead_sms": lane_sms if budget_mb == 0 and run.prefetching else None,
            "steps_per_s": a.steps / seconds,
            "hit_rate": hits / lookups if lookups else 0.0,
            "oracle_hit_rate": (oracle_hit_rate(used, slots, cache_keys(run, a.vocab))
                                if slots[0] else 0.0),
            "slots_per_table": slots, "host_bytes_per_step": moved / a.steps,
            "load_bytes_per_step": loads * row_bytes / a.steps,
            "writeback_bytes_per_step": backs * row_bytes / a.steps,
            # Rows a commit kept that the next stage staged again: loaded from the host and
            # written back, though the device held them.
            "restaged_kept_per_step": delta["deferred_loads"] / a.steps,
            "host_ms_per_step": 1e3 * statistics.median(host),
            "gpu_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20}


def add_bounds(rows: list, all_on_gpu: float, gbps: float, back_gbps: float) -> None:
    """The curve's fields of each run: its budget in MiB, steps/s against the captured
    all-on-GPU step, and its physical bound: the larger of the every-row step (the largest
    budget's run of its dtype and mode, which should cache every row) and the link's duplex
    time of its bytes (loads at the host-to-GPU memcpy rate beside write-backs at the
    GPU-to-host rate); ratio_to_bound = its step time / that bound."""
    for r in rows:
        same = [q for q in rows if q["dtype"] == r["dtype"] and q["mode"] == r["mode"]]
        every = max(same, key=lambda q: q["budget_mb"])
        every_ms = 1e3 / every["steps_per_s"]
        link_ms = max(r["load_bytes_per_step"] / gbps,
                      r["writeback_bytes_per_step"] / back_gbps) / 1e6
        r.update(budget_mib=r["budget_mb"], x_all_on_gpu=r["steps_per_s"] / all_on_gpu,
                 every_row_ms=every_ms, link_ms=link_ms, bound_ms=max(every_ms, link_ms),
                 ratio_to_bound=(1e3 / r["steps_per_s"]) / max(every_ms, link_ms))


def add_shared_bounds(rows: list, table_rows: int, reps: int = 10) -> None:
    """The bound on a link that carries loads and write-backs of random rows no faster
    together than apart (bench/link_duplex.py measures it; docs/decisions.md, "The link's
    two directions"): each run's loads and write-backs (rows a step) moved at once, on two
    streams, by the stores' transfer kernel under the run's SM caps, over a pinned table of
    the main job's span (`table_rows` rows of the run's row bytes): link_shared_ms;
    bound_shared_ms = max(every-row step, that); ratio_to_shared_bound = step / that."""
    from link_duplex import zero_copy_pair
    tables = {}
    for r in rows:
        loads = round(r["load_bytes_per_step"] / r["row_bytes"])
        backs = round(r["writeback_bytes_per_step"] / r["row_bytes"])
        shared = 0.0
        if loads and backs:
            if r["row_bytes"] not in tables:  # the bytes matter, not the dtype
                tables = {r["row_bytes"]: so.empty_pinned(
                    (table_rows, 1, r["row_bytes"] // 4), torch.float32)}
            shared = zero_copy_pair(tables[r["row_bytes"]], loads, backs,
                                    r["lane_sms"] or 0, r["write_sms"] or 0, reps)[2]
        bound = max(r["every_row_ms"], shared)
        r.update(link_shared_ms=shared, bound_shared_ms=bound,
                 ratio_to_shared_bound=(1e3 / r["steps_per_s"]) / bound)


def sms_label(r) -> str:
    """The SM caps of a run: loads/write-backs with a cache; without one the prefetch's (-: no
    prefetch, 0: uncapped) and the commit's write-back's."""
    if r["lane_sms"] is not None:  # with the transfer streams' priority
        return f"{r['lane_sms']}/{r['write_sms']} p{r.get('prefetch_priority', 0)}"
    if r["write_sms"] is None:  # a cache without its lane: no caps
        return "-"
    return f"{'-' if r['ahead_sms'] is None else r['ahead_sms']}/{r['write_sms']}"


def settings(a, budget_mb):
    """(mode, overlap, SM cap, admission, write-back SM cap) of each run at this budget:
    without a cache the overlap and admission have nothing to act on, and the SM cap is the
    prefetch's."""
    for mode in a.modes:
        if budget_mb == 0:
            caps = a.ahead_sms if "prefetch" in mode else [0]
            for sms, write_sms in itertools.product(caps, a.write_sms):
                yield mode, True, sms, a.admission[0], write_sms
            continue
        for overlap in a.overlap:
            on = overlap == "on"
            for sms, write_sms, admission in itertools.product(
                    a.lane_sms if on else [0], a.write_sms if on else [None], a.admission):
                yield mode, on, sms, admission, write_sms


def profile_steps(a, run, batches, device) -> None:
    """torch.profiler over 10 steps at budget a.profile in the first of a.modes: the GPU time
    per op, top 25, and a Chrome trace (profile_trace.json in --out; a graph replay's kernels
    appear one by one, on their streams)."""
    from torch.profiler import ProfilerActivity, profile
    run_budget(argparse.Namespace(**{**vars(a), "warmup": 0, "steps": 1}), run, batches, device,
               a.profile, a.modes[0], a.overlap[0] == "on", a.lane_sms[0], a.admission[0],
               a.write_sms[0])
    for i in range(30):
        run.step(batches[i % len(batches)], batches[(i + 1) % len(batches)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(30, 40):
            run.step(batches[i % len(batches)], batches[(i + 1) % len(batches)])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    os.makedirs(a.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(a.out, "profile_trace.json"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_skipgram_shape(p)
    p.add_argument("--engine", choices=["collection", "module"], default="collection",
                   help="collection: both tables in one HostEmbeddingCollection (the demo's "
                        "engine); module: a HostEmbedding a table")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32"],
                   help="the tables' and their state's dtypes, one set of runs each (16-bit: "
                        "stochastic rounding); the baselines keep float32")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--unfused", action="store_true",
                   help="Adam without fused=True (the demo fuses it on a GPU)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0, 300, 600, 1200, 2400])
    p.add_argument("--modes", nargs="+",
                   choices=["graph", "eager", "prefetch", "graph-prefetch"],
                   default=["graph", "graph-prefetch", "eager", "prefetch"],
                   help="graph: the step captured in a CUDA graph (speedtorch_ops.CapturedStep); "
                        "eager: launched op by op; prefetch: eager, the next batch's rows "
                        "loading on a side stream during each step (HostEmbedding.prefetch); "
                        "graph-prefetch: both")
    p.add_argument("--overlap", nargs="+", choices=["on", "off"], default=["on"],
                   help="with a cache: transfers on a side stream beside the training kernels "
                        "(on), or all in order on one stream (off); both: one run each")
    p.add_argument("--lane-sms", type=int, nargs="+", default=[8],
                   help="with overlap: the most SMs of the side stream's loads (0: all; "
                        "CachedRows.lane_sms, default 8); several: one run each")
    p.add_argument("--write-sms", type=int, nargs="+", default=[None],
                   help="the most SMs of the write-backs (0: all; default the store's: "
                        "CachedRows.write_sms 6 on the cache's side stream, HostRows.write_sms 0 "
                        "without a cache); several: one run each")
    p.add_argument("--ahead-sms", type=int, nargs="+", default=[32],
                   help="without a cache, with prefetch: the most SMs of the prefetch's transfer "
                        "kernels (HostRows.ahead_sms, default 32; 0: no cap); several: one run "
                        "each")
    p.add_argument("--admission", nargs="+", choices=["frequency", "always"],
                   default=["frequency"],
                   help="with a cache: the caches' admission rule "
                        "(speedtorch_ops.training.cache.CachedRows); several: one run each, in "
                        "this order (a rule named twice runs twice)")
    p.add_argument("--prefetch-priority", type=int, nargs="+",
                   default=[stores.PREFETCH_PRIORITY],
                   help="the priority of the stores' prefetch streams (training.stores."
                        "PREFETCH_PRIORITY; 0: the step's own, -1: above it); several: one run "
                        "each")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batches", type=int, default=200, help="distinct pre-drawn batches, cycled")
    p.add_argument("--profile", type=float, default=None, metavar="MB",
                   help="also profile 10 steps at this budget (torch.profiler, top GPU ops)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the demo's baseline (nn.Embedding(sparse=True) + SparseAdam)")
    p.add_argument("--no-captured-baseline", action="store_true",
                   help="skip the captured all-on-GPU step (CapturedAllOnGpu)")
    p.add_argument("--replot", metavar="JSON",
                   help="only draw the plot of an earlier run's cache_budget.json (into --out)")
    p.add_argument("--selfcheck", action="store_true",
                   help="only check the captured baseline's step on the CPU (tiny sizes) "
                        "against a float64 lazy Adam, and exit")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    if a.selfcheck:
        return selfcheck()
    if a.replot:
        with open(a.replot) as f:
            result = json.load(f)
        os.makedirs(a.out, exist_ok=True)
        return plot(result, os.path.join(a.out, "cache_budget.png"))
    device = torch.device("cuda", torch.cuda.current_device())
    corpus = skipgram_corpus(a)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(a.batches)]
    a.cache_mb, a.graph, a.fused = 0, "on", not a.unfused
    rows = []
    for dtype in a.dtypes:  # one set of tables a dtype, trained on the same batches
        a.dtype = dtype
        # The SM caps are each run's (run_budget): the engine starts with its stores' own.
        run = ENGINES[a.engine](argparse.Namespace(**{**vars(a), "lane_sms": None,
                                                      "write_sms": None}), device)
        for b, priority in itertools.product(a.budgets, a.prefetch_priority):
            # Read when a store is made: run_budget makes the caches anew.
            stores.PREFETCH_PRIORITY = priority
            for mode, overlap, sms, admission, write_sms in settings(a, b):
                rows.append({**run_budget(a, run, batches, device, b, mode, overlap, sms,
                                          admission, write_sms),
                             "dtype": dtype, "engine": a.engine, "prefetch_priority": priority,
                             "row_bytes": run.embeddings[0].row_bytes})
                print(rows[-1], flush=True)
        if a.profile is not None and dtype == a.dtypes[0]:
            profile_steps(a, run, batches, device)
        # The next tables' and the baselines' memory is their own: these go first.
        del run
        gc.collect()
    base = base_peak = float("nan")
    if not a.no_baseline:
        base_args = argparse.Namespace(**{**vars(a), "steps": a.warmup + a.steps,
                                          "reuse_batches": True})
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base_seconds = train_all_on_gpu(base_args, corpus, device)
        base = (base_args.steps - min(10, base_args.steps // 10)) / base_seconds
        base_peak = torch.cuda.max_memory_allocated(device) / 2**20
    captured = {"steps_per_s": float("nan"), "gpu_peak_mb": float("nan")}
    if not a.no_captured_baseline:
        captured = captured_baseline(a, batches, device)
    for r in rows:
        r["x_sparse_adam"] = r["steps_per_s"] / base
        r["x_captured_all_on_gpu"] = r["steps_per_s"] / captured["steps_per_s"]
    gbps = memcpy_gbps(device)
    back_gbps = memcpy_gbps(device, back=True)
    add_bounds(rows, captured["steps_per_s"], gbps, back_gbps)
    # The engine's host table: both tables in one (the collection's; the module engine's two
    # tables each span half of it, which the link's row rate favours).
    add_shared_bounds(rows, 2 * a.vocab)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "args": {k: v for k, v in vars(a).items()}, "memcpy_gbps": gbps,
              "memcpy_back_gbps": back_gbps,
              "baseline_steps_per_s": base, "baseline_gpu_peak_mb": base_peak,
              "captured_baseline_steps_per_s": captured["steps_per_s"],
              "captured_baseline_gpu_peak_mb": captured["gpu_peak_mb"],
              "budgets": rows}
    print(f"{result['gpu']}, {a.corpus} corpus, vocab {a.vocab:,} x {a.dim}, batch {a.batch}; "
          f"memcpy {gbps:.1f} GB/s; whole tables on the GPU: SparseAdam {base:.1f} steps/s "
          f"({base_peak:,.0f} MiB), the captured all-on-GPU step {captured['steps_per_s']:.1f} "
          f"steps/s ({captured['gpu_peak_mb']:,.0f} MiB)")
    print(f"{'dtype':>8} {'budget MiB':>10} {'mode':>8} {'overlap':>7} {'SMs':>9} {'admit':>9} {'steps/s':>8} {'x sparse':>8} {'x capt':>7} {'hit':>6} {'oracle':>6} "
          f"{'MB/step':>8} {'at memcpy ms':>12} {'bound ms':>8} {'x bound':>7} {'shared ms':>9} {'x shared':>8} {'host ms':>8} {'GPU MiB':>8}")
    for r in rows:
        print(f"{r['dtype']:>8} {r['budget_mb']:>10.0f} {r['mode']:>8} {str(r['overlap']):>7} {sms_label(r):>9} {str(r['admission'] or '-'):>9} {r['steps_per_s']:>8.1f} {r['x_sparse_adam']:>8.2f} {r['x_captured_all_on_gpu']:>7.2f} "
              f"{r['hit_rate']:>6.3f} {r['oracle_hit_rate']:>6.3f} "
              f"{r['host_bytes_per_step'] / 1e6:>8.1f} "
              f"{r['host_bytes_per_step'] / gbps / 1e6:>12.2f} {r['bound_ms']:>8.3f} "
              f"{r['ratio_to_bound']:>7.2f} {r['bound_shared_ms']:>9.3f} "
              f"{r['ratio_to_shared_bound']:>8.2f} {r['host_ms_per_step']:>8.2f} "
              f"{r['gpu_peak_mb']:>8.0f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cache_budget.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(a.out, "cache_budget.png"))


def plot(result: dict, path: str) -> None:
    """The runs of `result` (cache_budget.json) against the budget, with each dtype's two bounds
    and the baselines: steps/s on a log budget axis (the budgets span two orders)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows, args = result["budgets"], result["args"]
    fig, ax = plt.subplots(figsize=(7, 5.5))
    for (mode, dtype), mine in itertools.groupby(
            sorted(rows, key=lambda r: (r["mode"], r["dtype"], r["budget_mb"])),
            key=lambda r: (r["mode"], r["dtype"])):
        mine = [r for r in mine if r["budget_mb"] > 0]
        line, = ax.plot([r["budget_mb"] for r in mine], [r["steps_per_s"] for r in mine], "o-",
                        label=f"{args['engine']} {dtype} + GPU row cache ({mode})")
        ax.plot([r["budget_mb"] for r in mine], [1e3 / r["bound_ms"] for r in mine], ":",
                color=line.get_color(), alpha=0.7,
                label=f"{dtype} bound: every-row step, both directions at memcpy rate at once")
        if "bound_shared_ms" in mine[0]:
            ax.plot([r["budget_mb"] for r in mine], [1e3 / r["bound_shared_ms"] for r in mine],
                    "--", color=line.get_color(), alpha=0.7,
                    label=f"{dtype} bound: every-row step, loads and write-backs measured at once")
    if result.get("baseline_steps_per_s") == result.get("baseline_steps_per_s"):  # not NaN
        ax.axhline(result["baseline_steps_per_s"], color="gray", ls="--",
                   label="whole tables on the GPU (SparseAdam)")
    ax.axhline(result["captured_baseline_steps_per_s"], color="black", ls="-.",
               label="whole tables on the GPU (the captured step, fused Adam)")
    ax.set_xscale("log")
    ax.set_xlabel("GPU row cache, both tables (MiB)")
    ax.set_ylabel("steps/s")
    ax.set_title(f"{args['corpus']} skip-gram, {args['vocab']:,} x {args['dim']} x 2 + "
                 f"{args['optimizer']}, {result['gpu']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
