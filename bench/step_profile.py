"""Where the main job's cached step spends its GPU time: the demo's engine (--engine collection:
both tables in one HostEmbeddingCollection behind one GPU row cache; module: a HostEmbedding with
its own cache a table) on the Zipf corpus, profiled two ways with torch.profiler.

- eager steps, each phase wrapped in a named range (the stores' stage, victim choice, commit,
  prefetch; the distinct ids; the optimizer; forward and backward): GPU time and kernels per
  phase per step, and the costliest ops with their input shapes;
- captured steps (each one CUDA graph replay, as the demo runs): kernels per step by name, and
  the GPU time they cover.

    python3 bench/step_profile.py --budget 1200 --steps 10
"""

import argparse
import collections
import json
import os
import re
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from speedtorch_ops.demo.train import ENGINES

from _workloads import add_skipgram_shape, skipgram_corpus

# The phases' labels: the library's own ranges (speedtorch_ops.<Class>.<method>: the stores'
# stage, victim choice, commit and prefetch, the distinct ids) and torch's optimizer step.
LABELS = ("speedtorch_ops.", "Optimizer.step#")


def phase_name(event_name: str):
    """The phase an event labels ("CachedRows.stage", "Adam.step"), or None."""
    for prefix in LABELS:
        if event_name.startswith(prefix):
            return event_name[len(prefix):]
    return None


def kernels_under(event) -> list:
    """The GPU kernels launched by `event` and every op under it."""
    out, todo = [], [event]
    while todo:
        e = todo.pop()
        out += [k for k in e.kernels]
        todo += e.cpu_children
    return out


def phase_table(prof, steps: int) -> dict:
    """GPU µs and kernels per step of each labelled range (a range inside another counts in
    both: Distinct inside a stage)."""
    acc = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        name = phase_name(e.name)
        if name is not None:
            ks = kernels_under(e)
            acc[name][0] += sum(k.duration for k in ks)
            acc[name][1] += len(ks)
    return {k: {"gpu_us": v[0] / steps, "kernels": v[1] / steps} for k, v in acc.items()}


def kernel_table(prof, steps: int, top: int) -> list:
    by = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name][0] += e.time_range.elapsed_us()
            by[e.name][1] += 1
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])
    return [{"kernel": k[:110], "us_per_step": v[0] / steps, "per_step": v[1] / steps}
            for k, v in rows[:top]]


def busy_us(prof) -> float:
    """GPU time covered by at least one kernel or copy (union of their intervals)."""
    return union_us((e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)


def gpu_work(prof) -> list:
    """The profile's kernels, copies and memsets (chrome trace events, with stream and dur)."""
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def timeline(prof) -> list:
    """One step's GPU work in start order: (µs from the step's first kernel, µs, stream,
    name), runs of one kernel name on one stream merged: shows which stream ends the step and
    what each waits behind."""
    work = sorted(gpu_work(prof), key=lambda e: e["ts"])
    t0 = work[0]["ts"] if work else 0.0
    rows: list = []
    last_on: dict = {}
    for e in work:
        stream = e.get("args", {}).get("stream", -1)
        name = short_name(e["name"])
        run = last_on.get(stream)
        if run is not None and run[3] == name and e["ts"] - (run[0] + run[1] + t0) < 5:
            run[1] = e["ts"] + e["dur"] - t0 - run[0]
            run[4] += 1
            continue
        run = [e["ts"] - t0, e["dur"], stream, name, 1]
        rows.append(run)
        last_on[stream] = run
    return [{"at_us": round(r[0], 1), "us": round(r[1], 1), "stream": r[2], "kernel": r[3],
             "count": r[4]} for r in rows]


def gaps(work: list, steps: int, top: int = 12) -> dict:
    """The GPU's idle spans between the first and the last kernel of the profiled steps: the
    longest, each with the work that ended just before it and the work that started after
    (what the GPU waited for: the host's next launch, or work on another stream), and how the
    idle time adds up by the work that ended it."""
    work = sorted(work, key=lambda e: e["ts"])
    spans, end, before = [], None, None
    for e in work:
        if end is not None and e["ts"] - end > 2.0:
            spans.append((e["ts"] - end, before, short_name(e["name"])))
        if end is None or e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], short_name(e["name"])
    by_next = collections.Counter()
    for span, _, after in spans:
        by_next[after] += span / steps
    longest = sorted(spans, key=lambda g: -g[0])[:top]
    return {"idle_over_2us_per_step": sum(g[0] for g in spans) / steps,
            "by_next_us_per_step": dict(by_next.most_common(top)),
            "longest": [{"us": round(g[0], 1), "previous": g[1], "next": g[2]} for g in longest]}


def short_name(name: str) -> str:
    """A kernel's name without template arguments and namespaces."""
    base = re.sub(r"<.*", "", name.replace("(anonymous namespace)::", "").split("(")[0])
    return base.split("::")[-1][:48] or name[:48]


def streams_table(work_events: list, steps: int) -> list:
    """Per CUDA stream: kernels (and copies, memsets) per step and the time they cover per
    step. The step's own stream carries the critical path; the others (the lanes and the
    prefetch) run beside it."""
    by = collections.defaultdict(list)
    work = []
    for e in work_events:
        by[e.get("args", {}).get("stream", -1)].append((e["ts"], e["ts"] + e["dur"]))
        work.append((e["ts"], e["ts"] + e["dur"], any(t in e.get("name", "") for t in TRANSFERS)))
    rows = [{"stream": s, "per_step": len(v) / steps, "busy_us_per_step": union_us(v) / steps}
            for s, v in by.items()]
    return sorted(rows, key=lambda r: -r["busy_us_per_step"]), overlap_table(work, steps)


TRANSFERS = ("gather_sorted", "copy_rows")  # the kernels that move rows over the host link


def overlap_table(work, steps: int) -> dict:
    """Per step, between the first and the last kernel: time with nothing running, with only
    host-link transfer kernels running (the step waits on the link there), and with other
    kernels running (transfers beside them or not)."""
    edges = sorted([(s, 1, t) for s, _, t in work] + [(e, -1, t) for _, e, t in work])
    active = {True: 0, False: 0}
    idle = link_only = compute = 0.0
    last = edges[0][0] if edges else 0.0
    for time_, step, transfer in edges:
        span = time_ - last
        if active[False]:
            compute += span
        elif active[True]:
            link_only += span
        else:
            idle += span
        active[transfer] += step
        last = time_
    return {"idle_us": idle / steps, "link_only_us": link_only / steps,
            "compute_us": compute / steps}


def union_us(spans) -> float:
    spans = sorted(spans)
    total, end = 0.0, float("-inf")
    for s, t in spans:
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_skipgram_shape(p)
    p.add_argument("--engine", choices=["collection", "module"], default="collection")
    p.add_argument("--budget", type=float, default=1200, help="cache MiB, both tables")
    p.add_argument("--prefetch", choices=["on", "off"], default="on")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--unfused", action="store_true",
                   help="Adam without fused=True (the demo fuses it on a GPU)")
    p.add_argument("--lane-sms", type=int, default=None,
                   help="the SM cap of the stores' loads: the caches' lane_sms (without a cache "
                        "the prefetch's, HostRows.ahead_sms); default the stores'")
    p.add_argument("--write-sms", type=int, default=None,
                   help="the SM cap of the stores' write-backs (write_sms); default the stores'")
    p.add_argument("--admission", choices=["frequency", "always"], default=None,
                   help="the caches' admission rule; default the stores'")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    corpus = skipgram_corpus(a)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(64)]
    args = argparse.Namespace(vocab=a.vocab, dim=a.dim, batch=a.batch, negatives=a.negatives,
                              lr=0.05, optimizer="adam", fused=not a.unfused,
                              cache_mb=a.budget, graph="on", prefetch=a.prefetch)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "gpu": torch.cuda.get_device_name(device), "args": vars(a)}

    def steps(run, first, n):
        for i in range(first, first + n):
            run.step(batches[i % 64], batches[(i + 1) % 64])

    def make():
        run = ENGINES[a.engine](args, device)
        for emb in run.embeddings:
            if a.lane_sms is not None:
                setattr(emb.store, "lane_sms" if hasattr(emb.store, "lane_sms") else "ahead_sms",
                        a.lane_sms)
            if a.write_sms is not None:
                emb.store.write_sms = a.write_sms
            if a.admission is not None and hasattr(emb.store, "admission"):
                emb.store.admission = a.admission
        return run

    # Captured: the step as the demo runs it.
    run = make()
    steps(run, 0, a.warmup)
    torch.cuda.synchronize()
    t = time.perf_counter()
    steps(run, a.warmup, 50)
    torch.cuda.synchronize()
    result["graph_steps_per_s"] = 50 / (time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(run, a.warmup + 50, a.steps)
        torch.cuda.synchronize()
    result["graph_kernels_per_step"] = sum(
        1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / a.steps
    result["graph_busy_us_per_step"] = busy_us(prof) / a.steps
    result["graph_kernels"] = kernel_table(prof, a.steps, a.top)
    work = gpu_work(prof)
    result["graph_streams"], result["graph_overlap"] = streams_table(work, a.steps)
    result["graph_gaps"] = gaps(work, a.steps)
    # One replay alone (the GPU idle before and after it), kernel by kernel.
    steps(run, a.warmup + 50 + a.steps, 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(run, a.warmup + 52 + a.steps, 1)
        torch.cuda.synchronize()
    result["graph_timeline"] = timeline(prof)
    del run

    # Eager: the phases' labels are the library's and torch's own.
    args.graph = "off"
    run = make()
    steps(run, 0, a.warmup)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        steps(run, a.warmup, a.steps)
        torch.cuda.synchronize()
    result["eager_phases"] = phase_table(prof, a.steps)
    result["eager_kernels_per_step"] = sum(
        1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / a.steps
    ops = prof.key_averages(group_by_input_shape=True)
    result["eager_ops"] = [
        {"op": o.key, "shapes": str(o.input_shapes)[:120], "count_per_step": o.count / a.steps,
         "gpu_us_per_step": o.device_time_total / a.steps}
        for o in sorted(ops, key=lambda o: -o.device_time_total)[:a.top]]
    # One eager step alone: its streams are the stores' own (the step's, the lane, the
    # prefetch's side stream, the books), where a replay's are the graph's.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(run, a.warmup + a.steps, 1)
        torch.cuda.synchronize()
    result["eager_timeline"] = timeline(prof)
    print(json.dumps(result, indent=1))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "step_profile.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
