"""The row cache's policy on its own, on the CPU: the hit rate of CachedRows (LFU with aging,
admission against the coldest unused slot) on the demo's v table (contexts and word2vec
negatives of the Zipf corpus), against two fixed caches of the same size: the rows used most
in these very batches (an oracle that knows the future) and the rows most frequent in the
corpus (what a frequency-sorted warm start would hold). Only ids move (rows of one float), so
the full 4 M-row vocabulary fits on a laptop; the policy is the same tensor code as on a GPU.

With --prefetch, each step also prefetches the next batch (as HostEmbedding.prefetch does, after
the forward and before the commit), with no cache and with the cache: of the rows that cross
the host link per step, how many load ahead (off the step's critical path) and how many still
load in the step; and how many rows the prefetches loaded in all.

    python3 bench/cache_policy.py --slots 681338 --steps 190 600 --batches 120
    python3 bench/cache_policy.py --slots 681338 --steps 190 --prefetch
    python3 bench/cache_policy.py --slots 681338 --steps 190 600 --admission frequency always
"""

import argparse
import time

import numpy as np
import torch

from speedtorch_ops.demo.corpus import ZipfCorpus
from speedtorch_ops.training.cache import CachedRows, HostRows
from speedtorch_ops.training.plan import Plan


def v_ids(batch) -> np.ndarray:
    return np.concatenate([batch[1].ravel(), batch[2].ravel()])


def fixed_hit_rate(per_step, keep: np.ndarray) -> float:
    return sum(int(keep[u].sum()) for u in per_step) / sum(len(u) for u in per_step)


def simulate(store, batches, steps: int, warmup: int, prefetch: bool) -> list:
    """`steps` steps of the v table through `store` (each staging its batch, with `prefetch`
    prefetching the next, then committing, as the module does); the store's counts over the
    steps after `warmup`."""
    for i in range(steps):
        store.stage(Plan(v_ids(batches[i % len(batches)]), "cpu"))
        if prefetch:
            store.prefetch(Plan(v_ids(batches[(i + 1) % len(batches)]), "cpu"))
        store.commit()
        if i == warmup - 1:
            before = store.counters().clone()
    return (store.counters() - before).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=4_000_000)
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--negatives", type=int, default=5)
    p.add_argument("--slots", type=int, default=681_338, help="the v table's share of 1200 MiB")
    p.add_argument("--batches", type=int, default=120, help="distinct batches, cycled")
    p.add_argument("--steps", type=int, nargs="+", default=[190, 600])
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--aging", type=int, default=256)
    p.add_argument("--admission", nargs="+", choices=["frequency", "always"],
                   default=["frequency"], help="CachedRows' admission rule(s), one run each")
    p.add_argument("--prefetch", action="store_true",
                   help="also the prefetch's split of the loads (no cache and --slots)")
    a = p.parse_args()
    corpus = ZipfCorpus(a.vocab, 20, a.tokens)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(a.batches)]
    per_step = [np.unique(v_ids(b)) for b in batches]
    used = np.bincount(np.concatenate(per_step), minlength=a.vocab)
    oracle = np.zeros(a.vocab, dtype=bool)
    oracle[np.argsort(-used, kind="stable")[: a.slots]] = True
    by_count = np.zeros(a.vocab, dtype=bool)
    by_count[np.argsort(-corpus.counts, kind="stable")[: a.slots]] = True
    print(f"v table, {a.vocab:,} rows, {a.slots:,} slots, {a.batches} batches cycled: oracle "
          f"{fixed_hit_rate(per_step, oracle):.3f}, corpus-frequency cache "
          f"{fixed_hit_rate(per_step, by_count):.3f}")
    for admission in a.admission:
        for steps in a.steps:
            store = CachedRows(torch.zeros(a.vocab, 1, 1), torch.device("cpu"), a.slots,
                               aging_steps=a.aging, admission=admission)
            start = time.perf_counter()
            d = simulate(store, batches, steps, a.warmup, prefetch=False)
            print(f"LFU, admission {admission}, steps {a.warmup}-{steps}: hit rate "
                  f"{d[1] / d[0]:.3f}, evictions {d[3] / (steps - a.warmup):,.0f} and direct "
                  f"write-backs {d[4] / (steps - a.warmup):,.0f} per step "
                  f"({time.perf_counter() - start:.0f} s)")
    if a.prefetch:
        prefetch_split(a, batches)


def prefetch_split(a, batches) -> None:
    """Per step, with each step prefetching the next: distinct rows, hits, host loads (misses:
    of them loaded ahead, the rest in the step), rows the prefetches loaded (taken or not)."""
    steps = max(a.steps)
    table = torch.zeros(a.vocab, 1, 1)
    for slots in (0, a.slots):
        store = (CachedRows(table, torch.device("cpu"), slots, aging_steps=a.aging) if slots
                 else HostRows(table, torch.device("cpu")))
        d = [x / (steps - a.warmup) for x in simulate(store, batches, steps, a.warmup, True)]
        lookups, hits, loads, ahead, prefetched = d[0], d[1], d[2], d[5], d[6]
        print(f"prefetch, {'no cache' if not slots else f'{slots:,} slots'}, steps "
              f"{a.warmup}-{steps}, per step: {lookups:,.0f} distinct rows, {hits:,.0f} hits, "
              f"{loads:,.0f} host loads: {ahead:,.0f} ahead ({ahead / max(loads, 1):.3f}), "
              f"{loads - ahead:,.0f} in the step; {prefetched:,.0f} rows prefetched")

if __name__ == "__main__":
    main()
