"""The GPU work of a step from torch.profiler timelines (chrome traces, as `bench/sharded.py
--trace` writes them): each kernel's (and copy's, memset's) time and calls a step, the traces
side by side, the costliest first. A profiled CUDA graph's kernels run one after another, so
the total is a step's GPU work, not its length: compare the total with the step's unprofiled
time to see how long the GPU waits (for the host, for a peer).

    python bench/trace_kernels.py --steps 3 t-1-0-single.json.gz t-2-0-peer.json.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def short(name: str) -> str:
    """A kernel's name without its template arguments, parameters and namespaces."""
    name = name.replace("void ", "")
    for prefix in ("speedtorch_ops::kernels::(anonymous namespace)::",
                   "speedtorch_ops::kernels::", "at::native::", "(anonymous namespace)::",
                   "at_cuda_detail::"):
        name = name.replace(prefix, "")
    return re.sub(r"[<(].*", "", name)[:50]


def per_step(path: str, steps: int) -> tuple:
    """({kernel: microseconds a step}, {kernel: calls a step}) of one trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    time, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") in GPU:
            time[short(e["name"])] += e["dur"] / steps
            calls[short(e["name"])] += 1 / steps
    return time, calls


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--steps", type=int, default=3, help="the steps each trace holds")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    runs = {path: per_step(path, a.steps) for path in a.traces}
    names = sorted(set().union(*(t for t, _ in runs.values())),
                   key=lambda k: -max(t[k] for t, _ in runs.values()))
    labels = [re.sub(r"\.json(\.gz)?$", "", path.rsplit("/", 1)[-1]) for path in a.traces]
    print(f"{'GPU work a step: us (calls)':<50}" + "".join(f"{x:>22}" for x in labels))
    for k in names[:a.top]:
        print(f"{k:<50}" + "".join(f"{t[k]:>15.1f} ({c[k]:>4.0f})" for t, c in runs.values()))
    print(f"{'total':<50}" + "".join(f"{sum(t.values()):>15.1f} ({sum(c.values()):>4.0f})"
                                     for t, c in runs.values()))


if __name__ == "__main__":
    main()
