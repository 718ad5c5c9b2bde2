"""Where a demo step's time goes: the demo's training (speedtorch_ops.demo) at a given shape,
phase by phase (loads, compute, write-backs), as GPU time (CUDA events) and host time (what
Python and the host side of the ops take to queue the work), then torch.profiler's top ops.

    python3 bench/demo_profile.py --vocab 4000000 --dim 128 --batch 8192 --tokens 4000000
"""

import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from speedtorch_ops.demo import cli, corpus as demo_corpus, train as demo_train


def main() -> None:
    p = cli.parser()
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--measure", type=int, default=50)
    p.add_argument("--no-profiler", action="store_true")
    a = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    corpus = demo_corpus.Corpus(a.vocab, a.cluster_size, a.tokens)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(16)]
    run = demo_train.SwitcherTraining(a, device)
    # Each call gets the step number; a prefetch queues the next step's rows.
    calls = {"load": lambda i: run.load(*batches[i % len(batches)]),
             "prefetch": lambda i: run.prefetch(*batches[(i + 1) % len(batches)]),
             "compute": lambda i: run.compute(),
             "write_back": lambda i: run.write_back(*batches[i % len(batches)])}
    PHASES = [k for k in calls if k != "prefetch" or run.prefetching]
    for i in range(a.warmup):
        for phase in PHASES:
            calls[phase](i)
    torch.cuda.synchronize()

    gpu = {k: [] for k in PHASES}
    host = {k: [] for k in PHASES}
    events = []
    start = time.perf_counter()
    for i in range(a.measure):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        marks[0].record()
        for k, phase in enumerate(PHASES):
            t = time.perf_counter()
            calls[phase](i)
            host[phase].append((time.perf_counter() - t) * 1e3)
            marks[k + 1].record()
        events.append(marks)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 1e3 / a.measure
    for marks in events:
        for k, phase in enumerate(PHASES):  # the current stream's time (prefetches run beside)
            gpu[phase].append(marks[k].elapsed_time(marks[k + 1]))
    print(f"CPU threads {torch.get_num_threads()}; switching {a.switching}; transfer SMs "
          f"{a.transfer_sms or 'all'}")
    print(f"shape: vocab {a.vocab:,} dim {a.dim} batch {a.batch:,} negatives {a.negatives}; "
          f"{a.measure} steps; wall {step_ms:.2f} ms/step ({1e3 / step_ms:.1f} steps/s)")
    for phase in PHASES:
        print(f"  {phase:10s} GPU (between events) median {np.median(gpu[phase]):7.3f} ms   "
              f"host (queueing) median {np.median(host[phase]):7.3f} ms")
    sys.stdout.flush()
    if a.no_profiler:
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(10):
            for phase in PHASES:
                with torch.profiler.record_function(phase):
                    calls[phase](i)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
