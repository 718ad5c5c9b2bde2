"""Probe: where the host time of the demo's colocated/prefetch step goes. Wraps the functions a
step calls with wall-clock timers (no profiler) and prints the mean host milliseconds per step
of each, for the demo's training at a given shape.

    python3 bench/probes/prefetch_host.py --vocab 4000000 --dim 128 --batch 8192 \
        --tokens 4000000 --switching prefetch
"""

import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from speedtorch_ops import _rows, _switch, demo  # noqa: E402

totals = collections.defaultdict(float)


def timer(owner, name, label=None):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label or name] += time.perf_counter() - start
    setattr(owner, name, wrapped)


def main() -> None:
    p = demo.parser()
    p.add_argument("--measure", type=int, default=40)
    a = p.parse_args()
    device = torch.device(a.device)
    corpus = demo.Corpus(a.vocab, a.cluster_size, a.tokens)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(16)]
    run = demo.SwitcherTraining(a, device)
    for owner, names in ((_rows.SharedRows, ["load", "prefetch", "write_back", "_patch",
                                             "_gather", "_buffer", "_install"]),
                         (_switch, ["plan_for", "upload"]),
                         (_switch.Plan, ["check"]),
                         (torch.cuda.Stream, ["wait_event", "wait_stream", "record_event"]),
                         (run, ["compute"])):
        for name in names:
            timer(owner, name, f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")

    def step(i):
        run.step(batches[i % 16], batches[(i + 1) % 16])

    for i in range(10):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    totals.clear()
    start = time.perf_counter()
    for i in range(a.measure):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / a.measure
    print(f"switching {a.switching}: {wall:.2f} ms/step; host ms per step:")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<32} {seconds * 1e3 / a.measure:7.3f}")


if __name__ == "__main__":
    main()
