"""Host ids fed as a training loop feeds them: batches of pinned host ids (as a DataLoader with
pin_memory=True hands them out), each step waited for (a loss read back every step), against
the same batches already on the GPU. One process, one collection, the feeds in rotation:

- gpu: the batches' ids and lengths on the GPU beforehand (bounds_check="prechecked");
- host: the pinned host batches straight into the collection;
- prefetcher: the pinned host batches through ``speedtorch_ops.Prefetcher``: each step()
  prepares the next batch (host checks, ids laid out and uploaded, rows prefetched) while the
  GPU computes.

The workload is dynamicemb's public benchmark shape (``bench/bdet.py``): --tables tables of
--cap rows x --dim 128 fp32, Adam, --ids-per-table ids a table a step (one a sample, no pooling),
PowerLaw(1.05) ids, every row in the GPU row cache unless --cache-gib says otherwise. A step:
forward, backward with a fixed output gradient, step(), loss.item(). Reported: the median wall
ms a step per feed, and each feed over gpu.

    python3 bench/host_feed.py [--tables 4] [--cap 1677721] [--rounds 5] [--steps 40]
                               [--json J] [--plot P]
"""

import argparse
import json
import statistics
import time

import torch

import speedtorch_ops as so
from bdet import power_law


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--cap", type=int, default=1677721)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ids-per-table", type=int, default=104857)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="timed steps a feed a round")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--cache-gib", type=float, default=None, help="default: every row")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the code")
    p.add_argument("--profile", help="a folder for chrome traces of the host feeds")
    p.add_argument("--json")
    p.add_argument("--plot")
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    keys = [f"t{k}" for k in range(a.tables)]
    row_bytes = 3 * a.dim * 4
    cache = int((a.cache_gib or a.tables * a.cap * row_bytes * 1.05 / 2**30) * 2**30)
    ebc = so.HostEmbeddingCollection(
        [so.TableConfig(k, a.cap, a.dim) for k in keys], optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.1}, device=dev, cache_bytes=cache if dev.type == "cuda" else 0,
        bounds_check="prechecked")
    lengths = torch.ones(a.tables * a.ids_per_table, dtype=torch.int64)
    host = [so.KeyedJaggedTensor.from_lengths_sync(
        keys, torch.cat([power_law(1, a.cap, 1.05, a.ids_per_table, "cpu") for _ in keys]),
        lengths) for _ in range(a.batches)]
    if dev.type == "cuda":
        host = [kjt.pin_memory() for kjt in host]
    gpu = [kjt.to(dev) for kjt in host]
    grads = [torch.randn(a.ids_per_table, a.dim, device=dev) for _ in keys]
    feeds = {"gpu": gpu, "host": host, "prefetcher": host}

    def loop(name, n, start):
        order = [feeds[name][(start + i) % a.batches] for i in range(n)]
        times, t = [], time.perf_counter()
        for kjt in so.Prefetcher(order, ebc) if name == "prefetcher" else order:
            out = ebc(kjt)
            torch.autograd.backward([out[k].values() for k in keys], grads)
            ebc.step()
            float(out[keys[0]].values()[0, 0].detach())  # the loop waits for each step
            now = time.perf_counter()  # a whole iteration, the loader's next() included
            times.append((now - t) * 1e3)
            t = now
        return times

    for name in feeds:
        loop(name, a.warmup, 0)
    runs = {name: [] for name in feeds}
    for r in range(a.rounds):
        for name in list(feeds)[r % 3:] + list(feeds)[:r % 3]:
            runs[name] += loop(name, a.steps, r)
    if a.profile:  # a few steps of the host feeds under torch.profiler: where the host waits
        from torch.profiler import ProfilerActivity, profile
        for name in ("gpu", "host", "prefetcher"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                loop(name, 6, 0)
            prof.export_chrome_trace(f"{a.profile}/host_feed-{name}.json")
            print(name, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    med = {name: statistics.median(t) for name, t in runs.items()}
    result = {"benchmark": "host ids fed each step, waited for", "date":
              time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
              "config": vars(a),
              "median_ms": med, "p90_ms": {n: sorted(t)[int(0.9 * len(t))]
                                           for n, t in runs.items()},
              "over_gpu": {n: med[n] / med["gpu"] for n in med}, "times_ms": runs}
    for n in feeds:
        print(f"{n:>11}: {med[n]:.3f} ms a step (p90 {result['p90_ms'][n]:.3f}), "
              f"{result['over_gpu'][n]:.2f}x the ids on the GPU")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.boxplot([runs[n] for n in feeds], showfliers=False)
        ax.set_xticks(range(1, len(feeds) + 1), list(feeds))
        ax.set_ylabel("ms a step (wall, waited for)")
        ax.set_title(f"{result['device']}: {a.tables} x {a.cap:,} x {a.dim}, Adam, "
                     f"{a.ids_per_table:,} ids a table", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
