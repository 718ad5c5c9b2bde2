"""Whether the captured main-job step waits for the host: steps/s of the demo's captured,
prefetching step with host ids (checked, staged in pinned memory and copied each step) against
the same replays fed with ids already on the GPU, and against replays of one batch; how long
the host took to queue them; and the host time of each piece (a step, a replay, the input
copies, the six uploads one by one and at once) with the GPU kept busy. Prints; run from the repository root:

    python3 bench/replay_host.py [--budget MiB] [--engine collection|module] [skip-gram shape arguments]
"""
import argparse
import sys
import time

import torch

sys.path.insert(0, "bench")
from _timing import host_while_busy  # noqa: E402
from _workloads import add_skipgram_shape, skipgram_corpus  # noqa: E402
from speedtorch_ops.demo.train import ENGINES  # noqa: E402
from speedtorch_ops.training.placement import upload, upload_all  # noqa: E402

p = argparse.ArgumentParser()
add_skipgram_shape(p)
p.add_argument("--budget", type=float, default=1200)
p.add_argument("--engine", choices=["collection", "module"], default="collection")
a = p.parse_args([] if len(sys.argv) < 2 else sys.argv[1:])
a.optimizer, a.lr, a.unfused = "adam", 0.05, False
a.cache_mb, a.graph, a.fused = 0, "on", True
dev = torch.device("cuda", 0)
corpus = skipgram_corpus(a)
batches = [corpus.batch(a.batch, a.negatives) for _ in range(100)]
run = ENGINES[a.engine](a, dev)
run.set_cache_mb(a.budget)
run.graphed = run.prefetching = True


def step(i):
    run.step(batches[i % 100], batches[(i + 1) % 100])


for i in range(30):
    step(i)
torch.cuda.synchronize()
gpu = [[torch.from_numpy(x).to(dev) for x in b] for b in batches]
cap = run._captured


def fast(i):
    """A replay whose inputs come from ids already on the GPU."""
    b, f = gpu[i % 100], gpu[(i + 1) % 100]
    for src, into in zip((*b, *f), cap._inputs):
        into.view(-1).copy_(src.view(-1), non_blocking=True)
    cap.graph.replay()


def timed(name, fn, n=100):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn(30 + i)
    q = time.perf_counter() - t
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    print(f"{name:>22}: {n / s:.1f} steps/s, host queued them in {q / n * 1e3:.2f} ms a step "
          f"(total {s / n * 1e3:.2f})", flush=True)


def replay(i):
    cap.graph.replay()


for r in range(2):
    timed("normal", step)
    timed("inputs on GPU", fast)
    timed("replay only (same ids)", replay)


def busy(name, fn):
    """Host time of fn with the GPU kept busy (nothing it queues can wait)."""
    ts = [host_while_busy(lambda: fn(i), sleep_cycles=20_000_000) for i in range(5)]
    print(f"host time of one {name}, GPU busy: " + ", ".join(f"{x * 1e3:.2f}" for x in ts)
          + " ms")


def copies(i):
    for src, into in zip((*gpu[i], *gpu[i + 1]), cap._inputs):
        into.view(-1).copy_(src.view(-1), non_blocking=True)


def uploads(i):
    for x in (*batches[i], *batches[i + 1]):
        upload(torch.from_numpy(x), dev)


def one_upload(i):
    upload_all([torch.from_numpy(x) for x in (*batches[i], *batches[i + 1])], dev)


busy("normal step", step)
busy("replay", replay)
busy("input copies", copies)
busy("6 uploads", uploads)
busy("upload of the 6 at once (a step's)", one_upload)
